"""Orbax checkpoints: train state, grain iterator position and the loop's progress, async, keep-last-N,
each step verified by a checksum manifest (gem_jax/train/integrity.py).

A checkpoint is one orbax step directory holding up to three items: `state` (the sharded train
state), `data` (the grain iterator's state, a small dict) and `progress` (the loop's JSON record:
best validation metric so far, evaluations without improvement, training time spent...). All
three commit together, so a resumed run continues exactly where the saved one was.

After orbax has committed a step (at once for synchronous saves; for async ones, noticed by `poll()`
between steps, or at the next `save`/`wait`/`close`), a background thread writes the step's manifest.
`newest_intact()` is what a run restores: steps that fail their manifest are reported in one line
each and, when an older intact step exists, moved to `<workdir>/corrupt/` (out of orbax's sight, so a
replay can save those step numbers again; nothing is deleted). Temporary folders of saves that never
finished (`*.orbax-checkpoint-tmp*`) are removed when a writing Checkpointer opens the directory,
which the loop does only while it holds the workdir lock.

Each process saves its own data position (grain); a run resumed on another number of processes
merges them (`merge_process_states`), so a checkpoint written by 2 processes resumes in 1 and back.

A save the disk refuses (full, over quota, read-only) raises `files.WriteFailed` naming the file, from
`save`, `poll` or `wait` (async saves fail in orbax's threads and surface at the next of these). The
step it was writing never becomes a checkpoint a resume uses: orbax leaves an unfinished temporary
folder (removed at the next start), and a step orbax committed without its manifest fails the
integrity check (moved aside).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from gem_jax.config import TrainConfig
from gem_jax.train import files, integrity
from gem_jax.train.workdir_lock import WorkdirError

CORRUPT_DIR = "corrupt"
# tensorstore (orbax's array writer) reports a failed write as a ValueError carrying the errno.
_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")
_TENSORSTORE_FILE = re.compile(r'"(/[^"]+)"')


class NoIntactCheckpoint(WorkdirError):
    """Every checkpoint step of a run fails its integrity check."""


class Checkpointer:
    def __init__(
        self, directory: Path, config: TrainConfig, *, keep: int | None = None, read_only: bool = False
    ):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep if keep is not None else config.keep_checkpoints,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=config.async_checkpointing,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        if read_only:  # orbax warns that the directory is read-only: that is what we asked for
            absl_log.setLevel(logging.ERROR)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        finally:
            absl_log.setLevel(level)
        self._unsealed: list[int] = []  # saved by this process, manifest not written yet
        self._sealing: list[Future] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gem-manifest")
        self._primary = jax.process_index() == 0
        self._failed: files.WriteFailed | None = None  # the write failure raised already, if any
        if not any(isinstance(f, _QuietWriteFailures) for f in absl_log.filters):
            absl_log.addFilter(_QuietWriteFailures())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    # ------------------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        state,
        data_iterator: grain.DatasetIterator | None = None,
        progress: dict[str, Any] | None = None,
    ) -> None:
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        if progress is not None:
            items["progress"] = ocp.args.JsonSave(progress)
        with self._writing(step):
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._unsealed.append(step)
        self.poll()

    def poll(self) -> None:
        """Starts writing the manifests of saves that have committed (cheap; call between steps)."""
        with self._writing(self._unsealed[0] if self._unsealed else None):
            if self._unsealed and not self.manager.is_saving_in_progress():
                self._seal(self._unsealed)
                self._unsealed = []

    @contextlib.contextmanager
    def _writing(self, step: int | None) -> Iterator[None]:
        """Turns the disk's refusal inside (whichever form orbax gives it) into `files.WriteFailed`."""
        try:
            yield
        except Exception as e:
            failure = _write_failure(e, self.directory if step is None else self.directory / str(step))
            if failure is None:
                raise
            self._failed = failure
            raise failure from e

    def _seal(self, steps: list[int]) -> None:
        if not self._primary:
            return
        for step in steps:
            self._sealing.append(self._executor.submit(self._write_manifest, step))

    def _write_manifest(self, step: int) -> None:
        step_dir = self.directory / str(step)
        if step_dir.is_dir():  # orbax may already have removed it (keep-last-N)
            try:
                integrity.write_manifest(step_dir)
            except FileNotFoundError:  # removed while hashing
                pass

    def wait(self) -> None:
        """Waits for every save and its manifest."""
        with self._writing(self._unsealed[-1] if self._unsealed else None):
            self.manager.wait_until_finished()
            self._seal(self._unsealed)
            self._unsealed = []
            sealing, self._sealing = self._sealing, []
            for f in sealing:
                f.result()

    def close(self) -> None:
        """Waits and closes. A write failure is raised once: not again if this Checkpointer raised it
        already, nor in place of the error a caller's `finally` is unwinding from (the first failure is
        the one to report)."""
        quiet = self._failed is not None or sys.exc_info()[1] is not None
        try:
            self.wait()
        except files.WriteFailed:
            if not quiet:
                raise
        finally:
            with contextlib.suppress(Exception) if self._failed else contextlib.nullcontext():
                self.manager.close()
            self._executor.shutdown()

    # ------------------------------------------------------------------------- verifying

    def problem(self, step: int) -> str | None:
        """None when `step` is saved and intact, else what is wrong with it."""
        self.wait()
        return integrity.problem(self.directory / str(step))

    def newest_intact(
        self, *, below: int | None = None, move_aside: bool | None = None, required: bool = True
    ) -> int | None:
        """The newest step (below `below`, if given) that passes its integrity check, or None if none exist.

        Failed newer steps are reported (one line each); when an intact step is found and this
        Checkpointer writes, they are moved to `<workdir>/corrupt/`. Steps that exist but none intact:
        NoIntactCheckpoint and nothing is moved, unless `required=False` (best/) or every one is a save
        that never finished: then they are moved aside and None is returned (start over). Process 0
        decides; every process gets its answer.
        """
        self.wait()
        move_aside = not self.read_only if move_aside is None else move_aside
        chosen, failed = _NONE, []
        if self._primary:
            for step in sorted(self.all_steps(), reverse=True):
                if below is not None and step >= below:
                    continue
                problem = integrity.problem(self.directory / str(step))
                if problem is None:
                    chosen = step
                    break
                failed.append((step, problem))
            # Only unfinished saves (a run killed before its first save finished): there was never a
            # state to lose, so they are moved aside and the run starts over, as its stop line said.
            unfinished = all(problem == integrity.UNFINISHED for _, problem in failed)
            if chosen == _NONE and failed and required and not unfinished:
                chosen = _NONE_INTACT
            for step, problem in failed:
                fate = f"; moved to {self._move_aside(step)}" if chosen != _NONE_INTACT and move_aside else ""
                print(
                    f"checkpoint {self.directory / str(step)} is not intact: {problem}{fate}", file=sys.stderr
                )
        chosen = _agree(chosen)
        if chosen != _NONE_INTACT and move_aside:
            self.manager.reload()
        if chosen == _NONE_INTACT:
            listed = ", ".join(f"step {s} ({p})" for s, p in failed) or "see process 0's log"
            raise NoIntactCheckpoint(
                f"no intact checkpoint in {self.directory}: {listed}; nothing was changed "
                "(move the workdir aside to start over)"
            )
        return None if chosen == _NONE else chosen

    def _move_aside(self, step: int) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.directory.parent / CORRUPT_DIR / f"{self.directory.name}-{step}-{stamp}"
        with files.writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.directory / str(step), target)
        return target

    # ------------------------------------------------------------------------- restoring

    def restore(
        self, step: int, abstract_state, shardings, data_iterator: grain.DatasetIterator | None = None
    ) -> tuple[Any, dict[str, Any] | None]:
        """(state on `shardings`, progress or None); restores the iterator position in place if given."""
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
        )
        items = {"state": ocp.args.StandardRestore(target)}
        data_dir = self.directory / str(step) / "data"
        own_data = data_dir / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        if data_iterator is not None and own_data.exists():
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        has_progress = (self.directory / str(step) / "progress").exists()
        if has_progress:
            items["progress"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        if data_iterator is not None and not own_data.exists():
            # Written by another number of processes: every process's position, merged.
            files = sorted(data_dir.glob("process_*-of-*.json"))
            if not files:
                raise FileNotFoundError(f"{data_dir}: no data-iterator position saved")
            data_iterator.set_state(merge_process_states([json.loads(f.read_text()) for f in files]))
        return restored["state"], (restored["progress"] if has_progress else None)


_NONE, _NONE_INTACT = -1, -2  # newest_intact's answers besides a step


def _write_failure(error: BaseException | None, path: Path) -> files.WriteFailed | None:
    """The disk's refusal in `error` or its causes, as WriteFailed naming the file (else `path`); None
    for any other error. orbax raises the OSError of its own writes as is, and tensorstore's (the
    arrays) as a ValueError whose message carries the errno and the file."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, files.WriteFailed):
            return error
        if isinstance(error, OSError) and error.errno:
            named = error.filename and os.path.isabs(error.filename)  # (rmtree names entries alone)
            return files.WriteFailed(error.filename if named else path, error)
        if code := _TENSORSTORE_ERRNO.search(str(error)):
            named = _TENSORSTORE_FILE.search(str(error))
            number = int(code.group(1))
            return files.WriteFailed(named.group(1) if named else path, OSError(number, os.strerror(number)))
        error = error.__cause__ or error.__context__
    return None


class _QuietWriteFailures(logging.Filter):
    """Drops orbax's log records of a failed write (one per orbax thread, each with a traceback): the
    Checkpointer raises the failure as one line (`files.WriteFailed`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or _write_failure(error, Path()) is None


def _agree(value: int) -> int:
    """Process 0's answer on every process (they read the same files; only process 0 decides)."""
    if jax.process_count() == 1:
        return value

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def merge_process_states(states: list[Any], path: str = "") -> Any:
    """One data-iterator position from every process's: the union of their keys, where a value two
    processes both hold must agree. Positions that are global (next-item: epoch and step) or keyed by
    global batch shard (ranking: `packing.ShardStacks`) merge; per-worker positions of grain's
    multiprocess prefetch do not (resume with the number of processes that wrote them)."""
    if all(isinstance(s, dict) for s in states):
        keys = dict.fromkeys(k for s in states for k in s)
        return {k: merge_process_states([s[k] for s in states if k in s], f"{path}/{k}") for k in keys}
    if any(s != states[0] for s in states):
        raise ValueError(
            f"data positions of different processes disagree at {path or '/'} ({states[0]!r} vs "
            f"{next(s for s in states if s != states[0])!r}): this checkpoint's data position cannot be "
            "restored on another number of processes"
        )
    return states[0]
