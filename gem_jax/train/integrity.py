"""Checkpoint integrity: a sha256 manifest per checkpoint step, written after orbax commits the step and
checked before the step is restored.

Orbax's commit (a rename of the finished temporary folder) guarantees that a step directory is
complete when it was written; it cannot tell whether its files changed since (a bad disk, a partial
copy, a truncated file, flipped bytes), and orbax restores such a step without a word. The manifest
(`gem_manifest.json` inside the step directory: every file's size and sha256) closes that gap. A step
without a manifest is unverified: its save did not finish (the process died between orbax's commit and
the manifest), so it is treated like a corrupt one.
"""

from __future__ import annotations

import json
from pathlib import Path

from gem_jax.train import files

MANIFEST = "gem_manifest.json"
UNFINISHED = "no integrity manifest (its save never finished)"
FORMAT = 1


def write_manifest(step_dir: Path) -> None:
    """Records the size and sha256 of every file under a committed step directory."""
    step_dir = Path(step_dir)
    listing = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            listing[str(path.relative_to(step_dir))] = {
                "size": path.stat().st_size,
                "sha256": files.sha256(path),
            }
    files.write_json(step_dir / MANIFEST, {"format": FORMAT, "files": listing})


def problem(step_dir: Path, *, checksums: bool = True) -> str | None:
    """None when the step directory matches its manifest, else a few words on what is wrong.

    `checksums=False` checks only that every listed file is there with its size (no reading)."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return "missing"
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        return UNFINISHED
    try:
        listing = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"unreadable {MANIFEST}"
    for name, want in listing.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written"
        if checksums and files.sha256(path) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def newest_whole(directory: Path) -> int | None:
    """The newest step in a checkpoint folder whose manifest's files are all there at their sizes, or None.

    For the one-line reports of a run that stops from outside the training loop (a lost peer, a failed
    write): quick (no checksums, so seconds even for a large checkpoint); the resume verifies it fully.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True)
    return next((s for s in steps if problem(directory / str(s), checksums=False) is None), None)
