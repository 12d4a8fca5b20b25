"""SiLU(x W + b) split into pieces, with the forward GEMM in the compute dtype and the two gradient GEMMs in
FP8, the gradient quantised inside SiLU's backward kernel (`precision.fp8_gemms = "backward"`, delayed recipe).

Why this shape: with the FP8 GEMM form XLA turned into a cuBLASLt FP8 GEMM writing float32, casting HSTU's
uvqk output ([tokens, 4 x 512] in gem_h200) back to bf16 cost more than FP8 saved on its forward GEMM on the
H200 (docs/fp8.md); the backward GEMMs' FP8 inputs can be written by the ops that produce them: the output
gradient, its transpose and its amax come out of one Pallas pass over SiLU's backward
(`pallas_kernels.silu_backward_fp8`), which also sums the bias gradient, where XLA writes the bf16 gradient
and then reads it again for the amax, the cast, the transpose and the bias.
The layer input's e4m3 copy is stored transposed ([K, M], the layout dW's GEMM reads) in the forward.

The FP8 state (histories, scales, probe) is the layer's `FP8Matmul`'s, updated by the trainer as for any FP8
layer (gem_jax/model/fp8.py): the probe's cotangent is this call's three amaxes.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from gem_jax.model.fp8 import E4M3, SCALES, amax, quantize, scaled_dot
from pallas_kernels.silu_backward_fp8 import silu_backward_fp8


@dataclasses.dataclass(frozen=True)
class _Static:
    widths: tuple[int, ...]
    compute_dtype: Any
    x_dtype: Any
    w_dtype: Any
    b_dtype: Any  # None: no bias
    implementation: str | None  # of the SiLU-backward kernel
    interpret: bool


def split_widths(a: Array, widths: tuple[int, ...]) -> tuple[Array, ...]:
    """`a` cut along its last axis into pieces of these widths."""
    return tuple(jnp.split(a, list(itertools.accumulate(widths))[:-1], axis=-1))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense_silu(static: _Static, x, w, b, scales, probe):
    return _dense_silu_fwd(static, x, w, b, scales, probe)[0]


def _dense_silu_fwd(static: _Static, x, w, b, scales, probe):
    del probe  # its value is never read; its cotangent carries the amaxes
    x_scale, w_scale, _ = scales
    cd = static.compute_dtype
    # As Dense computes it without FP8: the GEMM in the compute dtype, the bias added in float32.
    z = jnp.dot(x.astype(cd), w.astype(cd))
    if b is not None:
        z = z + b.astype(jnp.float32)
    z = z.astype(cd)
    xq_t, wq = quantize(x.T, x_scale, E4M3), quantize(w, w_scale, E4M3)
    return split_widths(jax.nn.silu(z), static.widths), (xq_t, wq, z, scales, amax(x), amax(w))


def _dense_silu_bwd(static: _Static, res, dys):
    xq_t, wq, z, scales, x_amax, w_amax = res
    x_scale, w_scale, g_scale = scales
    gq, gq_t, g_amax, db = silu_backward_fp8(
        dys, z, g_scale, implementation=static.implementation, interpret=static.interpret
    )
    hi = jax.lax.Precision.HIGHEST  # the gradient GEMMs accumulate without cuBLASLt's fast mode (fp8.py)
    dx = scaled_dot(gq, wq, g_scale, w_scale, (1, 1), static.x_dtype, hi)  # dZ W^T: [M, K]
    dw = scaled_dot(xq_t, gq_t, x_scale, g_scale, (1, 1), static.w_dtype, hi)  # X^T dZ: [K, N]
    db = None if static.b_dtype is None else db.astype(static.b_dtype)
    no_scale_grads = tuple(jnp.zeros((), jnp.float32) for _ in SCALES)  # scales are state, not parameters
    probe_cotangent = jnp.stack([x_amax, w_amax, g_amax])
    return dx, dw, db, no_scale_grads, probe_cotangent  # dx, dw in x's, w's dtypes


_dense_silu.defvjp(_dense_silu_fwd, _dense_silu_bwd)


def dense_silu_split(
    x: Float[ArrayLike, "rows din"],
    w: Float[ArrayLike, "din dout"],
    b: Float[ArrayLike, " dout"] | None,
    scales: tuple[Array, Array, Array],
    probe: Float[ArrayLike, " 3"],
    widths: tuple[int, ...],
    *,
    compute_dtype,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "rows _"], ...]:
    """split(SiLU(x w + b), widths) in `compute_dtype`; the backward's GEMMs in FP8 with the delayed
    `scales` (x_scale, w_scale, g_scale) of the layer's FP8 state and `probe` its amax probe."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or sum(widths) != w.shape[1]:
        raise ValueError(
            f"dense_silu_split wants x [rows, din], w [din, dout] and widths adding up to dout, got {x.shape}, "
            f"{w.shape}, {widths}"
        )
    static = _Static(
        tuple(widths),
        jnp.dtype(compute_dtype),
        x.dtype,
        w.dtype,
        None if b is None else jnp.asarray(b).dtype,
        implementation,
        interpret,
    )
    return _dense_silu(static, x, w, b, tuple(scales), probe)
