"""A window of a real run traced with jax.profiler (`python -m experiments train --profile-steps A:B`).

The trace lands in `<workdir>/profile/` as a TensorBoard log directory (XProf `.xplane.pb`, open it
with `tensorboard --logdir` or `xprof --logdir`) plus `perfetto_trace.json.gz` for ui.perfetto.dev;
`python -m experiments profile` (docs/profiling.md) gives the per-group table of a step. No profiler
server is started, so nothing listens on any port.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax


class TraceWindow:
    """Traces global steps [start, stop) of a run: starts before the first step in the window (also
    after a resumption inside it), stops once step `stop` has run (waiting for its outputs)."""

    def __init__(self, steps: tuple[int, int] | None, log_dir: Path):
        self.steps = steps
        self.log_dir = log_dir
        self.active = False
        self.done = steps is None

    def before(self, step: int) -> None:
        """Call before running global step `step` (0-based count of steps done)."""
        if not self.done and not self.active and self.steps[0] <= step < self.steps[1]:
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, outputs: Any) -> None:
        """Call after dispatching a step, `step` being the count of steps done."""
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.done = True
            print(f"profile of steps {self.steps[0]}:{self.steps[1]} in {self.log_dir}", file=sys.stderr)
