"""Next-item (retrieval) mode: losses against hand computation, causality, end-to-end training
through the real loop (both protocols, resumption), early stopping, test scored once, data errors
exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.config import ConfigError, load_config
from gem_jax.data.next_item import load_next_item_data
from gem_jax.embeddings import HashedEmbedding
from gem_jax.model.next_item import NextItemModel, bce_loss, sampled_softmax_loss
from gem_jax.precision import PrecisionPolicy
from gem_jax.tasks import make_task
from gem_jax.train import loop
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
NUM_ITEMS = 40


def write_cyclic_pairs(path: Path, num_users: int = 48, seed: int = 0) -> Path:
    """Users walk the item cycle 1..N with step 1 or 3 from a random start: the next item is
    predictable from the last ones, so a model that learns beats chance by far."""
    rng = np.random.default_rng(seed)
    lines = []
    for u in range(num_users):
        step = 1 if u % 2 else 3
        start = int(rng.integers(0, NUM_ITEMS))
        length = int(rng.integers(4, 12))
        for i in range(length):
            lines.append(f"{u + 1} {(start + step * i) % NUM_ITEMS + 1}")
    path.write_text("\n".join(lines) + "\n")
    return path


SMALL_ARGS = [
    "data.kind=interactions",
    "data.examples_per_shard=16",
    "data.tokens_per_shard=160",
    "embeddings.dim=16",
    "model.model_dim=16",
    "model.num_heads=1",
    "model.attention_dim=16",
    "model.value_dim=16",
    "model.num_layers=1",
    "model.num_position_buckets=12",
    "model.num_time_buckets=0",
    "model.activation=softmax",
    "model.attention_implementation=reference",
    "precision.compute_dtype=float32",
    "parallel.mesh_shape=[1]",
    "train.learning_rate=1e-2",
    "train.warmup_steps=0",
    "train.end_learning_rate_fraction=1.0",
    "train.weight_decay=0.0",
    "train.log_every=2",
    "train.progress=false",
    "train.async_checkpointing=false",
    "retrieval.max_len=10",
    "retrieval.eval_negatives=20",
    "retrieval.epochs=30",
    "retrieval.eval_every_epochs=5",
]


def small(path: Path, *overrides: str):
    return load_config(None, [*SMALL_ARGS, f"data.path={path}", *overrides])


def records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- losses


def _log_sigmoid(x):
    return -np.log1p(np.exp(-x))


def test_bce_loss_matches_hand_computation():
    rng = np.random.default_rng(0)
    user = rng.normal(size=(5, 3)).astype(np.float32)
    table = rng.normal(size=(7, 3)).astype(np.float32)
    targets = np.array([1, 2, 0, 6, 3], np.int32)  # position 2 has no target
    negatives = np.array([4, 5, 1, 2, 6], np.int32)
    total, count = bce_loss(
        jnp.asarray(user), jnp.asarray(table), jnp.asarray(targets), jnp.asarray(negatives)
    )
    expected = 0.0
    for t in (0, 1, 3, 4):
        pos = float(user[t] @ table[targets[t]])
        neg = float(user[t] @ table[negatives[t]])
        expected += -_log_sigmoid(pos) - _log_sigmoid(-neg)
    assert int(count) == 4
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_sampled_softmax_matches_hand_computation(shared):
    rng = np.random.default_rng(1)
    user = rng.normal(size=(4, 3)).astype(np.float32)
    table = rng.normal(size=(9, 3)).astype(np.float32)
    targets = np.array([2, 0, 5, 8], np.int32)
    if shared:  # in-batch: the pack's own targets (0 and each position's own target are masked)
        negatives = targets
        per_position = [targets] * 4
    else:
        negatives = np.array([[1, 2, 3], [4, 5, 6], [5, 7, 0], [1, 1, 8]], np.int32)
        per_position = list(negatives)
    temperature = 0.5
    total, count = sampled_softmax_loss(
        jnp.asarray(user), jnp.asarray(table), jnp.asarray(targets), jnp.asarray(negatives), temperature
    )
    expected = 0.0
    for t in range(4):
        if targets[t] == 0:
            continue
        logits = [float(user[t] @ table[targets[t]]) / temperature]
        logits += [
            float(user[t] @ table[n]) / temperature for n in per_position[t] if n != targets[t] and n != 0
        ]
        expected += np.log(np.sum(np.exp(logits))) - logits[0]
    assert int(count) == 3
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)


# ----------------------------------------------------------------------------- model


def test_dense_embedding_is_not_hashed():
    emb = HashedEmbedding(
        11, 4, PrecisionPolicy.from_config(load_config().precision), rngs=nnx.Rngs(0), hashed=False
    )
    ids = jnp.array([0, 3, 10])
    np.testing.assert_array_equal(emb.lookup(ids), emb.table[...][ids])


@pytest.mark.parametrize("layer", ["model.activation=silu", "model.layer=sasrec"])
def test_user_vectors_are_causal(tmp_path, layer):
    """Changing a later item of a sequence leaves every earlier position's vector unchanged."""
    extra = ("model.num_position_buckets=0",) if "sasrec" in layer else ()
    config = small(tmp_path / "unused.txt", layer, *extra)
    model = NextItemModel(config, NUM_ITEMS, rngs=nnx.Rngs(0))
    offsets = jnp.array([0, 5, 9] + [9] * 14, jnp.int32)
    items = jnp.zeros(160, jnp.int32).at[:9].set(jnp.arange(1, 10))
    forward = jax.jit(lambda ids: model(ids, offsets))
    before = forward(items)
    after = forward(items.at[3].set(30))
    np.testing.assert_allclose(before[:3], after[:3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(before[5:9], after[5:9], rtol=1e-5, atol=1e-6)  # the other user
    assert not np.allclose(before[3], after[3])
    assert not np.any(before[9:])  # padding tokens


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_train_both_protocols_and_test_scored_once(tmp_path):
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    workdir = tmp_path / "run"
    config = small(data, "retrieval.loss=bce", "retrieval.normalize=false", "retrieval.epochs=30")
    # Interrupted after the first evaluation (as a preemption would), then resumed from it.
    task = make_task(config)
    first_eval = next(s for s in range(1, task.total_steps() + 1) if task.eval_due(s))
    first = loop.train(task, workdir, stop_after=first_eval)
    assert first["interrupted"] and first["epoch"] == 5 and first["test"] is None
    assert not (workdir / "test.json").exists()
    summary = loop.train(make_task(config), workdir)
    assert not summary["interrupted"] and summary["epoch"] == 30
    recs = records(workdir)
    valid = [r for r in recs if r.get("split") == "valid"]
    tests = [r for r in recs if r.get("split") == "test"]
    assert [r["epoch"] for r in valid] == [5, 10, 15, 20, 25, 30]
    assert len(tests) == 1
    for key in (
        "sampled/HR@10",
        "sampled/NDCG@10",
        "full/HR@5",
        "full/NDCG@5",
        "full/HR@10",
        "full/NDCG@10",
        "full/HR@20",
        "full/NDCG@20",
    ):
        assert 0.0 <= tests[0]["test"][key] <= 1.0, key
        assert key in valid[-1]["valid"]
    # The chosen checkpoint is the best validation one (first of ties), and test was scored on it.
    best = max(valid, key=lambda r: (r["valid"]["sampled/NDCG@10"], -r["step"]))
    assert summary["best_step"] == best["step"] == tests[0]["step"]
    assert tests[0]["valid"]["sampled/NDCG@10"] == pytest.approx(best["valid"]["sampled/NDCG@10"], abs=1e-6)
    # It learned: chance is HR@10 = 10/21 with 20 negatives, NDCG@10 ~ 0.2.
    assert tests[0]["test"]["sampled/HR@10"] > 0.8, tests[0]
    # Re-running a finished run does not score the test split again.
    loop.train(make_task(config), workdir)
    assert sum(r.get("split") == "test" for r in records(workdir)) == 1
    # `eval` reports the chosen checkpoint's validation metrics and the recorded test metrics.
    ev = loop.evaluate_run(make_task(config), workdir)
    assert ev["step"] == best["step"]
    assert ev["eval"]["sampled/NDCG@10"] == pytest.approx(best["valid"]["sampled/NDCG@10"], abs=1e-6)
    assert ev["test"] == tests[0]["test"]


@pytest.mark.slow
def test_early_stopping_keeps_first_best(tmp_path):
    """With a zero learning rate every evaluation ties; ties never count as better, so the first
    evaluation stays best and `patience` later ones stop the run."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    workdir = tmp_path / "run"
    config = small(
        data,
        "train.learning_rate=0.0",
        "retrieval.eval_every_epochs=1",
        "train.patience=2",
        "retrieval.negatives=in_batch",
        "retrieval.eval_protocol=full",
        "train.select_metric=full/NDCG@10",
    )
    summary = loop.train(make_task(config), workdir)
    valid = [r for r in records(workdir) if r.get("split") == "valid"]
    assert [r["epoch"] for r in valid] == [1, 2, 3]
    assert summary["stopped_early"] and summary["best_epoch"] == 1
    assert summary["best_step"] == valid[0]["step"]
    assert "sampled/HR@10" not in valid[0]["valid"]


def test_time_budget_stops_with_a_last_evaluation_and_scores_test(tmp_path):
    """`train.max_minutes` ends training at the first epoch end past the budget: that epoch is
    evaluated even off the `eval_every_epochs` grid, and the test split is scored for the best one."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    workdir = tmp_path / "run"
    config = small(data, "train.max_minutes=1e-6", "retrieval.eval_every_epochs=5")
    summary = loop.train(make_task(config), workdir)
    valid = [r for r in records(workdir) if r.get("split") == "valid"]
    assert [r["epoch"] for r in valid] == [1]
    assert summary["out_of_time"] and not summary["stopped_early"] and summary["epoch"] == 1
    assert summary["test"] is not None and (workdir / "test.json").exists()
    # A finished (out-of-time) run is not trained further when re-run.
    again = loop.train(make_task(config), workdir)
    assert again["epoch"] == 1 and sum(r.get("split") == "test" for r in records(workdir)) == 1


def test_exclude_history_reports_both_full_rankings(tmp_path):
    """With `exclude_history`, "full/" drops the user's own items and "full_incl_history/" keeps them;
    dropping candidates can only move a target up, so every HR is at least as high."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data, "retrieval.exclude_history=true", "retrieval.epochs=5", "train.select_metric=full/NDCG@10"
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    test = summary["test"]
    for k in (5, 10, 20):
        assert test[f"full/HR@{k}"] >= test[f"full_incl_history/HR@{k}"], test
    # Some user's history outranks its target (neighbouring items on the cycle), so excluding moves it up.
    assert any(test[f"full/HR@{k}"] > test[f"full_incl_history/HR@{k}"] for k in (5, 10, 20)), test


def test_sasrec_block_learns_with_bce(tmp_path):
    """SASRec's block (feed-forward, un-normalised keys) on SASRec's loss learns the cycles."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data,
        "model.layer=sasrec",
        "model.num_position_buckets=0",
        "retrieval.loss=bce",
        "retrieval.normalize=false",
        "train.adam_b2=0.98",
        "model.dropout=0.1",
        "retrieval.epochs=20",
        "retrieval.eval_every_epochs=20",
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    assert summary["test"]["sampled/HR@10"] > 0.8, summary["test"]


def test_sasrec_block_config_errors(tmp_path):
    with pytest.raises(ValueError, match="num_position_buckets"):
        NextItemModel(small(tmp_path / "x.txt", "model.layer=sasrec"), NUM_ITEMS, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="model.layer"):
        small(tmp_path / "x.txt", "model.layer=gru")
    with pytest.raises(ConfigError, match="adam_b2"):
        small(tmp_path / "x.txt", "train.adam_b2=1.0")


def test_uniform_sampled_softmax_learns(tmp_path):
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data,
        "model.activation=silu",
        "retrieval.num_negatives=16",
        "retrieval.temperature=0.1",
        "retrieval.epochs=15",
        "retrieval.eval_every_epochs=15",
    )
    summary = loop.train(make_task(config), tmp_path / "run")
    assert summary["test"]["sampled/HR@10"] > 0.8, summary["test"]


# ----------------------------------------------------------------------------- errors


def test_config_checks():
    with pytest.raises(ConfigError, match="retrieval.loss"):
        load_config(None, ["data.kind=interactions", "data.path=x", "retrieval.loss=hinge"])
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, ["data.kind=interactions"])
    with pytest.raises(ConfigError, match="eval_protocol"):
        load_config(None, ["data.kind=interactions", "data.path=x", "retrieval.eval_protocol=full"])


def test_malformed_file_exits_2_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2\n1 3\n1 x\n")
    config = str(ROOT / "configs" / "games_sasrec.toml")
    out = run_cli(
        "train", "--config", config, "--workdir", str(tmp_path / "run"), "--set", f"data.path={bad}"
    )
    assert out.returncode == 2, out.stderr
    assert f"{bad}:3" in out.stderr
    missing = tmp_path / "missing.txt"
    with pytest.raises(ConfigError, match="not found"):
        load_next_item_data(small(missing))


@pytest.mark.parametrize(
    "config, source",
    [
        ("games_sasrec", "github.com/kang205/SASRec, file data/Video.txt, saved as data/sasrec/Games.txt"),
        (
            "beauty_hstu",
            "github.com/salesforce/ICLRec, file data/Beauty.txt, saved as data/iclrec/Beauty.txt",
        ),
    ],
)
def test_next_item_config_without_its_data_names_where_to_get_it(tmp_path, config, source):
    """The configs read the local data/ folder; without the file, one line (exit 2) says where it comes
    from and how to point the run elsewhere, and nothing is written."""
    path = load_config(ROOT / "configs" / f"{config}.toml").data.path
    assert path.startswith("data/"), path
    if (ROOT / path).exists():
        pytest.skip(f"{path} is present in this checkout")
    out = run_cli(
        "train", "--config", f"configs/{config}.toml", "--workdir", str(tmp_path / "run"), timeout=300
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "config error: `data.path`: interactions file not found"
    ), lines
    assert source in lines[0] and "--set data.path=FILE" in lines[0]
    assert not (tmp_path / "run").exists()


def test_missing_file_of_no_public_set_points_to_the_readme(tmp_path):
    with pytest.raises(ConfigError, match=r'not found: .*"Public data"; or pass --set data.path=FILE$'):
        load_next_item_data(small(tmp_path / "mine.txt"))


# ----------------------------------------------------------------------------- resumption and processes


def _final_params(workdir: Path, config) -> list[np.ndarray]:
    from gem_jax.train.checkpoint import Checkpointer
    from gem_jax.train.step import Trainer

    task = make_task(config)
    trainer = Trainer(task, task.mesh)
    ck = Checkpointer(workdir / "checkpoints", config.train)
    state, _ = ck.restore(ck.latest_step(), trainer.abstract_state, trainer.state_shardings)
    ck.close()
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.slow
def test_resume_mid_epoch_gives_identical_parameters(tmp_path):
    """Stopped in the middle of an epoch (the data iterator's position is in the checkpoint) and
    resumed, a run ends with the same parameters, bit for bit, as one that never stopped."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    config = small(
        data, "retrieval.loss=bce", "retrieval.epochs=4", "retrieval.eval_every_epochs=2", "model.dropout=0.2"
    )
    task = make_task(config)
    per_epoch = task.total_steps() // 4
    assert per_epoch >= 3, "the test needs epochs of several steps"
    middle = per_epoch + per_epoch // 2  # inside the second epoch
    assert not task.is_boundary(middle)
    whole = loop.train(task, tmp_path / "whole")
    first = loop.train(make_task(config), tmp_path / "split", stop_after=middle)
    assert first["interrupted"] and first["step"] == middle and first["epoch"] == 1
    second = loop.train(make_task(config), tmp_path / "split")
    assert second["step"] == whole["step"] == task.total_steps()
    for a, b in zip(_final_params(tmp_path / "whole", config), _final_params(tmp_path / "split", config)):
        np.testing.assert_array_equal(a, b)
    assert second["test"] == whole["test"]


def test_processes_split_each_step_and_together_see_the_epoch(tmp_path):
    """With 2 processes, each yields its half of every step's packs; side by side they are the
    single-process stream, so multi-process training sees the same global batches."""
    from gem_jax.data.next_item import NextItemEpochs

    data_path = write_cyclic_pairs(tmp_path / "cyclic.txt", num_users=96)
    config = small(data_path, "data.examples_per_shard=4", "retrieval.epochs=2")
    data = load_next_item_data(config)
    whole = list(NextItemEpochs(data, config, shards=4))
    halves = [
        list(NextItemEpochs(data, config, shards=4, process_index=p, process_count=2)) for p in range(2)
    ]
    assert len(halves[0]) == len(halves[1]) == len(whole) > 2
    for w, a, b in zip(whole, *halves):
        for name in ("item_ids", "targets", "offsets"):
            joined = np.concatenate([getattr(a, name), getattr(b, name)])
            np.testing.assert_array_equal(joined, getattr(w, name))


def test_cli_trains_next_item_task(tmp_path):
    """`python -m experiments train` runs the next-item task through the same loop as ranking."""
    data = write_cyclic_pairs(tmp_path / "cyclic.txt")
    args = ["train", "--workdir", str(tmp_path / "run")]
    for o in SMALL_ARGS + ["retrieval.epochs=5", "retrieval.eval_every_epochs=5", f"data.path={data}"]:
        args += ["--set", o]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["epoch"] == 5 and not summary["interrupted"]
    assert summary["test"]["sampled/HR@10"] > 0.5, summary["test"]
    assert (tmp_path / "run" / "test.json").exists() and (tmp_path / "run" / "best").is_dir()
    assert "chosen checkpoint" in out.stdout
