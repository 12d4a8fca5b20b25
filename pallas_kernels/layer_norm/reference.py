"""The spec of the fused layer norm in plain jnp: statistics in float32, as gem_jax's LayerNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float


def layer_norm_reference(
    x: Float[ArrayLike, "*rows D"],
    scale: Float[ArrayLike, " D"] | None,
    bias: Float[ArrayLike, " D"],
    gate: Float[ArrayLike, "*rows D"] | None = None,
    *,
    eps: float = 1e-6,
    out_dtype=None,
) -> Float[ArrayLike, "*rows D"]:
    """((x - mean) / sqrt(var + eps)) * scale + bias over the last axis, in `out_dtype` (default x's); times
    `gate` if given.

    The gate multiplies the norm after its cast to the output dtype (as the HSTU layer wrote `LN(a) * u`); the
    kernel multiplies in float32 and rounds once, so they differ by at most one rounding of x's dtype.
    """
    x32 = jnp.asarray(x).astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * jnp.asarray(scale).astype(jnp.float32)
    y = (y + jnp.asarray(bias).astype(jnp.float32)).astype(out_dtype or x.dtype)
    return y if gate is None else y * gate
