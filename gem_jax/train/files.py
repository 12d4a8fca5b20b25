"""Run-directory file helpers: atomic writes (a crash or kill -9 leaves the old file or the new one,
never half of one) and content hashes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any


def write_text(path: Path, text: str) -> None:
    """Writes `text` to a temporary file beside `path`, flushes it to disk, then renames it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
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
