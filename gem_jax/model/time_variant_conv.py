"""TV-Rec's time-variant convolution (Shin et al., NeurIPS 2025), the HSTU layer's sequence mixer in place
of attention (`model.sequence_mixer = "time_variant"`, gem_jax/model/hstu.py).

Every position of a sequence has its own causal filter of K taps: y_i = sum_{k < K} h[n_i, k] x_{i-k}, where
n_i is the position's distance from the sequence's newest item (as the position embedding counts, and as
TV-Rec's left-padded window indexes its filters) and x before the sequence's first item is zero. The filters
come from a small learned basis: h[n] = c[n] @ normalise_rows(basis), M basis filters of K taps and M
coefficients per position. There is one filter bank per head (TV-Rec's one bank is the one-head case); the
channels of a head share its filters.

TV-Rec writes the mixer as a time-variant graph filter sum_k diag(h_k) S^k on a directed cycle (S the shift)
evaluated through the graph Fourier transform, with a complex basis and coefficients whose real part acts; on
its window padded with K - 1 zeros that is this causal convolution (but for one tap of the oldest position,
which wraps around to the newest). Here it is computed directly, with real basis and coefficients: a banded
lower-triangular [Lw, Lw] matrix per head applied to each sequence's window, the sequence at the window's end
(row p of the matrix is the filter of distance Lw - 1 - p). Position i reads only the items at or before it;
which filter it uses depends on how many items follow it, nothing else about them. The published model adds
an orthogonality penalty on the basis (weight 0 in its Beauty and Sports runs); this one does not.

Initialisation: basis ~ N(0, 1) (its rows normalised in use) and coefficients ~ N(0, 1 / M), so a filter's
taps have variance ~1 / K and the mixer roughly keeps its input's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, ArrayLike, Float, Int

from gem_jax.model.windows import from_windows, to_windows, window_layout
from gem_jax.parallel import param


def time_variant_taps(
    coefficients: Float[ArrayLike, "H Lw Mb"], basis: Float[ArrayLike, "H Mb Kt"]
) -> Float[Array, "H Lw Kt"]:
    """The taps of every position's filter (row n: distance n from the newest item), per head."""
    unit = basis * jax.lax.rsqrt(jnp.maximum(jnp.sum(basis * basis, axis=-1, keepdims=True), 1e-12))
    return jnp.einsum("hnm,hmk->hnk", coefficients, unit)


def filter_matrix(taps: Float[ArrayLike, "H Lw Kt"]) -> Float[Array, "H Lw Lw"]:
    """W[h, p, q] = taps[h, Lw - 1 - p, p - q] where 0 <= p - q < K, else 0: y = W x on a window whose last
    position holds the newest item."""
    length, num_taps = taps.shape[1], taps.shape[2]
    lag = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]  # p - q
    by_position = taps[:, ::-1]  # row p: the filter of distance Lw - 1 - p
    w = by_position[:, jnp.arange(length)[:, None], jnp.clip(lag, 0, num_taps - 1)]
    return jnp.where(((lag >= 0) & (lag < num_taps))[None], w, 0.0)


def time_variant_conv(
    x: Float[ArrayLike, "T H Dv"], offsets: Int[ArrayLike, " B1"], taps: Float[ArrayLike, "H Lw Kt"]
) -> Float[Array, "T H Dv"]:
    """The filters applied to every sequence of a jagged pack (each <= Lw long; zeros past offsets[B])."""
    layout = window_layout(offsets, x.shape[0], taps.shape[1], "end")
    windows = to_windows(x.astype(jnp.float32), layout)
    mixed = jnp.einsum("hpq,bqhd->bphd", filter_matrix(taps.astype(jnp.float32)), windows)
    return from_windows(mixed, layout).astype(x.dtype)


class TimeVariantConv(nnx.Module):
    """The learned part: per head, `length` rows of basis coefficients and a basis of `basis` filters of
    `taps` taps."""

    def __init__(self, heads: int, *, length: int, taps: int, basis: int, rngs: nnx.Rngs):
        axes = ("heads", None, None)
        self.coefficients = param(
            rngs, nnx.initializers.normal(basis**-0.5), (heads, length, basis), axes, jnp.float32
        )
        self.basis = param(rngs, nnx.initializers.normal(1.0), (heads, basis, taps), axes, jnp.float32)

    def taps(self) -> Float[Array, "H Lw Kt"]:
        return time_variant_taps(self.coefficients[...], self.basis[...])

    def __call__(
        self, x: Float[ArrayLike, "T H Dv"], offsets: Int[ArrayLike, " B1"]
    ) -> Float[Array, "T H Dv"]:
        with jax.named_scope("time_variant_conv"):
            return time_variant_conv(x, offsets, self.taps())
