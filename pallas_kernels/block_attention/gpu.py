"""BlockAttention forward and backward as Pallas GPU kernels (Triton lowering).

One program per (block-table entry, head): the entry names the block's first row and
length (block_table.py), the program loads that block's q, k, v rows with masked loads
(blocks start anywhere in the flat array), computes the whole block's softmax attention
in registers (the block is one tile, so no online softmax), and stores only its own
rows. Zero-fill entries (spare capacity past offsets[B]) skip the loads and store zeros,
so every output row is written exactly once without a memset.

The backend functions (the kernel-package contract, docs/architecture.md): `to_kernel_layout` checks that
int32 indexing suffices and passes the [T, H, D] arrays through, `forward(inputs, params)` -> (output,
residuals), `backward(residuals, d_out, params)` -> the inputs' cotangents, `from_kernel_layout` passes the
output through. forward and backward pad the head dims to a power of two (Triton tensor sides; exact) and
slice the results back, so the residuals are the unpadded inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels.block_attention import block_table as table_lib
from pallas_kernels.block_attention.block_math import probs as _probs
from pallas_kernels.block_attention.params import KernelParams
from pallas_kernels.common import dot, next_pow2, pad_last


def _load_rows(x_ref, start, n, head, num_heads, tile):
    """Rows [start, start + tile) of head ``head`` from a flat [T, H * D] ref; rows
    past ``n`` (other blocks, spare capacity, past T) read as 0 and are never touched."""
    d = x_ref.shape[-1] // num_heads
    rows = lax.broadcasted_iota(jnp.int32, (tile, d), 0)
    return plgpu.load(x_ref.at[pl.ds(start, tile), pl.ds(head * d, d)], mask=rows < n, other=0.0)


def _store_rows(x_ref, start, n, head, value):
    """Stores the first ``n`` rows of ``value`` to rows [start, start + n) of head."""
    tile, d = value.shape
    rows = lax.broadcasted_iota(jnp.int32, (tile, d), 0)
    plgpu.store(x_ref.at[pl.ds(start, tile), pl.ds(head * d, d)], value.astype(x_ref.dtype), mask=rows < n)


def _entry(start_ref, len_ref, live_ref, out_refs, attend, *, num_heads, tile):
    """Runs ``attend`` for a live block, zero-fills a spare-capacity chunk, and does
    nothing for a surplus entry (length 0), which then costs three scalar loads."""
    g, head = pl.program_id(0), pl.program_id(1)
    start, n, live = start_ref[g], len_ref[g], live_ref[g]

    @pl.when((n > 0) & (live > 0))
    def _():
        for ref, value in zip(out_refs, attend(start, n, head)):
            _store_rows(ref, start, n, head, value)

    @pl.when((n > 0) & (live == 0))
    def _():
        for ref in out_refs:
            d = ref.shape[-1] // num_heads
            _store_rows(ref, start, n, head, jnp.zeros((tile, d), jnp.float32))


def _fwd_kernel(start_ref, len_ref, live_ref, q_ref, k_ref, v_ref, o_ref, *, num_heads, tile, alpha, causal):
    def attend(start, n, head):
        q, k, v = (_load_rows(r, start, n, head, num_heads, tile) for r in (q_ref, k_ref, v_ref))
        p = _probs(q, k, n, tile, alpha, causal)
        return (dot(p.astype(v.dtype), v),)

    _entry(start_ref, len_ref, live_ref, (o_ref,), attend, num_heads=num_heads, tile=tile)


def _bwd_kernel(
    start_ref,
    len_ref,
    live_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    *,
    num_heads,
    tile,
    alpha,
    causal,
):
    def attend(start, n, head):
        q, k, v, do = (_load_rows(r, start, n, head, num_heads, tile) for r in (q_ref, k_ref, v_ref, do_ref))
        p = _probs(q, k, n, tile, alpha, causal)
        dv = dot(p.astype(do.dtype), do, trans_a=True)  # P^T dO
        dp = dot(do, v, trans_b=True)  # dO V^T
        ds = p * (dp - jnp.sum(p * dp, axis=1, keepdims=True))
        ds = (ds * alpha).astype(q.dtype)
        return dot(ds, k), dot(ds, q, trans_a=True), dv  # dQ, dK = dS^T Q, dV

    _entry(start_ref, len_ref, live_ref, (dq_ref, dk_ref, dv_ref), attend, num_heads=num_heads, tile=tile)


def _call(kernel, inputs, out_shapes, offsets, params: KernelParams, *, name: str):
    num_tokens, num_heads = inputs[0].shape[:2]
    sizes = params.blocks
    table = table_lib.block_table(offsets, num_tokens, params.block_size)
    grid = (table[0].shape[0], num_heads)
    flat = [x.reshape(num_tokens, -1) for x in inputs]
    # Grid: one program per (block-table entry, head); each ref is the whole flat
    # [T, H * D] array, indexed by the entry's start row (blocks are not tile-aligned).
    kernel = functools.partial(
        kernel, num_heads=num_heads, tile=sizes.tile, alpha=params.alpha, causal=params.causal
    )
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_heads * s[-1]), dt) for s, dt in out_shapes],
        compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=params.interpret,
        name=name,
    )(*table, *flat)
    return [o.reshape(num_tokens, num_heads, s[-1]) for o, (s, _) in zip(outs, out_shapes)]


def to_kernel_layout(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    params: KernelParams,
) -> tuple:
    """The kernels' inputs: (q, k, v, offsets) as given (ValueError past int32 indexing)."""
    del params
    for x in (q, v):  # Triton computes element offsets in int32 here
        if x.size >= 2**31:
            raise ValueError(
                f"the GPU kernel indexes with int32: an input of shape {x.shape} has "
                f"{x.size} >= 2**31 elements; split the batch"
            )
    return q, k, v, offsets


def _pad_features(x):
    """Zero-pads the feature axis to a power of two >= 16 (Triton tensor sides); exact."""
    return pad_last(x, next_pow2(x.shape[-1]))


def forward(inputs, params: KernelParams):
    """([T, H, Dv] output, residuals for backward) from to_kernel_layout's inputs."""
    q, k, v, offsets = inputs
    qp, kp, vp = (_pad_features(x) for x in (q, k, v))
    (o,) = _call(
        _fwd_kernel, [qp, kp, vp], [(vp.shape, v.dtype)], offsets, params, name="block_attention_fwd"
    )
    return o[..., : v.shape[-1]], inputs


def backward(residuals, d_out, params: KernelParams):
    """Cotangents of forward's inputs (None for offsets), recomputing each block's softmax from q and k."""
    q, k, v, offsets = residuals
    padded = [_pad_features(x) for x in (q, k, v, d_out.astype(v.dtype))]
    dq, dk, dv = _call(
        _bwd_kernel,
        padded,
        [(padded[0].shape, q.dtype), (padded[1].shape, k.dtype), (padded[2].shape, v.dtype)],
        offsets,
        params,
        name="block_attention_bwd",
    )
    dqk = q.shape[-1]
    return dq[..., :dqk], dk[..., :dqk], dv[..., : v.shape[-1]], None


def from_kernel_layout(
    out: Float[ArrayLike, "T H Dv"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    params: KernelParams,
) -> Float[ArrayLike, "T H Dv"]:
    """[T, H, Dv] output: forward returns it unpadded."""
    del v, offsets, params
    return out
