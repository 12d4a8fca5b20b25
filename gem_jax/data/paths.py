"""Where a relative `data.path` points: the working directory first, then the repository root (so the
configs' `data/...` defaults work from anywhere inside a checkout)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_data_path(path: str) -> Path:
    """A relative `data.path` is tried against the working directory, then the repository root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p
