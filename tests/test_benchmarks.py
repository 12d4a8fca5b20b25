"""Every benchmark is reachable as `python -m experiments bench NAME` and uses only public project names."""

import ast
import importlib
import pathlib

import pytest

from experiments.__main__ import BENCHMARKS

BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "benchmarks"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_has_a_main(name):
    module = importlib.import_module(BENCHMARKS[name])
    assert callable(module.main), f"{BENCHMARKS[name]} has no main(argv)"


def test_every_benchmark_module_is_registered():
    registered = set(BENCHMARKS.values())
    helpers = {"__init__", "shapes", "timing"}
    for path in BENCH_DIR.glob("*.py"):
        if path.stem not in helpers:
            assert f"experiments.benchmarks.{path.stem}" in registered, f"{path} is not in BENCHMARKS"


@pytest.mark.parametrize("path", sorted(BENCH_DIR.glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_use_public_names_only(path):
    # no jax internals, and no underscore-private attribute or import of the project's own modules
    tree = ast.parse(path.read_text())
    project = ("gem_jax", "pallas_kernels", "experiments")
    imported = {}  # local name -> module, for project modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("jax._src"), f"{path.name} imports {node.module}"
            if node.module.startswith(project):
                for alias in node.names:
                    assert not alias.name.startswith("_"), f"{path.name} imports {node.module}.{alias.name}"
                    imported[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("jax._src"), f"{path.name} imports {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
            assert not node.attr.startswith("_"), f"{path.name} uses {node.value.id}.{node.attr}"
