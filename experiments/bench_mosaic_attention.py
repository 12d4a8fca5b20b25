"""Mosaic GPU jagged attention forward against the Triton forward: `python -m experiments.bench_mosaic_attention`.

First checks the Mosaic GPU forward (o and, for softmax, lse) against the float32 reference on fresh random
inputs (relative L2 < 1e-2, no NaN, rows past offsets[B] zero), then times both forwards in the same run
(median of --reps after warm-up). TFLOP/s use the peer's formula: sum_b 2 H (Dqk + Dv) L_b^2 / 2.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import median_seconds
from pallas_kernels.jagged_attention import gpu, mosaic_gpu, tiling
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.reference import jagged_attention_reference, softmax_lse_reference


def _static(n, activation, d, window=0, targets=False):
    return tiling.Static(
        max_seq_len=n,
        activation=activation,
        alpha=1.0 / math.sqrt(d),
        max_attn_len=window,
        has_targets=targets,
        has_pos=False,
        has_time=False,
        num_pos=1,
        num_time=1,
        interpret=False,
        blocks=BlockSizes.get_default("gpu", d, n),
    )


def _inputs(lengths, h, d, seed, extra_rows=0, dtype=jnp.bfloat16):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = (
        -(-(int(offsets[-1]) + extra_rows) // mosaic_gpu.ALIGN) * mosaic_gpu.ALIGN
    )  # the Mosaic kernel needs T % 8 == 0
    keys = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(key, (t, h, d), jnp.float32).astype(dtype) for key in keys)
    return q, k, v, jnp.asarray(offsets)


def _unused(b, h, targets=None):
    targets = jnp.zeros((b,), jnp.int32) if targets is None else targets
    return (
        targets,
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((h, 16), jnp.float32),
        jnp.zeros((h, 16), jnp.float32),
    )


KNOBS = {}  # forward_mosaic_gpu keyword options from the command line (block_k, stages, pingpong, num_ctas)


def _mosaic(s):
    return jax.jit(
        lambda q, k, v, off, *rest: mosaic_gpu.forward_mosaic_gpu(q, k, v, off, *rest, s=s, **KNOBS)
    )


def _triton(s):
    return jax.jit(lambda q, k, v, off, *rest: gpu._forward(q, k, v, off, *rest, s=s))


def check(activation, lengths, n, h, d, seed, extra_rows=100, window=0, targets=False) -> tuple[bool, str]:
    q, k, v, off = _inputs(lengths, h, d, seed, extra_rows)
    s = _static(n, activation, d, window, targets)
    tg = jnp.asarray(np.random.default_rng(seed).integers(0, 60, size=len(lengths)), jnp.int32)
    o, lse = _mosaic(s)(q, k, v, off, *_unused(len(lengths), h, tg if targets else None))
    o = np.asarray(o, np.float32)
    ref = jagged_attention_reference(
        q,
        k,
        v,
        off,
        max_seq_len=n,
        activation=activation,
        max_attn_len=window,
        num_targets=tg if targets else None,
    )
    ref = np.asarray(ref, np.float32)
    tail = int(off[-1])
    err = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
    tail_max = float(np.abs(o[tail:]).max()) if tail < o.shape[0] else 0.0
    ok = bool(err < 1e-2 and np.isfinite(o).all() and tail_max == 0.0)
    msg = (
        f"check {activation} N={n} B={len(lengths)} window={window} targets={targets} {KNOBS}: "
        f"rel_l2={err:.2e} tail_max={tail_max}"
    )
    if activation == "softmax":
        lse_ref = softmax_lse_reference(
            q, k, off, n, 1.0 / math.sqrt(d), tg if targets else jnp.zeros_like(tg), window
        )
        lse = np.asarray(lse)[:, :tail]
        lse_err = float(np.abs(lse - lse_ref[:, :tail]).max())
        ok = ok and lse_err < 1e-2
        msg += f" lse_max_abs_err={lse_err:.2e}"
    return ok, msg + (" OK" if ok else " FAIL")


def bench(name, lengths, n, h, d, activation, reps, seed=0, triton=True) -> dict:
    q, k, v, off = _inputs(lengths, h, d, seed)
    s = _static(n, activation, d)
    flops = float(sum(2 * h * 2 * d * int(l) ** 2 / 2 for l in lengths))
    rest = _unused(len(lengths), h)
    row = {"case": name, "triton": float("nan")}
    impls = (("triton", _triton(s)),) if triton else ()
    for label, f in impls + (("mosaic", _mosaic(s)),):
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(f(q, k, v, off, *rest))
        except Exception as e:  # report and keep going: the other implementation's number still counts
            print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            row[label] = float("nan")
            continue
        compile_s = time.perf_counter() - t0
        sec = median_seconds(f, q, k, v, off, *rest, reps=reps, warmup=3)
        row[label] = flops / sec / 1e12
        print(
            f"{name} {label}: {sec * 1e3:.3f} ms  {row[label]:.1f} TFLOP/s (first call {compile_s:.1f} s)",
            flush=True,
        )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--pingpong", type=int, default=1)
    p.add_argument("--half-diag", type=int, default=0, help="half-width last key tile where it suffices")
    p.add_argument(
        "--num-ctas", type=int, default=mosaic_gpu.NUM_SMS, help="persistent grid size; 0: one CTA per item"
    )
    p.add_argument(
        "--cases", default="silu1024,silu4096,softmax", help="comma list of silu1024, silu4096, softmax"
    )
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--bringup", default="", help="mosaic_gpu.BRINGUP switches, e.g. flat_work=1,flat_gmem=0")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton baseline")
    args = p.parse_args(argv)
    for item in filter(None, args.bringup.split(",")):
        key, val = item.split("=")
        if key not in mosaic_gpu.BRINGUP:
            raise ValueError(f"unknown bring-up switch {key!r}, expected one of {sorted(mosaic_gpu.BRINGUP)}")
        mosaic_gpu.BRINGUP[key] = bool(int(val))
    KNOBS.update(
        block_k=args.block_k,
        stages=args.stages,
        pingpong=bool(args.pingpong),
        half_diag=bool(args.half_diag),
        num_ctas=args.num_ctas or None,
    )
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC jax {jax.__version__} "
        f"{jax.devices()[0].device_kind}",
        flush=True,
    )
    ok = True
    if not args.no_check:
        rng = np.random.default_rng(1)
        short = [200, 5, 130, 1, 256, 64]
        cases = [
            ("silu", short, 256, 0, False),
            ("softmax", short, 256, 0, False),
            ("silu", list(rng.integers(900, 1024, size=6)), 1024, 0, False),
            ("softmax", list(rng.integers(900, 1024, size=6)), 1024, 0, False),
            ("silu", short, 256, 100, True),
            ("softmax", short, 256, 40, True),
        ]
        for act, lengths, n, window, targets in cases:
            t0 = time.perf_counter()
            good, msg = check(
                act, lengths, n, 2, 128, int(rng.integers(1 << 30)), window=window, targets=targets
            )
            print(f"{msg} ({time.perf_counter() - t0:.1f} s)", flush=True)
            ok = ok and good
    if args.check_only or not ok:
        return 0 if ok else 1
    rng = np.random.default_rng(0)
    rows = []
    for case in args.cases.split(","):
        if case == "silu1024":
            rows.append(
                bench(
                    "silu N=1024 B=512 H=4",
                    rng.integers(921, 1024, size=512),
                    1024,
                    4,
                    128,
                    "silu",
                    args.reps,
                    triton=not args.no_triton,
                )
            )
        elif case == "silu4096":
            rows.append(
                bench(
                    "silu N=4096 B=512 H=4",
                    rng.integers(3686, 4096, size=512),
                    4096,
                    4,
                    128,
                    "silu",
                    args.reps,
                    triton=not args.no_triton,
                )
            )
        elif case == "softmax":
            rows.append(
                bench(
                    "softmax T=4096 B=8 H=16",
                    np.full(8, 4096),
                    4096,
                    16,
                    128,
                    "softmax",
                    args.reps,
                    triton=not args.no_triton,
                )
            )
    print("\n| case | Triton fwd TFLOP/s | Mosaic GPU fwd TFLOP/s | ratio |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['triton']:.1f} | {r['mosaic']:.1f} | {r['mosaic'] / r['triton']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
