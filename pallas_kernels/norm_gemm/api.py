"""The public entry point: picks the Hopper kernels or the reference (`kernels_for`), binds the backward.

`norm_silu_gemm(x, gamma, beta, w, b, widths)` is split(SiLU(LayerNorm(x) * gamma + beta) W + b), widths) as
reference.py specifies. Names as every kernel op (pallas_kernels/implementations.py): "mosaic" (gpu_sm90.py
forward, gpu_sm90_backward.py backward: Hopper; `interpret`: in the Mosaic GPU interpreter, CPU tests) and
"reference", which XLA compiles to its layer norm, cuBLAS and SiLU fusions, and which autodiff differentiates.
implementation=None takes DEFAULTS[platform] for each direction: on Hopper the Mosaic GPU kernel where its
tiles fit the shape (x float32, W 16-bit), else the reference; the reference elsewhere.

The kernel's backward, from the z the forward kept: dz = dy * SiLU'(z), the bias gradient its column sums and
dxn = dz W^T (reference.silu_backward_reference) come from the backward kernel (gpu_sm90_backward.py: dz made
in the GEMM's prologue, written once, its column sums as partials) where kernels_for picks it, else from that
reference in jnp; dW = xn^T dz (cuBLAS, xn recomputed from the row statistics) and
LayerNorm's backward are jnp. It is autodiff's backward of the reference, without re-running the forward GEMM.

Interpret mode needs XLA:CPU's thread pool to be larger than the kernel's three warpgroups, which wait on each
other: the pool has max(PJRT_NPROC or NPROC or the schedulable cores, CPU devices) threads, two on a 2-core
machine, where the interpreter would stop for good. mosaic_common.interpreter refuses such a pool, naming the
fix (tests/conftest.py's 8 fake CPU devices give 8 threads).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from pallas_kernels import implementations
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


NAMES = ("mosaic", "reference")
DEFAULTS = {
    "hopper": ("mosaic", "reference"),
    "gpu": ("reference",),
    "tpu": ("reference",),
    "cpu": ("reference",),
}


def _tiles(direction: str, interpret: bool, tiles: Tiles | None):
    """The kernel's tiles for a direction: `tiles` (the forward's, from benchmarks), else the defaults (the
    interpreter's: one CTA, small tiles)."""
    if direction == "forward":
        return tiles or (INTERPRET_TILES if interpret else Tiles())
    return INTERPRET_BACKWARD_TILES if interpret else BackwardTiles()


def _why_not(name: str, direction: str, x, w, widths, tiles) -> str | None:
    """None if backend `name` takes the call in `direction` ("forward", "backward"), else why not."""
    if name == "reference":
        return None
    if x.dtype != jnp.float32 or w.dtype not in (jnp.bfloat16, jnp.float16):
        return f"x {x.dtype}, w {w.dtype} (the Mosaic GPU kernels take a float32 x and a 16-bit w)"
    m, k = x.shape
    if not tiles.applies(m, k, tuple(widths)):
        return f"the Mosaic GPU {direction}'s tiles {tiles} do not fit M={m}, K={k}, widths {tuple(widths)}"
    return None


def kernels_for(
    x,
    w,
    widths: tuple[int, ...],
    implementation: str | None,
    *,
    interpret: bool = False,
    tiles: Tiles | None = None,
    platform: str | None = None,
) -> tuple[str, str]:
    """(forward, backward): which kernels run a call on x [M, K], w [K, N] (arrays or shapes), the one decision.
    Both directions run `implementation` when named (a ValueError where one does not take the call); for None
    each takes the first of DEFAULTS that takes the call (platform None: this process's), the backward the
    reference where the forward does: on an H100 the Mosaic GPU kernels where their tiles fit, else the
    reference."""
    choose = functools.partial(
        implementations.choose,
        "norm_gemm",
        implementation,
        names=NAMES,
        defaults=DEFAULTS,
        interpret=interpret,
        platform=platform,
    )
    forward = choose(
        why_not=lambda name: _why_not(name, "forward", x, w, widths, _tiles("forward", interpret, tiles))
    )
    if forward == "reference":
        return forward, forward
    backward = choose(
        why_not=lambda name: _why_not(name, "backward", x, w, widths, _tiles("backward", interpret, None))
    )
    return forward, backward


def kernels_in_use(
    x, w, widths: tuple[int, ...], implementation: str | None, *, interpret: bool = False, platform=None
) -> tuple[str, str]:
    """(forward, backward) as kernels_for picks them, as train prints them (" (interpret)" where interpreted)."""
    forward, backward = kernels_for(x, w, widths, implementation, interpret=interpret, platform=platform)
    return implementations.describe(forward, interpret), implementations.describe(backward, interpret)


def norm_silu_gemm(
    x: Float[ArrayLike, "M K"],
    gamma: Float[ArrayLike, " K"],
    beta: Float[ArrayLike, " K"],
    w: Float[ArrayLike, "K N"],
    b: Float[ArrayLike, " N"],
    widths: tuple[int, ...],
    *,
    implementation: str | None = None,
    interpret: bool = False,
    tiles: Tiles | None = None,
) -> tuple[Float[Array, "M _"], ...]:
    """split(SiLU(LN(x) W + b), widths) in W's dtype; implementation, interpret: which kernels (kernels_for) and
    whether in the interpreter (CPU tests); `tiles` (benchmarks) overrides the forward kernel's."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"norm_silu_gemm: x must be [M, K] and w [K, N], got {x.shape} and {w.shape}")
    if sum(widths) != w.shape[1]:
        raise ValueError(f"norm_silu_gemm: widths {widths} must add up to w's {w.shape[1]} columns")
    forward, backward = kernels_for(x, w, widths, implementation, interpret=interpret, tiles=tiles)
    if forward == "reference":
        return norm_silu_gemm_reference(x, gamma, beta, w, b, widths)[0]
    plan = _Plan(
        tuple(widths), backward, interpret, _tiles("forward", interpret, tiles), jnp.asarray(b).dtype
    )
    return _fused(x, gamma, beta, w, b, plan)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static settings of a kernel call (the custom VJP's nondiff argument): the backward's backend
    (kernels_for), interpret mode, the forward's tiles, b's dtype (for its gradient: residuals must be
    arrays)."""

    widths: tuple[int, ...]
    backward: str
    interpret: bool
    tiles: Tiles
    b_dtype: Any


def _run_kernel(x, gamma, beta, w, b, plan: _Plan):
    # platform-only: Mosaic GPU's interpreter switch, loaded with the kernel
    from pallas_kernels.mosaic_common import interpreter

    # platform-only: the Mosaic GPU kernel (Hopper, or its CPU interpreter), loaded when a call runs it
    from pallas_kernels.norm_gemm.gpu_sm90 import norm_silu_gemm_sm90

    stats = row_stats(x, EPS)
    affine = jnp.stack([jnp.asarray(gamma, jnp.float32), jnp.asarray(beta, jnp.float32)])
    with interpreter(plan.interpret, warpgroups=WARPGROUPS):
        pieces, z = norm_silu_gemm_sm90(
            x, stats, affine, w, b, plan.widths, plan.tiles, interpret=plan.interpret
        )
    return pieces, (x, stats, gamma, beta, w, z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(x, gamma, beta, w, b, plan: _Plan):
    return _run_kernel(x, gamma, beta, w, b, plan)[0]


def _fused_fwd(x, gamma, beta, w, b, plan: _Plan):
    return _run_kernel(x, gamma, beta, w, b, plan)


def silu_backward(
    d_pieces: tuple[Float[ArrayLike, "M _"], ...],
    z: Float[ArrayLike, "M N"],
    w: Float[ArrayLike, "K N"],
    kernel: str = "reference",
    tiles: BackwardTiles | None = None,
    *,
    interpret: bool = False,
) -> tuple[Float[Array, "M N"], Float[Array, "M K"], Float[Array, " N"]]:
    """(dz, dxn, db) as reference.silu_backward_reference: the backward kernel ("mosaic", with `tiles`, None: its
    defaults, which must fit) or that reference ("reference")."""
    if kernel == "reference":
        return silu_backward_reference(d_pieces, z, w)
    # platform-only: Mosaic GPU's interpreter switch, loaded with the kernel
    from pallas_kernels.mosaic_common import interpreter

    # platform-only: the Mosaic GPU kernel (Hopper, or its CPU interpreter), loaded when a call runs it
    from pallas_kernels.norm_gemm.gpu_sm90_backward import silu_gemm_backward_sm90

    tiles = tiles or _tiles("backward", interpret, None)
    d_pieces, z, w = tuple(jnp.asarray(p) for p in d_pieces), jnp.asarray(z), jnp.asarray(w)
    with interpreter(interpret, warpgroups=WARPGROUPS):
        dxn, dz, partials = silu_gemm_backward_sm90(d_pieces, z, w, tiles, interpret=interpret)
    return dz, dxn, jnp.sum(partials, axis=0)


def _fused_bwd(plan: _Plan, saved, d_pieces):
    x, stats, gamma, beta, w, z = saved
    dz, dxn, db = silu_backward(d_pieces, z, w, plan.backward, interpret=plan.interpret)
    db = db.astype(plan.b_dtype)
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
