"""One trainer per run directory: an OS file lock on `<workdir>/.lock`, and checks that the workdir is usable.

The lock is `fcntl.flock` on an open file: the kernel releases it when the process ends in any way
(normal exit, exception, `os._exit`, kill -9), so a crashed run never leaves a stale lock. The file
holds the holder's PID and host (written after the lock is taken), which a refused second trainer
names in its one-line error. The file itself stays after the run (deleting a lock file races with a
process about to lock it); its presence means nothing, only the kernel lock does.

`check_usable` runs before anything is written: a workdir that is a file, or whose directory cannot
be written, is a `WorkdirError` (one line) instead of a traceback from deep inside orbax.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".lock"


class WorkdirError(Exception):
    """The run directory cannot be used for this run; the message is one line naming it and why."""


class WorkdirLocked(WorkdirError):
    """Another process holds the run directory's lock."""


def check_usable(workdir: Path) -> None:
    """Raises WorkdirError if `workdir` is not a directory, or it (or its nearest parent) is not writable."""
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirError(f"{workdir} exists and is not a directory: pass a directory as --workdir")
    existing = workdir
    while not existing.exists():  # the nearest existing ancestor must let us create the rest
        existing = existing.parent
    if not existing.is_dir():
        raise WorkdirError(f"cannot create {workdir}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise WorkdirError(
            f"cannot write to {existing}{_why_not_writable(existing)}: choose another --workdir"
        )


def _why_not_writable(path: Path) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return " (read-only file system)"
    except OSError:
        pass
    return " (permission denied)"


class WorkdirLock:
    """An exclusive, non-blocking lock of a run directory, held until `release()` or process exit."""

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock (creating the workdir if needed) or raises WorkdirLocked naming the holder."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirError(f"cannot create {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirLocked(
                    f"{self.path.parent} is in use by {holder}: one trainer per workdir "
                    "(wait for it, stop it, or choose another --workdir)"
                ) from None
            raise WorkdirError(f"cannot lock {self.path}: {e.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """The holder's "pid N on host H" line (it may be empty for a moment after the holder locked)."""
    text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    return text or "another process (its PID is not written yet)"
