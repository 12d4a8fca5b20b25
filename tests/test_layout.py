"""The project's layout rules, read from the source: imports only run down a floor, and nothing a user
gets points outside the repository."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Floors, lowest first. A module may import its own unit (package or module named here) or a unit on a
# lower floor, never one on its own floor or above: the model may import embeddings and precision, never
# the reverse. `gem_jax` alone is the package's __init__.
FLOORS = (
    ("pallas_kernels",),
    ("gem_jax.dtypes", "gem_jax.typing"),  # dtypes: the one dtype table the config's choices come from
    ("gem_jax.config",),
    ("gem_jax", "gem_jax.data", "gem_jax.distributed", "gem_jax.parallel", "gem_jax.precision"),
    ("gem_jax.embeddings",),
    ("gem_jax.model",),
    ("gem_jax.train",),
    ("gem_jax.tasks",),
    ("experiments",),
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def unit_of(module: str) -> str | None:
    """The longest unit in FLOORS that `module` is or lies in (None: not the project's)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOOR:
            return ".".join(parts[:n])
    return None


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, function bodies included, relative ones resolved.

    `from a.b import c` gives a.b.c: c may be a module or a name, `unit_of` settles which unit it is.
    """
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def upward_imports(paths, root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for path in paths:
        here = unit_of(module_name(path, root))
        for line, module in imported_modules(path, root):
            target = unit_of(module)
            if target is not None and target != here and FLOOR[target] >= FLOOR[here]:
                bad.append(f"{path.relative_to(root)}:{line} ({here}) imports {module} ({target})")
    return bad


def source_files(*folders: str) -> list[pathlib.Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_every_package_module_has_a_floor():
    unplaced = [
        str(p)
        for p in source_files("gem_jax", "pallas_kernels", "experiments")
        if not unit_of(module_name(p))
    ]
    assert not unplaced, f"add these to FLOORS: {unplaced}"
    top = {p.stem for p in (ROOT / "gem_jax").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert {f"gem_jax.{name}" for name in top - {"__init__"}} <= set(FLOOR), "a gem_jax module has no floor"


def test_no_import_runs_up_a_floor():
    bad = upward_imports(source_files("gem_jax", "pallas_kernels", "experiments"))
    assert not bad, "imports that run up a floor (move the shared piece down):\n" + "\n".join(bad)


def test_the_floor_check_catches_an_upward_import(tmp_path):
    """The checker itself: an upward import, relative or inside a function, is found; down and own are not."""
    package = tmp_path / "gem_jax"
    (package / "embeddings").mkdir(parents=True)
    (package / "embeddings" / "dense.py").write_text(
        "from gem_jax.parallel import param\n"  # down: fine
        "from ..model import layers\n"  # up, relative
        "def f():\n    import gem_jax.tasks.ranking\n"  # up, in a function
        "from . import hashing\n"  # its own unit: fine
    )
    found = upward_imports([package / "embeddings" / "dense.py"], tmp_path)
    assert [line.split(" imports ")[1] for line in found] == [
        "gem_jax.model.layers (gem_jax.model)",
        "gem_jax.tasks.ranking (gem_jax.tasks)",
    ]


# What a user reads or runs; tests may read data kept outside the repository.
USER_FACING = ("README.md", "docs", "configs", "gem_jax", "pallas_kernels", "experiments", "notebooks")
OUTSIDE_POINTERS = ("../shared", "shared/DESIGN")


@pytest.mark.parametrize("where", USER_FACING)
def test_nothing_a_user_gets_points_outside_the_repository(where):
    root = ROOT / where
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    hits = []
    for path in paths:
        if path.suffix in {".png", ".pyc", ".gz"}:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(pointer in line for pointer in OUTSIDE_POINTERS):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "pointers to files users do not have:\n" + "\n".join(hits)
