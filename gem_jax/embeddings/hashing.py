"""Raw ids -> table rows (hashing) and jagged offsets -> per-position segment (bag) ids."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import ArrayLike, Int


def hash_ids(ids: Int[ArrayLike, ...], rows: int) -> Int[ArrayLike, ...]:
    """Multiplicative (Knuth) hash of raw ids into [0, rows); mixes nearby ids across rows."""
    h = ids.astype(jnp.uint32) * jnp.uint32(2654435761)
    h = h ^ (h >> 16)
    return (h % jnp.uint32(rows)).astype(jnp.int32)


def segment_ids(offsets: Int[ArrayLike, " B1"], capacity: int) -> Int[ArrayLike, " S"]:
    """Segment of each flat position under jagged `offsets`; N for positions past offsets[N]."""
    positions = jnp.arange(capacity)
    seg = jnp.searchsorted(offsets, positions, side="right") - 1
    return jnp.where(positions < offsets[-1], seg, offsets.shape[0] - 1).astype(jnp.int32)
