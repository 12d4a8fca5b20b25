"""Runtime shape checking (gem_jax/typing.py): the suite runs with it on, and a wrong shape or
dtype at an annotated module boundary fails where it enters, naming the argument."""

import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from gem_jax.embeddings import segment_ids
from gem_jax.model.next_item import bce_loss, sampled_softmax_loss
from gem_jax.typing import shape_checking_requested


def test_the_suite_checks_shapes():
    assert shape_checking_requested(), "tests/conftest.py sets GEM_JAX_TYPECHECK=1"


def test_mismatched_dimension_fails_at_the_boundary():
    user = jnp.zeros((5, 4), jnp.float32)
    table = jnp.zeros((7, 3), jnp.float32)  # d = 3, but the user vectors have d = 4
    targets = jnp.ones((5,), jnp.int32)
    with pytest.raises(TypeCheckError, match="table"):
        bce_loss(user, table, targets, targets)
    # The same call with matching widths passes the check (and computes).
    total, count = bce_loss(user, jnp.zeros((7, 4), jnp.float32), targets, targets)
    assert int(count) == 5 and np.isfinite(float(total))


def test_wrong_rank_and_dtype_fail():
    with pytest.raises(TypeCheckError, match="offsets"):
        segment_ids(np.zeros((2, 3), np.int32), 8)  # offsets must be 1-D
    with pytest.raises(TypeCheckError, match="offsets"):
        segment_ids(np.zeros(3, np.float32), 8)  # and integer
    user = jnp.zeros((5, 4), jnp.float32)
    with pytest.raises(TypeCheckError, match="targets"):
        sampled_softmax_loss(
            user, jnp.zeros((7, 4)), jnp.ones((6,), jnp.int32), jnp.ones((3,), jnp.int32), 0.1
        )
