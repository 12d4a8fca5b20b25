"""A stalled run ends instead of holding its machines: when no training step has finished for
`train.stall_timeout_s` seconds (the invocation's first step, which compiles, gets
`train.first_step_timeout_s`), every thread's Python stack goes to `WORKDIR/stalled-<process>.txt`,
one line says where it stopped, and the process exits with code 76 (in a multi-process run the other
processes are told and exit too: gem_jax/train/interrupt.py `exit_now`). Under `--restarts` the
supervisor then relaunches it from the last intact checkpoint.

Why: gem_jax/train/peers.py catches a peer that died, not one that is alive and stuck. A collective
that never completes (a gloo or NCCL exchange that lost its partner, a device that stopped answering)
blocks the host at the next value it fetches, with every heartbeat still beating; seen in this
project's own two-process CPU runs (both processes idle for 30 minutes after gloo's start-up).

Evaluation and checkpoint saves run inside `paused()`: they may take longer than a step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gem_jax.train import interrupt

STALLED_EXIT = 76


class Watchdog:
    """Calls `on_stall(step, seconds)` once, from its own thread, when `beat` was not called in time
    (`step`: the last beat's, None before the first).

    `first_s` bounds the wait for the first beat, `step_s` each later one; 0 turns that bound off."""

    def __init__(
        self,
        first_s: float,
        step_s: float,
        on_stall: Callable[[int | None, float], None],
        poll_s: float = 1.0,
    ):
        self.first_s, self.step_s, self.on_stall, self.poll_s = first_s, step_s, on_stall, poll_s
        self.step: int | None = None  # the last step a beat reported (None: none yet)
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if self.first_s or self.step_s:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="gem-stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def beat(self, step: int) -> None:
        self.step, self._last = step, time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            limit = self.first_s if self.step is None else self.step_s
            waited = time.monotonic() - self._last
            if limit and not self._paused and waited > limit:
                self.on_stall(self.step, waited)
                return


def exit_stalled(workdir: Path, process: int, start: int, first_s: float, step_s: float) -> Callable:
    """The trainer's `on_stall`: writes the stacks, says so in one line, ends the run (module docstring)."""

    def on_stall(step: int | None, waited: float) -> None:

        path = Path(workdir) / f"stalled-{process}.txt"
        with contextlib.suppress(OSError), open(path, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        if step is None:
            at, bound = (
                f"in this invocation's first step (step {start + 1})",
                f"first_step_timeout_s={first_s:g}",
            )
        else:
            at, bound = f"after step {step}", f"stall_timeout_s={step_s:g}"
        interrupt.exit_now(
            STALLED_EXIT,
            f"stalled {at}: no step finished within train.{bound} s (waited {waited:.0f} s); "
            f"every thread's stack is in {path}",
        )

    return on_stall
