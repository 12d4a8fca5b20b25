"""Prefix-style training (`retrieval.train_targets = "last_of_prefixes"`): the examples are exactly the
prefixes, the loss of a causal model over them is the all-positions loss, and BSARec's filter trains
with it end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.data.next_item import load_next_item_data, pack_next_item, prefix_examples
from gem_jax.tasks import make_task
from gem_jax.train import loop
from tests.test_retrieval import small, write_cyclic_pairs


def test_prefix_examples_are_every_prefix_with_only_its_next_item():
    inputs = [np.array([5, 6, 7]), np.array([9])]
    targets = [np.array([6, 7, 8]), np.array([2])]
    got_inputs, got_targets, owners = prefix_examples(inputs, targets, [3, 4])
    assert [x.tolist() for x in got_inputs] == [[5], [5, 6], [5, 6, 7], [9]]
    assert [x.tolist() for x in got_targets] == [[6], [0, 7], [0, 0, 8], [2]]
    assert owners == [3, 3, 3, 4]


def test_prefix_data_holds_the_all_positions_pairs(tmp_path):
    """The (input, target) pairs of the two modes are the same multiset."""
    data_path = write_cyclic_pairs(tmp_path / "cyclic.txt")
    every = load_next_item_data(small(data_path))
    prefixes = load_next_item_data(small(data_path, "retrieval.train_targets=last_of_prefixes"))
    want = sorted(
        (tuple(x[: t + 1].tolist()), int(y[t]))
        for x, y in zip(every.inputs, every.targets)
        for t in range(len(x))
    )
    got = sorted((tuple(x.tolist()), int(y[-1])) for x, y in zip(prefixes.inputs, prefixes.targets))
    assert got == want
    assert all(not y[:-1].any() for y in prefixes.targets)
    assert len(prefixes.inputs) == sum(len(x) for x in every.inputs)
    assert prefixes.eval_sets["valid"].histories[0].tolist() == every.eval_sets["valid"].histories[0].tolist()


@pytest.mark.slow
def test_causal_model_loss_over_prefixes_equals_the_all_positions_loss(tmp_path):
    """A causal model's vector at a prefix's last token is its vector at that position of the whole
    sequence, so both modes give the same loss sums for one user (the filter off, no dropout). Without
    the absolute position embedding: it counts back from the last token, so it differs between a prefix
    and the whole sequence (the relative bias does not)."""
    data_path = write_cyclic_pairs(tmp_path / "cyclic.txt")
    common = (
        "retrieval.loss=full_softmax",
        "retrieval.label_smoothing=0.1",
        "model.activation=silu",
        "retrieval.position_embedding=false",
    )
    configs = [
        small(data_path, *common),
        small(data_path, *common, "retrieval.train_targets=last_of_prefixes"),
    ]
    tasks = [make_task(c) for c in configs]
    model = tasks[0].build_model()
    seq, nxt = tasks[0].data.inputs[0], tasks[0].data.targets[0]
    whole = pack_next_item([seq], [nxt], None, examples_capacity=16, tokens_capacity=160)
    pre_inputs, pre_targets, _ = prefix_examples([seq], [nxt], [0])
    prefixes = pack_next_item(pre_inputs, pre_targets, None, examples_capacity=16, tokens_capacity=160)
    key = jax.random.key(0)
    a = tasks[0].pack_loss(model, jax.tree.map(jnp.asarray, whole), {}, key)
    b = tasks[1].pack_loss(model, jax.tree.map(jnp.asarray, prefixes), {}, key)
    assert float(a["count"]) == float(b["count"]) == len(seq)
    np.testing.assert_allclose(a["loss_sum"], b["loss_sum"], rtol=1e-5)


@pytest.mark.slow
def test_frequency_filter_trains_on_prefixes(tmp_path):
    """BSARec's filter with prefix training learns the cyclic walks (chance: sampled HR@10 = 10/21)."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data,
        "retrieval.train_targets=last_of_prefixes",
        "model.frequency_mix=0.7",
        "model.frequency_bins=2",
        "retrieval.loss=full_softmax",
        "retrieval.epochs=5",
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    assert summary["epoch"] == 5
    assert summary["test"]["sampled/HR@10"] > 0.8, summary["test"]
