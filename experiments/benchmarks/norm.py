"""The fused layer norms against XLA's: `python -m experiments bench norm`.

The HSTU layer's norms at gem_h200's and hstu_nvidia's sizes (T = 196,608 rows, bf16): the input norm with
the residual passed through, the attention-output norm times the gate, at width 512 and 1024. Each case runs
as plain jnp (XLA fuses it as it can: "reference"), as the Triton kernels (pallas_kernels/layer_norm/gpu.py,
the pre-Hopper path) and as the Mosaic GPU kernels (gpu_sm90.py, what a Hopper GPU runs), each with its
default tiles and a few others: the forward alone, and the backward (one `jit` of `jax.vjp`'s pull-back with
the forward's outputs unused, so XLA keeps only what the backward needs). Before timing, every output and
gradient is checked against the reference in float32 on fresh random inputs (drawn apart from the timed ones):
a variant's error may be at most 1.5x the bf16 reference's own. GB/s counts the bytes the fused kernels must
move (each row tensor read or written once), comparable with the HBM bandwidth (3.87 TB/s read + write
measured on the H200). A variant that does not compile on this device (Mosaic GPU off Hopper, a tile that
does not fit) prints `failed` and the run goes on.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from experiments.benchmarks.timing import median_seconds
from pallas_kernels.layer_norm import layer_norm
from pallas_kernels.layer_norm.api import kernel_for

# (name, width, gated, with_input)
CASES = [
    ("input norm + residual, D=512", 512, False, True),
    ("output norm x gate, D=512", 512, True, False),
    ("input norm + residual, D=1024", 1024, False, True),
    ("output norm x gate, D=1024", 1024, True, False),
]
# Triton: (rows per program, warps) tried beside the defaults (None, None)
TILES = [(None, None), (4, 4), (8, 4), (16, 4), (16, 8), (32, 8)]
# Mosaic GPU: rows per pipeline step (stages and CTAs follow from shared memory) beside the default (None)
MOSAIC_ROWS = [None, 4, 8, 16, 32]


def _fns(implementation, gated, with_input, rows_per_block=None, num_warps=None, interpret=False):
    norm = functools.partial(
        layer_norm,
        with_input=with_input,
        implementation=implementation,
        interpret=interpret,
        rows_per_block=rows_per_block,
        num_warps=num_warps,
    )

    def forward(x, gate, scale, bias):
        return norm(x, scale, bias, gate if gated else None)

    def grads(x, gate, scale, bias, dy, dres):
        out, pull = jax.vjp(forward, x, gate, scale, bias)
        return pull((dres, dy) if with_input else dy)

    return jax.jit(forward), jax.jit(grads)


def _max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _inputs(key, rows: int, width: int):
    """(x, gate, scale, bias) and (dy, dres): bf16 rows with an offset mean, float32 scale and bias."""
    k = jax.random.split(key, 6)
    x = (jax.random.normal(k[0], (rows, width)) * 2 + 0.5).astype(jnp.bfloat16)
    gate = jax.random.normal(k[1], (rows, width)).astype(jnp.bfloat16)
    scale = 1 + 0.1 * jax.random.normal(k[2], (width,))
    bias = 0.1 * jax.random.normal(k[3], (width,))
    dy = jax.random.normal(k[4], (rows, width)).astype(jnp.bfloat16)
    dres = jax.random.normal(k[5], (rows, width)).astype(jnp.bfloat16)
    return (x, gate, scale, bias), (dy, dres)


def _variants(gated, with_input, quick: bool, interpret: bool):
    """(label, (forward, grads)) of XLA's reference, the Triton kernels and the Mosaic GPU kernels."""
    out = [("reference (XLA)", _fns("reference", gated, with_input))]
    for r, w in TILES[:1] if quick else TILES:
        out.append(
            (
                f"triton rows={r or 'default'} warps={w or 'default'}",
                _fns("triton", gated, with_input, r, w, interpret),
            )
        )
    for r in MOSAIC_ROWS[:1] if quick else MOSAIC_ROWS:
        out.append((f"mosaic rows={r or 'default'}", _fns("mosaic", gated, with_input, r, None, interpret)))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments bench norm", description=__doc__)
    p.add_argument("--rows", type=int, default=196_608, help="tokens (gem_h200's pack capacity)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--quick",
        action="store_true",
        help="small shapes, default tiles only (smoke test, e.g. on CPU: the kernels in their interpreters)",
    )
    args = p.parse_args(argv)
    interpret = jax.default_backend() == "cpu"
    rows, cases = (args.rows, CASES) if not args.quick else (64, CASES[:2])
    if args.quick:
        cases = [(name.replace("512", "64"), 64, g, w) for name, _, g, w in cases]
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} rows={rows}", flush=True)
    ok = True
    for case, (name, width, gated, with_input) in enumerate(cases):
        arrays, (dy, dres) = _inputs(jax.random.key(2 * case), rows, width)  # timed
        fresh, (fresh_dy, fresh_dres) = _inputs(jax.random.key(2 * case + 1), rows, width)  # checked
        row_bytes = rows * width * 2
        fwd_bytes = row_bytes * (2 + gated)
        bwd_bytes = row_bytes * (3 + 2 * gated + with_input)  # read x, dy (gate, dres); write dx (dgate)
        print(
            f"{name}: forward moves {fwd_bytes / 1e9:.2f} GB, backward {bwd_bytes / 1e9:.2f} GB; "
            f"implementation=None runs {kernel_for(None, width)} here",
            flush=True,
        )
        variants = _variants(gated, with_input, args.quick, interpret)
        ref_f, ref_g = variants[0][1]
        # The truth: the reference in float32 on the same (bf16-valued) inputs. The bf16 reference rounds
        # the norm before the gate, and its gradient sums over many rows carry those roundings: each
        # variant's error against the truth is checked against the bf16 reference's own.
        f32 = [a.astype(jnp.float32) for a in (*fresh, fresh_dy, fresh_dres)]
        truth_y, truth_g = ref_f(*f32[:4]), ref_g(*f32)
        ref_err = max(
            _max_diff(ref_f(*fresh), truth_y), _max_diff(ref_g(*fresh, fresh_dy, fresh_dres), truth_g)
        )
        base = None
        for label, (f, g) in variants:
            try:
                err = max(_max_diff(f(*fresh), truth_y), _max_diff(g(*fresh, fresh_dy, fresh_dres), truth_g))
            except Exception as e:  # a family or tile that does not compile here: say so, go on
                print(f"  {label}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
                continue
            good = err <= max(1.5 * ref_err, 0.02)
            ok &= good
            fwd_ms = median_seconds(f, *arrays, reps=args.reps) * 1e3
            bwd_ms = median_seconds(g, *arrays, dy, dres, reps=args.reps) * 1e3
            base = base or (fwd_ms, bwd_ms)
            print(
                f"  {label}: forward {fwd_ms:.3f} ms ({fwd_bytes / fwd_ms / 1e6:.0f} GB/s, "
                f"{base[0] / fwd_ms:.2f}x reference's), backward {bwd_ms:.3f} ms "
                f"({bwd_bytes / bwd_ms / 1e6:.0f} GB/s, {base[1] / bwd_ms:.2f}x reference's); "
                f"max diff from float32 {err:.3g} " + ("ok" if good else "WRONG"),
                flush=True,
            )
    return 0 if ok else 1
