"""The public entry point: checks shapes, picks the kernel or the reference, binds the custom VJP.

`layer_norm(x, scale, bias, gate=None, with_input=False, out_dtype=None)` is LayerNorm(x) * scale + bias
(times `gate`) with float32 statistics, in `out_dtype` (default x's). `with_input=True` returns (x, y): use
that x as the residual stream and its gradient joins the norm's backward in the same pass, where XLA would
add the two in another one.

Implementation names as every kernel package (pallas_kernels/implementations.py); the Pallas kernel runs
where its tiles apply (a power-of-two width of 16-8192), the reference elsewhere, with the same VJP.
There is no TPU kernel: on TPU (and CPU) None means the reference, which XLA fuses well there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float

from pallas_kernels import implementations
from pallas_kernels.layer_norm import gpu
from pallas_kernels.layer_norm.params import NormParams
from pallas_kernels.layer_norm.reference import layer_norm_reference

# Elements of x per program: rows of width D in registers, with 4 warps for up to 4096 and 8 beyond.
_ELEMENTS_PER_PROGRAM = 4096


def kernel_applies(width: int) -> bool:
    """Whether the Pallas kernel takes rows of this width (Triton tensors are powers of two)."""
    return 16 <= width <= 8192 and width & (width - 1) == 0


def block_rows(rows: int, width: int, elements: int = _ELEMENTS_PER_PROGRAM) -> int:
    """Rows per program: the largest power of two <= elements // width that divides `rows` (at least 1)."""
    block = max(1, elements // width)
    while rows % block:
        block //= 2
    return block


def _resolve(implementation: str | None) -> str:
    if implementation is None and jax.default_backend() == "tpu":
        return "reference"
    kernel = implementations.resolve(implementation)
    if kernel.startswith("tpu"):
        raise ValueError(f"layer_norm has no TPU kernel (implementation={implementation!r}); use 'reference'")
    return kernel


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
    rows_per_block: int | None = None,
    num_warps: int | None = None,
):
    """Layer norm over the last axis (times `gate`): y, or (x, y) with `with_input` (see the module doc).

    out_dtype: y's dtype (default x's); e.g. bf16 for the next GEMM from a float32 residual stream, so
    neither the norm's output nor its gradient crosses memory in float32.

    rows_per_block, num_warps: the kernel's tiles (benchmarks); None picks them from the width.
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
    kernel = _resolve(implementation)
    if kernel == "reference" or not kernel_applies(width):
        y = layer_norm_reference(x, scale, bias, gate, eps=eps, out_dtype=out_dtype)
        return (x, y) if with_input else y

    rows = x.size // width
    block = rows_per_block or block_rows(rows, width)
    if rows % block:
        raise ValueError(f"layer_norm: rows_per_block={block} does not divide the {rows} rows of x")
    params = NormParams(
        rows=block,
        num_warps=num_warps or (4 if block * width <= 4096 else 8),
        eps=eps,
        has_gate=gate is not None,
        has_residual=with_input,
        out_dtype=jnp.dtype(out_dtype or x.dtype).name,
        interpret=implementations.interpret(kernel),
    )
    has_scale = scale is not None
    scale = scale if has_scale else jnp.ones((width,), bias.dtype)
    flat_gate = None if gate is None else gate.reshape(rows, width)
    out = _fused(x.reshape(rows, width), scale, bias, flat_gate, params)
    if with_input:
        return out[0].reshape(x.shape), out[1].reshape(x.shape)
    return out.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x, scale, bias, gate, params):

    y = gpu.forward(x, scale, bias, gate, params)
    return (x, y) if params.has_residual else y


def _fused_fwd(x, scale, bias, gate, params):
    return _fused(x, scale, bias, gate, params), (x, scale, bias, gate)


def _fused_bwd(params, residuals, d_out):

    x, scale, bias, gate = residuals
    d_residual, dy = d_out if params.has_residual else (None, d_out)
    dx, d_scale, d_bias, d_gate = gpu.backward(x, scale, bias, gate, dy, d_residual, params)
    return dx, d_scale, d_bias, d_gate


_fused.defvjp(_fused_fwd, _fused_bwd)
