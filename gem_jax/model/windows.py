"""A jagged pack as padded windows: each sequence of the pack in a row of a [B, Lw, ...] array.

The sequence filters that work along time on a fixed window (BSARec's FFT filter, the time-variant
convolution, the wavelet branch, the spectral views) move a pack's rows into one window per sequence,
transform the windows and move the rows back. `anchor` says where a sequence sits in its window: "start",
its first item at position 0 (padding after it); "end", its newest item at position Lw - 1 (padding before
it, SASRec's left padding, so a window position is a distance from the newest item). Padding is zero, so a
filter that reads only the window never mixes two sequences of a pack. Every sequence must fit the window
(a next-item pack holds at most `retrieval.max_len` items per example).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from gem_jax.embeddings import segment_ids


class WindowLayout(NamedTuple):
    """Where each token of a pack sits: window `row`, window position `pos` (`length`, out of the window,
    for tokens past offsets[B]), `valid` (the token belongs to a sequence)."""

    row: Int[Array, " T"]
    pos: Int[Array, " T"]
    valid: Bool[Array, " T"]
    rows: int
    length: int


def window_layout(
    offsets: Int[ArrayLike, " B1"], num_tokens: int, length: int, anchor: Literal["start", "end"]
) -> WindowLayout:
    """The layout of a pack of `num_tokens` token capacity in windows of `length` positions."""
    rows = offsets.shape[0] - 1
    row = jnp.minimum(segment_ids(offsets, num_tokens), rows - 1)
    token = jnp.arange(num_tokens)
    valid = token < offsets[-1]
    if anchor == "start":
        pos = jnp.where(valid, token - offsets[row], length)
    else:
        pos = length - offsets[row + 1] + token
        pos = jnp.where(valid & (pos >= 0), pos, length)
    return WindowLayout(row, pos, valid, rows, length)


def to_windows(x: Float[ArrayLike, " T *rest"], layout: WindowLayout) -> Float[Array, "B Lw *rest"]:
    """The pack's rows in their windows (zeros elsewhere), in x's dtype."""
    windows = jnp.zeros((layout.rows, layout.length, *x.shape[1:]), x.dtype)
    return windows.at[layout.row, layout.pos].set(x, mode="drop")


def from_windows(windows: Float[ArrayLike, "B Lw *rest"], layout: WindowLayout) -> Float[Array, " T *rest"]:
    """The inverse of `to_windows`: each token's row read back from its window (zeros past offsets[B])."""
    out = windows[layout.row, jnp.minimum(layout.pos, layout.length - 1)]
    valid = layout.valid.reshape(-1, *(1,) * (out.ndim - 1))
    return jnp.where(valid, out, 0.0)
