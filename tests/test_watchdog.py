"""The stall watchdog (gem_jax/train/watchdog.py): quiet while steps finish or while paused, one call
when they stop; in the CLI, a stalled first step ends the run with exit 76, one line and the stacks."""

from __future__ import annotations

import re
import time

import pytest

from gem_jax.train.watchdog import STALLED_EXIT, Watchdog
from tests.helpers import SMALL, run_cli


def _watch(first_s: float, step_s: float) -> tuple[Watchdog, list]:
    calls: list = []
    return Watchdog(first_s, step_s, lambda step, waited: calls.append((step, waited)), poll_s=0.02), calls


def test_beats_and_pauses_keep_it_quiet_and_a_stall_is_reported_once():
    dog, calls = _watch(first_s=0.5, step_s=0.15)
    with dog:
        time.sleep(0.3)  # within the first step's allowance
        for step in range(1, 6):
            dog.beat(step)
            time.sleep(0.05)
        with dog.paused():  # an evaluation: longer than a step
            time.sleep(0.4)
        dog.beat(6)
        assert calls == []
        time.sleep(0.5)  # no beat: stalled after step 6
    assert len(calls) == 1 and calls[0][0] == 6 and 0.15 < calls[0][1] < 0.5


def test_the_first_step_has_its_own_allowance_and_zero_turns_a_bound_off():
    dog, calls = _watch(first_s=0.1, step_s=10.0)
    with dog:
        time.sleep(0.4)
    assert len(calls) == 1 and calls[0][0] is None
    dog, calls = _watch(first_s=0.0, step_s=0.0)
    with dog:
        time.sleep(0.2)
    assert calls == [] and dog._thread is None


@pytest.mark.slow
def test_a_stalled_first_step_ends_the_cli_with_its_line_and_the_stacks(tmp_path):
    """A first-step allowance far below the step's compile time: the run stops as a stalled one would."""
    workdir = tmp_path / "run"
    args = [f"--set={o}" for o in SMALL]
    r = run_cli(
        "train", "--workdir", str(workdir), *args, "--set=train.first_step_timeout_s=0.01", timeout=300
    )
    assert r.returncode == STALLED_EXIT, r.stderr[-3000:]
    stacks = workdir / "stalled-0.txt"
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"stalled in this invocation's first step \(step 1\): no step finished within "
        rf"train.first_step_timeout_s=0.01 s \(waited \d+ s\); every thread's stack is in {re.escape(str(stacks))}",
        last,
    ), last
    assert "Thread" in stacks.read_text() and "loop.py" in stacks.read_text()  # the main thread, in the loop
