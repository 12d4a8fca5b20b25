"""A multi-level Haar wavelet branch with per-user band weights (after WEARec, Xu et al., AAAI 2026), beside
attention like BSARec's frequency branch (`model.wavelet_mix`, gem_jax/model/hstu.py).

Each sequence sits at the end of a window of Lw positions (retrieval.max_len rounded up to a multiple of 2^J;
its newest item last, so the Haar blocks are counted back from the newest item). J levels of the orthonormal
Haar transform split the window into detail bands d_1 .. d_J (fine to coarse: the differences between
neighbours, between neighbouring pairs, ...) and the approximation a_J (means of blocks of 2^J items). Band j
of user b is scaled per channel by gain[j] * gate[b, j]: `gain` learned, `gate` = 2 sigmoid(MLP(mean of the
user's rows)), one weight per band from a small network that reads the sequence (WEARec's adaptive per-user
filter); the inverse transform brings the rows back. The gains start at 1 and the network's output layer at
0, so the branch starts as the identity (as BSARec's branch at beta = 1).

Not causal: a row sees the rows of its 2^J block and the gates see the whole sequence, so like the frequency
branch it trains with `retrieval.train_targets = "last_of_prefixes"` (the scored row, each example's newest,
then sees only its own items). WEARec's layer is one Haar level with a learned weight per position and
channel on the details, beside a per-user FFT filter; this branch has several levels and weighs whole bands
per user.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, ArrayLike, Float, Int

from gem_jax.model.windows import from_windows, to_windows, window_layout
from gem_jax.parallel import param

_HALF = 0.5**0.5  # the orthonormal Haar pair: (even +- odd) / sqrt(2)


def wavelet_window(max_len: int, levels: int) -> int:
    """The window: max_len rounded up to a multiple of 2^levels."""
    block = 2**levels
    return -(-max_len // block) * block


def haar_analysis(x: Float[ArrayLike, "B Lw D"], levels: int) -> list[Array]:
    """[d_1, ..., d_J, a_J] along axis 1 (d_j has Lw / 2^j rows, a_J Lw / 2^J); Lw a multiple of 2^J."""
    bands, approx = [], x
    for _ in range(levels):
        even, odd = approx[:, 0::2], approx[:, 1::2]
        bands.append((even - odd) * _HALF)
        approx = (even + odd) * _HALF
    return [*bands, approx]


def haar_synthesis(bands: list[Array]) -> Array:
    """The inverse of `haar_analysis`."""
    approx = bands[-1]
    for detail in reversed(bands[:-1]):
        even, odd = (approx + detail) * _HALF, (approx - detail) * _HALF
        approx = jnp.stack([even, odd], axis=2).reshape(approx.shape[0], -1, approx.shape[-1])
    return approx


def wavelet_filter(
    windows: Float[ArrayLike, "B Lw D"], weights: Float[ArrayLike, "B J1 D"]
) -> Float[Array, "B Lw D"]:
    """Every window's Haar bands (J1 = J + 1 of them, details fine to coarse, then the approximation)
    scaled by that window's weights, transformed back."""
    bands = haar_analysis(windows, weights.shape[1] - 1)
    return haar_synthesis([band * weights[:, j, None, :] for j, band in enumerate(bands)])


class WaveletBranch(nnx.Module):
    """The learned part: per-band, per-channel gains and the gate network (one hidden layer of `dim` units,
    GELU, as WEARec's), float32."""

    def __init__(self, dim: int, *, levels: int, rngs: nnx.Rngs):
        bands = levels + 1
        self.levels = levels
        zeros = nnx.initializers.zeros
        self.gains = param(rngs, nnx.initializers.ones, (bands, dim), (None, "embed"), jnp.float32)
        self.gate_hidden = param(
            rngs, nnx.initializers.lecun_normal(), (dim, dim), ("embed", "mlp"), jnp.float32
        )
        self.gate_hidden_bias = param(rngs, zeros, (dim,), ("mlp",), jnp.float32)
        self.gate_out = param(rngs, zeros, (dim, bands), ("mlp", None), jnp.float32)
        self.gate_out_bias = param(rngs, zeros, (bands,), (None,), jnp.float32)

    def gates(self, context: Float[ArrayLike, "B D"]) -> Float[Array, "B J1"]:
        """Each user's band weights in (0, 2) from the mean of its rows (1 at the start)."""
        hidden = jax.nn.gelu(context @ self.gate_hidden[...] + self.gate_hidden_bias[...])
        return 2.0 * jax.nn.sigmoid(hidden @ self.gate_out[...] + self.gate_out_bias[...])

    def __call__(
        self, x: Float[ArrayLike, "T D"], offsets: Int[ArrayLike, " B1"], *, max_len: int
    ) -> Float[Array, "T D"]:
        with jax.named_scope("wavelet_filter"):
            layout = window_layout(offsets, x.shape[0], wavelet_window(max_len, self.levels), "end")
            windows = to_windows(x.astype(jnp.float32), layout)
            lengths = jnp.maximum(offsets[1:] - offsets[:-1], 1).astype(jnp.float32)
            context = jnp.sum(windows, axis=1) / lengths[:, None]
            weights = self.gains[...][None] * self.gates(context)[:, :, None]
            return from_windows(wavelet_filter(windows, weights), layout).astype(x.dtype)
