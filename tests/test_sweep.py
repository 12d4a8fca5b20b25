"""The sharding sweep: grid files, collective bytes read from compiled HLO, and the 8-CPU example grid
run end to end through the CLI (one subprocess per point, invalid points recorded, resumption)."""

from __future__ import annotations

import csv
import json
import subprocess
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.hlo import collective_bytes, type_bytes
from experiments.sweep import GridError, Point, load_grid, run_point
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent


def test_grid_crosses_points_with_the_product(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(
        """
[sweep]
steps = 3
[base]
"train.seed" = 1
[grid]
"data.examples_per_shard" = [4, 8]
"parallel.rules" = [{ shard = ["data"] }, { shard = ["data"], rows = ["data"] }]
[[points]]
name = "a"
parallel.mesh_shape = [8]
[[points]]
name = "b"
"sweep.cpu_devices" = 4
"""
    )
    points = load_grid(grid)
    assert len(points) == 2 * 2 * 2
    first = points[0]
    assert first.overrides == {
        "train.seed": 1,
        "parallel.mesh_shape": [8],
        "data.examples_per_shard": 4,
        "parallel.rules.shard": ["data"],
    }
    assert first.settings["steps"] == 3 and first.settings["cpu_devices"] == 0
    assert points[-1].settings["cpu_devices"] == 4 and points[-1].name.startswith("b ")
    assert points[3].overrides["parallel.rules.rows"] == ["data"]
    assert len({p.id("c.toml") for p in points}) == len(points)
    assert 'parallel.rules.shard=["data"]' in first.set_args()


@pytest.mark.parametrize(
    "text, words",
    [
        ("[grid]\n'train.seed' = []\n", ["grid.train.seed", "non-empty list"]),
        ("[grid]\n'train.seed' = 3\n", ["grid.train.seed"]),
        ("[sweep]\nsteps = -1\n", ["sweep.steps"]),
        ("[sweep]\nstep = 1\n", ["sweep.step", "known"]),
        ("[[points]]\n'sweep.nope' = 1\n", ["sweep.nope", "points[0]"]),
        ("[grids]\n", ["grids"]),
        ("[grid\n", ["not valid TOML"]),
    ],
)
def test_grid_errors_name_the_key(tmp_path, text, words):
    grid = tmp_path / "bad.toml"
    grid.write_text(text)
    with pytest.raises(GridError) as e:
        load_grid(grid)
    for w in [str(grid), *words]:
        assert w in str(e.value)


def test_collective_bytes_from_compiled_hlo():
    """An all-reduce of a [16] f32 sum and an all-gather of a [2, 8] f32 shard per device, read back
    from the compiled program with their operand sizes."""
    mesh = jax.make_mesh((8,), ("d",))

    @partial(jax.jit, in_shardings=NamedSharding(mesh, P("d")), out_shardings=NamedSharding(mesh, P()))
    def f(x):
        return x.sum(0), x * 2.0

    text = f.lower(jnp.ones((16, 16), jnp.float32)).compile().as_text()
    out = collective_bytes(text)
    assert out["all-reduce"]["count"] >= 1 and out["all-reduce"]["bytes"] >= 16 * 4
    assert out["all-gather"]["count"] >= 1
    assert out["all-gather"]["bytes"] == 2 * 16 * 4 * out["all-gather"]["count"]  # each device's rows
    assert out["all-to-all"] == {"count": 0, "bytes": 0}
    assert type_bytes("(f32[16]{0}, bf16[2,8]{1,0})") == 64 + 32 and type_bytes("pred[]") == 1


def test_a_point_that_runs_too_long_is_recorded_not_fatal(tmp_path):
    point = Point("slow", {}, {"steps": 1, "warmup": 0, "batches": 0, "cpu_devices": 1, "timeout_s": 1})
    record = run_point(point, str(ROOT / "configs" / "tiny.toml"), tmp_path / "p")
    assert record["status"] == "timeout" and "killed after 1 s" in record["error"]


CPU_GRID = "configs/sweeps/cpu8.toml"


def _one_batch_size_grid(tmp_path: Path) -> Path:
    """CI's grid at its smaller batch size only: the same points per sharding, half the compiles (the
    suite's time budget); `test_every_grid_file_loads_and_names_its_command` loads the whole file."""
    text = (ROOT / CPU_GRID).read_text()
    assert '"data.examples_per_shard" = [4, 8]' in text
    path = tmp_path / "cpu8_one_batch.toml"
    path.write_text(text.replace('"data.examples_per_shard" = [4, 8]', '"data.examples_per_shard" = [4]'))
    return path


def _sweep(out: Path, grid: Path) -> subprocess.CompletedProcess:
    return run_cli(
        "sweep", "--config", "configs/tiny.toml", "--grid", str(grid), "--out", str(out), timeout=900
    )


@pytest.mark.slow
def test_cpu_grid_runs_records_and_resumes(tmp_path):
    out, grid = tmp_path / "sweep", _one_batch_size_grid(tmp_path)
    run = _sweep(out, grid)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["status"] for r in rows] == ["ok"] * 2 + ["invalid"], [(r["name"], r["error"]) for r in rows]
    assert "needs 16 devices" in rows[-1]["error"] and "parallel.mesh_shape" in rows[-1]["error"]
    for r in rows[:2]:
        assert r["devices"] == "8" and float(r["step_ms"]) > 0 and float(r["tokens_per_s"]) > 0
        assert float(r["compile_s"]) > 0 and float(r["mem_estimate_gib"]) > 0 and r["loss"]
    by_name = {r["name"]: r for r in rows}
    dp, row_wise = by_name["dp8 examples_per_shard=4"], by_name["dcn2xdata4_row_wise examples_per_shard=4"]
    assert float(dp["all-reduce_mib"]) > 0  # dense gradients
    assert float(dp["all-to-all_mib"]) == 0 < float(row_wise["all-to-all_mib"])  # ids and rows routed
    assert abs(float(dp["loss"]) - float(row_wise["loss"])) < 1e-3  # the same global batches and model
    assert (out / "plot.png").stat().st_size > 0 and "| dp8" in (out / "results.md").read_text()

    # Resumption: recorded points are skipped; a point whose record is missing runs again.
    log = out / "results.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # the last record torn, as by a kill
    again = _sweep(out, grid)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("skipped") == 2 and "[3/3] misfit16 examples_per_shard=4 ..." in again.stderr
    records = [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]
    assert len({r["id"] for r in records}) == 3


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.toml")), ids=lambda p: p.name)
def test_every_grid_file_loads_and_names_its_command(path):
    points = load_grid(path)
    assert points and len({p.name for p in points}) == len(points)
    assert path.read_text().startswith("#") and f"--grid configs/sweeps/{path.name}" in path.read_text()
