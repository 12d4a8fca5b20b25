"""Reliability of runs, one test per failure: the run record refuses a changed config or
data file and leaves the workdir byte-identical; a corrupt latest checkpoint falls back to the
previous one; one trainer per workdir; signals during compilation, data-worker start-up and
training end cleanly; metrics.jsonl has no duplicate steps after kill -9 and resume; a write the disk
refuses (a checkpoint, its manifest, a metrics line) stops the run in one line naming the file, and
the resume uses the last intact checkpoint; `--restarts` relaunches a killed trainer.

Signals and locks are tested through `python -m experiments` subprocesses (one CPU device, tiny
configs); everything else in process on a small run trained once per module.
"""

from __future__ import annotations

import errno
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
import orbax.checkpoint as ocp
import pytest

from gem_jax.config import config_to_toml
from gem_jax.tasks import make_task
from gem_jax.train import files, integrity, loop
from gem_jax.train.checkpoint import Checkpointer, NoIntactCheckpoint
from gem_jax.train.run_record import RecordMismatch, RunRecord, data_fingerprint
from gem_jax.train.step import Trainer
from gem_jax.train.workdir_lock import WorkdirError, WorkdirLock, WorkdirLocked
from tests.helpers import (
    child_pids,
    cli_env,
    last_logged_step,
    poison_loss,
    run_cli,
    small_config,
    start_cli,
)
from tests.test_retrieval import small as small_next_item
from tests.test_retrieval import write_cyclic_pairs

ROOT = Path(__file__).resolve().parent.parent
RUN = ("train.steps=20", "train.checkpoint_every=10", "train.log_every=5")
# Where depth plays no part in what a test checks (signals), one layer: less to compile.
ONE_LAYER = ("model.num_layers=1", "model.wukong_layers=1")


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


@pytest.mark.slow
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
        "model.attention_implementation=triton",
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


def test_a_run_of_another_generator_stream_is_refused(trained, tmp_path):
    # Same settings, another random stream (a run written before the generator changed what a seed draws).
    workdir = _copy(trained, tmp_path)
    path = workdir / "run.json"
    record = json.loads(path.read_text())
    del record["data"]["stream"]
    path.write_text(json.dumps(record))
    with pytest.raises(RecordMismatch, match=r"data fingerprint \(stream null -> \d+\)"):
        RunRecord(workdir).check(_config(), data_fingerprint(_config()))


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


@pytest.mark.slow
def test_only_unfinished_saves_start_the_run_over(trained, tmp_path, capsys):
    """A run killed before its first save finished leaves steps without a manifest and nothing intact:
    its stop line says "re-run to start over", and the re-run does (the steps are moved aside)."""
    workdir = _copy(trained, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "20")
    (workdir / "checkpoints" / "10" / integrity.MANIFEST).unlink()
    summary = loop.train(make_task(_config()), workdir)
    err = capsys.readouterr().err
    assert "its save never finished); moved to" in err and "resumed from" not in err
    assert summary["step"] == 20 and len(list((workdir / "corrupt").iterdir())) == 1
    for a, b in zip(_params(workdir, _config(), 20), _params(trained, _config(), 20)):
        np.testing.assert_array_equal(a, b)
    assert _record_keys(workdir) == _record_keys(trained)


@pytest.mark.slow
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


@pytest.mark.slow
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
    run = ("train.steps=100000", "train.log_every=1", *ONE_LAYER)
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


# ----------------------------------------------------------------------------- write failures


def _no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _at_step_10(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run as it was at step 10 (its step-20 checkpoint not written yet)."""
    workdir = _copy(trained, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "20")
    return workdir


def _until_still(directory: Path, timeout: float = 60) -> None:
    """Waits until nothing is written under `directory` any more: the failed save's other writes may
    still be running in orbax's threads of this process (a real run's process has ended by then)."""
    listing, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = sorted((str(p), p.stat().st_size) for p in directory.rglob("*") if p.is_file())
        if now == listing:
            return
        listing = now
        time.sleep(1.0)


def _resumes_from_10_to_the_same_run(workdir: Path, trained: Path, capsys) -> None:
    summary = loop.train(make_task(_config()), workdir)
    err = capsys.readouterr().err
    assert "resumed from step 10" in err and summary["step"] == 20
    assert not list(workdir.rglob("*.orbax-checkpoint-tmp*"))
    for a, b in zip(_params(workdir, _config(), 20), _params(trained, _config(), 20)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_checkpoint_the_disk_refuses_stops_the_run_and_is_never_restored(
    trained, tmp_path, monkeypatch, capsys
):
    """The step-20 save fails part-way (its state written, its progress item refused, as on a full
    disk) in orbax's background thread: the run stops with one line naming the file; the resume
    removes the unfinished save and continues from step 10, on the uninterrupted run's parameters."""
    workdir = _at_step_10(trained, tmp_path)
    handler = ocp.handlers.JsonCheckpointHandler
    save = handler._save_fn

    async def refused(self, item, directory):
        if Path(directory).parent.name.startswith("20."):
            raise _no_space(directory / self._filename)
        return await save(self, item, directory)

    monkeypatch.setattr(handler, "_save_fn", refused)
    with pytest.raises(files.WriteFailed) as e:
        loop.train(make_task(_config("train.async_checkpointing=true")), workdir)
    tmp = workdir / "checkpoints" / "20.orbax-checkpoint-tmp"
    assert (
        str(e.value)
        == f"cannot write {tmp}/progress.orbax-checkpoint-tmp/metadata: No space left on device (ENOSPC)"
    )
    assert tmp.is_dir() and integrity.newest_whole(workdir / "checkpoints") == 10
    assert "Traceback" not in capsys.readouterr().err  # orbax's own reports of it are not printed
    monkeypatch.undo()
    _until_still(tmp)
    _resumes_from_10_to_the_same_run(workdir, trained, capsys)


@pytest.mark.slow
def test_a_manifest_the_disk_refuses_leaves_a_step_that_is_never_restored(
    trained, tmp_path, monkeypatch, capsys
):
    workdir = _at_step_10(trained, tmp_path)
    write_text = files.write_text

    def refused(path, text):
        if path.name == integrity.MANIFEST and path.parent.name == "20":
            with files.writing(path):
                raise _no_space(path)
        write_text(path, text)

    monkeypatch.setattr(files, "write_text", refused)
    with pytest.raises(
        files.WriteFailed, match=f"^cannot write {workdir}/checkpoints/20/{integrity.MANIFEST}: "
    ):
        loop.train(make_task(_config()), workdir)
    monkeypatch.undo()
    assert (workdir / "checkpoints" / "20").is_dir()  # committed by orbax, but without its manifest
    _resumes_from_10_to_the_same_run(workdir, trained, capsys)


@pytest.mark.slow
def test_a_metrics_line_the_disk_refuses_ends_the_cli_in_one_line(tmp_path):
    """Through `python -m experiments train`: exit code 2 and one line naming metrics.jsonl and the last
    intact checkpoint; no traceback (nor the prints of orbax's and TensorBoard's threads at shutdown)."""
    workdir = tmp_path / "run"
    program = """
import errno, os, sys
from gem_jax.train import loop

class Full:  # metrics.jsonl on a disk that fills up after step 10 (logged every 5 steps)
    def __init__(self, file):
        self.file = file
    def write(self, text):
        if text.startswith('{"step": 15,'):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(text)
    def __getattr__(self, name):
        return getattr(self.file, name)

opened = loop.MetricsWriter.__init__
def full(self, *args, **kwargs):
    opened(self, *args, **kwargs)
    self.file = Full(self.file)
loop.MetricsWriter.__init__ = full
from experiments.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
    args = ["train", "--workdir", str(workdir), *_config_args(tmp_path)]
    r = subprocess.run(
        [sys.executable, "-c", program, *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    _ends_with_error(
        r.stderr,
        f"cannot write {workdir / 'metrics.jsonl'}: No space left on device (ENOSPC): stopping; the last "
        f"intact checkpoint is step 10 ({workdir / 'checkpoints' / '10'}): re-run the same command to "
        "resume from it",
    )


def _ends_with_error(stderr: str, line: str) -> None:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert lines and lines[-1] == line and "Traceback" not in stderr, stderr[-3000:]


# ----------------------------------------------------------------------------- restarts


@pytest.mark.slow
def test_kill_9_then_a_restart_resumes_with_no_duplicate_metrics(tmp_path):
    """kill -9 of the trainer past a checkpoint, under `--restarts 1`: its supervisor reports it in one
    line and relaunches it; it resumes from the last intact checkpoint, logs the restart in
    resumes.jsonl, and metrics.jsonl has every step once (the records past the checkpoint, written
    before the kill, are dropped and written again)."""
    workdir = tmp_path / "run"
    run = ("train.steps=12", "train.checkpoint_every=3", "train.log_every=1")
    proc = _start("train", "--workdir", str(workdir), "--restarts", "1", *_config_args(tmp_path, *run))
    # Past the step-3 checkpoint, and its save finished (it is written in the background).
    saved = workdir / "checkpoints" / "3" / integrity.MANIFEST
    _wait_for(lambda: _lines(workdir / "metrics.jsonl") >= 5 and saved.exists(), proc)
    (trainer,) = child_pids(proc.pid)  # the supervisor's one child
    os.kill(trainer, signal.SIGKILL)
    logged = last_logged_step(workdir / "metrics.jsonl")  # before the relaunch (1 s later, then start-up)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    (killed,) = [
        line for line in err.splitlines() if line.startswith("the trainer was killed by SIGKILL at step")
    ]
    resumed = int(killed.split("the last intact checkpoint is step ")[1].split()[0])
    assert logged > resumed >= 3  # records past the checkpoint existed: they would be written twice
    assert "restart 1 of 1 in 1 s, from the last intact checkpoint" in err and "Traceback" not in err
    last = json.loads((workdir / "resumes.jsonl").read_text().splitlines()[-1])
    assert last["resumed_from_step"] == resumed
    assert last["restart"] == {"attempt": 1, "of": 1, "after": killed}
    assert [step for step, split in _record_keys(workdir) if split is None] == list(range(1, 13))
