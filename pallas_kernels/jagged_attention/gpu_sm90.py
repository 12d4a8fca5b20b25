"""Pallas Mosaic GPU (Hopper: wgmma + TMA, warp-specialised) forward kernel for jagged attention.

Why: the Triton-lowered forward (gpu.py) spends ~10-25 CUDA-core ops per score element (SiLU, masks,
casts) that do not overlap with its MMAs. Here, as in FlashAttention-3, one CTA runs three warpgroups:
a producer that TMA-loads key/value tiles into a ring of shared-memory slots, and two consumer
warpgroups of BLOCK_Q = 64 query rows each that issue wgmma and do the activation, so one's elementwise
work overlaps the other's matrix work.

Contract: the same as the Triton backend's forward (pallas_kernels.jagged_attention.gpu_layout.forward): the output
and the softmax lse from gpu_layout.to_kernel_layout's inputs. supports() lists what it handles: bf16/fp16, head dims
64 or 128, SiLU or softmax, targets, window, and the relative position and time bias.

Design:
* Work list: tiling.work_list(lengths, 2 * BLOCK_Q, ...), heaviest first, items (head fastest) then tail
  items that zero rows past offsets[B]. Persistent grid (default): NUM_SMS CTAs walk that list with a
  stride; the K/V ring and its barrier phases run on across items, so the producer prefetches the next
  item's keys while the consumers finish the current one, and each consumer fetches its next query
  rows during its epilogue. num_ctas=None: one CTA per (head, item) instead.
* Per-item scalars (sequence, tile, offsets, targets) are read from global memory at run time; each
  consumer derives its own key-tile range [lo, hi) (causal, window, targets) and its mask-free middle;
  the producer loads the union of both ranges, and a consumer releases the slots outside its own range
  (after waiting for their data, so an early release never completes a phase the other still holds).
* Jagged loads: TMA boxes of bk rows of one head at arbitrary row starts. Mosaic GPU tiles the GMEM side of a
  TMA by (8, 64), so a load's row start must be a multiple of 8: every sequence is processed in its aligned
  frame (frame row f = global row start - start % ALIGN + f), and frame rows outside the sequence are masked
  in the scores and never stored. Boxes past T are zero-filled by TMA. Rows past offsets[B] must hold finite
  values (0 * NaN = NaN in the PV product), as any real token does.
* Jagged stores: a consumer never writes rows outside [start, start + length): its tile is staged in an
  unswizzled shared buffer and stored as up to 7 power-of-two-row TMA boxes (binary decomposition of the
  valid row count). Rows of a sequence past max_seq_len are not written (the reference has zeros there, so
  callers keep L_b <= max_seq_len as api.py requires).
* Relative bias in the kernel, O(T) extra memory at any N: each consumer loads its head's position and time
  tables (float32, one row each) and its rows' timestamps with its query rows; the producer loads the key
  tile's timestamps with the keys. Per score element the consumer computes the position bucket min(i - j,
  P - 1) and the time bucket floor(log(max(ts_i - ts_j, 1)) / 0.301) (clipped to NT - 1) and gathers both
  tables from shared memory (one ld.shared each, through inline Mosaic GPU code: Pallas has no gather).
  Key tiles wholly past the position table's last bucket add that bucket's value as a scalar instead.
* Ping-pong (FA3): the two consumers meet on a barrier twice per key tile so that one's activation runs
  while the other's wgmmas do.
* SiLU: with h = z / 2, silu(z) = h + h * tanh(h) (tanh.approx via approx_math); 1/max_seq_len is applied
  once to the accumulator.
* Softmax: base-2 online softmax; a row that has seen no visible key yet keeps m = -inf and subtracts 0, so
  a window-edge tile that masks whole rows leaves them at zero rather than NaN. lse goes to a tile-major
  [items, H, 2 * BLOCK_Q] buffer (a 1-D TMA of a whole consumer tile) and is gathered to [H, T] in XLA.

CPU checks: tests/test_jagged_attention_mosaic_gpu.py lowers the kernel for several configs
(`lower(lowering_platforms=("cuda",))`) and runs it in Mosaic GPU interpret mode against the reference,
with the wgmma calls replaced by plain dots and the shared-memory gathers by jnp indexing there (the
interpreter has neither transposed wgmma operands, run_state nor inline Mosaic GPU code). Numbers come only
from the device (experiments/benchmarks/mosaic_attention.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv, cdiv_dyn
from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.sm90_common import (
    ALIGN,
    LOG2E,
    ZERO_TILES,
    copy_table,
    gather,
    store_rows,
    table_chunks,
    table_rows,
    table_width,
    time_buckets,
)
from pallas_kernels.mosaic_common import (
    COL,
    NUM_SMS,
    ROW,
    SMEM_BYTES,
    SMEM_SLACK,
    cast_layout,
    compiler_params,
    iota,
    load_vector,
    num_sms,
)

BLOCK_Q = 64  # query rows per consumer warpgroup; a CTA (one work item) holds 2 * BLOCK_Q rows
COMPUTE_WGS = 2
HEAD_DIMS = (64, 128, 256)  # multiples of 64 (the 128-byte swizzle); 256 needs 64-key tiles (shared memory)
# output columns staged (and stored) at a time: D = 256 stores its tile in four quarters (shared memory)
O_COLS = {64: 64, 128: 128, 256: 64}


def smem_bytes(params: KernelParams, dqk: int, dv: int, itemsize: int) -> int:
    """Shared memory the kernel's buffers take with its default tiles (the layout in forward_mosaic_gpu)."""
    has_bias = params.has_pos or params.has_time
    block_k, stages = default_tiles(max(dqk, dv), has_bias)
    tiles = COMPUTE_WGS * BLOCK_Q * (dqk + O_COLS.get(dv, dv)) + stages * block_k * (dqk + dv)
    floats = COMPUTE_WGS * BLOCK_Q * (params.activation == "softmax")
    if params.has_time:
        floats += (COMPUTE_WGS * BLOCK_Q + stages * block_k) + COMPUTE_WGS * table_width(params.num_time)
    if params.has_pos:
        floats += COMPUTE_WGS * table_width(params.num_pos)
    return tiles * itemsize + 4 * floats


def supports(params: KernelParams, q, v) -> bool:
    """Whether forward_mosaic_gpu handles this call (otherwise the GPU backend runs its Triton forward): a
    bias table too large for the shared memory left by the tiles (thousands of position buckets) is one."""
    return (
        not params.interpret
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and v.dtype == q.dtype
        and q.shape[-1] in HEAD_DIMS
        and v.shape[-1] in HEAD_DIMS
        and params.activation in ("silu", "softmax")
        and smem_bytes(params, q.shape[-1], v.shape[-1], q.dtype.itemsize) <= SMEM_BYTES - SMEM_SLACK
    )


def _kernel(
    work_ref,
    offsets_ref,
    targets_ref,
    q_ref,
    k_ref,
    v_ref,
    ts_ref,
    pos_ref,
    time_ref,
    o_ref,
    lse_ref,
    scoped,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    num_zero: int,
    block_k: int,
    stages: int,
    total_rows: int,
    interpret: bool,
    pingpong: bool,
    num_ctas: int | None,
):
    wg = lax.axis_index("wg")
    buffers, (k_bar, v_bar, q_bar), (k_free, v_free), sched = scoped
    q_smem2, o_bufs, k_smem, v_smem, lse_bufs, bias_bufs = buffers
    tsq_smem2, tsk_smem, pos_smem2, time_smem2 = bias_bufs
    dqk, dv = q_smem2.shape[-1], v_smem.shape[-1]
    has_bias = params.has_pos or params.has_time

    def rows_of(ref, row, size, h, d, col=0, cols=None):
        """[size, cols] GMEM window of head h at row, from column `col` (ref is [T, H * d])."""
        return ref.at[pl.ds(row, size), pl.ds(h * d + col, cols or d)]

    def work(k, wc):
        return work_ref[k * num_work + wc]

    bq, bk = BLOCK_Q, block_k
    dtype = q_ref.dtype
    num_seqs = offsets_ref.shape[0] - 1

    # Items of this CTA: one (head, item) pair per CTA, or (persistent) pairs cta, cta + num_ctas, ... of the
    # flat list with heads fastest. The K/V ring runs on across items: step g + i of the CTA uses slot
    # (g + i) % stages, where g counts the key tiles of the CTA's earlier items.
    if num_ctas is None:
        num_iters = 1

        def item_of(i):
            del i
            return lax.axis_index("heads"), lax.axis_index("items")
    else:
        cta = lax.axis_index("sm")
        num_iters = cdiv_dyn(jnp.maximum((num_work + num_zero) * heads - cta, 0), num_ctas)

        def item_of(i):
            idx = cta + i * num_ctas
            return idx % heads, idx // heads

    def info(i):
        h, w = item_of(i)
        wc = jnp.minimum(w, num_work - 1)
        valid = (w < num_work) & (work(2, wc) > 0)
        b = work(0, wc)
        start = offsets_ref[b]
        d = lax.rem(start, jnp.int32(ALIGN))  # the sequence's offset in its aligned frame
        base = start - d  # global row of frame row 0
        length = jnp.minimum(offsets_ref[b + 1] - start, params.max_seq_len)
        first_target = length
        if params.has_targets:
            first_target = length - jnp.clip(targets_ref[b], 0, length)
        tile_lo = work(1, wc) * (COMPUTE_WGS * bq)  # frame row
        # key tiles the whole CTA needs (the producer's range): the union of both consumers' ranges
        lo0, hi0 = kv_range(tile_lo, d, length, first_target)
        lo1, hi1 = kv_range(tile_lo + bq, d, length, first_target)
        cta_lo = jnp.where(hi1 > lo1, jnp.minimum(lo0, lo1), lo0)
        cta_hi = jnp.where(valid, jnp.maximum(hi0, hi1), cta_lo)
        return h, w, valid, base, d, length, first_target, tile_lo, cta_lo, cta_hi

    def kv_range(q_lo, d, length, first_target):
        """[lo, hi) key tiles that frame rows [q_lo, q_lo + bq) see (lo = hi: no rows of the sequence)."""
        end = d + length
        hi = jnp.where((q_lo < end) & (q_lo + bq > d), cdiv_dyn(jnp.minimum(q_lo + bq, end), bk), 0)
        lo = jnp.int32(0)
        if params.max_attn_len > 0:
            lo_col = jnp.maximum(jnp.maximum(q_lo, d) - params.max_attn_len, d)
            if params.has_targets:  # a tile holding targets sees the whole history
                lo_col = jnp.where(q_lo + bq > d + first_target, d, lo_col)
            lo = lo_col // bk
        return jnp.minimum(lo, hi), hi

    def mask_free(q_lo, d, first_target, lo, hi):
        """[f_lo, f_hi) within [lo, hi): key tiles every row of [q_lo, q_lo + bq) sees whole (no mask)."""
        f_hi = jnp.minimum(q_lo + 1, d + first_target) // bk  # below the diagonal and inside the history
        f_lo = cdiv_dyn(d, bk)  # frame rows before the sequence (in tile 0 when d > 0) are masked
        if params.max_attn_len > 0:
            f_lo = jnp.maximum(f_lo, cdiv_dyn(jnp.maximum(q_lo + bq - 1 - params.max_attn_len, 0), bk))
        f_lo = jnp.clip(f_lo, lo, hi)
        return f_lo, jnp.clip(f_hi, f_lo, hi)

    def pos_far_end(q_lo, f_lo, f_hi):
        """Key tiles [f_lo, end) of the mask-free range lie wholly past the position table's last bucket:
        min(i - j) = q_lo - (n + 1) bk + 1 >= num_pos - 1 there, so the position bias is one scalar."""
        if not params.has_pos:
            return f_lo
        n_max = (q_lo - params.num_pos + 2) // bk - 1  # floor division: negative when no tile is that far
        return jnp.clip(n_max + 1, f_lo, f_hi)

    def aligned(row):
        return pl.multiple_of(row, ALIGN)

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def sync():
        # Ping-pong (FA3): both consumers meet here twice per key tile, once after issuing the QK wgmma and
        # once after the activation, offset by one meeting, so one's activation overlaps the other's wgmmas.
        if pingpong:
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

    def load_q(i):
        """Starts the TMAs of this consumer's query rows of the CTA's i-th item (if it is a real tile), with the
        rows' timestamps and the head's bias tables when the call has a relative bias."""
        h, _, valid, base, _, _, _, tile_lo, _, _ = info(i)

        @pl.when(valid & (i < num_iters))
        def _():
            row = aligned(base + tile_lo + wg * bq)
            plgpu.copy_gmem_to_smem(rows_of(q_ref, row, bq, h, dqk), q_smem2.at[wg], q_bar.at[wg])
            if params.has_time:
                plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, bq)], tsq_smem2.at[wg], q_bar.at[wg])
                copy_table(time_ref.at[h], time_smem2.at[wg], q_bar.at[wg])
            if params.has_pos:
                copy_table(pos_ref.at[h], pos_smem2.at[wg], q_bar.at[wg])

    def bias_tile(q_lo, step, ts_rows, slot, pos_scalar):
        """float32 [bq, bk] relative bias of this consumer's rows against key tile `step` (None: no bias)."""
        bias = None
        probe = params.options.probe  # (benchmark-only skips: KernelOptions.bias_probe)
        if params.has_pos:
            if pos_scalar is not None:
                bias = pos_scalar
            elif probe("pos_gather"):
                bias = pos_smem2.at[wg][0]
            else:
                rel = (q_lo - step * bk) + iota(interpret, (bq, bk), 0) - iota(interpret, (bq, bk), 1)
                bias = gather(interpret, pos_smem2.at[wg], jnp.clip(rel, 0, params.num_pos - 1))
        if params.has_time and probe("time_bucket"):
            time_bias = time_smem2.at[wg][0]
            bias = time_bias if bias is None else bias + time_bias
        elif params.has_time:
            # the gap from the rows' timestamps relative to their sequence's start (tiling.relative_timestamps)
            ts_k = lax.broadcast_in_dim(load_vector(interpret, tsk_smem.at[slot, 0], COL), (bq, bk), [1])
            gap = lax.broadcast_in_dim(ts_rows, (bq, bk), [0]) - ts_k
            time_bias = gather(interpret, time_smem2.at[wg], time_buckets(gap, params.num_time))
            bias = time_bias if bias is None else bias + time_bias
        return bias

    def consumer_item(i, h, w, base, d, length, first_target, tile_lo, cta_lo, cta_hi, g0):
        # Key tile n of this item sits in ring slot (g0 + n - cta_lo) % stages. This consumer computes tiles
        # [lo, hi) (masked ones only at the ends) and releases the others of [cta_lo, cta_hi) unread.
        q_smem = q_smem2.at[wg]
        q_lo = tile_lo + wg * bq
        first_row = jnp.clip(d - q_lo, 0, bq)  # this consumer's rows of the sequence: [first_row, last_row)
        last_row = jnp.clip(d + length - q_lo, 0, bq)
        lo, hi = kv_range(q_lo, d, length, first_target)
        lo = jnp.where(hi > lo, lo, cta_lo)
        hi = jnp.where(hi > lo, hi, cta_lo)
        f_lo, f_hi = mask_free(q_lo, d, first_target, lo, hi)
        p_end = pos_far_end(q_lo, f_lo, f_hi)

        def slot_at(n):
            return slot_of(g0 + n - cta_lo)

        def drain(n):
            # The other consumer needs this tile: release our share of its slot, but only once the tile is in
            # it, so that an early arrival never completes a phase the other consumer still holds.
            slot = slot_at(n)
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            sync()
            sync()

        plgpu.barrier_wait(q_bar.at[wg])  # started by load_q(i) at the end of the previous item
        ts_rows = None
        if params.has_time:  # (the rows' timestamps, relative to their sequence's start)
            ts_rows = load_vector(interpret, tsq_smem2.at[wg, 0], ROW)
        pos_last = pos_smem2.at[wg][params.num_pos - 1] if params.has_pos else None
        pl.when(wg == 1)(sync)
        pl.loop(cta_lo, lo)(drain)

        @pl.when(hi > lo)
        def _():
            plgpu.barrier_wait(k_bar.at[slot_at(lo)])

        def body(step, carry, masked: bool, pos_far: bool = False):
            slot = slot_at(step)
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                sync()
                return acc_ref[...]

            if interpret:  # the GPU interpreter has no transposed wgmma operands: a plain dot of the tiles
                sc = lax.dot_general(
                    q_smem[...], k_tile[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )
                sync()
            else:
                sc = pl.run_scoped(qk_scope, plgpu.ACC((bq, bk), jnp.float32))
            bias = bias_tile(q_lo, step, ts_rows, slot, pos_last if pos_far else None) if has_bias else None
            plgpu.barrier_arrive(k_free.at[slot])  # the key tile and its timestamps have been read
            z = sc * params.alpha if bias is None else sc * params.alpha + bias
            mask = None
            if masked:
                rows = (q_lo - d) + iota(interpret, (bq, bk), 0)  # sequence positions
                cols = (step * bk - d) + iota(interpret, (bq, bk), 1)
                mask = tiling.allowed_2d(rows, cols, length, first_target, params) & (cols >= 0)
            if params.activation == "silu":
                (acc,) = carry
                half = z * 0.5
                p = half + half * jnp.tanh(half)
                if masked:
                    p = jnp.where(mask, p, 0.0)
                carry_out = ()
            else:
                acc, m_i, l_i = carry
                x = z * LOG2E
                if masked:
                    x = jnp.where(mask, x, -jnp.inf)
                m_new = jnp.maximum(m_i, x.max(axis=1))
                # A row that has seen no visible key yet (a window edge tile can mask a whole row) keeps
                # m = -inf; subtracting 0 instead keeps its p and correction at 0 rather than NaN.
                m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                corr = jnp.exp2(m_i - m_sub)
                p = jnp.exp2(x - lax.broadcast_in_dim(m_sub, x.shape, [0]))
                l_i = l_i * corr + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
                carry_out = (m_new, l_i)
            p = p.astype(dtype)
            if pingpong:
                acc, p, carry_out = lax.optimization_barrier(
                    (acc, p, carry_out)
                )  # activation before the meeting
                plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_bar.at[slot])
            if pingpong:
                plgpu.barrier_wait(sched)

            def wait_next_k():
                @pl.when(step + 1 < hi)
                def _():
                    plgpu.barrier_wait(k_bar.at[slot_at(step + 1)])

            def pv_scope(acc_ref):
                plgpu.wgmma(acc_ref, p, v_tile)
                wait_next_k()

            if interpret:  # ... and no run_state
                acc = acc + jnp.dot(p, v_tile[...], preferred_element_type=jnp.float32)
                wait_next_k()
            else:
                acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return (acc,) + carry_out

        acc = cast_layout(interpret, jnp.zeros((bq, dv), jnp.float32), plgpu.Layout.WGMMA)
        if params.activation == "silu":
            carry = (acc,)
        else:
            carry = (
                acc,
                cast_layout(interpret, jnp.full((bq,), -jnp.inf, jnp.float32), ROW),
                cast_layout(interpret, jnp.zeros((bq,), jnp.float32), ROW),
            )
        masked = functools.partial(body, masked=True)
        carry = lax.fori_loop(lo, f_lo, masked, carry)  # window edge
        if params.has_pos:  # far from the diagonal: the position bias is the last bucket's scalar
            carry = lax.fori_loop(f_lo, p_end, functools.partial(body, masked=False, pos_far=True), carry)
        carry = lax.fori_loop(p_end, f_hi, functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(f_hi, hi, masked, carry)  # diagonal, targets, sequence end
        pl.loop(hi, cta_hi)(drain)
        pl.when(wg == 0)(sync)
        load_q(i + 1)  # the last QK wgmma has read q_smem: fetch the next item's rows during this epilogue
        if params.activation == "silu":
            out = carry[0] * (1.0 / params.max_seq_len)
        else:
            acc, m_i, l_i = carry
            l_safe = jnp.where(l_i > 0, l_i, 1.0)
            out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
        lse = (m_i + jnp.log(l_safe) * LOG2E) * (1.0 / LOG2E) if params.activation == "softmax" else None
        out = out.astype(o_ref.dtype)

        def epilogue(i):
            o_smem = o_bufs[i]
            o_cols = o_smem.shape[-1]
            for col in range(0, dv, o_cols):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores have read o_smem
                if lse is not None and col == 0:
                    lse_bufs[i][...] = lse
                o_smem[...] = out if o_cols == dv else out[:, col : col + o_cols]
                plgpu.commit_smem()
                store_rows(
                    o_smem,
                    lambda off, size, col=col: rows_of(
                        o_ref, base + q_lo + first_row + off, size, h, dv, col, o_cols
                    ),
                    jnp.maximum(last_row - first_row, 0),
                    bq,
                    first=first_row,
                )
            if lse is not None:
                dst = lse_ref.at[pl.ds(((w * heads + h) * COMPUTE_WGS + i) * bq, bq)]
                plgpu.copy_smem_to_gmem(lse_bufs[i], dst)

        for i in range(COMPUTE_WGS):  # static buffers: one branch per consumer
            pl.when(wg == i)(functools.partial(epilogue, i))

    def zero_tail(h, w):
        o_smem = o_bufs[0]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_smem[...] = cast_layout(interpret, jnp.zeros(o_smem.shape, o_smem.dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()
        tail = offsets_ref[num_seqs]
        o_cols = o_smem.shape[-1]
        for i in range(ZERO_TILES * COMPUTE_WGS):
            lo = ((w - num_work) * ZERO_TILES * COMPUTE_WGS + i) * bq
            first = jnp.clip(tail - lo, 0, bq)  # rows [lo, lo + first) are real tokens
            count = jnp.where(lo < total_rows, bq - first, 0)
            for col in range(0, dv, o_cols):
                store_rows(
                    o_smem,
                    lambda off, size, lo=lo, first=first, col=col: rows_of(
                        o_ref, lo + first + off, size, h, dv, col, o_cols
                    ),
                    count,
                    bq,
                )

    @pl.when(wg < COMPUTE_WGS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")

        def one(i, g):
            h, w, valid, base, d, length, first_target, tile_lo, cta_lo, cta_hi = info(i)
            pl.when(valid)(
                lambda: consumer_item(i, h, w, base, d, length, first_target, tile_lo, cta_lo, cta_hi, g)
            )
            pl.when((w >= num_work) & (wg == 0))(lambda: zero_tail(h, w))
            return g + cta_hi - cta_lo

        load_q(0)
        lax.fori_loop(0, num_iters, one, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def one(i, g):
            h, _, _, base, _, _, _, _, cta_lo, cta_hi = info(i)

            @pl.loop(cta_lo, cta_hi)
            def _(n):
                j = g + n - cta_lo  # the CTA's running key-tile count
                slot = slot_of(j)
                row = aligned(base + n * bk)

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                plgpu.copy_gmem_to_smem(rows_of(k_ref, row, bk, h, dqk), k_smem.at[slot], k_bar.at[slot])
                if params.has_time:
                    plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, bk)], tsk_smem.at[slot], k_bar.at[slot])

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                plgpu.copy_gmem_to_smem(rows_of(v_ref, row, bk, h, dv), v_smem.at[slot], v_bar.at[slot])

            return g + cta_hi - cta_lo

        g = lax.fori_loop(0, num_iters, one, jnp.int32(0))

        @pl.loop(jnp.maximum(g - stages, 0), g)
        def _(step):  # observe the last releases too: the barriers then end in a consistent phase
            plgpu.barrier_wait(k_free.at[slot_of(step)])
            plgpu.barrier_wait(v_free.at[slot_of(step)])


def _tile_lse(lse_tiles, offsets, work, num_work: int, total_rows: int, max_seq_len: int):
    """[H, T] natural-log lse from the kernel's tile-major [items, H, tile] buffer (0 for rows not computed).

    The buffer is indexed by frame row (sequence position + offsets[b] % ALIGN), as the kernel's tiles are.
    """
    tile = lse_tiles.shape[-1]
    n_max = cdiv(max_seq_len + ALIGN - 1, tile)
    b = offsets.shape[0] - 1
    item_of = (
        jnp.zeros((b * n_max,), jnp.int32)
        .at[work[0] * n_max + work[1]]
        .set(jnp.where(work[2] > 0, jnp.arange(num_work, dtype=jnp.int32), 0))
    )
    rows = jnp.arange(total_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(offsets, rows, side="right").astype(jnp.int32) - 1, 0, b - 1)
    pos = rows - offsets[seq]
    ok = (rows < offsets[b]) & (pos < max_seq_len)
    fpos = pos + offsets[seq] % ALIGN
    item = item_of[seq * n_max + jnp.clip(fpos // tile, 0, n_max - 1)]
    lse = lse_tiles[item, :, fpos % tile]  # [T, H]
    return jnp.where(ok[:, None], lse, 0.0).T


def default_tiles(head_dim: int, has_bias: bool) -> tuple[int, int]:
    """(key-tile rows, ring slots) measured fastest on the H200: 128 x 2, or 64 x 2 at D = 256 (two 2-slot K/V
    rings of 128 x 256 exceed shared memory), or 64 x 3 with a relative bias (its per-element bucket and gather
    work needs the registers a 128-key score tile would take)."""
    if head_dim > 128:
        return 64, 2
    return (64, 3) if has_bias else (128, 2)


def _zero_unused_rows(x, offsets):
    """x [T, ...] with the rows past offsets[B] set to zero."""
    row = lax.broadcasted_iota(jnp.int32, (x.shape[0],) + (1,) * (x.ndim - 1), 0)
    return jnp.where(row < offsets[-1], x, jnp.zeros((), x.dtype))


def forward_mosaic_gpu(
    q,
    k,
    v,
    offsets,
    targets,
    ts,
    pos_tab,
    time_tab,
    params: KernelParams,
    *,
    block_k: int | None = None,
    stages: int | None = None,
    pingpong: bool = True,
    num_ctas: int | None = NUM_SMS,
    interpret: bool = False,
):
    """(o [T, H, Dv], lse float32 [H, T]) from gpu_layout.to_kernel_layout's inputs, as gpu_layout.forward
    (see supports()).

    The bias tables are gpu_layout.to_kernel_layout's: float32, each head's row padded (the time table has one more
    row, of bucket thresholds, which this kernel does not need: it takes the log directly).
    """
    t, heads, dqk = q.shape
    default_bk, default_stages = default_tiles(max(dqk, v.shape[-1]), params.has_pos or params.has_time)
    block_k = block_k or default_bk
    stages = stages or default_stages
    if not params.has_targets:
        targets = jnp.zeros((1,), jnp.int32)
    dv = v.shape[-1]
    tile = COMPUTE_WGS * BLOCK_Q
    if t % ALIGN:
        raise ValueError(
            f"the Mosaic GPU kernel needs a token capacity T that is a multiple of {ALIGN}, got {t}"
        )
    # The P.V wgmma multiplies a tile's masked key rows by P = 0, and 0 x NaN is NaN: rows past offsets[B] may
    # hold anything (the contract), so K and V are zeroed there (XLA fuses the select into their producer). Rows
    # before offsets[B] that a tile masks belong to other sequences and are finite.
    k, v = (_zero_unused_rows(x, offsets) for x in (k, v))
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], params.max_seq_len)
    # tiles of each sequence's aligned frame: frame length L + offsets[b] % ALIGN (at most ALIGN - 1 more rows
    # per sequence, hence the larger static bounds)
    frame = jnp.where(lengths > 0, lengths + offsets[:-1] % ALIGN, 0)
    wb, wm, wv, num_work = tiling.work_list(
        frame, tile, params.max_seq_len + ALIGN - 1, t + (ALIGN - 1) * frame.shape[0], "query"
    )
    work = jnp.stack([wb, wm, wv])
    num_zero = cdiv(t, ZERO_TILES * tile)
    softmax = params.activation == "softmax"
    pos_width = table_width(params.num_pos)
    time_width = table_width(params.num_time)
    ts = tiling.relative_timestamps(ts, offsets) if params.has_time else jnp.zeros((1, ALIGN), jnp.float32)
    pos_rows = table_rows(pos_tab, heads, pos_width) if params.has_pos else jnp.zeros((1, 4), jnp.float32)
    time_rows = table_rows(time_tab, heads, time_width) if params.has_time else jnp.zeros((1, 4), jnp.float32)
    # each copy into a ring slot / query buffer arrives once on its barrier
    k_arrivals = 1 + int(params.has_time)
    q_arrivals = (
        1
        + int(params.has_time) * (1 + table_chunks(params.num_time))
        + int(params.has_pos) * table_chunks(params.num_pos)
    )

    def entry(
        work_ref, offsets_ref, targets_ref, q_ref, k_ref, v_ref, ts_ref, pos_ref, time_ref, o_ref, lse_ref
    ):
        swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

        def per_consumer(shape, dtype):
            return tuple(plgpu.SMEM(shape, dtype) for _ in range(COMPUTE_WGS))

        bias_smem = (
            plgpu.SMEM((COMPUTE_WGS, 1, BLOCK_Q), jnp.float32) if params.has_time else None,
            plgpu.SMEM((stages, 1, block_k), jnp.float32) if params.has_time else None,
            plgpu.SMEM((COMPUTE_WGS, pos_width), jnp.float32) if params.has_pos else None,
            plgpu.SMEM((COMPUTE_WGS, time_width), jnp.float32) if params.has_time else None,
        )
        smem = (
            plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, dqk), q.dtype, transforms=swz),
            per_consumer((BLOCK_Q, O_COLS[dv]), v.dtype),
            plgpu.SMEM((stages, block_k, dqk), k.dtype, transforms=swz),
            plgpu.SMEM((stages, block_k, dv), v.dtype, transforms=swz),
            per_consumer((BLOCK_Q,), jnp.float32) if softmax else None,
            bias_smem,
        )
        loaded = (
            plgpu.Barrier(num_arrivals=k_arrivals, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=q_arrivals, num_barriers=COMPUTE_WGS),
        )
        freed = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2
        sched = plgpu.Barrier(num_arrivals=COMPUTE_WGS)
        pl.run_scoped(
            lambda *sc: _kernel(
                work_ref,
                offsets_ref,
                targets_ref,
                q_ref,
                k_ref,
                v_ref,
                ts_ref,
                pos_ref,
                time_ref,
                o_ref,
                lse_ref,
                sc,
                params=params,
                heads=heads,
                num_work=num_work,
                num_zero=num_zero,
                block_k=block_k,
                stages=stages,
                total_rows=t,
                interpret=interpret,
                pingpong=pingpong,
                num_ctas=num_ctas,
            ),
            smem,
            loaded,
            freed,
            sched,
            collective_axes="wg",
        )

    lse_shape = (math.prod((num_work if softmax else 1, heads, tile)),)
    ins = (work.reshape(-1), offsets, targets.astype(jnp.int32))
    ins += (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), ts, pos_rows, time_rows)
    # Grid: (head, work item) with heads fastest (heaviest items first), then num_zero tail items per head
    # that zero rows past offsets[B]; or (persistent) NUM_SMS CTAs walking that list. Three warpgroups per
    # CTA: two consumers, one TMA producer.
    o, lse_tiles = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((t, heads * dv), v.dtype),
            jax.ShapeDtypeStruct(lse_shape, jnp.float32),
        ),
        grid=(heads, num_work + num_zero) if num_ctas is None else (num_ctas,),
        grid_names=("heads", "items") if num_ctas is None else ("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=compiler_params(params.options.warpgroup_semantics),
    )(*ins)
    o = o.reshape(t, heads, dv)
    if softmax:
        lse = _tile_lse(
            lse_tiles.reshape(num_work, heads, tile), offsets, work, num_work, t, params.max_seq_len
        )
    else:
        lse = jnp.zeros((heads, t), jnp.float32)
    return o, lse


def forward(inputs, params: KernelParams):
    """(o, lse) from gpu_layout.to_kernel_layout's inputs with the tiles measured fastest (default_tiles)."""
    return forward_mosaic_gpu(*inputs, params=params, num_ctas=num_sms())
