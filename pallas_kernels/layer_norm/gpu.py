"""Pallas GPU (Triton lowering) layer norm: one pass over whole rows forward, one backward. The pre-Hopper
kernels: on Hopper api.py runs gpu_sm90.py (Mosaic GPU) where it takes the width.

Each program holds `rows` whole rows of width D in registers, so the statistics, the gate and the residual
gradient cost no extra memory round trip: forward reads x (and the gate) and writes y; backward reads x, dy
(the gate, the residual's gradient) and writes dx (and the gate's gradient) plus one row of partial sums of
the scale and bias gradients per program, which `backward` adds up. The statistics are recomputed backward
(cheaper than storing and reading them: x is read anyway). XLA runs a layer norm's backward as several
fusions with float32 intermediates in HBM; this is the round trip the kernels remove.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import ArrayLike, Float

from pallas_kernels.layer_norm.params import NormParams


def _stats(x, eps):
    """(x - mean, 1 / sqrt(var + eps)) of float32 rows."""
    xc = x - jnp.mean(x, axis=1, keepdims=True)
    return xc, lax.rsqrt(jnp.mean(xc * xc, axis=1, keepdims=True) + eps)


def _fwd_kernel(x_ref, scale_ref, bias_ref, *rest, params: NormParams):
    gate_ref, y_ref = rest if params.has_gate else (None, *rest)
    xc, rstd = _stats(x_ref[...].astype(jnp.float32), params.eps)
    y = xc * rstd * scale_ref[...].astype(jnp.float32)[None, :] + bias_ref[...].astype(jnp.float32)[None, :]
    if gate_ref is not None:
        y = y * gate_ref[...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)


def _bwd_kernel(x_ref, scale_ref, bias_ref, dy_ref, *rest, params: NormParams):
    rest = list(rest)
    gate_ref = rest.pop(0) if params.has_gate else None
    dres_ref = rest.pop(0) if params.has_residual else None
    dx_ref = rest.pop(0)
    dgate_ref = rest.pop(0) if params.has_gate else None
    dscale_ref, dbias_ref = rest
    xc, rstd = _stats(x_ref[...].astype(jnp.float32), params.eps)
    xhat = xc * rstd
    scale = scale_ref[...].astype(jnp.float32)[None, :]
    g = dy_ref[...].astype(jnp.float32)  # the gradient of the norm's output, before the gate
    if gate_ref is not None:
        norm = xhat * scale + bias_ref[...].astype(jnp.float32)[None, :]
        dgate_ref[...] = (g * norm).astype(dgate_ref.dtype)
        g = g * gate_ref[...].astype(jnp.float32)
    dscale_ref[...] = jnp.sum(g * xhat, axis=0)
    dbias_ref[...] = jnp.sum(g, axis=0)
    gs = g * scale
    inv_d = 1.0 / xhat.shape[1]
    dx = rstd * (
        gs
        - jnp.sum(gs, axis=1, keepdims=True) * inv_d
        - xhat * (jnp.sum(gs * xhat, axis=1, keepdims=True) * inv_d)
    )
    if dres_ref is not None:
        dx = dx + dres_ref[...].astype(jnp.float32)
    dx_ref[...] = dx.astype(dx_ref.dtype)


def _specs(params: NormParams, d: int, count: int):
    """`count` [rows, D] row-block specs."""
    return [pl.BlockSpec((params.rows, d), lambda i: (i, 0))] * count


def _vector_specs(d: int, count: int):
    return [pl.BlockSpec((d,), lambda i: (0,))] * count


def forward(
    x: Float[ArrayLike, "R D"],
    scale: Float[ArrayLike, " D"],
    bias: Float[ArrayLike, " D"],
    gate: Float[ArrayLike, "R D"] | None,
    params: NormParams,
) -> Float[ArrayLike, "R D"]:
    r, d = x.shape
    inputs = (x, scale, bias) + ((gate,) if params.has_gate else ())
    return pl.pallas_call(
        functools.partial(_fwd_kernel, params=params),
        grid=(r // params.rows,),
        in_specs=_specs(params, d, 1) + _vector_specs(d, 2) + _specs(params, d, int(params.has_gate)),
        out_specs=_specs(params, d, 1)[0],
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.dtype(params.out_dtype)),
        compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=1),
        interpret=params.interpret,
        name="layer_norm_fwd",
    )(*inputs)


def backward(x, scale, bias, gate, dy, d_residual, params: NormParams):
    """(dx [+ d_residual], d_scale, d_bias, d_gate or None) of the forward's inputs."""
    r, d = x.shape
    blocks = r // params.rows
    optional = ((gate,) if params.has_gate else ()) + ((d_residual,) if params.has_residual else ())
    row_out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    partial_sums = jax.ShapeDtypeStruct((blocks, d), jnp.float32)
    partial_spec = pl.BlockSpec((None, d), lambda i: (i, 0))
    outs = pl.pallas_call(
        functools.partial(_bwd_kernel, params=params),
        grid=(blocks,),
        in_specs=_specs(params, d, 1) + _vector_specs(d, 2) + _specs(params, d, 1 + len(optional)),
        out_specs=_specs(params, d, 1 + int(params.has_gate)) + [partial_spec] * 2,
        out_shape=[row_out]
        + ([jax.ShapeDtypeStruct(x.shape, gate.dtype)] if params.has_gate else [])
        + [partial_sums] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=1),
        interpret=params.interpret,
        name="layer_norm_bwd",
    )(x, scale, bias, dy, *optional)
    dgate = outs[1] if params.has_gate else None
    return outs[0], outs[-2].sum(0).astype(scale.dtype), outs[-1].sum(0).astype(bias.dtype), dgate
