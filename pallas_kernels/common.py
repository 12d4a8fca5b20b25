"""Constants and helpers every kernel package shares: the masked score, tile arithmetic, padding, the dot.

Plain jnp/lax, usable inside a Pallas kernel body (GPU Triton, TPU Mosaic, interpret mode) and in the
layout code around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Score of a masked cell, and the running maximum of an online softmax before its first key: finite, so a
# row that sees no key gives exp(MASKED - MASKED) = 1 times a zero mask rather than NaN.
MASKED = -1e30


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of static non-negative ints."""
    return -(-a // b)


def cdiv_dyn(a, b: int):
    """ceil(a / b) of a traced non-negative int by a static one."""
    return (a + b - 1) // b


def next_pow2(n: int, at_least: int = 16) -> int:
    """The smallest power of two >= n and >= at_least (Triton tensor sides are powers of two, MMAs >= 16)."""
    return max(at_least, 1 << (n - 1).bit_length())


def pad_last(x: jax.Array, size: int) -> jax.Array:
    """x zero-padded on its last axis to `size` (x itself when it already has that size)."""
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False, exact_f32: bool = False):
    """a @ b (a^T, b^T with trans_a, trans_b) of 2-D tiles, accumulated in float32.

    exact_f32: float32 operands multiply at Precision.HIGHEST (IEEE float32 on GPU, not TF32); other dtypes
    are unaffected.
    """
    precision = lax.Precision.HIGHEST if exact_f32 and a.dtype == jnp.float32 else None
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
