"""Retrieval metrics against hand-computed examples and a numpy brute force."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from gem_jax.train import retrieval_metrics as rm

INF = float("inf")
NAN = float("nan")


def test_target_rank_by_hand():
    scores = jnp.array(
        [
            [0.1, 0.5, 0.3, 0.9],  # target 0.5 (col 1): only 0.9 is higher -> 1
            [0.1, 0.5, 0.3, 0.5],  # target 0.5 (col 1) ties col 3: pessimistic -> 1
            [0.7, 0.7, 0.7, 0.7],  # constant scores: worst rank, 3
            [0.2, -INF, 0.1, 0.0],  # target 0.1 (col 2); the masked -inf does not count -> 1
            [0.2, NAN, 0.1, 0.0],  # NaN candidate counts against the target -> 2
            [NAN, 0.3, 0.1, 0.0],  # NaN target ranks last -> 3
            [-INF, -INF, 0.4, -INF],  # target -inf (col 0) ties every -inf and loses to 0.4 -> 3
        ]
    )
    target = jnp.array([1, 1, 2, 2, 2, 0, 0])
    ranks = rm.target_rank(scores, target)
    assert ranks.dtype == jnp.int32
    np.testing.assert_array_equal(ranks, [1, 1, 3, 1, 2, 3, 3])


def test_target_rank_shape_error():
    # The function's own check (what a caller without shape checking gets) ...
    unchecked = inspect.unwrap(rm.target_rank)  # under jax.jit and the shape checker
    with pytest.raises(ValueError, match=r"expected \[B, N\], \[B\]"):
        unchecked(jnp.zeros((2, 3)), jnp.zeros((3,), jnp.int32))
    # ... and the annotation's, which the suite's runtime shape checking applies first.
    with pytest.raises(TypeCheckError, match="target_index"):
        rm.target_rank(jnp.zeros((2, 3)), jnp.zeros((3,), jnp.int32))


def test_hr_ndcg_by_hand():
    ranks = jnp.array([0, 1, 4, 9, 10, 25])
    # 1 / log2(rank + 2) for ranks 0, 1, 4, 9, 10: 1, 0.6309298, 0.3868528, 0.2890648, 0.2789429
    g0, g1, g4, g9, g10 = 1.0, 0.6309298, 0.3868528, 0.2890648, 0.2789429
    expected = {
        "HR@5": 3 / 6,  # ranks 0, 1, 4
        "HR@10": 4 / 6,  # + 9
        "HR@20": 5 / 6,  # + 10; 25 misses everything
        "NDCG@5": (g0 + g1 + g4) / 6,
        "NDCG@10": (g0 + g1 + g4 + g9) / 6,
        "NDCG@20": (g0 + g1 + g4 + g9 + g10) / 6,
    }
    got = rm.hr_ndcg(ranks)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert float(got[name]) == pytest.approx(value, rel=1e-6), name


def test_hr_ndcg_valid_mask_and_custom_ks():
    # Rows 1 and 3 are padding: only ranks 2 and 0 count. NDCG@3 = (1/log2(4) + 1) / 2 = 0.75.
    valid = jnp.array([True, False, True, False])
    got = rm.hr_ndcg(jnp.array([2, 0, 0, 7]), ks=(1, 3), valid=valid)
    assert float(got["HR@1"]) == pytest.approx(0.5)
    assert float(got["HR@3"]) == pytest.approx(1.0)
    assert float(got["NDCG@1"]) == pytest.approx(0.5)
    assert float(got["NDCG@3"]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="ks="):
        rm.hr_ndcg(jnp.array([0]), ks=(0,))


def test_sampled_ranks_by_hand():
    target = jnp.array([0.8, 0.2, 0.5])
    negatives = jnp.array(
        [
            [0.1, 0.9, 0.3],  # 0.9 beats 0.8 -> 1
            [0.1, 0.3, 0.4],  # 0.3, 0.4 beat 0.2 -> 2
            [0.5, 0.0, 0.1],  # a tie with 0.5, pessimistic -> 1
        ]
    )
    np.testing.assert_array_equal(rm.sampled_ranks(target, negatives), [1, 2, 1])


def test_sampled_ranks_from_vectors_by_hand():
    # Items 1..4 on a line; user vectors pick them by dot product.
    table = jnp.array([[9.0, 9.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.0, 1.0]])
    users = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    # User 0 scores items 1..4 as 1, 2, 3, 0. Target 2 vs negatives {1, 3}: 3 beats it -> 1.
    # User 1 scores them 0, 0, 0, 1. Target 4 vs negatives {1, 2}: nothing beats it -> 0.
    ranks = rm.sampled_ranks_from_vectors(users, table, jnp.array([2, 4]), jnp.array([[1, 3], [1, 2]]))
    np.testing.assert_array_equal(ranks, [1, 0])


def test_full_ranking_by_hand():
    # Row 0 (padding) has the highest score for everyone and must never count.
    table = jnp.array([[9.0, 9.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.0, 1.0]])
    users = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    # User 0 scores items 1..4: 1, 2, 3, 0. Target 1: items 2, 3 beat it -> 2.
    # User 1 scores 0, 0, 0, 1. Target 1: ties with items 2, 3 and loses to 4 -> 3.
    # User 2 as user 0 with target 3 -> 0.
    targets = jnp.array([1, 1, 3])
    np.testing.assert_array_equal(rm.full_ranking_ranks(users, table, targets), [2, 3, 0])
    # Excluding training items: user 0 drops 3 -> rank 1; user 1 drops 4 and lists the target 1
    # itself, which stays a candidate -> 2; user 2 excludes nothing (0 is the pad) -> 0.
    exclude = jnp.array([[3, 0], [4, 1], [0, 0]])
    np.testing.assert_array_equal(
        rm.full_ranking_ranks(users, table, targets, exclude=exclude, chunk_size=2), [1, 2, 0]
    )


def brute_force_ranks(users, table, targets, exclude):
    scores = users.astype(np.float64) @ table.astype(np.float64).T
    ranks = []
    for b, t in enumerate(targets):
        masked = np.zeros(len(table), bool)
        masked[0] = True
        masked[exclude[b]] = True
        masked[t] = False
        ranks.append(int(np.sum(scores[b][~masked] >= scores[b, t])) - 1)
    return np.array(ranks)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
def test_full_ranking_matches_brute_force(chunk_size):
    rng = np.random.default_rng(chunk_size)
    num_users, num_items, dim = 23, 50, 8
    users = rng.normal(size=(num_users, dim)).astype(np.float32)
    table = rng.normal(size=(num_items + 1, dim)).astype(np.float32)
    targets = rng.integers(1, num_items + 1, num_users)
    exclude = rng.integers(0, num_items + 1, (num_users, 6))
    exclude[:, 0] = targets  # the target listed among training items must stay a candidate
    for ex in (None, exclude):
        got = rm.full_ranking_ranks(
            jnp.asarray(users),
            jnp.asarray(table),
            jnp.asarray(targets),
            exclude=None if ex is None else jnp.asarray(ex),
            chunk_size=chunk_size,
        )
        no_exclusion = np.zeros((num_users, 1), int)
        want = brute_force_ranks(users, table, targets, no_exclusion if ex is None else ex)
        np.testing.assert_array_equal(got, want)


def test_both_protocols_share_the_tie_rule():
    # All-equal scores: both protocols give the worst rank, not 0.
    table = jnp.ones((11, 4))
    users = jnp.ones((2, 4))
    targets = jnp.array([3, 7])
    np.testing.assert_array_equal(rm.full_ranking_ranks(users, table, targets), [9, 9])
    negatives = jnp.array([[1, 2, 4, 5], [1, 2, 3, 4]])
    sampled = rm.sampled_ranks_from_vectors(users, table, targets, negatives)
    np.testing.assert_array_equal(sampled, [4, 4])


def test_accumulator_is_exact_over_uneven_batches():
    # Batch means would give (1 + 0) / 2 = 0.5 for HR@1; per-example it is 1 / 4.
    acc = rm.RetrievalAccumulator(ks=(1, 10))
    acc.update(jnp.array([0]))
    acc.update(jnp.array([3, 12, 5, 99]), valid=jnp.array([True, True, True, False]))
    got = acc.compute()
    assert acc.count == 4
    assert got["HR@1"] == pytest.approx(1 / 4)
    assert got["HR@10"] == pytest.approx(3 / 4)  # ranks 0, 3, 5
    assert got["NDCG@10"] == pytest.approx((1 + 1 / math.log2(5) + 1 / math.log2(7)) / 4)
    # The same examples in one batch give the same numbers.
    once = rm.RetrievalAccumulator(ks=(1, 10))
    once.update(jnp.array([0, 3, 12, 5]))
    for name, value in got.items():
        assert once.compute()[name] == pytest.approx(value, rel=1e-12)
    acc.reset()
    with pytest.raises(ValueError, match="count=0"):
        acc.compute()


def test_metrics_run_under_jit_in_an_eval_step():
    # The helpers compose inside a caller's jitted eval step.
    @jax.jit
    def step(users, table, targets):
        return rm.hr_ndcg(rm.full_ranking_ranks(users, table, targets, chunk_size=2), ks=(1,))

    table = jnp.array([[0.0], [1.0], [2.0], [3.0]])
    got = step(jnp.array([[1.0], [1.0], [-1.0]]), table, jnp.array([3, 1, 1]))
    # Ranks: 0 (3 is best), 2, 0 (for a negative user item 1 is best) -> HR@1 = 2/3.
    assert float(got["HR@1"]) == pytest.approx(2 / 3)
