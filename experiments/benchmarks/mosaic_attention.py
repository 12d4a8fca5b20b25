"""The Hopper forward's knobs: `python -m experiments bench mosaic_attention` (`bench attention` times the shipped
forwards side by side; this one sweeps the Mosaic GPU kernel's tiles and schedule).

The kernel is pallas_kernels/jagged_attention/gpu_sm90.py; the Triton forward is jagged_attention with
implementation="triton" (with a bias: the bias_rows array it builds, or the computed bias past the
array's cap, as the model runs it). First checks the
Mosaic GPU forward (o and, for softmax, lse) against the float32 reference on fresh random inputs (relative
L2 < 1e-2, no NaN, rows past offsets[B] zero), with and without the relative bias, then times both forwards
in the same run (median of --reps after warm-up), and with --sweep the Mosaic kernel's tile knobs.
TFLOP/s use the usual count (docs/design.md): sum_b 2 H (Dqk + Dv) L_b^2 / 2 (the same count with or without a bias).
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

from experiments.benchmarks import shapes
from experiments.benchmarks.jagged_calls import fwd_flops
from experiments.benchmarks.timing import median_seconds
from pallas_kernels.jagged_attention import gpu_layout, jagged_attention
from pallas_kernels.jagged_attention import gpu_sm90 as mosaic_gpu
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.reference import jagged_attention_reference, softmax_lse_reference
from pallas_kernels.mosaic_common import num_sms


def _static(n, activation, d, window=0, targets=False, bias: shapes.RelativeBias | None = None):
    extra = {}
    if bias is not None:
        extra = dict(num_pos=bias.num_pos, num_time=bias.num_time)
    return KernelParams.build(n, activation, d, max_attn_len=window, has_targets=targets, **extra)


def _inputs(lengths, h, d, seed, extra_rows=0, dtype=jnp.bfloat16, bias: shapes.RelativeBias | None = None):
    """q, k, v, offsets, and (with a bias) timestamps ~ one event a minute with jitter, pos and time tables."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = (
        -(-(int(offsets[-1]) + extra_rows) // mosaic_gpu.ALIGN) * mosaic_gpu.ALIGN
    )  # the kernel's own T % 8 == 0
    keys = jax.random.split(jax.random.key(seed), 6)
    q, k, v = (jax.random.normal(key, (t, h, d), jnp.float32).astype(dtype) for key in keys[:3])
    extra = {}
    if bias is not None:
        gaps = jax.random.randint(keys[3], (t,), 1, 120)
        extra = dict(
            timestamps=jnp.cumsum(gaps).astype(jnp.int32),
            pos_bias=0.5 * jax.random.normal(keys[4], (h, bias.num_pos), jnp.float32),
            time_bias=0.5 * jax.random.normal(keys[5], (h, bias.num_time), jnp.float32),
        )
    return q, k, v, jnp.asarray(offsets), extra


def _kernel_inputs(q, k, v, off, s, targets=None, extra=None):
    """The Triton backend's kernel inputs, which the Mosaic forward takes too."""
    extra = extra or {}
    return gpu_layout.to_kernel_layout(
        q, k, v, off, targets, extra.get("timestamps"), extra.get("pos_bias"), extra.get("time_bias"), s
    )


def _mosaic(s, knobs: dict):
    """knobs: forward_mosaic_gpu keyword options (block_k, stages, pingpong, num_ctas)."""
    return jax.jit(lambda inputs: mosaic_gpu.forward_mosaic_gpu(*inputs, params=s, **knobs))


def _triton(q, k, v, off, n, activation, extra):
    """The shipped Triton forward through the public entry point (its own bias_rows decision)."""
    f = jax.jit(
        lambda q, k, v, off, extra: jagged_attention(
            q, k, v, off, max_seq_len=n, activation=activation, implementation="triton", **extra
        )
    )
    return lambda _inputs: f(q, k, v, off, extra)


def check(
    activation, lengths, n, h, d, seed, knobs: dict, extra_rows=100, window=0, targets=False, bias=None
) -> tuple[bool, str]:
    q, k, v, off, extra = _inputs(lengths, h, d, seed, extra_rows, bias=bias)
    if extra:  # unsorted timestamps: time buckets change anywhere along a row
        extra["timestamps"] = jax.random.permutation(jax.random.key(seed + 1), extra["timestamps"])
    s = _static(n, activation, d, window, targets, bias)
    tg = jnp.asarray(np.random.default_rng(seed).integers(0, 60, size=len(lengths)), jnp.int32)
    o, lse = _mosaic(s, knobs)(_kernel_inputs(q, k, v, off, s, tg if targets else None, extra))
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
        **extra,
    )
    ref = np.asarray(ref, np.float32)
    tail = int(off[-1])
    err = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
    tail_max = float(np.abs(o[tail:]).max()) if tail < o.shape[0] else 0.0
    ok = bool(err < 1e-2 and np.isfinite(o).all() and tail_max == 0.0)
    msg = (
        f"check {activation} N={n} B={len(lengths)} D={d} window={window} targets={targets} "
        f"bias={bias} {knobs}: rel_l2={err:.2e} tail_max={tail_max}"
    )
    if activation == "softmax" and bias is None:
        lse_ref = softmax_lse_reference(
            q, k, off, n, 1.0 / math.sqrt(d), tg if targets else jnp.zeros_like(tg), window
        )
        lse = np.asarray(lse)[:, :tail]
        lse_err = float(np.abs(lse - lse_ref[:, :tail]).max())
        ok = ok and lse_err < 1e-2
        msg += f" lse_max_abs_err={lse_err:.2e}"
    return ok, msg + (" OK" if ok else " FAIL")


def _time_one(label, f, inputs, flops, reps, name) -> float:
    t0 = time.perf_counter()
    try:
        jax.block_until_ready(f(inputs))
    except Exception as e:  # report and keep going: the other implementation's number still counts
        print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
        return float("nan")
    compile_s = time.perf_counter() - t0
    sec = median_seconds(f, inputs, reps=reps, warmup=3)
    tflops = flops / sec / 1e12
    print(
        f"{name} {label}: {sec * 1e3:.3f} ms  {tflops:.1f} TFLOP/s (first call {compile_s:.1f} s)", flush=True
    )
    return tflops


def bench(
    name, shape: shapes.JaggedShape, activation, reps, knob_sets: dict, rng, bias=None, triton=True
) -> dict:
    """TFLOP/s of the Triton forward and of the Mosaic forward with each named set of knobs, one shape."""
    lengths, n, h, d = shape.sample_lengths(rng), shape.max_seq_len, shape.heads, shape.head_dim
    q, k, v, off, extra = _inputs(lengths, h, d, 0, bias=bias)
    s = _static(n, activation, d, bias=bias)
    flops = fwd_flops(lengths, h, d, d)
    inputs = _kernel_inputs(q, k, v, off, s, extra=extra)
    row = {"case": name, "triton": float("nan")}
    if triton:
        row["triton"] = _time_one(
            "triton", _triton(q, k, v, off, n, activation, extra), inputs, flops, reps, name
        )
    for label, knobs in knob_sets.items():
        if not mosaic_gpu.supports(s, q, v):
            print(f"{name} mosaic: not supported (D={d})", flush=True)
            row[label] = float("nan")
            continue
        row[label] = _time_one(f"mosaic {label}", _mosaic(s, knobs), inputs, flops, reps, name)
    return row


CASES = {
    "silu1024": ("silu N=1024 B=512 H=4 D=128", shapes.PEER_N1024, "silu", None),
    "silu4096": ("silu N=4096 B=512 H=4 D=128", shapes.PEER_N4096, "silu", None),
    "heavy": ("silu heavy-tailed N=4096 B=2048 H=4 D=128", shapes.HEAVY_TAIL, "silu", None),
    "d256": ("silu full N=4096 B=64 H=4 D=256", shapes.NVIDIA_D256, "silu", None),
    "d64": ("silu full N=16384 B=16 H=4 D=64", shapes.NVIDIA_D64, "silu", None),
    "softmax": ("softmax T=4096 B=8 H=16 D=128", shapes.DENSE_H16, "softmax", None),
    "bias1024": ("silu N=1024 B=512 + pos 128 + time 64", shapes.PEER_N1024, "silu", shapes.GEM_H200_BIAS),
    "biasheavy": (
        "silu heavy-tailed N=4096 + pos 128 + time 64",
        shapes.HEAVY_TAIL,
        "silu",
        shapes.GEM_H200_BIAS,
    ),
}


def _knob_sets(args) -> dict:
    base = dict(block_k=args.block_k or None, stages=args.stages or None, pingpong=bool(args.pingpong))
    base.update(num_ctas={0: None, -1: num_sms()}.get(args.num_ctas, args.num_ctas))
    sets = {"default": base}
    for spec in filter(None, args.sweep.split(",")):  # bk:stages
        bk, stages = (int(x) for x in spec.split(":"))
        sets[spec] = {**base, "block_k": bk or None, "stages": stages}
    return sets


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments bench mosaic_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block-k", type=int, default=0, help="key-tile rows; 0: the kernel's default for D")
    p.add_argument("--stages", type=int, default=0, help="K/V ring slots; 0: the kernel's default")
    p.add_argument("--pingpong", type=int, default=1)
    p.add_argument(
        "--num-ctas", type=int, default=-1, help="persistent grid size; -1: one CTA per SM; 0: one per item"
    )
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument(
        "--sweep",
        default="",
        help="extra Mosaic knob sets, comma list of bk:stages (bk 0: default)",
    )
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton baseline")
    args = p.parse_args(argv)
    knob_sets = _knob_sets(args)
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC jax {jax.__version__} "
        f"{jax.devices()[0].device_kind}",
        flush=True,
    )
    ok = True
    if not args.no_check:
        rng = np.random.default_rng(1)
        small = shapes.MOSAIC_SMALL
        bias = shapes.RelativeBias(num_pos=40, num_time=16)
        # both consumers of a work item, unaligned starts, a 1-row sequence; N=1024: near-full sequences
        short, n = [200, 5, 130, 1, 256, 64], small.max_seq_len
        cases = [
            ("silu", short, n, 128, 0, False, None),
            ("softmax", short, n, 128, 0, False, None),
            ("silu", list(rng.integers(900, 1024, size=6)), 1024, 128, 0, False, None),
            ("softmax", list(rng.integers(900, 1024, size=6)), 1024, 128, 0, False, None),
            ("silu", short, n, 128, 100, True, None),
            ("softmax", short, n, 128, 40, True, None),
            ("silu", short, n, 64, 0, True, None),
            ("silu", short, n, 128, 0, True, bias),
            ("softmax", short, n, 128, 40, True, bias),
            ("silu", list(rng.integers(900, 1024, size=6)), 1024, 128, 0, False, shapes.GEM_H200_BIAS),
            ("silu", short, n, 64, 100, True, bias),
            ("silu", short, n, 256, 0, True, bias),
            ("softmax", short, n, 256, 40, True, None),
        ]
        for label, knobs in knob_sets.items():
            # the default knobs on every case; other knob sets on three (plain, window + targets, bias)
            for act, lengths, n, d, window, targets, b in cases if label == "default" else cases[::4]:
                t0 = time.perf_counter()
                try:
                    good, msg = check(
                        act,
                        lengths,
                        n,
                        small.heads,
                        d,
                        int(rng.integers(1 << 30)),
                        knobs,
                        window=window,
                        targets=targets,
                        bias=b,
                    )
                except (
                    Exception
                ) as e:  # e.g. a knob set whose tiles exceed shared memory: the others still run
                    good, msg = (
                        False,
                        f"check {act} D={d} bias={b} {knobs}: {type(e).__name__}: {str(e)[:300]}",
                    )
                    msg += " FAIL"

                print(f"[{label}] {msg} ({time.perf_counter() - t0:.1f} s)", flush=True)
                ok = ok and good
    if args.check_only or not ok:
        return 0 if ok else 1
    rng = np.random.default_rng(0)
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise ValueError(f"unknown case {case!r}, expected a comma list of {sorted(CASES)}")
        name, shape, activation, bias = CASES[case]
        rows.append(
            bench(name, shape, activation, args.reps, knob_sets, rng, bias, triton=not args.no_triton)
        )
    labels = list(knob_sets)
    print(
        "\n| case | Triton fwd TFLOP/s | " + " | ".join(f"Mosaic {x}" for x in labels) + " | best / Triton |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in labels) + " | --- |")
    for r in rows:
        best = max((r[x] for x in labels if not math.isnan(r[x])), default=float("nan"))
        cells = " | ".join(f"{r[x]:.1f}" for x in labels)
        print(f"| {r['case']} | {r['triton']:.1f} | {cells} | {best / r['triton']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
