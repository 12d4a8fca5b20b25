"""The next-item filter options together: off, the model computes what it computed before they existed
(values recorded from that model); on, each trains end to end through the loop, on cyclic walks and on a
slice of Amazon Beauty (ICLRec's file, where a copy is here)."""

from __future__ import annotations

import math
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.config import load_config
from gem_jax.tasks import make_task
from gem_jax.train import loop
from tests.helpers import ROOT, public_data_file
from tests.test_retrieval import records, small, write_cyclic_pairs

PREFIXES = ("retrieval.train_targets=last_of_prefixes", "retrieval.loss=full_softmax")

# The model before the time-variant mixer, the wavelet branch and the frequency contrastive loss existed, on
# the first pack of the cyclic walks: output rows 0, 5, 10 / 20 (first 4 channels) and the loss sums.
# A deliberate change of the default model changes these.
RECORDED = {
    "default": (
        (),
        {"loss_sum": 798.041259765625},
        [0, 5, 20],
        [
            [0.141213596, -0.131331816, 0.270204902, 0.276993036],
            [-0.131465197, 0.272437453, 0.248743981, -0.001523708],
            [-0.275659412, 0.01177513, 0.218385458, 0.342871994],
        ],
    ),
    "frequency_branch": (
        (
            "model.activation=silu",
            *PREFIXES,
            "model.frequency_mix=0.7",
            "model.frequency_bins=2",
            "retrieval.label_smoothing=0.1",
            "model.dropout=0.3",
        ),
        {"loss_sum": 198.77308654785156},
        [0, 5, 10],  # with the training dropout (key 3)
        [
            [0.001710369, 0.233105808, -0.38361454, 0.377946585],
            [-0.326701909, -0.124432601, 0.06798546, 0.697637916],
            [-0.020472316, 0.131636932, 0.10605976, 0.023844792],
        ],
    ),
    "contrastive_and_intent": (
        (
            "retrieval.contrastive_weight=0.3",
            "retrieval.intent_weight=0.5",
            "retrieval.intent_clusters=4",
            "retrieval.loss=full_softmax",
            "model.dropout=0.3",
        ),
        {"loss_sum": 699.49365234375, "contrastive_sum": 95.7745590209961, "intent_sum": 304.89373779296875},
        None,
        None,
    ),
}


@pytest.mark.parametrize("case", RECORDED)
def test_options_off_leave_the_model_as_it_was(tmp_path, case):
    overrides, sums, rows, values = RECORDED[case]
    task = make_task(small(write_cyclic_pairs(tmp_path / "cyclic.txt"), *overrides))
    model = task.build_model()
    pack = jax.tree.map(jnp.asarray, task._epochs.epoch_packs(0)[0])
    got = task.pack_loss(model, pack, {}, jax.random.key(5))
    counts = {"count" if k == "loss_sum" else k.removesuffix("_sum") + "_count" for k in sums}
    assert set(got) == {*sums, *counts}  # no other loss term
    for key, want in sums.items():
        assert float(got[key]) == pytest.approx(want, rel=1e-5), key
    if rows is not None:
        rng = jax.random.key(3) if "model.dropout=0.3" in overrides else None
        user = np.asarray(model(pack.item_ids, pack.offsets, rng=rng))
        np.testing.assert_allclose(user[rows, :4], values, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("model.sequence_mixer=time_variant", "retrieval.position_embedding=false"),
        (*PREFIXES, "model.activation=silu", "model.wavelet_mix=0.5", "model.wavelet_levels=2"),
    ],
    ids=["time_variant", "wavelet"],
)
def test_filters_learn_the_cycles(tmp_path, overrides):
    """Chance: sampled HR@10 = 10/21."""
    config = small(write_cyclic_pairs(tmp_path / "cyclic.txt"), *overrides)
    summary = loop.train(make_task(config), tmp_path / "run")
    assert summary["test"]["sampled/HR@10"] > 0.8, summary["test"]


# The device script's variants (scripts/device/next_item_variants.sh) on the shipped config's model, small.
BEAUTY_VARIANTS = {
    "time_variant": ("model.sequence_mixer=time_variant", "retrieval.position_embedding=false"),
    "wavelet": ("model.frequency_mix=0.4", "model.wavelet_mix=0.3"),
    "frequency_contrastive": (
        "retrieval.frequency_contrastive_weight=0.1",
        "retrieval.contrastive_dropout=false",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", BEAUTY_VARIANTS)
def test_variants_train_on_a_slice_of_beauty(tmp_path, variant):
    """Three epochs on Beauty's first 400 users: the loss falls and validation and test are scored."""
    path = public_data_file("iclrec/Beauty.txt")
    if path is None:
        pytest.skip("no copy of the public file iclrec/Beauty.txt here")
    sliced = tmp_path / "beauty_400.txt"
    sliced.write_text("".join(path.read_text().splitlines(keepends=True)[:400]))
    config = small(
        sliced,
        "model.activation=silu",
        *PREFIXES,
        "retrieval.label_smoothing=0.1",
        "retrieval.max_len=50",
        "retrieval.epochs=3",
        "retrieval.eval_every_epochs=1",
        "retrieval.exclude_history=true",
        "data.examples_per_shard=256",
        "data.tokens_per_shard=4096",
        "model.num_position_buckets=64",
        "model.dropout=0.3",
        "model.frequency_mix=0.7",
        "model.frequency_bins=3",
        "train.learning_rate=1e-3",
        "train.select_metric=full/NDCG@10",
        *BEAUTY_VARIANTS[variant],
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    losses = [r["loss"] for r in records(tmp_path / "run") if "loss" in r and "split" not in r]
    assert all(math.isfinite(x) for x in losses) and np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    valid = [r for r in records(tmp_path / "run") if r.get("split") == "valid"]
    assert len(valid) == 3 and all(0 <= r["valid"]["full_zeroed/NDCG@10"] <= 1 for r in valid)
    assert 0 <= summary["test"]["full_zeroed/HR@10"] <= 1


def test_every_variant_of_the_device_script_is_a_valid_config(tmp_path):
    """Each variant `scripts/device/next_item_variants.sh` can run (its --print) loads with both configs it
    trains: a key or value the config refuses would otherwise cost a GPU call."""
    out = subprocess.run(
        ["bash", "scripts/device/next_item_variants.sh", "--print"],
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path), "EXTRA": ""},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    variants = dict(line.split("\t", 1) for line in out.splitlines())
    assert {"config", "tv", "wave", "ficl", "allpos"} <= variants.keys(), variants.keys()
    for name, args in variants.items():
        words = args.split("\t")
        assert words[::2] == ["--set"] * (len(words) // 2), (name, words)
        for data in ("beauty", "sports"):
            config = load_config(ROOT / "configs" / f"{data}_hstu.toml", words[1::2])
            assert config.model.attention_implementation == "reference", name
