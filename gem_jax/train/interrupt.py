"""SIGINT/SIGTERM at any moment: a saved checkpoint or a clean exit, never a traceback or a crash.

Why the handler never raises KeyboardInterrupt: jaxlib compiles on a worker thread while the main
thread waits; a KeyboardInterrupt raised in that wait unwinds the main thread and the interpreter
shuts down under the running compilation, which then dereferences freed device objects
(`xla::ifrt::SingleDeviceSharding::Create` from a compile thread: segmentation fault, exit -11;
reproduced with jax 0.10.2 by Ctrl-C in the first seconds of `python -m experiments train`).

So a signal is one of two things, depending on what the process is doing:

* nothing to save (start-up, compilation, restore, data workers starting, the first step of this
  invocation, evaluation-only commands): the process ends at once with one line and exit code
  128 + signal number, through `os._exit`, which skips the interpreter shutdown that races the
  background threads. Grain worker processes are killed first; the workdir lock goes with the
  process (the OS drops it).
* inside `saving()` (the training loop, and its last save): the first signal sets `requested`;
  the loop saves a checkpoint after the current step and returns normally. A second signal ends
  the process at once, as above: a save in flight leaves an orbax temporary folder, which the next
  start removes. In a multi-process run the processes agree once per step whether any of them has
  a pending signal, and all stop after the same step (gem_jax/train/loop.py; jax's own SIGTERM
  handler, its preemption service, is turned off in gem_jax/distributed.py).

In a multi-process run, an exit at once reaches every process: `exit_now` first tells the others
(gem_jax/train/peers.py), which exit the same way, with the same code, within a second. So a signal
to one process before the first step, a second signal, or a signal after the loop (during the
test-split scoring, say) ends all of them, as a first signal in the loop stops all of them.

Grain worker processes (`data.num_workers`) are started with SIGINT and SIGTERM blocked
(`blocked()` around the data iterator's start): Ctrl-C in a terminal signals the whole process
group, and a worker that died of it would surface as a worker-crash traceback in the trainer.
They watch their parent instead (`worker_init`) and exit when it is gone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """The process's SIGINT/SIGTERM handler (one per process: signal handlers are process-wide)."""

    def __init__(self):
        self.requested: int | None = None  # the first signal received inside saving()
        self._saving = 0  # depth of saving() contexts
        self._saved = False  # a saving() context ended normally: the run's checkpoint is written
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> dict[int, object]:
        """Installs the handler (main thread only); returns the previous handlers.

        Also unblocks the signals in this thread: a mask is inherited across exec, and a launcher
        that starts the CLI from a thread with them blocked would make it deaf to Ctrl-C."""
        previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        self._installed = True
        return previous

    @contextlib.contextmanager
    def handling(self) -> Iterator[Interrupts]:
        """Installs the handler for the duration (unless installed already, or not on the main thread)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = self.install()
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._installed = False
            self.requested = None
            self._saved = False

    @contextlib.contextmanager
    def saving(self) -> Iterator[Interrupts]:
        """While inside, a first signal only sets `requested` (the loop checkpoints and returns)."""
        self._saving += 1
        try:
            yield self
            self._saved = True
        finally:
            self._saving -= 1

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._saving and self.requested is None:
            self.requested = signum
            _say(f"{name}: saving a checkpoint after this step (a second signal exits at once)")
            return
        if self._saving:
            exit_now(128 + signum, f"{name} again: exiting without saving")
        if self._saved:
            exit_now(128 + signum, f"{name}: exiting (the checkpoint is saved)")
        exit_now(128 + signum, f"{name}: exiting (nothing to save yet)")


INTERRUPTS = Interrupts()


def _say(message: str) -> None:
    """One line on stderr without Python's buffered writer: the handler may run inside a print
    (a second call into the same BufferedWriter raises "reentrant call")."""
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())


_EXITING = threading.Lock()
# How `exit_now` tells a multi-process run's other processes (gem_jax/train/peers.py sets it when it starts
# watching them; None in a one-process run). A hook, so this module needs nothing from peers, which uses it.
_TELL_OTHERS: Callable[[int, str], None] | None = None


def tell_others_with(tell: Callable[[int, str], None] | None) -> None:
    """Sets how `exit_now` tells the other processes of a run (None: there are none)."""
    global _TELL_OTHERS
    _TELL_OTHERS = tell


def exit_now(code: int, message: str, *, tell_others: bool = True) -> None:
    """Ends the process at once: no interpreter shutdown (see the module docstring), children killed;
    in a multi-process run the other processes are told first (unless this exit is their stop)."""
    if not _EXITING.acquire(blocking=False):  # another thread is ending the process already
        while True:
            time.sleep(60)
    if tell_others and _TELL_OTHERS is not None:
        _TELL_OTHERS(code, message)
    with contextlib.suppress(Exception):
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
    _say(message)
    os._exit(code)


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Blocks SIGINT/SIGTERM in this thread; threads and processes started inside inherit the mask.

    A signal that arrives meanwhile is not lost: another thread takes it (the handler still runs on
    the main thread), or it stays pending until the mask is restored.

    multiprocessing's resource tracker (one helper process, started with the first semaphore or shared
    memory block) unblocks SIGINT/SIGTERM in whichever thread starts it; it is started here first,
    so that no thread inside does. It cleans up after worker processes that `exit_now` killed; its
    report of those leaked objects is a `UserWarning`, silenced (the clean-up itself still runs).
    """
    warning = "ignore::UserWarning:multiprocessing.resource_tracker"
    if warning not in sys.warnoptions:
        sys.warnoptions.append(warning)  # passed on to the tracker's command line as -W
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_init(index: int, count: int) -> None:
    """Grain `worker_init_fn`: no SIGINT/SIGTERM in data workers; exit when the trainer is gone
    (also after a kill -9 of the trainer, which would otherwise leave them running forever)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    exit_with_parent()


def exit_with_parent() -> None:
    """Ends this process, quietly, within a second of its parent's end (a data worker's trainer, a
    supervised trainer's supervisor: gem_jax/train/supervisor.py)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="gem-parent-watch", daemon=True).start()
