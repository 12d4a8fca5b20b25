"""The contrastive auxiliary loss: the augmentations keep what they promise, the views sit where the
loss looks for them, InfoNCE against a direct numpy computation, and end-to-end training with it."""

from __future__ import annotations

import numpy as np
import pytest

from gem_jax.data.augment import MASK_ITEM, Augmentation
from gem_jax.data.next_item import NextItemEpochs, load_next_item_data
from gem_jax.model.next_item import info_nce_loss
from gem_jax.tasks import make_task
from gem_jax.train import loop
from tests.test_retrieval import records, small, write_cyclic_pairs

AUG = Augmentation(crop_keep=0.6, mask_fraction=0.3, reorder_fraction=0.5)


def _is_run_of(part: np.ndarray, whole: np.ndarray) -> bool:
    k = len(part)
    return any(np.array_equal(whole[i : i + k], part) for i in range(len(whole) - k + 1))


@pytest.mark.parametrize("n", [1, 2, 5, 13])
def test_augmentations_keep_what_they_promise(n):
    rng = np.random.default_rng(n)
    seq = np.arange(1, n + 1) * 7
    for _ in range(20):
        crop = AUG.crop(seq, rng)
        assert len(crop) == max(1, int(0.6 * n)) and _is_run_of(crop, seq)
        mask = AUG.mask(seq, rng)
        hidden = mask == MASK_ITEM
        assert len(mask) == n and hidden.sum() == int(0.3 * n)
        np.testing.assert_array_equal(mask[~hidden], seq[~hidden])
        reorder = AUG.reorder(seq, rng)
        assert sorted(reorder) == sorted(seq)
        moved = np.flatnonzero(reorder != seq)
        if len(moved):  # only inside one run of int(0.5 n) positions
            assert moved[-1] - moved[0] < int(0.5 * n)
    np.testing.assert_array_equal(seq, np.arange(1, n + 1) * 7)  # the input is never written


def test_views_sit_at_b_and_capacity_plus_b(tmp_path):
    data_path = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(data_path, "retrieval.contrastive_weight=0.5", "retrieval.augment_mask_fraction=0")
    data = load_next_item_data(config)
    pack = NextItemEpochs(data, config, shards=1).epoch_packs(0)[0]
    cap = pack.num_examples_capacity
    lengths, view_lengths = np.diff(pack.offsets), np.diff(pack.views.offsets)
    assert pack.views.offsets.shape == (2 * cap + 1,)
    for b in range(cap):
        items = pack.item_ids[pack.offsets[b] : pack.offsets[b + 1]]
        for v in (b, cap + b):
            view = pack.views.item_ids[pack.views.offsets[v] : pack.views.offsets[v + 1]]
            assert len(view) == 0 if lengths[b] == 0 else set(view) <= set(items)  # crop or reorder
    assert (view_lengths[:cap] > 0).sum() == (view_lengths[cap:] > 0).sum() == (lengths > 0).sum()
    # Off (the default), packs carry no views.
    assert NextItemEpochs(data, small(data_path), shards=1).epoch_packs(0)[0].views is None


def _numpy_info_nce(z1, z2, valid, temperature):
    z = np.concatenate([z1[valid], z2[valid]]).astype(np.float64)
    n = int(valid.sum())
    total = 0.0
    for i in range(2 * n):
        logits = z @ z[i] / temperature
        others = np.delete(logits, i)
        positive = logits[(i + n) % (2 * n)]
        total += np.log(np.exp(others).sum()) - positive
    return total, 2 * n


def test_info_nce_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    z1, z2 = rng.normal(size=(2, 6, 4)).astype(np.float32)
    valid = np.array([True, True, False, True, True, False])
    total, count = info_nce_loss(z1, z2, valid, 0.5)
    want_total, want_count = _numpy_info_nce(z1, z2, valid, 0.5)
    np.testing.assert_allclose(total, want_total, rtol=1e-5)
    assert count == want_count


@pytest.mark.slow
def test_contrastive_loss_trains_end_to_end(tmp_path):
    """The reported loss is next_item_loss + weight * contrastive, the contrastive part falls, and the
    model still learns the cyclic walks (chance: sampled HR@10 = 10/21)."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data, "retrieval.contrastive_weight=0.5", "retrieval.loss=full_softmax", "retrieval.epochs=10"
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    steps = [r for r in records(tmp_path / "run") if "contrastive" in r]
    for r in steps:
        assert r["loss"] == pytest.approx(r["next_item_loss"] + 0.5 * r["contrastive"], rel=1e-5)
    assert np.mean([r["contrastive"] for r in steps[-3:]]) < np.mean([r["contrastive"] for r in steps[:3]])
    assert summary["test"]["sampled/HR@10"] > 0.8, summary["test"]
