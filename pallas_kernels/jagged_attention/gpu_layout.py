"""The GPU backend of jagged attention: the layout and residuals its two kernel families share, Triton (gpu.py)
and Mosaic GPU (gpu_sm90.py forward, gpu_sm90_backward.py backward).

The backend functions (the kernel-package contract, docs/architecture.md): `to_kernel_layout` pads head dims
(and the rows, for Mosaic GPU) and builds the bias tables (plain jnp, differentiated by JAX),
`forward(inputs, params)` -> (o, residuals), `backward(residuals, d_out, params)` -> the inputs' cotangents,
`from_kernel_layout` drops the padding. forward and backward run the family KernelParams names for each
direction (api.py decides; both forwards leave the same residuals, so the two directions may differ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels.common import next_pow2, pad_last
from pallas_kernels.jagged_attention import gpu, tiling
from pallas_kernels.jagged_attention.params import KernelParams


def forward(inputs, params: KernelParams):
    """(o [T, H, Dv], residuals) from to_kernel_layout's inputs: the forward kernel params.forward_kernel names.
    The residuals end with o, the softmax lse [H, T] and the bias_rows array, built here for the Triton kernels
    (a small dummy when params.bias_rows is False: the kernels compute the bias; the Mosaic GPU ones always
    do)."""
    q, _, _, offsets, _, ts, pos_tab, time_tab = inputs
    t, heads, _ = q.shape
    bias = (
        bias_rows(offsets, ts, pos_tab, time_tab, params, total_rows=t, heads=heads, dtype=q.dtype)
        if params.bias_rows
        else jnp.zeros((1, 16, 16), q.dtype)
    )
    if params.forward_kernel == "mosaic":
        from pallas_kernels.jagged_attention import gpu_sm90  # platform-only: Mosaic GPU, on Hopper

        o, lse = gpu_sm90.forward(inputs, params)
    else:
        o, lse = gpu.forward(inputs, params, bias)
    return o, (*inputs, o, lse, bias)


def backward(residuals, d_out, params: KernelParams):
    """Cotangents of forward's inputs (None for the integer ones) from its residuals and the output's, d_out:
    the backward kernels params.backward_kernel names."""
    if params.backward_kernel == "mosaic":
        from pallas_kernels.jagged_attention import gpu_sm90_backward  # platform-only: Mosaic GPU, on Hopper

        return gpu_sm90_backward.backward(residuals, d_out, params)
    return gpu.backward(residuals, d_out, params)


def time_thresholds(num_time: int, width: int) -> jax.Array:
    """float32[width]: thr[b] = float32 of the smallest integer dt whose bucket is >= b; -inf at 0, +inf from num_time.

    A cell's bucket is then #{b >= 1: float32(max(dt, 1)) >= thr[b]}, the reference's bucket exactly: thr is found
    by bisection over int32 with the reference's own formula (same XLA ops), and the bucket of a delta depends on it
    only through float32(max(dt, 1)), a monotone map. So the kernels never take a logarithm per cell.
    """
    b = jnp.arange(width, dtype=jnp.int32)
    unclipped = lambda dt: tiling.time_bucket(dt, 2**30)
    top = jnp.iinfo(jnp.int32).max

    def bisect(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = unclipped(mid) >= b
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = lax.fori_loop(0, 32, bisect, (jnp.ones_like(b), jnp.full_like(b, top)))
    thr = jnp.where((b < num_time) & (unclipped(jnp.int32(top)) >= b), lo.astype(jnp.float32), jnp.inf)
    return jnp.where(b == 0, -jnp.inf, thr)


def bias_cells(
    offsets: Int[ArrayLike, " B1"], ts: Int[ArrayLike, " Tt"] | None, params: KernelParams, *, t: int
):
    """(i - j, time bucket or None), int32 [T, W]: row i's offset to column j of its own sequence, and the
    bucket of their time delta. Head- and layer-independent: a model's layers share them."""
    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(offsets, rows, side="right").astype(jnp.int32) - 1
    start = offsets[jnp.clip(seq, 0, offsets.shape[0] - 2)]
    cols = jnp.arange(tiling.bias_width(params.max_seq_len, params.blocks), dtype=jnp.int32)[None, :]
    bucket = None
    if params.has_time:
        ts_k = ts[jnp.minimum(start[:, None] + cols, t - 1)]
        # one [T, W] array for all heads: fused into the table gather, XLA takes the log once per head
        bucket = lax.optimization_barrier(
            tiling.time_bucket(ts[:, None] - ts_k, params.num_time).astype(jnp.int16)
        )
    return (rows - start)[:, None] - cols, bucket


def bias_rows(
    offsets: Int[ArrayLike, " B1"],
    ts: Int[ArrayLike, " Tt"],
    pos_tab: Float[ArrayLike, "H P"],
    time_tab: Float[ArrayLike, "H1 W"],
    params: KernelParams,
    *,
    total_rows: int,
    heads: int,
    dtype,
) -> jax.Array:
    """[H, T, W]: the relative bias of row i and column j of row i's sequence (j < W = tiling.bias_width).

    Built by XLA once per call, so the kernels load it per tile instead of each head of each kernel
    recomputing it; the buckets are the reference's formulas. Cells a kernel masks (j past the row, rows
    past offsets[B]) hold finite values.
    """
    delta, bucket = bias_cells(offsets, ts, params, t=total_rows)
    bias = jnp.zeros((heads, *delta.shape), jnp.float32)
    if params.has_pos:
        bias = bias + pos_tab[:, jnp.clip(delta, 0, params.num_pos - 1)]
    if params.has_time:
        bias = bias + time_tab[:heads, bucket]
    return bias.astype(dtype)


def to_kernel_layout(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    num_targets: Int[ArrayLike, " B"] | None,
    timestamps: Int[ArrayLike, " T"] | None,
    pos_bias: Float[ArrayLike, "H P"] | None,
    time_bias: Float[ArrayLike, "H NT"] | None,
    params: KernelParams,
) -> tuple:
    """The kernels' inputs (q, k, v, offsets, targets, ts, pos_tab, time_tab) from jagged_attention's arguments.

    Head dims are zero-padded to powers of two (Triton tiles); the bias tables become float32 padded to a power
    of two wide, the time table with one extra row of bucket thresholds (time_thresholds); absent ones are
    small dummies the kernels never read. When a Mosaic GPU kernel runs (either direction), rows are padded
    to a multiple of tiling.MOSAIC_ALIGN: Mosaic GPU tiles a TMA's whole GMEM
    array in 8-row tiles (rows past offsets[B] are unused capacity, so the kernels' contract holds).
    """
    t, heads, dqk = q.shape
    rows = (
        -(-t // tiling.MOSAIC_ALIGN) * tiling.MOSAIC_ALIGN
        if "mosaic" in (params.forward_kernel, params.backward_kernel)
        else t
    )
    if rows != t:
        q, k, v = (jnp.pad(x, ((0, rows - t), (0, 0), (0, 0))) for x in (q, k, v))
        if timestamps is not None:
            timestamps = jnp.pad(timestamps, (0, rows - t))
    dv = v.shape[-1]
    if t * heads * next_pow2(max(dqk, dv)) >= 2**31:
        raise ValueError(
            f"the GPU kernel indexes with int32: T*H*D must be < 2**31, got shape {q.shape}, v {v.shape}"
        )
    b = offsets.shape[0] - 1
    targets = jnp.zeros((b,), jnp.int32) if num_targets is None else num_targets.astype(jnp.int32)
    ts = jnp.zeros((1,), jnp.int32) if timestamps is None else timestamps.astype(jnp.int32)
    pos_tab = (
        jnp.zeros((heads, 16), jnp.float32)
        if pos_bias is None
        else pad_last(pos_bias.astype(jnp.float32), next_pow2(pos_bias.shape[1]))
    )
    time_tab = jnp.zeros((heads + 1, 16), jnp.float32)
    if time_bias is not None:  # the table, plus one row of bucket thresholds the kernels compare against
        width = next_pow2(time_bias.shape[1])
        time_tab = jnp.concatenate(
            [
                pad_last(time_bias.astype(jnp.float32), width),
                time_thresholds(time_bias.shape[1], width)[None],
            ]
        )
    dqk_p, dv_p = next_pow2(dqk), next_pow2(dv)
    return (
        pad_last(q, dqk_p),
        pad_last(k, dqk_p),
        pad_last(v, dv_p),
        offsets,
        targets,
        ts,
        pos_tab,
        time_tab,
    )


def from_kernel_layout(
    out: Float[ArrayLike, "Tk H DvPadded"],  # Tk: T, or T padded for Mosaic GPU (to_kernel_layout)
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    params: KernelParams,
) -> Float[ArrayLike, "T H Dv"]:
    """[T, H, Dv] output: drops the head-dim padding (and the rows to_kernel_layout added for Mosaic GPU)."""
    del offsets, params
    return out[: v.shape[0], :, : v.shape[-1]]
