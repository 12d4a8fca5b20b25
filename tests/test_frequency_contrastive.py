"""The frequency-domain contrastive loss: a view is its sequence with one contiguous band of its spectrum
removed (numpy's FFT), views keep the sequences of a pack apart, the task adds the loss with its weight and
leaves the next-item part as it was, gradients, the config rules, and end-to-end training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.config import ConfigError
from gem_jax.model.spectral_views import band_stop_view as band_stop_view_eager
from gem_jax.model.spectral_views import band_width
from gem_jax.tasks import make_task
from gem_jax.train import loop
from tests.helpers import jagged_rows, rows_changed
from tests.test_retrieval import records, small, write_cyclic_pairs

# compiled once per shape (eagerly, the loops below spent seconds in op dispatch)
band_stop_view = jax.jit(band_stop_view_eager, static_argnames=("max_len", "band"))

MAX_LEN = 10
ON = ("retrieval.frequency_contrastive_weight=0.3", "retrieval.loss=full_softmax")


def _removed_band(view: np.ndarray, rows: np.ndarray, width: int) -> int:
    """The start of the band of `width` bins whose removal from the zero-padded window of `rows` gives
    `view` (every start that does, checked: exactly one)."""
    spectrum = np.fft.rfft(np.pad(rows, ((0, MAX_LEN - len(rows)), (0, 0))), axis=0, norm="ortho")
    starts = []
    for start in range(1, spectrum.shape[0] - width + 1):
        cut = spectrum.copy()
        cut[start : start + width] = 0
        if np.allclose(np.fft.irfft(cut, n=MAX_LEN, axis=0, norm="ortho")[: len(rows)], view, atol=1e-5):
            starts.append(start)
    assert len(starts) == 1, starts
    return starts[0]


@pytest.mark.parametrize("band", [0.2, 0.6, 1.0])
def test_a_view_is_its_sequence_without_one_band(band):
    x, offsets = jagged_rows([3, 0, MAX_LEN, 6, MAX_LEN], 4, 3)
    width = band_width(MAX_LEN, band)
    assert width == max(1, round(band * 5))
    starts = set()
    for key in range(3):
        view = np.asarray(band_stop_view(x, offsets, jax.random.key(key), max_len=MAX_LEN, band=band))
        for a, b in zip(offsets[:-1], offsets[1:]):
            if b > a:
                starts.add(_removed_band(view[a:b], np.asarray(x)[a:b], width))
        assert not view[int(offsets[-1]) :].any()  # unused capacity stays zero
    assert len(starts) == 6 - width  # every band the draw allows, over 3 keys x 4 sequences


def test_views_keep_the_sequences_of_a_pack_apart():
    x, offsets = jagged_rows([3, 0, MAX_LEN, 2], 2, 4)
    key = jax.random.key(0)
    before = band_stop_view(x, offsets, key, max_len=MAX_LEN, band=0.4)
    bounds = np.asarray(offsets)
    for j in range(int(offsets[-1])):
        seq = int(np.searchsorted(bounds, j, side="right") - 1)
        after = band_stop_view(x.at[j].add(1.0), offsets, key, max_len=MAX_LEN, band=0.4)
        assert j in rows_changed(before, after) <= set(range(bounds[seq], bounds[seq + 1]))


def _task_and_pack(tmp_path, *overrides):
    task = make_task(small(write_cyclic_pairs(tmp_path / "cyclic.txt"), *overrides))
    pack = jax.tree.map(jnp.asarray, task._epochs.epoch_packs(0)[0])
    return task, pack


def test_loss_is_added_with_its_weight_and_the_next_item_part_is_unchanged(tmp_path):
    off, pack = _task_and_pack(tmp_path, "retrieval.loss=full_softmax", "model.dropout=0.2")
    on, _ = _task_and_pack(tmp_path, *ON, "model.dropout=0.2")
    model = off.build_model()  # the loss adds no parameter
    assert nnx.state(model, nnx.Param).keys() == nnx.state(on.build_model(), nnx.Param).keys()
    key = jax.random.key(1)
    # compiled (eagerly each call spent seconds in op dispatch)
    off_loss = nnx.jit(lambda m, k: off.pack_loss(m, pack, {}, k))
    on_loss = nnx.jit(lambda m, k: on.pack_loss(m, pack, {}, k))
    sums_off, sums_on = off_loss(model, key), on_loss(model, key)
    assert "frequency_contrastive_sum" not in sums_off
    np.testing.assert_array_equal(sums_on["loss_sum"], sums_off["loss_sum"])
    assert float(sums_on["frequency_contrastive_count"]) == 2 * int((np.diff(pack.offsets) > 0).sum())
    loss, aux = on.loss(sums_on)
    assert float(loss) == pytest.approx(float(aux["next_item_loss"] + 0.3 * aux["frequency_contrastive"]))
    # Another key draws other bands (and dropout): another contrastive loss, the same next-item loss shape.
    other = on_loss(model, jax.random.key(2))
    assert float(other["frequency_contrastive_sum"]) != float(sums_on["frequency_contrastive_sum"])


def test_gradients_are_finite_and_reach_the_item_table(tmp_path):
    task, pack = _task_and_pack(tmp_path, *ON, "retrieval.frequency_contrastive_band=0.3")
    model = task.build_model()

    def contrastive(m):
        sums = task.pack_loss(m, pack, {}, jax.random.key(0))
        return sums["frequency_contrastive_sum"] / sums["frequency_contrastive_count"]

    grads = nnx.jit(nnx.grad(contrastive))(model)
    for leaf in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(leaf)).all()
    assert np.abs(np.asarray(grads["items"]["table"][...])).max() > 0


def test_config_rules(tmp_path):
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    with pytest.raises(ConfigError, match=r"`retrieval.frequency_contrastive_band` \(0.3\) shapes"):
        small(data, "retrieval.frequency_contrastive_band=0.3")
    with pytest.raises(ConfigError, match="`retrieval.frequency_contrastive_band`"):
        small(data, *ON, "retrieval.frequency_contrastive_band=0")
    with pytest.raises(
        ConfigError, match=r"`retrieval.frequency_contrastive_weight` needs `retrieval.max_len` >= 2"
    ):
        small(data, *ON, "retrieval.max_len=1")
    # The shared contrastive keys shape this loss too.
    config = small(data, *ON, "retrieval.contrastive_pooling=mean", "retrieval.contrastive_dropout=false")
    assert config.retrieval.contrastive_pooling == "mean"


@pytest.mark.slow
def test_frequency_contrastive_loss_trains_end_to_end(tmp_path):
    """The reported loss is next_item_loss + weight x frequency_contrastive, the contrastive part falls, and
    the model still learns the cyclic walks (chance: sampled HR@10 = 10/21)."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(data, *ON, "retrieval.contrastive_dropout=false", "retrieval.epochs=10")
    summary = loop.train(make_task(config), tmp_path / "run")
    steps = [r for r in records(tmp_path / "run") if "frequency_contrastive" in r]
    for r in steps:
        assert r["loss"] == pytest.approx(r["next_item_loss"] + 0.3 * r["frequency_contrastive"], rel=1e-5)
    first, last = (np.mean([r["frequency_contrastive"] for r in part]) for part in (steps[:3], steps[-3:]))
    assert last < first
    assert summary["test"]["sampled/HR@10"] > 0.8, summary["test"]
