"""SiLU's backward with FP8 output, kernel against XLA: `python -m experiments bench silu_fp8`.

HSTU's uvqk SiLU backward at gem_h200's and hstu_nvidia's sizes (rows x 4 pieces of 512 / 1024, bf16). Three
ways to get the gradient the layer's backward GEMMs need:

- "bf16 (XLA)": what the step does without FP8: the bf16 gradient (concatenated) and the bias gradient's
  column sums, two XLA fusions. Not an FP8 input; the time the kernel must beat for FP8 to pay.
- "FP8 in XLA": pallas_kernels.silu_backward_fp8's reference, jitted: the same outputs as the kernel (e5m2
  gradient, its transpose, amax, column sums) as XLA fuses them.
- the Pallas Triton kernel (pallas_kernels.silu_backward_fp8, gpu.py) with its default tiles and those of TILES.
- the Pallas Mosaic GPU kernel (gpu_sm90.py, Hopper; implementation="mosaic") with its default tiles and those of
  MOSAIC_TILES. Not yet measured on an H200; on a GPU that is no Hopper it says failed. On CPU (--quick) it
  runs in the Mosaic GPU interpreter (one warpgroup per CTA: XLA:CPU's default thread pool suffices).

Each kernel variant is checked against the FP8 reference on the same fresh inputs first (q identical up to a
few rounding ties, the same transpose, amax and sums to float32 rounding). GB/s counts 6 bytes an element
(reads the bf16 gradient pieces and pre-activation, writes the e5m2 gradient and its transpose), comparable
with the H200's 3.87 TB/s read + write.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.timing import median_seconds
from pallas_kernels.silu_backward_fp8 import silu_backward_fp8
from pallas_kernels.silu_backward_fp8.reference import silu_backward_fp8_reference, silu_grad

SHAPES = [("gem_h200 uvqk", 196_608, 512), ("hstu_nvidia uvqk", 65_536, 1024)]  # rows, piece width
# (block rows, block cols, warps) tried beside the defaults
TILES = [(None, None, None), (128, 128, 8), (128, 64, 4), (256, 64, 8), (64, 256, 8), (32, 128, 4)]
# the Mosaic GPU kernel's (block rows, block cols): rows a multiple of 64, cols of 32
MOSAIC_TILES = [(None, None), (128, 64), (64, 256), (128, 128)]


def _bf16_silu_backward(dys, z):
    g = silu_grad(jnp.concatenate(dys, axis=1), z)
    return g.astype(jnp.bfloat16), jnp.sum(g, axis=0)


def _check(got, want) -> str | None:
    """None if the kernel's outputs are the reference's, else what differs."""
    q, q_ref = (np.asarray(a.astype(jnp.float32)) for a in (got[0], want[0]))
    differ = float(np.mean(q != q_ref))
    if differ > 1e-4:
        return f"q differs in {differ:.1e} of elements"
    if not np.array_equal(np.asarray(got[1].astype(jnp.float32)), q.T):
        return "q^T is not q transposed"
    if abs(float(got[2]) - float(want[2])) > 1e-5 * float(want[2]):
        return f"amax {float(got[2])} vs {float(want[2])}"
    rel = float(jnp.linalg.norm(got[3] - want[3]) / jnp.linalg.norm(want[3]))
    return None if rel < 1e-4 else f"column sums off by {rel:.1e}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments bench silu_fp8", description=__doc__)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small shapes, default tiles only (smoke test, CPU)")
    args = p.parse_args(argv)
    cpu = jax.default_backend() == "cpu"
    shapes, tiles = (SHAPES, TILES) if not args.quick else ([("quick", 64, 32)], TILES[:1])
    variants = [
        (f"triton {bm or 'default'} x {bn or 'default'}, warps {w or 'default'}", "triton", bm, bn, w)
        for bm, bn, w in tiles
    ]
    variants += [
        (f"mosaic {bm or 'default'} x {bn or 'default'}", "mosaic", bm, bn, None)
        for bm, bn in (MOSAIC_TILES if not args.quick else MOSAIC_TILES[:1])
    ]
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    ok = True
    for name, rows, width in shapes:
        keys = jax.random.split(jax.random.key(rows + width), 5)
        dys = tuple(jax.random.normal(keys[i], (rows, width), jnp.bfloat16) * 0.01 for i in range(4))
        z = jax.random.normal(keys[4], (rows, 4 * width), jnp.bfloat16) * 2
        amax = float(jnp.max(jnp.abs(silu_grad(jnp.concatenate(dys, 1), z))))
        scale = jnp.float32(amax / float(jnp.finfo(jnp.float8_e5m2).max) / 1.5)  # the largest third clips
        gb = 6 * rows * 4 * width / 1e9
        print(f"{name}: {rows} x 4 x {width}, the kernel moves {gb:.2f} GB", flush=True)
        reference = jax.jit(silu_backward_fp8_reference)
        want = reference(dys, z, scale)
        bf16_ms = median_seconds(jax.jit(_bf16_silu_backward), dys, z, reps=args.reps) * 1e3
        xla_ms = median_seconds(reference, dys, z, scale, reps=args.reps) * 1e3
        print(f"  bf16 (XLA, no FP8): {bf16_ms:.3f} ms; FP8 in XLA: {xla_ms:.3f} ms", flush=True)
        for label, kernel, bm, bn, warps in variants:
            run = jax.jit(
                lambda d, z, s, k=kernel, bm=bm, bn=bn, w=warps: silu_backward_fp8(
                    d, z, s, implementation=k, interpret=cpu, block_rows=bm, block_cols=bn, num_warps=w
                )
            )
            try:
                wrong = _check(run(dys, z, scale), want)
            except Exception as e:  # a tile that does not compile: say so, go on
                print(f"  {label}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
                continue
            ok &= wrong is None
            ms = median_seconds(run, dys, z, scale, reps=args.reps) * 1e3
            print(
                f"  {label}: {ms:.3f} ms ({gb / ms * 1e3:.0f} GB/s), {xla_ms / ms:.2f}x FP8 in XLA, "
                f"{bf16_ms / ms:.2f}x bf16: " + ("ok" if wrong is None else f"WRONG ({wrong})"),
                flush=True,
            )
    return 0 if ok else 1
