"""Multi-process training: 2 local CPU processes (4 fake devices each, gloo collectives) started with
`python -m experiments train --coordinator ... --num-processes 2 --process-id i` give the same loss
curve and validation metrics as one process on the same global mesh (dcn=2 slow x data=4 fast, 8
batch shards), for the ranking and the next-item task; the checkpoint they write resumes in one
process and finishes with the single-process run's curve. A SIGTERM to one process stops both after
the same step, with one checkpoint; before the first step, it ends both at once. A process killed
mid-run stops the other within seconds, in one line; `--restarts` relaunches both, and they finish the
run from the last intact checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from gem_jax.config import config_to_toml, load_config
from gem_jax.tasks import make_task
from gem_jax.train import integrity, loop
from gem_jax.train.checkpoint import Checkpointer
from tests.helpers import SMALL, child_pids, last_logged_step, start_cli
from tests.test_retrieval import SMALL_ARGS, write_cyclic_pairs

ROOT = Path(__file__).resolve().parent.parent
MESH = [
    'parallel.mesh_axes=["dcn", "data"]',
    "parallel.mesh_shape=[2, 4]",
    'parallel.slow_axes=["dcn"]',
    'parallel.rules={shard=["dcn", "data"]}',
]
# float32 compute: the one- and two-process runs then agree to float rounding (gloo and the in-process
# all-reduce sum in other orders). In bfloat16 such rounding differences flip a few activation gradients
# by a bfloat16 ulp (2^-8) and the losses part by ~1e-4 within a few steps (test_train's
# test_sharded_step_equals_single_device measures it), too loose to tell a wrong collective from noise.
LEAN = ["model.num_layers=1", "model.wukong_layers=1", "train.log_every=1", "precision.compute_dtype=float32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_processes(workdir: Path, config, extra: list[str]) -> list[subprocess.Popen]:
    """`python -m experiments train` as processes 0 and 1 of a 2-process run; output in workdir.{i}.log."""
    config_path = workdir.parent / f"{workdir.name}.toml"
    config_path.write_text(config_to_toml(config))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    port = _free_port()
    procs = []
    for i in range(2):
        args = [
            "train",
            "--config",
            str(config_path),
            "--workdir",
            str(workdir),
        ]
        args += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        with open(workdir.parent / f"{workdir.name}.{i}.log", "w") as log:
            procs.append(start_cli(*args, *extra, env=env, stdout=log, stderr=subprocess.STDOUT, text=False))
    return procs


def _wait_two_processes(
    workdir: Path, procs: list[subprocess.Popen], timeout: float, expect: tuple[int, int] = (0, 0)
) -> list[str]:
    """Waits for both (killing them past `timeout`: a hung run fails here); asserts their exit codes
    (`expect`); the logs."""
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                codes.append(f"still running after {timeout:.0f} s (killed)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(workdir.parent / f"{workdir.name}.{i}.log").read_text() for i in range(2)]
    assert codes == list(expect), "\n\n".join(
        f"process {i}: {c}\n{t[-3000:]}" for i, (c, t) in enumerate(zip(codes, logs))
    )
    return logs


def _train_two_processes(workdir: Path, config, stop_after: int) -> None:
    procs = _start_two_processes(workdir, config, ["--stop-after", str(stop_after)])
    logs = _wait_two_processes(workdir, procs, timeout=600)
    assert "process 1 of 2: 4 local cpu device(s), 8 in all" in logs[1]
    # The device order, printed once: the second host-sized row of the mesh is process 1's devices.
    assert re.search(r"dcn=1: \[\d+ \d+ \d+ \d+\] \(process 1\)", logs[0]), logs[0][-3000:]
    assert "device ids in mesh order" not in logs[1]


def _records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r and "split" not in r}


def _evals(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r["valid"] for r in records if r.get("split") == "valid"}


def _same_run(reference: Path, resumed: Path, total: int) -> None:
    ref, got = _records(reference), _records(resumed)
    ref_losses, got_losses = _losses(ref), _losses(got)
    assert sorted(got_losses) == list(range(1, total + 1)) == sorted(ref_losses)
    np.testing.assert_allclose(
        [got_losses[s] for s in range(1, total + 1)], [ref_losses[s] for s in range(1, total + 1)], rtol=1e-5
    )
    ref_evals, got_evals = _evals(ref), _evals(got)
    assert sorted(got_evals) == sorted(ref_evals) and ref_evals
    for step, metrics in ref_evals.items():
        flat_ref, flat_got = _flat(metrics), _flat(got_evals[step])
        assert flat_ref.keys() == flat_got.keys()
        np.testing.assert_allclose([flat_got[k] for k in flat_ref], list(flat_ref.values()), rtol=1e-4)


def _flat(metrics: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = float(v)
    return out


@pytest.mark.slow
def test_ranking_two_processes_match_one_and_resume_in_one(tmp_path):
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    overrides = [*SMALL, *MESH, *LEAN, "train.steps=6", "train.eval_every=4", "train.checkpoint_every=0"]
    overrides.append("train.max_minutes=1000")  # every step asks process 0 whether time is up (no)
    two_processes_match_one_and_resume_in_one(load_config(None, overrides), tmp_path)


def two_processes_match_one_and_resume_in_one(config, tmp_path: Path) -> None:
    """A 6-step ranking run: one process, and two stopped after step 2, resumed in two to step 4, then
    resumed in one, log the same (each process restores its own data position: it was once taken for a
    position of fewer batch shards and resharded, skipping examples)."""
    loop.train(make_task(config), tmp_path / "one")
    _train_two_processes(tmp_path / "two", config, stop_after=2)
    assert sorted(_losses(_records(tmp_path / "two"))) == [1, 2]
    _train_two_processes(tmp_path / "two", config, stop_after=4)
    assert sorted(_losses(_records(tmp_path / "two"))) == [1, 2, 3, 4]
    summary = loop.train(make_task(config), tmp_path / "two")  # resumes at step 4 in this one process
    assert summary["step"] == 6
    _same_run(tmp_path / "one", tmp_path / "two", total=6)


@pytest.mark.slow
def test_next_item_two_processes_match_one_and_resume_in_one(tmp_path):
    data = write_cyclic_pairs(tmp_path / "cyclic.txt", num_users=96)
    overrides = [
        *SMALL_ARGS,
        *MESH,
        f"data.path={data}",
        "data.examples_per_shard=4",
        "model.num_layers=1",
        "retrieval.epochs=2",
        "retrieval.eval_every_epochs=1",
        "train.log_every=1",
        "train.checkpoint_every=0",
    ]
    config = load_config(None, overrides)
    task = make_task(config)
    per_epoch = task._epochs.steps_in_epoch(0)
    assert per_epoch >= 2, "two steps per epoch at least, so the run stops mid-epoch 2"
    loop.train(task, tmp_path / "one")
    _train_two_processes(tmp_path / "two", config, stop_after=per_epoch + 1)  # evaluates epoch 1
    summary = loop.train(make_task(config), tmp_path / "two")
    assert summary["epoch"] == 2 and not summary["interrupted"]
    _same_run(tmp_path / "one", tmp_path / "two", total=task.total_steps())
    one, two = (json.loads((tmp_path / w / "test.json").read_text()) for w in ("one", "two"))
    assert one["step"] == two["step"]
    np.testing.assert_allclose(
        list(_flat(two["test"]).values()), list(_flat(one["test"]).values()), rtol=1e-4
    )


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    """A SIGTERM to process 1 alone: both processes agree to stop after the same step, save one complete
    checkpoint together and exit 0 (each deciding alone, process 1 would wait in the save's collectives
    and process 0 in the next step's: a hang, which the timeout turns into a failure here). The
    checkpoint resumes in one process on the uninterrupted run's curve."""
    overrides = [*SMALL, *MESH, *LEAN, "train.steps=100000", "train.eval_every=2", "train.checkpoint_every=0"]
    overrides += ["train.progress=false", "train.async_checkpointing=false"]
    config = load_config(None, overrides)
    workdir = tmp_path / "two"
    procs = _start_two_processes(workdir, config, [])
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    # Step 2 logged by process 0: process 1 has started step 2, so it is past its first step, where a
    # signal asks for a checkpoint (before it, a signal ends the process at once).
    while last_logged_step(metrics) < 2:
        assert all(p.poll() is None for p in procs), "a process ended before training got under way"
        assert time.monotonic() < deadline, "no step 2 after 300 s"
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    logs = _wait_two_processes(workdir, procs, timeout=120)
    assert "SIGTERM: saving a checkpoint after this step" in logs[1]
    steps = [int(re.search(r"== \S+ at step (\d+)", text).group(1)) for text in logs]
    assert steps[0] == steps[1] >= 2, steps
    assert all("interrupted (checkpoint saved)" in text for text in logs)
    stop = steps[0]
    checkpoints = Checkpointer(workdir / "checkpoints", config.train, read_only=True)
    try:
        assert checkpoints.all_steps()[-1] == stop  # (and the evaluations' saves before it)
        assert checkpoints.newest_intact() == stop
    finally:
        checkpoints.close()
    end = stop + 2
    summary = loop.train(make_task(config), workdir, stop_after=end)  # resumes at `stop` in one process
    assert summary["step"] == end
    loop.train(make_task(config), tmp_path / "one", stop_after=end)
    _same_run(tmp_path / "one", workdir, total=end)


@pytest.mark.slow
def test_a_signal_before_the_first_step_ends_every_process(tmp_path):
    """SIGTERM to process 1 while the processes compile: both end at once with 128 + SIGTERM, each with
    one line (process 0 names process 1), as one process does; nothing is saved."""
    config = load_config(None, [*SMALL, *MESH, *LEAN, "train.steps=100"])
    workdir = tmp_path / "two"
    procs = _start_two_processes(workdir, config, ["--peer-timeout", "3"])
    log = workdir.parent / f"{workdir.name}.1.log"
    deadline = time.monotonic() + 300
    while "embedding tables" not in (log.read_text() if log.exists() else ""):  # built; compiling next
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    logs = _wait_two_processes(workdir, procs, timeout=60, expect=(143, 143))
    assert logs[1].splitlines()[-1] == "SIGTERM: exiting (nothing to save yet)"
    assert logs[0].splitlines()[-1] == "process 1: SIGTERM: exiting (nothing to save yet)"
    assert not any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_lost_process_stops_the_other_in_one_line_and_restarts_finish_the_run(tmp_path):
    """kill -9 of process 1's trainer mid-run: process 0 stops within the peer timeout (3 s) and a few
    seconds (60 s at most), with one line naming process 1, the step and the last intact checkpoint,
    and no native stack trace or traceback. With --restarts 1 each process's supervisor relaunches its
    trainer; they meet again at the coordinator's address and finish from that checkpoint."""
    overrides = [*SMALL, *MESH, *LEAN, "train.steps=100000", "train.checkpoint_every=2", "train.eval_every=0"]
    config = load_config(None, overrides)
    workdir = tmp_path / "two"
    procs = _start_two_processes(
        workdir, config, ["--peer-timeout", "3", "--restarts", "1", "--stop-after", "7"]
    )
    deadline = time.monotonic() + 600  # 113 s alone; more than 300 s once beside the rest of the suite
    saved = workdir / "checkpoints" / "2" / integrity.MANIFEST  # the step-2 save finished (in the background)
    while last_logged_step(workdir / "metrics.jsonl") < 3 or not saved.exists():
        if not all(p.poll() is None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            logs = [(workdir.parent / f"{workdir.name}.{i}.log").read_text()[-2000:] for i in range(2)]
            pytest.fail(f"no step 3 within 600 s, or a process ended: {[p.poll() for p in procs]}\n{logs}")
        time.sleep(0.1)
    (trainer,) = child_pids(procs[1].pid)  # its supervisor's one child
    os.kill(trainer, signal.SIGKILL)
    killed_at, log = time.monotonic(), workdir.parent / f"{workdir.name}.0.log"
    while "lost process 1" not in log.read_text():
        assert time.monotonic() - killed_at < 60, log.read_text()[-3000:]
        time.sleep(0.1)
    stopped_after = time.monotonic() - killed_at
    logs = _wait_two_processes(workdir, procs, timeout=600)  # both restarted and reached --stop-after
    (lost,) = [line for line in logs[0].splitlines() if line.startswith("lost process 1")]
    found = re.fullmatch(
        r"lost process 1 at step (\d+) \(no sign of life for 3 s\): stopping; the last intact checkpoint "
        r"is step (\d+) \((\S+)\): re-run the same command to resume from it",
        lost,
    )
    assert found and int(found.group(1)) > int(found.group(2)) >= 2, lost
    assert Path(found.group(3)) == workdir / "checkpoints" / found.group(2)
    assert stopped_after < 30, stopped_after
    for text in logs:
        assert "Traceback" not in text and "Check failure" not in text and "client.h" not in text, text[
            -3000:
        ]
        assert "restart 1 of 1 in 8 s, from the last intact checkpoint" in text
        assert re.search(r"== \S+ at step 7\n", text)
    assert "the trainer was killed by SIGKILL at step" in logs[1]
    last = json.loads((workdir / "resumes.jsonl").read_text().splitlines()[-1])  # written by process 0
    assert last["resumed_from_step"] == int(found.group(2))
    assert last["restart"] == {"attempt": 1, "of": 1, "after": lost}
