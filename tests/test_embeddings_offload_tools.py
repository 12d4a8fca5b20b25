"""`bench train_step`, `measure` (the sweeps' point runner) and `profile` on a config with an offloaded
table: each step stages its rows from host memory first, as training does (Trainer.lower_step,
Trainer.rotating_steps), and the first step's loss equals the same config's with the table in HBM."""

from __future__ import annotations

import json

import pytest

from experiments import measure, plots, profile
from experiments.benchmarks import train_step
from tests.helpers import SMALL

TABLES = (
    "embeddings.tables.actions={rows=16, dim=16}",
    "embeddings.tables.sparse={rows=256, dim=16}",
    "embeddings.features.items={table='items', pooling='none'}",
    "embeddings.features.actions={table='actions', pooling='none'}",
    "embeddings.features.sparse={table='sparse', pooling='mean'}",
    "model.num_layers=1",
    "model.wukong_layers=1",
)
CONFIG = "configs/tiny.toml"


def _overrides(items: str) -> list[str]:
    return [
        *SMALL,
        *TABLES,
        f"embeddings.tables.items={{rows=4096, dim=16, sharding='{items}', cache_rows=256}}",
    ]


@pytest.mark.slow  # three compiles of a small step, two steps each
def test_measure_bench_and_profile_run_offloaded_tables(tmp_path, capsys):
    offloaded = measure.measure(CONFIG, _overrides("offload"), steps=3, warmup=1, batches=2)
    in_hbm = measure.measure(CONFIG, _overrides("row_wise"), steps=3, warmup=1, batches=2)
    assert offloaded["status"] == "ok"
    assert offloaded["loss_first"] == in_hbm["loss_first"]  # the same step, staged (bitwise, as training)
    assert offloaded["loss"] == in_hbm["loss"]

    assert train_step.main(["--config", CONFIG, *[f"--set={o}" for o in _overrides("offload")],
                            "--batches=20", "--steps=2", "--pipeline-steps=20", "--warmup=16"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["host_staging"] is True
    assert report["warmup_steps"] == 16 and report["every_step_a_new_batch"] is True
    assert 0 < report["host_stage_s_median"] < 60
    # a 256-row cache after 16 fresh batches is full: the timed steps write evicted rows back
    cache = report["cache_per_step"]
    assert cache["embeddings/items/device_to_host_bytes"] > 0
    # steady state: every missing row evicts one (the same bytes each way)
    assert cache["embeddings/items/device_to_host_bytes"] == cache["embeddings/items/host_to_device_bytes"]
    assert report["offloaded"] == {"items": {"rows": 4096, "cache_rows": 256}}
    log = tmp_path / "bench.log"
    log.write_text("bench train_step: progress on stderr\n" + json.dumps(report, indent=1))
    assert plots.main(["offload", str(log), "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="no report has table 'sparse' offloaded"):
        plots.plot_offload([report], tmp_path / "x.png", table="sparse")
    misses = report["cache_per_step"]["embeddings/items/cache_misses"]
    hits = report["cache_per_step"]["embeddings/items/cache_hits"]
    assert misses + hits > 0 and report["device_step_s_median"] > 0 and report["step_s_back_to_back"] > 0

    result = profile.run_profile(
        CONFIG, _overrides("offload"), steps=2, warmup=1, batches=2, pipeline_batches=2, out=tmp_path / "p"
    )
    assert result.summary["untraced_step_ms"] > 0
