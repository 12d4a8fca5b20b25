"""Work lists and per-tile masks shared by the GPU and TPU kernels.

A jagged batch is cut into (sequence, tile) work items. Only tiles that hold rows of a sequence are
listed, so cost follows sum(L_b^2) rather than B * N^2, and the list is sorted heaviest first (longest
processing time first), which keeps all multiprocessors busy on heavy-tailed length mixes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.reference import LOG_TIME_DIVISOR


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything a kernel is specialised on (hashable: it is a nondiff argument of the custom_vjp)."""

    max_seq_len: int
    activation: str
    alpha: float
    max_attn_len: int
    has_targets: bool
    has_pos: bool
    has_time: bool
    num_pos: int  # real bucket counts (the tables may be padded wider)
    num_time: int
    interpret: bool
    blocks: BlockSizes
    options: KernelOptions = KernelOptions()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cdiv_dyn(a, b: int):
    """cdiv of a traced non-negative int by a static one."""
    return (a + b - 1) // b


def bias_width(max_seq_len: int, key_tile: int = 128) -> int:
    """Columns of the GPU kernels' bias_rows array: max_seq_len rounded up to the key tiles (at least 128)."""
    step = max(128, key_tile)
    return cdiv(max_seq_len, step) * step


def work_list(lengths: jax.Array, block: int, max_seq_len: int, total_rows: int, by: str):
    """(seq, tile, valid) int32 arrays listing every tile of `block` rows, heaviest first.

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


def allowed(rows, cols, length, first_target, s: Static):
    """bool[rows, cols]: the DESIGN.md mask (causal, window for non-targets, targets see history + self)."""
    return allowed_2d(rows[:, None], cols[None, :], length, first_target, s)


def allowed_2d(r, c, length, first_target, s: Static):
    """allowed() for broadcastable row/column position arrays (TPU kernels build them with 2-D iotas)."""
    causal = c <= r
    if s.max_attn_len > 0:
        causal = causal & (r - c <= s.max_attn_len)
    if s.has_targets:
        causal = jnp.where(r >= first_target, (c < first_target) | (c == r), causal)
    return (r < length) & causal


def time_bucket(dt, num_buckets: int):
    """Same formula as reference.time_buckets, written with kernel-friendly ops."""
    x = jnp.maximum(dt, 1).astype(jnp.float32)
    return jnp.clip(jnp.floor(jnp.log(x) / LOG_TIME_DIVISOR).astype(jnp.int32), 0, num_buckets - 1)
