"""Plots of finished runs, read from their run directories (matplotlib; `pip install -e '.[plots]'`).

python -m experiments.plots validation runs/games_hstu runs/beauty_hstu --out docs/retrieval_validation.png
python -m experiments.plots offload hbm.log 0.05.log 0.1.log --out docs/offload_curve.png   (bench train_step logs)
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
    import matplotlib  # optional dependency: the plots extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: the plots extra

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


def read_bench_report(path: str | Path) -> dict:
    """The JSON report in a `bench train_step` log (its stdout; progress lines may come before it)."""
    text = Path(path).read_text()
    start, end = text.find("{\n"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError(f"{path}: no `bench train_step` JSON report in it (did the run finish?)")
    return json.loads(text[start : end + 1])


def plot_offload(reports: list[dict], out: str | Path, table: str = "items") -> None:
    """Step time against the HBM cache's share of an offloaded table's rows (left; the in-HBM step as
    horizontal lines), and the cache's hit rate and host -> device bytes per step (right)."""
    import matplotlib  # optional dependency: the plots extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: the plots extra

    in_hbm = [r for r in reports if table not in (r.get("offloaded") or {})]
    points = sorted(
        (r["offloaded"][table]["cache_rows"] / r["offloaded"][table]["rows"], r)
        for r in reports
        if table in (r.get("offloaded") or {})
    )
    if not points:
        raise ValueError(f"no report has table {table!r} offloaded (`offloaded` in the bench report)")
    fractions = [100 * f for f, _ in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label, style in (("device_step_s_median", "each step waited for", "o-"),
                              ("step_s_back_to_back", "back to back (as training runs)", "s-")):  # fmt: skip
        (line,) = left.plot(fractions, [1e3 * r[key] for _, r in points], style, label=f"offload: {label}")
        for r in in_hbm:
            left.axhline(1e3 * r[key], color=line.get_color(), linestyle=":", label=f"in HBM: {label}")
    left.set_xlabel(f"cache rows, % of the `{table}` table")
    left.set_ylabel("ms per step")
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    cache = [r["cache_per_step"] for _, r in points]
    hits = [c[f"embeddings/{table}/cache_hits"] for c in cache]
    misses = [c[f"embeddings/{table}/cache_misses"] for c in cache]
    right.plot(
        fractions, [100 * h / max(h + m, 1.0) for h, m in zip(hits, misses)], "o-", label="hit rate, %"
    )
    right.plot(fractions, [c[f"embeddings/{table}/host_to_device_bytes"] / 1e6 for c in cache], "s-",
               label="host -> device MB per step")  # fmt: skip
    right.plot(fractions, [c[f"embeddings/{table}/device_to_host_bytes"] / 1e6 for c in cache], "^-",
               label="device -> host MB per step (evictions)")  # fmt: skip
    right.set_xlabel(f"cache rows, % of the `{table}` table")
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
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
    offload = sub.add_parser("offload", help="step time against cache size of an offloaded table")
    offload.add_argument("logs", nargs="+", help="`bench train_step` outputs: in HBM and offloaded points")
    offload.add_argument("--table", default="items")
    offload.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.kind == "offload":
        plot_offload([read_bench_report(p) for p in args.logs], args.out, args.table)
        print(f"wrote {args.out}")
        return 0
    runs = dict(w.split("=", 1) if "=" in w else (Path(w).name, w) for w in args.workdirs)
    plot_validation(runs, args.out, tuple(args.metrics))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
