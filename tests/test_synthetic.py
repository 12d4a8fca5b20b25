"""The synthetic ads task's statistics: the block-at-a-time generator draws the task the module docstring
describes (each bound below was met by the per-example generator it replaced, and fails when a user's
history or actions are drawn with another user's taste), deterministically and thread-safely."""

import threading

import numpy as np
import pytest

from gem_jax.config import load_config
from gem_jax.data.synthetic import BLOCK, SyntheticAds
from gem_jax.train.metrics import auc


@pytest.fixture(scope="module")
def tiny():
    """The tiny config's generator and 8,192 of its examples (two ranges, as train and eval use)."""
    gen = SyntheticAds(load_config("configs/tiny.toml").data, num_tasks=2)
    return gen, [gen.example(i) for i in range(4096)] + [gen.example(10**12 + i) for i in range(4096)]


def test_history_lengths_ids_and_labels_follow_the_task(tiny):
    gen, examples = tiny
    c = gen.config
    history = np.array([len(e["item_ids"]) - e["num_targets"] for e in examples])
    assert 0.04 < np.mean(history == 0) < 0.062  # empty_history_fraction 0.05
    kept = history[history > 0]
    # log-normal, median history_len_mean 30 and sigma 1, cut at 96: P(cut) = P(Z > log(95.5 / 30)) = 0.12
    assert 28 <= np.median(kept) <= 32 and 8 <= np.quantile(kept, 0.1) <= 10
    assert 0.11 < np.mean(kept == c.max_history_len) < 0.14 and kept.max() == c.max_history_len
    # Zipf(1.1) over 2,000 items: item 1 is 16.4% of draws
    candidates = np.array([e["item_ids"][-1] for e in examples])
    items = np.concatenate([e["item_ids"][:-1] for e in examples])
    assert 0.15 < np.mean(candidates == 1) < 0.18 and 0.14 < np.mean(items == 1) < 0.17
    clicks = np.array([e["labels"][0, 0] for e in examples])
    conversions = np.array([e["labels"][0, 1] for e in examples])
    assert 0.41 < clicks.mean() < 0.455 and 0.24 < conversions.mean() < 0.285
    assert not np.any(conversions > clicks)
    assert 0.86 < auc(clicks, np.array([e["click_logit"][0] for e in examples])) < 0.89  # the planted oracle


def test_histories_and_actions_reveal_the_users_taste(tiny):
    """The signal a model learns: a user's history items lie near the items the user clicks (AUC of the
    history's mean factor . candidate factor: 0.65-0.67; 0.50 for histories drawn with another user's
    taste), and deeper actions go with stronger affinity (view share 0.24-0.25; 0.51 for another's)."""
    gen, examples = tiny
    f = gen.item_factors
    with_history = [e for e in examples if len(e["item_ids"]) > 1]
    score = np.array([f[e["item_ids"][:-1]].mean(0) @ f[e["item_ids"][-1]] for e in with_history])
    clicks = np.array([e["labels"][0, 0] for e in with_history])
    assert 0.64 < auc(clicks, score) < 0.69
    actions = np.concatenate([e["action_ids"][:-1] for e in examples])
    share = np.bincount(actions, minlength=gen.config.num_actions + 1)[1:] / len(actions)
    np.testing.assert_allclose(share, [0.245, 0.292, 0.297, 0.166], atol=0.012)


def test_times_bags_and_dense_features(tiny):
    gen, examples = tiny
    c = gen.config
    gaps = np.concatenate(
        [np.diff(e["timestamps"][: len(e["item_ids"]) - e["num_targets"] + 1]) for e in examples]
    )
    assert gaps.min() >= 1 and 3540 < gaps.mean() < 3660  # exponential(3600 s) gaps, at least 1 s
    for e in examples[:500]:
        assert e["action_ids"][-1] == 0 and e["timestamps"][-1] >= e["timestamps"][0]
        segment, category, noise = e["sparse_ids"]
        assert 1 <= segment[0] <= 16 and 1 <= len(segment) <= c.max_bag_size
        assert category[0] == 17 + e["item_ids"][-1] // 16
        assert 1 <= len(noise) <= c.max_bag_size and np.all((noise >= 1) & (noise < c.sparse_vocab))
    dense = np.stack([e["dense"] for e in examples])
    assert np.all(np.abs(dense.mean(0)) < 0.05) and np.all(np.abs(dense.std(0) - 1) < 0.05)


def test_examples_depend_only_on_seed_and_index():
    c = load_config("configs/tiny.toml").data
    a, b = SyntheticAds(c, 2), SyntheticAds(c, 2)
    indices = [5, 3 * BLOCK + 1, 10**12 + 7, 0, 3 * BLOCK + 1]
    forward = [a.example(i) for i in indices]
    # Another generator, the indices from many threads at once and in another order: the same examples.
    got = {}
    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, b.example(i))) for i in indices[::-1] * 4
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, e in zip(indices, forward):
        for key in ("item_ids", "action_ids", "timestamps", "dense", "labels"):
            np.testing.assert_array_equal(got[i][key], e[key])
    other_seed = SyntheticAds(load_config("configs/tiny.toml", ["data.seed=1"]).data, 2)
    assert not np.array_equal(other_seed.example(5)["dense"], forward[0]["dense"])
    assert not np.array_equal(a.example(BLOCK + 5)["dense"], forward[0]["dense"])  # blocks differ
