"""Pallas Mosaic GPU (Hopper: wgmma + TMA, warp-specialised, persistent) kernel of split(SiLU(LN(x) W + b)).

Why our own GEMM: cuBLAS reads A from and writes C to HBM, so around it XLA runs the layer norm (read the
float32 residual stream, write the bf16 normalised copy) and SiLU (read z, write SiLU(z), then the split's
slices). Here the normalisation happens on the A tile in shared memory and bias, SiLU and the split on the
accumulator in registers: the residual stream is read once, and z and the four SiLU pieces are written once.

Design:
* Grid: one CTA per SM (`num_ctas`) walking the (M tiles x N tiles) output tiles with plgpu.nd_loop, as jax's
  pallas/ops/gpu/hopper_matmul_mgpu.py. Three warpgroups: a TMA producer and two consumers, each owning
  BLOCK_M rows of the CTA's 2 * BLOCK_M (the prologue is per row, so rows split, not columns).
* K loop (plgpu.emit_pipeline_warp_specialized): the producer brings x's float32 tile, W's bf16 tile, the
  [gamma; beta] slice and the tile's row statistics into a ring of `stages` slots. A consumer loads its x rows
  into registers, normalises them ((x - mean) * rstd * gamma + beta), rounds to bf16 and stores them into its
  own swizzled A buffer (two slots, alternating with k), then issues the wgmma on that buffer and W's slot.
  One wgmma stays in flight (wgmma_wait(1)): ring slots are released one step late (delay_release=1), and the
  A slot written at step k was last read by the wgmma of step k - 2, which has completed. The last K step
  waits for its own wgmma (wgmma_wait(0)) before the pipeline releases step k_iters - 2: the pipeline never
  releases the last step's slot, and once its producer has seen step k_iters - 2 released it starts the
  next tile's TMA loads into every slot, so without that wait the last wgmma could read W's slot while the
  next tile's W tile lands in it (a race on the GPU in any persistent loop over this pipeline with
  delay_release=1; the consumer waits for that wgmma right after the pipeline anyway, so nothing that
  overlapped is serialised).
* Row statistics ([mean; rstd], float32 [2, M]) come from one XLA reduction over x (reference.row_stats):
  the kernel's K tiles see a row only piecewise. A consumer TMA-loads its rows' statistics and the tile's bias
  once per output tile (the pipeline carries only inputs that change with k). That pass reads x once more; the
  fused normalisation saves the bf16 copy's write and read, the epilogue saves two passes over [M, N].
* Epilogue, per EPI_N columns: z = acc + b (float32) is rounded once and written; SiLU(z) (h + h tanh(h),
  h = z / 2) goes to the output piece that holds those columns (the widths are multiples of the CTA's
  BLOCK_N, so a tile never straddles two pieces). Stores are TMA from a staging tile per consumer.

Contract: M a multiple of 2 * BLOCK_M, K of BLOCK_K, every width of BLOCK_N (api.py checks and runs the
reference otherwise). x float32, W bf16 or fp16.

CPU checks: tests/test_norm_gemm.py lowers the kernel at the shipped configs' shapes
(`lower(lowering_platforms=("cuda",))`, the shared-memory budget included) and runs it in Mosaic GPU
interpret mode against the reference: one tile; several in M and N over two pieces (race detector on); two
persistent CTAs looping over nine tiles with more K steps than stages; the api under jit, forward and
gradient. The interpreter's multi-tile and under-jit "stalls" were not the kernel: the interpreter runs each
warpgroup as an XLA program whose callbacks XLA:CPU may run on its intra-op thread pool (here it does, from
the first callback on), and a callback waiting at a barrier holds its pool thread. On a 2-core machine the
pool has 2 threads: two warpgroups waiting for the third leave it none, and nothing moves again (with one
tile the run passed only when the producer got a thread first). With a larger pool (NPROC, or the test
suite's 8 fake CPU devices) every case runs and matches; api._interpreter() refuses a pool that is too
small. jax's hopper_matmul_mgpu runs on 2 threads because XLA runs its warpgroups' programs inline on the
interpreter's own threads. The interpreter loads by TMA eagerly and runs wgmma synchronously, so it checks
barrier counts and phases, not the last-step race above. On the H200 (2026-12-05) it matches the reference
and runs 0.56-0.74x XLA's route (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_common import COL, ROW, cast_layout, load_vector, num_sms
from pallas_kernels.norm_gemm.tiles import Tiles

EPI_N = 64  # accumulator columns written per epilogue step (the staging tile's width: 128-byte swizzle)


def _silu(z):
    h = 0.5 * z
    return h + h * jnp.tanh(h)


def norm_silu_gemm_sm90(
    x,
    stats,
    affine,
    w,
    b,
    widths: tuple[int, ...],
    tiles: Tiles | None = None,
    *,
    interpret: bool = False,
):
    """(split(SiLU(z), widths), z), z = LN(x) W + b; stats: [mean; rstd] [2, M], affine: [gamma; beta] [2, K]."""
    tiles = tiles or Tiles()
    m, k = x.shape
    n = w.shape[1]
    dtype = w.dtype
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    if not tiles.applies(m, k, widths) or sum(widths) != n:
        raise ValueError(f"norm_silu_gemm_sm90: tiles {tiles} do not fit M={m}, K={k}, widths={widths}")
    m_iters, n_iters, k_iters = m // (2 * bm), n // bn, k // bk
    swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    swizzle_f32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    starts = tuple(sum(widths[:i]) for i in range(len(widths)))

    def kernel(x_ref, stats_ref, affine_ref, w_ref, b_ref, z_ref, *piece_refs):
        def scope(pipeline_allocs, a_smem, stats_smem, bias_smem, out_smem, loaded):
            wg = lax.axis_index("wg")
            rows = pl.ds(wg * bm, bm)

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cta")
            def _tile(loop_info):
                (idx,) = loop_info.index
                mi, ni = idx // n_iters, idx % n_iters
                cta_rows = pl.ds(mi * 2 * bm, 2 * bm)
                cols = pl.ds(ni * bn, bn)

                def body(idxs, xs, afs, ws, acc_ref):
                    (ki,) = idxs
                    xt = load_vector(interpret, xs.at[rows], plgpu.Layout.WGMMA)
                    mean, rstd = (
                        _broadcast(stats_smem.at[wg, i], ROW, (bm, bk), 0, interpret) for i in (0, 1)
                    )
                    gamma, beta = (_broadcast(afs.at[i], COL, (bm, bk), 1, interpret) for i in (0, 1))
                    a_slot = a_smem.at[wg, lax.rem(ki, 2)]
                    a_slot[...] = (((xt - mean) * rstd) * gamma + beta).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, a_slot, ws)
                    plgpu.wgmma_wait(1)

                    # The pipeline releases step k's ring slot after body(k + 1) (delay_release=1), so it never
                    # releases the last step's: the producer's quiesce awaits releases up to step k_iters - 2
                    # only, then starts the next tile's prologue, whose TMA loads overwrite every slot, W's
                    # slot of the last step included, unawaited. Completing the last wgmma here, before the
                    # release of step k_iters - 2 that follows this body, keeps that load off W's slot until
                    # the wgmma has read it. (compute() waits for it right after the pipeline anyway.)
                    @pl.when(ki == k_iters - 1)
                    def _():
                        plgpu.wgmma_wait(0)

                    return acc_ref

                def compute(run_pipeline):
                    # this tile's row statistics and bias, once per tile (the pipeline only carries
                    # inputs that change with k)
                    out_rows = pl.ds(mi * 2 * bm + wg * bm, bm)
                    plgpu.copy_gmem_to_smem(stats_ref.at[:, out_rows], stats_smem.at[wg], loaded.at[2 * wg])
                    plgpu.copy_gmem_to_smem(b_ref.at[cols], bias_smem.at[wg], loaded.at[2 * wg + 1])
                    plgpu.barrier_wait(loaded.at[2 * wg])
                    plgpu.barrier_wait(loaded.at[2 * wg + 1])

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                    def _acc(acc_ref):
                        run_pipeline(acc_ref)
                        plgpu.wgmma_wait(0)
                        _epilogue(acc_ref[...], bias_smem.at[wg], out_smem, mi, ni, wg)

                pipeline(body, compute)(
                    x_ref.at[cta_rows],
                    affine_ref,
                    w_ref.at[:, cols],
                    allocations=pipeline_allocs,
                )

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def _epilogue(acc, bias_ref, staging, mi, ni, wg):
            out_rows = pl.ds(mi * 2 * bm + wg * bm, bm)
            for e in range(bn // EPI_N):
                sl = slice(e * EPI_N, (e + 1) * EPI_N)
                bias = _broadcast(bias_ref.at[sl], COL, (bm, EPI_N), 1, interpret)
                z = acc[:, sl] + bias
                col = ni * bn + e * EPI_N
                plgpu.wait_smem_to_gmem(
                    0, wait_read_only=True
                )  # the staging tiles' last stores have read them
                # (one indexer per ref: the interpreter mishandles `ref.at[i][j] = ...` on a transformed ref)
                z_slot, silu_slot = staging.at[wg, 0], staging.at[wg, 1]
                z_slot[...] = z.astype(dtype)
                silu_slot[...] = _silu(z).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(z_slot, z_ref.at[out_rows, pl.ds(col, EPI_N)])
                plgpu.commit_smem_to_gmem_group()
                for start, width, piece in zip(starts, widths, piece_refs):

                    @pl.when((col >= start) & (col < start + width))
                    def _(start=start, piece=piece):
                        plgpu.copy_smem_to_gmem(silu_slot, piece.at[out_rows, pl.ds(col - start, EPI_N)])

                plgpu.commit_smem_to_gmem_group()

        ignore = lambda *_, **__: None  # noqa: E731 (the allocations do not depend on the body)
        pl.run_scoped(
            scope,
            pipeline(ignore, ignore).get_allocations(
                x_ref.at[pl.ds(0, 2 * bm)], affine_ref, w_ref.at[:, pl.ds(0, bn)]
            ),
            plgpu.SMEM((2, 2, bm, bk), dtype, transforms=swizzle),
            plgpu.SMEM((2, 2, bm), jnp.float32),
            plgpu.SMEM((2, bn), jnp.float32),
            plgpu.SMEM((2, 2, bm, EPI_N), dtype, transforms=swizzle),
            plgpu.Barrier(num_barriers=4),
            collective_axes="wg",
        )

    def pipeline(body, compute):
        def spec(shape, index):
            return plgpu.BlockSpec(shape, index, delay_release=1)

        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (2 * bm, bk), lambda ki: (0, ki), transforms=swizzle_f32, delay_release=1
                ),  # swizzled: the WGMMA-layout load of an unswizzled float32 tile has bank conflicts
                spec((2, bk), lambda ki: (0, ki)),
                plgpu.BlockSpec((bk, bn), lambda ki: (ki, 0), transforms=swizzle, delay_release=1),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=tiles.stages,
            compute_context=compute,
        )

    out_types = (jax.ShapeDtypeStruct((m, n), dtype),) + tuple(
        jax.ShapeDtypeStruct((m, wd), dtype) for wd in widths
    )
    z, *pieces = plgpu.kernel(
        kernel,
        out_type=out_types,
        grid=(min(tiles.num_ctas or num_sms(), m_iters * n_iters),),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(stats, jnp.float32),
        jnp.asarray(affine, jnp.float32),
        w,
        jnp.asarray(b, jnp.float32),
    )
    return tuple(pieces), z


def _broadcast(ref, layout, shape, dim: int, interpret: bool):
    """A float32 vector in shared memory, loaded in the wgmma row (dim 0) or column (dim 1) layout and
    broadcast to `shape`."""
    return lax.broadcast_in_dim(
        cast_layout(interpret, load_vector(interpret, ref, layout), layout), shape, [dim]
    )
