"""Benchmark of jagged attention on one accelerator: `python -m experiments bench attention`.

Checks the Pallas kernel against the float32 reference on fresh random inputs first, then times forward
and backward (median of many reps after warm-up) for the shapes in shapes.py, against the padded XLA reference
and, for softmax, cuDNN. TFLOP/s use the usual count (docs/design.md): forward = sum_b 2 H (Dqk + Dv) L_b^2 / 2,
backward = 2.5 x forward; backward times exclude the forward pass (residuals are computed once before timing);
"useful" means the same count whatever the implementation computes. --preset runs the preset table instead
(attention_presets.py: Mosaic, Triton, cuDNN and tokamax side by side).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import attention_presets, shapes
from experiments.benchmarks.jagged_calls import (
    compare,
    fwd_bwd,
    fwd_flops,
    inputs,
    jagged,
    time_bwd,
)
from experiments.benchmarks.timing import median_seconds
from pallas_kernels import implementations
from pallas_kernels.jagged_attention import jagged_attention
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.options import KernelOptions


def _time(fn, *args, reps: int) -> float:
    return median_seconds(fn, *args, reps=reps, warmup=3)


_INTERPRET = jax.default_backend() == "cpu"  # no GPU: the Triton kernels in Pallas's interpreter


def _backends() -> list[tuple[str, str | None]]:
    """(label, implementation) of each kernel backend to time, A/B by name: on a Hopper GPU the Triton kernels
    and the default (Mosaic GPU where it takes the call, each direction on its own: a call the Mosaic backward
    does not take runs the Triton backward), on other GPUs the default (Triton), on CPU Triton interpreted."""
    if _INTERPRET:
        return [("triton (interpret)", "triton")]
    if not implementations.is_hopper():
        return [("triton (ours)", None)]
    return [("ours, Triton", "triton"), ("ours, Mosaic GPU", None)]


def check(rng, shape: shapes.JaggedShape, bias_only=False) -> list[str]:
    """Rel. L2 errors of the Pallas kernel vs the float32 reference (bf16 inputs), forward and grads.

    Each row ends in "OK" (every error < jagged_calls.CHECK_BAR, no NaN/inf) or "FAIL".
    """
    h, d, n, b = shape.heads, shape.head_dim, shape.max_seq_len, shape.batch
    rows = []
    lengths = np.concatenate([[0, 1, n, n - 1], rng.integers(1, n, size=b - 4)])
    for activation in ("silu", "softmax"):
        for extras in ({"targets": True},) if bias_only else ({}, {"targets": True}):
            q, k, v, do, off = inputs(lengths, h, d, rng)
            kw = {}
            if extras:
                kw = dict(
                    num_targets=jnp.asarray(rng.integers(0, 5, size=b), jnp.int32),
                    max_attn_len=100,
                    timestamps=jnp.asarray(np.sort(rng.integers(0, 10**7, size=q.shape[0])), jnp.int32),
                    pos_bias=jnp.asarray(rng.standard_normal((h, 256)) * 0.3, jnp.float32),
                    time_bias=jnp.asarray(rng.standard_normal((h, 64)) * 0.3, jnp.float32),
                )

            def loss(q, k, v, pb, tb, impl, interpret):
                kk = dict(kw, pos_bias=pb, time_bias=tb) if kw else {}
                o = jagged_attention(
                    q,
                    k,
                    v,
                    off,
                    max_seq_len=n,
                    activation=activation,
                    implementation=impl,
                    interpret=interpret,
                    **kk,
                )
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

            pb, tb = kw.get("pos_bias"), kw.get("time_bias")
            argn = (0, 1, 2, 3, 4) if kw else (0, 1, 2)
            grads = jax.jit(jax.grad(loss, argnums=argn, has_aux=True), static_argnums=(5, 6))
            f32 = lambda x: None if x is None else x.astype(jnp.float32)
            want = grads(f32(q), f32(k), f32(v), pb, tb, "reference", False)
            for label, impl in _backends():
                got = grads(q, k, v, pb, tb, impl, _INTERPRET)
                names = ["out", "dq", "dk", "dv", "dpos", "dtime"]
                vals = [got[1]] + list(got[0])
                refs = [want[1]] + list(want[0])
                ok, errs = compare(names, vals, refs)
                rows.append(
                    f"check {activation:7s} {'targets+window+bias' if kw else 'plain':20s} [{label}] "
                    + errs
                    + (" -> OK" if ok else " -> FAIL")
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
    options=None,
    num_pos=0,
    num_time=0,
):
    n = int(max(lengths))
    n = 1 << (n - 1).bit_length() if n not in (1024, 4096) else n
    q, k, v, do, off = inputs(lengths, h, d, rng)
    flops = fwd_flops(lengths, h, d, d)
    out = []
    kw = {}
    if num_time:  # sorted timestamps, ~ one event per minute
        kw["timestamps"] = jnp.asarray(np.cumsum(rng.integers(1, 120, size=q.shape[0])), jnp.int32)
        kw["time_bias"] = jnp.asarray(rng.standard_normal((h, num_time)) * 0.1, jnp.float32)
    if num_pos:
        kw["pos_bias"] = jnp.asarray(rng.standard_normal((h, num_pos)) * 0.1, jnp.float32)
    for label, impl in _backends():
        fwd, bwd = fwd_bwd(jagged(impl, n, activation, block_sizes, options, _INTERPRET, **kw))
        tf = _time(fwd, q, k, v, off, reps=reps)
        tb = time_bwd(bwd, q, k, v, off, do, reps=reps)
        out.append((name, label, flops / tf / 1e12, 2.5 * flops / tb / 1e12, tf * 1e3, tb * 1e3))
        del fwd, bwd
    if with_ref:  # padded reference; memory B*H*N^2*4 bytes, so maybe on a sub-batch
        sub = lengths if ref_batch is None else lengths[:ref_batch]
        q2, k2, v2, do2, off2 = inputs(sub, h, d, rng)
        fl2 = fwd_flops(sub, h, d, d)
        fwd, bwd = fwd_bwd(jagged("reference", n, activation))
        tf = _time(fwd, q2, k2, v2, off2, reps=max(3, reps // 4))
        tb = time_bwd(bwd, q2, k2, v2, off2, do2, reps=max(3, reps // 4))
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


def bench_cudnn(shape: shapes.JaggedShape, rng, reps):
    """Dense causal softmax, equal lengths: cuDNN vs ours on the same tokens."""
    b, t, h, d = shape.batch, shape.max_seq_len, shape.heads, shape.head_dim
    lengths = shape.sample_lengths(rng)
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


def _bias(bias: shapes.RelativeBias, pos=True, time=True) -> dict:
    return dict(num_pos=bias.num_pos if pos else 0, num_time=bias.num_time if time else 0)


def bench_bias(rng, reps, shape: shapes.JaggedShape, variants):
    """The gem_h200 bias setting (128 position + 64 time buckets), the 1024-bucket case, and no bias."""
    gem, wide = shapes.GEM_H200_BIAS, shapes.WIDE_BIAS
    cases = [
        ("no bias", {}),
        (f"pos {gem.num_pos} + time {gem.num_time} (gem_h200)", _bias(gem)),
        (
            f"pos {gem.num_pos} + time {gem.num_time}, bias computed in the kernels (no bias_rows)",
            dict(_bias(gem), options=KernelOptions(bias_rows=False)),
        ),
        (f"pos {wide.num_pos} + time {wide.num_time}", _bias(wide)),
    ]
    if variants:  # attribution: each bias alone, other tiles, the kernel variants of KernelOptions
        cases += [
            (f"pos {gem.num_pos} only", _bias(gem, time=False)),
            (f"time {gem.num_time} only", _bias(gem, pos=False)),
            (
                f"pos {gem.num_pos} only, per-cell position gather",
                dict(_bias(gem, time=False), options=KernelOptions(pos_expanded=False)),
            ),
            ("no bias, forward SiLU in float32", dict(options=KernelOptions(silu_bf16x2=False))),
            (
                f"pos {gem.num_pos} + time {gem.num_time}, dK/dV tiles 64x128 and 2 forward stages",
                dict(_bias(gem), block_sizes=BlockSizes(block_q_dkv=64, block_k_dkv=128, num_stages=2)),
            ),
            (
                f"pos {gem.num_pos} + time {gem.num_time}, position gradient by atomics",
                dict(_bias(gem), options=KernelOptions(pos_grad_stores=False)),
            ),
        ]
    rows = []
    n, b = shape.max_seq_len, shape.batch
    for name, kw in cases:
        try:
            r = bench_case(
                f"silu uniform N={n} B={b} {name}",
                shape.sample_lengths(rng),
                shape.heads,
                shape.head_dim,
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
        help="with --bias-only: also time pos-only, time-only, other tiles and the KernelOptions variants",
    )
    p.add_argument(
        "--write", default="", help="append the markdown table to this file (e.g. docs/benchmarks.md)"
    )
    p.add_argument(
        "--preset",
        default="",
        metavar="NAME[,NAME...]",
        help="only the preset rows (attention_presets.py), every implementation side by side; 'all': "
        f"every row. NAMEs: {', '.join(shapes.ATTENTION_PRESETS)}. With --quick: shrunk (B, N, H <= 2, 64, 2)",
    )
    args = p.parse_args(argv)
    seed = int(time.time())
    rng = np.random.default_rng(seed)
    device = jax.devices()[0].device_kind
    print(f"device={device} jax={jax.__version__}", flush=True)
    if args.preset:
        names = list(shapes.ATTENTION_PRESETS) if args.preset == "all" else args.preset.split(",")
        unknown = [name for name in names if name not in shapes.ATTENTION_PRESETS]
        if unknown or args.write:
            p.error(f"unknown --preset {unknown}" if unknown else "--write goes with the default tables only")
        return attention_presets.run(
            names, quick_shapes=args.quick, reps=args.reps, checked=not args.no_check, seed=seed
        )
    try:
        checks = (
            []
            if args.no_check
            else check(rng, shapes.CHECK_QUICK if args.quick else shapes.CHECK, bias_only=args.bias_only)
        )
    except Exception as e:
        if not args.bias_only:
            raise
        checks = [f"check FAILED {type(e).__name__}: {str(e)[:2000]}"]  # still time what compiles
        print(checks[0], flush=True)
    peer = shapes.PEER_N1024
    h, d = peer.heads, peer.head_dim
    rows = []
    if args.bias_only:
        bias_shape = dataclasses.replace(peer, batch=4, max_seq_len=128) if args.quick else peer
        rows += bench_bias(rng, args.reps, bias_shape, args.bias_variants)
    elif args.quick:
        rows += bench_case(
            "silu uniform N=128 B=8",
            shapes.sample_lengths("uniform", 8, 128, rng),
            2,
            64,
            "silu",
            rng,
            args.reps,
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
                    peer.sample_lengths(rng),
                    h,
                    d,
                    "silu",
                    rng,
                    10,
                    with_ref=False,
                    block_sizes=bs,
                )
                print(f"{r[0][0]}: fwd {r[0][2]:.0f} bwd {r[0][3]:.0f} TFLOP/s", flush=True)
        for shape in (shapes.PEER_N1024, shapes.PEER_N4096):
            n = shape.max_seq_len
            rows += bench_case(
                f"silu uniform N={n} B={shape.batch}",
                shape.sample_lengths(rng),
                shape.heads,
                shape.head_dim,
                "silu",
                rng,
                args.reps,
                ref_batch=None if n == 1024 else 32,
            )
            for r in rows[-2:]:
                print(r, flush=True)
        tail = shapes.HEAVY_TAIL
        ln = tail.sample_lengths(rng)
        rows += bench_case(
            f"silu lognormal N={tail.max_seq_len} B={tail.batch} "
            f"(pad {1 - ln.sum() / (tail.batch * tail.max_seq_len):.0%})",
            ln,
            tail.heads,
            tail.head_dim,
            "silu",
            rng,
            args.reps,
            ref_batch=32,
        )
        for shape in (shapes.NVIDIA_D256, shapes.NVIDIA_D64):
            rows += bench_case(
                f"silu equal N={shape.max_seq_len} B={shape.batch} H={shape.heads} D={shape.head_dim}",
                shape.sample_lengths(rng),
                shape.heads,
                shape.head_dim,
                "silu",
                rng,
                args.reps,
                with_ref=False,
            )
        gem = shapes.GEM_H200_BIAS
        rows += bench_case(
            f"silu lognormal N={tail.max_seq_len} B={tail.batch} + pos {gem.num_pos} / time {gem.num_time} bias",
            tail.sample_lengths(rng),
            tail.heads,
            tail.head_dim,
            "silu",
            rng,
            args.reps,
            with_ref=False,
            **_bias(gem),
        )
        for name, bias in (
            ("+ pos/time bias", shapes.WIDE_BIAS),
            (f"+ pos {gem.num_pos} / time {gem.num_time} bias (gem_h200)", gem),
        ):
            rows += bench_case(
                f"silu uniform N=1024 B=512 {name}",
                peer.sample_lengths(rng),
                h,
                d,
                "silu",
                rng,
                args.reps,
                with_ref=False,
                **_bias(bias),
            )
        rows += bench_case(
            "softmax uniform N=1024 B=512",
            peer.sample_lengths(rng),
            h,
            d,
            "softmax",
            rng,
            args.reps,
            ref_batch=128,
        )
        if jax.default_backend() == "gpu":
            rows += bench_cudnn(shapes.DENSE_H16, rng, args.reps)
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
    if args.no_check:
        print("correctness: not checked (--no-check)")
        return 0
    failed = [c for c in checks if not c.endswith("OK")]
    print(
        f"correctness: {'FAILED' if failed else 'OK'}, {len(checks) - len(failed)} of {len(checks)} checks pass"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
