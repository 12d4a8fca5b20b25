"""The kernel packages' layout rules, read from the source: one role per file (no kernel file past 1,000
lines), no op package imports another (what ops share lives in pallas_kernels' own modules: common.py,
checks.py, implementations.py, mosaic_common.py), and no module imports another's private (underscore) names:
what two modules share is public in a module of its own (e.g. pallas_kernels/jagged_attention/sm90_common.py)."""

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


def test_kernel_files_stay_under_1000_lines():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len([f for f in files if "sm90" in f.name]) >= 9, files  # the Hopper kernels of four ops
    long = {str(f.relative_to(PACKAGE)): n for f in files if (n := len(f.read_text().splitlines())) > 1000}
    assert not long, long


def _imported_op_packages(path: Path) -> set[str]:
    """The op packages (pallas_kernels.<op>) a file imports, by any import form."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("pallas_kernels.") and len(n.split(".")) > 1}
    return {name for name in found if (PACKAGE / name).is_dir()}


def test_no_op_package_imports_another():
    ops = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert len(ops) >= 5, ops  # jagged_attention, block_attention, layer_norm, silu_backward_fp8, norm_gemm
    bad = {
        str(f.relative_to(ROOT)): sorted(others)
        for op in ops
        for f in (PACKAGE / op).rglob("*.py")
        if (others := _imported_op_packages(f) - {op})
    }
    assert not bad, f"op packages import each other (move what they share to pallas_kernels/): {bad}"


def test_the_op_import_check_catches_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from pallas_kernels.jagged_attention.sm90_common import COL\nfrom pallas_kernels import common\n"
    )
    assert _imported_op_packages(f) == {"jagged_attention"}
    f.write_text("from pallas_kernels import layer_norm\n")
    assert _imported_op_packages(f) == {"layer_norm"}
