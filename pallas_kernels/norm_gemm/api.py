"""The public entry point: picks the Hopper kernel or the reference, binds the backward.

`norm_silu_gemm(x, gamma, beta, w, b, widths)` is split(SiLU(LayerNorm(x) * gamma + beta) W + b), widths) as
reference.py specifies. Implementation names as every kernel package (pallas_kernels/implementations.py):
the Mosaic GPU kernel runs on a Hopper GPU when its tiles fit the shape ("gpu", None), in the Mosaic GPU
interpreter with "gpu_interpret"/"interpret" (CPU tests); everything else runs the reference, which XLA
compiles to its layer norm, cuBLAS and SiLU fusions, and which autodiff differentiates.

The kernel's backward, from the z the forward kept: dz = dy * SiLU'(z), the bias gradient its column sums and
dxn = dz W^T (reference.silu_backward_reference) come from the backward kernel (gpu_sm90_backward.py: dz made
in the GEMM's prologue, written once, its column sums as partials) where the forward ran a kernel and its tiles
fit, else from that reference in jnp; dW = xn^T dz (cuBLAS, xn recomputed from the row statistics) and
LayerNorm's backward are jnp. It is autodiff's backward of the reference, without re-running the forward GEMM.

Interpret mode needs XLA:CPU's thread pool to be larger than the kernel's three warpgroups, which wait on each
other: the pool has max(PJRT_NPROC or NPROC or the schedulable cores, CPU devices) threads, two on a 2-core
machine, where the interpreter would stop for good. mosaic_common.interpreter refuses such a pool, naming the
fix (tests/conftest.py's 8 fake CPU devices give 8 threads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from pallas_kernels import implementations
from pallas_kernels.common import is_hopper
from pallas_kernels.norm_gemm.reference import (
    EPS,
    norm_silu_gemm_reference,
    row_stats,
    silu_backward_reference,
)
from pallas_kernels.norm_gemm.tiles import COMPUTE_WGS, BackwardTiles, Tiles

# The interpreter's tiles: one CTA, small tiles, so a CPU test runs in seconds.
INTERPRET_TILES = Tiles(block_m=64, block_n=64, block_k=64, stages=2, num_ctas=1)
INTERPRET_BACKWARD_TILES = BackwardTiles(block_m=64, block_n=64, block_k=64, stages=2, num_ctas=1)
WARPGROUPS = COMPUTE_WGS + 1  # both kernels': the consumers and a TMA producer, which wait on each other


def kernel_for(
    implementation: str | None, x_shape, widths, tiles: Tiles | None = None
) -> tuple[str, Tiles | None]:
    """("gpu" | "gpu_interpret" | "reference", tiles): what a call runs."""
    kernel = implementations.resolve(implementation)
    m, k = x_shape
    if kernel == "gpu_interpret":
        tiles = tiles or INTERPRET_TILES
    elif kernel == "gpu" and is_hopper():
        tiles = tiles or Tiles()
    else:
        return "reference", None
    return (kernel, tiles) if tiles.applies(m, k, widths) else ("reference", None)


def norm_silu_gemm(
    x: Float[ArrayLike, "M K"],
    gamma: Float[ArrayLike, " K"],
    beta: Float[ArrayLike, " K"],
    w: Float[ArrayLike, "K N"],
    b: Float[ArrayLike, " N"],
    widths: tuple[int, ...],
    *,
    implementation: str | None = None,
    tiles: Tiles | None = None,
) -> tuple[Float[Array, "M _"], ...]:
    """split(SiLU(LN(x) W + b), widths) in W's dtype; `tiles` (benchmarks) overrides the kernel's."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"norm_silu_gemm: x must be [M, K] and w [K, N], got {x.shape} and {w.shape}")
    if sum(widths) != w.shape[1]:
        raise ValueError(f"norm_silu_gemm: widths {widths} must add up to w's {w.shape[1]} columns")
    kernel, tiles = kernel_for(implementation, x.shape, widths, tiles)
    if kernel == "reference":
        return norm_silu_gemm_reference(x, gamma, beta, w, b, widths)[0]
    return _fused(x, gamma, beta, w, b, tuple(widths), kernel, tiles, jnp.asarray(b).dtype)


def _run_kernel(x, gamma, beta, w, b, widths, kernel, tiles):
    # platform-only: the Mosaic GPU kernel (Hopper, or its CPU interpreter), loaded when a call runs it
    from pallas_kernels.norm_gemm.gpu_sm90 import norm_silu_gemm_sm90

    stats = row_stats(x, EPS)
    affine = jnp.stack([jnp.asarray(gamma, jnp.float32), jnp.asarray(beta, jnp.float32)])
    from pallas_kernels.mosaic_common import interpreter

    interpret = kernel == "gpu_interpret"
    with interpreter(interpret, warpgroups=WARPGROUPS):
        pieces, z = norm_silu_gemm_sm90(x, stats, affine, w, b, widths, tiles, interpret=interpret)
    return pieces, (x, stats, gamma, beta, w, z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(x, gamma, beta, w, b, widths, kernel, tiles, b_dtype):
    """b_dtype: b's, for its gradient (static: residuals must be arrays)."""
    return _run_kernel(x, gamma, beta, w, b, widths, kernel, tiles)[0]


def _fused_fwd(x, gamma, beta, w, b, widths, kernel, tiles, b_dtype):
    return _run_kernel(x, gamma, beta, w, b, widths, kernel, tiles)


def backward_kernel_for(kernel: str, m: int, k: int, widths) -> tuple[str, BackwardTiles | None]:
    """("gpu" | "gpu_interpret" | "reference", tiles): what the backward's dz / dxn / db step runs, given what
    the forward ran (the kernel again where its tiles fit the shape, else jnp)."""
    if kernel == "gpu_interpret":
        tiles = INTERPRET_BACKWARD_TILES
    elif kernel == "gpu" and is_hopper():
        tiles = BackwardTiles()
    else:
        return "reference", None
    return (kernel, tiles) if tiles.applies(m, k, tuple(widths)) else ("reference", None)


def silu_backward(
    d_pieces: tuple[Float[ArrayLike, "M _"], ...],
    z: Float[ArrayLike, "M N"],
    w: Float[ArrayLike, "K N"],
    kernel: str = "reference",
    tiles: BackwardTiles | None = None,
) -> tuple[Float[Array, "M N"], Float[Array, "M K"], Float[Array, " N"]]:
    """(dz, dxn, db) as reference.silu_backward_reference: the backward kernel (kernel "gpu" or "gpu_interpret",
    with `tiles`, which must fit) or that reference ("reference")."""
    if kernel == "reference":
        return silu_backward_reference(d_pieces, z, w)
    # platform-only: the Mosaic GPU kernel (Hopper, or its CPU interpreter), loaded when a call runs it
    from pallas_kernels.mosaic_common import interpreter
    from pallas_kernels.norm_gemm.gpu_sm90_backward import silu_gemm_backward_sm90

    interpret = kernel == "gpu_interpret"
    d_pieces, z, w = tuple(jnp.asarray(p) for p in d_pieces), jnp.asarray(z), jnp.asarray(w)
    with interpreter(interpret, warpgroups=WARPGROUPS):
        dxn, dz, partials = silu_gemm_backward_sm90(d_pieces, z, w, tiles, interpret=interpret)
    return dz, dxn, jnp.sum(partials, axis=0)


def _fused_bwd(widths, kernel, tiles, b_dtype, saved, d_pieces):
    x, stats, gamma, beta, w, z = saved
    m, k = x.shape
    dz, dxn, db = silu_backward(d_pieces, z, w, *backward_kernel_for(kernel, m, k, widths))
    db = db.astype(b_dtype)
    y = (jnp.asarray(x, jnp.float32) - stats[0][:, None]) * stats[1][:, None]  # the normalised rows, once
    gamma32 = jnp.asarray(gamma, jnp.float32)
    xn = (y * gamma32 + jnp.asarray(beta, jnp.float32)).astype(w.dtype)  # reference.normalize, from y
    dw = jnp.dot(xn.T, dz, preferred_element_type=jnp.float32).astype(w.dtype)
    dgamma = jnp.sum(dxn * y, axis=0).astype(jnp.asarray(gamma).dtype)
    dbeta = jnp.sum(dxn, axis=0).astype(jnp.asarray(beta).dtype)
    dy = dxn * gamma32
    dx = stats[1][:, None] * (dy - dy.mean(-1, keepdims=True) - y * (dy * y).mean(-1, keepdims=True))
    return dx.astype(x.dtype), dgamma, dbeta, dw, db


_fused.defvjp(_fused_fwd, _fused_bwd)
