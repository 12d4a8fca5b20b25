"""The synthetic ads task's statistics: the block-at-a-time generator draws the task the module docstring
describes (each bound below was met by the per-example generator it replaced, and fails when a user's
history or actions are drawn with another user's taste), deterministically and thread-safely."""

import pickle
import threading

import numpy as np
import pytest

from gem_jax.config import load_config
from gem_jax.data.synthetic import (
    BLOCK,
    HASHED_STREAM_VERSION,
    HEAD_ITEMS,
    STREAM_VERSION,
    TABLE_ITEMS,
    SyntheticAds,
    stream_version,
)
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


# ----------------------------------------------------------------------------- past TABLE_ITEMS items

HUGE = 125_829_119  # the 60 GiB offloaded item table's id space (scripts/device/offload_curve.sh)


def _data(num_items: int, *more: str):
    return load_config("configs/gem_h200.toml", [f"data.num_items={num_items}", *more]).data


def test_a_large_item_space_costs_no_memory_per_item():
    """Each grain worker gets the generator pickled: with tables over every item that was 40 bytes per item
    (5 GB a worker at 126 M items: 12 workers ran the H200 host out of memory before the first batch)."""
    sizes = {}
    for n in (TABLE_ITEMS + 1, HUGE):  # the first already failed the bound with tables (160 MB)
        gen = SyntheticAds(_data(n), 2)
        sizes[n] = len(pickle.dumps(gen))
        assert sizes[n] < 16 * 2**20, f"{n} items: the generator pickles to {sizes[n] / 2**20:.0f} MiB"
    assert sizes[HUGE] == sizes[TABLE_ITEMS + 1]
    # What a worker draws from its copy is what the trainer's would: every id of the space can come out.
    copy = pickle.loads(pickle.dumps(gen))
    a, b = gen.block(3), copy.block(3)
    for x, y in zip(a, b):
        for key in ("item_ids", "action_ids", "timestamps", "dense", "labels", "click_logit"):
            np.testing.assert_array_equal(x[key], y[key])
    ids = np.concatenate([e["item_ids"] for e in a])
    assert ids.min() >= 1 and ids.max() <= HUGE and (ids > HEAD_ITEMS).mean() > 0.05


@pytest.mark.parametrize("zipf", [1.1, 1.0, 0.8])
def test_past_the_tables_ids_follow_the_exact_zipf_law(zipf):
    """The sampler past TABLE_ITEMS (head table + the tail's integral inverted) gives the id that the
    exact inverse CDF of Zipf(s) over every item gives, for uniforms anywhere and in the tail."""
    n = TABLE_ITEMS + 12_345
    gen = SyntheticAds(_data(n, f"data.zipf_exponent={zipf}"), 2)
    p = np.arange(1, n + 1, dtype=np.float64) ** -zipf
    cdf = np.cumsum(p / p.sum())
    rng = np.random.default_rng(0)
    head = cdf[HEAD_ITEMS - 1]
    u = np.concatenate([rng.random(200_000), head + (1 - head) * rng.random(200_000)])
    exact = np.minimum(np.searchsorted(cdf, u) + 1, n)
    got = gen.zipf_ids(u)
    assert got.dtype == np.int32 and got.min() >= 1 and got.max() <= n
    assert (got > HEAD_ITEMS).sum() > 200_000  # the tail is exercised
    assert np.sum(got != exact) <= 2, np.flatnonzero(got != exact)[:10]  # floating point at a boundary


def test_past_the_tables_item_factors_keep_the_construction():
    """Hashed factors: unit norm, the same per id however they are asked for (the head table or the
    hash), seeded, and the category structure of the tables (items of a category share most of it)."""
    gen = SyntheticAds(_data(HUGE), 2)
    ids = np.array([1, 2, 17, HEAD_ITEMS, HEAD_ITEMS + 1, HUGE - 1, HUGE, 7 * HEAD_ITEMS])
    f = gen.factors(ids)
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(f, gen._hashed_factors(ids), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(gen.factors(ids[::-1]), f[::-1])
    np.testing.assert_array_equal(SyntheticAds(_data(HUGE), 2).factors(ids), f)
    assert not np.allclose(SyntheticAds(_data(HUGE, "data.seed=1"), 2).factors(ids), f)

    def cosines(g, ids):  # same-category pairs (ids 16c, 16c + 1), other-category pairs (16c, 16c + 16)
        a, same, other = g.factors(ids), g.factors(ids + 1), g.factors(ids + 16)
        return np.mean(np.sum(a * same, axis=1)), np.mean(np.abs(np.sum(a * other, axis=1)))

    table = SyntheticAds(_data(20_000), 2)  # tables: the reference
    rng = np.random.default_rng(0)
    want = cosines(table, 16 * rng.integers(1, 20_000 // 16 - 2, 1000))
    got = cosines(gen, 16 * rng.integers(HEAD_ITEMS // 16, HUGE // 16 - 2, 1000))
    np.testing.assert_allclose(got, want, atol=0.03)


def test_the_stream_version_says_which_world():
    assert stream_version(load_config("configs/tiny.toml").data) == STREAM_VERSION
    assert stream_version(_data(TABLE_ITEMS)) == STREAM_VERSION
    assert stream_version(_data(TABLE_ITEMS + 1)) == HASHED_STREAM_VERSION != STREAM_VERSION
