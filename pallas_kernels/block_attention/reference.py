"""Pure-jnp BlockAttention: the specification every backend is tested against.

Each sequence of the jagged batch is cut into consecutive blocks of ``block_size``
tokens counted from its own start; a token attends (softmax) to the tokens of its own
block only (earlier-or-equal ones when causal). Because a block never spans more than
``block_size`` tokens, a query only ever sees keys in the band
``[i - block_size + 1, i + block_size - 1]``: the reference scores that band with
explicit per-position masks, so its memory is linear in T (O(T * block_size)) and the
math stays in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels.common import MASKED


def token_layout(
    offsets: Int[ArrayLike, " B1"], num_tokens: int
) -> tuple[Int[ArrayLike, " T"], Int[ArrayLike, " T"], Int[ArrayLike, " T"]]:
    """Per-token (sequence id, position in sequence, validity) from ``offsets``.

    Tokens past ``offsets[-1]`` get sequence id ``B`` and validity 0.
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    offsets = offsets.astype(jnp.int32)
    # seq[t] = b with offsets[b] <= t < offsets[b+1]; empty sequences are skipped.
    seq = jnp.searchsorted(offsets[1:], t, side="right").astype(jnp.int32)
    valid = t < offsets[-1]
    start = offsets[jnp.minimum(seq, offsets.shape[0] - 1)]
    pos = t - start
    return seq, pos, valid.astype(jnp.int32)


def block_attention_reference(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    *,
    block_size: int = 64,
    causal: bool = False,
    alpha: float | None = None,
) -> Float[ArrayLike, "T H Dv"]:
    """BlockAttention in fp32 with per-position masks (see module docstring).

    Args:
      q: queries, [T, H, Dqk].
      k: keys, [T, H, Dqk].
      v: values, [T, H, Dv].
      offsets: int32[B+1], sequence b is tokens offsets[b]:offsets[b+1].
      block_size: tokens per attention block, counted from each sequence's start.
      causal: if True a token sees only earlier-or-equal tokens of its block.
      alpha: score scale, default 1/sqrt(Dqk).

    Returns:
      [T, H, Dv] in v.dtype; rows past offsets[-1] are zero.
    """
    num_tokens, _, dqk = q.shape
    if alpha is None:
        alpha = 1.0 / float(dqk) ** 0.5
    seq, pos, valid = token_layout(offsets, num_tokens)
    blk = pos // block_size

    # Key j = i + r for r in [-(bs-1), bs-1]: everything a block can contain.
    rel = jnp.arange(-(block_size - 1), block_size, dtype=jnp.int32)  # [W]
    i = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]  # [T, 1]
    j = i + rel[None, :]  # [T, W]
    in_range = (j >= 0) & (j < num_tokens)
    jc = jnp.clip(j, 0, num_tokens - 1)
    mask = (
        in_range
        & (valid[:, None] == 1)
        & (valid[jc] == 1)
        & (seq[jc] == seq[:, None])
        & (blk[jc] == blk[:, None])
    )
    if causal:
        mask = mask & (rel[None, :] <= 0)

    # Spare capacity may hold anything (even NaN); it must not leak through 0 * x.
    keep = (valid == 1)[:, None, None]
    qf = jnp.where(keep, q.astype(jnp.float32), 0.0)
    kw = jnp.where(keep, k.astype(jnp.float32), 0.0)[jc]  # [T, W, H, Dqk]
    vw = jnp.where(keep, v.astype(jnp.float32), 0.0)[jc]  # [T, W, H, Dv]
    s = alpha * jnp.einsum("thd,twhd->thw", qf, kw, precision=jax.lax.Precision.HIGHEST)
    s = jnp.where(mask[:, None, :], s, MASKED)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, :], p, 0.0)
    out = jnp.einsum("thw,twhd->thd", p, vw, precision=jax.lax.Precision.HIGHEST)
    out = jnp.where(valid[:, None, None] == 1, out, 0.0)
    return out.astype(v.dtype)
