"""The public entry point: checks shapes, picks the kernel or the reference.

`silu_backward_fp8(dys, z, scale)` returns (q, q^T, amax, column sums) of g = silu'(z) * concat(dys), with
q = saturate(g / scale) in e5m2 (see reference.py). Not differentiable: it is the inside of a backward pass.
A kernel takes pieces of one width that its column tile divides, with a row tile that divides the rows.

Which kernel (`kernel_for`, the one decision): names as every kernel op (pallas_kernels/implementations.py):
"mosaic" (gpu_sm90.py, Mosaic GPU, Hopper), "triton" (gpu.py), "reference"; `interpret` runs the kernel in its
interpreter (CPU). implementation=None takes DEFAULTS[platform]: Triton on every GPU, Hopper included, where its
tiles fit, else the reference; the reference on CPU and TPU. The Mosaic kernel is not the Hopper default yet: it
is lowered and interpreted on CPU only, not run or measured on an H200.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from pallas_kernels import implementations
from pallas_kernels.silu_backward_fp8 import gpu
from pallas_kernels.silu_backward_fp8.gpu import Tiles
from pallas_kernels.silu_backward_fp8.reference import silu_backward_fp8_reference

_BLOCK_ROWS, _BLOCK_COLS = 64, 128  # 64 rows: the transposed store writes 64 contiguous bytes per row
NAMES = ("mosaic", "triton", "reference")
# Triton on Hopper too until the Mosaic kernel is measured on the H200; the reference where Triton's tiles do
# not divide the shape.
DEFAULTS = {
    "hopper": ("triton", "reference"),
    "gpu": ("triton", "reference"),
    "tpu": ("reference",),
    "cpu": ("reference",),
}


def _tiles(name: str, rows: int, widths: tuple[int, ...], interpret: bool, block_rows, block_cols, num_warps):
    """(backend `name`'s tiles for this call, None) if it takes the call, else (None, why not)."""
    if name == "reference":
        return None, None
    if len(set(widths)) != 1:
        kernel = "the Mosaic GPU kernel" if name == "mosaic" else "the Triton kernel"
        return None, f"pieces of several widths {sorted(set(widths))} ({kernel} takes one width)"
    width = widths[0]
    if name == "triton":
        bm, bn = (8, 16) if interpret else (_BLOCK_ROWS, _BLOCK_COLS)
        bm, bn = block_rows or bm, block_cols or bn
        if rows % bm or width % bn:
            return None, f"Triton tiles {bm} x {bn} do not divide rows={rows}, piece width {width}"
        return Tiles(block_rows=bm, block_cols=bn, num_warps=num_warps or 4, interpret=interpret), None
    # platform-only: the Mosaic GPU kernel, loaded where a call names it
    from pallas_kernels.silu_backward_fp8 import gpu_sm90

    bn = block_cols or (32 if interpret else _BLOCK_COLS)  # interpret: small tiles keep CPU tests fast
    tiles = gpu_sm90.Tiles(block_rows=block_rows or gpu_sm90.BLOCK_ROWS, block_cols=bn, interpret=interpret)
    if num_warps is not None:
        return None, "the Mosaic GPU kernel has no num_warps (one warpgroup per CTA)"
    if not gpu_sm90.applies(rows, width, tiles):
        return None, (
            f"the Mosaic GPU kernel does not take rows={rows}, piece width {width} with tiles {tiles} (block_rows "
            "a multiple of 64 and block_cols of 32, both at most 256, dividing the rows and the width, within "
            "96 KiB of shared memory)"
        )
    return tiles, None


def kernel_for(
    rows: int,
    widths: tuple[int, ...],
    implementation: str | None,
    *,
    interpret: bool = False,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
    platform: str | None = None,
):
    """(backend, its tiles): what a call on [rows, pieces of these widths] runs, the one decision.
    `implementation` if it takes the call (else a ValueError), for None the first of DEFAULTS[platform] that
    does (platform None: this process's): on an H100 Triton, or the reference where its tiles do not fit."""
    found = {}

    def why_not(name: str) -> str | None:
        found[name], reason = _tiles(name, rows, tuple(widths), interpret, block_rows, block_cols, num_warps)
        return reason

    name = implementations.choose(
        "silu_backward_fp8",
        implementation,
        names=NAMES,
        defaults=DEFAULTS,
        why_not=why_not,
        interpret=interpret,
        platform=platform,
    )
    return name, found[name]


def kernels_in_use(
    rows: int,
    widths: tuple[int, ...],
    implementation: str | None,
    *,
    interpret: bool = False,
    platform: str | None = None,
) -> str:
    """The backend kernel_for picks, as train prints it (" (interpret)" where interpreted)."""
    name, _ = kernel_for(rows, widths, implementation, interpret=interpret, platform=platform)
    return implementations.describe(name, interpret)


def silu_backward_fp8(
    dys: tuple[Float[ArrayLike, "M _"], ...],
    z: Float[ArrayLike, "M N"],
    scale: Float[ArrayLike, ""],
    *,
    implementation: str | None = None,
    interpret: bool = False,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
) -> tuple[Array, Array, Float[Array, ""], Float[Array, " N"]]:
    """(q, q^T, amax, column sums); `dys` the pieces of SiLU's output gradient along N, `z` its input,
    `scale` the e5m2 dequantisation scale (q * scale ~ g). implementation, interpret: which kernel (kernel_for)
    and whether in its interpreter (CPU tests). block_rows, block_cols, num_warps: the kernel's tiles
    (benchmarks); None: the defaults."""
    z = jnp.asarray(z)
    dys = tuple(jnp.asarray(d) for d in dys)
    if z.ndim != 2 or not dys or any(d.ndim != 2 or d.shape[0] != z.shape[0] for d in dys):
        raise ValueError(
            f"silu_backward_fp8: dys must be [M, n_i] and z [M, N], got {[d.shape for d in dys]}, {z.shape}"
        )
    if sum(d.shape[1] for d in dys) != z.shape[1]:
        raise ValueError(
            f"silu_backward_fp8: the pieces' widths {[d.shape[1] for d in dys]} must add up to z's {z.shape[1]}"
        )
    widths = tuple(d.shape[1] for d in dys)
    name, tiles = kernel_for(
        z.shape[0],
        widths,
        implementation,
        interpret=interpret,
        block_rows=block_rows,
        block_cols=block_cols,
        num_warps=num_warps,
    )
    if name == "reference":
        return silu_backward_fp8_reference(dys, z, scale)
    inv_scale = 1.0 / jnp.asarray(scale, jnp.float32)
    if name == "mosaic":
        # platform-only: Mosaic GPU's interpreter switch, loaded with the kernel
        from pallas_kernels.mosaic_common import interpreter

        # platform-only: the Mosaic GPU kernel, loaded where a call names it
        from pallas_kernels.silu_backward_fp8 import gpu_sm90

        with interpreter(interpret):
            q, qt, col_max, col_sum = gpu_sm90.silu_backward_fp8(dys, z, inv_scale, tiles)
    else:
        q, qt, col_max, col_sum = gpu.silu_backward_fp8(dys, z, inv_scale, tiles)
    return q, qt, jnp.max(col_max), jnp.sum(col_sum, axis=0)
