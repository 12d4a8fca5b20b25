"""Pure-jnp jagged attention: the spec every kernel is tested against.

Sequences are gathered into a padded [B, N, ...] layout (N = max_seq_len), the full per-position mask
is built explicitly, the math runs in float32, and rows are scattered back to the flat [T, ...] layout.
Cost is O(B * N^2): this is also the "padded XLA" baseline of the benchmark.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float, Int

# floor(log(dt) / LOG_TIME_DIVISOR) is the log-time bucket (0.301 ~ log10(2), as in HSTU).
LOG_TIME_DIVISOR = 0.301


def time_buckets(dt: Int[ArrayLike, ...], num_buckets: int) -> Int[ArrayLike, ...]:
    """Log-time bucket of a timestamp delta in seconds (deltas < 1 s fall into bucket 0)."""
    dt = jnp.maximum(dt, 1).astype(jnp.float32)
    return jnp.clip(jnp.floor(jnp.log(dt) / LOG_TIME_DIVISOR).astype(jnp.int32), 0, num_buckets - 1)


def position_buckets(delta: Int[ArrayLike, ...], num_buckets: int) -> Int[ArrayLike, ...]:
    """Relative-position bucket of i - j (clipped to the table)."""
    return jnp.clip(delta, 0, num_buckets - 1)


def allowed_mask(
    lengths: Int[ArrayLike, " B"], num_targets: Int[ArrayLike, " B"], max_seq_len: int, max_attn_len: int
) -> jax.Array:
    """bool[B, N, N]: may position i of sequence b attend position j (docs/design.md, Kernels)."""
    pos = jnp.arange(max_seq_len, dtype=jnp.int32)
    i = pos[None, :, None]
    j = pos[None, None, :]
    length = lengths[:, None, None]
    first_target = (lengths - num_targets)[:, None, None]
    valid = (i < length) & (j < length)
    i_target = i >= first_target
    j_target = j >= first_target
    causal = j <= i
    if max_attn_len > 0:
        causal = causal & (i - j <= max_attn_len)
    history = (~i_target) & causal  # non-targets: causal (and windowed) over non-targets
    target = i_target & (~j_target | (i == j))  # targets: all non-targets, and themselves
    return valid & (history | target)


def _padded_rows(offsets, lengths, n: int):
    """([B, N] flat row of each padded slot, whether the slot is in its sequence, the row to gather)."""
    pos = jnp.arange(n, dtype=jnp.int32)
    rows = offsets[:-1, None] + pos[None, :]
    in_seq = pos[None, :] < lengths[:, None]
    return rows, in_seq, jnp.where(in_seq, rows, 0)


def padded_buckets(
    offsets: Int[ArrayLike, " B1"],
    timestamps: Int[ArrayLike, " T"] | None,
    *,
    max_seq_len: int,
    num_pos: int,
    num_time: int,
) -> tuple[Int[ArrayLike, "N N"], Int[ArrayLike, "B N N"] | None]:
    """The position bucket of every padded (i, j) cell and, with timestamps, the time bucket of every
    sequence's cell: the reference's buckets, in the layout of `score_offset`."""
    n = max_seq_len
    offsets = jnp.asarray(offsets, jnp.int32)
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], n)
    pos = jnp.arange(n, dtype=jnp.int32)
    pos_bucket = position_buckets(pos[:, None] - pos[None, :], num_pos)
    if timestamps is None:
        return pos_bucket, None
    _, _, gather_rows = _padded_rows(offsets, lengths, n)
    ts = jnp.take(jnp.asarray(timestamps, jnp.int32), gather_rows, axis=0)
    return pos_bucket, time_buckets(ts[:, :, None] - ts[:, None, :], num_time)


def jagged_attention_reference(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    *,
    max_seq_len: int,
    activation: str = "silu",
    alpha: float | None = None,
    num_targets: Int[ArrayLike, " B"] | None = None,
    max_attn_len: int = 0,
    timestamps: Int[ArrayLike, " T"] | None = None,
    pos_bias: Float[ArrayLike, "H P"] | None = None,
    time_bias: Float[ArrayLike, "H NT"] | None = None,
    weight_dropout: float = 0.0,
    dropout_rng: jax.Array | None = None,
    score_offset: Float[ArrayLike, "B H N N"] | None = None,
) -> Float[ArrayLike, "T H Dv"]:
    """Jagged causal attention with SiLU (HSTU) or softmax, targets, window and relative bias.

    Every sequence must satisfy offsets[b+1] - offsets[b] <= max_seq_len; longer ones are truncated.
    Returns [T, H, Dv] in v.dtype; rows past offsets[B] are zero. `weight_dropout` (with
    `dropout_rng`) drops attention weights in training, as SASRec/HSTU do; no kernel implements it.
    `score_offset` (zeros, for checks) is added to the padded scores: its gradient is dScore of every cell,
    the terms that a bias table's gradient sums per bucket (see `padded_buckets`).
    """
    t, h, dqk = q.shape
    n = max_seq_len
    if alpha is None:
        alpha = 1.0 / dqk**0.5
    offsets = offsets.astype(jnp.int32)
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], n)
    b = lengths.shape[0]
    if num_targets is None:
        num_targets = jnp.zeros((b,), jnp.int32)
    num_targets = jnp.clip(num_targets.astype(jnp.int32), 0, lengths)

    pos = jnp.arange(n, dtype=jnp.int32)
    rows, in_seq, gather_rows = _padded_rows(offsets, lengths, n)

    def pad(x):
        xp = jnp.take(x, gather_rows, axis=0).astype(jnp.float32)  # [B, N, H, D]
        return jnp.where(in_seq[:, :, None, None], xp, 0.0)

    qp, kp, vp = pad(q), pad(k), pad(v)
    s = alpha * jnp.einsum("bihd,bjhd->bhij", qp, kp)
    if pos_bias is not None:
        bucket = position_buckets(pos[:, None] - pos[None, :], pos_bias.shape[1])  # [N, N]
        s = s + pos_bias.astype(jnp.float32)[:, bucket][None]
    if time_bias is not None:
        if timestamps is None:
            raise ValueError("time_bias needs timestamps, got timestamps=None")
        ts = jnp.take(timestamps.astype(jnp.int32), gather_rows, axis=0)  # [B, N]
        bucket = time_buckets(ts[:, :, None] - ts[:, None, :], time_bias.shape[1])  # [B, N, N]
        s = s + jnp.moveaxis(time_bias.astype(jnp.float32)[:, bucket], 0, 1)  # [B, H, N, N]
    if score_offset is not None:
        s = s + score_offset
    mask = allowed_mask(lengths, num_targets, n, max_attn_len)[:, None]  # [B, 1, N, N]
    if activation == "silu":
        p = jnp.where(mask, jax.nn.silu(s), 0.0) / n
    elif activation == "softmax":
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.where(mask, jnp.exp(s - m), 0.0)
        p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    else:
        raise ValueError(f"activation must be 'silu' or 'softmax', got {activation!r}")
    if weight_dropout > 0:
        if dropout_rng is None:
            raise ValueError(f"weight_dropout={weight_dropout} needs dropout_rng")
        keep = jax.random.bernoulli(dropout_rng, 1.0 - weight_dropout, p.shape)
        p = jnp.where(keep, p / (1.0 - weight_dropout), 0.0)
    out = jnp.einsum("bhij,bjhd->bihd", p, vp)  # [B, N, H, Dv]
    scatter_rows = jnp.where(in_seq, rows, t)  # out-of-sequence slots are dropped
    flat = jnp.zeros((t, h, v.shape[-1]), jnp.float32)
    flat = flat.at[scatter_rows.reshape(-1)].set(out.reshape(b * n, h, -1), mode="drop")
    return flat.astype(v.dtype)


def softmax_lse_reference(q, k, offsets, max_seq_len: int, alpha: float, targets, window: int) -> np.ndarray:
    """float64 [H, T] natural-log softmax log-sum-exp over each row's allowed keys (checks a kernel's lse)."""
    t, h, _ = q.shape
    off = np.asarray(offsets)
    lengths = np.minimum(np.diff(off), max_seq_len)
    mask = np.asarray(
        allowed_mask(jnp.asarray(lengths), jnp.clip(targets, 0, jnp.asarray(lengths)), max_seq_len, window)
    )
    out = np.zeros((h, t))
    qf, kf = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b, length in enumerate(lengths):
        lo = off[b]
        if length:
            sc = alpha * np.matmul(
                qf[lo : lo + length].transpose(1, 0, 2), kf[lo : lo + length].transpose(1, 2, 0)
            )
            sc = np.where(mask[b, :length, :length][None], sc, -np.inf)
            mx = sc.max(-1, keepdims=True)
            out[:, lo : lo + length] = mx[..., 0] + np.log(np.exp(sc - mx).sum(-1))
    return out
