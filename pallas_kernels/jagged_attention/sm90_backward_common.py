"""What the Hopper backward kernels (sm90_dkv.py, sm90_dq.py) share: the work item's frame and its ranges of
streamed tiles, the score tile's bias and dS, wgmma helpers, the persistent walk, jagged stores and tail zeroing.
The design is in gpu_sm90_backward.py's docstring.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv_dyn
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.sm90_common import (
    ALIGN,
    LOG2E,
    ZERO_TILES,
    copy_table,
    gather,
    store_rows,
    table_chunks,
    time_buckets,
)
from pallas_kernels.mosaic_common import cast_layout, load_vector

RES = 64  # resident rows per consumer warpgroup
COMPUTE_WGS = 2
TILE = COMPUTE_WGS * RES  # rows of one work item


def interpret_matmul(a, b, trans_b: bool):
    """float32 a @ b (b^T with trans_b) of two arrays: the interpreter's wgmma."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def two_products(interpret: bool, a1, b1, a2, b2, shape):
    """(a1 b1^T, a2 b2^T) in float32 [shape]: two wgmmas of shared-memory operands, one wait."""
    if interpret:
        return interpret_matmul(a1[...], b1[...], True), interpret_matmul(a2[...], b2[...], True)

    def scope(r1, r2):
        plgpu.wgmma(r1, a1, plgpu.transpose_ref(b1, (1, 0)))
        plgpu.wgmma(r2, a2, plgpu.transpose_ref(b2, (1, 0)))
        return r1[...], r2[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def accumulate(interpret: bool, accs, lhs, rhs, during=None):
    """accs[i] + lhs[i] @ rhs[i] (lhs: registers, rhs: shared-memory refs), wgmmas with one wait; `during()`
    (if given) runs between their issue and the wait, beside the tensor cores."""
    if interpret:
        out = tuple(acc + interpret_matmul(a, b[...], False) for acc, a, b in zip(accs, lhs, rhs))
        if during is not None:
            during()
        return out

    def scope(refs):
        for r, a, b in zip(refs, lhs, rhs):
            plgpu.wgmma(r, a, b)
        if during is not None:
            during()

    return pl.run_state(scope)(tuple(plgpu.ACC.init(acc) for acc in accs))


def one_product(interpret: bool, a, b, shape):
    """a b^T in float32 [shape]: one wgmma of shared-memory operands."""
    if interpret:
        return interpret_matmul(a[...], b[...], True)

    def scope(r):
        plgpu.wgmma(r, a, plgpu.transpose_ref(b, (1, 0)))
        return r[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def tile_bias(
    interpret: bool, params: KernelParams, pos_tab, time_tab, rel, ts_q, ts_k, clipped: bool = False
):
    """(float32 bias, position bucket, time bucket) of a tile's cells (None where a table is absent): rel is
    i - j (int32, the tile's shape), ts_q and ts_k the query and key timestamps (tiling.relative_timestamps)
    broadcast to it. As the forward: the tables' rows are in shared memory, gathered per cell; the time bucket
    is sm90_common.time_buckets of the gap. A `clipped` tile lies wholly past the last position bucket
    (i - j >= num_pos - 1 in every cell): its position bias is that bucket's scalar, and no position bucket
    comes back."""
    bias = pb = tb = None
    probe = params.options.probe  # (benchmark-only skips: KernelOptions.bias_probe)
    if params.has_pos and clipped:
        bias = pos_tab[params.num_pos - 1]
    elif params.has_pos:
        pb = jnp.clip(rel, 0, params.num_pos - 1)
        bias = pos_tab[0] if probe("pos_gather") else gather(interpret, pos_tab, pb)
    if params.has_time and probe("time_bucket"):
        tb = cast_layout(interpret, jnp.zeros(rel.shape, jnp.int32), plgpu.Layout.WGMMA)
        bias = time_tab[0] if bias is None else time_tab[0] + bias
    elif params.has_time:
        tb = time_buckets(ts_q - ts_k, params.num_time)
        time_bias = gather(interpret, time_tab, tb)
        bias = time_bias if bias is None else time_bias + bias
    return bias, pb, tb


def ts_tile(interpret: bool, ref, layout, shape, dim: int):
    """A float32 tile of `shape` from a [1, n] shared-memory ref of relative timestamps, as a vector in `layout`
    broadcast along the tile's other dimension (dim: the one it varies along)."""
    return lax.broadcast_in_dim(load_vector(interpret, ref.at[0], layout), shape, [dim])


class Frame:
    """The work item's sequence in its aligned frame (scalars read from GMEM at run time)."""

    def __init__(
        self, work_ref, offsets_ref, targets_ref, params: KernelParams, num_work: int, h, w, tile: int = TILE
    ):
        def work(k, wc):
            return work_ref[k * num_work + wc]

        wc = jnp.minimum(w, num_work - 1)
        self.h, self.w = h, w
        self.valid = (w < num_work) & (work(2, wc) > 0)
        b = work(0, wc)
        self.b = b  # the sequence
        start = offsets_ref[b]
        self.d = lax.rem(start, jnp.int32(ALIGN))  # the sequence's offset in its frame
        self.base = start - self.d  # global row of frame row 0
        self.length = jnp.minimum(offsets_ref[b + 1] - start, params.max_seq_len)
        self.first_target = self.length
        if params.has_targets:
            self.first_target = self.length - jnp.clip(targets_ref[b], 0, self.length)
        self.tile_lo = work(1, wc) * tile  # frame row of the item's first resident row (items of `tile` rows)
        self.end = self.d + self.length  # frame row past the sequence


def cta_range(f, tiles, block: int, params: KernelParams):
    """[lo, hi) of the streamed tiles an item's two consumers see between them: the union of their
    ranges (`tiles(f, first row, rows, block, params)`), empty for a padding item."""
    lo0, hi0 = tiles(f, f.tile_lo, RES, block, params)
    lo1, hi1 = tiles(f, f.tile_lo + RES, RES, block, params)
    lo = jnp.where(hi1 > lo1, jnp.minimum(lo0, lo1), lo0)
    return lo, jnp.where(f.valid, jnp.maximum(hi0, hi1), lo)


def q_tiles(f: Frame, k_lo, nk: int, bq: int, params: KernelParams):
    """[lo, hi) query tiles (bq frame rows) that can see frame key rows [k_lo, k_lo + nk); lo = hi: none."""
    has = (k_lo < f.end) & (k_lo + nk > f.d)
    hi_row = f.end
    if params.max_attn_len > 0 and not params.has_targets:
        hi_row = jnp.minimum(hi_row, k_lo + nk + params.max_attn_len)
    if params.has_targets:  # a key range wholly inside the targets is seen by its own rows only
        hi_row = jnp.where(k_lo >= f.d + f.first_target, jnp.minimum(hi_row, k_lo + nk), hi_row)
    lo = k_lo // bq
    hi = jnp.maximum(cdiv_dyn(hi_row, bq), lo)
    return jnp.where(has, lo, 0), jnp.where(has, hi, 0)


def q_free(f: Frame, k_lo, nk: int, bq: int, lo, hi, params: KernelParams):
    """[f_lo, f_hi) within [lo, hi): query tiles whose every row sees every key of [k_lo, k_lo + nk)."""
    f_lo = cdiv_dyn(k_lo + nk - 1, bq)  # causal: the tile's first query row is at or past the last key
    f_hi = f.end // bq  # the whole tile inside the sequence
    if params.max_attn_len > 0:  # q_lo + bq - 1 - k_lo <= window (also for targets: conservative)
        f_hi = jnp.minimum(f_hi, (k_lo + params.max_attn_len - bq + 1) // bq + 1)
        f_hi = jnp.where(k_lo + params.max_attn_len - bq + 1 >= 0, f_hi, 0)
    if params.has_targets:  # keys all in the history: history rows see them causally, targets see all
        f_hi = jnp.where(k_lo + nk <= f.d + f.first_target, f_hi, 0)
    f_hi = jnp.where(k_lo >= f.d, f_hi, 0)  # frame rows before the sequence are masked
    f_lo = jnp.clip(f_lo, lo, hi)
    return f_lo, jnp.clip(f_hi, f_lo, hi)


def k_tiles(f: Frame, q_lo, nq: int, bk: int, params: KernelParams):
    """[lo, hi) key tiles (bk frame rows) that frame query rows [q_lo, q_lo + nq) see (gpu_sm90 kv_range)."""
    has = (q_lo < f.end) & (q_lo + nq > f.d)
    hi = cdiv_dyn(jnp.minimum(q_lo + nq, f.end), bk)
    lo = jnp.int32(0)
    if params.max_attn_len > 0:
        lo_col = jnp.maximum(jnp.maximum(q_lo, f.d) - params.max_attn_len, f.d)
        if params.has_targets:  # a tile holding targets sees the whole history
            lo_col = jnp.where(q_lo + nq > f.d + f.first_target, f.d, lo_col)
        lo = lo_col // bk
    hi = jnp.where(has, hi, 0)
    return jnp.minimum(jnp.where(has, lo, 0), hi), hi


def k_free(f: Frame, q_lo, nq: int, bk: int, lo, hi, params: KernelParams):
    """[f_lo, f_hi) within [lo, hi): key tiles every row of [q_lo, q_lo + nq) sees whole (gpu_sm90 mask_free)."""
    f_hi = jnp.minimum(q_lo + 1, f.d + f.first_target) // bk
    f_lo = cdiv_dyn(f.d, bk)
    if params.max_attn_len > 0:
        f_lo = jnp.maximum(f_lo, cdiv_dyn(jnp.maximum(q_lo + nq - 1 - params.max_attn_len, 0), bk))
    f_lo = jnp.clip(f_lo, lo, hi)
    return f_lo, jnp.clip(f_hi, f_lo, hi)


def k_clipped_end(q_lo, bk: int, f_lo, f_hi, params: KernelParams):
    """Key tiles [f_lo, end) of the mask-free range [f_lo, f_hi) wholly past the last position bucket for the
    query rows from q_lo (min(i - j) = q_lo - (n + 1) bk + 1 >= num_pos - 1; gpu_sm90's pos_far_end)."""
    if not params.has_pos:
        return f_lo
    return jnp.clip((q_lo - params.num_pos + 2) // bk, f_lo, f_hi)  # floor division: < 0 when none is


def q_clipped_start(k_lo, nk: int, bq: int, f_lo, f_hi, params: KernelParams):
    """Query tiles [start, f_hi) of the mask-free range [f_lo, f_hi) wholly past the last position bucket for
    the key rows [k_lo, k_lo + nk) (min(i - j) = n bq - k_lo - nk + 1 >= num_pos - 1)."""
    if not params.has_pos:
        return f_hi
    return jnp.clip(cdiv_dyn(k_lo + nk + params.num_pos - 2, bq), f_lo, f_hi)


def score_grads(z, dp, mask, lse, delta, params: KernelParams, lse_dim: int):
    """(p, dScore) in float32 from the scores z (alpha q.k), dP and the mask (None: all allowed); for softmax lse
    and delta are vectors broadcast along dimension lse_dim of the tile. SiLU: without 1/max_seq_len."""
    if params.activation == "silu":
        half = z * 0.5
        th = jnp.tanh(half)
        sig = 0.5 + 0.5 * th
        p = half + half * th  # z * sig
        ds = dp * (sig + p * (1.0 - sig))  # silu'(z) = sig + z sig (1 - sig)
    else:
        lse2 = lax.broadcast_in_dim(lse * LOG2E, z.shape, [lse_dim])
        p = jnp.exp2(z * LOG2E - lse2)
        ds = p * (dp - lax.broadcast_in_dim(delta, z.shape, [lse_dim]))
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
        ds = jnp.where(mask, ds, 0.0)
    return p, ds


def p_and_factor(z, mask, lse, params: KernelParams, lse_dim: int):
    """(p, g) in float32 from the scores z (alpha q.k; the mask None: all allowed), g the factor that makes dS
    from dP: SiLU dS = dP g with g = silu'(z) (without 1/max_seq_len), softmax dS = g (dP - delta) with g = p.
    Zero in masked cells (where, not a product: a masked cell's z may be NaN)."""
    if params.activation == "silu":
        half = z * 0.5
        th = jnp.tanh(half)
        sig = 0.5 + 0.5 * th
        p = half + half * th  # z * sig
        g = sig + p * (1.0 - sig)  # silu'(z) = sig + z sig (1 - sig)
    else:
        lse2 = lax.broadcast_in_dim(lse * LOG2E, z.shape, [lse_dim])
        p = g = jnp.exp2(z * LOG2E - lse2)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
        g = p if params.activation == "softmax" else jnp.where(mask, g, 0.0)
    return p, g


def rows_of(ref, row, size, h, d, col: int = 0, cols: int | None = None):
    """[size, d] GMEM window of head h at `row` (ref is [T, H * d]); [size, cols] from its column `col`."""
    if cols is None or cols == d:
        return ref.at[pl.ds(row, size), pl.ds(h * d, d)]
    return ref.at[pl.ds(row, size), pl.ds(h * d + col, cols)]


def zero_tail(stage, outs, offsets_ref, z, *, num_seqs: int, total_rows: int, interpret: bool):
    """Tail item z zeroes rows [z, z + 1) * ZERO_TILES * TILE past offsets[B] of each (ref, head, d) of outs."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = cast_layout(interpret, jnp.zeros(stage.shape, stage.dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    tail = offsets_ref[num_seqs]
    for i in range(ZERO_TILES * COMPUTE_WGS):
        lo = (z * ZERO_TILES * COMPUTE_WGS + i) * RES
        first = jnp.clip(tail - lo, 0, RES)  # rows [lo, lo + first) are real tokens
        count = jnp.where(lo < total_rows, RES - first, 0)
        for ref, h, d in outs:
            cols = min(d, stage.shape[1])  # a stage narrower than d (D_SPLIT): d in slices of its width
            for col in range(0, d, cols):
                store_rows(
                    stage.at[:, pl.ds(0, d)] if d < stage.shape[1] else stage,
                    lambda off, size, lo=lo, first=first, ref=ref, h=h, d=d, col=col, cols=cols: rows_of(
                        ref, lo + first + off, size, h, d, col, cols
                    ),
                    count,
                    RES,
                )


def load_bias_res(
    ts_ref, pos_ref, time_ref, row, h, ts_res2, pos_tabs, time_tabs, wg, barrier, thr_tabs=None, heads=0
):
    """Starts the TMAs of a consumer's resident rows' timestamps and its head's bias tables (each arriving once
    on barrier.at[wg]: bias_copies of them); with thr_tabs, also the time buckets' thresholds (time_ref's row
    `heads`, gpu_layout.time_thresholds)."""
    if ts_res2 is not None:
        plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, RES)], ts_res2.at[wg], barrier.at[wg])
    if time_tabs is not None:
        copy_table(time_ref.at[h], time_tabs.at[wg], barrier.at[wg])
    if thr_tabs is not None:
        copy_table(time_ref.at[heads], thr_tabs.at[wg], barrier.at[wg])
    if pos_tabs is not None:
        copy_table(pos_ref.at[h], pos_tabs.at[wg], barrier.at[wg])


def bias_copies(params: KernelParams, thresholds: bool = False) -> int:
    """TMA copies load_bias_res starts (with the thresholds: thresholds)."""
    time_copies = 1 + table_chunks(params.num_time) * (1 + thresholds)
    return params.has_time * time_copies + params.has_pos * table_chunks(params.num_pos)


def cta_index(heads: int):
    """The CTA's linear index in the one-CTA-per-(head, item) grid."""
    return lax.axis_index("heads") + heads * lax.axis_index("items")


def scoped_kernel(body, smem, barriers):
    """plgpu.kernel entry: runs body(*refs, scoped) inside the scoped shared memory and barriers."""

    def entry(*refs):
        pl.run_scoped(lambda *sc: body(*refs, sc), smem, barriers, collective_axes="wg")

    return entry


def store_slices(stage, val, dst, first_row, last_row):
    """TMA-stores rows [first_row, last_row) of the [RES, d] value val through the staging buffer, its width of
    columns at a time (dst(row offset, size, col, cols): the GMEM window)."""
    cols = stage.shape[1]
    for col in range(0, val.shape[1], cols):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores have read the buffer
        stage[...] = val[:, col : col + cols]
        plgpu.commit_smem()
        store_rows(
            stage,
            lambda off, size, col=col: dst(off, size, col, cols),
            jnp.maximum(last_row - first_row, 0),
            RES,
            first=first_row,
        )
