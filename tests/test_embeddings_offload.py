"""Offloaded tables (gem_jax/embeddings/offload.py): rows in host memory, hot rows in a small HBM
cache. Training through the cache gives the in-HBM run's tables, on 1 and 8 fake CPU devices, with
many evictions; the checkpoint form moves between the two placements; the planner offloads what does
not fit; a cache too small for one batch is named."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from gem_jax.config import ConfigError, FeatureConfig, TableConfig
from gem_jax.embeddings import EmbeddingCollection, FeatureIds, RowWiseAdagrad, SparseSGD, plan_tables
from gem_jax.embeddings.host_cache import SlotCache
from tests.test_embeddings import LR, _batch, _step

STEPS = 6


def _mesh(devices: int):
    return jax.make_mesh(
        (devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:devices]
    )


def _collection(mesh, offload: bool, optimizer, cache_rows: int):
    """Two offloadable tables (hashed bags, a dense-id sequence) beside one that stays in HBM."""
    g = mesh.size

    def placed(**kw):
        if offload:
            return TableConfig(sharding="offload", **kw)
        return TableConfig(sharding="row_wise", **kw)

    tables = {
        "big": placed(rows=2048, dim=8, cache_rows=cache_rows * g),
        "dense": placed(rows=40, dim=8, hashed=False, cache_rows=5 * g if g > 1 else 24),
        "other": TableConfig(rows=24, dim=16, sharding="row_wise", initializer="uniform"),
    }
    features = {
        "bag_sum": FeatureConfig(table="big", pooling="sum", max_bag_size=4),
        "bag_mean": FeatureConfig(table="big", pooling="mean", max_bag_size=4),
        "seq": FeatureConfig(table="dense", pooling="none"),
        "other": FeatureConfig(table="other", pooling="sum", max_bag_size=2),
    }
    return EmbeddingCollection(tables, features, mesh, ("data",), optimizer=optimizer)


def _run(mesh, offload: bool, optimizer, cache_rows: int, batches):
    """STEPS lookup + update steps; returns (activations per step, final logical tables, stats)."""
    coll = _collection(mesh, offload, optimizer, cache_rows)
    state = coll.init(jax.random.key(3))
    rng = np.random.default_rng(0)
    weights = {
        k: rng.normal(size=s).astype(np.float32)
        for k, s in {
            "bag_sum": (mesh.size, 2, 5, 8),
            "bag_mean": (mesh.size, 2, 5, 8),
            "seq": (mesh.size, 2, 6, 8),
            "other": (mesh.size, 2, 5, 16),
        }.items()
    }
    step = _step(coll, batches[0], weights, LR)
    acts, stats = [], []
    for batch in batches:
        if offload:
            rows = {
                n: np.asarray(coll.table_rows(n, FeatureIds(*map(np.asarray, batch[n]))))
                for n in coll.offloaded_features()
            }
            state, slots, counts = coll.stage(state, rows)
            batch = {k: (slots.get(k, v), o) for k, (v, o) in batch.items()}
            stats.append(counts)
        state, a, _ = jax.block_until_ready(step(state, batch, weights))
        acts.append(jax.device_get(a))
    return acts, jax.device_get(coll.to_logical(state)), stats


@pytest.mark.parametrize(
    "devices,optimizer",
    [
        (1, RowWiseAdagrad(eps=1e-6)),
        pytest.param(1, SparseSGD(), marks=pytest.mark.slow),
        pytest.param(8, RowWiseAdagrad(eps=1e-6), marks=pytest.mark.slow),
    ],
)
def test_offload_trains_like_the_in_hbm_table(devices, optimizer):
    """Caches of 40 (1 device) or 8 x 24 slots for a 2048-row table: every step evicts, and the
    activations and final tables and accumulators equal the row_wise run's bit for bit (the step
    reads and writes each row exactly as it would in HBM; only where it lives differs)."""
    mesh = _mesh(devices)
    rng = np.random.default_rng(1)
    batches = [_batch(rng, devices) for _ in range(STEPS)]
    cache = 40 if devices == 1 else 24
    base_acts, base, _ = _run(mesh, False, optimizer, cache, batches)
    acts, tables, stats = _run(mesh, True, optimizer, cache, batches)
    evicted = sum(s["embeddings/big/device_to_host_bytes"] for s in stats)
    assert evicted > 0 and sum(s["embeddings/big/cache_hits"] for s in stats) > 0, stats
    for step, (a, b) in enumerate(zip(acts, base_acts, strict=True)):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"step {step} {k}")
    for name in base:
        for slot in base[name]:
            np.testing.assert_array_equal(tables[name][slot], base[name][slot], err_msg=f"{name} {slot}")


def test_logical_form_moves_between_offload_and_hbm():
    """A trained offloaded state's logical form restores onto row_wise (and back) unchanged; the
    offloaded side keeps every value in host memory and starts with an empty cache."""
    mesh = _mesh(8)
    rng = np.random.default_rng(2)
    batches = [_batch(rng, 8) for _ in range(2)]
    _, saved, _ = _run(mesh, True, RowWiseAdagrad(), 24, batches)
    hbm = _collection(mesh, False, RowWiseAdagrad(), 24)
    back = jax.device_get(hbm.to_logical(hbm.from_logical(saved)))
    off = _collection(mesh, True, RowWiseAdagrad(), 24)
    state = off.from_logical(back)
    assert not np.asarray(state["big"]["table"]).any(), "a restored cache should start empty"
    again = off.to_logical(state)
    for name in saved:
        for slot in saved[name]:
            np.testing.assert_array_equal(np.asarray(again[name][slot]), saved[name][slot])


def test_planner_offloads_what_does_not_fit_and_says_so():
    tables = {
        "huge": TableConfig(rows=1 << 20, dim=64),  # 260 MiB with its accumulator
        "small": TableConfig(rows=1024, dim=16),
    }
    plan = plan_tables(tables, {"data": 8}, ("data",), budget_bytes=16 << 20)
    huge = plan.placements["huge"]
    assert huge.sharding == "offload" and plan.placements["small"].sharding == "data_parallel"
    assert huge.cache_rows == (1 << 20) // 10 // 8 * 8 + 8  # cache_fraction 0.1, whole rows per device
    assert plan.bytes_per_device().max() <= 16 << 20
    text = plan.format()
    assert "does not fit" in text and "offload" in text and "rest in host memory" in text
    # A table that names its sharding is never moved to the host: the plan then fails.
    fixed = {**tables, "huge": TableConfig(rows=1 << 20, dim=64, sharding="row_wise")}
    with pytest.raises(ConfigError, match="over its"):
        plan_tables(fixed, {"data": 8}, ("data",), budget_bytes=16 << 20)


def test_bad_cache_sizes_are_named():
    with pytest.raises(
        ConfigError, match=r"embeddings.tables.t.cache_rows` = 12 must be a multiple of the 8"
    ):
        plan_tables({"t": TableConfig(rows=64, sharding="offload", cache_rows=12)}, {"data": 8}, ("data",))
    coll = _collection(_mesh(8), True, SparseSGD(), 1)  # one slot per device
    state = coll.init(jax.random.key(0))
    rows = {"bag_sum": np.arange(0, 2048, 16, dtype=np.int32)[None]}  # 16 distinct rows per device
    with pytest.raises(
        ValueError, match=r"16 distinct rows in one batch.*raise `embeddings.tables.big.cache_rows"
    ):
        coll.stage(state, rows)


def test_slot_cache_evicts_the_least_used_rows_outside_the_batch():
    cache = SlotCache(rows=10, slots=3)
    first = cache.place(np.array([1, 2, 3]), np.array([5, 1, 3]))
    assert sorted(first.fill_rows) == [1, 2, 3] and (first.evicted_rows == -1).all()
    again = cache.place(np.array([3, 7]), np.array([1, 1]))  # row 2 is the least used: out
    assert again.hits == 1 and list(again.fill_rows) == [7] and list(again.evicted_rows) == [2]
    assert again.fill_slots[0] == first.slots[1]
    nxt = cache.place(np.array([7, 8]), np.array([1, 1]))  # 7 stays (in the batch); 3 (uses 4) < 1 (5)
    assert list(nxt.evicted_rows) == [3]
    before = (cache.slot_of.copy(), cache.row_in.copy(), cache.uses.copy())
    dry = cache.place(np.array([0, 7]), np.array([1, 1]), commit=False)  # evaluation: nothing changes
    assert dry.hits == 1 and list(dry.fill_rows) == [0]
    for a, b in zip(before, (cache.slot_of, cache.row_in, cache.uses), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="4 distinct rows in one batch, over the 3 slots"):
        cache.place(np.array([0, 1, 2, 4]), np.ones(4, np.int64))


def test_slot_cache_samples_its_evictions_in_a_large_cache():
    """Past MIN_SAMPLE slots the victims come from a sample (sampled LFU): they are distinct, never the batch's
    own rows, and all less used than the cache's median row; every slot stays mapped both ways."""
    from gem_jax.embeddings import host_cache

    rows, slots = 200_000, 20_000
    cache = SlotCache(rows, slots)
    rng = np.random.default_rng(0)
    for _ in range(12):  # fill with rows of varied use counts
        batch = np.unique(rng.integers(0, rows, 3000))
        cache.place(batch, rng.integers(1, 50, len(batch)))
    assert cache.filled == (cache.row_in >= 0).sum() == slots
    batch = np.unique(rng.integers(0, rows, 2000))
    median_uses = np.median(cache.uses[cache.row_in])
    assert host_cache.SAMPLE_PER_EVICTION * 2000 < slots  # the sampled path, not a scan of every slot
    placed = cache.place(batch, np.ones(len(batch), np.int64))
    evicted = placed.evicted_rows
    assert len(np.unique(placed.fill_slots)) == len(placed.fill_slots) and (evicted >= 0).all()
    assert not np.isin(evicted, batch).any()
    assert cache.uses[evicted].max() < median_uses  # the least used eighth of a sample, all below the median
    np.testing.assert_array_equal(cache.slot_of[cache.row_in], np.arange(slots))
    assert (cache.slot_of[evicted] == -1).all()


def test_host_init_in_chunks_gives_the_whole_tables_values(monkeypatch):
    """An offloaded table is drawn a few blocks at a time on the device; each block of rows has its
    own key, so the chunks give the values of the whole table drawn at once (the in-HBM init), also
    with a last block cut short: equal up to float rounding (the two programs vectorise differently)."""
    import gem_jax.embeddings.collection as collection

    monkeypatch.setattr(collection, "INIT_BLOCK_ROWS", 64)
    monkeypatch.setattr(collection, "INIT_CHUNK_BYTES", 3 * 64 * 8 * 4)  # three blocks a chunk
    mesh = _mesh(1)
    tables = {"big": TableConfig(rows=2000, dim=8, sharding="offload", cache_rows=256)}
    features = {"bag": FeatureConfig(table="big", pooling="sum", max_bag_size=4)}
    coll = EmbeddingCollection(tables, features, mesh, ("data",), optimizer=RowWiseAdagrad())
    key = jax.random.key(5)
    coll.init(key)
    whole = jax.device_get(coll._init_table(key, "big"))
    host = coll.offload["big"]
    np.testing.assert_allclose(host.table, whole["table"], rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(host.accumulator, whole["accumulator"])
    assert len(np.unique(host.table[:, 0])) == 2000  # 32 blocks, no two drawn from one key


def test_exchange_writes_the_cache_in_place():
    """The cache is most of an offloaded table's HBM: the exchange must not copy it. One program that
    reads the evicted values and writes the new ones made XLA copy the whole cache (a 24 GiB OOM on the
    H200 at a 6 GiB cache); the write alone, donated, updates it in place."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from gem_jax.embeddings import offload

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    exchange = offload._exchange_fn(mesh, ("d",), True, True)
    rows, k = 1 << 16, 256
    cache = {
        "table": jax.ShapeDtypeStruct((rows, 128), jnp.float32),
        "accumulator": jax.ShapeDtypeStruct((rows,), jnp.float32),
    }
    slots = jax.ShapeDtypeStruct((1, k), jnp.int32)
    values = {
        "table": jax.ShapeDtypeStruct((1, k, 128), jnp.float32),
        "accumulator": jax.ShapeDtypeStruct((1, k), jnp.float32),
    }
    cache_bytes = rows * 129 * 4
    for program, args in ((exchange.read, (cache, slots)), (exchange.write, (cache, slots, values))):
        memory = program.lower(*args).compile().memory_analysis()
        assert memory.temp_size_in_bytes < cache_bytes / 8, (program, memory.temp_size_in_bytes)
    write = exchange.write.lower(cache, slots, values).compile().memory_analysis()
    assert write.alias_size_in_bytes >= cache_bytes  # donated: the new cache is the old one's buffer

    # and it exchanges: the old values come back, the new ones are in
    fresh = {
        "table": jnp.arange(rows * 128, dtype=jnp.float32).reshape(rows, 128),
        "accumulator": jnp.ones(rows),
    }
    at = jnp.array([[3, 7, rows + 5]], jnp.int32)  # the last: padding past the cache
    new_values = {"table": -jnp.ones((1, 3, 128)), "accumulator": jnp.full((1, 3), 9.0)}
    expected_old = np.asarray(fresh["table"][jnp.array([3, 7])])
    new, old = exchange(fresh, at, new_values)
    np.testing.assert_array_equal(np.asarray(old["table"][0, :2]), expected_old)
    np.testing.assert_array_equal(np.asarray(old["table"][0, 2]), 0)
    np.testing.assert_array_equal(np.asarray(new["table"][jnp.array([3, 7])]), -1)
    np.testing.assert_array_equal(np.asarray(new["accumulator"][jnp.array([3, 7, 8])]), [9, 9, 1])
