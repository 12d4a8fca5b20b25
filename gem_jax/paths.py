"""Where a relative path given to the trainer points: the working directory first, then the repository root,
so `--config configs/X.toml` and the configs' `data/...` paths work from anywhere inside a checkout; a config
named alone (`--config tiny.toml`, or `tiny`) is also looked up in the repository's `configs/`."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIGS / "tiny.toml"  # `python -m experiments train` without --config


def in_repository(path: str | Path) -> Path:
    """`path` itself when it is absolute or exists from the working directory, else the same path under the
    repository root (which may not exist either: the caller's error names it)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p


def config_file(path: str | Path) -> Path:
    """A config's file: `path` as `in_repository` finds it, else, for a bare name (`tiny.toml`, `tiny`),
    the file of that name in the repository's `configs/`."""
    p = in_repository(path)
    if p.exists() or Path(path).parent != Path("."):
        return p
    named = CONFIGS / Path(path).name
    if not named.suffix:
        named = named.with_suffix(".toml")
    return named if named.exists() else p
