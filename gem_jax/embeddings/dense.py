"""A dense embedding table: one nnx Param, `jnp.take` lookups, pooled bags via segment_sum.

The next-item model's item table (`hashed=False`: id i is row i, since the table doubles as the tied
output layer and a hash collision would merge two items' scores). It is small (10^4-10^5 items) and
trained by the dense optimizer like any parameter, so its gradient is table-sized; the ranking task's
large tables live in `EmbeddingCollection` (sharded, sparse updates; docs/embeddings.md).

With `hashed=True` raw ids (any int32) are hashed into the table's rows, so the id space can exceed the
table. Rows carry the logical axis "rows", so the rules table can shard them (row-wise) over the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import ArrayLike, Float, Int

from gem_jax.embeddings.hashing import hash_ids
from gem_jax.parallel import param
from gem_jax.precision import PrecisionPolicy


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
