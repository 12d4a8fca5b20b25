"""Embedding tables with id hashing: unpooled lookups for sequences, pooled bags for features.

Raw ids (any int32) are hashed into the table's rows, so the id space can exceed the table. Rows
carry the logical axis "rows" so the rules table can shard them (row-wise) across the mesh.
`hashed=False` makes id i row i (dense ids, e.g. next-item retrieval, where the table doubles as
the output layer and a hash collision would merge two items' scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import ArrayLike, Float, Int

from gem_jax.model.layers import param
from gem_jax.precision import PrecisionPolicy


def hash_ids(ids: Int[ArrayLike, ...], rows: int) -> Int[ArrayLike, ...]:
    """Multiplicative (Knuth) hash of raw ids into [0, rows); mixes nearby ids across rows."""
    h = ids.astype(jnp.uint32) * jnp.uint32(2654435761)
    h = h ^ (h >> 16)
    return (h % jnp.uint32(rows)).astype(jnp.int32)


class HashedEmbedding(nnx.Module):
    def __init__(self, rows: int, dim: int, policy: PrecisionPolicy, *, rngs: nnx.Rngs, hashed: bool = True):
        self.rows = rows
        self.hashed = hashed
        self.table = param(
            rngs, nnx.initializers.normal(0.05), (rows, dim), ("rows", "embed"), policy.param_dtype
        )

    def lookup(self, ids: Int[ArrayLike, ...]) -> Float[ArrayLike, "... d"]:
        """Unpooled lookup (sequence tokens); dense ids (`hashed=False`) must lie in [0, rows)."""
        rows = hash_ids(ids, self.rows) if self.hashed else ids
        return jnp.take(self.table[...], rows, axis=0)

    def pooled(
        self,
        values: Int[ArrayLike, " S"],
        bag_ids: Int[ArrayLike, " S"],
        bag_sizes: Int[ArrayLike, " N"],
        *,
        mode: str,
    ) -> Float[ArrayLike, "N d"]:
        """Pools jagged bags: value s belongs to bag `bag_ids[s]` (== N for unused capacity).

        Sum or mean; an empty bag pools to zeros.
        """
        num_bags = bag_sizes.shape[0]
        sums = jax.ops.segment_sum(self.lookup(values), bag_ids, num_segments=num_bags + 1)[:num_bags]
        if mode == "sum":
            return sums
        return sums / jnp.maximum(bag_sizes, 1).astype(sums.dtype)[:, None]


def segment_ids(offsets: Int[ArrayLike, " B1"], capacity: int) -> Int[ArrayLike, " S"]:
    """Segment of each flat position under jagged `offsets`; N for positions past offsets[N]."""
    positions = jnp.arange(capacity)
    seg = jnp.searchsorted(offsets, positions, side="right") - 1
    return jnp.where(positions < offsets[-1], seg, offsets.shape[0] - 1).astype(jnp.int32)
