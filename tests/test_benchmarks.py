"""Every benchmark is reachable as `python -m experiments bench NAME` and uses only public project names."""

import ast
import importlib
import pathlib

import pytest

from experiments.__main__ import BENCHMARKS

BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "benchmarks"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_answers_help_under_its_cli_name(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(BENCHMARKS[name][0]).main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m experiments bench {name}")


def test_every_benchmark_module_is_registered():
    registered = {module for module, _ in BENCHMARKS.values()}
    helpers = {"__init__", "shapes", "timing", "jagged_calls", "attention_presets"}
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


@pytest.mark.slow
def test_bench_train_step_times_the_pipeline_after_every_workers_first_batch(monkeypatch):
    """`bench train_step` on the CPU default with 2 data workers: one JSON report, the pipeline timed after
    2 untimed batches (one per worker: their start-up is not throughput) over two batches per worker, a finite
    step time."""
    import json

    from tests.helpers import run_cli

    monkeypatch.delenv("GEM_JAX_TYPECHECK", raising=False)  # grain cannot pickle the checked functions
    args = ["--steps", "2", "--batches", "1", "--pipeline-steps", "3", "--set", "data.num_workers=2"]
    r = run_cli("bench", "train_step", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout[r.stdout.index("{") :])
    assert report["pipeline_batches"] == {"untimed": 2, "timed": 4}  # at least two per worker
    assert report["pipeline_s_per_batch"] > 0 and report["device_step_s_median"] > 0
    assert report["step_s_back_to_back"] > 0


@pytest.mark.slow
def test_bench_bias_rows_checks_each_build_against_the_shipped_one(capsys):
    """`bench bias_rows --quick` on CPU: every formulation that is not a bound equals gpu_layout.bias_rows, and the
    forward runs with and without bias_rows."""
    from experiments.benchmarks import bias_rows

    assert bias_rows.main(["--quick", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("equals the shipped build: yes") == 2, out  # the shipped build itself and one other
    for label in ("bias_rows", "bias computed in the kernels", "no bias"):
        assert f"forward, {label}:" in out, out


@pytest.mark.slow
def test_bench_balance_reports_less_imbalance_balanced(capsys):
    """`bench balance` on Zipf histories over 8 packs: the same sequences per step, a smaller largest pack."""
    import json

    from experiments.benchmarks import balance

    zipf = ["data.history_len_distribution=zipf", "data.max_history_len=1000", "data.tokens_per_shard=2048"]
    args = ["--config", "configs/tiny.toml", "--shards", "8", "--steps", "4"]
    assert balance.main([*args, *(x for kv in zipf for x in ("--set", kv))]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 4
    ratio = report["max_over_mean"]
    assert report["lower_bound"] <= ratio["balanced"] < ratio["unbalanced"]
    assert report["attention_speedup"] > 1


def test_bench_silu_fp8_checks_the_kernel_against_xla_before_timing(capsys):
    """`bench silu_fp8 --quick` on CPU: the Triton and the Mosaic GPU kernel (their interpreters) each checked
    against the FP8 reference, both XLA baselines timed."""
    from experiments.benchmarks import silu_fp8

    assert silu_fp8.main(["--quick", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "FP8 in XLA" in out and out.count(": ok") == 2 and "WRONG" not in out, out
    assert "triton default" in out and "mosaic default" in out, out


def test_bench_norm_checks_the_kernels_against_xla_before_timing(capsys):
    """`bench norm --quick` on CPU: both cases run the reference, the Triton kernels and the Mosaic GPU
    kernels (each in its interpreter), each checked against the reference."""
    from experiments.benchmarks import norm

    assert norm.main(["--quick", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok") == 6 and "WRONG" not in out and "failed" not in out, out
    assert out.count("triton rows=default") == 2 and out.count("mosaic rows=default") == 2, out


@pytest.mark.slow  # ~24 s: every FP8 GEMM form compiled
def test_bench_fp8_out_checks_every_form_and_reads_the_fp8_gemms_result_dtype(capsys):
    """`bench fp8_out --small` on CPU: every form of a layer's three GEMMs, each checked against float32 within
    its formats' bound (the run exits 0); and the parse of an optimised HLO's cuBLASLt FP8 call (GPU only),
    on a line as XLA writes it."""
    from experiments.benchmarks import fp8_out

    assert fp8_out.main(["--small"]) == 0
    out = capsys.readouterr().out
    for form in ("bf16", "f32_out", "raw_bf16_out", "raw_bf16_out_f32_scale", "raw_f32_out"):
        assert out.count(f"| {form} |") == 3 * 4, out  # tiny.toml's three FP8 GEMM shapes, four GEMMs each
    assert out.count("| bf16_out |") == 3 * 2, out  # fwd and dx: dW's result is f32 anyway
    line = (
        "  %cublas-gemm.1 = (bf16[128,256]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[128,64]{1,0} %p0, "
        'f8e4m3fn[256,64]{1,0} %p1, f32[] %p2, f32[] %p3), custom_call_target="__cublas$lt$matmul$f8"'
    )
    hlo = f"HloModule m\n\nENTRY %main {{\n{line}\n  %f = bf16[128,256] fusion(%cublas-gemm.1)\n}}\n"
    assert fp8_out.fp8_calls(hlo) == (1, ["bf16"])
    assert fp8_out.entry_fusions(hlo) == 1
