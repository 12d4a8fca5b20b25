"""The Hopper backward's dQ kernel: over query tiles, the key/value tiles streamed; with a relative bias it
also sums dS into the bias tables' gradients (lane-private shared-memory histograms, flushed per work item)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir  # Mosaic GPU's own API, for the inline code Pallas has no primitive for
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv
from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.sm90_backward_common import (
    COMPUTE_WGS,
    RES,
    Frame,
    accumulate,
    cta_range,
    k_clipped_end,
    k_free,
    k_tiles,
    load_bias_res,
    rows_of,
    score_grads,
    tile_bias,
    ts_tile,
    two_products,
    zero_tail,
)
from pallas_kernels.jagged_attention.sm90_common import ALIGN, TMA_BOX, store_rows, time_buckets
from pallas_kernels.mosaic_common import COL, ROW, cast_layout, iota, load_vector, persistent

# The bias tables' gradients (dQ kernel): each consumer owns a lane-private histogram per table in shared memory,
# float32 [rows, LANES] (bucket b of lane l at b * LANES + l), so a warp's adds never meet on one address: a
# lane's own column sits in its own bank whatever bucket it adds to. A thread sums its consecutive cells of one
# bucket in registers (a run) and adds the run with one red.shared.add.f32 into its lane's column; only the
# four warps of a consumer share a column, and they rarely add at the same instant. At the end of each work
# item the consumer sums its histogram over the lanes, stores that item's [buckets] row to HBM (one slot per
# (item, head, consumer): plain stores, no accumulation across CTAs) and zeroes the histogram; XLA sums the
# slots. The earlier design (one histogram row per head, every lane adding to it) serialised a warp's atomics on
# one or two addresses: 28.5 ms of table gradients where the rest of the backward took 10.8 (docs/benchmarks.md).
LANES = 32
# red.shared.add.f32 of $1 at [$0], skipped for 0 (masked cells and a run's inner elements; NaN adds)
_RED = "{ .reg .pred p; setp.neu.f32 p, $1, 0f00000000; @p red.shared.add.f32 [$0], $1; }"
# the same add as a plain load, add and store (KernelOptions.bias_probe "hist_plain": racy between the warps that
# share a lane's column, so wrong; it times what the atomic itself costs)
_PLAIN = (
    "{ .reg .pred p; .reg .f32 t; setp.neu.f32 p, $1, 0f00000000; @p ld.shared.f32 t, [$0];"
    " @p add.f32 t, t, $1; @p st.shared.f32 [$0], t; }"
)


def _elements(reg):
    """The scalars of one register of a FragmentedArray (a vector register's elements, in order)."""
    if not isinstance(reg.type, ir.VectorType):
        return [reg]
    [n] = ir.VectorType(reg.type).shape
    at = lambda e: ir.DenseI64ArrayAttr.get([e])
    return [vector.extract(reg, dynamic_position=[], static_position=at(e)) for e in range(n)]


def _lane_adder(hist, plain: bool = False):
    """red(i, v): hist[i, lane] += v (float32, i int32), one red.shared.add.f32 (skipped for 0) into this lane's
    column of a lane-private histogram (inline Mosaic GPU code)."""
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    base = mgpu_utils.memref_ptr(hist)
    lane = llvm.inline_asm(i32, [], "mov.u32 $0, %laneid;", "=r")
    lanes = arith.constant(i32, LANES)

    def red(i, v):
        slot = arith.addi(arith.muli(i, lanes), lane)
        address = mgpu_utils.getelementptr(base, [slot], f32)
        code = _PLAIN if plain else _RED
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [address, v], code, "r,f", has_side_effects=True)

    return red


# thresholds each cell of a tile is compared against on the time gradient's sorted path (runs_add): tiles whose
# cells span at most RUN_THRESHOLDS + 1 buckets take it
RUN_THRESHOLDS = 4


def exact_bucket(thr_ref, gap, num_buckets: int):
    """The time bucket of one scalar gap as the thresholds (gpu_layout.time_thresholds, in shared memory) define it,
    the reference's exactly: time_buckets' log2 estimate, then one threshold up or down (log2's approximation
    is off by at most one bucket, at an edge)."""
    gap = jnp.maximum(gap, jnp.float32(1.0))
    top = num_buckets - 1
    b = jnp.clip(time_buckets(gap, num_buckets), 0, top)
    b = jnp.where((b < top) & (gap >= thr_ref[jnp.minimum(b + 1, top)]), b + 1, b)
    return jnp.where((b > 0) & (gap < thr_ref[b]), b - 1, b)


def hist_rows(num_buckets: int) -> int:
    """Rows of a lane-private histogram of `num_buckets` buckets: a multiple of 64, so that the flush reads it
    as one wgmma-layout tile."""
    return cdiv(num_buckets, 64) * 64


def hist_add(interpret: bool, hist_ref, idx, vals, diagonals: bool = False, plain: bool = False):
    """hist_ref[idx, lane] += vals for an int32 bucket tile and a float32 tile in the wgmma layout; hist_ref is
    a consumer's float32 [rows, LANES] lane-private histogram (the comment above LANES).

    A thread visits its cells in an order where neighbours often share a bucket, sums each run of one bucket
    in registers, and adds it with one red.shared.add.f32 into its own lane's column (inline Mosaic GPU code:
    Pallas has no scatter). Zeros issue no add; NaN does (setp.neu). The order: row by row (a row's time
    bucket changes only as the time gap grows), or with `diagonals` (position buckets, i - j) the thread's
    cells (r, c) and (r + 8, c + 8) next to each other: the wgmma layout gives a thread rows r and r + 8 at
    the same columns, so near the diagonal 18 runs of a 64 x 64 tile's 32 cells instead of 32. Any order is
    correct (a run ends wherever the bucket changes); the order only saves adds."""
    if interpret:  # (the GPU interpreter has no scatter: a one-hot sum, into lane column 0)
        onehot = idx.reshape(-1, 1) == lax.broadcasted_iota(jnp.int32, (1, hist_ref.shape[0]), 1)
        sums = jnp.sum(jnp.where(onehot, vals.reshape(-1, 1), 0.0), axis=0)
        hist_ref[:, 0] = hist_ref[:, 0] + sums
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA, plgpu.Layout.WGMMA))
    def scatter(ctx, hist, cells, values):
        del ctx
        red, elements = _lane_adder(hist, plain), _elements
        # a thread's rows one after the other: the register axes that remain at 8 columns come first (in the
        # wgmma layout one axis of 2: rows r and r + 8; then the column groups of 8, each a vector of 2)
        rows = [a for a, n in enumerate(cells.layout.registers_shape((RES, 8))) if n > 1]
        regs_i, regs_v = (
            np.moveaxis(r, rows, list(range(len(rows)))) for r in (cells.registers, values.registers)
        )
        pairs = [
            (i, v)
            for ireg, vreg in zip(regs_i.flat, regs_v.flat, strict=True)
            for i, v in zip(elements(ireg), elements(vreg), strict=True)
        ]
        if diagonals and len(rows) == 1 and regs_i.shape[0] == 2:
            # row r's element k (column 8 (k // 2) + 2 q + k % 2) shares i - j with row r + 8's element k + 2
            n = len(pairs) // 2
            upper, lower = pairs[:n], pairs[n:]
            pairs = lower[:2] + [p for k in range(n - 2) for p in (upper[k], lower[k + 2])] + upper[n - 2 :]
        zero = arith.constant(ir.F32Type.get(), 0.0)
        run_i, run_v = pairs[0]
        for i, v in pairs[1:]:  # a run ends where the bucket changes: its sum goes out (0: no add)
            same = arith.cmpi(arith.CmpIPredicate.eq, i, run_i)
            red(run_i, arith.select(same, zero, run_v))
            run_v = arith.select(same, arith.addf(run_v, v), v)
            run_i = i
        red(run_i, run_v)

    scatter(hist_ref, idx, vals)


def runs_add(interpret: bool, hist_ref, lo, thresholds, gap, vals, num_buckets: int):
    """The time table's gradient of a tile whose every cell's bucket lies in [lo, lo + len(thresholds)]
    (sorted timestamps: the bucket of gap is lo + the number of thresholds[j] <= max(gap, 1), those of the
    buckets lo + 1, ..., +inf past the tile's last bucket): hist_ref[lo + j, lane] += this thread's sum of
    vals over its cells of bucket lo + j. S_j, the sum over the cells at or past threshold j (S_0 all of
    them), takes a compare, a select and an add a cell, and bucket lo + j gets S_j - S_(j + 1): a few
    shared-memory adds a tile instead of one per run of one bucket in every cell's code (hist_add). Bucket
    indices past num_buckets - 1 are clipped to it (their sums are 0)."""
    gap = jnp.maximum(gap, 1.0)
    if interpret:
        sums = [jnp.sum(vals)] + [jnp.sum(jnp.where(gap >= t, vals, 0.0)) for t in thresholds] + [0.0]
        for j in range(len(thresholds) + 1):
            idx = jnp.minimum(lo + j, num_buckets - 1)
            hist_ref[idx, 0] = hist_ref[idx, 0] + (sums[j] - sums[j + 1])
        return
    splat = lambda x, dtype: cast_layout(False, jnp.full(vals.shape, x, dtype), plgpu.Layout.WGMMA)
    tile = plgpu.Layout.WGMMA
    thr_tiles = [splat(t, jnp.float32) for t in thresholds]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), tile, tuple(tile for _ in thr_tiles), tile, tile))
    def add(ctx, hist, lo_tile, thr_tiles, gaps, values):
        del ctx
        red = _lane_adder(hist)
        first = lambda a: _elements(a.registers.flat[0])[0]  # (a splat: every element is the scalar)
        lo_i, thr = first(lo_tile), [first(t) for t in thr_tiles]
        zero = arith.constant(ir.F32Type.get(), 0.0)
        sums = [[zero, zero] for _ in range(len(thr) + 1)]  # two chains each: half the add latency
        cells = [
            (g, v)
            for greg, vreg in zip(gaps.registers.flat, values.registers.flat, strict=True)
            for g, v in zip(_elements(greg), _elements(vreg), strict=True)
        ]
        for n, (g, v) in enumerate(cells):
            sums[0][n % 2] = arith.addf(sums[0][n % 2], v)
            for j, t in enumerate(thr):
                past = arith.cmpf(arith.CmpFPredicate.OGE, g, t)
                sums[j + 1][n % 2] = arith.addf(sums[j + 1][n % 2], arith.select(past, v, zero))
        sums = [arith.addf(a, b) for a, b in sums]
        i32 = ir.IntegerType.get_signless(32)
        top = arith.constant(i32, num_buckets - 1)
        for j in range(len(thr) + 1):
            part = sums[j] if j == len(thr) else arith.subf(sums[j], sums[j + 1])
            red(arith.minsi(arith.addi(lo_i, arith.constant(i32, j)), top), part)

    add(hist_ref, splat(lo, jnp.int32), tuple(thr_tiles), gap, vals)


def hist_flush(interpret: bool, hist_ref, row_ref, dst):
    """Sums a consumer's lane-private histogram over its lanes into row_ref (float32 [rows]), zeroes the
    histogram, and TMA-stores the row's first dst.shape[0] buckets to dst (GMEM). Every thread of the consumer
    must have finished its adds (a warpgroup barrier first); the caller waits for the store before row_ref is
    written again."""
    plgpu.commit_smem()  # (a warpgroup barrier: every lane's adds are in)
    if interpret:
        row = jnp.sum(hist_ref[...], axis=1)
    else:
        # (unoptimized: Mosaic GPU finds no bank-conflict-free plan for a 32-column float32 tile; a flush per item)
        row = jnp.sum(plgpu.load(hist_ref, (), layout=plgpu.Layout.WGMMA, optimized=False), axis=1)
    hist_ref[...] = jnp.zeros(hist_ref.shape, jnp.float32)
    row_ref[...] = row
    plgpu.commit_smem()  # the row is visible to the TMA unit, and the zeros to every lane's next adds
    width = dst.shape[0]
    for start in range(0, width, TMA_BOX):
        size = min(TMA_BOX, width - start)
        plgpu.copy_smem_to_gmem(row_ref.at[pl.ds(start, size)], dst.at[pl.ds(start, size)])


def dq_kernel(
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
    sorted_ref,
    dq_ref,
    dpos_ref,
    dtime_ref,
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
    num_ctas: int | None,
):
    wg = lax.axis_index("wg")
    buffers, (res_bar, s_bar, s_free) = scoped
    q_res2, do_res2, lse_res2, delta_res2, stage_bufs, k_smem, v_smem, bias_bufs = buffers
    # (None: no such bias) hists: per consumer, lane-private [rows, LANES]; rows: per consumer, [rows]
    tsq_res2, tsk_smem, pos_tabs, time_tabs, thr_tabs, pos_hist, time_hist, pos_row, time_row = bias_bufs
    has_bias = params.has_pos or params.has_time
    # the table gradients (a benchmark may skip either: KernelOptions.bias_probe)
    pos_grad = params.has_pos and not params.options.probe("pos_grad")
    time_grad = params.has_time and not params.options.probe("time_grad")
    dqk, dv = q_res2.shape[-1], do_res2.shape[-1]
    bk = block_k
    dtype = q_ref.dtype
    num_seqs = offsets_ref.shape[0] - 1
    softmax = params.activation == "softmax"
    num_iters, item_of = persistent(num_ctas, num_work + num_zero, heads)

    def info(i):
        h, w = item_of(i)
        f = Frame(work_ref, offsets_ref, targets_ref, params, num_work, h, w)
        return (f, *cta_range(f, k_tiles, bk, params))

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def load_res(i):
        """Starts the TMAs of this consumer's resident Q and dO rows (and lse, delta) of the CTA's i-th item."""
        f, _, _ = info(i)

        @pl.when(f.valid & (i < num_iters))
        def _():
            row = pl.multiple_of(f.base + f.tile_lo + wg * RES, ALIGN)
            plgpu.copy_gmem_to_smem(rows_of(q_ref, row, RES, f.h, dqk), q_res2.at[wg], res_bar.at[wg])
            plgpu.copy_gmem_to_smem(rows_of(do_ref, row, RES, f.h, dv), do_res2.at[wg], res_bar.at[wg])
            if softmax:
                vec = pl.ds(row, RES)
                plgpu.copy_gmem_to_smem(lse_ref.at[f.h, vec], lse_res2.at[wg], res_bar.at[wg])
                plgpu.copy_gmem_to_smem(delta_ref.at[f.h, vec], delta_res2.at[wg], res_bar.at[wg])
            load_bias_res(
                ts_ref,
                pos_ref,
                time_ref,
                row,
                f.h,
                tsq_res2,
                pos_tabs,
                time_tabs,
                wg,
                res_bar,
                thr_tabs,
                heads,
            )

    def consumer_item(i, f: Frame, cta_lo, cta_hi, g0):
        q_res, do_res = q_res2.at[wg], do_res2.at[wg]
        q_lo = f.tile_lo + wg * RES
        first_row = jnp.clip(f.d - q_lo, 0, RES)
        last_row = jnp.clip(f.end - q_lo, 0, RES)
        lo, hi = k_tiles(f, q_lo, RES, bk, params)
        empty = hi <= lo
        lo, hi = jnp.where(empty, cta_lo, lo), jnp.where(empty, cta_lo, hi)
        f_lo, f_hi = k_free(f, q_lo, RES, bk, lo, hi, params)
        if (
            has_bias
        ):  # the table gradients sum dS over the cells: rows outside the sequence must be masked too
            f_hi = jnp.where((q_lo >= f.d) & (q_lo + RES <= f.end), f_hi, f_lo)

        def slot_at(n):
            return slot_of(g0 + n - cta_lo)

        def drain(n):
            slot = slot_at(n)
            plgpu.barrier_wait(s_bar.at[slot])
            plgpu.barrier_arrive(s_free.at[slot])

        plgpu.barrier_wait(res_bar.at[wg])
        lse = delta = None
        if softmax:
            lse = load_vector(interpret, lse_res2.at[wg], ROW)
            delta = load_vector(interpret, delta_res2.at[wg], ROW)
        pl.loop(cta_lo, lo)(drain)

        def body(n, carry, masked: bool, clipped: bool = False):
            dq_acc, far = carry
            slot = slot_at(n)
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            plgpu.barrier_wait(s_bar.at[slot])
            s, dp = two_products(interpret, q_res, k_tile, do_res, v_tile, (RES, bk))
            mask = None
            if masked:
                rows = (q_lo - f.d) + iota(interpret, (RES, bk), 0)
                cols = (n * bk - f.d) + iota(interpret, (RES, bk), 1)
                mask = tiling.allowed_2d(rows, cols, f.length, f.first_target, params) & (cols >= 0)
            z = s * params.alpha
            pb = None
            if has_bias:
                rel = (q_lo - n * bk) + iota(interpret, (RES, bk), 0) - iota(interpret, (RES, bk), 1)
                ts_q = ts_k = None
                if params.has_time:
                    ts_q = ts_tile(interpret, tsq_res2.at[wg], ROW, (RES, bk), 0)
                    ts_k = ts_tile(interpret, tsk_smem.at[slot], COL, (RES, bk), 1)
                pos_tab = pos_tabs.at[wg] if params.has_pos else None
                time_tab = time_tabs.at[wg] if params.has_time else None
                bias, pb, _ = tile_bias(interpret, params, pos_tab, time_tab, rel, ts_q, ts_k, clipped)
                z = z + bias
            _, ds = score_grads(z, dp, mask, lse, delta, params, 0)
            if pos_grad and clipped:  # every cell in the last bucket: row sums, added once per item
                far = far + ds.sum(axis=1)

            # the time gradient of a mask-free tile of a sorted sequence through its buckets' thresholds
            # (KernelOptions.time_grad_runs): the tile's bucket range from its extreme gaps, scalars
            runs = (
                thr_tabs is not None and time_grad and not masked and not params.options.probe("time_bucket")
            )
            if runs:
                tq, tk, thr = tsq_res2.at[wg], tsk_smem.at[slot], thr_tabs.at[wg]
                b_lo = exact_bucket(thr, tq[0, 0] - tk[0, bk - 1], params.num_time)
                b_hi = exact_bucket(thr, tq[0, RES - 1] - tk[0, 0], params.num_time)
                use_runs = (sorted_ref[f.b] > 0) & (b_hi - b_lo <= RUN_THRESHOLDS)

            def table_grads():
                """dS into this consumer's histograms (masked cells add 0), while the dQ wgmma runs. The time
                buckets are computed again from timestamps loaded again (after the wgmma's issue, so that the
                compiler cannot reuse the first ones): 32 bucket registers held across the score gradient
                spilled, and cost more than the second computation."""
                plain = params.options.probe("hist_plain")
                if pos_grad and not clipped:
                    hist_add(interpret, pos_hist.at[wg], pb, ds, diagonals=True, plain=plain)
                if not time_grad:
                    return
                if params.options.probe("time_bucket"):
                    tb = cast_layout(interpret, jnp.zeros((RES, bk), jnp.int32), plgpu.Layout.WGMMA)
                    hist_add(interpret, time_hist.at[wg], tb, ds, plain=plain)
                    return
                gap = ts_tile(interpret, tsq_res2.at[wg], ROW, (RES, bk), 0) - ts_tile(
                    interpret, tsk_smem.at[slot], COL, (RES, bk), 1
                )
                by_cell = lambda: hist_add(
                    interpret, time_hist.at[wg], time_buckets(gap, params.num_time), ds, plain=plain
                )
                if not runs:
                    by_cell()
                    return
                inf = jnp.float32(jnp.inf)
                thresholds = [
                    jnp.where(b_lo + j <= b_hi, thr[jnp.minimum(b_lo + j, params.num_time - 1)], inf)
                    for j in range(1, RUN_THRESHOLDS + 1)
                ]
                by_runs = lambda: runs_add(
                    interpret, time_hist.at[wg], b_lo, thresholds, gap, ds, params.num_time
                )
                pl.when(use_runs)(by_runs)
                pl.when(jnp.logical_not(use_runs))(by_cell)

            (dq_acc,) = accumulate(
                interpret, (dq_acc,), (ds.astype(dtype),), (k_tile,), during=table_grads if has_bias else None
            )
            plgpu.barrier_arrive(s_free.at[slot])
            return dq_acc, far

        dq = cast_layout(interpret, jnp.zeros((RES, dqk), jnp.float32), plgpu.Layout.WGMMA)
        far = cast_layout(interpret, jnp.zeros((RES,), jnp.float32), ROW) if pos_grad else None
        c_hi = k_clipped_end(q_lo, bk, f_lo, f_hi, params)  # far below the diagonal: a scalar pos bias
        carry = lax.fori_loop(lo, f_lo, functools.partial(body, masked=True), (dq, far))
        if params.has_pos:
            carry = lax.fori_loop(f_lo, c_hi, functools.partial(body, masked=False, clipped=True), carry)
        carry = lax.fori_loop(c_hi, f_hi, functools.partial(body, masked=False), carry)
        dq, far = lax.fori_loop(f_hi, hi, functools.partial(body, masked=True), carry)
        if pos_grad:  # the clipped tiles' dS, into the last position bucket
            col0 = iota(interpret, (RES, bk), 1) == 0
            sums = jnp.where(col0, lax.broadcast_in_dim(far, (RES, bk), [0]), 0.0)
            last = jnp.full((RES, bk), params.num_pos - 1, jnp.int32)
            last = cast_layout(interpret, last, plgpu.Layout.WGMMA)
            hist_add(interpret, pos_hist.at[wg], last, sums, plain=params.options.probe("hist_plain"))
        # this item's table gradients: one [buckets] row per (item, head, consumer), plain TMA stores
        slot = (f.w * heads + f.h) * COMPUTE_WGS + wg
        for hist, row, out in ((pos_hist, pos_row, dpos_ref), (time_hist, time_row, dtime_ref)):
            if hist is not None:
                width = row.shape[1]
                dst = out.at[pl.ds(pl.multiple_of(slot * width, 64), width)]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's row has been read
                hist_flush(interpret, hist.at[wg], row.at[wg], dst)
        pl.loop(hi, cta_hi)(drain)
        load_res(i + 1)  # the last wgmmas have read Q and dO (and lse, delta are in registers)
        scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
        dq = (dq * (params.alpha * scale)).astype(dtype)

        def epilogue(c):
            stage = stage_bufs[c]
            cols = stage.shape[1]  # dqk, or (D_SPLIT) a slice of it at a time
            for col in range(0, dqk, cols):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                stage[...] = dq if cols == dqk else dq[:, col : col + cols]
                plgpu.commit_smem()
                store_rows(
                    stage,
                    lambda off, size, col=col: rows_of(
                        dq_ref, f.base + q_lo + first_row + off, size, f.h, dqk, col, cols
                    ),
                    jnp.maximum(last_row - first_row, 0),
                    RES,
                    first=first_row,
                )

        for c in range(COMPUTE_WGS):
            pl.when(wg == c)(functools.partial(epilogue, c))

    @pl.when(wg < COMPUTE_WGS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")

        def one(i, g):
            f, cta_lo, cta_hi = info(i)
            pl.when(f.valid)(lambda: consumer_item(i, f, cta_lo, cta_hi, g))

            @pl.when((f.w >= num_work) & (wg == 0))
            def _():
                zero_tail(
                    stage_bufs[0], ((dq_ref, f.h, dqk),), offsets_ref, f.w - num_work,
                    num_seqs=num_seqs, total_rows=total_rows, interpret=interpret,
                )  # fmt: skip

            return g + cta_hi - cta_lo

        for hist in (pos_hist, time_hist):  # zero this consumer's histograms (the flushes keep them zero)
            if hist is not None:
                hist.at[wg][...] = jnp.zeros(hist.shape[1:], jnp.float32)
        plgpu.commit_smem()
        load_res(0)
        lax.fori_loop(0, num_iters, one, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def one(i, g):
            f, cta_lo, cta_hi = info(i)

            @pl.loop(cta_lo, cta_hi)
            def _(n):
                j = g + n - cta_lo
                slot = slot_of(j)
                row = pl.multiple_of(f.base + n * bk, ALIGN)

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(s_free.at[slot])

                plgpu.copy_gmem_to_smem(rows_of(k_ref, row, bk, f.h, dqk), k_smem.at[slot], s_bar.at[slot])
                plgpu.copy_gmem_to_smem(rows_of(v_ref, row, bk, f.h, dv), v_smem.at[slot], s_bar.at[slot])
                if params.has_time:
                    plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, bk)], tsk_smem.at[slot], s_bar.at[slot])

            return g + cta_hi - cta_lo

        g = lax.fori_loop(0, num_iters, one, jnp.int32(0))

        @pl.loop(jnp.maximum(g - stages, 0), g)
        def _(step):
            plgpu.barrier_wait(s_free.at[slot_of(step)])
