"""The public entry point: checks shapes, picks the kernel or the reference.

`silu_backward_fp8(dys, z, scale)` returns (q, q^T, amax, column sums) of g = silu'(z) * concat(dys), with
q = saturate(g / scale) in e5m2 (see reference.py). Not differentiable: it is the inside of a backward pass.
The Pallas kernel runs when the pieces have one width that its column tile divides and the row tile divides
the rows; the reference elsewhere.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from pallas_kernels import implementations
from pallas_kernels.silu_backward_fp8 import gpu
from pallas_kernels.silu_backward_fp8.gpu import Tiles
from pallas_kernels.silu_backward_fp8.reference import silu_backward_fp8_reference

_BLOCK_ROWS, _BLOCK_COLS = 64, 128  # 64 rows: the transposed store writes 64 contiguous bytes per row


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
    tiles (benchmarks); None: the defaults. Tiles that do not divide the shape run the reference."""
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
    kernel = implementations.resolve(implementation)
    widths = {d.shape[1] for d in dys}
    tiles = None
    if kernel != "reference" and not kernel.startswith("tpu") and len(widths) == 1:
        interpret = implementations.interpret(kernel)
        tiles = _tiles(z.shape[0], widths.pop(), interpret, block_rows, block_cols, num_warps)
    if tiles is None:
        return silu_backward_fp8_reference(dys, z, scale)

    inv_scale = 1.0 / jnp.asarray(scale, jnp.float32)
    q, qt, col_max, col_sum = gpu.silu_backward_fp8(dys, z, inv_scale, tiles)
    return q, qt, jnp.max(col_max), jnp.sum(col_sum, axis=0)
