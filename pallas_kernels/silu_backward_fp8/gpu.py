"""Pallas GPU (Triton lowering) kernel of SiLU's backward with FP8 output.

Grid (row blocks, pieces, column blocks of a piece): each program reads one [BM, BN] block of one piece of
SiLU's output gradient (the layer splits SiLU's output into pieces of equal width, and each piece's gradient
arrives as its own array, so no concatenation is ever written) and the same block of the pre-activation z,
and writes the e5m2 gradient block, its transpose (the operand layout cuBLASLt FP8 needs for the weight
gradient, which contracts over rows) and one row of column maxima and column sums per row block. Against
XLA's fusions for the same math (the concatenated bf16 gradient, then the amax and cast, the transpose and
the bias reduction, each a pass over HBM) it reads the inputs once and writes 2 bytes per element.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static settings of one call (hashable)."""

    block_rows: int
    block_cols: int
    num_warps: int
    interpret: bool


def _kernel(inv_scale_ref, z_ref, *refs, pieces: int):
    dy_refs, (q_ref, qt_ref, amax_ref, sum_ref) = refs[:pieces], refs[pieces:]
    piece = pl.program_id(1)
    z = z_ref[...].astype(jnp.float32)
    s = jax.nn.sigmoid(z)
    silu_prime = s * (1.0 + z * (1.0 - s))
    fp8_max = float(jnp.finfo(E5M2).max)
    for p, dy_ref in enumerate(dy_refs):  # only the program's own piece is read (Triton loads lazily)

        @pl.when(piece == p)
        def _(dy_ref=dy_ref):
            g = dy_ref[...].astype(jnp.float32) * silu_prime
            amax_ref[...] = jnp.max(jnp.abs(g), axis=0)
            sum_ref[...] = jnp.sum(g, axis=0)
            q = jnp.clip(g * inv_scale_ref[...][None, :], -fp8_max, fp8_max).astype(E5M2)
            q_ref[...] = q
            qt_ref[...] = q.T


def silu_backward_fp8(dys, z, inv_scale, tiles: Tiles):
    """(q [M, N], q^T [N, M], column maxima [M / BM, N], column sums [M / BM, N]); see reference.py."""
    m, n = z.shape
    width = n // len(dys)
    bm, bn = tiles.block_rows, tiles.block_cols
    per_piece = width // bn

    def col(i, p, j):  # the block column of (piece p, its block j) in [M, N]
        return p * per_piece + j

    piece_spec = pl.BlockSpec((bm, bn), lambda i, p, j: (i, j))
    partial = jax.ShapeDtypeStruct((m // bm, n), jnp.float32)
    partial_spec = pl.BlockSpec((None, bn), lambda i, p, j: (i, col(i, p, j)))
    return pl.pallas_call(
        functools.partial(_kernel, pieces=len(dys)),
        grid=(m // bm, len(dys), per_piece),
        in_specs=[
            pl.BlockSpec((bn,), lambda i, p, j: (0,)),
            pl.BlockSpec((bm, bn), lambda i, p, j: (i, col(i, p, j))),
        ]
        + [piece_spec] * len(dys),
        out_specs=[
            pl.BlockSpec((bm, bn), lambda i, p, j: (i, col(i, p, j))),
            pl.BlockSpec((bn, bm), lambda i, p, j: (col(i, p, j), i)),
            partial_spec,
            partial_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((m, n), E5M2),
            jax.ShapeDtypeStruct((n, m), E5M2),
            partial,
            partial,
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=tiles.interpret,
        name="silu_backward_fp8",
    )(jnp.broadcast_to(inv_scale, (bn,)), z, *dys)
