"""The watch over the other processes of a run (gem_jax/train/peers.py), in one process: two `Peers`
on one stand-in for jax's key-value store, each with an exit that records instead of ending the
process. A lost process is reported by the other with one line (its index, the step, the last intact
checkpoint) and exit code 75; a stop (a signal before the first step, a second signal, a signal after
the loop: gem_jax/train/interrupt.py) reaches the other with the same exit code; a finished process
is not missed; process 0, which hosts the store, leaves only once the others have read a stop."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from gem_jax.train import integrity, interrupt, peers
from gem_jax.train.run_status import STATUS

TIMEOUT_S, INTERVAL_S = 0.6, 0.05


class Store:
    """jax's coordination-service client, as the watch uses it (its key-value store)."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.lock:
            if key in self.values and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


class Exits:
    """Records a process's exit (code, line, whether it told the others) instead of ending it."""

    def __init__(self):
        self.calls: list[tuple[int, str, bool]] = []
        self.done = threading.Event()

    def __call__(self, code: int, line: str, *, tell_others: bool = True) -> None:
        self.calls.append((code, line, tell_others))
        self.done.set()

    def wait(self, timeout: float = 5.0) -> tuple[int, str, bool]:
        assert self.done.wait(timeout), "no exit"
        return self.calls[0]


def _two(store: Store) -> tuple[peers.Peers, peers.Peers, Exits, Exits]:
    exits = Exits(), Exits()
    zero, one = (peers.Peers(store, i, 2, TIMEOUT_S, INTERVAL_S, exit=exits[i]) for i in range(2))
    return zero, one, *exits


@pytest.fixture
def status(tmp_path, monkeypatch):
    """The run at step 7 with an intact checkpoint at step 5 (and a step 6 whose save never finished)."""
    checkpoints = tmp_path / "checkpoints"
    for step in (5, 6):
        (checkpoints / str(step)).mkdir(parents=True)
        (checkpoints / str(step) / "state").write_bytes(b"x" * 100)
    integrity.write_manifest(checkpoints / "5")
    monkeypatch.setattr(STATUS, "step", 7)
    monkeypatch.setattr(STATUS, "checkpoints", checkpoints)
    return checkpoints


def test_a_lost_process_is_reported_by_the_other_in_one_line(status: Path):
    store = Store()
    zero, one, exit0, exit1 = _two(store)
    zero.start(), one.start()
    time.sleep(5 * INTERVAL_S)
    assert not exit0.calls
    one._finished.set()  # process 1 stops beating without a word, as after kill -9
    t0 = time.monotonic()
    code, line, _ = exit0.wait()
    # Not long before the timeout, nor long after it. The watch may have seen process 1's last beat a
    # few intervals before t0, and on a loaded machine its thread runs late: the margins allow both
    # (the strict bounds failed once beside the suite's compiles).
    assert TIMEOUT_S - 5 * INTERVAL_S <= time.monotonic() - t0 < TIMEOUT_S + 5.0
    assert code == peers.LOST_PEER_EXIT == 75
    assert line == (
        f"lost process 1 at step 7 (no sign of life for {TIMEOUT_S:.0f} s): stopping; the last intact "
        f"checkpoint is step 5 ({status / '5'}): re-run the same command to resume from it"
    )
    assert '"lost": 1' in store.values["gem_jax/stop"]  # a third process would stop on this word


def test_the_coordinators_loss_names_it_and_the_store_going_away_counts(status: Path):
    class Gone(Store):
        def key_value_set(self, *args, **kwargs):
            raise RuntimeError("UNAVAILABLE: Socket closed")

    exits = Exits()
    peers.Peers(Gone(), 1, 2, TIMEOUT_S, INTERVAL_S, exit=exits).start()
    code, line, _ = exits.wait()
    assert code == 75 and line.startswith("lost process 0 (the coordinator) at step 7 ")


@pytest.mark.parametrize("sender", [0, 1])
def test_a_stop_reaches_the_other_process_with_its_exit_code(sender, status: Path):
    store = Store()
    zero, one, exit0, exit1 = _two(store)
    zero.start(), one.start()
    time.sleep(3 * INTERVAL_S)
    (zero, one)[sender].tell_others(143, "SIGTERM: exiting (nothing to save yet)")
    receiver_exit = (exit1, exit0)[sender]
    if sender == 0:  # process 0 hosts the store: it returns only once the other has read the stop
        assert "gem_jax/ack/1" in store.values
    code, line, told = receiver_exit.wait()
    assert (code, line, told) == (143, f"process {sender}: SIGTERM: exiting (nothing to save yet)", False)
    assert not (exit0, exit1)[sender].calls  # the sender ends itself (interrupt.exit_now)


def test_a_finished_process_is_not_missed(status: Path):
    store = Store()
    zero, one, exit0, _ = _two(store)
    zero.start(), one.start()
    time.sleep(3 * INTERVAL_S)
    one.finish()
    time.sleep(TIMEOUT_S + 10 * INTERVAL_S)
    assert not exit0.calls


# ----------------------------------------------------------------------------- signals, end to end


class Exited(BaseException):
    pass


@pytest.mark.parametrize(
    "case, message",
    [
        ("before the first step", "SIGTERM: exiting (nothing to save yet)"),
        ("a second signal", "SIGTERM again: exiting without saving"),
        ("after the loop", "SIGTERM: exiting (the checkpoint is saved)"),
    ],
)
def test_signals_that_end_a_process_at_once_end_every_process(case, message, status, monkeypatch):
    """The signal handler of process 1 ends it at once (interrupt.exit_now); process 0's watch then
    ends process 0 with the same exit code, 128 + SIGTERM, as a first signal in the loop stops both."""
    store = Store()
    zero, one, exit0, _ = _two(store)
    zero.start()
    monkeypatch.setattr(peers, "WATCH", one)  # this process is process 1,
    monkeypatch.setattr(interrupt, "_TELL_OTHERS", one.tell_others)  # as peers.watch would set it
    monkeypatch.setattr(interrupt, "_EXITING", threading.Lock())
    codes = []

    def _exit(code):
        codes.append(code)
        raise Exited

    monkeypatch.setattr(interrupt.os, "_exit", _exit)
    handler = interrupt.Interrupts()
    with pytest.raises(Exited):
        if case == "before the first step":
            handler._handle(signal.SIGTERM, None)
        elif case == "a second signal":
            with handler.saving():
                handler._handle(signal.SIGTERM, None)
                assert handler.requested == signal.SIGTERM and not codes  # the first: save, then stop
                handler._handle(signal.SIGTERM, None)
        else:
            with handler.saving():
                pass
            handler._handle(signal.SIGTERM, None)
    assert codes == [143]
    assert exit0.wait() == (143, f"process 1: {message}", False)
