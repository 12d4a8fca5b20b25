"""Benchmark of jagged attention on one accelerator: `python -m experiments bench attention`.

Checks the Pallas kernel against the float32 reference on fresh random inputs first, then times forward
and backward (median of many reps after warm-up) for the issue's shapes, against the padded XLA reference
and, for softmax, cuDNN. TFLOP/s use the peer's formula (DESIGN.md): forward = sum_b 2 H (Dqk + Dv) L_b^2 / 2,
backward = 2.5 x forward; backward times exclude the forward pass (residuals are computed once before timing);
"useful" means the same count whatever the implementation computes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import median_seconds
from pallas_kernels.jagged_attention import jagged_attention
from pallas_kernels.jagged_attention.block_sizes import BlockSizes


def _lengths(kind: str, b: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":  # the mix: uniform in [0.9 N, N)
        return rng.integers(int(0.9 * n), n, size=b)
    if kind == "lognormal":  # heavy tail: median ~ N/16, clipped to [1, N]
        return np.clip(rng.lognormal(np.log(n / 16), 1.0, size=b), 1, n).astype(np.int64)
    if kind == "equal":
        return np.full(b, n)
    raise ValueError(f"unknown length mix {kind!r}")


def _inputs(lengths, h, d, rng, dtype=jnp.bfloat16):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(offsets[-1])
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 4)
    q, k, v, do = (jax.random.normal(key, (t, h, d), jnp.float32).astype(dtype) for key in keys)
    return q, k, v, do, jnp.asarray(offsets)


def fwd_flops(lengths, h, dqk, dv) -> float:
    return float(sum(2 * h * (dqk + dv) * int(l) ** 2 / 2 for l in lengths))


def _time(fn, *args, reps: int) -> float:
    return median_seconds(fn, *args, reps=reps, warmup=3)


def _kernel_impl() -> str:
    return "interpret" if jax.default_backend() == "cpu" else "pallas"


def _fwd_bwd(impl, n, activation, block_sizes=None, **kw):
    kwargs = dict(max_seq_len=n, activation=activation, implementation=impl, **kw)
    if block_sizes is not None:
        from pallas_kernels.jagged_attention import gpu

        opts = dict(dict(timestamps=None, pos_bias=None, time_bias=None), **kw)
        f = lambda q, k, v, off: gpu.jagged_attention_gpu(
            q,
            k,
            v,
            off,
            alpha=None,
            num_targets=None,
            max_attn_len=0,
            block_sizes=block_sizes,
            max_seq_len=n,
            activation=activation,
            interpret=impl == "interpret",
            **opts,
        )
    else:
        f = functools.partial(jagged_attention, **kwargs)
    fwd = jax.jit(f)

    @jax.jit
    def residuals(q, k, v, off):
        return jax.vjp(lambda q, k, v: f(q, k, v, off), q, k, v)[1]

    pullback = jax.jit(lambda vjp, do: vjp(do))
    return fwd, (residuals, pullback)


def _time_bwd(bwd, q, k, v, off, do, reps):
    """Median seconds of the backward pass alone (residuals computed once, outside the timed region)."""
    residuals, pullback = bwd
    vjp = jax.block_until_ready(residuals(q, k, v, off))
    return _time(pullback, vjp, do, reps=reps)


def check(rng, h=4, d=128, n=512, b=24, bias_only=False) -> list[str]:
    """Rel. L2 errors of the Pallas kernel vs the float32 reference (bf16 inputs), forward and grads."""
    rows = []
    lengths = np.concatenate([[0, 1, n, n - 1], rng.integers(1, n, size=b - 4)])
    for activation in ("silu", "softmax"):
        for extras in ({"targets": True},) if bias_only else ({}, {"targets": True}):
            q, k, v, do, off = _inputs(lengths, h, d, rng)
            kw = {}
            if extras:
                kw = dict(
                    num_targets=jnp.asarray(rng.integers(0, 5, size=b), jnp.int32),
                    max_attn_len=100,
                    timestamps=jnp.asarray(np.sort(rng.integers(0, 10**7, size=q.shape[0])), jnp.int32),
                    pos_bias=jnp.asarray(rng.standard_normal((h, 256)) * 0.3, jnp.float32),
                    time_bias=jnp.asarray(rng.standard_normal((h, 64)) * 0.3, jnp.float32),
                )

            def loss(q, k, v, pb, tb, impl):
                kk = dict(kw, pos_bias=pb, time_bias=tb) if kw else {}
                o = jagged_attention(
                    q, k, v, off, max_seq_len=n, activation=activation, implementation=impl, **kk
                )
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

            pb, tb = kw.get("pos_bias"), kw.get("time_bias")
            argn = (0, 1, 2, 3, 4) if kw else (0, 1, 2)
            got = jax.jit(jax.grad(loss, argnums=argn, has_aux=True), static_argnums=5)(
                q, k, v, pb, tb, _kernel_impl()
            )
            f32 = lambda x: None if x is None else x.astype(jnp.float32)
            want = jax.jit(jax.grad(loss, argnums=argn, has_aux=True), static_argnums=5)(
                f32(q), f32(k), f32(v), pb, tb, "reference"
            )
            names = ["out", "dq", "dk", "dv", "dpos", "dtime"]
            vals = [got[1]] + list(got[0])
            refs = [want[1]] + list(want[0])
            errs = []
            for name, a, r in zip(names, vals, refs):
                a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
                e = np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30)
                errs.append(f"{name}={e:.1e}" + ("" if np.isfinite(a).all() else "(NaN!)"))
            rows.append(
                f"check {activation:7s} {'targets+window+bias' if kw else 'plain':20s} " + " ".join(errs)
            )
            print(rows[-1], flush=True)
    return rows


def bench_case(
    name,
    lengths,
    h,
    d,
    activation,
    rng,
    reps,
    with_ref=True,
    ref_batch=None,
    block_sizes=None,
    num_pos=0,
    num_time=0,
):
    n = int(max(lengths))
    n = 1 << (n - 1).bit_length() if n not in (1024, 4096) else n
    q, k, v, do, off = _inputs(lengths, h, d, rng)
    flops = fwd_flops(lengths, h, d, d)
    out = []
    kw = {}
    if num_time:  # sorted timestamps, ~ one event per minute
        kw["timestamps"] = jnp.asarray(np.cumsum(rng.integers(1, 120, size=q.shape[0])), jnp.int32)
        kw["time_bias"] = jnp.asarray(rng.standard_normal((h, num_time)) * 0.1, jnp.float32)
    if num_pos:
        kw["pos_bias"] = jnp.asarray(rng.standard_normal((h, num_pos)) * 0.1, jnp.float32)
    fwd, bwd = _fwd_bwd(_kernel_impl(), n, activation, block_sizes, **kw)
    tf = _time(fwd, q, k, v, off, reps=reps)
    tb = _time_bwd(bwd, q, k, v, off, do, reps=reps)
    out.append((name, "pallas (ours)", flops / tf / 1e12, 2.5 * flops / tb / 1e12, tf * 1e3, tb * 1e3))
    del fwd, bwd
    if with_ref:  # padded reference; memory B*H*N^2*4 bytes, so maybe on a sub-batch
        sub = lengths if ref_batch is None else lengths[:ref_batch]
        q2, k2, v2, do2, off2 = _inputs(sub, h, d, rng)
        fl2 = fwd_flops(sub, h, d, d)
        fwd, bwd = _fwd_bwd("reference", n, activation)
        tf = _time(fwd, q2, k2, v2, off2, reps=max(3, reps // 4))
        tb = _time_bwd(bwd, q2, k2, v2, off2, do2, reps=max(3, reps // 4))
        out.append(
            (
                name,
                f"padded XLA ref (B={len(sub)})",
                fl2 / tf / 1e12,
                2.5 * fl2 / tb / 1e12,
                tf * 1e3,
                tb * 1e3,
            )
        )
    return out


def bench_cudnn(b, t, h, d, rng, reps):
    """Dense causal softmax, equal lengths: cuDNN vs ours on the same tokens."""
    lengths = np.full(b, t)
    rows = bench_case(f"softmax equal B={b} T={t} H={h}", lengths, h, d, "softmax", rng, reps, with_ref=False)
    x = [jnp.asarray(rng.standard_normal((b, t, h, d), dtype=np.float32), jnp.bfloat16) for _ in range(4)]
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))

    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    vjp = jax.block_until_ready(jax.jit(lambda q, k, v: jax.vjp(cudnn, q, k, v)[1])(*x[:3]))
    pullback = jax.jit(lambda vjp, do: vjp(do))
    flops = fwd_flops(lengths, h, d, d)
    tf = _time(f, *x[:3], reps=reps)
    tb = _time(pullback, vjp, x[3], reps=reps)
    rows.append(
        (rows[0][0], "cuDNN dense causal", flops / tf / 1e12, 2.5 * flops / tb / 1e12, tf * 1e3, tb * 1e3)
    )
    return rows


@contextlib.contextmanager
def _relaxed_atomics():
    """Lowers Pallas-Triton atomics with relaxed instead of acquire-release ordering (a jax internal: probe)."""
    from jax._src.pallas.triton import lowering as tl

    orig = getattr(tl, "_atomic_rmw", None)
    if orig is None:
        print("relaxed atomics: jax has no lowering._atomic_rmw, measuring the default", flush=True)
        yield
        return
    tl._atomic_rmw = lambda *a, **k: orig(*a, **dict(k, semantic=tl.tt_dialect.MemSemantic.RELAXED))
    jax.clear_caches()  # lowering happens once per trace: drop cached ones
    try:
        yield
    finally:
        tl._atomic_rmw = orig
        jax.clear_caches()


@contextlib.contextmanager
def _switch(name: str, value, on: bool = True):
    """Sets a module-level switch of the GPU kernels (read at trace time) for one case."""
    from pallas_kernels.jagged_attention import gpu

    if not on:
        yield
        return
    saved = getattr(gpu, name)
    setattr(gpu, name, value)
    jax.clear_caches()  # no cached trace of the other setting may be reused
    try:
        yield
    finally:
        setattr(gpu, name, saved)
        jax.clear_caches()


def _pos_gather(on: bool):
    """The GPU kernels' per-cell position-bias gather instead of block loads of the expanded table."""
    return _switch("POS_EXPANDED", False, on)


def bench_bias(rng, reps, h, d, variants, n=1024, b=512):
    """The gem_h200 bias setting (128 position + 64 time buckets), the 1024-bucket case, and no bias, N=1024."""
    cases = [
        ("no bias", {}),
        ("pos 128 + time 64 (gem_h200)", dict(num_pos=128, num_time=64)),
        ("pos 1024 + time 64", dict(num_pos=1024, num_time=64)),
    ]
    if (
        variants
    ):  # attribution: each bias alone, other tiles, relaxed ordering of the position-gradient atomics
        both = dict(num_pos=128, num_time=64)
        cases += [
            ("pos 128 only", dict(num_pos=128)),
            ("time 64 only", dict(num_time=64)),
            (
                "pos 128 + time 64, block_k 32",
                dict(both, block_sizes=BlockSizes(block_k=32, block_q_dkv=64, block_k_dkv=128, num_stages=2)),
            ),
            ("pos 128 + time 64, relaxed atomics", dict(both, relaxed=True)),
            ("pos 128 only, per-cell position gather", dict(num_pos=128, gather=True)),
            ("no bias, forward SiLU in float32", dict(silu_f32=True)),
        ]
    rows = []
    for name, kw in cases:
        kw = dict(kw)
        relaxed = kw.pop("relaxed", False)
        gather = kw.pop("gather", False)
        silu_f32 = kw.pop("silu_f32", False)
        try:
            with (
                _relaxed_atomics() if relaxed else contextlib.nullcontext(),
                _pos_gather(gather),
                _switch("SILU_BF16X2", False, silu_f32),
            ):
                r = bench_case(
                    f"silu uniform N={n} B={b} {name}",
                    _lengths("uniform", b, n, rng),
                    h,
                    d,
                    "silu",
                    rng,
                    reps,
                    with_ref=False,
                    **kw,
                )
        except Exception as e:  # one failing variant (e.g. shared memory) must not hide the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        print(r[0], flush=True)
        rows += r
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments bench attention", description=__doc__)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small shapes (smoke test, e.g. on CPU)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs at N=1024")
    p.add_argument(
        "--bias-only",
        action="store_true",
        help="check, then only the relative-bias cases at N=1024 (and the same shape without bias)",
    )
    p.add_argument(
        "--bias-variants",
        action="store_true",
        help="with --bias-only: also time pos-only, time-only, other tiles and relaxed atomics",
    )
    p.add_argument(
        "--write", default="", help="append the markdown table to this file (e.g. docs/benchmarks.md)"
    )
    args = p.parse_args(argv)
    rng = np.random.default_rng(int(time.time()))
    device = jax.devices()[0].device_kind
    print(f"device={device} jax={jax.__version__}", flush=True)
    try:
        checks = (
            []
            if args.no_check
            else check(rng, n=64 if args.quick else 512, b=8 if args.quick else 24, bias_only=args.bias_only)
        )
    except Exception as e:
        if not args.bias_only:
            raise
        checks = [f"check FAILED {type(e).__name__}: {str(e)[:2000]}"]  # still time what compiles
        print(checks[0], flush=True)
    h, d = 4, 128
    rows = []
    if args.bias_only:
        rows += bench_bias(rng, args.reps, h, d, args.bias_variants, *((128, 4) if args.quick else ()))
    elif args.quick:
        rows += bench_case(
            "silu uniform N=128 B=8", _lengths("uniform", 8, 128, rng), 2, 64, "silu", rng, args.reps
        )
    else:
        if args.sweep:
            for bs in (
                BlockSizes(),
                BlockSizes(block_k=128),
                BlockSizes(num_warps=4),
                BlockSizes(block_q=64, block_k=64, num_warps=4, num_warps_bwd=4),
                BlockSizes(num_stages=4, block_k=32, num_warps_bwd=4),
                BlockSizes(block_q_dkv=64, block_k_dkv=64, num_stages_bwd=3),
                BlockSizes(block_q_dkv=64, block_k_dkv=128, num_stages_bwd=3),
                BlockSizes(block_q_dkv=128, block_k_dkv=128, num_stages_bwd=1),
            ):
                r = bench_case(
                    f"sweep {bs}",
                    _lengths("uniform", 512, 1024, rng),
                    h,
                    d,
                    "silu",
                    rng,
                    10,
                    with_ref=False,
                    block_sizes=bs,
                )
                print(f"{r[0][0]}: fwd {r[0][2]:.0f} bwd {r[0][3]:.0f} TFLOP/s", flush=True)
        for n in (1024, 4096):
            rows += bench_case(
                f"silu uniform N={n} B=512",
                _lengths("uniform", 512, n, rng),
                h,
                d,
                "silu",
                rng,
                args.reps,
                ref_batch=None if n == 1024 else 32,
            )
            for r in rows[-2:]:
                print(r, flush=True)
        ln = _lengths("lognormal", 2048, 4096, rng)
        rows += bench_case(
            f"silu lognormal N=4096 B=2048 (pad {1 - ln.sum() / (2048 * 4096):.0%})",
            ln,
            h,
            d,
            "silu",
            rng,
            args.reps,
            ref_batch=32,
        )
        rows += bench_case(
            "silu uniform N=1024 B=512 + pos/time bias",
            _lengths("uniform", 512, 1024, rng),
            h,
            d,
            "silu",
            rng,
            args.reps,
            with_ref=False,
            num_pos=1024,
            num_time=64,
        )
        rows += bench_case(
            "silu uniform N=1024 B=512 + pos 128 / time 64 bias (gem_h200)",
            _lengths("uniform", 512, 1024, rng),
            h,
            d,
            "silu",
            rng,
            args.reps,
            with_ref=False,
            num_pos=128,
            num_time=64,
        )
        rows += bench_case(
            "softmax uniform N=1024 B=512",
            _lengths("uniform", 512, 1024, rng),
            h,
            d,
            "softmax",
            rng,
            args.reps,
            ref_batch=128,
        )
        if jax.default_backend() == "gpu":
            rows += bench_cudnn(8, 4096, 16, 128, rng, args.reps)
    header = (
        "| case | implementation | fwd TFLOP/s | bwd TFLOP/s | fwd ms | bwd ms |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    table = "\n".join(
        [header] + [f"| {a} | {b} | {c:.1f} | {e:.1f} | {f:.3f} | {g:.3f} |" for a, b, c, e, f, g in rows]
    )
    print(table)
    if args.write:
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python -m experiments bench attention " + " ".join(argv)
        text = (
            f"\n## Jagged attention\n\nMeasured {date} on {device}, JAX {jax.__version__}, bf16, H={h}, "
            f"Dqk=Dv={d}.\nCommand: `{cmd}`\n\n"
            "Correctness first (rel. L2 vs float32 reference, fresh random inputs):\n\n"
            + "\n".join(f"    {c}" for c in checks)
            + "\n\n"
            + table
            + "\n"
        )
        with open(args.write, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
