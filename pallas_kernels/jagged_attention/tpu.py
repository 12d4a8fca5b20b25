"""Pallas Mosaic TPU jagged attention: forward, dQ and dK/dV kernels on a tile-major layout.

TPU blocks are addressed in whole blocks, while sequences start at arbitrary rows, so the wrapper
gathers q/k/v into a tile-major [H, tiles, block, D] layout (every tile holds rows of one sequence,
zero-filled past its end) and scatters the result back. Per-tile tables (sequence, first/last key
tile, ...) reach the index maps through scalar prefetch, so each (query tile, step) grid point fetches
exactly the key tile it needs; steps past a tile's causal range repeat the previous block index (no new
DMA) and skip compute.

Relative bias: the TPU has no vector gather, so a tile's bias is built by compare-select loops over only
the bucket values the tile can hold (position: at most 2 * block - 1 values from the tile offsets, one for
a tile wholly past the last bucket; time: [min, max] of the tile's allowed cells). The tables are read as
scalars from SMEM; timestamps travel in the same tile-major layout as q. The dQ kernel also sums dScore per
bucket (same loops) into per-(head, query tile) histogram rows, which the wrapper sums over tiles.

The backend functions (the kernel-package contract, docs/architecture.md): `to_kernel_layout` builds the
tile tables and gathers q/k/v/timestamps into tiles (plain jnp, differentiated by JAX), `forward(inputs,
params)` -> (o tiles, residuals), `backward(residuals, d_out, params)` -> the inputs' cotangents,
`from_kernel_layout` scatters the output tiles back to [T, H, Dv].

No TPU has run this kernel: it is validated in TPU interpret mode (pltpu.InterpretParams) and by lowering on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels.common import MASKED, cdiv, dot
from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.params import KernelParams


def _layout(offsets, targets, t: int, params: KernelParams):
    """Tile tables (all int32) for the tile-major layout; see module docstring."""
    bt = params.blocks.block_q
    b = offsets.shape[0] - 1
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], params.max_seq_len)
    first_target = lengths - jnp.clip(targets, 0, lengths) if params.has_targets else lengths
    ntiles = (lengths + bt - 1) // bt
    tile_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ntiles)[:-1]]).astype(jnp.int32)
    num_tiles = min(cdiv(t, bt) + b, b * cdiv(params.max_seq_len, bt))
    idx = jnp.arange(num_tiles, dtype=jnp.int32)
    valid = idx < jnp.sum(ntiles)
    tile_b = jnp.clip(jnp.searchsorted(jnp.cumsum(ntiles), idx, side="right"), 0, b - 1).astype(jnp.int32)
    tile_m = jnp.where(valid, idx - tile_start[tile_b], 0)
    length = jnp.where(valid, lengths[tile_b], 0)
    ft = first_target[tile_b]
    lo_row = tile_m * bt
    # key tiles a query tile sees: [kv_lo, kv_hi) (absolute tile indices)
    kv_lo_row = jnp.zeros_like(lo_row)
    if params.max_attn_len > 0:
        kv_lo_row = jnp.maximum(lo_row - params.max_attn_len, 0)
        if params.has_targets:
            kv_lo_row = jnp.where(lo_row + bt > ft, 0, kv_lo_row)
    kv_hi_row = jnp.minimum(lo_row + bt, length)
    base = tile_start[tile_b]
    kv_lo = base + kv_lo_row // bt
    kv_hi = jnp.where(valid, base + (kv_hi_row + bt - 1) // bt, kv_lo)
    # query tiles that see a key tile: [q_lo, q_hi)
    q_hi_row = length
    if params.max_attn_len > 0 and not params.has_targets:
        q_hi_row = jnp.minimum(length, lo_row + bt + params.max_attn_len)
    if params.has_targets:
        q_hi_row = jnp.where(lo_row >= ft, jnp.minimum(q_hi_row, lo_row + bt), q_hi_row)
    q_lo = idx
    q_hi = jnp.where(valid, base + (q_hi_row + bt - 1) // bt, q_lo)
    rows = offsets[tile_b][:, None] + lo_row[:, None] + jnp.arange(bt, dtype=jnp.int32)[None, :]
    row_ok = (lo_row[:, None] + jnp.arange(bt)[None, :]) < length[:, None]
    tables = dict(
        tile_m=tile_m,
        length=length,
        first_target=ft.astype(jnp.int32),
        base=base,
        kv_lo=kv_lo.astype(jnp.int32),
        kv_hi=kv_hi.astype(jnp.int32),
        q_lo=q_lo,
        q_hi=q_hi.astype(jnp.int32),
    )
    return tables, rows, row_ok, num_tiles


def _to_tiles(x, rows, row_ok):
    """[T, H, D] -> [H, tiles, block, D], zero past each sequence end."""
    xt = jnp.take(x, jnp.where(row_ok, rows, 0), axis=0)
    xt = jnp.where(row_ok[:, :, None, None], xt, 0)
    return jnp.transpose(xt, (2, 0, 1, 3))


def _ts_tiles(ts, rows, row_ok):
    """int32[T] timestamps -> ([tiles, block, 1] query-side columns, [tiles, 1, block] key-side rows)."""
    tt = jnp.where(row_ok, jnp.take(ts.astype(jnp.int32), jnp.where(row_ok, rows, 0), axis=0), 0)
    return tt[:, :, None], tt[:, None, :]


def _from_tiles(xt, offsets, t: int, params: KernelParams):
    """[H, tiles, block, D] -> [T, H, D] (zeros past offsets[B] and past max_seq_len in a sequence)."""
    bt = params.blocks.block_q
    b = offsets.shape[0] - 1
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], params.max_seq_len)
    ntiles = (lengths + bt - 1) // bt
    tile_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ntiles)[:-1]])
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(offsets, tok, side="right") - 1, 0, b - 1)
    pos = tok - offsets[seq]
    ok = (tok < offsets[-1]) & (pos < lengths[seq])
    tile = jnp.where(ok, tile_start[seq] + pos // bt, 0)
    out = xt[:, tile, jnp.where(ok, pos % bt, 0)]  # [H, T, D]
    return jnp.where(ok[None, :, None], out, 0).transpose(1, 0, 2)


_TABLES = ("tile_m", "length", "first_target", "base", "kv_lo", "kv_hi", "q_lo", "q_hi")


def _tab(refs, name, i):
    return refs[_TABLES.index(name)][i]


def _positions(refs, i, other_tile, params: KernelParams, bt: int):
    """2-D row/col positions (within the sequence) of query tile i against tile other_tile."""
    r = _tab(refs, "tile_m", i) * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    c = (other_tile - _tab(refs, "base", i)) * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    return r, c


def _pad128(n: int) -> int:
    return cdiv(n, 128) * 128


def _bias_inputs(pos, time, ts_rows, ts_cols, rows_side: str, cols_side: str):
    """(arrays, spec kinds) of the bias inputs a kernel needs: flat tables in SMEM, timestamps as tiles."""
    arrays, kinds = [], []
    for x, kind in ((pos, "smem"), (time, "smem"), (ts_rows, rows_side), (ts_cols, cols_side)):
        if x is not None:
            arrays.append(x.reshape(-1).astype(jnp.float32) if kind == "smem" else x)
            kinds.append(kind)
    return arrays, kinds


def _split_bias(refs, params: KernelParams):
    """(pos_ref, time_ref, ts_rows_ref, ts_cols_ref) (None where absent), rest of the refs."""
    have = (params.has_pos, params.has_time, params.has_time, params.has_time)
    out, n = [], 0
    for h in have:
        out.append(refs[n] if h else None)
        n += int(h)
    return out, refs[n:]


def _bias(bias_refs, *, h, rm, cm, r, c, mask, params: KernelParams, bt: int):
    """float32 [bt, bt] relative bias of query tile rm against key tile cm (tile indices within the sequence);
    r, c: the cells' row and column positions, mask: tiling.allowed_2d of them.

    Returns (bias, pos bucket, its [lo, hi] range, time bucket, its [lo, hi] range); buckets are None when
    the table is absent. Only bucket values the tile can hold are visited (no vector gather on the TPU).
    """
    pos_ref, time_ref, tsr_ref, tsc_ref = bias_refs
    bias = jnp.zeros((bt, bt), jnp.float32)
    pb = prange = tb = trange = None
    if params.has_pos:
        last = params.num_pos - 1
        pb = jnp.clip(r - c, 0, last)
        d = (rm - cm) * bt  # i - j of the tiles' first rows; cells span d - (bt - 1) .. d + (bt - 1)
        prange = (jnp.clip(d - (bt - 1), 0, last), jnp.clip(d + (bt - 1), 0, last))
        base = h * params.num_pos
        bias = lax.fori_loop(
            prange[0], prange[1] + 1, lambda t, b: jnp.where(pb == t, pos_ref[base + t], b), bias
        )
    if params.has_time:
        last = params.num_time - 1
        tb = tiling.time_bucket(tsr_ref[...] - tsc_ref[...], params.num_time)
        trange = (
            jnp.min(jnp.where(mask, tb, last)),
            jnp.max(jnp.where(mask, tb, 0)),
        )  # empty if no allowed cell
        base = h * params.num_time
        bias = lax.fori_loop(
            trange[0], trange[1] + 1, lambda t, b: jnp.where(tb == t, b + time_ref[base + t], b), bias
        )
    return bias, pb, prange, tb, trange


def _histogram(ds, bucket, lo_hi, width: int):
    """[1, width] row with sum(ds over cells of bucket t) at lane t, for t in [lo, hi]."""
    lane = lax.broadcasted_iota(jnp.int32, (1, width), 1)

    def add(t, row):
        tot = jnp.sum(jnp.sum(jnp.where(bucket == t, ds, 0.0), axis=1, keepdims=True), axis=0, keepdims=True)
        return row + jnp.where(lane == t, tot, 0.0)

    return lax.fori_loop(lo_hi[0], lo_hi[1] + 1, add, jnp.zeros((1, width), jnp.float32))


def _act(sc, mask, params: KernelParams, lse=None):
    """(p, sigmoid or None) for a score tile; for SiLU p lacks the 1/max_seq_len factor."""
    if params.activation == "silu":
        sig = jax.nn.sigmoid(sc)
        return jnp.where(mask, sc * sig, 0.0), sig
    return jnp.where(mask, jnp.exp(sc - lse), 0.0), None


def _fwd_kernel(*refs, params: KernelParams, bt: int, steps: int):
    tabs = refs[: len(_TABLES)]
    bias_refs, refs = _split_bias(refs[len(_TABLES) :], params)
    q_ref, k_ref, v_ref, o_ref, lse_ref, acc, m_scr, l_scr = refs
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv = _tab(tabs, "kv_lo", i) + j

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)
        m_scr[...] = jnp.full_like(m_scr, MASKED)
        l_scr[...] = jnp.zeros_like(l_scr)

    @pl.when(kv < _tab(tabs, "kv_hi", i))
    def _():
        r, c = _positions(tabs, i, kv, params, bt)
        mask = tiling.allowed_2d(r, c, _tab(tabs, "length", i), _tab(tabs, "first_target", i), params)
        sc = params.alpha * dot(q_ref[...], k_ref[...], trans_b=True)
        if params.has_pos or params.has_time:
            rm, cm = _tab(tabs, "tile_m", i), kv - _tab(tabs, "base", i)
            sc = sc + _bias(bias_refs, h=h, rm=rm, cm=cm, r=r, c=c, mask=mask, params=params, bt=bt)[0]
        v = v_ref[...]
        if params.activation == "silu":
            p, _ = _act(sc, mask, params)
            acc[...] += dot(p.astype(v.dtype), v)
        else:
            sc = jnp.where(mask, sc, MASKED)
            m_prev = m_scr[...]
            m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)
            corr = jnp.exp(m_prev - m_new)
            acc[...] = acc[...] * corr + dot(p.astype(v.dtype), v)
            l_scr[...] = l_scr[...] * corr + jnp.sum(p, axis=1, keepdims=True)
            m_scr[...] = m_new

    @pl.when(j == steps - 1)
    def _():
        if params.activation == "silu":
            o_ref[...] = (acc[...] * (1.0 / params.max_seq_len)).astype(o_ref.dtype)
            lse_ref[...] = jnp.zeros_like(lse_ref)
        else:
            l = l_scr[...]
            l_safe = jnp.where(l > 0, l, 1.0)
            o_ref[...] = (acc[...] / l_safe).astype(o_ref.dtype)
            lse_ref[...] = m_scr[...] + jnp.log(l_safe)


def _specs(shape, which):
    """BlockSpec of a [H, tiles, a, b] (or head-less [tiles, a, b]) tile array: this grid point's own tile,
    or its key/query tile; "smem": the whole (flat) array in SMEM, read as scalars."""
    if which == "smem":
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    block = (None,) * (len(shape) - 2) + tuple(shape[-2:])
    heads = len(shape) == 4
    if which == "own":
        tile = lambda i, j, t: i
    else:
        lo, hi = ("kv_lo", "kv_hi") if which == "kv" else ("q_lo", "q_hi")
        a, b = _TABLES.index(lo), _TABLES.index(hi)
        tile = lambda i, j, t: jnp.maximum(
            jnp.minimum(t[a][i] + j, t[b][i] - 1), 0
        )  # past the range: last block

    def index(h, i, j, *t):
        return (h, tile(i, j, t), 0, 0) if heads else (tile(i, j, t), 0, 0)

    return pl.BlockSpec(block, index)


def _call(
    kernel, tables, *, inputs, in_kinds, out_shapes, out_kinds, scratch, grid, params: KernelParams, name: str
):
    """pallas_call of `kernel` over `grid` with the tile tables as scalar prefetch; each input and output has
    a spec kind (_specs)."""
    in_specs = [_specs(x.shape, kind) for x, kind in zip(inputs, in_kinds)]
    out_specs = [_specs(o.shape, kind) for o, kind in zip(out_shapes, out_kinds)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(_TABLES),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shapes,
        name=name,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if params.interpret else False,
    )(*[tables[k] for k in _TABLES], *inputs)


def forward(inputs, params: KernelParams):
    """(o tiles [H, tiles, block, Dv], residuals) from to_kernel_layout's inputs."""
    qt, kt, vt, tables, pos, time, ts_rows, ts_cols = inputs
    heads, tiles, bt, dv = vt.shape
    steps = cdiv(params.max_seq_len, bt)
    kernel = functools.partial(_fwd_kernel, params=params, bt=bt, steps=steps)
    bias_in, bias_kinds = _bias_inputs(pos, time, ts_rows, ts_cols, "own", "kv")
    # Grid: (head, query tile, key step); the key step walks the query tile's causal key range.
    ot, lse = _call(
        kernel,
        tables,
        inputs=[*bias_in, qt, kt, vt],
        in_kinds=[*bias_kinds, "own", "kv", "kv"],
        out_shapes=[
            jax.ShapeDtypeStruct(vt.shape, vt.dtype),
            jax.ShapeDtypeStruct((heads, tiles, bt, 1), jnp.float32),
        ],
        out_kinds=["own", "own"],
        scratch=[
            pltpu.VMEM((bt, dv), jnp.float32),
            pltpu.VMEM((bt, 1), jnp.float32),
            pltpu.VMEM((bt, 1), jnp.float32),
        ],
        grid=(heads, tiles, steps),
        params=params,
        name="jagged_attention_fwd_tpu",
    )
    return ot, (qt, kt, vt, ot, lse, tables, pos, time, ts_rows, ts_cols)


def _dscore(sc, mask, dp, lse, delta, params: KernelParams):
    p, sig = _act(sc, mask, params, lse)
    if params.activation == "silu":
        return p, jnp.where(mask, dp * sig * (1.0 + sc * (1.0 - sig)), 0.0)
    return p, p * (dp - delta)


def _dq_kernel(*refs, params: KernelParams, bt: int, steps: int):
    tabs = refs[: len(_TABLES)]
    bias_refs, refs = _split_bias(refs[len(_TABLES) :], params)
    q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, *hist_refs, acc = refs
    dpos_ref = hist_refs[0] if params.has_pos else None
    dtime_ref = hist_refs[-1] if params.has_time else None
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv = _tab(tabs, "kv_lo", i) + j

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)
        for ref in hist_refs:
            ref[...] = jnp.zeros_like(ref)

    @pl.when(kv < _tab(tabs, "kv_hi", i))
    def _():
        r, c = _positions(tabs, i, kv, params, bt)
        mask = tiling.allowed_2d(r, c, _tab(tabs, "length", i), _tab(tabs, "first_target", i), params)
        k = k_ref[...]
        sc = params.alpha * dot(q_ref[...], k, trans_b=True)
        if params.has_pos or params.has_time:
            rm, cm = _tab(tabs, "tile_m", i), kv - _tab(tabs, "base", i)
            bias, pb, prange, tb, trange = _bias(
                bias_refs, h=h, rm=rm, cm=cm, r=r, c=c, mask=mask, params=params, bt=bt
            )
            sc = sc + bias
        dp = dot(do_ref[...], v_ref[...], trans_b=True)
        _, ds = _dscore(sc, mask, dp, lse_ref[...], delta_ref[...], params)  # zero outside the mask
        acc[...] += dot(ds.astype(k.dtype), k)
        if params.has_pos:
            dpos_ref[...] += _histogram(ds, pb, prange, dpos_ref.shape[-1])
        if params.has_time:
            dtime_ref[...] += _histogram(ds, tb, trange, dtime_ref.shape[-1])

    @pl.when(j == steps - 1)
    def _():
        scale = params.alpha / params.max_seq_len if params.activation == "silu" else params.alpha
        dq_ref[...] = (acc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, params: KernelParams, bt: int, steps: int):
    tabs = refs[: len(_TABLES)]
    bias_refs, refs = _split_bias(refs[len(_TABLES) :], params)
    k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    qi = _tab(tabs, "q_lo", i) + j

    @pl.when(j == 0)
    def _():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    @pl.when(qi < _tab(tabs, "q_hi", i))
    def _():
        # rows: query tile qi, cols: this key tile i (same sequence, so the same base)
        rm, cm = _tab(tabs, "tile_m", qi), _tab(tabs, "tile_m", i)
        r = rm * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
        c = cm * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
        mask = tiling.allowed_2d(r, c, _tab(tabs, "length", i), _tab(tabs, "first_target", i), params)
        q, do = q_ref[...], do_ref[...]
        sc = params.alpha * dot(q, k_ref[...], trans_b=True)
        if params.has_pos or params.has_time:
            sc = sc + _bias(bias_refs, h=h, rm=rm, cm=cm, r=r, c=c, mask=mask, params=params, bt=bt)[0]
        dp = dot(do, v_ref[...], trans_b=True)
        p, ds = _dscore(sc, mask, dp, lse_ref[...], delta_ref[...], params)
        dv_acc[...] += dot(p.astype(do.dtype), do, trans_a=True)
        dk_acc[...] += dot(ds.astype(q.dtype), q, trans_a=True)

    @pl.when(j == steps - 1)
    def _():
        scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
        dk_ref[...] = (dk_acc[...] * (params.alpha * scale)).astype(dk_ref.dtype)
        dv_ref[...] = (dv_acc[...] * scale).astype(dv_ref.dtype)


def backward(residuals, d_out, params: KernelParams):
    """Cotangents of forward's inputs (None for the tile tables and timestamps) from its residuals and the
    output tiles' cotangent d_out."""
    qt, kt, vt, ot, lse, tables, pos, time, ts_rows, ts_cols = residuals
    heads, tiles, bt, dqk = qt.shape
    dv = vt.shape[-1]
    d_out = d_out.astype(vt.dtype)
    if params.activation == "softmax":
        delta = jnp.sum(d_out.astype(jnp.float32) * ot.astype(jnp.float32), axis=-1, keepdims=True)
    else:
        delta = jnp.zeros_like(lse)
    steps = cdiv(params.max_seq_len, bt)
    # per-(head, query tile) bucket histograms of dScore, lane-padded: block (1, 128 * n) per grid point
    hists = [
        jax.ShapeDtypeStruct((heads, tiles, 1, _pad128(n)), jnp.float32)
        for n, on in ((params.num_pos, params.has_pos), (params.num_time, params.has_time))
        if on
    ]
    bias_in, bias_kinds = _bias_inputs(pos, time, ts_rows, ts_cols, "own", "kv")
    # Grid: (head, query tile, key step), as the forward; the histograms accumulate over the key step.
    dq, *hist = _call(
        functools.partial(_dq_kernel, params=params, bt=bt, steps=steps),
        tables,
        inputs=[*bias_in, qt, d_out, lse, delta, kt, vt],
        in_kinds=[*bias_kinds, "own", "own", "own", "own", "kv", "kv"],
        out_shapes=[jax.ShapeDtypeStruct(qt.shape, qt.dtype), *hists],
        out_kinds=["own"] * (1 + len(hists)),
        scratch=[pltpu.VMEM((bt, dqk), jnp.float32)],
        grid=(heads, tiles, steps),
        params=params,
        name="jagged_attention_bwd_dq_tpu",
    )
    scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
    dtab = [jnp.sum(x, axis=(1, 2)) * scale for x in hist]  # [H, padded buckets]
    dpos = dtab[0][:, : params.num_pos].astype(pos.dtype) if params.has_pos else None
    dtime = dtab[-1][:, : params.num_time].astype(time.dtype) if params.has_time else None
    bias_in, bias_kinds = _bias_inputs(pos, time, ts_rows, ts_cols, "q", "own")
    # Grid: (head, key tile, query step); the query step walks the query tiles that see the key tile.
    dk, dvv = _call(
        functools.partial(_dkv_kernel, params=params, bt=bt, steps=steps),
        tables,
        inputs=[*bias_in, kt, vt, qt, d_out, lse, delta],
        in_kinds=[*bias_kinds, "own", "own", "q", "q", "q", "q"],
        out_shapes=[jax.ShapeDtypeStruct(kt.shape, kt.dtype), jax.ShapeDtypeStruct(vt.shape, vt.dtype)],
        out_kinds=["own", "own"],
        scratch=[pltpu.VMEM((bt, dqk), jnp.float32), pltpu.VMEM((bt, dv), jnp.float32)],
        grid=(heads, tiles, steps),
        params=params,
        name="jagged_attention_bwd_dkv_tpu",
    )
    return dq, dk, dvv, None, dpos, dtime, None, None


def to_kernel_layout(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    num_targets: Int[ArrayLike, " B"] | None,
    timestamps: Int[ArrayLike, " T"] | None,
    pos_bias: Float[ArrayLike, "H P"] | None,
    time_bias: Float[ArrayLike, "H NT"] | None,
    params: KernelParams,
) -> tuple:
    """The kernels' inputs (qt, kt, vt, tables, pos, time, ts_rows, ts_cols) from jagged_attention's arguments."""
    t = q.shape[0]
    b = offsets.shape[0] - 1
    targets = jnp.zeros((b,), jnp.int32) if num_targets is None else num_targets.astype(jnp.int32)
    tables, rows, row_ok, _ = _layout(offsets, targets, t, params)
    qt, kt, vt = (_to_tiles(x, rows, row_ok) for x in (q, k, v))
    ts_rows, ts_cols = _ts_tiles(timestamps, rows, row_ok) if time_bias is not None else (None, None)
    return qt, kt, vt, tables, pos_bias, time_bias, ts_rows, ts_cols


def from_kernel_layout(
    out: Float[ArrayLike, "H tiles block Dv"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    params: KernelParams,
) -> Float[ArrayLike, "T H Dv"]:
    """[T, H, Dv] output from the tiles (zeros past offsets[B] and past max_seq_len in a sequence)."""
    return _from_tiles(out, offsets, v.shape[0], params)
