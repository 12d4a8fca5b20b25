"""Pallas Mosaic GPU (Hopper: wgmma + TMA, warp-specialised, persistent) kernel of the dX side of the backward of
split(SiLU(z), widths), z = LN(x) W + b:

    dz  = concat(d_pieces) * SiLU'(z)      rounded to W's dtype, written once (cuBLAS's dW = xn^T dz reads it)
    dxn = dz W^T                           float32 [M, D] (LayerNorm's backward follows in XLA)
    db  = column sums of dz                as float32 partials [M / BLOCK_M, N], summed by XLA (no atomics)

Why: XLA writes dz from one fusion (0.59 ms a layer at gem_h200's shape on the H200), reads it back for the
bias gradient's column sums (0.20 ms) and once more in cuBLAS's dz W^T. Here dz is made in the GEMM's
prologue, in shared memory, from the cotangents and z: it is written once (by TMA, from the wgmma's own A
buffer), its column sums come from the registers that made it, and dz W^T needs no read of it.

Design:
* Grid: one CTA per SM (`num_ctas`) walking the (M tiles x D tiles) output tiles, D tiles fastest (the CTAs
  that share a row block run at the same time, so the second one's cotangent and z reads hit L2). Three
  warpgroups: a TMA producer and two consumers, each owning BLOCK_M rows of the CTA's 2 * BLOCK_M.
* K loop over N, a ring of `stages` slots run by hand (as the jagged attention forward's, not
  emit_pipeline_warp_specialized): the ring and its barrier phases run on across output tiles, so the producer
  fetches the next tile's first steps during the consumers' epilogue. A slot holds the step's cotangent tile
  (read straight from the piece that holds those columns: a K tile never straddles two pieces, block_k divides
  every width), z's tile and W^T's [block_k, block_n] tile (W^T from one XLA transpose of the small W: a plain
  B operand, which the Mosaic GPU interpreter also runs, where it has no transposed wgmma operand).
* Prologue, per consumer and step: load its rows of the cotangent and z tiles, dz = dy * SiLU'(z) in float32
  (sigmoid through tanh.approx: one MUFU op), rounded to bf16 and stored over its own rows of the cotangent
  slot (same swizzled layout); then the wgmma of that A tile with W^T's slot. One wgmma stays in flight
  (wgmma_wait(1)); a consumer releases a slot once the wgmma that read it has completed and the dz store from
  it has read it, i.e. one step late; the last step's slot after the tile's wgmma_wait(0).
* dz and the bias partials: several D tiles of a row block recompute the same dz tile (one wgmma's 64 x
  BLOCK_N float32 accumulator is 128 registers a thread at BLOCK_N = 256: a whole D = 512 or 1024 row does not
  fit in one consumer). Only the first D tile (ni == 0) stores dz (TMA from the A tile) and its column sums
  (a cross-warp reduction in the consumer's own scratch: Pallas's jnp.sum over the wgmma rows would use one
  scratch for both consumers) to partial row 2 mi + wg.
* Epilogue: the accumulator goes out in EPI_N-column float32 tiles through one swizzled staging tile per
  consumer.

Shared memory (defaults 64 x 256 x 64, 3 stages, bf16): a slot is 2 x 128 x 64 x 2 (cotangent, z) + 64 x 256 x 2
(W^T) = 64 KiB, the ring 192 KiB; staging 2 x 64 x 32 x 4 = 16 KiB, partials 2 x 2 x 64 x 4 = 1 KiB,
reduction scratch 2 x RED_SCRATCH x 4 = 8 KiB: 217 KiB (Mosaic GPU counts 222,272 bytes) of the 227. A fourth
stage or a second staging slot does not fit; 2 stages free 64 KiB but hide less load latency (bench norm_gemm
times both). Why 2 x 64 rows by 256 columns: a CTA tile of R rows and C columns loads R x 64 x 4 bytes of
cotangent and z and 64 x C x 2 of W^T per step for 2 R C 64 flops; with R C fixed by the accumulators' registers
(2 x 64 x 256), R = 128, C = 256 loads least per flop (64 flop/byte). The cost of the recomputation: the
cotangents and z are read D / BLOCK_N times (2 at gem_h200's D = 512, 4 at hstu_nvidia's 1024; after the first,
from L2 when the row block's tiles run together) and W^T once per row block (from L2).

Contract: M a multiple of 2 * BLOCK_M, D of BLOCK_N, every width of BLOCK_K (api.py checks, else jnp).

CPU checks: tests/test_norm_gemm_backward.py lowers the kernel at the shipped configs' shapes
(`lower(lowering_platforms=("cuda",))`, the shared-memory budget included) and runs it in Mosaic GPU interpret
mode against reference.silu_backward_reference, several output tiles, more tiles than CTAs and several K steps
included. On the H200 (2026-12-05) it matches the reference and runs 0.70-0.96x XLA's jnp (docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from pallas_kernels.mosaic_common import COL, load_vector, num_sms
from pallas_kernels.norm_gemm.tiles import BACKWARD_EPI_N, COMPUTE_WGS, BackwardTiles

EPI_N = BACKWARD_EPI_N  # accumulator columns stored per epilogue step (the staging tile's 128-byte swizzle)
RED_SCRATCH = (
    1024  # floats of a consumer's reduction scratch: 4 of the column sums' 8 cross-warp exchanges at once
)


def silu_grad(z):
    """SiLU'(z) = s (1 + z (1 - s)), s = sigmoid(z) = (1 + tanh(z / 2)) / 2 (tanh.approx: one MUFU op)."""
    s = 0.5 + 0.5 * jnp.tanh(0.5 * z)
    return s * (1.0 + z * (1.0 - s))


def silu_gemm_backward_sm90(
    d_pieces: tuple[Float[Array, "M _"], ...],
    z: Float[Array, "M N"],
    w: Float[Array, "D N"],
    tiles: BackwardTiles | None = None,
    *,
    interpret: bool = False,
) -> tuple[Float[Array, "M D"], Float[Array, "M N"], Float[Array, "P N"]]:
    """(dxn float32 [M, D], dz [M, N] in W's dtype, float32 column-sum partials of dz [M / block_m, N]) from
    the pieces' cotangents (widths adding up to N), the forward's z and W [D, N] (the forward's weight)."""
    tiles = tiles or BackwardTiles()
    widths = tuple(int(p.shape[1]) for p in d_pieces)
    m, n = z.shape
    d = w.shape[0]
    dtype = w.dtype
    bm, bn, bk, stages = tiles.block_m, tiles.block_n, tiles.block_k, tiles.stages
    if sum(widths) != n or w.shape[1] != n or not tiles.applies(m, d, widths):
        raise ValueError(f"silu_gemm_backward_sm90: tiles {tiles} do not fit M={m}, D={d}, widths={widths}")
    m_iters, n_iters, k_iters = m // (COMPUTE_WGS * bm), d // bn, n // bk
    num_tiles = m_iters * n_iters
    num_ctas = min(tiles.num_ctas or num_sms(), num_tiles)
    swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    swizzle_f32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    starts = tuple(sum(widths[:i]) for i in range(len(widths)))

    def kernel(*refs):
        piece_refs, (z_ref, wt_ref, dxn_ref, dz_ref, part_ref) = refs[: len(widths)], refs[len(widths) :]

        def scope(dy_ring, z_ring, w_ring, out_smem, part_smem, red_smem, full, free):
            wg = lax.axis_index("wg")
            cta = lax.axis_index("cta")
            num_iters = (
                num_tiles - cta + num_ctas - 1
            ) // num_ctas  # this CTA's tiles: cta, cta + num_ctas, ...

            def tile_of(i):
                idx = cta + i * num_ctas
                return idx // n_iters, idx % n_iters

            def slot_of(g):
                return lax.rem(g, jnp.int32(stages))

            @pl.when(wg == COMPUTE_WGS)
            def _producer():
                plgpu.set_max_registers(40, action="decrease")

                @pl.loop(0, num_iters)
                def _tile(i):
                    mi, ni = tile_of(i)
                    rows = pl.ds(mi * COMPUTE_WGS * bm, COMPUTE_WGS * bm)

                    @pl.loop(0, k_iters)
                    def _step(ki):
                        g = i * k_iters + ki  # the CTA's running step count: ring slot and barrier phase
                        slot = slot_of(g)

                        @pl.when(g >= stages)
                        def _():
                            plgpu.barrier_wait(free.at[slot])

                        for start, width, piece in zip(starts, widths, piece_refs):

                            @pl.when((ki >= start // bk) & (ki < (start + width) // bk))
                            def _(start=start, piece=piece):
                                src = piece.at[rows, pl.ds(ki * bk - start, bk)]
                                plgpu.copy_gmem_to_smem(src, dy_ring.at[slot], full.at[slot])

                        plgpu.copy_gmem_to_smem(
                            z_ref.at[rows, pl.ds(ki * bk, bk)], z_ring.at[slot], full.at[slot]
                        )
                        plgpu.copy_gmem_to_smem(
                            wt_ref.at[pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)], w_ring.at[slot], full.at[slot]
                        )

                total = num_iters * k_iters

                @pl.loop(jnp.maximum(total - stages, 0), total)
                def _(g):  # observe the last releases too: the barriers end in a consistent phase
                    plgpu.barrier_wait(free.at[slot_of(g)])

            @pl.when(wg < COMPUTE_WGS)
            def _consumer():
                plgpu.set_max_registers(232, action="increase")
                own = pl.ds(wg * bm, bm)  # this consumer's rows of a ring slot

                @pl.loop(0, num_iters)
                def _tile(i):
                    mi, ni = tile_of(i)
                    out_rows = pl.ds(mi * COMPUTE_WGS * bm + wg * bm, bm)
                    first = ni == 0  # the one D tile of the row block that stores dz and the partials

                    def k_loop(acc_ref):
                        @pl.loop(0, k_iters)
                        def _step(ki):
                            g = i * k_iters + ki
                            slot = slot_of(g)
                            plgpu.barrier_wait(full.at[slot])
                            a_tile = dy_ring.at[slot, own]  # (one indexer: see _epilogue)
                            dy = load_vector(interpret, a_tile, plgpu.Layout.WGMMA).astype(jnp.float32)
                            zt = load_vector(interpret, z_ring.at[slot, own], plgpu.Layout.WGMMA)
                            dz = (dy * silu_grad(zt.astype(jnp.float32))).astype(dtype)
                            a_tile[...] = dz
                            plgpu.commit_smem()
                            plgpu.wgmma(acc_ref, a_tile, w_ring.at[slot])

                            @pl.when(first)
                            def _():
                                part = part_smem.at[wg, lax.rem(ki, 2)]
                                part[...] = _column_sums(interpret, dz.astype(jnp.float32), red_smem.at[wg])
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(a_tile, dz_ref.at[out_rows, pl.ds(ki * bk, bk)])
                                plgpu.copy_smem_to_gmem(
                                    part, part_ref.at[mi * COMPUTE_WGS + wg, pl.ds(ki * bk, bk)]
                                )
                                plgpu.commit_smem_to_gmem_group()
                                # the previous step's stores have read its A tile and partial slot
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                            plgpu.wgmma_wait(1)  # the previous step's wgmma is done

                            @pl.when(ki > 0)
                            def _():
                                plgpu.barrier_arrive(free.at[slot_of(g - 1)])

                        plgpu.wgmma_wait(0)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        plgpu.barrier_arrive(free.at[slot_of(i * k_iters + k_iters - 1)])
                        return acc_ref[...]

                    acc = pl.run_scoped(k_loop, plgpu.ACC((bm, bn), jnp.float32))
                    _epilogue(acc, out_smem.at[wg], dxn_ref, out_rows, ni)

                plgpu.wait_smem_to_gmem(0)

        def _epilogue(acc, staging, dxn_ref, out_rows, ni):
            for e in range(bn // EPI_N):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read the staging tile
                # (`staging` is out_smem.at[wg]: the interpreter deadlocks on `ref.at[i][j] = ...` chains)
                staging[...] = acc[:, e * EPI_N : (e + 1) * EPI_N]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(staging, dxn_ref.at[out_rows, pl.ds(ni * bn + e * EPI_N, EPI_N)])
                plgpu.commit_smem_to_gmem_group()

        pl.run_scoped(
            scope,
            plgpu.SMEM((stages, COMPUTE_WGS * bm, bk), dtype, transforms=swizzle),
            plgpu.SMEM((stages, COMPUTE_WGS * bm, bk), z.dtype, transforms=swizzle),
            plgpu.SMEM((stages, bk, bn), dtype, transforms=swizzle),
            plgpu.SMEM((COMPUTE_WGS, bm, EPI_N), jnp.float32, transforms=swizzle_f32),
            plgpu.SMEM((COMPUTE_WGS, 2, bk), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, RED_SCRATCH), jnp.float32),
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),  # cotangent, z, W^T copies
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            collective_axes="wg",
        )

    out_types = (
        jax.ShapeDtypeStruct((m, d), jnp.float32),
        jax.ShapeDtypeStruct((m, n), dtype),
        jax.ShapeDtypeStruct((m // bm, n), jnp.float32),
    )
    return plgpu.kernel(
        kernel,
        out_type=out_types,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*(p.astype(dtype) for p in d_pieces), z.astype(dtype), w.T)


def _column_sums(interpret: bool, x, scratch):
    """Column sums of a float32 [64, n] wgmma-layout tile ([n], column layout). The rows are spread over the
    warpgroup's four warps: the cross-warp step goes through `scratch`, this consumer's own (Pallas's jnp.sum
    would use one scratch region for every warpgroup at that program point, and two consumers race on it)."""
    if interpret:
        return jnp.sum(x, axis=0)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((x.shape[1],), jnp.float32, COL),
    )
    def sums(ctx, tile, scratch_ref):
        del ctx
        return tile.reduce("add", 0, scratch_ref)

    return sums(x, scratch)
