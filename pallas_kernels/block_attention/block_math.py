"""In-kernel math shared by the GPU and TPU block-attention kernels (plain jnp on one block tile)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import MASKED, dot


def probs(q, k, n, tile, alpha, causal):
    """Row-normalised softmax of one head's block scores, fp32 [tile, tile]."""
    s = dot(q, k, trans_b=True) * alpha
    row = lax.broadcasted_iota(jnp.int32, (tile, tile), 0)
    col = lax.broadcasted_iota(jnp.int32, (tile, tile), 1)
    visible = (col < n) & (row < n)  # rows past n belong to other blocks
    if causal:
        visible = visible & (col <= row)
    s = jnp.where(visible, s, MASKED)
    p = jnp.exp(s - jnp.max(s, axis=1, keepdims=True))
    # Zero, not uniform, on rows with no visible key, so they add nothing to dk, dv.
    return jnp.where(visible, p / jnp.sum(p, axis=1, keepdims=True), 0.0)
