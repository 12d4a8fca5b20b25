"""Plots of finished runs, read from their run directories (matplotlib; `pip install -e '.[plots]'`).

python -m experiments.plots validation runs/games_hstu runs/beauty_hstu --out docs/retrieval_validation.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plot_validation(
    workdirs: dict[str, str | Path],
    out: str | Path,
    metrics: tuple[str, ...] = ("sampled/NDCG@10", "full/NDCG@10"),
) -> None:
    """One panel per metric: validation value against epoch for each labelled run directory;
    a dotted line marks each run's chosen epoch (from its test.json)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for label, workdir in workdirs.items():
        lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
        valid = [r for r in map(json.loads, lines) if r.get("split") == "valid"]
        test_path = Path(workdir) / "test.json"
        test = json.loads(test_path.read_text()) if test_path.exists() else None
        for ax, metric in zip(axes[0], metrics):
            points = [(r["epoch"], r["valid"][metric]) for r in valid if metric in r["valid"]]
            if not points:
                continue
            (line,) = ax.plot(*zip(*points), marker=".", label=label)
            if test is not None:
                ax.axvline(test["epoch"], color=line.get_color(), linestyle=":", linewidth=1)
    for ax, metric in zip(axes[0], metrics):
        ax.set_title(f"validation {metric} (dotted: chosen epoch)")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.plots", description=__doc__)
    sub = parser.add_subparsers(dest="kind", required=True)
    validation = sub.add_parser("validation", help="validation curves of next-item runs")
    validation.add_argument(
        "workdirs", nargs="+", help="run directories (label = directory name, or LABEL=DIR)"
    )
    validation.add_argument("--out", required=True)
    validation.add_argument("--metrics", nargs="+", default=["sampled/NDCG@10", "full/NDCG@10"])
    args = parser.parse_args(argv)
    runs = dict(w.split("=", 1) if "=" in w else (Path(w).name, w) for w in args.workdirs)
    plot_validation(runs, args.out, tuple(args.metrics))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
