"""The supervisor: `python -m experiments train` runs the trainer as a child process, which it watches,
reports on and restarts (`--restarts K`).

Why a second process: when process 0 of a multi-process run dies, jax's coordination service (which
it hosts) goes with it, and jax ends every other process at once from a C++ thread: a fatal log line
and a native stack trace, nothing Python can catch (gem_jax/train/peers.py catches every other lost
peer itself). Only a parent sees that end; it turns it into the lost-peer line, with the step and the
last intact checkpoint that the trainer sends it (gem_jax/train/run_status.py). And a process cannot
relaunch itself after a crash: `--restarts` needs a parent.

When: every multi-process `train`, and `train --restarts K` with K > 0. Otherwise the trainer runs in
the launched process itself.

What it does:

* runs the same command line as a child (`GEM_JAX_SUPERVISED=1`) in a process group of its own: a
  Ctrl-C in the terminal reaches the supervisor alone, which passes each SIGINT/SIGTERM on once (the
  trainer decides what a signal does: gem_jax/train/interrupt.py). The trainer ends within a second
  of its supervisor (a kill -9 of the supervisor ends both).
* relays the trainer's stderr as it comes, except native log lines at ERROR or FATAL level (abseil's
  `E1201 12:00:00.000000 ...` format) and what follows them for a few seconds: held back, then
  printed, unless the trainer ends by jax's abort for a lost peer (then dropped: its stack trace too).
* when the trainer ends: exit codes 0, 2 (config or workdir error), 3 (NaN) and 128 + SIGINT/SIGTERM are
  final, as is any end after a signal it passed on. Any other end is a lost peer (75, reported by the
  trainer; or jax's abort, reported here), a stall (76, reported by the trainer) or a crash (reported
  here: exit code or signal, the step, the last intact checkpoint). While restarts are left, the trainer
  is launched again after `settle_s` seconds and resumes from the last intact checkpoint; the relaunched
  trainer records the restart in resumes.jsonl (`restart_record`). In a multi-process run each process's
  supervisor relaunches its own trainer, after the peer timeout plus a few seconds, when every trainer of
  the old attempt has stopped and the coordinator's port is free; they meet again at the same coordinator
  address (jax waits up to 5 minutes for all of them). A process whose whole host was lost has no
  supervisor left: relaunch that one with the same command.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

from gem_jax.train import peers, watchdog
from gem_jax.train.run_status import STATUS_FD, RunStatus

SUPERVISED = "GEM_JAX_SUPERVISED"
RESTART = "GEM_JAX_RESTART"
FINAL = {0, 2, 3, 128 + signal.SIGINT, 128 + signal.SIGTERM}
JAX_ABORT = b"Terminating process because the JAX distributed service detected fatal errors"
_NATIVE = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ ")  # abseil/glog's line prefix
_NATIVE_END = (b"*** Check failure stack trace", b"terminate called after throwing")


def supervised() -> bool:
    """Whether this process is a trainer under a supervisor."""
    return os.environ.get(SUPERVISED) == "1"


def restart_record() -> dict[str, Any] | None:
    """This trainer's restart ({"attempt", "of", "after"}) from its supervisor, for resumes.jsonl."""
    text = os.environ.get(RESTART)
    return json.loads(text) if text else None


def run(argv: list[str], *, restarts: int, settle_s: float, command: list[str] | None = None) -> int:
    """Runs `python -m experiments ARGV` (or `COMMAND ARGV`) under supervision; returns the exit code
    to end with."""
    return _Supervisor([*(command or [sys.executable, "-m", "experiments"]), *argv]).run(restarts, settle_s)


def _say(line: str) -> None:
    os.write(2, (line + "\n").encode())


class _Supervisor:
    def __init__(self, command: list[str]):
        self.command = command
        self.child: subprocess.Popen | None = None
        self.signalled: int | None = None

    def run(self, restarts: int, settle_s: float) -> int:
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._forward) for sig in signals}
        # A thread's signal mask is inherited across fork and exec: a launcher that starts us from a
        # thread with these blocked would leave both us and the trainer deaf to them.
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        try:
            return self._run(restarts, settle_s)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self, restarts: int, settle_s: float) -> int:
        attempt, restart = 0, None
        while True:
            code, line = self._once(restart)
            if code in FINAL or self.signalled is not None:
                return code
            if attempt >= restarts:
                if restarts:
                    _say(f"not restarting: the {restarts} restart(s) of --restarts are used")
                return code
            attempt += 1
            _say(f"restart {attempt} of {restarts} in {settle_s:.0f} s, from the last intact checkpoint")
            restart = {"attempt": attempt, "of": restarts, "after": line}
            deadline = time.monotonic() + settle_s
            while time.monotonic() < deadline:
                time.sleep(0.1)

    def _forward(self, signum: int, frame) -> None:
        self.signalled = signum
        if self.child is not None and self.child.poll() is None:
            os.kill(self.child.pid, signum)
            return
        _say(f"{signal.Signals(signum).name}: not restarting")  # between two attempts
        os._exit(128 + signum)

    def _once(self, restart: dict[str, Any] | None) -> tuple[int, str]:
        """One trainer, from launch to end: (the exit code to end with, the line that reports its end)."""
        read_end, write_end = os.pipe()
        env = {**os.environ, SUPERVISED: "1", STATUS_FD: str(write_end)}
        if restart is not None:
            env[RESTART] = json.dumps(restart)
        self.child = subprocess.Popen(
            self.command,
            env=env,
            stderr=subprocess.PIPE,
            pass_fds=(write_end,),
            process_group=0,
        )
        os.close(write_end)
        status, relay = RunStatus(), _Relay()
        self._follow(self.child, read_end, status, relay)
        os.close(read_end)
        rc = self.child.returncode
        if rc in FINAL or self.signalled is not None:
            relay.release()
            return rc, ""
        if relay.jax_abort:  # process 0 is gone (or jax saw a loss first): its native trace goes
            who = relay.lost_process()
            relay.drop()
            if rc == peers.LOST_PEER_EXIT:  # the trainer's own line came first
                return rc, relay.last_line
            line = f"lost {who} {status.where()}: stopping; {status.last_intact()}"
            _say(line)
            return peers.LOST_PEER_EXIT, line
        relay.release()
        if rc in (peers.LOST_PEER_EXIT, watchdog.STALLED_EXIT):  # the trainer said so itself, and why
            return rc, relay.last_line
        if rc < 0:
            how = "was killed" if -rc == signal.SIGKILL else "died"
            how = f"{how} by {signal.Signals(-rc).name}"
        else:
            how = f"exited with code {rc}"
        line = f"the trainer {how} {status.where()}: {status.last_intact()}"
        _say(line)
        return (128 - rc if rc < 0 else rc), line

    @staticmethod
    def _follow(child: subprocess.Popen, status_fd: int, status: RunStatus, relay: _Relay) -> None:
        """Relays the trainer's stderr and reads its status until it has ended (and a moment more,
        for output still in the pipes)."""
        selector = selectors.DefaultSelector()
        selector.register(child.stderr.fileno(), selectors.EVENT_READ, relay.feed)
        pending = b""

        def read_status(data: bytes) -> None:
            nonlocal pending
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                status.read(line.decode(errors="replace"))

        selector.register(status_fd, selectors.EVENT_READ, read_status)
        ended_at = None
        while selector.get_map():
            for key, _ in selector.select(timeout=0.2):
                data = os.read(key.fd, 1 << 16)
                if data:
                    key.data(data)
                else:
                    selector.unregister(key.fd)
            relay.tick()
            if ended_at is None and child.poll() is not None:
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > 2.0:
                break  # a data worker of the trainer may hold the pipe a moment longer
        selector.close()
        child.wait()
        relay.flush_partial()


class _Relay:
    """Copies the trainer's stderr to this process's as it comes, holding back native error output."""

    def __init__(self, grace_s: float = 3.0):
        self.pending = b""  # the start of a line not ended yet
        self.held: list[bytes] = []
        self.hold_until: float | None = None  # while set, lines are held
        self.fatal = False  # a native fatal line or stack trace came: the trainer is ending
        self.jax_abort = False
        self.last_line = ""  # the last line passed on (a lost-peer line, for the restart record)
        self.grace_s = grace_s

    def feed(self, data: bytes) -> None:
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            self._line(line + b"\n")
        # A progress bar redraws one line with "\r" and no "\n": passed on at once, unless held or
        # possibly the start of a native line.
        if self.pending and self.hold_until is None and not self.fatal and self.pending[:1] not in b"IWEF":
            self._out(self.pending)
            self.pending = b""

    def _line(self, line: bytes) -> None:
        native = _NATIVE.match(line)
        if JAX_ABORT in line:
            self.jax_abort = True
        if (native and line[:1] == b"F") or any(end in line for end in _NATIVE_END):
            self.fatal = True
        if self.fatal or self.hold_until is not None or (native and line[:1] in b"EF"):
            self.held.append(line)
            if self.hold_until is None:
                self.hold_until = time.monotonic() + self.grace_s
            return
        self._out(line)

    def tick(self) -> None:
        """Passes on what was held, once the grace period has gone by without a fatal end."""
        if self.hold_until is not None and not self.fatal and time.monotonic() > self.hold_until:
            self.release()

    def release(self) -> None:
        for line in self.held:
            self._out(line)
        self.held, self.hold_until = [], None

    def drop(self) -> None:
        self.held, self.hold_until = [], None

    def flush_partial(self) -> None:
        if self.pending:
            self._line(self.pending)
            self.pending = b""

    def lost_process(self) -> str:
        """Which process jax's abort was about, from its log lines (process 0's loss by default:
        the others' losses are caught by the trainer itself, gem_jax/train/peers.py)."""
        text = b"".join(self.held)
        found = re.search(rb"[Tt]ask (\d+) heartbeat timeout", text) or re.search(
            rb"stopped sending heartbeats\):\s*(\d+)", text
        )
        return f"process {int(found.group(1))}" if found else "process 0 (the coordinator)"

    def _out(self, data: bytes) -> None:
        text = data.decode(errors="replace").strip()
        if text:
            self.last_line = text.splitlines()[-1].split("\r")[-1]
        try:
            os.write(2, data)
        except OSError:
            pass
