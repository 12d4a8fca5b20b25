"""The public entry point: checks shapes, picks the kernel or the reference, binds the custom VJP.

`layer_norm(x, scale, bias, gate=None, with_input=False, out_dtype=None)` is LayerNorm(x) * scale + bias
(times `gate`) with float32 statistics, in `out_dtype` (default x's). `with_input=True` returns (x, y): use
that x as the residual stream and its gradient joins the norm's backward in the same pass, where XLA would
add the two in another one.

Which kernel runs (`kernel_for`, the one decision): names as every kernel op (pallas_kernels/
implementations.py): "mosaic" (gpu_sm90.py, Mosaic GPU, Hopper: widths a multiple of 32 up to 1024), "triton"
(gpu.py: widths a power of two of 16-8192), "reference"; `interpret` runs the kernel in its interpreter (CPU).
implementation=None takes DEFAULTS[platform]: on every GPU Triton where it takes the width, else the reference
(the same VJP), on Hopper too until the Mosaic GPU kernels are measured on the H200. There is no TPU kernel: on
TPU (and CPU) None means the reference, which XLA fuses well there.

Rows: the Triton kernel takes any count (its rows per program divide it). The Mosaic kernel's pipeline steps
are multiples of 4 rows: a count that is no multiple of 4 is padded with zero rows up to a whole step (a copy
of the inputs and outputs; the GPU configs' pack capacities are multiples of the steps).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float

from pallas_kernels import implementations
from pallas_kernels.common import cdiv
from pallas_kernels.layer_norm import gpu, tiles
from pallas_kernels.layer_norm.params import FAMILIES, NormParams
from pallas_kernels.layer_norm.reference import layer_norm_reference

# Elements of x per program: rows of width D in registers, with 4 warps for up to 4096 and 8 beyond.
_ELEMENTS_PER_PROGRAM = 4096
NAMES = (*FAMILIES, "reference")
# Triton on Hopper too until the Mosaic GPU kernels are measured on the H200 (bench norm, `scripts/device/
# measure.sh norm`): then the fastest of XLA, Triton and Mosaic per direction leads Hopper's order.
DEFAULTS = {
    "hopper": ("triton", "reference"),
    "gpu": ("triton", "reference"),
    "tpu": ("reference",),
    "cpu": ("reference",),
}


def kernel_applies(width: int) -> bool:
    """Whether the Triton kernel takes rows of this width (Triton tensors are powers of two)."""
    return 16 <= width <= 8192 and width & (width - 1) == 0


def block_rows(rows: int, width: int, elements: int = _ELEMENTS_PER_PROGRAM) -> int:
    """Rows per program: the largest power of two <= elements // width that divides `rows` (at least 1)."""
    block = max(1, elements // width)
    while rows % block:
        block //= 2
    return block


def _why_not(name: str, width: int) -> str | None:
    """None if backend `name` takes rows of this width, else why not."""
    if name == "mosaic" and not tiles.mosaic_applies(width):
        return f"rows of width {width} (the Mosaic GPU kernels take a multiple of 32 up to {tiles.MAX_WIDTH})"
    if name == "triton" and not kernel_applies(width):
        return f"rows of width {width} (the Triton kernel takes a power of two of 16-8192)"
    return None


def kernel_for(
    implementation: str | None, width: int, *, interpret: bool = False, platform: str | None = None
) -> str:
    """What a call with rows of this width runs: "mosaic", "triton" or "reference", the one decision.
    `implementation` if it takes the width (else a ValueError), for None the first of DEFAULTS[platform] that
    does (platform None: this process's): on an H100 Triton, or the reference past its widths."""
    return implementations.choose(
        "layer_norm",
        implementation,
        names=NAMES,
        defaults=DEFAULTS,
        why_not=lambda name: _why_not(name, width),
        interpret=interpret,
        platform=platform,
    )


def kernels_in_use(
    width: int, implementation: str | None, *, interpret: bool = False, platform: str | None = None
) -> str:
    """The backend kernel_for picks, as train prints it (" (interpret)" where interpreted)."""
    return implementations.describe(
        kernel_for(implementation, width, interpret=interpret, platform=platform), interpret
    )


def _mosaic_params(rows, x, gate, with_input, rows_per_block, **common) -> tuple[NormParams, int]:
    """(the Mosaic kernels' params, rows after padding). The tiles come from the backward's shared memory (its
    row arrays outnumber the forward's): x, dy, dx (the gate and its gradient, the residual's gradient)."""
    width = x.shape[-1]
    arrays = [x.dtype, common["out_dtype"], x.dtype] + [x.dtype] * with_input
    arrays += [] if gate is None else [gate.dtype] * 2
    row_bytes = width * sum(jnp.dtype(a).itemsize for a in arrays)
    fixed_bytes = width * 4 * (2 + 2 * tiles.ROWS_PER_GROUP)  # scale and bias; the CTA's partial sums
    if rows_per_block is not None:
        if rows_per_block % tiles.ROWS_PER_GROUP or rows % rows_per_block:
            raise ValueError(
                f"layer_norm: rows_per_block={rows_per_block} must be a multiple of {tiles.ROWS_PER_GROUP} "
                f"that divides the {rows} rows of x (the Mosaic GPU kernel)"
            )
        block, padded = rows_per_block, rows
    else:
        block = tiles.mosaic_tiles(row_bytes, fixed_bytes).rows
        padded = rows if rows % tiles.ROWS_PER_GROUP == 0 else cdiv(rows, block) * block
        while padded % block:
            block //= 2
    sizes = tiles.mosaic_tiles(row_bytes, fixed_bytes, rows=block)
    if sizes is None:
        raise ValueError(
            f"layer_norm: {block} rows of {x.shape} do not fit the Mosaic GPU kernel's shared memory"
        )
    # platform-only: the Mosaic GPU kernels' shared pieces, loaded when a call runs them
    from pallas_kernels.mosaic_common import num_sms

    params = NormParams(
        rows=block, family="mosaic", stages=sizes.stages, num_ctas=sizes.ctas_per_sm * num_sms(), **common
    )
    return params, padded


def layer_norm(
    x: Float[ArrayLike, "*rows D"],
    scale: Float[ArrayLike, " D"] | None,
    bias: Float[ArrayLike, " D"],
    gate: Float[ArrayLike, "*rows D"] | None = None,
    *,
    with_input: bool = False,
    eps: float = 1e-6,
    out_dtype=None,
    implementation: str | None = None,
    interpret: bool = False,
    rows_per_block: int | None = None,
    num_warps: int | None = None,
):
    """Layer norm over the last axis (times `gate`): y, or (x, y) with `with_input` (see the module doc).

    out_dtype: y's dtype (default x's); e.g. bf16 for the next GEMM from a float32 residual stream, so
    neither the norm's output nor its gradient crosses memory in float32.

    implementation, interpret: which kernel (kernel_for) and whether in its interpreter (CPU tests).
    rows_per_block, num_warps: the kernel's tiles (benchmarks); None picks them from the width. The Mosaic
    GPU kernel takes rows_per_block (rows per pipeline step, a multiple of 4) and has no num_warps (one
    warpgroup per CTA).
    """
    x = jnp.asarray(x)
    width = x.shape[-1]
    if bias.shape != (width,) or (scale is not None and scale.shape != (width,)):
        raise ValueError(
            f"layer_norm: scale {None if scale is None else scale.shape} and bias {bias.shape} must be "
            f"({width},), the width of x {x.shape}"
        )
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"layer_norm: gate {gate.shape} must have x's shape {x.shape}")
    family = kernel_for(implementation, width, interpret=interpret)
    if family == "reference" or x.size == 0:  # (no rows: no kernel grid)
        y = layer_norm_reference(x, scale, bias, gate, eps=eps, out_dtype=out_dtype)
        return (x, y) if with_input else y

    rows = x.size // width
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    common = dict(
        eps=eps,
        has_gate=gate is not None,
        has_residual=with_input,
        out_dtype=out_dtype.name,
        interpret=interpret,
    )
    if family == "mosaic":
        params, padded = _mosaic_params(rows, x, gate, with_input, rows_per_block, **common)
    else:
        block = rows_per_block or block_rows(rows, width)
        if rows % block:
            raise ValueError(f"layer_norm: rows_per_block={block} does not divide the {rows} rows of x")
        params = NormParams(rows=block, num_warps=num_warps or (4 if block * width <= 4096 else 8), **common)
        padded = rows
    has_scale = scale is not None
    scale = scale if has_scale else jnp.ones((width,), bias.dtype)
    flat_x = _pad_rows(x.reshape(rows, width), padded)
    flat_gate = None if gate is None else _pad_rows(gate.reshape(rows, width), padded)
    out = _fused(flat_x, scale, bias, flat_gate, params)
    if with_input:
        return out[0][:rows].reshape(x.shape), out[1][:rows].reshape(x.shape)
    return out[:rows].reshape(x.shape)


def _pad_rows(a, rows: int):
    """`a` with zero rows appended up to `rows` (a itself when it has them): zero rows normalise to the bias,
    finite, and their zero cotangents add nothing to the scale and bias gradients."""
    return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def _backend(params: NormParams):
    """The module that runs these params: gpu_sm90 (Mosaic GPU) or gpu (Triton)."""
    if params.family == "triton":
        return gpu
    # platform-only: the Mosaic GPU kernels (Hopper, or their CPU interpreter), loaded when a call runs them
    from pallas_kernels.layer_norm import gpu_sm90

    return gpu_sm90


def _interpreter(params: NormParams):
    """Mosaic GPU's CPU interpreter around a Mosaic kernel's call in interpret mode, else nothing."""
    if params.family != "mosaic":
        return contextlib.nullcontext()
    # platform-only: the Mosaic GPU kernels' shared pieces, loaded when a call runs them
    from pallas_kernels.mosaic_common import interpreter

    return interpreter(params.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x, scale, bias, gate, params):

    with _interpreter(params):
        y = _backend(params).forward(x, scale, bias, gate, params)
    return (x, y) if params.has_residual else y


def _fused_fwd(x, scale, bias, gate, params):
    return _fused(x, scale, bias, gate, params), (x, scale, bias, gate)


def _fused_bwd(params, residuals, d_out):

    x, scale, bias, gate = residuals
    d_residual, dy = d_out if params.has_residual else (None, d_out)
    with _interpreter(params):
        dx, d_scale, d_bias, d_gate = _backend(params).backward(x, scale, bias, gate, dy, d_residual, params)
    return dx, d_scale, d_bias, d_gate


_fused.defvjp(_fused_fwd, _fused_bwd)
