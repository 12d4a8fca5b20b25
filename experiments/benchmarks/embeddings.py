"""Benchmark of the sparse embeddings: `python -m experiments bench embeddings [--small] [options]`.

Workload: 16 tables x 4M rows x dim 128 fp32, batch 65536, one sum-pooled bag per table
per example, bag lengths uniform in [1, 40], ids Zipf(1.1) folded into the table (id mod rows).
The batch is split over all local devices (one shard_map shard each); tables follow the planner
(one device: data_parallel) unless `--sharding` names a type.

1. Correctness, on fresh random ids and two tables of the benchmark's size: pooled outputs, the
   updated rows and the row-wise Adagrad accumulators of `gem_jax.embeddings` against the dense jnp
   reference (gem_jax/embeddings/reference.py). A failure stops the benchmark (exit 1).
2. torch.nn.EmbeddingBag (mode="sum", sparse=True) + torch.optim.Adagrad (element-wise state: the
   usual PyTorch baseline) on the same ids, when torch is importable: forward, forward + backward +
   update. Run before ours so that torch's memory is freed (torch.cuda.empty_cache) before JAX
   allocates (XLA_PYTHON_CLIENT_PREALLOCATE=false).
3. Ours: forward (lookup) and the full step (lookup -> activation gradients -> sparse row-wise
   Adagrad), median of `--reps`, with the features' `max_bag_size = --max-bag` (bounded-bag pooling
   where a device owns the rows: a fused gather + masked sum); the forward again without the bound
   (gather + segment_sum scatter-add); on one device, a hand-written padded-bag forward in plain XLA.

4. With `--offload`: the same tables with sharding `offload` (host memory + an HBM cache of
   `--cache-fraction` of the rows): per step, the host stages the next batch's rows into the caches
   (LFU; gem_jax/embeddings/offload.py) and dispatches the step, over `--reps` fresh batches (after 5
   warm-up batches) so that rows miss and are evicted; reports ms per step (the host's staging
   included, as the train loop runs it: wall time over the steps), hit rate and host<->device bytes
   per step, beside the in-HBM step (one batch, repeated).

Bytes moved, the memory-traffic floor: forward reads every looked-up row (ids x dim x 4 B) and
writes the pooled bags; the step adds reading the bags' gradients and reading + writing every
touched (unique) row and its accumulator. Achieved TB/s = those bytes / measured time, against the
H200's measured 3.87 TB/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments.benchmarks.timing import median_seconds  # noqa: E402
from gem_jax.config import FeatureConfig, TableConfig  # noqa: E402
from gem_jax.embeddings import EmbeddingCollection, FeatureIds, RowWiseAdagrad  # noqa: E402
from gem_jax.embeddings import reference as ref  # noqa: E402
from gem_jax.embeddings.offload import host_device  # noqa: E402

HBM_TBPS = 3.87  # H200, measured (docs/benchmarks.md)
EPS = 1e-8


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments bench embeddings", description=__doc__)
    p.add_argument("--small", action="store_true", help="a CPU-sized run (seconds): 4 tables x 4096 x 16")
    p.add_argument("--tables", type=int, default=16)
    p.add_argument("--rows", type=int, default=4 * 1024 * 1024)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--max-bag", type=int, default=40)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sharding", default="auto", help="sharding type of every table (default: the planner's)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--offload", action="store_true", help="also time the tables offloaded (host + HBM cache)")
    p.add_argument(
        "--cache-fraction",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[0.25],
        help="--offload: cached share of each table (>= a batch's rows); comma-separated: one row each",
    )
    p.add_argument("--check-batch", type=int, default=4096, help="examples of the correctness check")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.small:
        a.tables, a.rows, a.dim, a.batch, a.reps, a.check_batch = 4, 4096, 16, 512, 3, 256
    return a


# ----------------------------------------------------------------------------- inputs


def make_ids(rng, num_tables, rows, batch, max_bag, zipf, devices):
    """Per table: values [G, cap] (cap = the longest device's id count, tail unused) and offsets
    [G, batch / G + 1]; each device holds batch / G examples."""
    per = batch // devices
    out = []
    for _ in range(num_tables):
        lengths = rng.integers(1, max_bag + 1, size=(devices, per))
        offsets = np.concatenate([np.zeros((devices, 1), np.int64), np.cumsum(lengths, 1)], 1)
        cap = int(offsets[:, -1].max())
        values = (rng.zipf(zipf, size=(devices, cap)) % rows).astype(np.int32)
        out.append((values, offsets.astype(np.int32)))
    return out


def _collection(num_tables, rows, dim, sharding, mesh, max_bag=0, cache_fraction=0.1):
    tables = {
        f"t{i:02d}": TableConfig(
            rows=rows, dim=dim, hashed=False, sharding=sharding, cache_fraction=cache_fraction
        )
        for i in range(num_tables)
    }
    features = {
        f"f{i:02d}": FeatureConfig(table=f"t{i:02d}", pooling="sum", max_bag_size=max_bag)
        for i in range(num_tables)
    }
    budget = None if jax.default_backend() != "cpu" else 8 << 30
    coll = EmbeddingCollection(
        tables, features, mesh, mesh.axis_names, optimizer=RowWiseAdagrad(eps=EPS), budget_bytes=budget
    )
    return coll, tables, features


def _jitted(coll, lr):
    """(forward, step) under shard_map over the batch axes; the step donates the state."""
    spec = P(coll.batch_axes)

    def local_forward(state, ids):
        acts, _ = coll.lookup(state, {f: FeatureIds(v[0], o[0]) for f, (v, o) in ids.items()})
        return {f: a[None] for f, a in acts.items()}

    def local_step(state, ids, cotangents):
        acts, res = coll.lookup(state, {f: FeatureIds(v[0], o[0]) for f, (v, o) in ids.items()})
        # The dense model's stand-in: loss = sum(acts * cotangent), so d loss / d acts = cotangent.
        loss, grads = jax.value_and_grad(lambda a: sum(jnp.vdot(a[f], cotangents[f][0]) for f in a))(acts)
        return coll.apply_gradients(state, res, grads, lr), jax.lax.psum(loss, coll.batch_axes)

    state_specs = coll.state_specs()
    forward = jax.jit(
        jax.shard_map(
            local_forward, mesh=coll.mesh, in_specs=(state_specs, spec), out_specs=spec, check_vma=False
        )
    )
    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=coll.mesh,
            in_specs=(state_specs, spec, spec),
            out_specs=(state_specs, P()),
            check_vma=False,
        ),
        donate_argnums=(0,),
    )
    return forward, step


def _batch_dict(ids):
    return {f"f{i:02d}": (jnp.asarray(v), jnp.asarray(o)) for i, (v, o) in enumerate(ids)}


# ----------------------------------------------------------------------------- 1. correctness


def check(a, mesh) -> bool:
    """Two benchmark-sized tables, fresh ids: ours against the dense reference."""
    rng = np.random.default_rng(a.seed + 1000)
    coll, tables, features = _collection(2, a.rows, a.dim, a.sharding, mesh, a.max_bag)
    ids = make_ids(rng, 2, a.rows, a.check_batch, a.max_bag, a.zipf, mesh.size)
    batch = _batch_dict(ids)
    forward, step = _jitted(coll, a.lr)
    state = coll.init(jax.random.key(a.seed + 1))
    logical0 = coll.to_logical(state)
    tables0 = {k: v["table"] for k, v in logical0.items()}
    accs0 = {k: v["accumulator"] for k, v in logical0.items()}
    acts = forward(state, batch)
    cot = {f: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)) for f, x in acts.items()}
    acts_ref = jax.jit(lambda t, b: ref.lookup(t, tables, features, b))(tables0, batch)
    state, _ = step(state, batch, cot)
    new_ref, accs_ref = jax.jit(
        lambda t, acc, b, g: ref.update(t, acc, tables, features, b, g, a.lr, eps=EPS)
    )(tables0, accs0, batch, cot)
    logical = coll.to_logical(state)
    errors = {}
    for f in features:
        errors[f"pooled {f}"] = _rel_err(acts[f], acts_ref[f])
    for t in tables:
        errors[f"rows {t}"] = _update_rel_err(logical[t]["table"], new_ref[t], tables0[t])
        errors[f"accumulator {t}"] = _rel_err(logical[t]["accumulator"], accs_ref[t])
    ok = all(e < 1e-5 for e in errors.values())
    print(f"correctness ({a.check_batch} examples, fresh ids, 2 tables of {a.rows:,} x {a.dim}): ", end="")
    print("OK" if ok else "FAILED", "  max relative error", f"{max(errors.values()):.2e}")
    if not ok:
        for k, e in errors.items():
            print(f"   {k}: {e:.2e}")
    return ok


def _rel_err(x, y) -> float:
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    return float(jnp.linalg.norm((x - y).ravel()) / jnp.maximum(jnp.linalg.norm(y.ravel()), 1e-30))


@jax.jit
def _squares(got, want, before):
    """(|got - want|^2, |want - before|^2), fused: no [rows, dim] temporary."""
    return jnp.sum(jnp.square(got - want)), jnp.sum(jnp.square(want - before))


def _update_rel_err(got, want, before, block: int = 1 << 20) -> float:
    """Relative error of an update (got - before against want - before), a block of rows at a time: on
    tables of billions of elements a whole-table difference would not fit beside the tables themselves."""
    num = den = 0.0
    for lo in range(0, got.shape[0], block):
        n, d = _squares(got[lo : lo + block], want[lo : lo + block], before[lo : lo + block])
        num, den = num + float(n), den + float(d)
    return (num / max(den, 1e-60)) ** 0.5


# ----------------------------------------------------------------------------- 2. torch


def bench_torch(a, ids) -> dict[str, float] | None:
    try:
        import torch  # optional dependency: the torch baseline, when installed
    except ImportError:
        print("torch not importable: skipping the torch baseline")
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    bags = [torch.nn.EmbeddingBag(a.rows, a.dim, mode="sum", sparse=True).to(device) for _ in range(a.tables)]
    inputs = []
    for values, offsets in ids:  # the whole batch, device chunks concatenated (same ids as ours)
        vals = np.concatenate([v[: o[-1]] for v, o in zip(values, offsets)])
        lengths = np.concatenate([np.diff(o) for o in offsets])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        inputs.append((torch.from_numpy(vals).long().to(device), torch.from_numpy(starts).long().to(device)))
    opt = torch.optim.Adagrad([p for b in bags for p in b.parameters()], lr=a.lr, eps=EPS)
    grads = [torch.randn(a.batch, a.dim, device=device) for _ in range(a.tables)]

    def forward():
        with torch.no_grad():
            return [b(v, offsets=o) for b, (v, o) in zip(bags, inputs)]

    def step():
        opt.zero_grad(set_to_none=True)
        outs = [b(v, offsets=o) for b, (v, o) in zip(bags, inputs)]
        torch.autograd.backward(outs, grads)
        opt.step()

    times = {}
    for name, fn in (("forward", forward), ("step", step)):
        for _ in range(2):
            fn()
        sync()
        samples = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        times[name] = float(np.median(samples))
    bags.clear()  # free the tables and optimizer state before JAX allocates
    inputs.clear()
    grads.clear()
    opt.state.clear()
    opt.param_groups.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return times


# ----------------------------------------------------------------------------- 3. ours


def bench_ours(a, mesh, ids) -> tuple[dict[str, float], str]:
    coll, _, _ = _collection(a.tables, a.rows, a.dim, a.sharding, mesh, a.max_bag)
    forward, step = _jitted(coll, a.lr)
    plain, _, _ = _collection(a.tables, a.rows, a.dim, a.sharding, mesh)  # same state, no bag bound
    forward_plain, _ = _jitted(plain, a.lr)
    batch = _batch_dict(ids)
    state = coll.init(jax.random.key(a.seed))
    rng = np.random.default_rng(a.seed + 7)
    per = a.batch // mesh.size
    cot = {f: jnp.asarray(rng.normal(size=(mesh.size, per, a.dim)).astype(np.float32)) for f in coll.features}
    times = {
        "forward": median_seconds(lambda: forward(state, batch), reps=a.reps, warmup=2),
        "forward, scatter-add pooling (no max_bag_size)": median_seconds(
            lambda: forward_plain(state, batch), reps=a.reps, warmup=2
        ),
    }
    samples = []
    for i in range(a.reps + 2):
        t0 = time.perf_counter()
        state, loss = jax.block_until_ready(step(state, batch, cot))
        if i >= 2:
            samples.append(time.perf_counter() - t0)
    times["step"] = float(np.median(samples))
    if mesh.size == 1:
        times["forward, XLA padded bags"] = _padded_forward(state, coll, ids, a)
    return times, coll.plan.format()


def _padded_forward(state, coll, ids, a) -> float:
    """Diagnostic: bags padded to --max-bag ids (padding reads row 0, masked), gather + sum."""
    padded = []
    for values, offsets in ids:
        v, o = values[0], offsets[0]
        lengths = np.diff(o)
        idx = o[:-1, None] + np.arange(a.max_bag)[None, :]
        mask = np.arange(a.max_bag)[None, :] < lengths[:, None]
        padded.append((jnp.asarray(np.where(mask, v[np.minimum(idx, len(v) - 1)], 0)), jnp.asarray(mask)))
    tables = [state[coll.features[f].table]["table"] for f in coll.features]

    @jax.jit
    def fwd(tables, padded):
        return [
            jnp.sum(jnp.where(m[..., None], jnp.take(t, i, axis=0), 0.0), axis=1)
            for t, (i, m) in zip(tables, padded)
        ]

    return median_seconds(lambda: fwd(tables, padded), reps=a.reps, warmup=2)


# ----------------------------------------------------------------------------- 4. offloaded


def bench_offload(a, mesh, cache_fraction: float, warmup: int = 5) -> tuple[float, dict[str, float], str]:
    """Seconds per step of the host's work (ids -> rows on the CPU, `stage`) + the step, over
    `--reps` fresh batches after `warmup` (the fill widths settle as the caches warm: each new width
    compiles the exchange once); the host dispatches ahead, so staging batch t + 1 overlaps step t.
    Also the cache counts summed over the timed steps."""
    coll, _, _ = _collection(a.tables, a.rows, a.dim, "offload", mesh, a.max_bag, cache_fraction)
    _, step = _jitted(coll, a.lr)
    state = coll.init(jax.random.key(a.seed))
    rng = np.random.default_rng(a.seed + 11)
    per = a.batch // mesh.size
    cot = {f: jnp.asarray(rng.normal(size=(mesh.size, per, a.dim)).astype(np.float32)) for f in coll.features}
    host = host_device()
    table_rows = jax.jit(lambda ids: {f: coll.table_rows(f, FeatureIds(v, o)) for f, (v, o) in ids.items()})
    batches = []
    for _ in range(warmup + a.reps):
        ids = make_ids(rng, a.tables, a.rows, a.batch, a.max_bag, a.zipf, mesh.size)
        cap = (
            per * a.max_bag
        )  # one shape for every batch (the tail past offsets[-1] is unused): no recompiles
        batches.append(_batch_dict([(np.pad(v, ((0, 0), (0, cap - v.shape[1]))), o) for v, o in ids]))
    counts: dict[str, float] = {}
    loss = t0 = None
    for i, batch in enumerate(batches):
        if i == warmup:
            jax.block_until_ready(loss)
            t0 = time.perf_counter()
        with jax.default_device(host):
            rows = jax.tree.map(np.asarray, table_rows(jax.device_put(batch, host)))
        state, slots, c = coll.stage(state, rows)
        batch = {f: (slots[f], o) for f, (_, o) in batch.items()}
        state, loss = step(state, batch, cot)
        if i >= warmup:
            for k, v in c.items():
                counts[k.split("/")[-1]] = counts.get(k.split("/")[-1], 0.0) + v
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / a.reps, counts, coll.plan.format()


# ----------------------------------------------------------------------------- report


def main(argv=None) -> int:
    a = _args(argv if argv is not None else sys.argv[1:])
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    if a.batch % mesh.size:
        print(f"--batch {a.batch} must divide over {mesh.size} devices", file=sys.stderr)
        return 2
    print(
        f"# embeddings: {a.tables} tables x {a.rows:,} rows x dim {a.dim} fp32, batch {a.batch:,}, bags of "
        f"1..{a.max_bag} ids, Zipf({a.zipf}); {mesh.size} x {devices[0].device_kind}, jax {jax.__version__}"
    )
    if not check(a, mesh):
        return 1
    rng = np.random.default_rng(a.seed)
    ids = make_ids(rng, a.tables, a.rows, a.batch, a.max_bag, a.zipf, mesh.size)
    n_ids = sum(int(o[:, -1].sum()) for _, o in ids)
    n_unique = sum(
        len(np.unique(np.concatenate([v[: o[-1]] for v, o in zip(vals, offs)]))) for vals, offs in ids
    )
    torch_times = None if a.no_torch else bench_torch(a, ids)
    ours, plan = bench_ours(a, mesh, ids)
    print(plan)
    row = a.dim * 4
    pooled = a.tables * a.batch * row
    moved = {
        "forward": n_ids * row + pooled,
        "step": n_ids * row + 2 * pooled + n_unique * (2 * row + 8),
    }
    print(f"\n{n_ids:,} ids looked up, {n_unique:,} distinct rows touched ({n_unique / n_ids:.1%})\n")
    print(
        "| what | ours (ms) | torch (ms) | torch / ours | bytes (GB, floor) | ours TB/s | floor at 3.87 TB/s (ms) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, t in ours.items():
        key = "forward" if name.startswith("forward") else "step"
        tt = (torch_times or {}).get(name)
        label = {"forward": "forward", "step": "forward + backward + row-wise Adagrad"}.get(name, name)
        print(
            f"| {label} | {t * 1e3:.2f} | {'-' if tt is None else f'{tt * 1e3:.2f}'} | "
            f"{'-' if tt is None else f'{tt / t:.1f}x'} | {moved[key] / 1e9:.3f} | {moved[key] / t / 1e12:.3f} | "
            f"{moved[key] / HBM_TBPS / 1e9:.3f} |"
        )
    if torch_times:
        print("\ntorch's step uses torch.optim.Adagrad (element-wise state) on sparse gradients.")
    if a.offload:
        print(f"\n## offloaded: {a.reps} fresh batches per cache fraction\n")
        rows = []
        for fraction in a.cache_fraction:
            try:
                seconds, counts, plan = bench_offload(a, mesh, fraction)
            except ValueError as e:  # a cache smaller than one batch's distinct rows
                print(f"--offload --cache-fraction {fraction}: {e}", file=sys.stderr)
                return 2
            print(plan, flush=True)
            hit_rate = counts["cache_hits"] / max(counts["cache_hits"] + counts["cache_misses"], 1)
            h2d, d2h = (counts[f"{way}_bytes"] / a.reps / 1e6 for way in ("host_to_device", "device_to_host"))
            rows.append(
                f"| {fraction:g} | {seconds * 1e3:.2f} | {ours['step'] * 1e3:.2f} | {seconds / ours['step']:.2f}x | "
                f"{hit_rate:.1%} | {h2d:.1f} | {d2h:.1f} |"
            )
        print("\nstage + forward + backward + row-wise Adagrad, offloaded, against the in-HBM step:\n")
        print(
            "| cache fraction | ms / step | in-HBM step (ms) | offload / in-HBM | hit rate | host->device MB/step "
            "| device->host MB/step |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
