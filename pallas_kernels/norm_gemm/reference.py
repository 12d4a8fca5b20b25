"""The spec of the fused norm-GEMM-SiLU in plain jnp, rounding where the HSTU layer rounds.

    xn = LayerNorm(x) * gamma + beta   statistics in float32 (x is the float32 residual stream), cast to W's dtype
    z  = xn @ W + b                    the GEMM accumulates in float32; + b in float32; z rounded to W's dtype
    split(SiLU(z), widths)             SiLU of the rounded z, in W's dtype

and z itself, which the backward needs (SiLU's derivative). The kernel (gpu_sm90.py) adds b to the float32
accumulator before its one rounding, the layer rounds the GEMM's result first: they differ by one rounding.

The backward's dX side (silu_backward_reference, the spec of gpu_sm90_backward.py), from the pieces' cotangents:

    dz  = concat(d_pieces) * SiLU'(z)  in float32 from the rounded z, rounded to W's dtype (the dW GEMM's operand)
    dxn = dz @ W^T                     accumulated in float32, kept float32 (LayerNorm's backward follows)
    db  = column sums of dz            float32 sums of the rounded dz
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

EPS = 1e-6  # gem_jax's LayerNorm


def row_stats(x: Float[ArrayLike, "M K"], eps: float = EPS) -> Float[Array, "2 M"]:
    """[mean; 1 / sqrt(var + eps)] of each row, float32: what the kernel's prologue normalises with."""
    x32 = jnp.asarray(x, jnp.float32)
    mean = x32.mean(-1)
    var = jnp.square(x32 - mean[:, None]).mean(-1)
    return jnp.stack([mean, jax.lax.rsqrt(var + eps)])


def normalize(x, stats, gamma, beta, dtype) -> Array:
    """LayerNorm(x) * gamma + beta from precomputed row statistics, in `dtype`."""
    y = (jnp.asarray(x, jnp.float32) - stats[0][:, None]) * stats[1][:, None]
    return (y * jnp.asarray(gamma, jnp.float32) + jnp.asarray(beta, jnp.float32)).astype(dtype)


def split_columns(y: Array, widths: tuple[int, ...]) -> tuple[Array, ...]:
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return tuple(y[:, s : s + w] for s, w in zip(starts, widths))


def norm_silu_gemm_reference(
    x: Float[ArrayLike, "M K"],
    gamma: Float[ArrayLike, " K"],
    beta: Float[ArrayLike, " K"],
    w: Float[ArrayLike, "K N"],
    b: Float[ArrayLike, " N"],
    widths: tuple[int, ...],
    eps: float = EPS,
) -> tuple[tuple[Array, ...], Array]:
    """(split(SiLU(z), widths), z) with z = LayerNorm(x) W + b, as the HSTU layer computes them."""
    w = jnp.asarray(w)
    xn = normalize(x, row_stats(x, eps), gamma, beta, w.dtype)
    z = jnp.dot(xn, w, preferred_element_type=jnp.float32).astype(w.dtype)
    z = (z.astype(jnp.float32) + jnp.asarray(b, jnp.float32)).astype(w.dtype)
    return split_columns(jax.nn.silu(z), widths), z


def silu_backward_reference(
    d_pieces: tuple[Float[ArrayLike, "M _"], ...],
    z: Float[ArrayLike, "M N"],
    w: Float[ArrayLike, "K N"],
) -> tuple[Float[Array, "M N"], Float[Array, "M K"], Float[Array, " N"]]:
    """(dz, dxn, db) of split(SiLU(z), widths) with z = xn W + b, given the pieces' cotangents."""
    w = jnp.asarray(w)
    z32 = jnp.asarray(z, jnp.float32)
    sig = jax.nn.sigmoid(z32)
    dy = jnp.concatenate([jnp.asarray(p, jnp.float32) for p in d_pieces], axis=1)
    dz = (dy * sig * (1 + z32 * (1 - sig))).astype(w.dtype)
    dxn = jnp.dot(dz, w.T, preferred_element_type=jnp.float32)
    return dz, dxn, jnp.sum(dz.astype(jnp.float32), axis=0)
