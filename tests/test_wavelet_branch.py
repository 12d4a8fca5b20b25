"""The wavelet branch: the Haar transform against its basis written out, the jagged branch against a direct
computation on right-aligned windows, the identity at the start, per-user gates, the HSTU layer's mix with
attention, sequences of a pack kept apart (a property test), gradients, and the config rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_jax.config import ConfigError, load_config
from gem_jax.model.wavelet_branch import (
    WaveletBranch,
    haar_analysis,
    haar_synthesis,
    wavelet_filter,
    wavelet_window,
)
from tests.helpers import filter_layer, jagged_rows, rows_changed

MAX_LEN = 10
PREFIXES = "retrieval.train_targets=last_of_prefixes"


def _haar_basis(length: int, levels: int) -> list[np.ndarray]:
    """The orthonormal Haar basis as rows, band by band (details fine to coarse, then block means)."""
    bands = []
    for j in range(1, levels + 1):
        size = 2**j
        rows = np.zeros((length // size, length))
        for m in range(length // size):
            rows[m, m * size : m * size + size // 2] = 1.0
            rows[m, m * size + size // 2 : (m + 1) * size] = -1.0
        bands.append(rows / np.sqrt(size))
    size = 2**levels
    means = np.kron(np.eye(length // size), np.ones(size)) / np.sqrt(size)
    return [*bands, means]


def test_haar_bands_are_the_basis_coefficients_and_invert():
    x = np.random.default_rng(0).normal(size=(2, 16, 3)).astype(np.float32)
    bands = haar_analysis(jnp.asarray(x), 3)
    for got, rows in zip(bands, _haar_basis(16, 3)):
        np.testing.assert_allclose(got, np.einsum("ml,bld->bmd", rows, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(haar_synthesis(bands), x, rtol=1e-5, atol=1e-5)


def _direct(x, offsets, weights, levels):
    """Each sequence right-aligned in its window, every basis coefficient scaled by its band's weights."""
    length = wavelet_window(MAX_LEN, levels)
    basis = _haar_basis(length, levels)
    out = np.zeros_like(x)
    for s, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        window = np.zeros((length, x.shape[1]))
        window[length - (b - a) :] = x[a:b]
        filtered = sum(rows.T @ ((rows @ window) * weights[s, j]) for j, rows in enumerate(basis))
        out[a:b] = filtered[length - (b - a) :]
    return out


def test_branch_matches_a_direct_computation_and_starts_as_the_identity():
    levels, d = 2, 4
    x, offsets = jagged_rows([3, 0, MAX_LEN, 1], 5, d)
    branch = WaveletBranch(d, levels=levels, rngs=nnx.Rngs(0))
    start = np.asarray(branch(x, offsets, max_len=MAX_LEN))
    real = int(offsets[-1])
    np.testing.assert_allclose(start[:real], np.asarray(x)[:real], rtol=1e-5, atol=1e-5)
    assert not start[real:].any()
    _away_from_the_identity(branch, seed=1)
    got = np.asarray(branch(x, offsets, max_len=MAX_LEN))
    # The weights the branch used: gains x per-user gates from the mean of each sequence's rows.
    lengths = np.maximum(np.diff(np.asarray(offsets)), 1)
    sums = np.stack([np.asarray(x)[a:b].sum(0) for a, b in zip(offsets[:-1], offsets[1:])])
    gates = np.asarray(branch.gates(jnp.asarray(sums / lengths[:, None])))
    assert np.ptp(gates[[0, 2, 3]], axis=0).max() > 1e-3  # users get different band weights
    weights = np.asarray(branch.gains[...])[None] * gates[:, :, None]
    want = _direct(np.asarray(x), np.asarray(offsets), weights, levels)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_zero_mean_band_weight_removes_the_block_means():
    x = np.random.default_rng(2).normal(size=(1, 8, 2)).astype(np.float32)
    weights = np.ones((1, 3, 2), np.float32)
    weights[:, -1] = 0.0
    out = np.asarray(wavelet_filter(jnp.asarray(x), jnp.asarray(weights)))
    np.testing.assert_allclose(out.reshape(1, 2, 4, 2).mean(axis=2), 0.0, atol=1e-6)


def test_layer_mixes_the_branch_with_attention():
    """Y = X + omega W(LN X) + (1 - omega) (the attention layer's residual), parameters shared."""
    omega = 0.4
    plain, call_plain = filter_layer(MAX_LEN)
    mixed, call_mixed = filter_layer(
        MAX_LEN, PREFIXES, f"model.wavelet_mix={omega}", "model.wavelet_levels=2"
    )
    assert plain.wavelet is None and mixed.wavelet is not None
    nnx.update(mixed, nnx.state(plain))  # the shared parameters; the branch's stay mixed's own
    x, offsets = jagged_rows([3, 0, MAX_LEN, 1], 5, 8, seed=3)
    _away_from_the_identity(mixed.wavelet, seed=2)
    y_plain = call_plain(x, offsets)
    want = (
        x + omega * mixed.wavelet(mixed.input_norm(x), offsets, max_len=MAX_LEN) + (1 - omega) * (y_plain - x)
    )
    real = int(offsets[-1])
    np.testing.assert_allclose(call_mixed(x, offsets)[:real], want[:real], rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, MAX_LEN), min_size=3, max_size=3).filter(sum),
    pick=st.integers(0, 10**6),
)
def test_layer_keeps_sequences_of_a_pack_apart(lengths, pick):
    """Changing one token changes every row of its own sequence (the gates read them all) and no other."""
    layer, call = filter_layer(MAX_LEN, PREFIXES, "model.wavelet_mix=0.5", "model.wavelet_levels=2")
    _away_from_the_identity(layer.wavelet, seed=pick % 5)
    x, offsets = jagged_rows(
        lengths, 3 * MAX_LEN + 2 - sum(lengths), 8, seed=pick % 7
    )  # one shape: one compile
    j = pick % int(offsets[-1])
    seq = int(np.searchsorted(np.asarray(offsets), j, side="right") - 1)
    # -2x, not a shift: the layer norm would not see a shift of every channel
    changed = rows_changed(call(x, offsets), call(x.at[j].multiply(-2.0), offsets))
    assert changed == set(range(int(offsets[seq]), int(offsets[seq + 1]))), (lengths, j, changed)


def _away_from_the_identity(branch: WaveletBranch, seed: int) -> None:
    """Random gains and gate output layer (at the start both make the branch the identity)."""
    rng = np.random.default_rng(seed)
    for name in ("gains", "gate_out", "gate_out_bias"):
        shape = getattr(branch, name)[...].shape
        getattr(branch, name)[...] = jnp.asarray(rng.normal(size=shape).astype(np.float32))


def test_gradients_are_finite_and_reach_the_gates():
    layer, call = filter_layer(MAX_LEN, PREFIXES, "model.wavelet_mix=0.5")
    x, offsets = jagged_rows([3, 0, MAX_LEN], 3, 8)
    grads = nnx.grad(lambda module: jnp.sum(jnp.sin(call(x, offsets, module))))(layer)
    for leaf in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(leaf)).all()
    for g in (grads.wavelet.gains, grads.wavelet.gate_out, grads.wavelet.gate_out_bias):
        assert np.abs(np.asarray(g[...])).max() > 0


def test_config_rules():
    base = ["data.kind=interactions", "data.path=x.txt", "model.wavelet_mix=0.3"]
    with pytest.raises(ConfigError, match=r"`model.wavelet_mix` \(0.3\) lets every position see later items"):
        load_config(None, base)
    ok = [*base, PREFIXES]
    assert load_config(None, ok).model.wavelet_mix == 0.3
    with pytest.raises(ConfigError, match=r"`model.frequency_mix` \+ `model.wavelet_mix` \(0.8 \+ 0.3\)"):
        load_config(None, [*ok, "model.frequency_mix=0.8"])
    with pytest.raises(ConfigError, match=r"`model.wavelet_levels` \(7\) makes Haar blocks of 128"):
        load_config(None, [*ok, "model.wavelet_levels=7"])
    assert load_config(None, [*ok, "model.wavelet_levels=6"]).model.wavelet_levels == 6
    with pytest.raises(ConfigError, match="`model.wavelet_mix` needs model.layer"):
        load_config(
            None, [*ok, "model.layer=sasrec", "model.num_position_buckets=0", "model.num_time_buckets=0"]
        )
    with pytest.raises(
        ConfigError, match=r"`model.wavelet_levels` \(2\) shapes `model.wavelet_mix`, which is off"
    ):
        load_config(None, ["model.wavelet_levels=2"])
