"""The spec of the fused SiLU backward with FP8 output, in plain jnp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

E5M2 = jnp.float8_e5m2


def silu_grad(dy: Float[ArrayLike, "M N"], z: Float[ArrayLike, "M N"]) -> Float[Array, "M N"]:
    """d silu(z) = dy * s (1 + z (1 - s)), s = sigmoid(z), in float32."""
    z = jnp.asarray(z).astype(jnp.float32)
    s = jax.nn.sigmoid(z)
    return jnp.asarray(dy).astype(jnp.float32) * s * (1.0 + z * (1.0 - s))


def silu_backward_fp8_reference(
    dys: tuple[Float[ArrayLike, "M _"], ...], z: Float[ArrayLike, "M N"], scale: Float[ArrayLike, ""]
) -> tuple[Array, Array, Float[Array, ""], Float[Array, " N"]]:
    """(q, q^T, amax, column sums) of g = silu'(z) * concat(dys) with q = saturate(g * (1 / scale)) in e5m2.

    `dys` are the gradients of SiLU's output split along N (as the layer splits it); g is computed in
    float32 and never stored wider than FP8. The column sums are the gradient of a bias added before SiLU.
    """
    g = silu_grad(jnp.concatenate([jnp.asarray(d) for d in dys], axis=1), z)
    m = float(jnp.finfo(E5M2).max)
    q = jnp.clip(g * (1.0 / jnp.asarray(scale, jnp.float32)), -m, m).astype(E5M2)
    return q, q.T, jnp.max(jnp.abs(g)), jnp.sum(g, axis=0)
