"""scripts/device/fp8_quality.py: the FP8 quality table (mean and spread over seeds, NE paired by seed)."""

import importlib.util
import json
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fp8_quality", ROOT / "scripts" / "device" / "fp8_quality.py")
fp8_quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fp8_quality)


def _run(root: Path, name: str, evals: list[tuple[float, float]]) -> None:
    """A workdir whose metrics.jsonl holds train records and one evaluation per (click NE, conversion NE)."""
    (root / name).mkdir(parents=True)
    lines = []
    for step, (click, conversion) in enumerate(evals, 1):
        lines.append(json.dumps({"step": step, "loss": 1.0}))
        valid = {
            "click": {"ne": click, "auc": 0.7 + step / 100},
            "conversion": {"ne": conversion, "auc": 0.75},
        }
        lines.append(json.dumps({"step": step, "split": "valid", "valid": valid}))
    (root / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_table_pairs_each_recipe_with_bf16_by_seed(tmp_path, capsys):
    _run(tmp_path, "bf16_s0", [(0.9, 0.9), (0.80, 0.70)])  # only the last evaluation counts
    _run(tmp_path, "bf16_s1", [(0.82, 0.72)])
    _run(tmp_path, "delayed_s0", [(0.84, 0.70)])
    _run(tmp_path, "delayed_s1", [(0.82, 0.756)])
    _run(tmp_path, "delayed_s2", [(0.83, 0.71)])  # no bf16 run of seed 2: in the mean, not in the pairs
    (tmp_path / "current_s0").mkdir()  # unfinished: reported and left out
    runs = fp8_quality.collect(tmp_path)
    assert "current_s0" in capsys.readouterr().err and "current" not in runs
    assert runs["bf16"][0][("click", "ne")] == 0.80 and runs["bf16"][0][("click", "auc")] == 0.72
    rows = {line.split(" | ")[0].strip("| "): line for line in fp8_quality.table(runs).splitlines()[2:]}
    assert list(rows) == ["bf16", "delayed"]  # the baseline first
    assert (
        f"{statistics.fmean([0.84, 0.82, 0.83]):.4f} ± {statistics.stdev([0.84, 0.82, 0.83]):.4f}"
        in rows["delayed"]
    )
    click = [100 * (0.84 / 0.80 - 1), 0.0]  # seeds 0 and 1
    conversion = [0.0, 100 * (0.756 / 0.72 - 1)]
    want = (
        f"{statistics.fmean(click):+.2f}% ± {statistics.stdev(click):.2f} "
        f"({statistics.fmean(conversion):+.2f}% ± {statistics.stdev(conversion):.2f}), seeds [0, 1]"
    )
    assert want in rows["delayed"] and rows["bf16"].endswith("|  |")


def test_one_seed_has_no_spread(tmp_path):
    _run(tmp_path, "bf16_s0", [(0.8, 0.7)])
    row = fp8_quality.table(fp8_quality.collect(tmp_path)).splitlines()[2]
    assert "0.8000 ± nan" in row


def test_the_device_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "device" / "fp8_quality.sh")], check=True)
