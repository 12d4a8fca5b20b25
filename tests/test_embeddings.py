"""Sharded embeddings (gem_jax/embeddings/) against the dense single-device reference, on 8 fake
CPU devices: every sharding type, 1-D and 2-D meshes, duplicates, empty bags, hashed ids past the
table size, out-of-range dense ids, untouched rows; a toy training run per type; the compiled HLO
of a lookup + update moves no table-sized operand through an all-gather or all-reduce."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gem_jax.config import ConfigError, FeatureConfig, TableConfig, load_config
from gem_jax.embeddings import EmbeddingCollection, FeatureIds, RowWiseAdagrad, SparseSGD, plan_tables
from gem_jax.embeddings import reference as ref

TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "two_d")
MESHES = {"1d": ((8,), ("data",)), "2d": ((2, 4), ("dcn", "data"))}
PACKS, BAGS, CAP, SEQ = 2, 5, 16, 6
LR = 0.3  # per device: packs, bags per pack, id capacity, sequence capacity


def _mesh(kind):
    shape, axes = MESHES[kind]
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _specs(sharding: str, dtype: str = "float32"):
    tables = {
        "big": TableConfig(rows=64, dim=8, sharding=sharding, dtype=dtype),  # hashed
        "dense": TableConfig(rows=40, dim=8, hashed=False, sharding=sharding),  # ids outside [0, 40) skip
        "other": TableConfig(rows=24, dim=16, sharding=sharding, initializer="uniform"),
    }
    features = {
        # Bags hold <= 3 ids: "big" pools by the bounded path where a device owns the rows (and
        # "other", whose bound is too small, falls back to scatter-add).
        "bag_sum": FeatureConfig(table="big", pooling="sum", max_bag_size=4),
        "bag_mean": FeatureConfig(table="big", pooling="mean", max_bag_size=4),  # shares "big"
        "seq": FeatureConfig(table="dense", pooling="none"),
        "other": FeatureConfig(table="other", pooling="sum", max_bag_size=2),
    }
    return tables, features


def _batch(rng: np.random.Generator, devices: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """Global batch [devices, PACKS, ...]: Zipf-ish ids with duplicates, empty bags, unused capacity,
    raw ids far past the table sizes, and dense ids out of range."""
    lead = (devices, PACKS)

    def bags(high):
        lengths = rng.integers(0, 5, size=(*lead, BAGS))
        lengths[..., 1] = 0  # an empty bag in every pack
        lengths = np.minimum(lengths, CAP // BAGS)
        offsets = np.concatenate([np.zeros((*lead, 1), np.int64), np.cumsum(lengths, -1)], -1)
        values = np.minimum(rng.zipf(1.3, size=(*lead, CAP)), high).astype(np.int64)
        values[..., :3] = 7  # duplicates inside every pack (and across devices)
        values[..., 3] = 10**9 + rng.integers(0, 10**6, size=lead)  # hashed far past the table
        return values.astype(np.int32), offsets.astype(np.int32)

    seq = rng.integers(-3, 48, size=(*lead, SEQ)).astype(np.int32)  # some < 0 or >= 40: looked up as zeros
    seq_offsets = np.zeros((*lead, 2), np.int32)
    seq_offsets[..., 1] = rng.integers(2, SEQ + 1, size=lead)  # unused tail
    return {
        "bag_sum": bags(10**6),
        "bag_mean": bags(10**6),
        "seq": (seq, seq_offsets),
        "other": bags(5),  # few distinct ids: many duplicates
    }


def _loss(acts, weights):
    """A nonlinear function of the activations, so their gradients depend on them."""
    return sum(jnp.sum(jnp.sin(acts[k]) * weights[k]) for k in acts)


def _step(coll: EmbeddingCollection, batch, weights, lr):
    """lookup -> value_and_grad w.r.t. activations -> apply_gradients, under shard_map; returns the
    activations and their gradients (stacked over devices) and the new state."""
    axes = coll.batch_axes
    spec = P(axes)

    def local(state, ids, weights):
        ids = {k: FeatureIds(v[0], None if o is None else o[0]) for k, (v, o) in ids.items()}
        acts, res = coll.lookup(state, ids)
        w = {k: x[0] for k, x in weights.items()}
        grads = jax.grad(_loss)(acts, w)
        state = coll.apply_gradients(state, res, grads, lr)
        return state, jax.tree.map(lambda x: x[None], acts), jax.tree.map(lambda x: x[None], grads)

    ids_spec = {k: (spec, None if o is None else spec) for k, (v, o) in batch.items()}
    fn = jax.shard_map(
        local,
        mesh=coll.mesh,
        in_specs=(coll.state_specs(), ids_spec, spec),
        out_specs=(coll.state_specs(), spec, spec),
        check_vma=False,
    )
    return jax.jit(fn)


def _close(a, b, tol, what):
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol, err_msg=what
    )


def _assert_copies_identical(state):
    """Every device holding the same piece of an array (replicas: data_parallel everywhere, two_d
    across the slow axis, column_wise accumulators) holds identical values after the update."""
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        pieces = {}
        for shard in x.addressable_shards:
            key = tuple((i.start, i.stop) for i in shard.index)
            data = np.asarray(shard.data)
            if key in pieces:
                np.testing.assert_array_equal(data, pieces[key], err_msg=jax.tree_util.keystr(path))
            pieces[key] = data


@functools.cache
def _reference(dtype: str, optimizer: str):
    """The jitted dense reference (lookup, activation gradient, update, touched rows); it does not
    depend on the sharding type, so one compilation serves every case."""
    tables, features = _specs("auto", dtype)
    return (
        jax.jit(lambda t, b: ref.lookup(t, tables, features, b)),
        jax.jit(jax.grad(_loss)),
        jax.jit(
            lambda t, a, b, g: ref.update(t, a, tables, features, b, g, LR, optimizer=optimizer, eps=1e-6)
        ),
        jax.jit(lambda b: ref.touched_rows(tables, features, b)),
    )


# Row-wise Adagrad on every type and mesh; SGD shares all routing, so two cases cover its update.
CASES = [(s, m, "row_wise_adagrad") for s in TYPES for m in sorted(MESHES)]
CASES += [("row_wise", "2d", "sgd"), ("column_wise", "1d", "sgd"), ("two_d", "2d", "bfloat16")]


@pytest.mark.parametrize("sharding,mesh_kind,optimizer", CASES)
def test_matches_dense_reference(sharding, mesh_kind, optimizer):
    """`optimizer = "bfloat16"`: row-wise Adagrad with the hashed table stored in bf16."""
    mesh = _mesh(mesh_kind)
    dtype, optimizer = ("bfloat16", "row_wise_adagrad") if optimizer == "bfloat16" else ("float32", optimizer)
    tables, features = _specs(sharding, dtype)
    opt = (
        RowWiseAdagrad(eps=1e-6, initial_accumulator=0.1) if optimizer == "row_wise_adagrad" else SparseSGD()
    )
    coll = EmbeddingCollection(tables, features, mesh, mesh.axis_names, optimizer=opt)
    assert {p.sharding for p in coll.plan.placements.values()} == {sharding}
    rng = np.random.default_rng(hash((sharding, mesh_kind, optimizer)) % 2**32)
    batch = _batch(rng, mesh.size)
    state = coll.init(jax.random.key(0))
    logical0 = jax.device_get(coll.to_logical(state))
    tables0 = {k: v["table"] for k, v in logical0.items()}
    accs0 = {k: v["accumulator"] for k, v in logical0.items()} if opt.has_accumulator else None
    if opt.has_accumulator:
        for a in accs0.values():
            np.testing.assert_array_equal(a, np.float32(0.1))
    ref_lookup, ref_grad, ref_update, ref_touched = _reference(dtype, optimizer)
    acts_ref = ref_lookup(tables0, batch)
    weights = {k: rng.normal(size=x.shape).astype(np.float32) for k, x in acts_ref.items()}

    new_state, acts, grads = _step(coll, batch, weights, LR)(state, batch, weights)
    grads_ref = ref_grad(acts_ref, weights)
    for k in features:
        _close(acts[k], acts_ref[k], 1e-5, f"activations of {k}")
        _close(grads[k], grads_ref[k], 1e-5, f"activation gradients of {k}")
    new_tables_ref, new_accs_ref = ref_update(tables0, accs0, batch, grads_ref)
    _assert_copies_identical(new_state)
    logical = jax.device_get(coll.to_logical(new_state))
    touched = ref_touched(batch)
    for k in tables:
        # bf16 rows: the same fp32 update may round to a neighbouring bf16 value (one ulp, 2^-8 relative)
        _close(
            logical[k]["table"],
            new_tables_ref[k],
            1e-5 if dtype == "float32" else 1e-2,
            f"updated rows of {k}",
        )
        if opt.has_accumulator:
            _close(logical[k]["accumulator"], new_accs_ref[k], 1e-5, f"accumulator of {k}")
        untouched = ~np.asarray(touched[k])
        assert untouched.any() and np.asarray(touched[k]).any(), k
        np.testing.assert_array_equal(logical[k]["table"][untouched], tables0[k][untouched])
        assert not np.allclose(logical[k]["table"][~untouched], tables0[k][~untouched]), k


def test_bounded_bag_pooling_equals_scatter_add_and_falls_back_when_a_bag_is_longer():
    from gem_jax.embeddings import routing

    rng = np.random.default_rng(5)
    table = jnp.asarray(rng.normal(size=(50, 4)).astype(np.float32))
    lengths = np.array([0, 3, 1, 6, 0, 2])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cap = int(offsets[-1]) + 4  # unused tail
    rows = rng.integers(0, 60, size=cap)  # >= 50: no row
    rows[offsets[-1] :] = 50
    bags = np.minimum(np.searchsorted(offsets, np.arange(cap), side="right") - 1, len(lengths) - 1)
    spans = (jnp.asarray(offsets[:-1]), jnp.asarray(offsets[1:]))
    expected = np.zeros((len(lengths), 4), np.float32)
    for b in range(len(lengths)):
        for i in range(offsets[b], offsets[b + 1]):
            if rows[i] < 50:
                expected[b] += np.asarray(table[rows[i]])
    for max_bag in (0, 6, 8, 3):  # none, exact fit, loose, too small (falls back)
        pooled, _ = routing.row_sharded_lookup(
            table, jnp.asarray(rows), jnp.asarray(bags), len(lengths), (), True, spans, max_bag
        )
        np.testing.assert_allclose(pooled, expected, rtol=1e-6, atol=1e-6, err_msg=f"max_bag={max_bag}")
    bounded = routing._pool_bounded(table, jnp.asarray(np.minimum(rows, 50)), *spans, 3)
    assert not np.allclose(bounded[3], expected[3]), "the bounded path alone truncates a longer bag"


# ----------------------------------------------------------------------------- training


def _toy_data(steps: int, devices: int, batch: int, seed: int = 0):
    """Logistic regression over two pooled bags per example; labels from planted per-id weights."""
    rng = np.random.default_rng(seed)
    planted = {"users": rng.normal(size=1000), "ads": rng.normal(size=300)}
    out = {}
    score = np.zeros((steps, devices, batch))
    for name, high, longest in (("users", 1000, 4), ("ads", 300, 3)):
        lengths = rng.integers(1, longest + 1, size=(steps, devices, batch))
        offsets = np.concatenate([np.zeros((steps, devices, 1), np.int64), np.cumsum(lengths, -1)], -1)
        cap = batch * longest
        values = np.minimum(rng.zipf(1.2, size=(steps, devices, cap)), high) - 1
        bag = np.stack(
            [np.searchsorted(o, np.arange(cap), side="right") - 1 for o in offsets.reshape(-1, batch + 1)]
        )
        w = np.where(bag < batch, planted[name][values.reshape(-1, cap)], 0.0)
        np.add.at(score.reshape(-1, batch), (np.arange(bag.shape[0])[:, None], np.minimum(bag, batch - 1)), w)
        out[name] = (values.astype(np.int32), offsets.astype(np.int32))
    labels = (rng.random(score.shape) < 1 / (1 + np.exp(-2 * score))).astype(np.float32)
    return out, labels


def _train(sharding: str, mesh, data, labels, steps: int) -> np.ndarray:
    tables = {
        "users": TableConfig(rows=256, dim=8, sharding=sharding),
        "ads": TableConfig(rows=128, dim=8, sharding=sharding, initializer="zeros"),
    }
    features = {name: FeatureConfig(table=name, pooling="sum") for name in tables}
    coll = EmbeddingCollection(tables, features, mesh, mesh.axis_names, optimizer=RowWiseAdagrad())
    axes = coll.batch_axes
    spec = P(axes)
    count = float(labels[0].size)

    def local(state, w, ids, y):
        ids = {k: FeatureIds(v[0], o[0]) for k, (v, o) in ids.items()}
        acts, res = coll.lookup(state, ids)

        def loss_share(w, acts):  # this device's share of the global mean loss
            logits = (acts["users"] + acts["ads"]) @ w[:-1] + w[-1]
            return jnp.sum(jnp.logaddexp(0.0, logits) - y[0] * logits) / count

        loss, (gw, gacts) = jax.value_and_grad(loss_share, argnums=(0, 1))(w, acts)
        state = coll.apply_gradients(state, res, gacts, 0.1)
        return state, w - 0.5 * jax.lax.psum(gw, axes), jax.lax.psum(loss, axes)

    ids_spec = {k: (spec, spec) for k in data}
    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(coll.state_specs(), P(), ids_spec, spec),
            out_specs=(coll.state_specs(), P(), P()),
            check_vma=False,
        ),
        donate_argnums=(0,),
    )
    state, w = coll.init(jax.random.key(1)), jnp.zeros((9,), jnp.float32)
    losses = []
    for i in range(steps):
        batch = {k: (v[i], o[i]) for k, (v, o) in data.items()}
        # Synchronous steps: XLA:CPU runs the 8 fake devices' collectives on a shared thread pool, and
        # overlapping executions of the step can deadlock its rendezvous on a loaded 2-core machine.
        state, w, loss = jax.block_until_ready(step(state, w, batch, labels[i]))
        losses.append(loss)
    return np.asarray(jax.device_get(losses))


@pytest.mark.slow
def test_toy_training_reaches_the_data_parallel_loss():
    mesh = _mesh("2d")
    steps = 150
    data, labels = _toy_data(steps, mesh.size, batch=16)
    curves = {s: _train(s, mesh, data, labels, steps) for s in TYPES}
    base = curves["data_parallel"]
    assert base[-20:].mean() < 0.8 * base[:5].mean(), "the toy model does not learn"
    for s, curve in curves.items():
        np.testing.assert_allclose(curve[-20:].mean(), base[-20:].mean(), atol=2e-3, err_msg=s)
        np.testing.assert_allclose(curve, base, atol=2e-2, err_msg=s)


# ----------------------------------------------------------------------------- compiled HLO

_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|all-to-all)(?:-start)?\(")
_SHAPE = re.compile(r"[a-z0-9]+\[([\d,]*)\]")


def test_no_table_sized_all_gather_or_all_reduce():
    """Compiles lookup + update for large tables of every type on 2 x 4 devices and reads the HLO:
    every all-gather and all-reduce result is batch-sized, far below one table (or one shard)."""
    mesh = _mesh("2d")
    rows, dim = 32768, 16
    tables = {
        s: TableConfig(rows=rows, dim=dim, sharding=s)
        for s in ("row_wise", "column_wise", "two_d", "data_parallel")
    }
    tables |= {f"tw{i}": TableConfig(rows=rows, dim=dim, sharding="table_wise") for i in range(2)}
    features = {f"f_{name}": FeatureConfig(table=name, pooling="mean") for name in tables}
    coll = EmbeddingCollection(tables, features, mesh, mesh.axis_names)
    spec = P(coll.batch_axes)
    cap, bags = 32, 8

    def local(state, values, offsets):
        ids = {f: FeatureIds(values[0], offsets[0]) for f in features}
        acts, res = coll.lookup(state, ids)
        return coll.apply_gradients(state, res, acts, 0.1)

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(coll.state_specs(), spec, spec),
            out_specs=coll.state_specs(),
            check_vma=False,
        ),
        donate_argnums=(0,),
    )
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(coll.init, jax.random.key(0)),
        coll.state_shardings(),
    )
    values = jax.ShapeDtypeStruct((mesh.size, 2, cap), jnp.int32)
    offsets = jax.ShapeDtypeStruct((mesh.size, 2, bags + 1), jnp.int32)
    hlo = fn.lower(abstract_state, values, offsets).compile().as_text()
    sizes = {"all-gather": [], "all-reduce": [], "all-to-all": []}
    for shapes, op in _COLLECTIVE.findall(hlo):
        for dims in _SHAPE.findall(shapes):
            sizes[op].append(math.prod(int(d) for d in dims.split(",") if d))
    assert sizes["all-to-all"], "no all-to-all: ids were not routed"
    assert sizes["all-gather"], "no all-gather found: the HLO pattern no longer matches"
    shard = rows * dim // mesh.size  # the smallest piece of a sharded table on one device
    for op in ("all-gather", "all-reduce"):
        assert max(sizes[op], default=0) < shard // 4, (op, max(sizes[op]), shard)


# ----------------------------------------------------------------------------- planner + checkpoint


def test_planner_rules_and_printed_plan():
    mb = 1 << 20
    tables = {
        "tiny": TableConfig(rows=100, dim=8),  # 6 KiB: data_parallel
        "big": TableConfig(rows=1 << 16, dim=64),  # 17 MiB: two_d on 2 x 4, row_wise on 8
        "odd": TableConfig(rows=100_003, dim=16),  # rows divide nothing: table_wise
        "odd2": TableConfig(rows=50_001, dim=16),
        "forced": TableConfig(rows=64, dim=8, sharding="column_wise"),
    }
    plan = plan_tables(tables, {"dcn": 2, "data": 4}, ("dcn", "data"), budget_bytes=1 << 30)
    kinds = {n: p.sharding for n, p in plan.placements.items()}
    assert kinds == {
        "tiny": "data_parallel",
        "big": "two_d",
        "odd": "table_wise",
        "odd2": "table_wise",
        "forced": "column_wise",
    }
    assert plan.placements["odd"].owner != plan.placements["odd2"].owner  # balanced
    assert plan.placements["big"].bytes_per_device == plan.placements["big"].bytes // 4
    text = plan.format()
    assert "| table | rows | dim" in text and all(f"| {n} |" in text for n in tables)
    flat = plan_tables(tables, {"data": 8}, ("data",), budget_bytes=1 << 30)
    assert flat.placements["big"].sharding == "row_wise"
    one = plan_tables(tables, {"data": 1}, ("data",), budget_bytes=1 << 30)
    assert {p.sharding for n, p in one.placements.items() if n != "forced"} == {"data_parallel"}
    with pytest.raises(ConfigError, match="odd.*divisible"):
        plan_tables({"odd": TableConfig(rows=9, dim=8, sharding="row_wise")}, {"data": 8}, ("data",))
    with pytest.raises(ConfigError, match="budget"):
        plan_tables({"huge": TableConfig(rows=1 << 20, dim=64)}, {"data": 8}, ("data",), budget_bytes=mb)


def test_checkpoint_on_4_devices_restores_on_8_with_another_plan(tmp_path):
    import orbax.checkpoint as ocp

    tables, features = _specs("auto")
    mesh4 = jax.make_mesh(
        (4,), ("data",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    before = {"big": "row_wise", "dense": "table_wise", "other": "table_wise"}
    after = {"big": "two_d", "dense": "column_wise", "other": "table_wise"}
    coll4 = EmbeddingCollection(
        {n: TableConfig(**{**t.__dict__, "sharding": before[n]}) for n, t in tables.items()},
        features,
        mesh4,
        ("data",),
    )
    state = coll4.init(jax.random.key(3))
    saved = coll4.to_logical(state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "emb", saved)
    mesh8 = _mesh("2d")
    coll8 = EmbeddingCollection(
        {n: TableConfig(**{**t.__dict__, "sharding": after[n]}) for n, t in tables.items()},
        features,
        mesh8,
        mesh8.axis_names,
    )
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), saved, coll8.logical_shardings()
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = coll8.from_logical(ckpt.restore(tmp_path / "emb", target))
    assert restored["big"]["table"].sharding.spec == P("data", None)
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(coll8.to_logical(restored)), jax.device_get(saved)
    )


def test_config_describes_default_tables_and_named_ones(tmp_path):
    e = load_config(None).embeddings
    assert {n: (t.rows, t.dim) for n, t in e.resolved_tables().items()} == {
        "items": (e.item_rows, e.dim),
        "actions": (e.action_rows, e.dim),
        "sparse": (e.sparse_rows, e.dim),
    }
    assert {n: f.pooling for n, f in e.resolved_features().items()} == {
        "items": "none",
        "actions": "none",
        "sparse": e.pooling,
    }
    path = tmp_path / "emb.toml"
    path.write_text(
        '[embeddings.tables.users]\nrows = 1024\ndim = 16\nsharding = "row_wise"\n'
        '[embeddings.features.user_bag]\ntable = "users"\npooling = "mean"\n'
    )
    config = load_config(path, ["embeddings.tables.users.dtype=bfloat16"])
    assert config.embeddings.tables["users"] == TableConfig(
        rows=1024, dim=16, dtype="bfloat16", sharding="row_wise"
    )
    for override, message in (
        ("embeddings.tables.users.rows=x", "`embeddings.tables.users.rows` must be an integer"),
        ("embeddings.tables.users.colour=1", "unknown key `embeddings.tables.users.colour`"),
        ("embeddings.tables.users.sharding=diagonal", "`embeddings.tables.users.sharding` must be one of"),
        ("embeddings.features.user_bag.table=nope", "`embeddings.features.user_bag.table` is 'nope'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            load_config(path, [override])
        assert str(path) in str(err.value)
