"""Pallas Mosaic GPU (Hopper) kernel of SiLU's backward with FP8 output: the same outputs as gpu.py (Triton).

Why: jax deprecates Pallas's Triton backend, and on Hopper the project's kernels run Mosaic GPU (gpu.py stays
for pre-Hopper GPUs). The api runs this one only when asked by name ("mosaic", "mosaic_interpret"): it is not
yet run or measured on an H200.

Design: one CTA (one warpgroup) per [BM, BN] block, grid (row blocks, column blocks of [M, N]). TMA brings the
block of z and of the one gradient piece it falls in (a piece is its own array: no concatenation is written)
into shared memory; the warpgroup computes g = silu'(z) * dy in float32 registers in the WGMMA register layout
(rows of 64 per warpgroup, 8 columns a tile), writes q = saturate(g * inv_scale) in e5m2, and the column max
of |g| and column sums of g (cross-warp reductions); TMA stores the blocks.

The transposed e5m2 store (q^T): Mosaic GPU converts registers between the WGMMA layout and its transpose
(WGMMA_TRANSPOSED: the same lanes hold 2x2 transposed sub-tiles) only for 16- and 32-bit values, and stores a
value into a transposed shared-memory view (plgpu.transpose_ref) only from that transposed layout. So the
saturated float32 q is converted to WGMMA_TRANSPOSED while still 32-bit, cast to e5m2 there (the cast is
elementwise, the same rounding as q's), and stored through transpose_ref into a [BN, BM] buffer that TMA writes
to q^T. Lowered with Lane semantics, set explicitly (jax 0.10.2's default; 0.11.2 defaults to Warpgroup).

CPU checks: tests/test_silu_backward_fp8.py lowers the kernel for the GPU (`lower(lowering_platforms=
("cuda",))`) at gem_h200's shape and runs it in the Mosaic GPU interpreter against reference.py. The
interpreter has no register layouts nor transposed views (it runs jnp on whole arrays; q^T there is `.T`): it
checks the arithmetic, the block indexing and the TMA copies, not the layouts' code nor the transposed store,
which only the lowering and a GPU run check.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

E5M2 = jnp.float8_e5m2
BLOCK_ROWS = 64  # the WGMMA layout's rows per warpgroup
MAX_BOX = 256  # elements a TMA copy moves along each dimension at most
SMEM_BYTES = 96 * 1024  # the blocks of z, dy (bf16), q and q^T (e5m2) of one CTA at most
_SCALE_WORDS = 32  # inv_scale travels as 32 copies: a TMA copy moves a multiple of 128 bytes (the warpgroup)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static settings of one call (hashable): block_rows a multiple of 64, block_cols of 32 (a float32 row of
    partials is then a multiple of 128 bytes), both <= 256 (a TMA box), their 6 bytes an element <= 96 KiB of
    shared memory (two CTAs an SM)."""

    block_rows: int
    block_cols: int
    interpret: bool


def applies(rows: int, width: int, tiles: Tiles) -> bool:
    """Whether the kernel takes [rows, pieces x width] with these tiles."""
    bm, bn = tiles.block_rows, tiles.block_cols
    return (
        bm % BLOCK_ROWS == 0
        and bn % 32 == 0
        and 6 * bm * bn <= SMEM_BYTES
        and bm <= MAX_BOX
        and bn <= MAX_BOX
        and not rows % bm
        and not width % bn
    )


def silu_backward_fp8(
    dys: tuple[Float[Array, "M _"], ...], z: Float[Array, "M N"], inv_scale: Float[Array, ""], tiles: Tiles
) -> tuple[Array, Array, Float[Array, "B N"], Float[Array, "B N"]]:
    """(q [M, N], q^T [N, M], column maxima [M / BM, N], column sums [M / BM, N]); see reference.py."""
    m, n = z.shape
    width = n // len(dys)
    bm, bn = tiles.block_rows, tiles.block_cols
    per_piece, pieces = width // bn, len(dys)
    fp8_max = float(jnp.finfo(E5M2).max)

    def layout(value, which):
        return value if tiles.interpret else plgpu.layout_cast(value, which)

    def load(ref):  # a [BM, BN] block in the WGMMA layout, float32
        value = (
            ref[...] if tiles.interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA, optimized=False)
        )
        return value.astype(jnp.float32)

    def silu_backward_fp8_sm90(inv_ref, z_ref, *refs):
        dy_refs, (q_ref, qt_ref, max_ref, sum_ref) = refs[:pieces], refs[pieces : pieces + 4]
        inv_smem, z_smem, dy_smem, q_smem, qt_smem, max_smem, sum_smem, loaded = refs[pieces + 4 :]
        i, c = lax.axis_index("rows"), lax.axis_index("cols")
        piece, j = lax.div(c, per_piece), lax.rem(c, per_piece)
        rows, cols = pl.ds(i * bm, bm), pl.ds(c * bn, bn)
        plgpu.copy_gmem_to_smem(inv_ref, inv_smem, loaded.at[0])
        plgpu.copy_gmem_to_smem(z_ref.at[rows, cols], z_smem, loaded.at[0])
        for p, dy_ref in enumerate(dy_refs):  # only this block's piece is read

            @pl.when(piece == p)
            def _(dy_ref=dy_ref):
                plgpu.copy_gmem_to_smem(dy_ref.at[rows, pl.ds(j * bn, bn)], dy_smem, loaded.at[0])

        plgpu.barrier_wait(loaded.at[0])
        zf, dy = load(z_smem), load(dy_smem)
        s = 1.0 / (1.0 + jnp.exp(-zf))
        g = dy * (s * (1.0 + zf * (1.0 - s)))
        max_smem[...] = jnp.max(jnp.abs(g), axis=0)
        sum_smem[...] = jnp.sum(g, axis=0)
        qf = jnp.clip(g * inv_smem[0], -fp8_max, fp8_max)
        q_smem[...] = qf.astype(E5M2)
        qt = layout(qf, plgpu.Layout.WGMMA_TRANSPOSED).astype(E5M2)
        if tiles.interpret:  # no register layouts nor transposed views in the interpreter: jnp
            qt_smem[...] = qt.T
        else:
            plgpu.transpose_ref(qt_smem, (1, 0))[...] = qt
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, q_ref.at[rows, cols])
        plgpu.copy_smem_to_gmem(qt_smem, qt_ref.at[cols, rows])
        plgpu.copy_smem_to_gmem(max_smem, max_ref.at[i, cols])
        plgpu.copy_smem_to_gmem(sum_smem, sum_ref.at[i, cols])
        plgpu.wait_smem_to_gmem(0)

    partial = jax.ShapeDtypeStruct((m // bm, n), jnp.float32)
    return plgpu.kernel(
        silu_backward_fp8_sm90,
        out_type=(jax.ShapeDtypeStruct((m, n), E5M2), jax.ShapeDtypeStruct((n, m), E5M2), partial, partial),
        grid=(m // bm, n // bn),
        grid_names=("rows", "cols"),
        scratch_types=[
            plgpu.SMEM((_SCALE_WORDS,), jnp.float32),
            plgpu.SMEM((bm, bn), z.dtype),
            plgpu.SMEM((bm, bn), dys[0].dtype),
            plgpu.SMEM((bm, bn), E5M2),
            plgpu.SMEM((bn, bm), E5M2),
            plgpu.SMEM((bn,), jnp.float32),
            plgpu.SMEM((bn,), jnp.float32),
            plgpu.Barrier(num_arrivals=3, num_barriers=1),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name="silu_backward_fp8_sm90",
    )(jnp.broadcast_to(inv_scale.astype(jnp.float32), (_SCALE_WORDS,)), z, *dys)
