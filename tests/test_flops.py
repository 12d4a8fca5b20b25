"""The analytic FLOP count against hand-computed values."""

import numpy as np

from gem_jax.tasks.ranking import RankingTask
from gem_jax.train.flops import nvidia_hstu_flops, train_step_flops, train_step_flops_by_group
from tests.helpers import small_config, stacks


def test_attention_term_follows_sum_of_squares():
    c = small_config("model.num_layers=1")
    offsets = np.array([0, 10, 10, 40], np.int32)  # lengths 10, 0, 30
    targets = np.array([1, 0, 1], np.int32)
    base = train_step_flops(c, offsets, targets)
    # Moving 5 tokens from the long to the short sequence keeps every GEMM term and changes only sum L^2.
    moved = train_step_flops(c, np.array([0, 15, 15, 40], np.int32), targets)
    h, dqk, dv = c.model.num_heads, c.model.attention_dim, c.model.value_dim
    per_pair = 3.5 * 2 * h * (dqk + dv) / 2
    np.testing.assert_allclose(base - moved, per_pair * ((10**2 + 30**2) - (15**2 + 25**2)), rtol=1e-9)


def test_long_history_counts_recent_part_and_blocks():
    c = small_config(
        "model.num_layers=1",
        "model.long_history=true",
        "model.recent_len=4",
        "model.block_size=8",
        "model.num_context_tokens=2",
    )
    plain = small_config("model.num_layers=1", "model.num_context_tokens=2")
    offsets = np.array([0, 103], np.int32)  # 2 context + 100 history + 1 target
    targets = np.array([1], np.int32)
    h, dqk, dv = c.model.num_heads, c.model.attention_dim, c.model.value_dim
    unit = 3.5 * 2 * h * (dqk + dv)
    delta = train_step_flops(plain, offsets, targets) - train_step_flops(c, offsets, targets)
    expected = unit * (103**2 / 2 - ((2 + 4 + 1) ** 2 / 2 + 103 * 8 / 2))
    np.testing.assert_allclose(delta, expected, rtol=1e-9)


def test_nvidia_count_by_hand():
    """NVIDIA's HSTU count (gem_jax/train/flops.py) for one sequence of T = 10 rows: C = 2 context,
    H = 7 history, K = 1 candidate; N = 2 heads of D = 4, model width W = 8, two layers."""
    c = small_config(
        "model.num_layers=2",
        "model.num_heads=2",
        "model.attention_dim=4",
        "model.value_dim=4",
        "model.model_dim=8",
        "model.num_context_tokens=2",
    )
    offsets = np.array([0, 10, 10], np.int32)  # the second example is padding
    targets = np.array([1, 0], np.int32)
    attention = 4 * 2 * 10 * (2 + 7) * 4 - 2 * 2 * 7**2 * 4 + 4 * 2 * 1 * 4  # 2128
    gemms = 2 * 10 * (4 * 2 * 4) * 8 + 2 * 10 * (2 * 4) * 8  # 6400
    elementwise = 2 * 10 * 2 * 4 + 10 * 2 * 8  # 320
    per_layer = 3.5 * attention + 3 * gemms + elementwise  # 26968
    assert nvidia_hstu_flops(c, offsets, targets) == 2 * per_layer == 53936


def test_nvidia_count_matches_their_published_step():
    """PERF_ANALYSIS.md (NVIDIA recsys-examples, examples/hstu/training/benchmark): 63.89 TFLOPs per GPU
    step for B = 32 sequences of T = 4099 (C = 3 context tokens, no candidates), 8 layers, 4 heads x 256,
    width 1024."""
    c = small_config(
        "model.num_layers=8",
        "model.num_heads=4",
        "model.attention_dim=256",
        "model.value_dim=256",
        "model.model_dim=1024",
        "model.num_context_tokens=3",
    )
    offsets = np.arange(33, dtype=np.int64) * 4099
    np.testing.assert_allclose(nvidia_hstu_flops(c, offsets, np.zeros(32)), 63.89e12, rtol=1e-3)
    # Our count of the same HSTU layers differs only in the causal attention's diagonal and context rows.
    ours = train_step_flops_by_group(c, offsets, np.zeros(32))
    hstu_ours = ours["gemm hstu"] + ours["attention fwd"] + ours["attention bwd"]
    np.testing.assert_allclose(hstu_ours, 63.89e12, rtol=1e-2)


def test_nvidia_count_only_where_its_formula_applies():
    """NVIDIA's count assumes full attention over every history; the long-history tower computes block
    attention over most of it (gem_long's mfu_nvidia read 314%). There it is not reported at all."""
    long = small_config(
        "model.num_layers=1", "model.long_history=true", "model.recent_len=4", "model.block_size=8"
    )
    offsets, targets = np.array([0, 103], np.int32), np.array([1], np.int32)
    assert nvidia_hstu_flops(long, offsets, targets) is None
    assert nvidia_hstu_flops(small_config("model.num_layers=1"), offsets, targets) > 0
    task = RankingTask.__new__(RankingTask)  # batch_counts reads only the config
    task.config = long
    stack = next(iter(stacks(long, shards=1)))
    assert set(task.batch_counts(stack)) == {"examples", "tokens", "flops"}  # no flops_nvidia: no mfu_nvidia
