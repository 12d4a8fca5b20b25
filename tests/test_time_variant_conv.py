"""TV-Rec's time-variant convolution: the jagged filter against a direct loop, the taps from the basis, the
HSTU layer with it in place of attention (causal, sequences of a pack kept apart: a property test; no Q, K or
relative bias), gradients, and the config rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_jax.config import ConfigError, load_config
from gem_jax.model.time_variant_conv import time_variant_conv, time_variant_taps
from tests.helpers import filter_layer, jagged_rows, rows_changed

MAX_LEN = 8
MIXER = ("model.sequence_mixer=time_variant", "model.time_variant_basis=3")


def _direct(x: np.ndarray, offsets: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """y_i = sum_k taps[:, n_i, k] x_{i-k} within each sequence, n_i = distance from its newest item."""
    out = np.zeros_like(x)
    for a, b in zip(offsets[:-1], offsets[1:]):
        for i in range(a, b):
            for k in range(min(taps.shape[2], i - a + 1)):
                out[i] += taps[:, b - 1 - i, k][:, None] * x[i - k]
    return out


@pytest.mark.parametrize("num_taps", [1, 3, MAX_LEN])
def test_filter_matches_a_direct_loop(num_taps):
    # lengths 3, 0 (an empty example), MAX_LEN, 1; then 4 rows of unused capacity
    x, offsets = jagged_rows([3, 0, MAX_LEN, 1], 4, (2, 3))
    taps = np.random.default_rng(1).normal(size=(2, MAX_LEN, num_taps)).astype(np.float32)
    got = np.asarray(time_variant_conv(x, offsets, jnp.asarray(taps)))
    np.testing.assert_allclose(got, _direct(np.asarray(x), np.asarray(offsets), taps), rtol=1e-5, atol=1e-5)
    assert not got[int(offsets[-1]) :].any()  # unused capacity stays zero


def test_taps_are_coefficients_over_the_normalised_basis():
    rng = np.random.default_rng(2)
    coefficients = rng.normal(size=(2, MAX_LEN, 3)).astype(np.float32)
    basis = rng.normal(size=(2, 3, 5)).astype(np.float32)
    got = time_variant_taps(jnp.asarray(coefficients), jnp.asarray(basis))
    unit = basis / np.linalg.norm(basis, axis=-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("hnm,hmk->hnk", coefficients, unit), rtol=1e-5, atol=1e-6)
    # The basis' scale does not matter, only its directions.
    np.testing.assert_allclose(
        time_variant_taps(jnp.asarray(coefficients), jnp.asarray(3 * basis)), got, rtol=1e-5
    )


def test_layer_has_no_attention_parameters_and_differs_from_attention():
    tv, call_tv = filter_layer(MAX_LEN, *MIXER)
    attention, call_attention = filter_layer(MAX_LEN)
    assert tv.time_variant is not None and attention.time_variant is None
    assert tv.pos_bias is None and attention.pos_bias is not None
    assert tv.uvqk.kernel.shape == (8, 2 * 2 * 4)  # U and V of 2 heads x 4; no Q or K
    assert tv.time_variant.coefficients.shape == (2, MAX_LEN, 3)
    assert tv.time_variant.basis.shape == (2, 3, MAX_LEN)  # taps 0: the whole window
    x, offsets = jagged_rows([3, MAX_LEN], 2, 8)
    assert not np.allclose(call_tv(x, offsets), call_attention(x, offsets))


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, MAX_LEN), min_size=3, max_size=3).filter(sum),
    pick=st.integers(0, 10**6),
)
def test_layer_is_causal_and_keeps_sequences_apart(lengths, pick):
    """Changing one token changes only its own and later positions of its own sequence (the next one too:
    the filters reach it)."""
    _, call = filter_layer(MAX_LEN, *MIXER, "model.time_variant_taps=3")
    x, offsets = jagged_rows(
        lengths, 3 * MAX_LEN + 2 - sum(lengths), 8, seed=pick % 7
    )  # one shape: one compile
    j = pick % int(offsets[-1])
    end = int(offsets[int(np.searchsorted(np.asarray(offsets), j, side="right"))])
    # -2x, not a shift: the layer norm would not see a shift of every channel
    changed = rows_changed(call(x, offsets), call(x.at[j].multiply(-2.0), offsets))
    assert {j, min(j + 1, end - 1)} <= changed <= set(range(j, end)), (lengths, j, changed)


def test_gradients_are_finite_and_reach_the_basis():
    layer, call = filter_layer(MAX_LEN, *MIXER)
    x, offsets = jagged_rows([3, 0, MAX_LEN], 3, 8)
    grads = nnx.grad(lambda module: jnp.sum(call(x, offsets, module) ** 2))(layer)
    for leaf in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(leaf)).all()
    for g in (grads.time_variant.coefficients, grads.time_variant.basis):
        assert np.abs(np.asarray(g[...])).max() > 0


def test_config_rules():
    base = ["data.kind=interactions", "data.path=x.txt", "model.sequence_mixer=time_variant"]
    assert load_config(None, base).model.sequence_mixer == "time_variant"  # causal: every training target
    with pytest.raises(ConfigError, match='`model.sequence_mixer = "time_variant"` is for next-item data'):
        load_config(None, ["model.sequence_mixer=time_variant"])
    with pytest.raises(ConfigError, match=r"`model.time_variant_taps` \(51\) exceeds"):
        load_config(None, [*base, "model.time_variant_taps=51"])
    with pytest.raises(ConfigError, match="`model.attention_dropout`"):
        load_config(None, [*base, "model.attention_dropout=0.1"])
    with pytest.raises(ConfigError, match="`model.uvqk_implementation = 'reference'`"):
        load_config(None, [*base, "model.uvqk_implementation=reference"])
    # Keys of the mixer while attention mixes: refused, naming the key.
    for key in ("time_variant_taps=4", "time_variant_basis=4"):
        with pytest.raises(ConfigError, match=f"`model.{key.split('=')[0]}`"):
            load_config(None, ["data.kind=interactions", "data.path=x.txt", f"model.{key}"])
