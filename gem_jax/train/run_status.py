"""Where this process's run is (its step, its checkpoint folder), for the one-line reports of stops
that come from outside the training loop: a lost peer (gem_jax/train/peers.py), a failed write
(experiments/__main__.py) and a trainer that died under its supervisor (gem_jax/train/supervisor.py).

The supervisor is another process: it passes the write end of a pipe in `GEM_JAX_STATUS_FD`, and the
trainer's `STATUS` sends each change as one line ("step 7", "checkpoints /runs/a/checkpoints"), which
the supervisor's own `RunStatus` reads back (`read`). Writes never block training: a full pipe drops
the line (the next step's replaces it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gem_jax.train import integrity

STATUS_FD = "GEM_JAX_STATUS_FD"


class RunStatus:
    def __init__(self, fd: int | None = None):
        self.step: int | None = None  # the last step this process finished
        self.checkpoints: Path | None = None
        self._fd = fd

    @classmethod
    def from_environment(cls) -> RunStatus:
        """The trainer's status; sent to a supervisor when one passed its pipe."""
        fd = os.environ.pop(STATUS_FD, None)  # (not for the trainer's own child processes)
        if not fd:
            return cls()
        with contextlib.suppress(OSError, ValueError):
            os.set_blocking(int(fd), False)
            os.set_inheritable(int(fd), False)  # not for the data workers' processes
            return cls(int(fd))
        return cls()

    def training(self, checkpoints: Path) -> None:
        """The run's checkpoint folder (the last intact checkpoint is looked up there)."""
        self.checkpoints = Path(checkpoints).absolute()
        self._send(f"checkpoints {self.checkpoints}")

    def at_step(self, step: int) -> None:
        self.step = step
        self._send(f"step {step}")

    def read(self, line: str) -> None:
        """Applies one line from a trainer's pipe (the supervisor's side)."""
        key, _, value = line.strip().partition(" ")
        if key == "step" and value.isdigit():
            self.step = int(value)
        elif key == "checkpoints" and value:
            self.checkpoints = Path(value)

    def _send(self, line: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (line + "\n").encode())
        except BlockingIOError:
            pass  # the supervisor is behind: the next line carries the news
        except OSError:
            self._fd = None  # the supervisor is gone

    # ------------------------------------------------------------------------- report phrases

    def where(self) -> str:
        """ "at step 7", or "before the first step" when none was finished here."""
        return "before the first step" if self.step is None else f"at step {self.step}"

    def last_intact(self) -> str:
        """The last intact checkpoint and what re-running the same command does with it."""
        if self.checkpoints is None:  # not training (evaluating, or still starting)
            return "re-run the same command"
        step = None
        with contextlib.suppress(OSError):
            step = integrity.newest_whole(self.checkpoints)
        if step is None:
            return "there is no intact checkpoint yet: re-run the same command to start over"
        return (
            f"the last intact checkpoint is step {step} ({self.checkpoints / str(step)}): re-run the "
            "same command to resume from it"
        )


STATUS = RunStatus.from_environment()
