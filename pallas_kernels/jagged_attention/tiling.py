"""Work lists and per-tile masks shared by the GPU and TPU kernels.

A jagged batch is cut into (sequence, tile) work items. Only tiles that hold rows of a sequence are
listed, so cost follows sum(L_b^2) rather than B * N^2, and the list is sorted heaviest first (longest
processing time first), which keeps all multiprocessors busy on heavy-tailed length mixes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import cdiv
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.reference import LOG_TIME_DIVISOR

# Mosaic GPU tiles a TMA's GMEM array by (8, 64): the Hopper kernels need row starts, and so a token capacity,
# that are multiples of this (gpu_layout.to_kernel_layout pads the rows when a Mosaic GPU kernel runs)
MOSAIC_ALIGN = 8


def bias_width(max_seq_len: int, blocks: BlockSizes) -> int:
    """Columns of the GPU kernels' bias_rows array: max_seq_len rounded up to every key tile that reads it
    (and to 128), so no kernel masks its columns."""
    step = max(128, blocks.block_k, blocks.block_k_dkv)
    return cdiv(max_seq_len, step) * step


def work_list(lengths: jax.Array, block: int, max_seq_len: int, total_rows: int, by: str):
    """(seq, tile, valid, length): int32 arrays listing every tile of `block` rows, heaviest first, and their
    static length.

    by="query": tile m of a sequence scans m + 1 key tiles (forward, dQ); by="key": key tile m is seen by
    ntiles - m query tiles (dK/dV). The length is static: min(cdiv(T, block) + B, B * cdiv(N, block)).
    """
    b = lengths.shape[0]
    n_max = cdiv(max_seq_len, block)
    size = min(cdiv(total_rows, block) + b, b * n_max)
    m = jnp.arange(n_max, dtype=jnp.int32)[None, :]
    ntiles = (lengths + block - 1) // block
    valid = m < ntiles[:, None]
    cost = m if by == "query" else ntiles[:, None] - m
    key = jnp.where(valid, cost, -1).reshape(-1)
    order = jnp.argsort(-key, stable=True)[:size].astype(jnp.int32)
    return order // n_max, order % n_max, (key[order] >= 0).astype(jnp.int32), size


def allowed(rows, cols, length, first_target, params: KernelParams):
    """bool[rows, cols]: the mask of reference.allowed_mask (causal, window for non-targets, targets see the
    history and themselves)."""
    return allowed_2d(rows[:, None], cols[None, :], length, first_target, params)


def allowed_2d(r, c, length, first_target, params: KernelParams):
    """allowed() for broadcastable row/column position arrays (TPU kernels build them with 2-D iotas)."""
    causal = c <= r
    if params.max_attn_len > 0:
        causal = causal & (r - c <= params.max_attn_len)
    if params.has_targets:
        causal = jnp.where(r >= first_target, (c < first_target) | (c == r), causal)
    return (r < length) & causal


def time_bucket(dt, num_buckets: int):
    """Same formula as reference.time_buckets, written with kernel-friendly ops."""
    x = jnp.maximum(dt, 1).astype(jnp.float32)
    return jnp.clip(jnp.floor(jnp.log(x) / LOG_TIME_DIVISOR).astype(jnp.int32), 0, num_buckets - 1)


def relative_timestamps(ts, offsets):
    """float32 [1, T]: each token's timestamp minus its sequence's first token's (0 past offsets[B]).

    The Hopper kernels form a cell's time gap as one float32 subtraction of two of these, which keeps one float
    per row in shared memory and registers and one instruction per cell. It is exact, the integer gap rounded
    once as int -> float would round it, while a sequence spans less than 2**24 time units (194 days of
    seconds); past that, each operand is rounded to float32 first (a relative error of 2**-24 in the gap, which
    moves a cell's log-time bucket only at a bucket edge)."""
    ts = ts.astype(jnp.int32)
    rows = jnp.arange(ts.shape[0], dtype=jnp.int32)
    seq = jnp.searchsorted(offsets, rows, side="right") - 1  # offsets[seq] <= row < offsets[seq + 1]
    start = jnp.take(offsets, jnp.clip(seq, 0, offsets.shape[0] - 2), mode="clip")
    base = jnp.take(ts, start, mode="clip")
    return jnp.where(rows < offsets[-1], ts - base, 0).astype(jnp.float32)[None]


def sorted_sequences(ts, offsets):
    """int32 [B]: 1 where a sequence's timestamps never decrease (its time buckets along a query row then never
    increase: the Hopper dQ kernel's per-tile thresholds apply, sm90_dq.runs_add), else 0."""
    ts = ts.astype(jnp.int32)
    rows = jnp.arange(1, ts.shape[0], dtype=jnp.int32)
    seq = jnp.searchsorted(offsets, rows, side="right") - 1  # the sequence of row j (rows 1..T-1)
    inside = (rows < offsets[-1]) & (jnp.take(offsets, jnp.clip(seq, 0, offsets.shape[0] - 1)) < rows)
    down = inside & (ts[1:] < ts[:-1])  # row j's timestamp below row j-1's, in the same sequence
    num_seqs = offsets.shape[0] - 1
    unsorted = (
        jnp.zeros((num_seqs,), jnp.int32).at[jnp.clip(seq, 0, num_seqs - 1)].max(down.astype(jnp.int32))
    )
    return 1 - unsorted
