"""Where a relative path given to the trainer points: the working directory first, then the repository root,
so `--config configs/X.toml` and the configs' `data/...` paths work from anywhere inside a checkout."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.toml"  # `python -m experiments train` without --config


def in_repository(path: str | Path) -> Path:
    """`path` itself when it is absolute or exists from the working directory, else the same path under the
    repository root (which may not exist either: the caller's error names it)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p
