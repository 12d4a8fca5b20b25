"""ICLRec's intent contrastive loss and the contrastive options (docs/results.md): k-means finds planted
clusters, the de-noised InfoNCE against a direct computation, mean pooling, the centroids are computed
at epoch starts only (and a resumed run recomputes the same ones), the loss wiring, and the new keys'
validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.config import ConfigError
from gem_jax.data.next_item import EvalSet, eval_stacks
from gem_jax.model.next_item import info_nce_loss, kmeans, nearest_centroid, pool_examples
from gem_jax.tasks import make_task
from gem_jax.train import loop
from gem_jax.train.step import Trainer
from tests.test_retrieval import _final_params, records, small, write_cyclic_pairs

INTENT = (
    "retrieval.intent_weight=0.5",
    "retrieval.intent_clusters=4",
    "retrieval.loss=full_softmax",
    "retrieval.contrastive_pooling=mean",
)


def test_kmeans_finds_planted_clusters():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(5, 8)) * 10
    labels = rng.integers(0, 5, size=400)
    x = (centres[labels] + rng.normal(size=(400, 8)) * 0.3).astype(np.float32)
    # Several draws of the first centroids: Lloyd's iterations must land on the planted partition from
    # most of them (k-means from a bad start may merge two blobs; ICLRec's faiss redoes 5 times).
    found = 0
    for seed in range(4):
        centroids = kmeans(jnp.asarray(x), 5, 20, jax.random.key(seed))
        assign = np.asarray(nearest_centroid(jnp.asarray(x), centroids))
        # A bijection between planted labels and clusters.
        pairs = set(zip(labels.tolist(), assign.tolist()))
        if len(pairs) == 5 and len({a for _, a in pairs}) == 5:
            found += 1
            for c in range(5):
                np.testing.assert_allclose(
                    np.asarray(centroids)[assign[labels == c][0]],
                    x[labels == c].mean(0),
                    rtol=1e-4,
                    atol=1e-4,
                )
    assert found >= 3


def test_nearest_centroid_is_the_argmin_distance():
    rng = np.random.default_rng(1)
    x, c = rng.normal(size=(50, 6)).astype(np.float32), rng.normal(size=(7, 6)).astype(np.float32)
    want = np.argmin(((x[:, None] - c[None]) ** 2).sum(-1), axis=1)
    np.testing.assert_array_equal(np.asarray(nearest_centroid(jnp.asarray(x), jnp.asarray(c))), want)


def _numpy_grouped_info_nce(z1, z2, valid, temperature, groups):
    """ICLRec's NCELoss with intent_ids (de-noising), rows of invalid examples left out."""
    keep = np.flatnonzero(valid)
    z1, z2, g = z1[keep].astype(np.float64), z2[keep].astype(np.float64), groups[keep]
    n = len(keep)
    same = g[:, None] == g[None, :]
    s11, s22, s12 = z1 @ z1.T / temperature, z2 @ z2.T / temperature, z1 @ z2.T / temperature
    s11[same], s22[same] = -np.inf, -np.inf
    s12 = np.where(same & ~np.eye(n, dtype=bool), -np.inf, s12)
    logits = np.concatenate([np.concatenate([s12, s11], 1), np.concatenate([s22, s12.T], 1)], 0)
    lse = np.log(np.exp(logits).sum(1))
    return (lse - logits[np.arange(2 * n), np.arange(2 * n)]).sum(), 2 * n


def test_denoised_info_nce_matches_iclrec():
    rng = np.random.default_rng(2)
    z1, z2 = rng.normal(size=(2, 8, 4)).astype(np.float32)
    valid = np.array([True, True, False, True, True, True, False, True])
    groups = np.array([0, 1, 0, 0, 2, 1, 3, 2], np.int32)
    total, count = info_nce_loss(z1, z2, valid, 0.5, jnp.asarray(groups))
    want_total, want_count = _numpy_grouped_info_nce(z1, z2, valid, 0.5, groups)
    np.testing.assert_allclose(total, want_total, rtol=1e-5)
    assert count == want_count
    # Distinct groups: the plain loss.
    plain = info_nce_loss(z1, z2, valid, 0.5)
    np.testing.assert_allclose(info_nce_loss(z1, z2, valid, 0.5, jnp.arange(8))[0], plain[0], rtol=1e-6)


def test_pooling_last_and_mean():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(10, 3)).astype(np.float32))
    offsets = jnp.asarray([0, 3, 3, 7, 7])  # examples of 3, 0 and 4 tokens; tokens 7..9 padding
    last = np.asarray(pool_examples(x, offsets, "last", normalize=False))
    np.testing.assert_array_equal(last[[0, 2]], np.asarray(x)[[2, 6]])
    mean = np.asarray(pool_examples(x, offsets, "mean", normalize=False))
    np.testing.assert_allclose(mean[0], np.asarray(x)[:3].mean(0), rtol=1e-6)
    np.testing.assert_allclose(mean[2], np.asarray(x)[3:7].mean(0), rtol=1e-6)
    assert not mean[1].any() and not mean[3].any()  # empty examples: zeros
    unit = np.asarray(pool_examples(x, offsets, "mean", normalize=True))
    np.testing.assert_allclose(np.linalg.norm(unit[[0, 2]], axis=1), 1.0, rtol=1e-6)


def test_off_by_default_the_model_and_packs_are_as_before(tmp_path):
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    off = make_task(small(data, "retrieval.contrastive_weight=0.5"))
    assert off.build_model().intent_centroids is None  # no new parameter
    on = make_task(small(data, *INTENT))
    assert on.build_model().intent_centroids[...].shape == (4, 16)
    # The intent loss alone still brings the views (CL4SRec's augmentations) into the packs.
    pack = on._epochs.epoch_packs(0)[0]
    assert pack.views is not None


@pytest.mark.slow
def test_centroids_are_refreshed_at_epoch_starts_only(tmp_path):
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(data, *INTENT, "retrieval.intent_every_epochs=2", "retrieval.epochs=6")
    task = make_task(config)
    trainer = Trainer(task, task.mesh)
    state = trainer.init_state()
    per_epoch = task.total_steps() // 6
    assert not np.asarray(state.params["intent_centroids"]).any()
    fresh = task.refresh(trainer, state, 0)
    centroids = np.asarray(fresh.params["intent_centroids"])
    assert np.isfinite(centroids).all() and len(np.unique(centroids.round(5), axis=0)) == 4
    # The same state gives the same centroids (a resumed run recomputes what the first one did).
    np.testing.assert_array_equal(
        np.asarray(task.refresh(trainer, state, 0).params["intent_centroids"]), centroids
    )
    # Mid-epoch, and at the end of epoch 1 (every 2 epochs): untouched; at the end of epoch 2: recomputed.
    for step in (1, per_epoch):
        assert task.refresh(trainer, fresh, step) is fresh
    assert task.refresh(trainer, fresh, 2 * per_epoch) is not fresh
    # Every centroid is the mean of the encoded examples nearest to it (a k-means fixed point, within
    # the 20 iterations on 48 points).
    encoded = np.concatenate(
        [
            np.asarray(task._encode(state, trainer.to_device(stack)))[0, : b - a]
            for stack, [(a, b)] in eval_stacks(
                EvalSet(task.data.inputs, np.zeros(0), np.zeros((0, 0)), None), config, shards=1
            )
        ]
    )
    assign = np.asarray(nearest_centroid(jnp.asarray(encoded), jnp.asarray(centroids)))
    for c in np.unique(assign):
        np.testing.assert_allclose(centroids[c], encoded[assign == c].mean(0), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_intent_loss_trains_and_adds_up(tmp_path):
    """loss = next_item_loss + w_c contrastive + w_i intent, both auxiliary terms fall, the model learns
    the cycles, and the centroids never move between refreshes (no gradient reaches them)."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data,
        *INTENT,
        "retrieval.contrastive_weight=0.3",
        "retrieval.contrastive_dropout=false",
        "retrieval.intent_denoise=true",
        "retrieval.epochs=10",
        "model.dropout=0.3",
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    steps = [r for r in records(tmp_path / "run") if "intent" in r]
    for r in steps:
        want = r["next_item_loss"] + 0.3 * r["contrastive"] + 0.5 * r["intent"]
        assert r["loss"] == pytest.approx(want, rel=1e-5)
    for name in ("intent", "contrastive"):
        assert np.mean([r[name] for r in steps[-3:]]) < np.mean([r[name] for r in steps[:3]]), name
    assert summary["test"]["sampled/HR@10"] > 0.8, summary["test"]


@pytest.mark.slow
def test_resume_with_intent_clustering_gives_identical_parameters(tmp_path):
    """Stopped mid-epoch (the checkpoint keeps the centroids) or at an epoch end (the next start
    recomputes them), a run ends with the parameters of one that never stopped."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(data, *INTENT, "retrieval.epochs=3", "retrieval.eval_every_epochs=3", "model.dropout=0.2")
    task = make_task(config)
    per_epoch = task.total_steps() // 3
    whole = loop.train(task, tmp_path / "whole")
    for name, stop in (("middle", per_epoch + 1), ("end", per_epoch)):
        loop.train(make_task(config), tmp_path / name, stop_after=stop)
        again = loop.train(make_task(config), tmp_path / name)
        assert again["step"] == whole["step"]
        for a, b in zip(_final_params(tmp_path / "whole", config), _final_params(tmp_path / name, config)):
            np.testing.assert_array_equal(a, b)


def test_new_keys_are_validated(tmp_path):
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    for override, words in (
        ("retrieval.intent_weight=-1", "retrieval.intent_weight"),
        ("retrieval.intent_clusters=1", "retrieval.intent_clusters"),
        ("retrieval.intent_every_epochs=0", "retrieval.intent_every_epochs"),
        ("retrieval.intent_kmeans_iterations=0", "retrieval.intent_kmeans_iterations"),
        ("retrieval.contrastive_pooling=first", "retrieval.contrastive_pooling"),
        # Options of losses that are off.
        ("retrieval.contrastive_pooling=mean", "retrieval.contrastive_pooling"),
        ("retrieval.contrastive_dropout=false", "retrieval.contrastive_dropout"),
    ):
        with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
            small(data, override)
    with pytest.raises(ConfigError, match=r"retrieval\.intent_denoise"):
        small(data, "retrieval.contrastive_weight=0.1", "retrieval.intent_denoise=true")
    # More clusters than training examples (48): refused when the data is read.
    with pytest.raises(ConfigError, match=r"retrieval\.intent_clusters"):
        make_task(small(data, "retrieval.intent_weight=0.1", "retrieval.intent_clusters=49"))
