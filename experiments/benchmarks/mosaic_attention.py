"""Experimental Mosaic GPU jagged attention forward against the Triton forward:
`python -m experiments bench mosaic_attention`.

The kernel is pallas_kernels/experimental/mosaic_gpu_jagged_attention.py; the Triton forward is the jagged
package's GPU backend (gpu.forward on gpu.to_kernel_layout's inputs, the same contract). First checks the
Mosaic GPU forward (o and, for softmax, lse) against the float32 reference on fresh random
inputs (relative L2 < 1e-2, no NaN, rows past offsets[B] zero), then times both forwards in the same run
(median of --reps after warm-up). TFLOP/s use the usual count (docs/design.md): sum_b 2 H (Dqk + Dv) L_b^2 / 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import shapes
from experiments.benchmarks.attention import fwd_flops
from experiments.benchmarks.timing import median_seconds
from pallas_kernels.experimental import mosaic_gpu_jagged_attention as mosaic_gpu
from pallas_kernels.jagged_attention import gpu
from pallas_kernels.jagged_attention.reference import jagged_attention_reference, softmax_lse_reference


def _static(n, activation, d, window=0, targets=False):
    return mosaic_gpu.static(n, activation, d, max_attn_len=window, has_targets=targets)


def _inputs(lengths, h, d, seed, extra_rows=0, dtype=jnp.bfloat16):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = (
        -(-(int(offsets[-1]) + extra_rows) // mosaic_gpu.ALIGN) * mosaic_gpu.ALIGN
    )  # the Mosaic kernel needs T % 8 == 0
    keys = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(key, (t, h, d), jnp.float32).astype(dtype) for key in keys)
    return q, k, v, jnp.asarray(offsets)


def _kernel_inputs(q, k, v, off, s, targets=None):
    """The Triton backend's kernel inputs (no relative bias), which the Mosaic forward takes too."""
    return gpu.to_kernel_layout(q, k, v, off, targets, None, None, None, s)


def _mosaic(s, knobs: dict):
    """knobs: forward_mosaic_gpu keyword options (block_k, stages, pingpong, half_diag, num_ctas, bringup)."""
    return jax.jit(lambda inputs: mosaic_gpu.forward_mosaic_gpu(*inputs, s=s, **knobs))


def _triton(s):
    def forward(inputs):
        o, residuals = gpu.forward(inputs, s)
        return o, residuals[-2]  # (o, lse), as the Mosaic forward (residuals end with o, lse, bias)

    return jax.jit(forward)


def check(
    activation, lengths, n, h, d, seed, knobs: dict, extra_rows=100, window=0, targets=False
) -> tuple[bool, str]:
    q, k, v, off = _inputs(lengths, h, d, seed, extra_rows)
    s = _static(n, activation, d, window, targets)
    tg = jnp.asarray(np.random.default_rng(seed).integers(0, 60, size=len(lengths)), jnp.int32)
    o, lse = _mosaic(s, knobs)(_kernel_inputs(q, k, v, off, s, tg if targets else None))
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
        f"check {activation} N={n} B={len(lengths)} window={window} targets={targets} {knobs}: "
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


def bench(name, shape: shapes.JaggedShape, activation, reps, knobs: dict, rng, seed=0, triton=True) -> dict:
    lengths, n, h, d = shape.sample_lengths(rng), shape.max_seq_len, shape.heads, shape.head_dim
    q, k, v, off = _inputs(lengths, h, d, seed)
    s = _static(n, activation, d)
    flops = fwd_flops(lengths, h, d, d)
    inputs = _kernel_inputs(q, k, v, off, s)
    row = {"case": name, "triton": float("nan")}
    impls = (("triton", _triton(s)),) if triton else ()
    for label, f in impls + (("mosaic", _mosaic(s, knobs)),):
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(f(inputs))
        except Exception as e:  # report and keep going: the other implementation's number still counts
            print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            row[label] = float("nan")
            continue
        compile_s = time.perf_counter() - t0
        sec = median_seconds(f, inputs, reps=reps, warmup=3)
        row[label] = flops / sec / 1e12
        print(
            f"{name} {label}: {sec * 1e3:.3f} ms  {row[label]:.1f} TFLOP/s (first call {compile_s:.1f} s)",
            flush=True,
        )
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments bench mosaic_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    p.add_argument(
        "--bringup", default="", help="Bringup fields of the Mosaic kernel, e.g. flat_work=1,flat_gmem=0"
    )
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton baseline")
    args = p.parse_args(argv)
    fields = [f.name for f in dataclasses.fields(mosaic_gpu.Bringup)]
    bringup = {}
    for item in filter(None, args.bringup.split(",")):
        key, val = item.split("=")
        if key not in fields:
            raise ValueError(f"unknown --bringup switch {key!r}, expected one of {fields}")
        bringup[key] = bool(int(val))
    knobs = dict(
        bringup=mosaic_gpu.Bringup(**bringup),
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
        small = shapes.MOSAIC_SMALL
        # both consumers of a work item, unaligned starts, a 1-row sequence; N=1024: near-full sequences
        short, n = [200, 5, 130, 1, 256, 64], small.max_seq_len
        cases = [
            ("silu", short, n, 0, False),
            ("softmax", short, n, 0, False),
            ("silu", list(rng.integers(900, 1024, size=6)), 1024, 0, False),
            ("softmax", list(rng.integers(900, 1024, size=6)), 1024, 0, False),
            ("silu", short, n, 100, True),
            ("softmax", short, n, 40, True),
        ]
        for act, lengths, n, window, targets in cases:
            t0 = time.perf_counter()
            good, msg = check(
                act,
                lengths,
                n,
                small.heads,
                small.head_dim,
                int(rng.integers(1 << 30)),
                knobs,
                window=window,
                targets=targets,
            )
            print(f"{msg} ({time.perf_counter() - t0:.1f} s)", flush=True)
            ok = ok and good
    if args.check_only or not ok:
        return 0 if ok else 1
    rng = np.random.default_rng(0)
    cases = {
        "silu1024": ("silu N=1024 B=512 H=4", shapes.PEER_N1024, "silu"),
        "silu4096": ("silu N=4096 B=512 H=4", shapes.PEER_N4096, "silu"),
        "softmax": ("softmax T=4096 B=8 H=16", shapes.SOFTMAX_DENSE, "softmax"),
    }
    rows = []
    for case in args.cases.split(","):
        if case not in cases:
            raise ValueError(f"unknown case {case!r}, expected a comma list of {sorted(cases)}")
        name, shape, activation = cases[case]
        rows.append(bench(name, shape, activation, args.reps, knobs, rng, triton=not args.no_triton))
    print("\n| case | Triton fwd TFLOP/s | Mosaic GPU fwd TFLOP/s | ratio |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['triton']:.1f} | {r['mosaic']:.1f} | {r['mosaic'] / r['triton']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
