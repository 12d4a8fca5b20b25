"""BlockAttention forward and backward as Pallas GPU kernels (Triton lowering).

One program per (block-table entry, head): the entry names the block's first row and
length (block_table.py), the program loads that block's q, k, v rows with masked loads
(blocks start anywhere in the flat array), computes the whole block's softmax attention
in registers (the block is one tile, so no online softmax), and stores only its own
rows. Zero-fill entries (spare capacity past offsets[B]) skip the loads and store zeros,
so every output row is written exactly once without a memset.

`forward` returns the output and the residuals `backward` needs (api.py owns the custom_vjp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels.block_attention import block_sizes as bs_lib
from pallas_kernels.block_attention import block_table as table_lib
from pallas_kernels.block_attention.block_math import dot as _dot
from pallas_kernels.block_attention.block_math import probs as _probs


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
        return (_dot(p.astype(v.dtype), v, 1, 0),)

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
        dv = _dot(p.astype(do.dtype), do, 0, 0)  # P^T dO
        dp = _dot(do, v, 1, 1)  # dO V^T
        ds = p * (dp - jnp.sum(p * dp, axis=1, keepdims=True))
        ds = (ds * alpha).astype(q.dtype)
        return _dot(ds, k, 1, 0), _dot(ds, q, 0, 0), dv  # dQ, dK = dS^T Q, dV

    _entry(start_ref, len_ref, live_ref, (dq_ref, dk_ref, dv_ref), attend, num_heads=num_heads, tile=tile)


def _pad_features(x):
    """Zero-pads the feature axis to a power of two (Triton tensor sides); exact."""
    d = x.shape[-1]
    dp = max(16, 1 << (d - 1).bit_length())
    if dp == d:
        return x
    return jnp.pad(x, ((0, 0), (0, 0), (0, dp - d)))


def _call(kernel, inputs, out_shapes, offsets, *, block_size, causal, alpha, interpret, name):
    num_tokens, num_heads = inputs[0].shape[:2]
    sizes = bs_lib.BlockSizes.get_default(block_size)
    table = table_lib.block_table(offsets, num_tokens, block_size)
    grid = (table[0].shape[0], num_heads)
    flat = [x.reshape(num_tokens, -1) for x in inputs]
    # Grid: one program per (block-table entry, head); each ref is the whole flat
    # [T, H * D] array, indexed by the entry's start row (blocks are not tile-aligned).
    outs = pl.pallas_call(
        functools.partial(kernel, num_heads=num_heads, tile=sizes.tile, alpha=alpha, causal=causal),
        grid=grid,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_heads * s[-1]), dt) for s, dt in out_shapes],
        compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name=name,
    )(*table, *flat)
    return [o.reshape(num_tokens, num_heads, s[-1]) for o, (s, _) in zip(outs, out_shapes)]


def _check_index_range(*arrays):
    # Triton computes element offsets in int32 here.
    for x in arrays:
        if x.size >= 2**31:
            raise ValueError(
                f"the GPU kernel indexes with int32: an input of shape {x.shape} has "
                f"{x.size} >= 2**31 elements; split the batch"
            )


def forward(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    *,
    block_size: int,
    causal: bool,
    alpha: float,
    interpret: bool = False,
) -> tuple:
    """([T, H, Dv] output, residuals for backward) (see module docstring)."""
    _check_index_range(q, v)
    dv = v.shape[-1]
    qp, kp, vp = _pad_features(q), _pad_features(k), _pad_features(v)
    (o,) = _call(
        _fwd_kernel,
        [qp, kp, vp],
        [(vp.shape, v.dtype)],
        offsets,
        block_size=block_size,
        causal=causal,
        alpha=alpha,
        interpret=interpret,
        name="block_attention_fwd",
    )
    return o[..., :dv], (q, k, v, offsets)


def backward(residuals, do, *, block_size, causal, alpha, interpret=False):
    """(dq, dk, dv), recomputing each block's softmax from q and k."""
    q, k, v, offsets = residuals
    _check_index_range(q, v)
    dqk, dvd = q.shape[-1], v.shape[-1]
    qp, kp, vp, dop = (_pad_features(x) for x in (q, k, v, do.astype(v.dtype)))
    dq, dk, dv = _call(
        _bwd_kernel,
        [qp, kp, vp, dop],
        [(qp.shape, q.dtype), (kp.shape, k.dtype), (vp.shape, v.dtype)],
        offsets,
        block_size=block_size,
        causal=causal,
        alpha=alpha,
        interpret=interpret,
        name="block_attention_bwd",
    )
    return dq[..., :dqk], dk[..., :dqk], dv[..., :dvd]
