"""The other processes of a multi-process run: noticing that one is lost, and stopping all of them
together.

Why not jax's own watch: its coordination service declares a process dead after its heartbeat
timeout (100 s by default) and then ends every other process from a C++ thread (`client.h:80]
Terminating process because the JAX distributed service detected fatal errors`: SIGABRT and a native
stack trace); the Python callback it can take instead (`missed_heartbeat_callback` of
`get_distributed_runtime_client`) gets an absl::Status, which has no Python type in jax 0.10 (the
call throws std::bad_cast, which terminates the process too). So each process runs a watch thread of
its own, on the service's key-value store (`gem_jax/*` keys):

* a heartbeat: every `interval` (1 s) it bumps its counter and reads the others'. A process whose
  counter has not moved for the peer timeout (`--peer-timeout`, 30 s by default; jax's own is set
  well above it, `jax_heartbeat_timeout_s`) is lost: every other process prints one line (the lost
  process, this process's step, the last intact checkpoint, re-run the same command) and exits with
  LOST_PEER_EXIT (75, EX_TEMPFAIL: re-running may succeed). On CPU a collective with the lost process
  fails at once in the main thread; `await_verdict` holds such an error back until the watch decides.
* a stop that must reach every process (a signal before the first step or after the loop, a second
  signal, an error on one process: `gem_jax.train.interrupt.exit_now`): the stopping process writes
  it, the others read it within `interval` and exit the same way, with the same exit code.

Process 0 hosts the store, and its end ends the others at once from inside jax (nothing to catch
here): it leaves last, once the others have read the stop (or after a few seconds). Its own loss is
reported by the others' supervisors (gem_jax/train/supervisor.py). A process that finished its run
says so (`finish`, at exit): from then on it is not missed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
import time
from typing import Any

import jax
from jax._src import distributed as jax_distributed  # the client has no public accessor

from gem_jax.train import interrupt
from gem_jax.train.run_status import STATUS

LOST_PEER_EXIT = 75
DEFAULT_TIMEOUT_S = 30.0
_PREFIX = "gem_jax/"
_DONE = "done"


def jax_heartbeat_timeout_s(peer_timeout_s: float) -> int:
    """jax's own heartbeat timeout for a peer timeout: well above it, so that a lost process is
    reported by this module's line before jax ends the others with its native stack trace."""
    return int(max(100, 3 * peer_timeout_s + 10))


class Peers:
    """This process's watch over the others (one per process, after jax.distributed.initialize).

    Args:
      client: jax's coordination-service client (its key-value store).
      me, count: this process's index and the number of processes.
      timeout_s: a peer is lost after this long without a heartbeat.
      interval_s: the heartbeat and polling period.
      exit: how a stop ends this process (`interrupt.exit_now`; tests pass a recorder).
    """

    def __init__(self, client, me: int, count: int, timeout_s: float, interval_s: float = 1.0, exit=None):
        self.client = client
        self.me, self.count = me, count
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._exit = exit or interrupt.exit_now
        now = time.monotonic()
        self._seen = {p: (None, now) for p in range(count) if p != me}  # last beat, when it changed
        self._stopping = threading.Event()  # a stop is under way: the watch reports nothing more
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gem-peers", daemon=True)

    def start(self) -> Peers:
        self._thread.start()
        return self

    # ------------------------------------------------------------------------- the watch

    def _watch(self) -> None:
        beat = 0
        unreachable_since = None
        while not (self._finished.is_set() or self._stopping.is_set()):
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(_key(f"alive/{self.me}"), str(beat), allow_overwrite=True)
                entries = dict(self.client.key_value_dir_get(_PREFIX))
                unreachable_since = None
            except Exception:  # process 0 (the store) gone: jax ends this process at once anyway
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self.timeout_s:
                    return self._lose(0)
                entries = None
            if entries is not None:
                stop = json.loads(entries.get(_key("stop"), "null"))
                if stop and stop.get("from") != self.me:
                    return self._obey(stop)
                for peer, (last, since) in self._seen.items():
                    value = entries.get(_key(f"alive/{peer}"))
                    if value == _DONE:
                        continue
                    if value != last:
                        self._seen[peer] = (value, now)
                    elif now - since > self.timeout_s:
                        return self._lose(peer)
            self._finished.wait(self.interval_s)

    def lost_line(self, peer: int) -> str:
        coordinator = " (the coordinator)" if peer == 0 else ""
        return (
            f"lost process {peer}{coordinator} {STATUS.where()} (no sign of life for "
            f"{self.timeout_s:.0f} s): stopping; {STATUS.last_intact()}"
        )

    def _lose(self, peer: int) -> None:
        line = self.lost_line(peer)
        self.tell_others(LOST_PEER_EXIT, line, lost=peer)
        self._exit(LOST_PEER_EXIT, line, tell_others=False)

    def _obey(self, stop: dict[str, Any]) -> None:
        """Another process's stop: this process ends the same way (after the others, if it is process 0)."""
        self._stopping.set()
        self._ack()
        if self.me == 0:
            self._await_acks(skip={stop.get("from"), stop.get("lost")})
        if stop.get("lost") is not None:
            line = self.lost_line(stop["lost"])
        else:
            line = f"process {stop.get('from')}: {stop.get('message')}"
        self._exit(int(stop.get("code", 1)), line, tell_others=False)

    # ------------------------------------------------------------------------- stopping

    def tell_others(self, code: int, message: str, lost: int | None = None) -> None:
        """Before this process exits at once: every other one exits too, with `code` (the first stop
        written wins). Process 0 returns once the others have read it (a few seconds at most)."""
        self._stopping.set()
        payload = json.dumps({"from": self.me, "code": code, "message": message, "lost": lost})
        with contextlib.suppress(Exception):  # another process's stop came first, or the store is gone
            self.client.key_value_set(_key("stop"), payload)
        self._ack()
        if self.me == 0:
            self._await_acks(skip={lost})

    def _ack(self) -> None:
        with contextlib.suppress(Exception):
            self.client.key_value_set(_key(f"ack/{self.me}"), "1", allow_overwrite=True)

    def _await_acks(self, skip: set) -> None:
        deadline = time.monotonic() + max(5.0, 4 * self.interval_s)
        while time.monotonic() < deadline:
            try:
                entries = dict(self.client.key_value_dir_get(_PREFIX))
            except Exception:
                return
            now = time.monotonic()
            waiting = [
                p
                for p, (_, since) in self._seen.items()
                if p not in skip
                and _key(f"ack/{p}") not in entries
                and entries.get(_key(f"alive/{p}")) != _DONE
                and now - since <= self.timeout_s
            ]
            if not waiting:
                return
            time.sleep(min(0.05, self.interval_s))

    def finish(self) -> None:
        """This process is done with the run (normal exit): the others stop watching it."""
        self._finished.set()
        with contextlib.suppress(Exception):
            self.client.key_value_set(_key(f"alive/{self.me}"), _DONE, allow_overwrite=True)

    def await_verdict(self) -> None:
        """Gives the watch the time to find a lost process (or a stop) behind an error of the main
        thread; returns if it finds none (the error is this process's own)."""
        deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
        while time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.1)
        if self._stopping.is_set():  # the stop under way ends the process
            while True:
                time.sleep(60)


def _key(name: str) -> str:
    return _PREFIX + name


WATCH: Peers | None = None  # this process's watch, in a multi-process run


def watch(timeout_s: float = DEFAULT_TIMEOUT_S) -> Peers:
    """Starts this process's watch (after jax.distributed.initialize); `finish` runs at exit."""
    global WATCH

    WATCH = Peers(
        jax_distributed.global_state.client,
        jax.process_index(),
        jax.process_count(),
        timeout_s,
        interval_s=min(1.0, timeout_s / 5),
    ).start()
    atexit.register(WATCH.finish)  # runs before jax's own shutdown (registered earlier, at import)
    interrupt.tell_others_with(WATCH.tell_others)  # an exit at once reaches the other processes
    return WATCH
