"""Pallas Mosaic TPU jagged attention: forward, dQ and dK/dV kernels on a tile-major layout.

TPU blocks are addressed in whole blocks, while sequences start at arbitrary rows, so the wrapper
gathers q/k/v into a tile-major [H, tiles, block, D] layout (every tile holds rows of one sequence,
zero-filled past its end) and scatters the result back. Per-tile tables (sequence, first/last key
tile, ...) reach the index maps through scalar prefetch, so each (query tile, step) grid point fetches
exactly the key tile it needs; steps past a tile's causal range repeat the previous block index (no new
DMA) and skip compute. Relative bias is not implemented here (the TPU has no vector gather for the
bucket lookup); api.py falls back to the reference when it is asked for implicitly.

No TPU was available: this kernel is validated only in TPU interpret mode (pltpu.InterpretParams).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.tiling import Static, cdiv

NEG_INF = -1e30


def _layout(offsets, targets, t: int, s: Static):
  """Tile tables (all int32) for the tile-major layout; see module docstring."""
  bt = s.blocks.block_q
  b = offsets.shape[0] - 1
  lengths = jnp.minimum(offsets[1:] - offsets[:-1], s.max_seq_len)
  first_target = lengths - jnp.clip(targets, 0, lengths) if s.has_targets else lengths
  ntiles = (lengths + bt - 1) // bt
  tile_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ntiles)[:-1]]).astype(jnp.int32)
  num_tiles = min(cdiv(t, bt) + b, b * cdiv(s.max_seq_len, bt))
  idx = jnp.arange(num_tiles, dtype=jnp.int32)
  valid = idx < jnp.sum(ntiles)
  tile_b = jnp.clip(jnp.searchsorted(jnp.cumsum(ntiles), idx, side="right"), 0, b - 1).astype(jnp.int32)
  tile_m = jnp.where(valid, idx - tile_start[tile_b], 0)
  length = jnp.where(valid, lengths[tile_b], 0)
  ft = first_target[tile_b]
  lo_row = tile_m * bt
  # key tiles a query tile sees: [kv_lo, kv_hi) (absolute tile indices)
  kv_lo_row = jnp.zeros_like(lo_row)
  if s.max_attn_len > 0:
    kv_lo_row = jnp.maximum(lo_row - s.max_attn_len, 0)
    if s.has_targets:
      kv_lo_row = jnp.where(lo_row + bt > ft, 0, kv_lo_row)
  kv_hi_row = jnp.minimum(lo_row + bt, length)
  base = tile_start[tile_b]
  kv_lo = base + kv_lo_row // bt
  kv_hi = jnp.where(valid, base + (kv_hi_row + bt - 1) // bt, kv_lo)
  # query tiles that see a key tile: [q_lo, q_hi)
  q_hi_row = length
  if s.max_attn_len > 0 and not s.has_targets:
    q_hi_row = jnp.minimum(length, lo_row + bt + s.max_attn_len)
  if s.has_targets:
    q_hi_row = jnp.where(lo_row >= ft, jnp.minimum(q_hi_row, lo_row + bt), q_hi_row)
  q_lo = idx
  q_hi = jnp.where(valid, base + (q_hi_row + bt - 1) // bt, q_lo)
  rows = offsets[tile_b][:, None] + lo_row[:, None] + jnp.arange(bt, dtype=jnp.int32)[None, :]
  row_ok = (lo_row[:, None] + jnp.arange(bt)[None, :]) < length[:, None]
  tables = dict(tile_m=tile_m, length=length, first_target=ft.astype(jnp.int32), base=base,
                kv_lo=kv_lo.astype(jnp.int32), kv_hi=kv_hi.astype(jnp.int32), q_lo=q_lo, q_hi=q_hi.astype(jnp.int32))
  return tables, rows, row_ok, num_tiles


def _to_tiles(x, rows, row_ok):
  """[T, H, D] -> [H, tiles, block, D], zero past each sequence end."""
  xt = jnp.take(x, jnp.where(row_ok, rows, 0), axis=0)
  xt = jnp.where(row_ok[:, :, None, None], xt, 0)
  return jnp.transpose(xt, (2, 0, 1, 3))


def _from_tiles(xt, offsets, t: int, s: Static):
  """[H, tiles, block, D] -> [T, H, D] (zeros past offsets[B] and past max_seq_len in a sequence)."""
  bt = s.blocks.block_q
  b = offsets.shape[0] - 1
  lengths = jnp.minimum(offsets[1:] - offsets[:-1], s.max_seq_len)
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


def _positions(refs, i, other_tile, s: Static, bt: int):
  """2-D row/col positions (within the sequence) of query tile i against tile other_tile."""
  r = _tab(refs, "tile_m", i) * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
  c = (other_tile - _tab(refs, "base", i)) * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
  return r, c


def _act(sc, mask, s: Static, lse=None):
  """(p, sigmoid or None) for a score tile; for SiLU p lacks the 1/max_seq_len factor."""
  if s.activation == "silu":
    sig = jax.nn.sigmoid(sc)
    return jnp.where(mask, sc * sig, 0.0), sig
  return jnp.where(mask, jnp.exp(sc - lse), 0.0), None


def _dot(a, b, dims):
  return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _fwd_kernel(*refs, s: Static, bt: int, steps: int):
  tabs = refs[:len(_TABLES)]
  q_ref, k_ref, v_ref, o_ref, lse_ref, acc, m_scr, l_scr = refs[len(_TABLES):]
  i, j = pl.program_id(1), pl.program_id(2)
  kv = _tab(tabs, "kv_lo", i) + j

  @pl.when(j == 0)
  def _():
    acc[...] = jnp.zeros_like(acc)
    m_scr[...] = jnp.full_like(m_scr, NEG_INF)
    l_scr[...] = jnp.zeros_like(l_scr)

  @pl.when(kv < _tab(tabs, "kv_hi", i))
  def _():
    r, c = _positions(tabs, i, kv, s, bt)
    mask = tiling.allowed_2d(r, c, _tab(tabs, "length", i), _tab(tabs, "first_target", i), s)
    sc = s.alpha * _dot(q_ref[...], k_ref[...], ((1,), (1,)))
    v = v_ref[...]
    if s.activation == "silu":
      p, _ = _act(sc, mask, s)
      acc[...] += _dot(p.astype(v.dtype), v, ((1,), (0,)))
    else:
      sc = jnp.where(mask, sc, NEG_INF)
      m_prev = m_scr[...]
      m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
      p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)
      corr = jnp.exp(m_prev - m_new)
      acc[...] = acc[...] * corr + _dot(p.astype(v.dtype), v, ((1,), (0,)))
      l_scr[...] = l_scr[...] * corr + jnp.sum(p, axis=1, keepdims=True)
      m_scr[...] = m_new

  @pl.when(j == steps - 1)
  def _():
    if s.activation == "silu":
      o_ref[...] = (acc[...] * (1.0 / s.max_seq_len)).astype(o_ref.dtype)
      lse_ref[...] = jnp.zeros_like(lse_ref)
    else:
      l = l_scr[...]
      l_safe = jnp.where(l > 0, l, 1.0)
      o_ref[...] = (acc[...] / l_safe).astype(o_ref.dtype)
      lse_ref[...] = m_scr[...] + jnp.log(l_safe)


def _specs(bt, d, which):
  """BlockSpec of a [H, tiles, bt, d] tile array: this grid point's own tile, or its key/query tile."""
  if which == "own":
    return pl.BlockSpec((None, None, bt, d), lambda h, i, j, *t: (h, i, 0, 0))
  lo, hi = ("kv_lo", "kv_hi") if which == "kv" else ("q_lo", "q_hi")
  a, b = _TABLES.index(lo), _TABLES.index(hi)

  def index(h, i, j, *t):  # clamp: past the range, re-use the last block (no new DMA)
    return h, jnp.maximum(jnp.minimum(t[a][i] + j, t[b][i] - 1), 0), 0, 0

  return pl.BlockSpec((None, None, bt, d), index)


def _call(kernel, tables, inputs, in_kinds, out_shapes, out_kinds, scratch, grid, s: Static, name: str):
  in_specs = [_specs(s.blocks.block_q, x.shape[-1], kind) for x, kind in zip(inputs, in_kinds)]
  out_specs = [_specs(s.blocks.block_q, o.shape[-1], kind) for o, kind in zip(out_shapes, out_kinds)]
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(_TABLES), grid=grid, in_specs=in_specs,
                                           out_specs=out_specs, scratch_shapes=scratch)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shapes, name=name,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if s.interpret else False,
  )(*[tables[k] for k in _TABLES], *inputs)


def _forward(qt, kt, vt, tables, s: Static):
  heads, tiles, bt, dv = vt.shape
  steps = cdiv(s.max_seq_len, bt)
  kernel = functools.partial(_fwd_kernel, s=s, bt=bt, steps=steps)
  # Grid: (head, query tile, key step); the key step walks the query tile's causal key range.
  return _call(kernel, tables, [qt, kt, vt], ["own", "kv", "kv"],
               [jax.ShapeDtypeStruct(vt.shape, vt.dtype), jax.ShapeDtypeStruct((heads, tiles, bt, 1), jnp.float32)],
               ["own", "own"], [pltpu.VMEM((bt, dv), jnp.float32), pltpu.VMEM((bt, 1), jnp.float32),
                                pltpu.VMEM((bt, 1), jnp.float32)],
               (heads, tiles, steps), s, "jagged_attention_fwd_tpu")


def _dscore(sc, mask, dp, lse, delta, s: Static):
  p, sig = _act(sc, mask, s, lse)
  if s.activation == "silu":
    return p, jnp.where(mask, dp * sig * (1.0 + sc * (1.0 - sig)), 0.0)
  return p, p * (dp - delta)


def _dq_kernel(*refs, s: Static, bt: int, steps: int):
  tabs = refs[:len(_TABLES)]
  q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, acc = refs[len(_TABLES):]
  i, j = pl.program_id(1), pl.program_id(2)
  kv = _tab(tabs, "kv_lo", i) + j

  @pl.when(j == 0)
  def _():
    acc[...] = jnp.zeros_like(acc)

  @pl.when(kv < _tab(tabs, "kv_hi", i))
  def _():
    r, c = _positions(tabs, i, kv, s, bt)
    mask = tiling.allowed_2d(r, c, _tab(tabs, "length", i), _tab(tabs, "first_target", i), s)
    k = k_ref[...]
    sc = s.alpha * _dot(q_ref[...], k, ((1,), (1,)))
    dp = _dot(do_ref[...], v_ref[...], ((1,), (1,)))
    _, ds = _dscore(sc, mask, dp, lse_ref[...], delta_ref[...], s)
    acc[...] += _dot(ds.astype(k.dtype), k, ((1,), (0,)))

  @pl.when(j == steps - 1)
  def _():
    scale = s.alpha / s.max_seq_len if s.activation == "silu" else s.alpha
    dq_ref[...] = (acc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, s: Static, bt: int, steps: int):
  tabs = refs[:len(_TABLES)]
  k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs[len(_TABLES):]
  i, j = pl.program_id(1), pl.program_id(2)
  qi = _tab(tabs, "q_lo", i) + j

  @pl.when(j == 0)
  def _():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  @pl.when(qi < _tab(tabs, "q_hi", i))
  def _():
    # rows: query tile qi, cols: this key tile i (same sequence, so the same base)
    r = (_tab(tabs, "tile_m", qi)) * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    c = _tab(tabs, "tile_m", i) * bt + lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    mask = tiling.allowed_2d(r, c, _tab(tabs, "length", i), _tab(tabs, "first_target", i), s)
    q, do = q_ref[...], do_ref[...]
    sc = s.alpha * _dot(q, k_ref[...], ((1,), (1,)))
    dp = _dot(do, v_ref[...], ((1,), (1,)))
    p, ds = _dscore(sc, mask, dp, lse_ref[...], delta_ref[...], s)
    dv_acc[...] += _dot(p.astype(do.dtype), do, ((0,), (0,)))
    dk_acc[...] += _dot(ds.astype(q.dtype), q, ((0,), (0,)))

  @pl.when(j == steps - 1)
  def _():
    scale = 1.0 / s.max_seq_len if s.activation == "silu" else 1.0
    dk_ref[...] = (dk_acc[...] * (s.alpha * scale)).astype(dk_ref.dtype)
    dv_ref[...] = (dv_acc[...] * scale).astype(dv_ref.dtype)


def _backward(s: Static, res, dot):
  qt, kt, vt, ot, lse, tables = res
  heads, tiles, bt, dqk = qt.shape
  dv = vt.shape[-1]
  dot = dot.astype(vt.dtype)
  if s.activation == "softmax":
    delta = jnp.sum(dot.astype(jnp.float32) * ot.astype(jnp.float32), axis=-1, keepdims=True)
  else:
    delta = jnp.zeros_like(lse)
  steps = cdiv(s.max_seq_len, bt)
  # Grid: (head, query tile, key step), as the forward.
  dq = _call(functools.partial(_dq_kernel, s=s, bt=bt, steps=steps), tables,
             [qt, dot, lse, delta, kt, vt], ["own", "own", "own", "own", "kv", "kv"],
             [jax.ShapeDtypeStruct(qt.shape, qt.dtype)], ["own"], [pltpu.VMEM((bt, dqk), jnp.float32)],
             (heads, tiles, steps), s, "jagged_attention_bwd_dq_tpu")[0]
  # Grid: (head, key tile, query step); the query step walks the query tiles that see the key tile.
  dk, dvv = _call(functools.partial(_dkv_kernel, s=s, bt=bt, steps=steps), tables,
                  [kt, vt, qt, dot, lse, delta], ["own", "own", "q", "q", "q", "q"],
                  [jax.ShapeDtypeStruct(kt.shape, kt.dtype), jax.ShapeDtypeStruct(vt.shape, vt.dtype)],
                  ["own", "own"], [pltpu.VMEM((bt, dqk), jnp.float32), pltpu.VMEM((bt, dv), jnp.float32)],
                  (heads, tiles, steps), s, "jagged_attention_bwd_dkv_tpu")
  return dq, dk, dvv, None


@functools.partial(jax.custom_vjp, nondiff_argnames=("s",))
def _attention_tiles(qt, kt, vt, tables, s: Static):
  return _forward(qt, kt, vt, tables, s)[0]


def _attention_tiles_fwd(qt, kt, vt, tables, s: Static):
  ot, lse = _forward(qt, kt, vt, tables, s)
  return ot, (qt, kt, vt, ot, lse, tables)


_attention_tiles.defvjp(_attention_tiles_fwd, _backward)


def jagged_attention_tpu(q, k, v, offsets, *, max_seq_len, activation, alpha, num_targets, max_attn_len,
                         timestamps, pos_bias, time_bias, interpret=False, block_sizes: BlockSizes | None = None):
  """Pallas Mosaic TPU jagged attention (see api.jagged_attention for the arguments)."""
  del timestamps  # only used by time_bias
  if pos_bias is not None or time_bias is not None:
    raise ValueError("the TPU kernel has no relative bias yet: use implementation='reference' with "
                     f"pos_bias={None if pos_bias is None else pos_bias.shape}, "
                     f"time_bias={None if time_bias is None else time_bias.shape}")
  t = q.shape[0]
  if alpha is None:
    alpha = 1.0 / math.sqrt(q.shape[-1])
  if block_sizes is None:
    block_sizes = BlockSizes.get_default("cpu" if interpret else "tpu", max(q.shape[-1], v.shape[-1]), max_seq_len)
  s = Static(max_seq_len=max_seq_len, activation=activation, alpha=float(alpha), max_attn_len=max_attn_len,
             has_targets=num_targets is not None, has_pos=False, has_time=False, num_pos=1, num_time=1,
             interpret=interpret, blocks=block_sizes)
  b = offsets.shape[0] - 1
  targets = jnp.zeros((b,), jnp.int32) if num_targets is None else num_targets.astype(jnp.int32)
  tables, rows, row_ok, _ = _layout(offsets, targets, t, s)
  qt, kt, vt = (_to_tiles(x, rows, row_ok) for x in (q, k, v))
  ot = _attention_tiles(qt, kt, vt, tables, s=s)
  return _from_tiles(ot, offsets, t, s)
