"""Pallas GPU (Triton lowering) jagged attention: a forward kernel and dQ, dK/dV backward kernels.

Each kernel runs a 1-D grid over (work item, head) plus a few tail programs that zero the rows past
offsets[B]. A work item is one tile of one sequence (tiling.work_list), so empty padding is never
touched. q/k/v stay in their [T, H, D] layout; tiles are masked row loads of one head.

`forward(inputs, params, bias)` -> (o, lse) and `backward(residuals, d_out, params)` -> the inputs' cotangents
take the GPU backend's layout and residuals (gpu_layout.py, which calls them).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import MASKED, cdiv, cdiv_dyn, dot
from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.block_sizes import ZERO_TILES
from pallas_kernels.jagged_attention.params import KernelParams

# Float32 inputs multiply in IEEE float32, not TF32: the float32 kernels meet the reference to 1e-4.
_dot = functools.partial(dot, exact_f32=True)


def _seq(offsets_ref, targets_ref, b, params: KernelParams):
    start = offsets_ref[b]
    length = jnp.minimum(offsets_ref[b + 1] - start, params.max_seq_len)
    first_target = length
    if params.has_targets:
        first_target = length - jnp.clip(targets_ref[b], 0, length)
    return start, length, first_target


def _rows(ref, start, lo, size, ok, h=None):
    """Masked load of `size` rows of ref (one head's [rows, D] slab when h is given)."""
    if h is None:
        return plgpu.load(ref.at[pl.ds(start + lo, size)], mask=ok, other=0)
    return plgpu.load(ref.at[pl.ds(start + lo, size), h, :], mask=ok[:, None], other=0)


def _timestamps(ts_ref, start, lo, size, ok):
    """(timestamps of the tile's rows, their min, their max over valid rows): the time-bias bucket range."""
    ts = _rows(ts_ref, start, lo, size, ok)
    big = jnp.iinfo(jnp.int32).max
    return ts, jnp.min(jnp.where(ok, ts, big)), jnp.max(jnp.where(ok, ts, -big))


class _QueryTile(NamedTuple):
    """One head's query tile: first row, row positions and mask, q, dO, timestamps, lse, delta (None: unused)."""

    lo: Any
    rows: Any
    ok: Any
    q: Any
    do: Any
    ts: Any
    lse: Any
    delta: Any


class _KeyTile(NamedTuple):
    """One head's key tile: first row, column positions and mask, k, v, timestamps (None: unused)."""

    lo: Any
    cols: Any
    ok: Any
    k: Any
    v: Any
    ts: Any


class _BiasRefs(NamedTuple):
    """A kernel's relative-bias inputs: the padded tables, the expanded position table, bias_rows (small dummies
    where unused)."""

    pos: Any
    pos_expanded: Any
    time: Any
    rows: Any


def _q_side(
    q_ref,
    ts_ref,
    *,
    start,
    q_lo,
    bq: int,
    length,
    h,
    params: KernelParams,
    do_ref=None,
    lse_ref=None,
    delta_ref=None,
    o_ref=None,
    with_ts: bool = True,
):
    """The query tile: rows [q_lo, q_lo + bq) of the sequence starting at row `start`, one head.

    The backward kernels give do_ref and lse_ref; softmax delta (rowsum(dO * O)) is loaded from delta_ref, or,
    given o_ref (the dQ kernel), computed here from the very dO tile that dP = dO V^T uses (_delta).
    """
    rows = q_lo + jnp.arange(bq, dtype=jnp.int32)
    row_ok = rows < length
    q = _rows(q_ref, start, q_lo, bq, row_ok, h)
    do = None if do_ref is None else _rows(do_ref, start, q_lo, bq, row_ok, h)
    ts_q = _timestamps(ts_ref, start, q_lo, bq, row_ok) if params.has_time and with_ts else None
    lse = delta = None
    if do_ref is not None and params.activation == "softmax":
        lse = plgpu.load(lse_ref.at[h, pl.ds(start + q_lo, bq)], mask=row_ok, other=0.0)
        if o_ref is not None:
            delta = _delta(do, _rows(o_ref, start, q_lo, bq, row_ok, h))
        else:
            delta = plgpu.load(delta_ref.at[h, pl.ds(start + q_lo, bq)], mask=row_ok, other=0.0)
    return _QueryTile(q_lo, rows, row_ok, q, do, ts_q, lse, delta)


def _delta(do, o):
    """Softmax backward's delta_i = sum_d dO_id O_id in float32, from the kernel's own dO and O tiles.

    It must come from the same dO values as dP = dO V^T: dScore = P (dP - delta) is a difference of two nearly
    equal terms (exactly equal for a row that sees one key: a target whose history is empty). Computed in XLA
    from `do.astype(float32)` instead, it could read the unrounded dO: XLA on GPU is free to drop the float32 ->
    bf16 -> float32 round trip of an upstream float32 cotangent (SimplifyFPConversions,
    xla_allow_excess_precision) while the kernel reads the bf16 dO, which leaves dScore off by bf16 rounding
    and dq/dk/dtime noisy where they are 0.
    """
    return jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1)


def _kv_side(
    k_ref, v_ref, ts_ref, *, start, k_lo, bk: int, length, h, params: KernelParams, with_ts: bool = True
):
    """The key tile: rows [k_lo, k_lo + bk) of the sequence starting at row `start`, one head."""
    cols = k_lo + jnp.arange(bk, dtype=jnp.int32)
    col_ok = cols < length
    k = _rows(k_ref, start, k_lo, bk, col_ok, h)
    v = _rows(v_ref, start, k_lo, bk, col_ok, h)
    ts_k = _timestamps(ts_ref, start, k_lo, bk, col_ok) if params.has_time and with_ts else None
    return _KeyTile(k_lo, cols, col_ok, k, v, ts_k)


def _scores(
    qt: _QueryTile,
    kt: _KeyTile,
    *,
    start,
    h,
    bias: _BiasRefs,
    params: KernelParams,
    clipped: bool,
    pos_far,
):
    """(alpha * q k^T + relative bias in float32 [rows, cols], time-bias cell data or None) of a tile pair.

    With params.bias_rows the bias is the pair's tile of bias_rows, and the time-bias cell data is computed only
    when timestamps are given (the dQ kernel needs it for the table gradient). Otherwise the bias is computed
    here: on a clipped tile (every i - j >= num_pos - 1) the position bias is the one scalar pos_far, on
    others the tile's slice of _pos_expand (a plain block load) or, without one, a per-cell gather.
    """
    bq, bk = qt.rows.shape[0], kt.cols.shape[0]
    bias_tile = pos_tile = None
    if params.bias_rows:
        bias_tile = _bias_tile(
            bias.rows, h=h, start=start, q_lo=qt.lo, bq=bq, k_lo=kt.lo, bk=bk, row_ok=qt.ok
        )
    elif not clipped:
        pos_tile = _pos_tile(bias.pos_expanded, h=h, q_lo=qt.lo, k_lo=kt.lo, params=params, bq=bq, bk=bk)
    sc = params.alpha * _dot(qt.q, kt.k, trans_b=True)
    time_ref = bias.time
    thr = time_ref[time_ref.shape[0] - 1, :] if params.has_time and qt.ts is not None else None
    if bias_tile is not None:
        tt = _time_cells(qt.ts, kt.ts, thr) if thr is not None else None
        return sc + bias_tile, tt
    if params.has_pos:
        if clipped:
            sc = sc + pos_far
        elif pos_tile is not None:
            sc = sc + pos_tile
        else:
            delta = qt.rows[:, None] - kt.cols[None, :]
            sc = sc + bias.pos[h, jnp.clip(delta, 0, params.num_pos - 1)]
    tt = None
    if params.has_time:
        tt = _time_cells(qt.ts, kt.ts, thr)
        sc = sc + _time_bias(tt, h, time_ref)
    return sc, tt


def _time_cells(ts_q, ts_k, thr):
    """(float32(max(dt, 1)) per cell, lo, hi): every cell's bucket lies in [lo, hi], the tile's exact range.

    A bucket is #{b >= 1: x >= thr[b]} (time_thresholds), monotone in x, so the extreme deltas of the tile's
    valid rows and columns bound it exactly: two 64-lane counts per tile, no logarithm and no slack.
    """
    (tq, q_min, q_max), (tk, k_min, k_max) = ts_q, ts_k
    x = jnp.maximum(tq[:, None] - tk[None, :], 1).astype(jnp.float32)
    bucket = lambda dt: jnp.sum((thr <= jnp.maximum(dt, 1).astype(jnp.float32)).astype(jnp.int32)) - 1
    return x, bucket(q_min - k_max), bucket(q_max - k_min)


def _time_bias(tt, h, time_ref):
    """time_bias[h, bucket] per cell: a compare-select per bucket of the tile's range (no gather, no log).

    time_ref row -1 holds time_thresholds; a cell at or past thr[b] takes table[b], larger b overriding.
    """
    x, lo, hi = tt
    thr = time_ref.shape[0] - 1
    return lax.fori_loop(
        lo + 1,
        hi + 1,
        lambda b, bias: jnp.where(x >= time_ref[thr, b], time_ref[h, b], bias),
        jnp.full(x.shape, time_ref[h, lo], jnp.float32),
    )


def _time_hist(hist, ds, tt, time_ref, total):
    """hist[b] += sum of ds over the tile's cells of bucket b; hist is a register row carried through the loop.

    With S_b = sum(ds where x >= thr[b]), a bucket's sum is S_b - S_{b+1}. S_lo is the whole tile's sum
    `total` (every cell with a nonzero ds has a bucket >= lo), which the caller also uses for the position
    table's clipped bucket: a tile within one bucket (most tiles away from the diagonal) costs no masked
    reduction at all, the others one per bucket above lo. No atomics.
    """
    x, lo, hi = tt
    thr = time_ref.shape[0] - 1
    lane = jnp.arange(hist.shape[0], dtype=jnp.int32)

    def body(b, carry):
        hist, prev = carry  # prev = S_{b-1}
        sb = jnp.sum(jnp.where(x >= time_ref[thr, b], ds, 0.0))
        return hist + jnp.where(lane == b - 1, prev - sb, 0.0), sb

    hist, last = lax.fori_loop(lo + 1, hi + 1, body, (hist, total))
    return hist + jnp.where(lane == hi, last, 0.0)


LOG2E = 1.4426950408889634


def _tanh(x, params: KernelParams, exact: bool):
    """tanh.approx.f32 (one MUFU op) on GPU for bf16 inputs; exact tanh for float32 inputs and interpret."""
    if exact or params.interpret:
        return jnp.tanh(x)
    return plgpu.approx_tanh(x)


def _silu_parts(x, params: KernelParams, exact: bool):
    """(silu(x), sigmoid(x)) via sigmoid(x) = (1 + tanh(x / 2)) / 2: no division on the hot path."""
    sig = 0.5 + 0.5 * _tanh(0.5 * x, params, exact)
    return x * sig, sig


def _silu_bf16x2(x):
    """silu(x) rounded to bf16, computed in packed bf16 (tanh.approx.bf16x2): half the ALU ops of float32."""
    xb = x.astype(jnp.bfloat16)
    [t] = plgpu.elementwise_inline_asm(
        "tanh.approx.bf16x2 $0, $1;",
        args=[xb * 0.5],
        constraints="=r,r",
        pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(xb.shape, jnp.bfloat16)],
    )
    return xb * (t * 0.5 + 0.5)


def _split_loop(n_lo, n_hi, f_lo, f_hi, body, carry, clip_edge=None, clipped_below=True):
    """Runs body(n, carry, masked, clipped) over [n_lo, n_hi); tiles in [f_lo, f_hi) need no mask.

    With clip_edge, tiles n < clip_edge (clipped_below) or n >= clip_edge (not clipped_below) lie wholly in
    the clipped region of the position bias; each range is split there so the body is specialised on both.
    """
    f_lo = jnp.clip(f_lo, n_lo, n_hi)
    f_hi = jnp.clip(f_hi, f_lo, n_hi)
    for a, b, masked in ((n_lo, f_lo, True), (f_lo, f_hi, False), (f_hi, n_hi, True)):
        if clip_edge is None:
            carry = lax.fori_loop(a, b, functools.partial(body, masked=masked, clipped=False), carry)
            continue
        mid = jnp.clip(clip_edge, a, b)
        carry = lax.fori_loop(a, mid, functools.partial(body, masked=masked, clipped=clipped_below), carry)
        carry = lax.fori_loop(
            mid, b, functools.partial(body, masked=masked, clipped=not clipped_below), carry
        )
    return carry


def _full_kv(q_lo, bq, bk, first_target, params: KernelParams):
    """[lo, hi) key tiles that every row of the query tile sees (no mask needed there)."""
    hi = jnp.minimum(q_lo + 1, first_target) // bk  # below the diagonal and inside the history
    lo = jnp.int32(0)
    if params.max_attn_len > 0:
        lo = cdiv_dyn(jnp.maximum(q_lo + bq - 1 - params.max_attn_len, 0), bk)
    return lo, hi


def _full_q(k_lo, bq, bk, first_target, q_hi_tiles, params: KernelParams):
    """[lo, hi) query tiles whose every row sees the whole key tile (no mask needed there)."""
    lo = cdiv_dyn(k_lo + bk - 1, bq)
    hi = q_hi_tiles
    if params.max_attn_len > 0:
        hi = jnp.minimum(hi, (k_lo + params.max_attn_len - bq + 1) // bq + 1)
    if params.has_targets:
        hi = jnp.where(k_lo + bk <= first_target, hi, lo)
    return lo, hi


def _kv_range(q_lo, bq, length, first_target, params: KernelParams):
    """[lo, hi) key rows a query tile starting at q_lo can see."""
    hi = jnp.minimum(q_lo + bq, length)
    lo = jnp.int32(0)
    if params.max_attn_len > 0:
        lo = jnp.maximum(q_lo - params.max_attn_len, 0)
        if params.has_targets:  # a tile holding targets sees the whole history
            lo = jnp.where(q_lo + bq > first_target, 0, lo)
    return lo, hi


def _q_range(k_lo, bk, length, first_target, params: KernelParams):
    """[lo, hi) query rows that can see a key tile starting at k_lo."""
    hi = length
    if params.max_attn_len > 0 and not params.has_targets:
        hi = jnp.minimum(length, k_lo + bk + params.max_attn_len)
    if params.has_targets:  # a key tile wholly inside the targets is seen by its own rows only
        hi = jnp.where(k_lo >= first_target, jnp.minimum(hi, k_lo + bk), hi)
    return k_lo, hi


def _clip_edge_kv(q_lo, bk, params: KernelParams):
    """Key tiles n < edge lie wholly in the clipped position bucket for a query tile at q_lo (None: no bias)."""
    if not params.has_pos:
        return None
    return (q_lo - params.num_pos + 2) // bk  # min(i - j) = q_lo - (n + 1) bk + 1 >= num_pos - 1


def _clip_edge_q(k_lo, bk, bq, params: KernelParams):
    """Query tiles m >= edge lie wholly in the clipped position bucket for a key tile at k_lo (None: no bias)."""
    if not params.has_pos:
        return None
    return cdiv_dyn(k_lo + bk + params.num_pos - 2, bq)  # min(i - j) = m bq - k_lo - bk + 1 >= num_pos - 1


def _pos_offsets(params: KernelParams, bq: int, bk: int):
    """(lowest q_lo - k_lo, its step, count) over the dQ kernel's tiles that are not wholly clipped.

    The dQ kernel adds each such tile's dScore into slot (q_lo - k_lo - lowest) // step of a per-head
    accumulator; the bucket of cell (a, c) there is clip(q_lo - k_lo + a - c), summed in XLA afterwards.
    """
    step = math.gcd(bq, bk)
    lowest = min(0, bk - bq)  # the key tile holding the query tile's last row
    return lowest, step, (params.num_pos + bk - 3 - lowest) // step + 1


def _pos_expand(pos_tab, params: KernelParams, bq: int, bk: int):
    """[H, offsets, bq, bk]: the position bias of every not-wholly-clipped tile offset (_pos_offsets).

    A kernel then loads its tile's bias as one block instead of gathering pos_tab per cell (slower: docs/
    kernels_jagged_attention.md); built by XLA once per call, a few MB at most.
    """
    lowest, step, count = _pos_offsets(params, bq, bk)
    off = (
        lowest
        + step * np.arange(count)[:, None, None]
        + np.arange(bq)[None, :, None]
        - np.arange(bk)[None, None, :]
    )
    return pos_tab[:, np.clip(off, 0, params.num_pos - 1)]


def _bias_tile(bias_ref, *, h, start, q_lo, bq: int, k_lo, bk: int, row_ok):
    """float32 [bq, bk] tile of bias_rows (rows past the sequence read as zeros)."""
    blk = bias_ref.at[h, pl.ds(start + q_lo, bq), pl.ds(k_lo, bk)]
    return plgpu.load(blk, mask=row_ok[:, None], other=0).astype(jnp.float32)


def _pos_tile(pos_exp_ref, *, h, q_lo, k_lo, params: KernelParams, bq: int, bk: int):
    """The tile's slice of _pos_expand (None without one: the kernels then gather per cell)."""
    if not (params.has_pos and params.options.pos_expanded):
        return None
    lowest, step, _ = _pos_offsets(params, bq, bk)
    return pos_exp_ref[h, (q_lo - k_lo - lowest) // step, :, :]


def _zero_tail(refs_heads, offsets_ref, *, z, num_seqs: int, total_rows: int, bq: int):
    """Tail program z zeroes ZERO_TILES tiles of bq rows past offsets[B] in each (ref, head) of refs_heads."""
    tail = offsets_ref[num_seqs]
    for i in range(ZERO_TILES):
        lo = (z * ZERO_TILES + i) * bq
        rows = lo + jnp.arange(bq, dtype=jnp.int32)
        ok = (rows >= tail) & (rows < total_rows)
        for ref, h in refs_heads:
            blk = ref.at[pl.ds(lo, bq), h, :]
            plgpu.store(blk, jnp.zeros(blk.shape, ref.dtype), mask=ok[:, None])


# ----------------------------------------------------------------------------------------------- forward


def _fwd_kernel(
    wb_ref,
    wm_ref,
    wv_ref,
    offsets_ref,
    targets_ref,
    ts_ref,
    q_ref,
    k_ref,
    v_ref,
    pos_ref,
    pos_exp_ref,
    time_ref,
    bias_ref,
    o_ref,
    lse_ref,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    total_rows: int,
):
    rows_bias = params.bias_rows
    bias = _BiasRefs(pos_ref, pos_exp_ref, time_ref, bias_ref)
    pid = pl.program_id(0)
    h = pid % heads
    w = pid // heads
    bq, bk = params.blocks.block_q, params.blocks.block_k
    num_seqs = offsets_ref.shape[0] - 1

    @pl.when((w < num_work) & (wv_ref[jnp.minimum(w, num_work - 1)] > 0))
    def _():
        b, m = wb_ref[w], wm_ref[w]
        start, length, first_target = _seq(offsets_ref, targets_ref, b, params)
        q_lo = m * bq
        seq = dict(start=start, length=length, h=h, params=params)
        qt = _q_side(q_ref, ts_ref, q_lo=q_lo, bq=bq, with_ts=not rows_bias, **seq)
        lo, hi = _kv_range(q_lo, bq, length, first_target, params)
        dv = v_ref.shape[-1]
        pos_far = pos_ref[h, params.num_pos - 1] if params.has_pos and not rows_bias else None

        exact = qt.q.dtype == jnp.float32

        def body(n, carry, masked, clipped):
            kt = _kv_side(k_ref, v_ref, ts_ref, k_lo=n * bk, bk=bk, with_ts=not rows_bias, **seq)
            sc, _ = _scores(
                qt, kt, start=start, h=h, bias=bias, params=params, clipped=clipped, pos_far=pos_far
            )
            mask = tiling.allowed(qt.rows, kt.cols, length, first_target, params) if masked else None
            v = kt.v
            if params.activation == "silu":
                (acc,) = carry
                if params.options.silu_bf16x2 and v.dtype == jnp.bfloat16 and not params.interpret:
                    p = _silu_bf16x2(sc)
                else:
                    p, _ = _silu_parts(sc, params, exact)
                if masked:
                    p = jnp.where(mask, p, 0.0)
                return (acc + _dot(p.astype(v.dtype), v),)
            acc, m_i, l_i = carry
            sc = sc * LOG2E  # base-2 softmax: exp2 is cheaper than exp
            if masked:
                sc = jnp.where(mask, sc, MASKED)
            m_new = jnp.maximum(m_i, jnp.max(sc, axis=1))
            p = jnp.exp2(sc - m_new[:, None])
            if masked:
                p = jnp.where(mask, p, 0.0)
            corr = jnp.exp2(m_i - m_new)
            acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
            return acc, m_new, l_i * corr + jnp.sum(p, axis=1)

        acc0 = jnp.zeros((bq, dv), jnp.float32)
        f_lo, f_hi = _full_kv(q_lo, bq, bk, first_target, params)
        clip_edge = None if rows_bias else _clip_edge_kv(q_lo, bk, params)
        loop = functools.partial(
            _split_loop, lo // bk, cdiv_dyn(hi, bk), f_lo, f_hi, body, clip_edge=clip_edge
        )
        if params.activation == "silu":
            (acc,) = loop(carry=(acc0,))
            acc = acc * (1.0 / params.max_seq_len)
        else:
            acc, m_i, l_i = loop(
                carry=(acc0, jnp.full((bq,), MASKED, jnp.float32), jnp.zeros((bq,), jnp.float32))
            )
            l_safe = jnp.where(l_i > 0, l_i, 1.0)
            acc = acc / l_safe[:, None]
            lse = (m_i + jnp.log2(l_safe)) / LOG2E  # natural-log units
            plgpu.store(lse_ref.at[h, pl.ds(start + q_lo, bq)], lse, mask=qt.ok)
        plgpu.store(o_ref.at[pl.ds(start + q_lo, bq), h, :], acc.astype(o_ref.dtype), mask=qt.ok[:, None])

    @pl.when(w >= num_work)
    def _():
        _zero_tail([(o_ref, h)], offsets_ref, z=w - num_work, num_seqs=num_seqs, total_rows=total_rows, bq=bq)


def forward(inputs, params: KernelParams, bias):
    """(o [T, H, Dv], the softmax lse [H, T]) from gpu_layout.to_kernel_layout's inputs and the bias_rows array
    (a small dummy when params.bias_rows is False: the kernels compute the bias)."""
    q, k, v, offsets, targets, ts, pos_tab, time_tab = inputs
    t, heads, _ = q.shape
    bq = params.blocks.block_q
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], params.max_seq_len)
    wb, wm, wv, num_work = tiling.work_list(lengths, bq, params.max_seq_len, t, "query")
    num_zero = cdiv(t, ZERO_TILES * bq)
    kernel = functools.partial(_fwd_kernel, params=params, heads=heads, num_work=num_work, total_rows=t)
    # Grid: one program per (work item, head), heads fastest so the heaviest tiles start first; then
    # num_zero programs per head that zero rows past offsets[B]. Blocks: whole arrays (masked row loads).
    o, lse = pl.pallas_call(
        kernel,
        grid=((num_work + num_zero) * heads,),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((heads, t), jnp.float32)),
        compiler_params=plgpu.CompilerParams(
            num_warps=params.blocks.num_warps, num_stages=params.blocks.num_stages
        ),
        interpret=params.interpret,
        name="jagged_attention_fwd",
    )(
        wb,
        wm,
        wv,
        offsets,
        targets,
        ts,
        q,
        k,
        v,
        pos_tab,
        _pos_expand_or_dummy(pos_tab, params, bq, params.blocks.block_k),
        time_tab,
        bias,
    )
    return o, lse


def _pos_expand_or_dummy(pos_tab, params: KernelParams, bq: int, bk: int):
    if params.has_pos and params.options.pos_expanded and not params.bias_rows:
        return _pos_expand(pos_tab, params, bq, bk)
    return jnp.zeros((1, 1, 16, 16), jnp.float32)


# ---------------------------------------------------------------------------------------------- backward


def _ds(sc, mask, dp, *, lse, delta, params: KernelParams, exact: bool):
    """(p, dscore) of one tile in float32, zero outside the mask (None: all allowed).

    For SiLU both lack the 1/max_seq_len factor, which the callers apply once to their accumulators.
    """
    if params.activation == "silu":
        p, sig = _silu_parts(sc, params, exact)
        ds = dp * (sig + p * (1.0 - sig))  # silu'(x) = sig + x sig (1 - sig)
    else:
        p = jnp.exp2(sc * LOG2E - (lse * LOG2E)[:, None])
        ds = p * (dp - delta[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
        ds = jnp.where(mask, ds, 0.0)
    return p, ds


POS_SLOTS = 4  # copies of the position-gradient accumulator (programs pick one by work item: less contention)


def _dq_kernel(
    wb_ref,
    wm_ref,
    wv_ref,
    offsets_ref,
    targets_ref,
    ts_ref,
    q_ref,
    k_ref,
    v_ref,
    pos_ref,
    pos_exp_ref,
    time_ref,
    bias_ref,
    do_ref,
    lse_ref,
    o_ref,
    dpos_in_ref,
    dtime_in_ref,
    dq_ref,
    dpos_ref,
    dfar_ref,
    dtime_ref,
    delta_ref,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    total_rows: int,
    pos_stores: bool,
):
    del dpos_in_ref, dtime_in_ref  # zeros, aliased to dpos_ref / dtime_ref (dpos: unless pos_stores)
    rows_bias = params.bias_rows
    bias = _BiasRefs(pos_ref, pos_exp_ref, time_ref, bias_ref)
    pid = pl.program_id(0)
    h = pid % heads
    w = pid // heads
    bq, bk = params.blocks.block_q, params.blocks.block_k
    num_seqs = offsets_ref.shape[0] - 1
    active = (w < num_work) & (wv_ref[jnp.minimum(w, num_work - 1)] > 0)

    @pl.when(active)
    def _():
        b, m = wb_ref[w], wm_ref[w]
        start, length, first_target = _seq(offsets_ref, targets_ref, b, params)
        q_lo = m * bq
        seq = dict(start=start, length=length, h=h, params=params)
        qt = _q_side(q_ref, ts_ref, q_lo=q_lo, bq=bq, do_ref=do_ref, lse_ref=lse_ref, o_ref=o_ref, **seq)
        if params.activation == "softmax":  # for the dK/dV kernel, which runs after this one
            plgpu.store(delta_ref.at[h, pl.ds(start + q_lo, bq)], qt.delta, mask=qt.ok)
        lo, hi = _kv_range(q_lo, bq, length, first_target, params)
        pos_far = pos_ref[h, params.num_pos - 1] if params.has_pos and not rows_bias else None
        lowest, step, _ = _pos_offsets(params, bq, bk)

        exact = qt.q.dtype == jnp.float32

        def body(n, carry, masked, clipped):
            dq, far, hist, seen = carry
            k_lo = n * bk
            kt = _kv_side(k_ref, v_ref, ts_ref, k_lo=k_lo, bk=bk, **seq)
            sc, tt = _scores(
                qt, kt, start=start, h=h, bias=bias, params=params, clipped=clipped, pos_far=pos_far
            )
            mask = tiling.allowed(qt.rows, kt.cols, length, first_target, params) if masked else None
            dp = _dot(qt.do, kt.v, trans_b=True)
            _, ds = _ds(sc, mask, dp, lse=qt.lse, delta=qt.delta, params=params, exact=exact)
            dq = dq + _dot(ds.astype(kt.k.dtype), kt.k)
            total = jnp.sum(ds) if params.has_time or (params.has_pos and clipped) else None
            if params.has_pos and clipped:  # the whole tile is the last bucket
                far = far + total
            elif params.has_pos:  # the tile's cells, summed per diagonal in XLA (_pos_grad)
                slot = (q_lo - k_lo - lowest) // step
                if pos_stores:  # this program's own slot: no other program writes it
                    plgpu.store(dpos_ref.at[pid, slot, pl.ds(0, bq), pl.ds(0, bk)], ds)
                    seen = seen | jnp.left_shift(jnp.int32(1), slot)
                else:
                    plgpu.atomic_add(dpos_ref, (w % POS_SLOTS, h, slot, pl.ds(0, bq), pl.ds(0, bk)), ds)
            if params.has_time:  # ds is zero on masked cells
                hist = _time_hist(hist, ds, tt, time_ref, total)
            return dq, far, hist, seen

        init = (
            jnp.zeros((bq, q_ref.shape[-1]), jnp.float32),
            jnp.zeros((), jnp.float32),
            jnp.zeros((dtime_ref.shape[-1],), jnp.float32),
            jnp.zeros((), jnp.int32),  # pos_stores: the slots written (bit per tile offset)
        )
        f_lo, f_hi = _full_kv(q_lo, bq, bk, first_target, params)
        dq, far, hist, seen = _split_loop(
            lo // bk, cdiv_dyn(hi, bk), f_lo, f_hi, body, init, clip_edge=_clip_edge_kv(q_lo, bk, params)
        )
        if params.has_time:
            dtime_ref[pid, :] = hist
        scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
        plgpu.store(
            dq_ref.at[pl.ds(start + q_lo, bq), h, :],
            (dq * (params.alpha * scale)).astype(dq_ref.dtype),
            mask=qt.ok[:, None],
        )
        dfar_ref[pid] = far
        if pos_stores:
            _zero_pos_slots(dpos_ref, pid, seen, bq, bk)

    @pl.when(jnp.logical_not(active))
    def _():
        dfar_ref[pid] = jnp.zeros((), jnp.float32)
        if pos_stores:  # an empty work item still owns its slots

            @pl.when(w < num_work)
            def _():
                _zero_pos_slots(dpos_ref, pid, jnp.int32(0), bq, bk)

    @pl.when(w >= num_work)
    def _():
        _zero_tail(
            [(dq_ref, h)], offsets_ref, z=w - num_work, num_seqs=num_seqs, total_rows=total_rows, bq=bq
        )


def _zero_pos_slots(dpos_ref, pid, seen, bq: int, bk: int):
    """Zeros into the program's position-gradient slots it did not write (bit s of `seen` clear): the
    buffer is not zeroed beforehand, so each slot is written exactly once."""
    zeros = jnp.zeros((bq, bk), jnp.float32)
    for s in range(dpos_ref.shape[1]):

        @pl.when(jnp.bitwise_and(jnp.right_shift(seen, s), 1) == 0)
        def _():
            plgpu.store(dpos_ref.at[pid, jnp.int32(s), pl.ds(0, bq), pl.ds(0, bk)], zeros)


def _dkv_kernel(
    wb_ref,
    wm_ref,
    wv_ref,
    offsets_ref,
    targets_ref,
    ts_ref,
    q_ref,
    k_ref,
    v_ref,
    pos_ref,
    pos_exp_ref,
    time_ref,
    bias_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    total_rows: int,
):
    rows_bias = params.bias_rows
    bias = _BiasRefs(pos_ref, pos_exp_ref, time_ref, bias_ref)
    pid = pl.program_id(0)
    h = pid % heads
    w = pid // heads
    bq, bk = params.blocks.block_q_dkv, params.blocks.block_k_dkv
    num_seqs = offsets_ref.shape[0] - 1

    @pl.when((w < num_work) & (wv_ref[jnp.minimum(w, num_work - 1)] > 0))
    def _():
        b, n = wb_ref[w], wm_ref[w]
        start, length, first_target = _seq(offsets_ref, targets_ref, b, params)
        k_lo = n * bk
        seq = dict(start=start, length=length, h=h, params=params)
        kt = _kv_side(k_ref, v_ref, ts_ref, k_lo=k_lo, bk=bk, with_ts=not rows_bias, **seq)
        lo, hi = _q_range(k_lo, bk, length, first_target, params)
        pos_far = pos_ref[h, params.num_pos - 1] if params.has_pos and not rows_bias else None

        exact = q_ref.dtype == jnp.float32

        def body(m, carry, masked, clipped):
            dk, dv = carry
            refs = dict(do_ref=do_ref, lse_ref=lse_ref, delta_ref=delta_ref)
            qt = _q_side(q_ref, ts_ref, q_lo=m * bq, bq=bq, with_ts=not rows_bias, **refs, **seq)
            sc, _ = _scores(
                qt, kt, start=start, h=h, bias=bias, params=params, clipped=clipped, pos_far=pos_far
            )
            mask = tiling.allowed(qt.rows, kt.cols, length, first_target, params) if masked else None
            dp = _dot(qt.do, kt.v, trans_b=True)
            p, ds = _ds(sc, mask, dp, lse=qt.lse, delta=qt.delta, params=params, exact=exact)
            dv = dv + _dot(p.astype(qt.do.dtype), qt.do, trans_a=True)
            dk = dk + _dot(ds.astype(qt.q.dtype), qt.q, trans_a=True)
            return dk, dv

        init = (jnp.zeros((bk, k_ref.shape[-1]), jnp.float32), jnp.zeros((bk, v_ref.shape[-1]), jnp.float32))
        m_hi = cdiv_dyn(hi, bq)
        f_lo, f_hi = _full_q(k_lo, bq, bk, first_target, m_hi, params)
        dk, dv = _split_loop(
            lo // bq,
            m_hi,
            f_lo,
            f_hi,
            body,
            init,
            clip_edge=None if rows_bias else _clip_edge_q(k_lo, bk, bq, params),
            clipped_below=False,
        )
        scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
        plgpu.store(
            dk_ref.at[pl.ds(start + k_lo, bk), h, :],
            (dk * (params.alpha * scale)).astype(dk_ref.dtype),
            mask=kt.ok[:, None],
        )
        plgpu.store(
            dv_ref.at[pl.ds(start + k_lo, bk), h, :], (dv * scale).astype(dv_ref.dtype), mask=kt.ok[:, None]
        )

    @pl.when(w >= num_work)
    def _():
        _zero_tail(
            [(dk_ref, h), (dv_ref, h)],
            offsets_ref,
            z=w - num_work,
            num_seqs=num_seqs,
            total_rows=total_rows,
            bq=bk,
        )


def _pos_grad(acc, far, head_of, width: int, params: KernelParams):
    """[H, width] position-table gradient from the dQ kernel's per-tile accumulator and clipped-tile sums."""
    bq, bk = params.blocks.block_q, params.blocks.block_k
    lowest, step, count = _pos_offsets(params, bq, bk)
    off = (
        lowest
        + step * np.arange(count)[:, None, None]
        + np.arange(bq)[None, :, None]
        - np.arange(bk)[None, None, :]
    )
    bucket = np.clip(off, 0, params.num_pos - 1).reshape(-1)  # masked cells (i < j) hold zeros
    heads = acc.shape[1]
    grad = jnp.zeros((heads, width), jnp.float32).at[:, bucket].add(jnp.sum(acc, axis=0).reshape(heads, -1))
    return grad.at[:, params.num_pos - 1].add(jax.ops.segment_sum(far, head_of, num_segments=heads))


def backward(residuals, d_out, params: KernelParams):
    """Cotangents of the forward's inputs (None for the integer ones) from gpu_layout.forward's residuals and the
    output's, d_out."""
    q, k, v, offsets, targets, ts, pos_tab, time_tab, o, lse, bias = residuals
    t, heads, _ = q.shape
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], params.max_seq_len)
    # softmax: the dQ kernel computes delta = rowsum(dO * O) from its own dO tiles (_delta) and hands it,
    # [H, T] float32 written on every row of a sequence, to the dK/dV kernel
    delta_shape = (heads, t) if params.activation == "softmax" else (1, 1)
    bq, bk = params.blocks.block_q, params.blocks.block_k
    wb, wm, wv, num_work = tiling.work_list(lengths, bq, params.max_seq_len, t, "query")
    num_zero = cdiv(t, ZERO_TILES * bq)
    grid = (num_work + num_zero) * heads
    compiler_params = plgpu.CompilerParams(
        num_warps=params.blocks.num_warps_bwd, num_stages=params.blocks.num_stages_bwd
    )
    # Bias-table gradients, summed in XLA below: position, one [bq, bk] tile of dScore per (program, tile
    # offset), each written once by its program, zeros where it saw no such tile (or, with atomics, into a
    # zeroed buffer per (slot, head, tile offset)); time, one histogram row per program, into zeros.
    num_offsets = _pos_offsets(params, bq, bk)[2]
    pos_stores = (
        params.has_pos
        and num_offsets < 32  # the kernel's bit mask of written slots
        and params.options.use_pos_grad_stores(num_work * heads * num_offsets * bq * bk * 4)
    )
    kernel = functools.partial(
        _dq_kernel,
        params=params,
        heads=heads,
        num_work=num_work,
        total_rows=t,
        pos_stores=pos_stores,
    )
    if not params.has_pos:
        pos_shape = (1,) * 4
    elif pos_stores:
        pos_shape = (num_work * heads, num_offsets, bq, bk)
    else:
        pos_shape = (POS_SLOTS, heads, num_offsets, bq, bk)
    # pos_stores: not zeroed (939 MB per gem_h200 layer, 0.25 ms): a dummy in its input slot
    pos_acc = jnp.zeros((1,) * 4 if pos_stores else pos_shape, jnp.float32)
    time_acc = jnp.zeros((grid if params.has_time else 1, time_tab.shape[1]), jnp.float32)
    # Grid: (work item, head) over query tiles, then tail-zeroing programs.
    dq, pos_acc, far, time_acc, delta = pl.pallas_call(
        kernel,
        grid=(grid,),
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(pos_shape, jnp.float32),
            jax.ShapeDtypeStruct((grid,), jnp.float32),
            jax.ShapeDtypeStruct(time_acc.shape, jnp.float32),
            jax.ShapeDtypeStruct(delta_shape, jnp.float32),
        ),
        input_output_aliases={17: 3} if pos_stores else {16: 1, 17: 3},
        compiler_params=compiler_params,
        interpret=params.interpret,
        name="jagged_attention_bwd_dq",
    )(
        wb,
        wm,
        wv,
        offsets,
        targets,
        ts,
        q,
        k,
        v,
        pos_tab,
        _pos_expand_or_dummy(pos_tab, params, bq, bk),
        time_tab,
        bias,
        d_out,
        lse,
        o,
        pos_acc,
        time_acc,
    )
    if pos_stores:  # program w * heads + h -> [work item, head, ...], as the atomic slots
        pos_acc = pos_acc.reshape(num_work, heads, *pos_acc.shape[1:])
    bk = params.blocks.block_k_dkv
    wb, wm, wv, num_work = tiling.work_list(lengths, bk, params.max_seq_len, t, "key")
    num_zero = cdiv(t, ZERO_TILES * bk)
    kernel = functools.partial(_dkv_kernel, params=params, heads=heads, num_work=num_work, total_rows=t)
    # Grid: (work item, head) over key tiles, heaviest first, then tail-zeroing programs.
    dk, dv = pl.pallas_call(
        kernel,
        grid=((num_work + num_zero) * heads,),
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        compiler_params=compiler_params,
        interpret=params.interpret,
        name="jagged_attention_bwd_dkv",
    )(
        wb,
        wm,
        wv,
        offsets,
        targets,
        ts,
        q,
        k,
        v,
        pos_tab,
        _pos_expand_or_dummy(pos_tab, params, params.blocks.block_q_dkv, bk),
        time_tab,
        bias,
        d_out,
        lse,
        delta,
    )
    scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
    head_of = jnp.arange(grid) % heads
    dpos = jnp.zeros(pos_tab.shape, jnp.float32)
    if params.has_pos:
        dpos = _pos_grad(pos_acc, far, head_of, pos_tab.shape[1], params) * scale
    dtime = jnp.zeros(time_tab.shape, jnp.float32)  # [H + 1, W]: the threshold row gets no gradient
    if params.has_time:
        dtime = dtime.at[:heads].set(jax.ops.segment_sum(time_acc, head_of, num_segments=heads) * scale)
    return dq, dk, dv, None, None, None, dpos.astype(pos_tab.dtype), dtime.astype(time_tab.dtype)
