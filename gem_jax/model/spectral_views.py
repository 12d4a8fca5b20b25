"""Views of a sequence made in the frequency domain, for a contrastive loss
(`retrieval.frequency_contrastive_weight`; after FICLRec's frequency contrastive learning, Su et al. 2025,
and CFIT4SRec's frequency-domain augmentations, Zhang et al. 2023).

A view of an example is its embedded sequence with a random contiguous band of its spectrum removed: the
sequence in a window of max_len positions (zero padding), its real FFT along time, `band_width` of the
non-constant bins 1 .. max_len // 2 zeroed from a start drawn per example and view (a band that reaches the
top bin is a low-pass filter), the inverse FFT. The window's mean (bin 0) is kept. Like BSARec's filter, a
view's row reads the whole sequence; only the contrastive loss sees the views.

FICLRec's released code contrasts a sequence with another training sequence of the same target and adds an
L1 distance between their spectra at one bin; the views here are band-filtered copies of the sequence itself
(the frequency-domain augmentation), contrasted with the InfoNCE of the other contrastive losses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from gem_jax.model.windows import from_windows, to_windows, window_layout


def band_width(max_len: int, band: float) -> int:
    """Bins a view loses: the fraction `band` of the max_len // 2 non-constant bins, at least one."""
    return max(1, round(band * (max_len // 2)))


def band_stop_view(
    x: Float[ArrayLike, "T D"], offsets: Int[ArrayLike, " B1"], key: jax.Array, *, max_len: int, band: float
) -> Float[Array, "T D"]:
    """One view of every sequence of a jagged pack (each <= max_len long, max_len >= 2; zeros past
    offsets[B]), its band drawn with `key`."""
    layout = window_layout(offsets, x.shape[0], max_len, "start")
    spectrum = jnp.fft.rfft(to_windows(x.astype(jnp.float32), layout), axis=1, norm="ortho")
    bins, width = spectrum.shape[1], band_width(max_len, band)
    start = jax.random.randint(key, (layout.rows, 1), 1, bins - width + 1)
    k = jnp.arange(bins)[None, :]
    removed = (k >= start) & (k < start + width)
    view = jnp.fft.irfft(jnp.where(removed[:, :, None], 0, spectrum), n=max_len, axis=1, norm="ortho")
    return from_windows(view, layout).astype(x.dtype)
