"""Long-history attention for the HSTU tower: linear cost in the history length.

Sequence layout (gem_jax/data/batch.py): `num_context` context slots, the history oldest first,
then `num_targets[b]` candidate tokens. Per layer, each sequence is split *in place* into

* the **recent part**: the context slots, the `recent_len` most recent history events and the
  candidates. It is gathered into its own (much shorter) jagged layout and gets the project's full
  jagged attention (`gem_jax.model.attention.attention`: HSTU SiLU or softmax, the target mask, the
  relative position and time bias), then scattered back;
* the **older prefix**: every older event. BlockAttention (`pallas_kernels.block_attention`, causal
  softmax inside blocks of `block_size` tokens) runs over the whole sequence cut at the split point
  (two block sequences per example: context slots + older prefix, then recent events + candidates),
  so nothing is copied; its output is kept on the older rows only.

Combination: *replace*, not a sum or a gate. Recent rows (context, recent events, candidates) take
the jagged attention output, older rows the block attention output. Why:
  1. candidates keep the exact target mask of full attention (they see the context, the recent
     events and themselves, never each other), because their rows never mix in block output: the
     second block sequence does contain the candidates, but its rows are all overwritten;
  2. the two outputs are on different scales (softmax averages vs. SiLU sums divided by the
     sequence length) and the layer's LayerNorm over the attention output normalises each row on
     its own, which a sum would not (one term would dominate);
  3. it adds no parameters and no work beyond the two kernels; recent_len >= the history length
     gives back the plain HSTU layer exactly (tested).
Causal blocks keep a history row's meaning the same as in the full tower (it depends only on
earlier events). The relative position/time bias applies in the recent part only; positions
there are counted in the gathered layout, so the gap between the context slots and the first
recent event is closed (time deltas use the real timestamps and are unchanged).

What the candidates see: the context slots, the `recent_len` most recent events and themselves.
The older prefix reaches them only indirectly, through the model's history-mean summary (gem.py
averages the tower output over all history rows) and through the context slots' cross features.

Pyramid (`pyramid[i]`: fraction of the most recent history events kept at layer i): a layer with
fraction f < 1 runs on a compacted jagged layout holding, per sequence, the context slots, the
ceil(f * L) most recent of its L history events and the candidates (new offsets, gather). Dropped
events are frozen: their rows keep the value of the last layer that ran them and are scattered
back into the full layout, so the tower's output still has every row. Candidates at a pyramid
layer therefore see min(recent_len, ceil(f * L)) recent events (fewer only when f * L < recent_len).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from gem_jax.model.attention import AttentionSpec, attention
from pallas_kernels.block_attention import block_attention


def sequence_parts(
    offsets: Int[ArrayLike, " B1"], num_targets: Int[ArrayLike, " B"], num_context: int
) -> tuple[Int[ArrayLike, " B"], Int[ArrayLike, " B"]]:
    """Per sequence: (context slots, history events); padding examples give (0, 0)."""
    rest = jnp.maximum(jnp.diff(offsets) - num_targets, 0)
    ctx = jnp.minimum(rest, num_context)
    return ctx, rest - ctx


def suffix_layout(
    offsets: Int[ArrayLike, " B1"],
    num_targets: Int[ArrayLike, " B"],
    keep: Int[ArrayLike, " B"],
    *,
    num_context: int,
    capacity: int,
) -> tuple[Int[ArrayLike, " B1"], Int[ArrayLike, " R"]]:
    """A compact jagged layout of: context slots + the `keep[b]` most recent events + targets.

    Because the kept events and the targets form a contiguous suffix of each sequence, a row of the
    new layout maps to `start + p` (context slot p) or `end - new_length + p` (suffix) in the old one.

    Returns:
      new_offsets: int32[B+1], capped at `capacity`.
      rows: int32[capacity], the old row of each new row; rows past new_offsets[B] get -1
        (callers clip them for gathers and drop them from scatters).
    """
    ctx, hist = sequence_parts(offsets, num_targets, num_context)
    keep = jnp.minimum(keep, hist)
    lengths = jnp.where(jnp.diff(offsets) > 0, ctx + keep + num_targets, 0)
    new_offsets = jnp.minimum(
        jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lengths).astype(jnp.int32)]), capacity
    )
    r = jnp.arange(capacity, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(new_offsets[1:], r, side="right"), 0, lengths.shape[0] - 1)
    p = r - new_offsets[b]
    old = jnp.where(p < ctx[b], offsets[b] + p, offsets[b + 1] - lengths[b] + p)
    return new_offsets, jnp.where(r < new_offsets[-1], old, -1).astype(jnp.int32)


def gather_rows(x: Array, rows: Int[ArrayLike, " R"]) -> Array:
    """x[rows] for a compact layout's row map (rows < 0, the unused tail, read row 0)."""
    return jnp.take(x, jnp.maximum(rows, 0), axis=0, mode="clip")


def scatter_rows(full: Array, rows: Int[ArrayLike, " R"], values: Array) -> Array:
    """full[rows] = values, dropping rows < 0 (the unused tail of a compact layout)."""
    return full.at[jnp.where(rows < 0, full.shape[0], rows)].set(values, mode="drop")


def recent_capacity(
    num_tokens: int, num_examples: int, *, num_context: int, recent_len: int, max_targets: int
) -> int:
    """Static row capacity of the recent-part layout: every example's longest recent part."""
    return min(num_tokens, num_examples * (num_context + recent_len + max_targets))


def pyramid_capacity(
    num_tokens: int, num_examples: int, fraction: float, *, num_context: int, max_targets: int
) -> int:
    """Static row capacity of a pyramid layout keeping `fraction` of the history.

    sum_b (ctx + ceil(f L_b) + C_b) <= f * T + B * (num_context + max_targets + 1); rounded up to 8.
    """
    bound = math.ceil(fraction * num_tokens) + num_examples * (num_context + max_targets + 1)
    return min(num_tokens, -(-bound // 8) * 8)


def pyramid_layout(
    offsets: Int[ArrayLike, " B1"],
    num_targets: Int[ArrayLike, " B"],
    fraction: float,
    *,
    num_context: int,
    max_targets: int,
    num_tokens: int,
) -> tuple[Int[ArrayLike, " B1"], Int[ArrayLike, " R"]]:
    """The layout of a pyramid layer: ceil(fraction * L) most recent events of each history kept."""
    _, hist = sequence_parts(offsets, num_targets, num_context)
    keep = jnp.ceil(fraction * hist.astype(jnp.float32)).astype(jnp.int32)
    capacity = pyramid_capacity(
        num_tokens, num_targets.shape[0], fraction, num_context=num_context, max_targets=max_targets
    )
    return suffix_layout(offsets, num_targets, keep, num_context=num_context, capacity=capacity)


def long_history_attention(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    num_targets: Int[ArrayLike, " B"],
    timestamps: Int[ArrayLike, " T"],
    *,
    num_context: int,
    recent_len: int,
    max_targets: int,
    block_size: int,
    max_seq_len: int,
    spec: AttentionSpec,
    pos_bias: Float[ArrayLike, "H P"] | None = None,
    time_bias: Float[ArrayLike, "H NT"] | None = None,
) -> Float[ArrayLike, "T H Dv"]:
    """Block attention on the older prefix, full jagged attention on the recent part (module doc).

    Args:
      q, k, v: token-major [T, H, D] projections of one jagged pack.
      offsets: int32[B+1]; num_targets: int32[B] candidates at the end of each sequence.
      timestamps: int32[T] seconds (used only with `time_bias`).
      num_context: context slots at the start of each sequence (always in the recent part).
      recent_len: most recent history events per sequence that get full attention.
      max_targets: static bound on num_targets (sizes the recent layout).
      block_size: BlockAttention block over the older prefix.
      max_seq_len: static bound on any sequence length of this pack; the recent layout's jagged
        attention uses min(max_seq_len, num_context + recent_len + max_targets) (SiLU divides by it).
      spec, pos_bias, time_bias: as `attention` (spec.block_implementation runs the block attention; no
        weight dropout here).

    Returns:
      [T, H, Dv] in v.dtype.
    """
    t, b = q.shape[0], num_targets.shape[0]
    ctx, hist = sequence_parts(offsets, num_targets, num_context)
    recent = jnp.minimum(hist, recent_len)
    # Block sequences, in place: [start, split) = context + older prefix, [split, end) = the rest.
    split = offsets[:-1] + ctx + hist - recent
    block_offsets = jnp.concatenate([jnp.stack([offsets[:-1], split], 1).reshape(-1), offsets[-1:]])
    older = block_attention(
        q,
        k,
        v,
        block_offsets,
        block_size=block_size,
        causal=True,
        implementation=spec.block_implementation,
        interpret=spec.block_interpret,
    )

    capacity = recent_capacity(t, b, num_context=num_context, recent_len=recent_len, max_targets=max_targets)
    recent_offsets, rows = suffix_layout(
        offsets, num_targets, recent, num_context=num_context, capacity=capacity
    )
    a = attention(
        gather_rows(q, rows),
        gather_rows(k, rows),
        gather_rows(v, rows),
        recent_offsets,
        spec=spec,
        max_seq_len=min(max_seq_len, num_context + recent_len + max_targets),
        num_targets=num_targets,
        timestamps=gather_rows(timestamps, rows) if time_bias is not None else None,
        pos_bias=pos_bias,
        time_bias=time_bias,
    )
    return scatter_rows(older.astype(a.dtype), rows, a)
