"""BSARec's frequency branch: the jagged filter against a numpy FFT on BSARec's left-padded layout, its
identities, the HSTU layer's mix of the two branches, and the config rules that keep it from leaking."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.config import ConfigError, load_config
from gem_jax.model.frequency_filter import frequency_filter
from gem_jax.model.hstu import HSTULayer
from gem_jax.precision import PrecisionPolicy
from tests.helpers import FILTER_LAYER_ARGS

MAX_LEN = 10


def _numpy_filter(x: np.ndarray, offsets: np.ndarray, beta: np.ndarray, low_bins: int) -> np.ndarray:
    """Each sequence left-padded with zeros to MAX_LEN (BSARec's layout), filtered with numpy's FFT."""
    out = np.zeros_like(x)
    for a, b in zip(offsets[:-1], offsets[1:]):
        if a == b:
            continue
        padded = np.zeros((MAX_LEN, x.shape[1]))
        padded[MAX_LEN - (b - a) :] = x[a:b]
        spectrum = np.fft.rfft(padded, axis=0, norm="ortho")
        spectrum[low_bins:] = 0
        low = np.fft.irfft(spectrum, n=MAX_LEN, axis=0, norm="ortho")
        out[a:b] = (low + beta * (padded - low))[MAX_LEN - (b - a) :]
    return out


def _pack(seed: int = 0, d: int = 6):
    # lengths 3, 0 (an empty example), MAX_LEN, 1; then 5 tokens of unused capacity
    offsets = np.array([0, 3, 3, 3 + MAX_LEN, 4 + MAX_LEN, 4 + MAX_LEN])
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(offsets[-1] + 5, d)).astype(np.float32)
    return x, offsets, rng.uniform(0.0, 2.0, d).astype(np.float32)


@pytest.mark.parametrize("low_bins", [1, 3, MAX_LEN // 2 + 1])
def test_filter_matches_numpy_fft_of_left_padded_sequences(low_bins):
    x, offsets, beta = _pack()
    got = frequency_filter(
        jnp.asarray(x), jnp.asarray(offsets), jnp.asarray(beta), max_len=MAX_LEN, low_bins=low_bins
    )
    want = _numpy_filter(x, offsets, beta, low_bins)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[offsets[-1] :])  # unused capacity stays zero


def test_beta_one_is_the_identity_and_beta_zero_keeps_only_the_low_bins():
    x, offsets, _ = _pack(seed=1)
    real = offsets[-1]
    ones = frequency_filter(jnp.asarray(x), jnp.asarray(offsets), jnp.ones(6), max_len=MAX_LEN, low_bins=2)
    np.testing.assert_allclose(np.asarray(ones)[:real], x[:real], rtol=1e-5, atol=1e-5)
    # beta = 0 with one bin: the mean of the padded window (the DC term), the same at every real position
    zero = frequency_filter(jnp.asarray(x), jnp.asarray(offsets), jnp.zeros(6), max_len=MAX_LEN, low_bins=1)
    np.testing.assert_allclose(
        zero[:3], np.broadcast_to(x[:3].sum(0) / MAX_LEN, (3, 6)), rtol=1e-5, atol=1e-6
    )


def _layer_config(mix: float):
    overrides = [
        *FILTER_LAYER_ARGS,
        f"retrieval.max_len={MAX_LEN}",
        "retrieval.train_targets=last_of_prefixes",
        f"model.frequency_mix={mix}",
    ]
    return load_config(None, overrides)


def test_layer_mixes_filter_and_attention_branches():
    """Y = X + alpha F(LN X) + (1 - alpha) * (the attention layer's residual), the attention layer's
    parameters shared; and the filter lets an earlier position see a later item."""
    alpha = 0.7
    policy = PrecisionPolicy.from_config(_layer_config(0.0).precision)
    plain = HSTULayer("hstu/0", _layer_config(0.0).model, policy, rngs=nnx.Rngs(0))
    mixed = HSTULayer("hstu/0", _layer_config(alpha).model, policy, rngs=nnx.Rngs(1))
    assert plain.frequency is None and mixed.frequency is not None
    nnx.update(mixed, nnx.state(plain))  # the shared parameters; sqrt_beta stays mixed's own
    x, offsets, _ = _pack(seed=2, d=8)
    x, offsets = jnp.asarray(x), jnp.asarray(offsets)
    b = offsets.shape[0] - 1
    call = dict(max_seq_len=MAX_LEN, rng=None)
    args = (offsets, jnp.zeros((b,), jnp.int32), jnp.zeros((x.shape[0],), jnp.int32))
    y_plain, y_mixed = plain(x, *args, **call), mixed(x, *args, **call)
    beta = jnp.square(mixed.frequency.sqrt_beta[...])
    filtered = frequency_filter(mixed.input_norm(x), offsets, beta, max_len=MAX_LEN, low_bins=3)
    want = x + alpha * filtered + (1 - alpha) * (y_plain - x)
    real = int(offsets[-1])
    np.testing.assert_allclose(y_mixed[:real], want[:real], rtol=1e-5, atol=1e-5)
    later = x.at[1].set(-x[1])  # the second item of the first sequence
    assert not np.allclose(mixed(later, *args, **call)[0], y_mixed[0])  # not causal
    np.testing.assert_allclose(plain(later, *args, **call)[0], y_plain[0], rtol=1e-6)


def test_config_refuses_the_filter_where_it_would_leak_or_is_unsupported():
    base = ["data.kind=interactions", "data.path=x.txt", "model.frequency_mix=0.7"]
    with pytest.raises(
        ConfigError, match=r"`model.frequency_mix` \(0.7\) lets every position see later items"
    ):
        load_config(None, base)
    ok = [*base, "retrieval.train_targets=last_of_prefixes"]
    assert load_config(None, ok).model.frequency_mix == 0.7
    with pytest.raises(ConfigError, match="`model.frequency_bins` \\(27\\) exceeds the 26 real-FFT bins"):
        load_config(None, [*ok, "model.frequency_bins=27"])
    with pytest.raises(ConfigError, match='`model.frequency_mix` needs model.layer = "hstu"'):
        load_config(
            None, [*ok, "model.layer=sasrec", "model.num_position_buckets=0", "model.num_time_buckets=0"]
        )
    with pytest.raises(ConfigError, match="`model.frequency_mix` is for next-item data"):
        load_config(None, ["model.frequency_mix=0.5"])
