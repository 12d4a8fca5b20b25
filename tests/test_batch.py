"""Jagged batch invariants on packs from the real pipeline, and the pipeline's determinism/resume."""

import jax
import numpy as np
import pytest

from gem_jax.data.batch import check_pack, pack_examples
from gem_jax.data.pipeline import example_range, packed_dataset
from gem_jax.data.synthetic import SyntheticAds
from tests.helpers import small_config, stacks


def test_packs_hold_invariants_and_capacity():
    c = small_config("data.empty_history_fraction=0.3")
    it = stacks(c, shards=2)
    empty_seen = 0
    for _ in range(10):
        s = next(it)
        assert s.item_ids.shape == (2, c.data.tokens_per_shard)
        assert s.offsets.shape == (2, c.data.examples_per_shard + 1)
        for i in range(2):
            pack = jax.tree.map(lambda x: x[i], s)
            check_pack(pack)
            lengths = np.diff(pack.offsets)
            valid = pack.num_targets > 0
            # Every real example: prefix + history + candidates; an empty history is just prefix + targets.
            prefix = c.model.num_context_tokens
            assert np.all(lengths[valid] >= prefix + c.data.num_candidates)
            empty_seen += int(np.sum(lengths[valid] == prefix + c.data.num_candidates))
            # Candidates sit at the end of each sequence with action id 0.
            ends = pack.offsets[1:][valid]
            assert np.all(pack.action_ids[ends - 1] == 0) and np.all(pack.item_ids[ends - 1] > 0)
    assert empty_seen > 0, "empty histories must occur"


def test_history_lengths_are_heavy_tailed():
    c = small_config("data.max_history_len=1000", "data.history_len_mean=20", "data.tokens_per_shard=2048")
    gen = SyntheticAds(c.data, 2)
    lengths = np.array([len(gen.example(i)["item_ids"]) - 1 for i in range(2000)])
    assert np.mean(lengths) > 1.3 * np.median(lengths), "log-normal: mean well above median"
    ids = np.concatenate([gen.example(i)["item_ids"] for i in range(300)])
    top = np.bincount(ids).max() / len(ids)
    assert top > 0.02, f"Zipf ids: the most popular item should be frequent, got {top:.3f}"


def test_pack_rejects_overflow():
    c = small_config()
    gen = SyntheticAds(c.data, 2)
    ex = [gen.example(i) for i in range(3)]
    with pytest.raises(ValueError, match="token capacity"):
        pack_examples(
            ex, examples_capacity=8, tokens_capacity=4, num_sparse_features=2, max_bag_size=4, prefix=2
        )
    with pytest.raises(ValueError, match="example capacity"):
        pack_examples(
            ex, examples_capacity=2, tokens_capacity=1000, num_sparse_features=2, max_bag_size=4, prefix=2
        )


def test_pipeline_is_deterministic_and_resumable():
    c = small_config()
    a, b = stacks(c, 2), stacks(c, 2)
    for _ in range(3):
        np.testing.assert_array_equal(next(a).item_ids, next(b).item_ids)
    state = a.get_state()
    expected = [next(a) for _ in range(3)]
    b.set_state(state)
    for e in expected:
        got = next(b)
        np.testing.assert_array_equal(e.item_ids, got.item_ids)
        np.testing.assert_array_equal(e.offsets, got.offsets)
        np.testing.assert_array_equal(e.labels, got.labels)


def test_processes_see_disjoint_examples():
    c = small_config()
    gen = SyntheticAds(c.data, 2)
    kw = dict(
        examples_capacity=8,
        tokens_capacity=256,
        num_sparse_features=2,
        max_bag_size=4,
        prefix=2,
        shards=2,
        process_count=2,
    )
    seen = []
    for p in range(2):
        stamps = set()
        for s in packed_dataset(example_range(gen.example, 0, 40), process_index=p, **kw):
            o = s.offsets[0]
            for b in range(len(o) - 1):
                if o[b + 1] > o[b]:
                    stamps.add(tuple(s.item_ids[0, o[b] : o[b + 1]]))
        seen.append(stamps)
    assert seen[0] and seen[1] and not (seen[0] & seen[1])
    assert len(seen[0]) + len(seen[1]) == 40


def test_global_batch_does_not_depend_on_process_count():
    """Process p's stack is block p of the one-process stack, step after step, so a run gives the
    same batches on 1, 2 or 4 processes; a position saved by 2 processes restores in 1."""
    c = small_config()
    gen = SyntheticAds(c.data, 2)
    kw = dict(
        examples_capacity=8,
        tokens_capacity=256,
        num_sparse_features=2,
        max_bag_size=4,
        prefix=2,
        shards=4,
    )
    endless = example_range(gen.example, 0, None)
    whole = iter(packed_dataset(endless, process_index=0, process_count=1, **kw))
    parts = [iter(packed_dataset(endless, process_index=p, process_count=2, **kw)) for p in range(2)]
    for _ in range(3):
        expected = next(whole)
        got = [next(it) for it in parts]
        joined = jax.tree.map(lambda *xs: np.concatenate(xs), *got)
        jax.tree.map(np.testing.assert_array_equal, joined, expected)
        assert (expected.offsets[:, -1] > 0).all()
    merged = {"shards": {**parts[0].get_state()["shards"], **parts[1].get_state()["shards"]}, "num_shards": 4}
    assert merged == whole.get_state()
    # Each process's own position (its 2 of the 4 shards) resumes that process (the same count of
    # processes: a checkpoint's own file); without `num_shards` (older checkpoints) too. It was once
    # taken for a position of a 2-shard run and resharded, skipping examples.
    own = [it.get_state() for it in parts]
    legacy = [{"shards": o["shards"]} for o in own]
    expected = next(whole)
    for states in (own, legacy):
        again = [iter(packed_dataset(endless, process_index=p, process_count=2, **kw)) for p in range(2)]
        for it, state in zip(again, states, strict=True):
            it.set_state(state)
        joined = jax.tree.map(lambda *xs: np.concatenate(xs), *[next(it) for it in again])
        jax.tree.map(np.testing.assert_array_equal, joined, expected)
    resumed = iter(packed_dataset(endless, process_index=0, process_count=1, **kw))
    resumed.set_state(merged)
    np.testing.assert_array_equal(next(resumed).item_ids, expected.item_ids)


def test_position_saved_with_4_shards_resumes_with_8_without_rereading():
    """A run resumed on another mesh (8 batch shards instead of 4) reads no example twice."""
    c = small_config("data.empty_history_fraction=0")
    gen = SyntheticAds(c.data, 2)
    endless = example_range(gen.example, 0, None)
    kw = dict(examples_capacity=4, tokens_capacity=256, num_sparse_features=2)
    kw.update(max_bag_size=4, prefix=2, process_index=0, process_count=1)

    def histories(stack):
        return {
            tuple(stack.item_ids[p, o[b] : o[b + 1]])
            for p, o in enumerate(stack.offsets)
            for b in range(len(o) - 1)
            if o[b + 1] > o[b]
        }

    four = iter(packed_dataset(endless, shards=4, **kw))
    seen = set().union(*(histories(next(four)) for _ in range(3)))
    eight = iter(packed_dataset(endless, shards=8, **kw))
    eight.set_state(four.get_state())
    later = set().union(*(histories(next(eight)) for _ in range(3)))
    assert len(seen) > 20 and len(later) > 40 and not seen & later
