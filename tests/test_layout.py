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
    # dtypes: the one dtype table the config's choices come from; paths: where a relative path points;
    # kernels: which kernel runs each op for a config's calls (the config checks its settings with it)
    ("gem_jax.dtypes", "gem_jax.paths", "gem_jax.typing", "gem_jax.kernels"),
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


# ----------------------------------------------------------------------------- the import graph


def project_modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """module name -> file, for every module of the three packages."""
    paths = [p for folder in PACKAGES for p in (root / folder).rglob("*.py")]
    return {module_name(p, root): p for p in sorted(paths)}


PACKAGES = ("gem_jax", "pallas_kernels", "experiments")


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in the file. `from a import b` is an edge to
    module a.b where that is a module, else to a (the package's __init__ holds the name)."""
    modules = project_modules(root)
    graph = {}
    for name, path in modules.items():
        targets = set()
        for _, module in imported_modules(path, root):
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted: the import circles."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_circles():
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other (move the shared piece down a floor):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_circle_check_finds_a_circle_closed_in_a_function(tmp_path):
    package = tmp_path / "experiments"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text("from experiments import data\nDEFAULT = 1\n")
    (package / "data.py").write_text(
        "def f():\n    from experiments.main import DEFAULT\n    return DEFAULT\n"
    )
    (package / "other.py").write_text("from experiments import data\n")
    assert import_cycles(import_graph(tmp_path)) == [["experiments.data", "experiments.main"]]


# An import inside a function body hides what a module needs and can close an import circle. It is
# allowed only where it guards an optional dependency (an extra of pyproject.toml) or a backend that loads
# on one platform only, and the line (or the one above it) says which.
WHY_INSIDE = ("optional dependency", "platform-only")


def unexplained_function_imports(paths, root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for path in paths:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    said = " ".join(lines[max(0, inner.lineno - 2) : inner.end_lineno])
                    if not any(why in said for why in WHY_INSIDE):
                        bad.append(
                            f"{path.relative_to(root)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}"
                        )
    return sorted(set(bad))


def test_imports_inside_functions_say_why():
    bad = unexplained_function_imports(source_files(*PACKAGES, "scripts"))
    assert not bad, (
        "imports inside functions (move them to the top, or say `# optional dependency: ...` or "
        "`# platform-only: ...`):\n" + "\n".join(bad)
    )


def test_the_function_import_check(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "def f():\n    import json\n"
        "def g():\n    import matplotlib  # optional dependency: the plots extra\n"
        "def h():\n    # platform-only: the Triton backend\n    from x import gpu\n"
    )
    assert unexplained_function_imports([path], tmp_path) == ["m.py:2: import json"]


def test_ci_runs_the_readme_commands_and_both_test_tiers():
    """CI runs what the README tells a newcomer to run: the lint and both tiers (`-m slow` replaces
    pyproject's `-m "not slow"`, so together they run every test)."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for command in (
        "ruff check . && ruff format --check .",
        "python3 -m pytest\n",
        "python3 -m pytest -m slow",
    ):
        assert command in ci, command
        assert command.strip() in readme, command
    assert "-m 'not slow'" in (ROOT / "pyproject.toml").read_text()
