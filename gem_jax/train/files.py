"""Run-directory file helpers: atomic writes (a crash or kill -9 leaves the old file or the new one,
never half of one), content hashes, and `WriteFailed`: a write into the run directory that the disk
refused (full, over quota, read-only, no permission), one line naming the path, instead of an OSError
raised from wherever the write happened to be (a metrics line, an orbax thread, a manifest)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gem_jax.train.workdir_lock import WorkdirError


class WriteFailed(WorkdirError):
    """A write into the run directory failed; the message names the path and the reason."""

    def __init__(self, path: Path | str, error: OSError):
        self.path = Path(path)
        self.errno = error.errno
        name = errno.errorcode.get(error.errno) if error.errno else None
        reason = error.strerror or str(error) or type(error).__name__
        super().__init__(f"cannot write {self.path}: {reason}{f' ({name})' if name else ''}")


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Turns an OSError inside into `WriteFailed` naming `path`."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as e:
        raise WriteFailed(path, e) from e


def write_text(path: Path, text: str) -> None:
    """Writes `text` to a temporary file beside `path`, flushes it to disk, then renames it over `path`;
    raises WriteFailed naming `path` if the disk refuses."""
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    """write_text's atomic write, of bytes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
    except WriteFailed:  # a full disk: the old file stays, the partial temporary one goes
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def write_json(path: Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=1) + "\n")


def read_json(path: Path) -> Any:
    """The JSON value in `path`, or None when the file does not exist."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def _fsync_dir(directory: Path) -> None:
    """Makes the rename itself durable (a power cut after it must not bring the old file back)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes (about 0.1 s for a 30 MB file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
