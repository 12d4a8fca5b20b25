"""The block table: which rows of the flat token array each kernel program owns.

Blocks start at each sequence's own start, not at multiples of ``block_size`` in the
flat array, so a kernel cannot find its rows from its program id alone. We compute,
once per call and in plain jnp, one entry per program: the first row ``start``, the
number of rows ``length`` (<= block_size) and ``live`` (1: attention block, 0: a chunk
of the spare capacity past offsets[B] whose rows the kernel must zero). Every row of
[0, T) is owned by exactly one entry; surplus entries have length 0 and do nothing.
Because a sequence of L tokens has ceil(L / bs) blocks, the number of entries needed is
at most T // bs + B + 1 (the +1 covers the spare tail), which is static under jit.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import ArrayLike, Int


def num_entries(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Static upper bound on the entries a batch can need (see module docstring)."""
    return num_tokens // block_size + num_seqs + 1


def block_table(
    offsets: Int[ArrayLike, " B1"], num_tokens: int, block_size: int
) -> tuple[Int[ArrayLike, " G"], Int[ArrayLike, " G"], Int[ArrayLike, " G"]]:
    """Returns (start, length, live), each int32[num_entries(...)], sorted by start."""
    offsets = offsets.astype(jnp.int32)
    num_seqs = offsets.shape[0] - 1
    g_total = num_entries(num_tokens, num_seqs, block_size)
    lengths = offsets[1:] - offsets[:-1]
    nblk = (lengths + block_size - 1) // block_size  # blocks per sequence
    blk_end = jnp.cumsum(nblk)  # exclusive end of each sequence's block range
    total = blk_end[-1] if num_seqs > 0 else jnp.int32(0)

    g = jnp.arange(g_total, dtype=jnp.int32)
    # Attention blocks: entry g < total belongs to sequence b, block j of it.
    b = jnp.minimum(jnp.searchsorted(blk_end, g, side="right"), max(num_seqs - 1, 0))
    blk_begin = blk_end - nblk
    j = g - blk_begin[b] if num_seqs > 0 else g
    seq_start = offsets[b] if num_seqs > 0 else jnp.zeros_like(g)
    seq_len = lengths[b] if num_seqs > 0 else jnp.zeros_like(g)
    blk_start = seq_start + j * block_size
    blk_len = jnp.clip(seq_len - j * block_size, 0, block_size)
    # Spare capacity [offsets[B], T): chunks of block_size rows, zero-filled.
    tail_start = offsets[-1] + (g - total) * block_size
    tail_len = jnp.clip(num_tokens - tail_start, 0, block_size)

    is_block = g < total
    start = jnp.where(is_block, blk_start, jnp.minimum(tail_start, num_tokens))
    length = jnp.where(is_block, blk_len, tail_len)
    live = is_block.astype(jnp.int32)
    return start.astype(jnp.int32), length.astype(jnp.int32), live
