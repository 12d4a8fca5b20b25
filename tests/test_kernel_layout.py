"""The kernel packages' layout rules, read from the source: one role per file (no kernel file past 1,000
lines), and no module imports another's private (underscore) names: what two modules share is public in a
module of its own (e.g. pallas_kernels/jagged_attention/sm90_common.py)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pallas_kernels"


def _private_imports(path: Path) -> list[str]:
    """'module: name' for every `from <project module> import _name` in a file."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "pallas_kernels",
            "gem_jax",
        ):
            bad += [f"{node.module}: {a.name}" for a in node.names if a.name.startswith("_")]
    return bad


def test_no_private_names_cross_kernel_modules():
    bad = {str(p.relative_to(ROOT)): names for p in PACKAGE.rglob("*.py") if (names := _private_imports(p))}
    assert not bad, f"private names imported across modules (make them public in a shared module): {bad}"


def test_the_private_import_check_catches_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from pallas_kernels.jagged_attention.sm90_common import _hidden, public\n")
    assert _private_imports(f) == ["pallas_kernels.jagged_attention.sm90_common: _hidden"]


def test_hopper_kernel_files_stay_under_1000_lines():
    files = sorted((PACKAGE / "jagged_attention").glob("*sm90*.py"))
    assert len(files) >= 5, files  # forward, backward driver, dK/dV, dQ, shared pieces
    long = {f.name: n for f in files if (n := len(f.read_text().splitlines())) > 1000}
    assert not long, long
