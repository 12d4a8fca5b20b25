"""FP8 quality with statistics (docs/fp8.md): the final click and conversion NE and AUC of runs named
`<recipe>_s<seed>` under a folder, per recipe the mean and spread over seeds, and each FP8 recipe's
NE change against bf16 paired by seed (same seed and worker count: the same batches).

    python3 scripts/device/fp8_quality.py RUNS_DIR [--baseline bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

METRICS = (("click", "ne"), ("click", "auc"), ("conversion", "ne"), ("conversion", "auc"))


def final_eval(workdir: Path) -> dict[tuple[str, str], float] | None:
    """The last evaluation in `workdir/metrics.jsonl` (None if it has none)."""
    path = workdir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    evals = [r for r in records if r.get("split") == "valid"]
    if not evals:
        return None
    return {(task, m): float(evals[-1]["valid"][task][m]) for task, m in METRICS}


def collect(root: Path) -> dict[str, dict[int, dict[tuple[str, str], float]]]:
    """{recipe: {seed: final metrics}} of the runs `<recipe>_s<seed>` under `root`; unfinished runs
    are reported on stderr and left out."""
    out: dict[str, dict[int, dict]] = {}
    for workdir in sorted(p for p in root.iterdir() if p.is_dir()):
        recipe, sep, seed = workdir.name.rpartition("_s")
        if not sep or not seed.isdigit():
            continue
        metrics = final_eval(workdir)
        if metrics is None:
            print(f"{workdir}: no evaluation in metrics.jsonl (left out)", file=sys.stderr)
            continue
        out.setdefault(recipe, {})[int(seed)] = metrics
    return out


def _stdev(values: list[float]) -> float:
    """The sample standard deviation; nan for one value (no spread to tell)."""
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def _mean_spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f} ± {_stdev(values):.4f}"


def table(runs: dict[str, dict[int, dict]], baseline: str = "bf16") -> str:
    """Markdown: one row per recipe (mean ± sample standard deviation over its seeds) and, for the
    others, the relative NE change against the baseline's run of the same seed (mean ± stdev)."""
    columns = ["recipe", "seeds", "click NE", "click AUC", "conversion NE", "conversion AUC"]
    columns.append(f"click (conversion) NE vs {baseline}, same seeds")
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    base = runs.get(baseline, {})
    for recipe, by_seed in sorted(runs.items(), key=lambda kv: (kv[0] != baseline, kv[0])):
        seeds = sorted(by_seed)
        cells = [_mean_spread([by_seed[s][m] for s in seeds]) for m in METRICS]
        paired = [s for s in seeds if s in base]
        versus = ""
        if recipe != baseline and paired:
            change = {
                task: [100 * (by_seed[s][(task, "ne")] / base[s][(task, "ne")] - 1) for s in paired]
                for task in ("click", "conversion")
            }
            click, conversion = change["click"], change["conversion"]
            versus = (
                f"{statistics.fmean(click):+.2f}% ± {_stdev(click):.2f} "
                f"({statistics.fmean(conversion):+.2f}% ± {_stdev(conversion):.2f}), seeds {paired}"
            )
        lines.append(f"| {recipe} | {len(seeds)} | " + " | ".join(cells) + f" | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--baseline", default="bf16")
    args = parser.parse_args(argv)
    print(table(collect(args.root), args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
