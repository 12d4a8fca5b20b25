"""The analytic FLOP count against hand-computed values."""

import numpy as np

from gem_jax.train.flops import train_step_flops
from tests.helpers import small_config


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
