"""`python -m experiments data {convert,synth,inspect,validate}`: ranking records on disk (docs/data.md).

  convert SRC --out DIR      Parquet files (one row per request) or a MovieLens directory -> shard sets
                             (MovieLens: DIR/train, DIR/valid, DIR/test by time), on every core
  synth --config C --examples N --out DIR
                             the config's synthetic examples as shards: DIR/train (examples 0..N-1) and
                             DIR/valid (the task's held-out examples), on every core
  inspect DIR [--plot FILE]  schema, counts, label rates, history-length histogram (from schema.json)
  validate DIR               every record read and checked against the schema (and the shards' sha256)

A bad input row, or a bad record found by `validate`, is one line naming the file and row or record;
`convert --bad-rows skip` counts and leaves such rows out instead. Exit codes: 0 fine, 1 `validate` found
bad records, 2 an error (bad input, unreadable shards, a config error).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

from gem_jax.config import ConfigError, load_config
from gem_jax.data.records import movielens, parquet
from gem_jax.data.records.codec import Invalid, check, parse
from gem_jax.data.records.errors import BadShard, DataError
from gem_jax.data.records.reader import ShardSource
from gem_jax.data.records.schema import SCHEMA_FILE, ShardSet, bucket_label
from gem_jax.data.records.synthetic import synthetic_records, synthetic_schema
from gem_jax.data.records.writer import ShardJob, Written, _sha256, even_ranges, plain_signals, write_shards
from gem_jax.paths import DEFAULT_CONFIG
from gem_jax.tasks.ranking import EVAL_START

SPLIT_ORDER = ("train", "valid", "test")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common_write(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
        p.add_argument("--shards", type=int, default=None, help="shards per split (default: 4 per worker)")
        p.add_argument("--compression", choices=("none", "zstd"), default="none")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    convert = sub.add_parser("convert", help="Parquet or MovieLens -> shards")
    convert.add_argument("src", nargs="+", help="Parquet files or directories, or one MovieLens directory")
    convert.add_argument("--format", choices=("auto", "parquet", "movielens"), default="auto")
    common_write(convert)
    convert.add_argument("--bad-rows", choices=("stop", "skip"), default="stop")
    convert.add_argument("--tasks", default=None, help="Parquet: label columns to keep, in order (a,b)")
    convert.add_argument("--max-history", type=int, default=256, help="MovieLens: history events kept")
    convert.add_argument("--split", default="0.8,0.1", help="MovieLens: train,valid fractions by time")

    synth = sub.add_parser("synth", help="the synthetic task's examples -> shards")
    synth.add_argument("--config", default=None, help="TOML config (default: configs/tiny.toml)")
    synth.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    synth.add_argument("--examples", type=int, required=True, help="training examples (0..N-1)")
    synth.add_argument(
        "--eval-examples", type=int, default=None, help="validation examples (default data.eval_examples)"
    )
    synth.add_argument(
        "--distinct",
        type=int,
        default=None,
        help="volume tests: request i holds example i mod K (K distinct)",
    )
    common_write(synth)

    inspect = sub.add_parser("inspect", help="what a shard set holds")
    inspect.add_argument("dir", help="a shard set, or a directory of split shard sets (train/valid/test)")
    inspect.add_argument("--plot", default=None, metavar="FILE.png", help="history lengths and label rates")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")

    validate = sub.add_parser("validate", help="check every record against the schema")
    validate.add_argument("dir", help="a shard set, or a directory of split shard sets")
    validate.add_argument("--workers", type=int, default=None)
    validate.add_argument("--no-sha256", action="store_true", help="skip hashing the shard files")
    validate.add_argument("--show", type=int, default=10, help="bad records listed (the rest are counted)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"convert": convert, "synth": synth, "inspect": inspect, "validate": validate}[args.command](
            args
        )
    except (DataError, ConfigError, FileNotFoundError) as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------- writing


def _workers(args) -> int:
    return args.workers or os.cpu_count() or 1


def _jobs(total: int, args) -> list[ShardJob]:
    ranges = even_ranges(total, args.shards or 4 * _workers(args))
    return [ShardJob(i, len(ranges), r) for i, r in enumerate(ranges)]


def _write(
    directory: Path, schema, jobs, records_fn, context, args, total, desc, source, skip_bad=False
) -> Written:
    return write_shards(
        directory,
        schema,
        jobs,
        records_fn,
        context,
        workers=_workers(args),
        skip_bad=skip_bad,
        compression=args.compression,
        total=total,
        desc=desc,
        source=source,
        progress=not args.quiet,
    )


def convert(args) -> int:
    src = [Path(s) for s in args.src]
    missing = [s for s in src if not s.exists() and not any(ch in str(s) for ch in "*?[")]
    if missing:
        raise DataError(
            f"{missing[0]}: no such file or folder (MovieLens: unzip GroupLens's files there, README, "
            '"Public data"; Parquet: a file, a folder of them or a glob)'
        )
    fmt = args.format
    if fmt == "auto":
        fmt = (
            "movielens"
            if len(src) == 1 and src[0].is_dir() and not list(src[0].glob("*.parquet"))
            else "parquet"
        )
    out = Path(args.out)
    written: dict[str, Written] = {}
    if fmt == "movielens":
        train, valid = (float(x) for x in args.split.split(","))
        data = movielens.load(src[0])
        prepared = movielens.prepare(data, max_history=args.max_history, train=train, valid=valid)
        source = {
            "kind": "movielens",
            "layout": data.layout,
            "from": str(src[0]),
            "max_history": args.max_history,
        }
        source["split"] = {"train": train, "valid": valid}
        for split, (a, b) in prepared.splits.items():
            jobs = [ShardJob(j.index, j.count, (a + j.args[0], a + j.args[1])) for j in _jobs(b - a, args)]
            written[split] = _write(
                out / split, prepared.schema, jobs, movielens.movielens_records, prepared, args, b - a, split,
                {**source, "split_name": split}, args.bad_rows == "skip",
            )  # fmt: skip
    else:
        files = parquet.parquet_files([str(s) for s in src])
        schema = parquet.infer_schema(files, args.tasks.split(",") if args.tasks else None)
        groups = parquet.row_groups(files)
        total = sum(g[3] for g in groups)
        n = min(args.shards or 4 * _workers(args), len(groups))
        pieces = [[g[:3] for g in groups[a:b]] for a, b in even_ranges(len(groups), n)]
        jobs = [ShardJob(i, len(pieces), p) for i, p in enumerate(pieces)]
        source = {"kind": "parquet", "files": [str(f) for f in files]}
        written["train"] = _write(
            out,
            schema,
            jobs,
            parquet.parquet_records,
            schema,
            args,
            total,
            "rows",
            source,
            args.bad_rows == "skip",
        )
    _print_written(written)
    return 0


def synth(args) -> int:
    config = load_config(args.config or DEFAULT_CONFIG, args.overrides)
    schema = synthetic_schema(config)
    out = Path(args.out)
    n_eval = config.data.eval_examples if args.eval_examples is None else args.eval_examples
    source = {"kind": "synthetic", "config": str(args.config or DEFAULT_CONFIG), "overrides": args.overrides}
    written = {}
    for split, start, n in (("train", 0, args.examples), ("valid", EVAL_START, n_eval)):
        if n:
            jobs = [
                ShardJob(j.index, j.count, (start + j.args[0], start + j.args[1])) for j in _jobs(n, args)
            ]
            written[split] = _write(
                out / split,
                schema,
                jobs,
                synthetic_records,
                (config, args.distinct),
                args,
                n,
                split,
                {**source, "first": start, "distinct": args.distinct},
            )
    _print_written(written)
    evaluate = f" --set data.eval_path={out / 'valid'}" if "valid" in written else ""
    print(f"train on them: --set data.kind=records --set data.path={out / 'train'}{evaluate}")
    return 0


def _print_written(written: dict[str, Written]) -> None:
    for split, w in written.items():
        shard_set = ShardSet.open(str(w.directory))
        stats = shard_set.stats()
        size = sum(s.bytes for s in w.shards)
        print(
            f"{split}: {w.records:,} records in {len(w.shards)} shards, {size / 2**20:.1f} MiB, {w.directory} "
            f"({w.seconds:.1f} s, {w.records / max(w.seconds, 1e-9):,.0f} records/s)"
        )
        for line in _stats_lines(stats, shard_set.schema.tasks):
            print(f"  {line}")
        if w.skipped:
            print(f"  skipped {w.skipped:,} bad rows, e.g.:")
            for e in w.skipped_examples:
                print(f"    {e}")


# ----------------------------------------------------------------------------- reading


def _shard_sets(directory: str) -> dict[str, ShardSet]:
    """A shard set, or the split shard sets (train/valid/test) of a directory."""
    d = Path(directory)
    if (d / SCHEMA_FILE).exists() or not d.is_dir():
        return {d.name: ShardSet.open(directory)}
    found = {s: ShardSet.open(str(d / s)) for s in SPLIT_ORDER if (d / s / SCHEMA_FILE).exists()}
    found.update(
        {
            p.name: ShardSet.open(str(p))
            for p in sorted(d.iterdir())
            if (p / SCHEMA_FILE).exists() and p.name not in found
        }
    )
    if not found:
        raise FileNotFoundError(f"{directory}: no {SCHEMA_FILE} in it or in its subdirectories")
    return found


def _stats_lines(stats: dict[str, Any], tasks: tuple[str, ...]) -> list[str]:
    n, labels = stats["records"], max(stats["labels"], 1)
    lines = ["label rates: " + ", ".join(f"{t} {s / labels:.4f}" for t, s in zip(tasks, stats["label_sums"]))]
    lines.append(
        f"history: mean {stats['history_events'] / max(n, 1):.1f} events, max {stats['history_max']}"
    )
    return lines


def _histogram_lines(stats: dict[str, Any]) -> list[str]:
    hist = {int(b): c for b, c in stats["history_hist"].items()}
    top = max(hist.values(), default=1)
    return [
        f"  {bucket_label(b):>13} {c:>11,} {'#' * max(1, round(40 * c / top))}"
        for b, c in sorted(hist.items())
    ]


def inspect(args) -> int:
    sets = _shard_sets(args.dir)
    summary = {}
    for name, s in sets.items():
        stats = s.stats()
        summary[name] = {
            "records": s.num_records,
            "shards": len(s.shards),
            "bytes": sum(x.bytes for x in s.shards),
            **stats,
        }
    if args.json:
        print(json.dumps({"schema": next(iter(sets.values())).schema.to_json(), "splits": summary}, indent=1))
    else:
        schema = next(iter(sets.values())).schema
        print(f"schema ({SCHEMA_FILE}):")
        print(f"  tasks: {', '.join(schema.tasks)}; {schema.num_candidates} candidate(s) per request")
        print(f"  items: vocab {schema.item_vocab}; actions: vocab {schema.action_vocab}")
        print("  sparse: " + ", ".join(f"{f.name} (vocab {f.vocab})" for f in schema.sparse_features))
        print("  dense: " + ", ".join(schema.dense_features))
        for name, s in sets.items():
            info = summary[name]
            size = info["bytes"] / 2**20
            print(
                f"{name}: {info['records']:,} records in {info['shards']} shards, {size:.1f} MiB ({s.where})"
            )
            for line in _stats_lines(info, schema.tasks):
                print(f"  {line}")
            print("  history length   requests")
            for line in _histogram_lines(info):
                print(line)
    if args.plot:
        _plot(summary, next(iter(sets.values())).schema.tasks, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plot(summary: dict[str, dict], tasks: tuple[str, ...], path: str) -> None:
    import matplotlib  # optional dependency: the plots extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: the plots extra

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(summary)
    for i, (name, info) in enumerate(summary.items()):
        hist = {int(b): c for b, c in info["history_hist"].items()}
        buckets = range(max(hist) + 1)
        ax1.bar(
            [b + i * width for b in buckets],
            [hist.get(b, 0) / info["records"] for b in buckets],
            width,
            label=name,
        )
        rates = [s / max(info["labels"], 1) for s in info["label_sums"]]
        ax2.bar([k + i * width for k in range(len(tasks))], rates, width, label=name)
    buckets = list(range(max(int(b) for info in summary.values() for b in info["history_hist"]) + 1))
    middle = width * (len(summary) - 1) / 2
    ax1.set_xticks([b + middle for b in buckets], [bucket_label(b) for b in buckets], rotation=60, fontsize=7)
    ax1.set(title="history length", xlabel="events", ylabel="fraction of requests")
    ax2.set_xticks([k + middle for k in range(len(tasks))], tasks)
    ax2.set(title="label rate", ylabel="positives / labels")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _validate_shard(args: tuple[int, dict, bool, int]) -> tuple[int, int, list[str], str | None]:
    """(records read, bad records, the first messages, a shard-level problem) of one shard."""
    index, payload, hash_files, show = args
    shard_set = _VALIDATE[payload["set"]]
    shard = shard_set.shards[index]
    if hash_files and _sha256(shard.path) != shard.sha256:
        return 0, 0, [], f"{shard.path}: sha256 differs from its {SCHEMA_FILE} (the file changed)"
    one = ShardSet(shard_set.schema, [shard], shard_set.where)
    source = ShardSource(one)
    bad, messages = 0, []
    for i in range(shard.records):
        try:
            _, data = source[i]
            check(parse(data, shard_set.schema), shard_set.schema)
        except Invalid as e:
            bad += 1
            if len(messages) < show:
                messages.append(f"{shard.path}: record {i}: {e}")
        except BadShard as e:
            return i, bad, messages, str(e)
    return shard.records, bad, messages, None


_VALIDATE: dict[str, ShardSet] = {}


def validate(args) -> int:
    t0 = time.perf_counter()
    sets = _shard_sets(args.dir)
    _VALIDATE.clear()
    _VALIDATE.update(sets)
    tasks = [
        (i, {"set": name}, not args.no_sha256, args.show)
        for name, s in sets.items()
        for i in range(len(s.shards))
    ]
    workers = min(_workers(args), len(tasks)) or 1
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers, initializer=plain_signals) as pool:
            results = pool.map(_validate_shard, tasks, chunksize=1)
    else:
        results = [_validate_shard(t) for t in tasks]
    read = sum(r[0] for r in results)
    bad = sum(r[1] for r in results)
    problems = [r[3] for r in results if r[3]]
    shown = [m for r in results for m in r[2]][: args.show]
    for m in shown:
        print(m)
    for p in problems:
        print(p)
    if bad > len(shown):
        print(f"... and {bad - len(shown)} more bad records")
    elapsed = time.perf_counter() - t0
    total = sum(s.num_records for s in sets.values())
    verdict = "ok" if not bad and not problems else "FAILED"
    print(
        f"validate {args.dir}: {verdict}: {read:,} of {total:,} records read in {elapsed:.1f} s, {bad} bad, "
        f"{len(problems)} unreadable or changed shards"
    )
    return 0 if verdict == "ok" else 1
