"""Reliability of runs, one test per failure: the run record refuses a changed config or
data file and leaves the workdir byte-identical; a corrupt latest checkpoint falls back to the
previous one; one trainer per workdir; signals during compilation, data-worker start-up and
training end cleanly; metrics.jsonl has no duplicate steps after kill -9 and resume.

Signals and locks are tested through `python -m experiments` subprocesses (one CPU device, tiny
configs); everything else in process on a small run trained once per module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from gem_jax.config import config_to_toml
from gem_jax.tasks import make_task
from gem_jax.train import integrity, loop
from gem_jax.train.checkpoint import Checkpointer, NoIntactCheckpoint
from gem_jax.train.run_record import RecordMismatch, RunRecord, data_fingerprint
from gem_jax.train.step import Trainer
from gem_jax.train.workdir_lock import WorkdirError, WorkdirLock, WorkdirLocked
from tests.helpers import poison_loss, run_cli, small_config, start_cli
from tests.test_retrieval import small as small_next_item
from tests.test_retrieval import write_cyclic_pairs

ROOT = Path(__file__).resolve().parent.parent
RUN = ("train.steps=20", "train.checkpoint_every=10", "train.log_every=5")


def _config(*extra):
    return small_config(*RUN, *extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 20-step ranking run with checkpoints at steps 10 and 20 (async saves)."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    loop.train(make_task(_config("train.async_checkpointing=true")), workdir)
    return workdir


def _copy(trained: Path, tmp_path: Path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    return workdir


def _snapshot(directory: Path) -> dict[str, tuple]:
    """Every entry under `directory`: (sha256 of the bytes, mtime) for files, "dir" for directories."""
    out = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if path.is_dir():
            out[rel] = ("dir",)
        else:
            out[rel] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


def _config_args(tmp_path: Path, *overrides: str) -> list[str]:
    """CLI arguments that load exactly `_config(*overrides)` (the CLI's default config is tiny.toml)."""
    path = tmp_path / f"small-{len(list(tmp_path.glob('small-*.toml')))}.toml"
    path.write_text(config_to_toml(_config(*overrides)))
    return ["--config", str(path)]


def _start(*args: str) -> subprocess.Popen:
    """The CLI in its own session (so a signal to the group reaches it and its workers, as Ctrl-C would)."""
    return start_cli(*args, start_new_session=True)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.1)


def _record_keys(workdir: Path) -> list[tuple[int, str | None]]:
    """(step, split) of every metrics.jsonl record: a train log line and an evaluation may share a step."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [(json.loads(line)["step"], json.loads(line).get("split")) for line in lines]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _params(workdir: Path, config, step: int):
    task = make_task(config)
    trainer = Trainer(task, task.mesh)
    ck = Checkpointer(workdir / "checkpoints", config.train, read_only=True)
    state, _ = ck.restore(step, *trainer.saved_target)
    ck.close()
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state, state.embeddings))]


def _ends_with(stderr: str, line: str) -> None:
    """The run's own output (e.g. the task's description) may come first; then exactly this line."""
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert lines and lines[-1] == line and "Traceback" not in stderr, stderr[-3000:]
    assert sum("SIG" in x for x in lines) == 1, stderr[-3000:]


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- the run record


def test_new_run_writes_the_record_and_manifests(trained):
    assert (trained / "config.toml").read_text() == config_to_toml(_config("train.async_checkpointing=true"))
    record = json.loads((trained / "run.json").read_text())
    assert record["data"]["kind"] == "synthetic" and record["data"]["generator"]["num_items"] == 500
    assert record["code"]["package"] and "git" in record["code"] and record["code"]["jax"] == jax.__version__
    assert not (trained / "resumes.jsonl").exists()
    for step in (10, 20):  # async saves: the manifest is written once the save has committed
        assert integrity.problem(trained / "checkpoints" / str(step)) is None


def test_changed_config_is_refused_and_the_workdir_is_untouched(trained, tmp_path):
    workdir = _copy(trained, tmp_path)
    before = _snapshot(workdir)
    # data.num_workers too: the worker count decides which examples a batch holds (not `may_change`).
    args = _config_args(tmp_path, "model.model_dim=48", "train.learning_rate=0.01", "data.num_workers=2")
    r = run_cli("train", "--workdir", str(workdir), *args)
    assert r.returncode == 2
    line = _one_line_error(r.stderr)
    assert "model.model_dim 32 -> 48" in line and "train.learning_rate" in line and str(workdir) in line
    assert "data.num_workers 0 -> 2" in line
    assert _snapshot(workdir) == before
    # `eval` reads the record, which the refused run did not touch, and writes nothing either.
    r = run_cli("eval", "--workdir", str(workdir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 20
    assert _snapshot(workdir) == before


def test_allowed_changes_are_recorded_and_eval_applies_them(trained, tmp_path):
    workdir = _copy(trained, tmp_path)
    record = RunRecord(workdir)
    changed = _config(
        "train.async_checkpointing=true",
        "train.steps=30",
        "train.log_every=3",
        "model.attention_implementation=interpret",
    )
    plan = record.check(changed, data_fingerprint(changed))
    assert not plan.new and set(plan.changed) == {
        "train.steps",
        "train.log_every",
        "model.attention_implementation",
    }
    record.write(plan, changed, data_fingerprint(changed), resumed_from=20)
    line = json.loads((workdir / "resumes.jsonl").read_text())
    assert line["resumed_from_step"] == 20 and line["changed"]["train.steps"] == [20, 30]
    assert (workdir / "config.toml").read_text() == config_to_toml(_config("train.async_checkpointing=true"))
    assert record.recorded_config() == changed


def test_changed_generator_setting_is_refused_by_name(trained, tmp_path):
    # The fingerprint goes through run.json (tuples come back as lists): an unchanged config must match
    # it, and a changed generator setting must be refused with its name.
    workdir = _copy(trained, tmp_path)
    record = RunRecord(workdir)
    assert not record.check(_config(), data_fingerprint(_config())).new
    changed = _config("data.history_len_mean=12.0")
    with pytest.raises(RecordMismatch, match=r"generator\.history_len_mean 30\.0 -> 12\.0"):
        record.check(changed, data_fingerprint(changed))


def test_changed_data_file_is_refused_and_a_moved_one_accepted(tmp_path, capsys):
    data = write_cyclic_pairs(tmp_path / "pairs.txt", num_users=24)
    config = small_next_item(data, "retrieval.epochs=1", "retrieval.eval_every_epochs=1")
    workdir = tmp_path / "run"
    loop.train(make_task(config), workdir)
    before = _snapshot(workdir)
    original = data.read_bytes()
    data.write_bytes(original.replace(b"\n1 ", b"\n2 ", 1))  # same size, other content
    with pytest.raises(RecordMismatch, match="data file content") as e:
        loop.train(make_task(config), workdir)
    assert "\n" not in str(e.value)
    assert _snapshot(workdir) == before
    # The same bytes under another path: the run resumes (data.path is recorded as a change).
    data.write_bytes(original)
    moved = data.rename(tmp_path / "moved.txt")
    config2 = small_next_item(moved, "retrieval.epochs=1", "retrieval.eval_every_epochs=1")
    plan = RunRecord(workdir).check(config2, data_fingerprint(config2))
    assert set(plan.changed) == {"data.path"}
    # A corrupt best/ checkpoint: `eval` reports it and falls back to the newest intact checkpoint.
    (best,) = [p for p in (workdir / "best").iterdir() if p.name.isdigit()]
    victim = _largest_file(best)
    victim.write_bytes(victim.read_bytes()[::-1])
    summary = loop.evaluate_run(make_task(config2), workdir)
    assert summary["checkpoint"] == "checkpoints" and f"{best} is not intact" in capsys.readouterr().err


def test_workdir_without_a_checkpoint_starts_over(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.toml").write_text(config_to_toml(_config("model.model_dim=48")))
    (workdir / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    plan = RunRecord(workdir).check(_config(), data_fingerprint(_config()))
    assert plan.new  # nothing to protect: no checkpoint


# ----------------------------------------------------------------------------- integrity


def _largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(trained, tmp_path, capsys):
    workdir = _copy(trained, tmp_path)
    victim = _largest_file(workdir / "checkpoints" / "20")
    data = bytearray(victim.read_bytes())
    data[100:164] = bytes(255 - b for b in data[100:164])  # flip 64 bytes
    victim.write_bytes(bytes(data))
    summary = loop.train(make_task(_config()), workdir)
    err = capsys.readouterr().err
    assert f"checkpoint {workdir / 'checkpoints' / '20'} is not intact" in err and "checksum" in err
    assert "resumed from step 10" in err
    assert summary["step"] == 20 and not summary["interrupted"]
    assert len(list((workdir / "corrupt").iterdir())) == 1  # moved aside, not deleted
    # The replayed steps give the uninterrupted run's parameters, bit for bit.
    for a, b in zip(_params(workdir, _config(), 20), _params(trained, _config(), 20)):
        np.testing.assert_array_equal(a, b)
    # metrics.jsonl: the records past step 10 were dropped at resume and written again, once.
    assert _record_keys(workdir) == _record_keys(trained)


def test_truncated_and_missing_files_and_no_intact_checkpoint(trained, tmp_path, capsys):
    workdir = _copy(trained, tmp_path)
    train_config = _config().train
    victim = _largest_file(workdir / "checkpoints" / "20")
    victim.write_bytes(victim.read_bytes()[:-10])
    ck = Checkpointer(workdir / "checkpoints", train_config)
    assert ck.newest_intact() == 10 and ck.all_steps() == [10]
    ck.close()
    assert "bytes" in capsys.readouterr().err
    # A missing file in the only remaining step: a clear error, and nothing is moved.
    next(p for p in (workdir / "checkpoints" / "10").rglob("*") if p.name == "_CHECKPOINT_METADATA").unlink()
    before = _snapshot(workdir)
    with pytest.raises(NoIntactCheckpoint, match="missing"):
        loop.train(make_task(_config()), workdir)
    # A step without a manifest (a save that never finished) is not trusted either.
    assert integrity.problem(workdir / "corrupt" / "nothing") == "missing"
    (workdir / "checkpoints" / "10" / integrity.MANIFEST).unlink()
    assert "no integrity manifest" in integrity.problem(workdir / "checkpoints" / "10")
    before.pop(f"checkpoints/10/{integrity.MANIFEST}")
    after = _snapshot(workdir)
    assert {k: v for k, v in after.items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


def test_nan_stop_names_only_an_intact_checkpoint(tmp_path, monkeypatch):
    poison_loss(monkeypatch, from_step=5)
    write = Checkpointer._write_manifest
    # Step 4's manifest is never written, as if the process had died right after orbax's commit.
    monkeypatch.setattr(
        Checkpointer, "_write_manifest", lambda self, step: None if step == 4 else write(self, step)
    )
    c = small_config("train.steps=20", "train.checkpoint_every=2", "train.log_every=100")
    with pytest.raises(loop.TrainingDiverged, match="the last good checkpoint is step 2$"):
        loop.train(make_task(c), tmp_path)


# ----------------------------------------------------------------------------- one trainer per workdir


def test_second_trainer_is_refused_while_the_lock_is_held(trained, tmp_path):
    workdir = _copy(trained, tmp_path)
    stale = workdir / "checkpoints" / "30.orbax-checkpoint-tmp-1234"
    stale.mkdir()
    with WorkdirLock(workdir):
        before = _snapshot(workdir)
        r = run_cli("train", "--workdir", str(workdir), *_config_args(tmp_path))
        assert r.returncode == 2
        line = _one_line_error(r.stderr)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in line
        assert _snapshot(workdir) == before and stale.exists()  # no clean-up without the lock
        with pytest.raises(WorkdirLocked):  # in the same process too (flock is per open file)
            WorkdirLock(workdir).acquire()
    summary = loop.train(make_task(_config()), workdir)  # finished already: nothing to train
    assert summary["step"] == 20 and not stale.exists()  # the unfinished save's folder is removed


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from gem_jax.train.workdir_lock import WorkdirLock; "
            f"WorkdirLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(120)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(WorkdirLocked, match=f"pid {holder.pid} on host"):
        WorkdirLock(tmp_path).acquire()
    holder.kill()  # SIGKILL: no clean-up code runs; the kernel drops the lock
    holder.wait()
    lock = WorkdirLock(tmp_path)
    lock.acquire()
    lock.release()


def test_workdir_that_is_a_file_or_not_writable(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(WorkdirError, match="is not a directory"):
        loop.train(make_task(_config()), a_file)
    with pytest.raises(WorkdirError, match="is a file"):
        loop.train(make_task(_config()), a_file / "sub")
    r = run_cli("train", "--workdir", str(a_file), *_config_args(tmp_path))
    assert r.returncode == 2 and "is not a directory" in _one_line_error(r.stderr)
    locked_dir = tmp_path / "ro"
    locked_dir.mkdir()
    locked_dir.chmod(0o555)
    if os.access(locked_dir, os.W_OK):  # root ignores permission bits: use a read-only tree instead
        locked_dir = Path("/proc/sys")
    if os.access(locked_dir, os.W_OK):
        pytest.skip("no directory this user cannot write to")
    with pytest.raises(WorkdirError, match="cannot write to"):
        loop.train(make_task(_config()), locked_dir / "run")


# ----------------------------------------------------------------------------- signals


def test_sigint_during_compilation_exits_cleanly(tmp_path):
    workdir = tmp_path / "run"
    proc = _start("train", "--workdir", str(workdir), *_config_args(tmp_path))
    _wait_for(lambda: (workdir / "run.json").exists(), proc)  # checks passed; compilation follows
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])  # not -11 (a segfault)
    _ends_with(err, "SIGINT: exiting (nothing to save yet)")
    assert not [p for p in (workdir / "checkpoints").iterdir()]


@pytest.mark.slow
def test_ctrl_c_during_data_worker_start_up_exits_cleanly(tmp_path, monkeypatch):
    # Runtime shape checking wraps the data pipeline's functions in something grain cannot pickle for
    # its worker processes (a weakref); the signal handling under test does not depend on it.
    monkeypatch.delenv("GEM_JAX_TYPECHECK", raising=False)
    workdir = tmp_path / "run"
    proc = _start("train", "--workdir", str(workdir), *_config_args(tmp_path, "data.num_workers=2"))

    def session() -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == proc.pid and stat.parent.name != str(proc.pid):  # field 6: session id
                pids.append(int(stat.parent.name))
        return pids

    _wait_for(lambda: len(session()) >= 2, proc)  # grain's worker processes are starting
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    _ends_with(err, "SIGINT: exiting (nothing to save yet)")
    deadline = time.time() + 10
    while session() and time.time() < deadline:
        time.sleep(0.2)
    assert not session(), "data workers outlived the trainer"


@pytest.mark.slow
def test_two_signals_in_a_row_exit_cleanly_and_the_next_start_cleans_up(tmp_path):
    workdir = tmp_path / "run"
    run = ("train.steps=100000", "train.log_every=1")
    proc = _start("train", "--workdir", str(workdir), *_config_args(tmp_path, *run))
    _wait_for(lambda: _lines(workdir / "metrics.jsonl") >= 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and proc.returncode in (0, 130), (proc.returncode, err[-3000:])
    (workdir / "checkpoints" / "99.orbax-checkpoint-tmp-1").mkdir()  # as a save cut by the second signal
    step = loop.train(make_task(_config(*run)), workdir, stop_after=1)["step"]
    assert not list(workdir.rglob("*.orbax-checkpoint-tmp*"))
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step"] <= step for r in records)


def test_metrics_have_no_duplicate_steps_after_kill_9_and_resume(tmp_path):
    workdir = tmp_path / "run"
    run = ("train.steps=100000", "train.log_every=1", "train.checkpoint_every=4")
    proc = _start("train", "--workdir", str(workdir), *_config_args(tmp_path, *run))
    _wait_for(lambda: _lines(workdir / "metrics.jsonl") >= 7, proc)  # past the step-4 checkpoint
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    logged = [
        json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines() if line
    ]
    ck = Checkpointer(workdir / "checkpoints", _config().train, read_only=True)
    resume = ck.newest_intact()
    ck.close()
    assert max(logged) > resume  # records past the checkpoint exist: they would be written twice
    summary = loop.train(make_task(_config(*run)), workdir, stop_after=resume + 3)
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, summary["step"] + 1))


# ----------------------------------------------------------------------------- data errors


@pytest.mark.parametrize(
    "content, needle",
    [(bytes(range(256)) * 40, "not a UTF-8 text file"), (f"1 2\n1 3\n{2**70} 4\n".encode(), "int64")],
)
def test_unreadable_data_file_is_one_line_exit_2(tmp_path, content, needle):
    data = tmp_path / "data.bin"
    data.write_bytes(content)
    config = ROOT / "configs" / "games_sasrec.toml"
    r = run_cli(
        "train", "--config", str(config), "--workdir", str(tmp_path / "run"), "--set", f"data.path={data}"
    )
    assert r.returncode == 2
    line = _one_line_error(r.stderr)
    assert str(data) in line and needle in line
    assert not (tmp_path / "run").exists()
