"""Training on records (`data.kind = "records"`): the CLI end to end, resume bitwise (one process and
two), a bad record stopping the run with one line, and the `data` subcommands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from gem_jax.config import load_config
from gem_jax.data.records import codec
from gem_jax.data.records.schema import ShardSet
from gem_jax.data.records.writer import shard_name
from gem_jax.tasks import make_task
from gem_jax.train import loop
from tests.helpers import SMALL, cli_env, small_config
from tests.test_records import synth_shards, write_movielens
from tests.test_train import _params

ROOT = Path(__file__).resolve().parent.parent
# Two embedding features for the two sparse bags (f0 on its own table, f1 salted into "sparse"): the
# feature map from config, not the default one-table layout.
FEATURE_MAP = [
    'data.sparse_features={f0 = "segments", f1 = "sparse"}',
    "embeddings.tables={items = {rows = 512, dim = 16}, actions = {rows = 16, dim = 16}, "
    "segments = {rows = 64, dim = 16}, sparse = {rows = 256, dim = 16}}",
    'embeddings.features={items = {table = "items", pooling = "none"}, actions = {table = "actions", pooling = "none"}'
    ', segments = {table = "segments", pooling = "sum"}, sparse = {table = "sparse", pooling = "mean"}}',
]
# Where depth plays no part in what a test checks (a resume, a data error), one layer: less to compile.
ONE_LAYER = ["model.num_layers=1", "model.wukong_layers=1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The small config's synthetic examples as shards: train (600) and valid (the eval range, 64)."""
    from gem_jax.tasks.ranking import EVAL_START

    root = tmp_path_factory.mktemp("records")
    c = small_config()
    synth_shards(root / "train", c, 600, shards=4)
    synth_shards(root / "valid", c, c.data.eval_examples, start=EVAL_START, shards=2)
    return root


def records_overrides(root: Path, *extra: str) -> list[str]:
    return ["data.kind=records", f"data.path={root / 'train'}", f"data.eval_path={root / 'valid'}", *extra]


def _cli(
    *args: str, cwd: Path = ROOT, timeout: float = 600, typecheck: bool = True
) -> subprocess.CompletedProcess:
    env = cli_env()
    if not typecheck:  # grain cannot pickle the shape-checked functions into its worker processes
        env.pop("GEM_JAX_TYPECHECK", None)
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


@pytest.mark.slow
def test_cli_trains_on_records_and_logs_the_data_counters(shards, tmp_path):
    overrides = [
        *SMALL,
        *records_overrides(shards),
        "train.steps=10",
        "train.log_every=5",
        "data.max_history_len=16",
    ]
    overrides += ["data.num_workers=1"]  # through a grain worker process, as on a GPU host
    r = _cli("train", "--workdir", str(tmp_path / "run"), *_sets(overrides), typecheck=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "records train: 600 records in 4 shards" in r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["step"] == 10 and set(summary["eval"]) == {"click", "conversion"}
    assert 0 < summary["eval"]["click"]["auc"] < 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in records if "loss" in x]
    assert [x["step"] for x in logged] == [5, 10]
    # Histories longer than 16 events were cut (log-normal lengths, median 30), and the count only grows.
    cuts = [x["data/histories_cut"] for x in logged]
    assert 0 < cuts[0] < cuts[1] and logged[-1]["data/skipped_records"] == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["data"]["kind"] == "records" and len(run["data"]["train"]["shards"]) == 4


@pytest.mark.slow
def test_resume_on_records_is_bitwise(shards, tmp_path):
    """Stopped at step 12 and resumed, a run on records (global shuffle, the feature map from config, more
    than one epoch) ends with the uninterrupted run's parameters and metrics."""
    c = small_config(
        *records_overrides(shards), *FEATURE_MAP, *ONE_LAYER, "train.steps=24", "train.checkpoint_every=6"
    )
    task = make_task(c)
    assert task.feature_groups == {"segments": (0,), "sparse": (1,)}
    loop.train(task, tmp_path / "one")
    first = loop.train(make_task(c), tmp_path / "two", stop_after=12)
    assert first["step"] == 12
    second = loop.train(make_task(c), tmp_path / "two")
    assert second["step"] == 24
    (step_a, a), (step_b, b) = _params(tmp_path / "one", c), _params(tmp_path / "two", c)
    assert step_a == step_b == 24
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    logs = [
        [json.loads(line) for line in (tmp_path / w / "metrics.jsonl").read_text().splitlines()]
        for w in ("one", "two")
    ]
    losses = [[x["loss"] for x in log if "loss" in x] for log in logs]
    assert losses[0] == losses[1] and len(losses[0]) == 5  # steps 5, 10, 15, 20 and the last, 24
    # 24 steps x 8 examples exceed the 600 records at most once: the second epoch is a new order.
    assert logs[0][-1]["valid"]["click"] == logs[1][-1]["valid"]["click"]


@pytest.mark.slow
def test_a_bad_record_stops_the_cli_run_with_one_line(shards, tmp_path):
    import shutil

    from tests.test_records import write_raw

    bad = tmp_path / "bad"
    shard_set = ShardSet.open(str(shards / "train"))
    from gem_jax.data.records.reader import ShardSource

    source = ShardSource(shard_set)
    records = [source[i][1] for i in range(shard_set.num_records)]
    records[200] = _negative_item(records[200], shard_set)
    counts = [s.records for s in shard_set.shards]
    split = np.cumsum([0, *counts])
    write_raw(bad, shard_set.schema, [records[a:b] for a, b in zip(split[:-1], split[1:])])
    shutil.copytree(shards / "valid", tmp_path / "valid")
    where = bad / shard_set.shards[1].path.name
    overrides = [*SMALL, *ONE_LAYER, "data.kind=records", f"data.path={bad}", "train.steps=200"]
    overrides += ["train.log_every=50"]
    r = _cli("train", "--workdir", str(tmp_path / "run"), *_sets(overrides))
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("data error:")]
    assert lines == [f"data error: {where}: record {200 - counts[0]}: negative item id -7"], r.stderr[-3000:]
    # Skipping instead: the run finishes and counts the one bad record.
    overrides += ["data.bad_records=skip", "train.steps=75"]  # 8 examples a step: one epoch and one record
    r = _cli("train", "--workdir", str(tmp_path / "skip"), *_sets(overrides))
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [x["data/skipped_records"] for x in logged if "loss" in x][-1] == 1


def _negative_item(data: bytes, shard_set: ShardSet) -> bytes:
    r = codec.decode(data, shard_set.schema)
    r.candidates = np.array([-7])
    return codec.encode(r)


@pytest.mark.slow
def test_data_commands_synth_inspect_validate_convert(tmp_path):
    out = tmp_path / "synth"
    r = _cli(
        "data", "synth", "--examples", "300", "--eval-examples", "40", "--out", str(out), "--workers", "2"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train: 300 records in" in r.stdout and "valid: 40 records" in r.stdout
    assert f"--set data.path={out / 'train'}" in r.stdout
    r = _cli("data", "inspect", str(out), "--plot", str(tmp_path / "h.png"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tasks: click, conversion; 1 candidate(s) per request" in r.stdout
    assert "train: 300 records" in r.stdout and "history length" in r.stdout
    assert (tmp_path / "h.png").stat().st_size > 10_000
    r = _cli("data", "validate", str(out))
    assert r.returncode == 0 and "ok: 340 of 340 records read" in r.stdout, r.stdout + r.stderr[-2000:]
    # A shard set with a bad record: found, named, exit 1.
    from gem_jax.data.records.reader import ShardSource
    from tests.test_records import write_raw

    shard_set = ShardSet.open(str(out / "train"))
    records = [ShardSource(shard_set)[i][1] for i in range(shard_set.num_records)]
    records[3] = _negative_item(records[3], shard_set)
    write_raw(tmp_path / "bad", shard_set.schema, [records[:100], records[100:]])
    r = _cli("data", "validate", str(tmp_path / "bad"))
    assert r.returncode == 1, r.stdout
    assert f"{tmp_path / 'bad' / shard_name(0, 2)}: record 3: negative item id -7" in r.stdout
    assert "FAILED: 300 of 300 records read" in r.stdout and ", 1 bad," in r.stdout
    # A shard whose bytes changed in place (same size: the reader's size check passes; a flipped byte inside a
    # record's ids may even decode as valid ids): its sha256 differs from the one written.
    path = shard_set.shards[0].path
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    r = _cli("data", "validate", str(out))
    assert r.returncode == 1 and f"{path}: sha256 differs" in r.stdout, r.stdout
    # MovieLens: the three splits by time; Parquet: one shard set.
    write_movielens(tmp_path / "ml", "ml-1m")
    r = _cli(
        "data", "convert", str(tmp_path / "ml"), "--out", str(tmp_path / "ml-out"), "--split", "0.5,0.25"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert [ShardSet.open(str(tmp_path / "ml-out" / s)).num_records for s in ("train", "valid", "test")] == [
        6,
        3,
        3,
    ]
    from gem_jax.data.records import parquet
    from tests.test_records import SCHEMA, make_record

    parquet.write_parquet(
        [make_record(i) for i in range(20)], SCHEMA, tmp_path / "p.parquet", row_group_size=5
    )
    r = _cli(
        "data", "convert", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "p-out"), "--workers", "2"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert ShardSet.open(str(tmp_path / "p-out")).num_records == 20 and "rows" not in r.stdout
    r = _cli("data", "validate", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and r.stderr.startswith("data error:")


@pytest.mark.slow
def test_records_two_processes_match_one_and_resume_in_one(shards, tmp_path):
    from tests.test_multiprocess import LEAN, MESH, two_processes_match_one_and_resume_in_one

    overrides = [*SMALL, *MESH, *LEAN, *records_overrides(shards), "train.steps=6", "train.eval_every=4"]
    overrides += ["train.checkpoint_every=0"]
    two_processes_match_one_and_resume_in_one(load_config(None, overrides), tmp_path)
