"""`python -m experiments bench pipeline --config C [--set ...]`: the input pipeline alone (host only, no
device step, no compile): time per batch, and the memory of the trainer's process and its data workers
while it streams.

`time_pipeline` is also what `bench train_step` and `profile` report as the pipeline's time: every data
worker's first batch is untimed (workers start at once and each packs whole batches of its own slice, so
the first W batches measure start-up), then at least two rounds of every worker are timed (fewer would
read batches packed ahead while the first round was awaited).

With `--epochs E` (records only) it streams E passes over the training shards and samples the resident
memory (RSS) of this process plus its worker processes every `--rss-every` seconds into `--rss-out`
(CSV: seconds, batches, GiB read, RSS MiB): on a shard set larger than the page cache it shows whether
memory stays flat while streaming.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax

from gem_jax.config import load_config
from gem_jax.tasks import make_task


@dataclasses.dataclass
class PipelineTiming:
    s_per_batch: float
    untimed: int
    timed: int
    batches: list[Any]  # the timed host batches (numpy stacks), in order
    untimed_batches: list[Any]  # the batches before them


def time_pipeline(it, workers: int, batches: int) -> PipelineTiming:
    """Seconds per batch of an iterator of host batches (see the module docstring for the protocol)."""
    warmup = max(1, workers)
    first = [next(it) for _ in range(warmup)]
    timed = max(batches, 2 * workers)
    t0 = time.perf_counter()
    host = [next(it) for _ in range(timed)]
    return PipelineTiming((time.perf_counter() - t0) / timed, warmup, timed, host, first)


def pipeline_source(config) -> str:
    """What the pipeline reads, for reports: the generator, or which shards."""
    d = config.data
    if d.kind == "records":
        return f"records {d.path} ({d.num_workers} workers)"
    return f"{d.kind} generator ({d.num_workers} workers)" if d.kind == "synthetic" else f"{d.kind} {d.path}"


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    """Every descendant process of `pid` (Linux /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_tree_rss_mib() -> tuple[float, int]:
    """(RSS of this process and all its descendants in MiB, number of processes)."""
    me = os.getpid()
    pids = [me, *_children(me)]
    return sum(_rss_mib(p) for p in pids), len(pids)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments bench pipeline")
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--batches", type=int, default=60, help="timed batches (at least 2 per data worker)")
    parser.add_argument("--epochs", type=float, default=0, help="records: then stream this many passes")
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--rss-out", default=None, help="CSV of the memory samples")
    args = parser.parse_args(argv)

    config = load_config(args.config, args.overrides)
    task = make_task(config)
    it = iter(task.train_data(jax.process_index(), jax.process_count()))
    timing = time_pipeline(it, config.data.num_workers, args.batches)
    tokens = sum(float(b.offsets[:, -1].sum()) for b in timing.batches) / timing.timed
    examples = sum(float((b.num_targets > 0).sum()) for b in timing.batches) / timing.timed
    result: dict[str, Any] = {
        "config": args.config,
        "overrides": args.overrides,
        "pipeline": pipeline_source(config),
        "pipeline_s_per_batch": timing.s_per_batch,
        "pipeline_batches": {"untimed": timing.untimed, "timed": timing.timed},
        "tokens_per_batch": tokens,
        "examples_per_batch": examples,
        "host_cpus": os.cpu_count(),
    }
    del timing
    if args.epochs and task.records is not None:
        result["stream"] = _stream(task, it, args)
    print(json.dumps(result, indent=1))
    return 0


def _stream(task, it, args) -> dict[str, Any]:
    """Streams `args.epochs` passes over the training shards, sampling memory; a summary of the samples."""
    shard_set = task.records.splits["train"]
    total_bytes = sum(s.bytes for s in shard_set.shards)
    bytes_per_example = total_bytes / shard_set.num_records
    target = args.epochs * shard_set.num_records
    samples = []
    t0 = last = time.perf_counter()
    batches = 0
    read = 0.0
    out = open(args.rss_out, "w") if args.rss_out else None  # noqa: SIM115 (closed below)
    if out:
        out.write("seconds,batches,gib_read,rss_mib,processes\n")
    try:
        while read < target:
            stack = next(it)
            batches += 1
            read += float((stack.num_targets > 0).sum())
            now = time.perf_counter()
            if now - last >= args.rss_every or read >= target:
                last = now
                rss, procs = process_tree_rss_mib()
                gib = read * bytes_per_example / 2**30
                samples.append((now - t0, batches, gib, rss, procs))
                if out:
                    out.write(f"{now - t0:.1f},{batches},{gib:.3f},{rss:.1f},{procs}\n")
                    out.flush()
                print(
                    f"{now - t0:7.1f} s  {batches:7d} batches  {gib:8.2f} GiB  RSS {rss:9.1f} MiB",
                    file=sys.stderr,
                )
    finally:
        if out:
            out.close()
    rss = [s[3] for s in samples]
    quarter = max(1, len(rss) // 4)
    return {
        "shards": f"{len(shard_set.shards)} shards, {total_bytes / 2**30:.2f} GiB, {shard_set.num_records} records",
        "gib_read": samples[-1][2] if samples else 0.0,
        "seconds": samples[-1][0] if samples else 0.0,
        "batches": batches,
        "rss_mib_first_quarter_max": max(rss[:quarter]) if rss else None,
        "rss_mib_last_quarter_max": max(rss[-quarter:]) if rss else None,
        "rss_mib_max": max(rss) if rss else None,
        "samples": len(samples),
        "rss_csv": str(Path(args.rss_out).resolve()) if args.rss_out else None,
    }
