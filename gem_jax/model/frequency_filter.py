"""BSARec's frequency branch (Shin et al., AAAI 2024): an inductive bias beside self-attention.

Each sequence is padded to `max_len` and transformed along time with a real FFT; its lowest
`low_bins` frequencies are the low-pass part (the user's slowly changing taste), the rest the
high-pass part (short-term shifts). The branch returns low + beta * high with a learned
non-negative per-channel beta, so beta = 1 is the identity and beta = 0 a pure low-pass filter.
The HSTU layer mixes it with attention (`model.frequency_mix`, gem_jax/model/hstu.py).

The filter is not causal: every position sees the whole sequence, later items included, so it may
only be trained on examples whose target follows the whole input (`retrieval.train_targets =
"last_of_prefixes"`). Where a sequence sits in its padded window does not matter: padding is zero,
and a shift of the window is a circular shift, which the DFT's per-frequency filter commutes with,
so right padding (used here) gives BSARec's left-padded values at the real positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import ArrayLike, Float, Int

from gem_jax.model.windows import from_windows, to_windows, window_layout
from gem_jax.parallel import param


def frequency_filter(
    x: Float[ArrayLike, "T D"],
    offsets: Int[ArrayLike, " B1"],
    beta: Float[ArrayLike, " D"],
    *,
    max_len: int,
    low_bins: int,
) -> Float[ArrayLike, "T D"]:
    """low + beta * high of every sequence of a jagged pack (zeros past offsets[B]).

    Args:
      x: token vectors of the pack; sequence b owns rows offsets[b]:offsets[b+1], each <= max_len long.
      offsets: the pack's B + 1 sequence offsets.
      beta: the weight of the high-pass part, per channel.
      max_len: the padded window (the FFT length).
      low_bins: how many of the lowest of the max_len // 2 + 1 real-FFT bins form the low-pass part.
    """
    layout = window_layout(offsets, x.shape[0], max_len, "start")
    padded = to_windows(x.astype(jnp.float32), layout)
    spectrum = jnp.fft.rfft(padded, axis=1, norm="ortho")
    keep = (jnp.arange(spectrum.shape[1]) < low_bins)[None, :, None]
    low = jnp.fft.irfft(jnp.where(keep, spectrum, 0), n=max_len, axis=1, norm="ortho")
    filtered = low + beta.astype(jnp.float32) * (padded - low)
    return from_windows(filtered, layout).astype(x.dtype)


class FrequencyBranch(nnx.Module):
    """The learned part of the branch: beta = sqrt_beta ** 2 per channel (BSARec's parametrisation,
    which keeps beta >= 0), sqrt_beta drawn from N(0, 1) as in their code."""

    def __init__(self, dim: int, *, low_bins: int, rngs: nnx.Rngs):
        self.sqrt_beta = param(rngs, nnx.initializers.normal(1.0), (dim,), ("embed",), jnp.float32)
        self.low_bins = low_bins

    def __call__(
        self, x: Float[ArrayLike, "T D"], offsets: Int[ArrayLike, " B1"], *, max_len: int
    ) -> Float[ArrayLike, "T D"]:
        with jax.named_scope("frequency_filter"):
            beta = jnp.square(self.sqrt_beta[...])
            return frequency_filter(x, offsets, beta, max_len=max_len, low_bins=self.low_bins)
