"""The embeddings benchmark's --small run: correctness check, timings and the markdown table."""

from __future__ import annotations

import pytest

from experiments.benchmarks import embeddings as bench_embeddings


@pytest.mark.slow
def test_small_run_checks_and_prints_the_table(capsys):
    assert bench_embeddings.main(["--small", "--no-torch", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "correctness" in out and "OK" in out
    assert "| forward + backward + row-wise Adagrad |" in out
    assert "| t00 | 4,096 | 16 | float32 |" in out  # the printed plan


@pytest.mark.slow
def test_small_offload_run_prints_the_cache_table(capsys):
    argv = [
        "--small",
        "--no-torch",
        "--reps",
        "2",
        "--max-bag",
        "8",
        "--offload",
        "--cache-fraction",
        "0.9,0.95",
    ]
    assert bench_embeddings.main(argv) == 0
    out = capsys.readouterr().out
    assert "| cache fraction | ms / step | in-HBM step (ms) |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 0.9 |", "| 0.95 |"))]
    assert len(rows) == 2, out  # one row per fraction
    assert "| t00 | 4,096 | 16 | float32 | 272.0 KiB | offload |" in out
