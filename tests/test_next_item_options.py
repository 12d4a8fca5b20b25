"""The next-item training options: full softmax (with label smoothing), dropout on
the attention weights, and the published baselines' "score history 0" full-ranking variant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gem_jax.config import ConfigError
from gem_jax.model.next_item import NextItemModel, full_softmax_loss, sampled_softmax_loss
from gem_jax.tasks import make_task
from gem_jax.train import loop
from gem_jax.train.retrieval_metrics import full_ranking_ranks
from pallas_kernels.jagged_attention.reference import jagged_attention_reference
from tests.test_retrieval import NUM_ITEMS, small, write_cyclic_pairs


def _case(seed=0, t=9, n=7, d=5):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    user = jax.random.normal(k1, (t, d))
    table = jax.random.normal(k2, (n + 1, d))
    targets = jax.random.randint(k3, (t,), 0, n + 1).at[0].set(0).at[1].set(n)  # a padding row, the last item
    return user, table, targets


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_full_softmax_matches_optax_cross_entropy(smoothing):
    user, table, targets = _case()
    n = table.shape[0] - 1
    total, count = full_softmax_loss(user, table, targets, 0.5, smoothing)
    logits = user @ table[1:].T / 0.5
    labels = optax.smooth_labels(jax.nn.one_hot(targets - 1, n), smoothing)
    per = optax.softmax_cross_entropy(logits, labels)
    mask = targets > 0
    np.testing.assert_allclose(total, jnp.sum(jnp.where(mask, per, 0.0)), rtol=1e-5)
    assert count == mask.sum()


def test_full_softmax_equals_sampled_softmax_over_every_item():
    """Sampled softmax whose negatives are all items (the target masked out) is the full softmax."""
    user, table, targets = _case(seed=1)
    every_item = jnp.arange(1, table.shape[0])
    full = full_softmax_loss(user, table, targets, 0.1)
    sampled = sampled_softmax_loss(user, table, targets, every_item, 0.1)
    np.testing.assert_allclose(full[0], sampled[0], rtol=1e-5)
    assert full[1] == sampled[1]


def test_zeroed_history_ranks_like_the_published_code():
    """ICLRec/ICSRec/BSARec set history scores to 0: a history item then outranks a target with a
    negative score (removal would not), and a repeated target scores 0 itself."""
    table = jnp.array([[0.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [-0.5, 0.0], [0.2, 0.0]])  # items 1..4
    user = jnp.array([[1.0, 0.0], [1.0, 0.0]])
    # user 0: target 3 (score -0.5), history {2 (score -1)}; items 1 (1.0) and 4 (0.2) outrank it either way.
    # user 1: target 1 (score 1.0) is also in the history: zeroed it falls behind item 4 (0.2) and ties
    # with the zeroed item 2 (ties count against the target).
    targets = jnp.array([3, 1])
    exclude = jnp.array([[2, 0], [1, 2]])
    removed = full_ranking_ranks(user, table, targets, exclude)
    zeroed = full_ranking_ranks(user, table, targets, exclude, zero_excluded=True)
    np.testing.assert_array_equal(removed, [2, 0])
    np.testing.assert_array_equal(zeroed, [3, 2])  # user 0: items 1, 4 and the zeroed item 2 are above -0.5


def _attention_case():
    t, h, d = 12, 2, 4
    k = jax.random.split(jax.random.key(3), 3)
    q, kk, v = (jax.random.normal(k[i], (t, h, d)) for i in range(3))
    return q, kk, v, jnp.array([0, 5, 12])


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_attention_weight_dropout_is_unbiased_and_random(activation):
    q, k, v, offsets = _attention_case()
    kw = {"max_seq_len": 8, "activation": activation}
    plain = jagged_attention_reference(q, k, v, offsets, **kw)
    zero_rate = jagged_attention_reference(
        q, k, v, offsets, **kw, weight_dropout=0.0, dropout_rng=jax.random.key(0)
    )
    np.testing.assert_array_equal(plain, zero_rate)

    def dropped(key):
        return jagged_attention_reference(q, k, v, offsets, **kw, weight_dropout=0.3, dropout_rng=key)

    draws = jax.vmap(dropped)(jax.random.split(jax.random.key(1), 4000))
    assert not np.allclose(draws[0], plain, atol=1e-3)  # one draw really drops weights
    assert not np.allclose(draws[0], draws[1], atol=1e-3)  # and the draws differ
    # Inverted dropout keeps the expectation: the mean of many draws is the plain output.
    np.testing.assert_allclose(draws.mean(0), plain, atol=0.06 * float(jnp.abs(plain).max()))
    with pytest.raises(ValueError, match="dropout_rng"):
        jagged_attention_reference(q, k, v, offsets, **kw, weight_dropout=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["model.layer=hstu", "model.layer=sasrec"])
def test_attention_dropout_changes_training_only(tmp_path, layer):
    """With `model.attention_dropout`, a training call (rng given) depends on the rng; evaluation
    (no rng) is deterministic and the same as the model without the option (same parameters)."""
    extra = ["model.num_position_buckets=0"] if "sasrec" in layer else []
    config = small(tmp_path / "x.txt", layer, "model.attention_dropout=0.5", *extra)
    plain = small(tmp_path / "x.txt", layer, *extra)
    ids = jnp.array([3, 4, 5, 6, 7, 8, 9, 0], jnp.int32)
    offsets = jnp.array([0, 3, 7], jnp.int32)
    model = NextItemModel(config, NUM_ITEMS, rngs=nnx.Rngs(0))
    baseline = NextItemModel(plain, NUM_ITEMS, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(ids, offsets), baseline(ids, offsets))
    a = model(ids, offsets, rng=jax.random.key(1))
    b = model(ids, offsets, rng=jax.random.key(2))
    assert not np.allclose(a[:7], b[:7], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("retrieval.loss=full_softmax", "retrieval.label_smoothing=0.1", "model.attention_dropout=0.2"),
        ("model.layer=sasrec", "model.num_position_buckets=0", "model.attention_dropout=0.3"),
    ],
)
def test_new_options_learn_the_cycles(tmp_path, overrides):
    """Through the real loop: full softmax with label smoothing, and weight dropout, learn; the zeroed
    full-ranking variant is reported next to the removed one."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data,
        "model.activation=silu",
        "retrieval.temperature=0.1",
        "retrieval.exclude_history=true",
        "retrieval.epochs=15",
        "retrieval.eval_every_epochs=15",
        *overrides,
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    test = summary["test"]
    assert test["sampled/HR@10"] > 0.8, test
    for k in (5, 10, 20):
        assert 0 < test[f"full_zeroed/HR@{k}"] <= 1 and 0 < test[f"full/HR@{k}"] <= 1, test


def test_option_errors(tmp_path):
    with pytest.raises(ConfigError, match="label_smoothing"):
        small(tmp_path / "x.txt", "retrieval.label_smoothing=0.1")  # sampled softmax
    with pytest.raises(ConfigError, match="model.attention_dropout"):
        small(tmp_path / "x.txt", "model.attention_dropout=1.0")
    with pytest.raises(ConfigError, match="model.attention_dropout"):
        small(tmp_path / "x.txt", "model.attention_dropout=0.1", "model.long_history=true")
