"""Argument checks shared by the kernel packages' public functions (they take the same jagged layout)."""

from __future__ import annotations

import jax.numpy as jnp


def check_jagged_qkv(q, k, v, offsets) -> None:
    """ValueError naming the bad value unless q, k are [T, H, Dqk], v is [T, H, Dv], offsets int[B+1]."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, Dqk], got shape {q.shape}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    if v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [T, H, Dv] with [T, H] = {q.shape[:2]}, got {v.shape}")
    if offsets.ndim != 1 or offsets.shape[0] < 1 or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(
            f"offsets must be an integer array [B+1] with B >= 0, got dtype {offsets.dtype}, shape {offsets.shape}"
        )
