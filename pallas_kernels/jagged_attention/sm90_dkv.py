"""The Hopper backward's dK/dV kernels: over key tiles, the query tiles streamed (gpu_sm90_backward.py's
docstring: "dK/dV over key tiles", and at head dim 256 the role-split kernel, "Head dim 256")."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.sm90_backward_common import (
    COMPUTE_WGS,
    RES,
    Frame,
    accumulate,
    cta_range,
    load_bias_res,
    one_product,
    p_and_factor,
    q_clipped_start,
    q_free,
    q_tiles,
    rows_of,
    score_grads,
    store_slices,
    tile_bias,
    ts_tile,
    two_products,
    zero_tail,
)
from pallas_kernels.jagged_attention.sm90_common import ALIGN, store_rows
from pallas_kernels.mosaic_common import COL, ROW, cast_layout, iota, load_vector, persistent


def dkv_kernel(
    work_ref,
    offsets_ref,
    targets_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    ts_ref,
    pos_ref,
    time_ref,
    dk_ref,
    dv_ref,
    scoped,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    num_zero: int,
    block_q: int,
    stages: int,
    total_rows: int,
    interpret: bool,
    num_ctas: int | None,
):
    wg = lax.axis_index("wg")
    buffers, (res_bar, s_bar, s_free) = scoped
    k_res2, v_res2, stage_bufs, q_smem, do_smem, lse_smem, delta_smem, bias_bufs = buffers
    tsk_res2, tsq_smem, pos_tabs, time_tabs = bias_bufs  # (None where the call has no such bias)
    has_bias = params.has_pos or params.has_time
    dqk, dv = k_res2.shape[-1], v_res2.shape[-1]
    bq = block_q
    dtype = q_ref.dtype
    num_seqs = offsets_ref.shape[0] - 1
    softmax = params.activation == "softmax"
    num_iters, item_of = persistent(num_ctas, num_work + num_zero, heads)

    def info(i):
        h, w = item_of(i)
        f = Frame(work_ref, offsets_ref, targets_ref, params, num_work, h, w)
        return (f, *cta_range(f, q_tiles, bq, params))

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def load_res(i):
        """Starts the TMAs of this consumer's resident K and V rows of the CTA's i-th item (if it is real)."""
        f, _, _ = info(i)

        @pl.when(f.valid & (i < num_iters))
        def _():
            row = pl.multiple_of(f.base + f.tile_lo + wg * RES, ALIGN)
            plgpu.copy_gmem_to_smem(rows_of(k_ref, row, RES, f.h, dqk), k_res2.at[wg], res_bar.at[wg])
            plgpu.copy_gmem_to_smem(rows_of(v_ref, row, RES, f.h, dv), v_res2.at[wg], res_bar.at[wg])
            load_bias_res(ts_ref, pos_ref, time_ref, row, f.h, tsk_res2, pos_tabs, time_tabs, wg, res_bar)

    def consumer_item(i, f: Frame, cta_lo, cta_hi, g0):
        k_res, v_res = k_res2.at[wg], v_res2.at[wg]
        k_lo = f.tile_lo + wg * RES  # frame row of this consumer's first key
        first_row = jnp.clip(
            f.d - k_lo, 0, RES
        )  # this consumer's keys of the sequence: [first_row, last_row)
        last_row = jnp.clip(f.end - k_lo, 0, RES)
        lo, hi = q_tiles(f, k_lo, RES, bq, params)
        empty = hi <= lo  # (the second consumer past the sequence's end)
        lo, hi = jnp.where(empty, cta_lo, lo), jnp.where(empty, cta_lo, hi)
        f_lo, f_hi = q_free(f, k_lo, RES, bq, lo, hi, params)

        def slot_at(n):
            return slot_of(g0 + n - cta_lo)

        def drain(n):  # a tile only the other consumer needs: release it once it is in its slot
            slot = slot_at(n)
            plgpu.barrier_wait(s_bar.at[slot])
            plgpu.barrier_arrive(s_free.at[slot])

        plgpu.barrier_wait(res_bar.at[wg])  # started by load_res(i) at the end of the previous item
        pl.loop(cta_lo, lo)(drain)

        def body(n, carry, masked: bool, clipped: bool = False):
            dk_acc, dv_acc = carry
            slot = slot_at(n)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            plgpu.barrier_wait(s_bar.at[slot])
            st, dpt = two_products(interpret, k_res, q_tile, v_res, do_tile, (RES, bq))
            lse = delta = None
            if softmax:
                lse = load_vector(interpret, lse_smem.at[slot], COL)
                delta = load_vector(interpret, delta_smem.at[slot], COL)
            mask = None
            if masked:  # rows: keys, columns: queries (sequence positions)
                keys = (k_lo - f.d) + iota(interpret, (RES, bq), 0)
                queries = (n * bq - f.d) + iota(interpret, (RES, bq), 1)
                mask = tiling.allowed_2d(queries, keys, f.length, f.first_target, params) & (keys >= 0)
            z = st * params.alpha
            if has_bias:  # rows: keys, columns: queries
                rel = (n * bq - k_lo) + iota(interpret, (RES, bq), 1) - iota(interpret, (RES, bq), 0)
                ts_q = ts_k = None
                if params.has_time:  # (rows: keys, columns: queries)
                    ts_q = ts_tile(interpret, tsq_smem.at[slot], COL, (RES, bq), 1)
                    ts_k = ts_tile(interpret, tsk_res2.at[wg], ROW, (RES, bq), 0)
                pos_tab = pos_tabs.at[wg] if params.has_pos else None
                time_tab = time_tabs.at[wg] if params.has_time else None
                z = z + tile_bias(interpret, params, pos_tab, time_tab, rel, ts_q, ts_k, clipped)[0]
            pt, dst = score_grads(z, dpt, mask, lse, delta, params, 1)
            dv_acc, dk_acc = accumulate(
                interpret, (dv_acc, dk_acc), (pt.astype(dtype), dst.astype(dtype)), (do_tile, q_tile)
            )
            plgpu.barrier_arrive(s_free.at[slot])
            return dk_acc, dv_acc

        zeros = lambda d: cast_layout(interpret, jnp.zeros((RES, d), jnp.float32), plgpu.Layout.WGMMA)
        carry = (zeros(dqk), zeros(dv))
        c_lo = q_clipped_start(k_lo, RES, bq, f_lo, f_hi, params)  # far below the diagonal: a scalar pos bias
        carry = lax.fori_loop(lo, f_lo, functools.partial(body, masked=True), carry)
        carry = lax.fori_loop(f_lo, c_lo, functools.partial(body, masked=False), carry)
        if params.has_pos:
            carry = lax.fori_loop(c_lo, f_hi, functools.partial(body, masked=False, clipped=True), carry)
        carry = lax.fori_loop(f_hi, hi, functools.partial(body, masked=True), carry)
        pl.loop(hi, cta_hi)(drain)
        load_res(i + 1)  # the last wgmmas have read K and V: fetch the next item's rows during the epilogue
        scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
        dk = (carry[0] * (params.alpha * scale)).astype(dtype)
        dvv = (carry[1] * scale).astype(dtype)

        def epilogue(c):
            stage = stage_bufs[c]
            for val, ref, d in ((dk, dk_ref, dqk), (dvv, dv_ref, dv)):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores have read the buffer
                buf = stage if d == stage.shape[1] else stage.at[:, pl.ds(0, d)]
                buf[...] = val
                plgpu.commit_smem()
                store_rows(
                    buf,
                    lambda off, size, ref=ref, d=d: rows_of(
                        ref, f.base + k_lo + first_row + off, size, f.h, d
                    ),
                    jnp.maximum(last_row - first_row, 0),
                    RES,
                    first=first_row,
                )

        for c in range(COMPUTE_WGS):  # static buffers: one branch per consumer
            pl.when(wg == c)(functools.partial(epilogue, c))

    @pl.when(wg < COMPUTE_WGS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")

        def one(i, g):
            f, cta_lo, cta_hi = info(i)
            pl.when(f.valid)(lambda: consumer_item(i, f, cta_lo, cta_hi, g))

            @pl.when((f.w >= num_work) & (wg == 0))
            def _():
                outs = ((dk_ref, f.h, dqk), (dv_ref, f.h, dv))
                zero_tail(
                    stage_bufs[0], outs, offsets_ref, f.w - num_work,
                    num_seqs=num_seqs, total_rows=total_rows, interpret=interpret,
                )  # fmt: skip

            return g + cta_hi - cta_lo

        load_res(0)
        lax.fori_loop(0, num_iters, one, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        ins = (q_ref, do_ref, lse_ref, delta_ref, ts_ref)
        bufs = (q_smem, do_smem, lse_smem, delta_smem, tsq_smem)
        stream_queries(info, num_iters, ins, bufs, s_bar, s_free, bq, stages, params)


def stream_queries(info, num_iters, ins, bufs, s_bar, s_free, bq: int, stages: int, params: KernelParams):
    """The dK/dV kernels' producer: the query tiles [cta_lo, cta_hi) of each item (info(i) -> (frame, cta_lo,
    cta_hi)) into the ring: Q, dO (and lse, delta for softmax; the timestamps with a time bias)."""
    q_ref, do_ref, lse_ref, delta_ref, ts_ref = ins
    q_smem, do_smem, lse_smem, delta_smem, tsq_smem = bufs
    dqk, dv = q_smem.shape[-1], do_smem.shape[-1]
    softmax = params.activation == "softmax"

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def one(i, g):
        f, cta_lo, cta_hi = info(i)

        @pl.loop(cta_lo, cta_hi)
        def _(n):
            j = g + n - cta_lo  # the CTA's running streamed-tile count
            slot = slot_of(j)
            row = pl.multiple_of(f.base + n * bq, ALIGN)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(s_free.at[slot])

            plgpu.copy_gmem_to_smem(rows_of(q_ref, row, bq, f.h, dqk), q_smem.at[slot], s_bar.at[slot])
            plgpu.copy_gmem_to_smem(rows_of(do_ref, row, bq, f.h, dv), do_smem.at[slot], s_bar.at[slot])
            if softmax:
                vec = pl.ds(row, bq)
                plgpu.copy_gmem_to_smem(lse_ref.at[f.h, vec], lse_smem.at[slot], s_bar.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[f.h, vec], delta_smem.at[slot], s_bar.at[slot])
            if params.has_time:
                plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, bq)], tsq_smem.at[slot], s_bar.at[slot])

        return g + cta_hi - cta_lo

    g = lax.fori_loop(0, num_iters, one, jnp.int32(0))

    @pl.loop(jnp.maximum(g - stages, 0), g)
    def _(step):  # observe the last releases too: the barriers then end in a consistent phase
        plgpu.barrier_wait(s_free.at[slot_of(step)])


def dkv_split_kernel(
    work_ref,
    offsets_ref,
    targets_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    scoped,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    num_zero: int,
    block_q: int,
    stages: int,
    total_rows: int,
    interpret: bool,
    num_ctas: int | None,
):
    """dK/dV at D_SPLIT (module docstring, "Head dim 256"): one item = RES keys, both consumers walk all its
    query tiles. Consumer 0 holds dV: S^T = K Q^T, P^T and g (the dS factor: p_and_factor, masked) into the
    exchange tile, dV += P^T dO. Consumer 1 holds dK: dP^T = V dO^T, g from the exchange tile, dS^T, dK +=
    dS^T Q. ex_full / ex_free hand the exchange tile over and back once per query tile."""
    wg = lax.axis_index("wg")
    buffers, (res_bar, s_bar, s_free, ex_full, ex_free, meet) = scoped
    k_res, v_res, stage_bufs, q_smem, do_smem, lse_smem, delta_smem, ex_smem = buffers
    d = k_res.shape[-1]
    bq = block_q
    dtype = q_ref.dtype
    num_seqs = offsets_ref.shape[0] - 1
    softmax = params.activation == "softmax"
    scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
    num_iters, item_of = persistent(num_ctas, num_work + num_zero, heads)

    def info(i):
        h, w = item_of(i)
        f = Frame(work_ref, offsets_ref, targets_ref, params, num_work, h, w, tile=RES)
        lo, hi = q_tiles(f, f.tile_lo, RES, bq, params)
        return f, lo, jnp.where(f.valid, hi, lo)

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def load_res(i, c: int):
        """Starts the TMA of consumer c's resident rows of the CTA's i-th item: K (0) or V (1)."""
        f, _, _ = info(i)

        @pl.when(f.valid & (i < num_iters))
        def _():
            row = pl.multiple_of(f.base + f.tile_lo, ALIGN)
            src, dst = (k_ref, k_res) if c == 0 else (v_ref, v_res)
            plgpu.copy_gmem_to_smem(rows_of(src, row, RES, f.h, d), dst, res_bar.at[c])

    def item(c: int, i, f: Frame, lo, hi, g0):
        """Consumer c's share of an item: query tiles [lo, hi), the ring's tile g0 first."""
        k_lo = f.tile_lo  # frame row of the item's first key
        first_row = jnp.clip(f.d - k_lo, 0, RES)  # the item's keys of the sequence: [first_row, last_row)
        last_row = jnp.clip(f.end - k_lo, 0, RES)
        f_lo, f_hi = q_free(f, k_lo, RES, bq, lo, hi, params)
        plgpu.barrier_wait(res_bar.at[c])  # started by load_res(i, c) at the end of the previous item

        def scores(n, dv_acc, masked: bool):
            j = g0 + n - lo  # the CTA's running query-tile count
            slot = slot_of(j)
            plgpu.barrier_wait(s_bar.at[slot])
            st = one_product(interpret, k_res, q_smem.at[slot], (RES, bq))
            if params.options.split_meet:  # S^T is done: consumer 1 may issue dP^T
                plgpu.barrier_arrive(meet)
                plgpu.barrier_wait(meet)
            lse = load_vector(interpret, lse_smem.at[slot], COL) if softmax else None
            mask = None
            if masked:  # rows: keys, columns: queries (sequence positions)
                keys = (k_lo - f.d) + iota(interpret, (RES, bq), 0)
                queries = (n * bq - f.d) + iota(interpret, (RES, bq), 1)
                mask = tiling.allowed_2d(queries, keys, f.length, f.first_target, params) & (keys >= 0)
            pt, factor = p_and_factor(st * params.alpha, mask, lse, params, 1)

            @pl.when(j > 0)
            def _():
                plgpu.barrier_wait(ex_free)  # consumer 1 has read the previous tile's g

            ex_smem[...] = factor.astype(ex_smem.dtype)
            plgpu.barrier_arrive(ex_full)
            (dv_acc,) = accumulate(interpret, (dv_acc,), (pt.astype(dtype),), (do_smem.at[slot],))
            plgpu.barrier_arrive(s_free.at[slot])
            return dv_acc

        def grads(n, dk_acc):
            slot = slot_of(g0 + n - lo)
            if params.options.split_meet:  # after consumer 0's S^T wgmma
                plgpu.barrier_arrive(meet)
                plgpu.barrier_wait(meet)
            plgpu.barrier_wait(s_bar.at[slot])
            dpt = one_product(interpret, v_res, do_smem.at[slot], (RES, bq))
            plgpu.barrier_wait(ex_full)
            factor = load_vector(interpret, ex_smem, plgpu.Layout.WGMMA).astype(jnp.float32)
            plgpu.barrier_arrive(ex_free)
            # No mask: g is zero in masked cells, and their dP^T is finite (dO is zero past offsets[B]) except in
            # the rows of keys past offsets[B] (V may hold NaN there), which reach only their own, unstored, dK rows
            if softmax:
                delta = load_vector(interpret, delta_smem.at[slot], COL)
                dst = factor * (dpt - lax.broadcast_in_dim(delta, (RES, bq), [1]))
            else:
                dst = dpt * factor
            (dk_acc,) = accumulate(interpret, (dk_acc,), (dst.astype(dtype),), (q_smem.at[slot],))
            plgpu.barrier_arrive(s_free.at[slot])
            return dk_acc

        acc = cast_layout(interpret, jnp.zeros((RES, d), jnp.float32), plgpu.Layout.WGMMA)
        if c == 0:
            acc = lax.fori_loop(lo, f_lo, functools.partial(scores, masked=True), acc)
            acc = lax.fori_loop(f_lo, f_hi, functools.partial(scores, masked=False), acc)
            acc = lax.fori_loop(f_hi, hi, functools.partial(scores, masked=True), acc)
            out, ref = (acc * scale).astype(dtype), dv_ref
        else:
            acc = lax.fori_loop(lo, hi, grads, acc)
            out, ref = (acc * (params.alpha * scale)).astype(dtype), dk_ref
        load_res(i + 1, c)  # the last wgmma has read K (V): fetch the next item's rows during the epilogue
        store_slices(
            stage_bufs[c],
            out,
            lambda off, size, col, cols: rows_of(
                ref, f.base + k_lo + first_row + off, size, f.h, d, col, cols
            ),
            first_row,
            last_row,
        )

    def consumer(c: int):
        plgpu.set_max_registers(232, action="increase")

        def one(i, g):
            f, lo, hi = info(i)
            pl.when(f.valid)(lambda: item(c, i, f, lo, hi, g))

            @pl.when(f.w >= num_work)
            def _():  # each consumer zeroes its own output's rows past offsets[B]
                zero_tail(
                    stage_bufs[c], ((dv_ref if c == 0 else dk_ref, f.h, d),), offsets_ref, f.w - num_work,
                    num_seqs=num_seqs, total_rows=total_rows, interpret=interpret,
                )  # fmt: skip

            return g + hi - lo

        load_res(0, c)
        g = lax.fori_loop(0, num_iters, one, jnp.int32(0))
        if c == 0:  # observe the last tile's release too: the barrier then ends in a consistent phase

            @pl.when(g > 0)
            def _():
                plgpu.barrier_wait(ex_free)

        plgpu.wait_smem_to_gmem(0)

    for c in range(COMPUTE_WGS):  # static roles: one branch per consumer
        pl.when(wg == c)(functools.partial(consumer, c))

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        ins = (q_ref, do_ref, lse_ref, delta_ref, None)
        bufs = (q_smem, do_smem, lse_smem, delta_smem, None)
        stream_queries(info, num_iters, ins, bufs, s_bar, s_free, bq, stages, params)
