"""The supervisor (gem_jax/train/supervisor.py) around stand-in trainers, small Python programs that end
the way a trainer does: jax's abort when the coordinator is gone (its fatal log line and native stack
trace), a crash, a config error, a SIGTERM. It reports each end in one line with the step and the last
intact checkpoint that the trainer sent it, leaves jax's native trace out, relaunches while restarts
are left (except after a final end), and passes a signal on to the trainer once. No jax here: the real
runs are in tests/test_multiprocess.py and tests/test_reliability.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gem_jax.train import integrity, supervisor

ROOT = Path(__file__).resolve().parent.parent

TRAINER = textwrap.dedent(
    """
    import os, signal, sys, time
    checkpoints, how = sys.argv[1:]
    os.write(int(os.environ["GEM_JAX_STATUS_FD"]), f"checkpoints {checkpoints}\\nstep 7\\n".encode())
    if os.environ.get("GEM_JAX_RESTART"):
        print("relaunched after:", os.environ["GEM_JAX_RESTART"], file=sys.stderr)
        sys.exit(0)
    print("training", file=sys.stderr, flush=True)
    if how == "coordinator lost":  # what jax 0.10 prints when process 0 is gone, then SIGABRT
        os.write(2, b"E1201 17:35:11.770441   15451 coordination_service_agent.cc:289] Polled an error "
                    b"from coordination service (this can be an error from this or another task).\\n"
                    b"F1201 17:35:11.770493   15451 client.h:80] Terminating process because the JAX "
                    b"distributed service detected fatal errors. This most likely indicates that another "
                    b"task died\\nAdditional GRPC error information from remote target coordination_service "
                    b"while calling /xla.coordination.CoordinationService/PollForError:\\n"
                    b"*** Check failure stack trace: ***\\n    @     0x7f5907240634  absl::LogMessage::Flush()\\n")
        time.sleep(0.5)
        os.abort()
    if how == "config error":
        print("config error: no such key", file=sys.stderr)
        sys.exit(2)
    if how == "crash":
        sys.exit(1)
    if how == "stall":
        print("stalled after step 7: no step finished within train.stall_timeout_s=900 s", file=sys.stderr)
        sys.exit(76)
    if how == "signal":
        signal.signal(signal.SIGTERM, lambda s, f: (print("SIGTERM", os.getpgid(0) != os.getpgid(os.getppid()),
                                                        file=sys.stderr, flush=True), sys.exit(0)))
        print("ready", file=sys.stderr, flush=True)
        time.sleep(600)
    """
)


@pytest.fixture
def trainer(tmp_path) -> list[str]:
    path = tmp_path / "trainer.py"
    path.write_text(TRAINER)
    return [sys.executable, str(path)]


@pytest.fixture
def checkpoints(tmp_path) -> Path:
    """A checkpoint folder whose last intact step is 5."""
    folder = tmp_path / "checkpoints"
    (folder / "5").mkdir(parents=True)
    (folder / "5" / "state").write_bytes(b"x" * 10)
    integrity.write_manifest(folder / "5")
    return folder


def _intact(checkpoints: Path) -> str:
    return f"the last intact checkpoint is step 5 ({checkpoints / '5'}): re-run the same command to resume from it"


def test_the_coordinators_loss_is_one_line_without_the_native_trace(trainer, checkpoints, capfd):
    code = supervisor.run([str(checkpoints), "coordinator lost"], restarts=0, settle_s=0.0, command=trainer)
    err = capfd.readouterr().err
    assert code == 75
    assert err.splitlines() == [
        "training",
        f"lost process 0 (the coordinator) at step 7: stopping; {_intact(checkpoints)}",
    ]


def test_a_restart_relaunches_with_its_record_and_a_final_end_is_not_restarted(trainer, checkpoints, capfd):
    assert supervisor.run([str(checkpoints), "crash"], restarts=1, settle_s=0.0, command=trainer) == 0
    err = capfd.readouterr().err.splitlines()
    crashed = f"the trainer exited with code 1 at step 7: {_intact(checkpoints)}"
    assert err[:3] == ["training", crashed, "restart 1 of 1 in 0 s, from the last intact checkpoint"]
    assert err[3].startswith("relaunched after: ")
    assert json.loads(err[3].split(": ", 1)[1]) == {"attempt": 1, "of": 1, "after": crashed}
    assert supervisor.run([str(checkpoints), "config error"], restarts=1, settle_s=0.0, command=trainer) == 2
    assert capfd.readouterr().err.splitlines() == ["training", "config error: no such key"]


def test_a_stall_is_the_trainers_own_line_and_restarts(trainer, checkpoints, capfd):
    assert supervisor.run([str(checkpoints), "stall"], restarts=1, settle_s=0.0, command=trainer) == 0
    err = capfd.readouterr().err.splitlines()
    stalled = "stalled after step 7: no step finished within train.stall_timeout_s=900 s"
    assert err[:3] == ["training", stalled, "restart 1 of 1 in 0 s, from the last intact checkpoint"]
    assert json.loads(err[3].split(": ", 1)[1]) == {"attempt": 1, "of": 1, "after": stalled}


def test_restarts_are_counted(trainer, checkpoints, capfd):
    assert supervisor.run([str(checkpoints), "crash"], restarts=0, settle_s=0.0, command=trainer) == 1
    assert (
        capfd.readouterr().err.splitlines()[-1]
        == f"the trainer exited with code 1 at step 7: {_intact(checkpoints)}"
    )


def _signal_state(pid: int) -> str:
    """The signal lines of /proc/PID/status (blocked, ignored, caught), for a failure message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return f"{pid}: gone"
    return f"{pid}: " + " ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_a_signal_to_the_supervisor_reaches_the_trainer_once(trainer, checkpoints):
    """SIGTERM to the supervisor (a scheduler's, or Ctrl-C's SIGINT, which reaches the supervisor's
    process group only: the trainer has its own) is passed on; the trainer's exit code is final.
    The supervisor starts with SIGINT/SIGTERM blocked, as when a launcher's thread has them blocked
    (a mask is inherited across exec): it must unblock them, for itself and for the trainer."""
    program = (
        "import signal, sys; from gem_jax.train import supervisor; "
        "signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM)); "
        f"sys.exit(supervisor.run([{str(checkpoints)!r}, 'signal'], restarts=1, settle_s=0.0, command={trainer!r}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    lines = []
    while "ready" not in lines:
        lines.append(proc.stderr.readline().strip())
        assert time.monotonic() < deadline and proc.poll() is None, lines
    os.kill(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        state = [_signal_state(pid) for pid in (proc.pid, *map(int, children))]
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        proc.kill()
        raise AssertionError(f"the SIGTERM was not passed on within 120 s; {state}") from None
    assert proc.returncode == 0 and err.splitlines() == ["SIGTERM True"], err  # its own process group
