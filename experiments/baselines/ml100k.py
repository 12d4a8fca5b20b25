"""`python -m experiments.baselines.ml100k [--seeds 0 1 2] [--out runs/ml100k]`: the MovieLens-100K ranking
table of docs/results.md: GEM (configs/ml100k_rank.toml), the same model with the history removed
(`data.max_history_len=0`), and logistic regression on the same features (experiments/baselines/logreg.py),
each over the seeds (train.seed and data.seed), test AUC and NE of the checkpoint chosen on validation.

Runs what is missing (a finished run's test.json, or a logreg JSON, is reused; `--collect` only reads),
then prints the markdown table. Needs the converted shards:
  python -m experiments data convert data/movielens/ml-100k --out data/movielens/ml-100k-records
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "ml100k_rank.toml"
VARIANTS = {  # name -> extra --set overrides of the GEM runs
    "GEM (HSTU + Wukong)": [],
    # 3 tokens per request: a smaller token buffer holds the same 128 requests per step, faster
    "GEM, history removed": ["data.max_history_len=0", "data.tokens_per_shard=512"],
}


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {code}); see {log}")


def gem(
    out: Path, name: str, overrides: list[str], seed: int, collect: bool, extra: list[str]
) -> dict | None:
    workdir = out / f"{name.split(',')[0].split()[0].lower()}{'-nohist' if overrides else ''}-s{seed}"
    test = workdir / "test.json"
    if not test.exists() and not collect:
        sets = [
            x for o in [*overrides, f"train.seed={seed}", f"data.seed={seed}", *extra] for x in ("--set", o)
        ]
        _run(
            [
                sys.executable,
                "-m",
                "experiments",
                "train",
                "--config",
                str(CONFIG),
                "--workdir",
                str(workdir),
                *sets,
            ],
            workdir.with_suffix(".log"),
        )
    return json.loads(test.read_text())["test"] if test.exists() else None


def logreg(out: Path, data: str, seed: int, collect: bool) -> dict | None:
    path = out / f"logreg-s{seed}.json"
    if not path.exists() and not collect:
        log = path.with_suffix(".log")
        _run([sys.executable, "-m", "experiments.baselines.logreg", "--data", data, "--seed", str(seed)], log)
        path.write_text(log.read_text().strip().splitlines()[-1])
    return json.loads(path.read_text())["test"] if path.exists() else None


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.baselines.ml100k", description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/ml100k")
    parser.add_argument("--data", default="data/movielens/ml-100k-records")
    parser.add_argument("--collect", action="store_true", help="only read finished runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra GEM overrides")
    args = parser.parse_args(argv)
    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    rows = {}
    for name, overrides in VARIANTS.items():
        rows[name] = [gem(out, name, overrides, s, args.collect, args.overrides) for s in args.seeds]
    rows["logistic regression (same features)"] = [
        logreg(out, args.data, s, args.collect) for s in args.seeds
    ]
    print("| model | test AUC (like) | test NE (like) | seeds |\n| --- | --- | --- | --- |")
    for name, results in rows.items():
        done = [r["like"] for r in results if r is not None]
        print(
            f"| {name} | {_cell([r['auc'] for r in done])} | {_cell([r['ne'] for r in done])} | {len(done)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
