"""The public entry point: checks shapes, picks the kernel or the reference.

`silu_backward_fp8(dys, z, scale)` returns (q, q^T, amax, column sums) of g = silu'(z) * concat(dys), with
q = saturate(g / scale) in e5m2 (see reference.py). Not differentiable: it is the inside of a backward pass.
The Pallas kernel runs when the pieces have one width that its column tile divides and the row tile divides
the rows; the reference elsewhere.

Which kernel (`kernel_for`): implementation names as every kernel package (pallas_kernels/implementations.py)
run the Triton kernel (gpu.py) on every GPU, Hopper included, and in its interpreter ("interpret"); the
reference on CPU and TPU. The GPU families by name as layer_norm's: "mosaic" (gpu_sm90.py, Mosaic GPU, Hopper)
and "triton", each also with "_interpret" (its interpreter, on CPU). The Mosaic kernel is not the Hopper
default yet: it is lowered and interpreted on CPU only, not run or measured on an H200. A family named
explicitly that does not take the shape is a ValueError.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from pallas_kernels import implementations
from pallas_kernels.silu_backward_fp8 import gpu
from pallas_kernels.silu_backward_fp8.gpu import Tiles
from pallas_kernels.silu_backward_fp8.reference import silu_backward_fp8_reference

_BLOCK_ROWS, _BLOCK_COLS = 64, 128  # 64 rows: the transposed store writes 64 contiguous bytes per row
GPU_FAMILIES = ("mosaic", "triton")  # the GPU kernels by name (each also with "_interpret")


def kernel_for(implementation: str | None) -> tuple[str, bool]:
    """(the kernel family a call runs: "mosaic", "triton" or "reference"; whether in interpret mode)."""
    if implementation is not None and implementation.removesuffix("_interpret") in GPU_FAMILIES:
        return implementation.removesuffix("_interpret"), implementation.endswith("_interpret")
    kernel = implementations.resolve(implementation)
    if kernel == "reference" or kernel.startswith("tpu"):
        return "reference", False
    return "triton", implementations.interpret(kernel)  # also on Hopper, until the Mosaic one is measured


def _mosaic_tiles(rows: int, widths: set[int], interpret: bool, block_rows, block_cols, num_warps):
    """gpu_sm90's tiles, or a ValueError saying why it does not take the call (it runs only when named)."""
    # platform-only: the Mosaic GPU kernel, loaded when a call names it
    from pallas_kernels.silu_backward_fp8 import gpu_sm90

    bn = block_cols or (32 if interpret else _BLOCK_COLS)  # interpret: small tiles keep CPU tests fast
    tiles = gpu_sm90.Tiles(block_rows=block_rows or gpu_sm90.BLOCK_ROWS, block_cols=bn, interpret=interpret)
    if num_warps is not None:
        raise ValueError("silu_backward_fp8: the Mosaic GPU kernel has no num_warps (one warpgroup per CTA)")
    if len(widths) != 1 or not gpu_sm90.applies(rows, next(iter(widths)), tiles):
        raise ValueError(
            f"silu_backward_fp8: the Mosaic GPU kernel does not take rows={rows}, piece widths {sorted(widths)} "
            f"with tiles {tiles} (pieces of one width; block_rows a multiple of 64 and block_cols of 32, both "
            "at most 256, dividing the rows and the width, within 96 KiB of shared memory)"
        )
    return tiles


def _tiles(rows: int, width: int, interpret: bool, block_rows, block_cols, num_warps):
    bm, bn = (8, 16) if interpret else (_BLOCK_ROWS, _BLOCK_COLS)
    bm, bn = block_rows or bm, block_cols or bn
    if rows % bm or width % bn:
        return None

    return Tiles(block_rows=bm, block_cols=bn, num_warps=num_warps or 4, interpret=interpret)


def silu_backward_fp8(
    dys: tuple[Float[ArrayLike, "M _"], ...],
    z: Float[ArrayLike, "M N"],
    scale: Float[ArrayLike, ""],
    *,
    implementation: str | None = None,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
) -> tuple[Array, Array, Float[Array, ""], Float[Array, " N"]]:
    """(q, q^T, amax, column sums); `dys` the pieces of SiLU's output gradient along N, `z` its input,
    `scale` the e5m2 dequantisation scale (q * scale ~ g). block_rows, block_cols, num_warps: the kernel's
    tiles (benchmarks); None: the defaults. Tiles that do not divide the shape run the reference (the Triton
    kernel's), or are a ValueError (the Mosaic kernel's, which has no num_warps)."""
    z = jnp.asarray(z)
    dys = tuple(jnp.asarray(d) for d in dys)
    if z.ndim != 2 or not dys or any(d.ndim != 2 or d.shape[0] != z.shape[0] for d in dys):
        raise ValueError(
            f"silu_backward_fp8: dys must be [M, n_i] and z [M, N], got {[d.shape for d in dys]}, {z.shape}"
        )
    if sum(d.shape[1] for d in dys) != z.shape[1]:
        raise ValueError(
            f"silu_backward_fp8: the pieces' widths {[d.shape[1] for d in dys]} must add up to z's {z.shape[1]}"
        )
    family, interpret = kernel_for(implementation)
    widths = {d.shape[1] for d in dys}
    inv_scale = 1.0 / jnp.asarray(scale, jnp.float32)
    if family == "mosaic":
        # platform-only: the Mosaic GPU kernel, loaded when a call names it
        from pallas_kernels.mosaic_common import interpreter
        from pallas_kernels.silu_backward_fp8 import gpu_sm90

        tiles = _mosaic_tiles(z.shape[0], widths, interpret, block_rows, block_cols, num_warps)
        with interpreter(interpret):
            q, qt, col_max, col_sum = gpu_sm90.silu_backward_fp8(dys, z, inv_scale, tiles)
        return q, qt, jnp.max(col_max), jnp.sum(col_sum, axis=0)

    tiles = None
    if family == "triton" and len(widths) == 1:
        tiles = _tiles(z.shape[0], widths.pop(), interpret, block_rows, block_cols, num_warps)
    if tiles is None:
        return silu_backward_fp8_reference(dys, z, scale)

    q, qt, col_max, col_sum = gpu.silu_backward_fp8(dys, z, inv_scale, tiles)
    return q, qt, jnp.max(col_max), jnp.sum(col_sum, axis=0)
