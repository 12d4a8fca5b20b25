"""Writing shard sets: records -> checked bytes -> ArrayRecord shards, on every core, and their schema.json.

Shards are written with `group_size:1` (every record its own chunk: a random read decodes one record,
which the global shuffle needs) and, by default, uncompressed (reading costs no decompression; `zstd`
is an option for slow disks). A shard is written under a temporary name and renamed when complete, and
schema.json is written last, so an interrupted conversion never leaves a shard set that looks whole.

`write_shards` runs one job per shard in a process pool (fork: the jobs' shared input, e.g. a whole
MovieLens ratings table, is inherited, not copied), with a progress bar over records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import queue
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from array_record.python.array_record_module import ArrayRecordWriter
from tqdm import tqdm

from gem_jax.data.records.codec import Invalid, Record, check_record
from gem_jax.data.records.errors import BadRecord
from gem_jax.data.records.schema import SHARD_SUFFIX, RecordSchema, RecordStats, ShardInfo, write_schema

COMPRESSION = {"none": "uncompressed", "zstd": "zstd:3"}
_PROGRESS_EVERY = 500  # records between a worker's progress reports


def shard_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}{SHARD_SUFFIX}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class ShardWriter:
    """Writes one shard: every record checked against the schema, statistics kept, renamed on close."""

    def __init__(self, path: Path, schema: RecordSchema, compression: str = "none"):

        self.path = Path(path)
        self.schema = schema
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._writer = ArrayRecordWriter(str(self._tmp), f"group_size:1,{COMPRESSION[compression]}")
        self.stats = RecordStats(len(schema.tasks))

    def write(self, record: Record) -> None:
        """Raises codec.Invalid (nothing written) if the record breaks the schema."""
        data = check_record(record, self.schema)
        self._writer.write(data)
        self.stats.add(len(record.candidates), record.labels.sum(0).tolist(), len(record.history_items))

    def close(self) -> ShardInfo:
        self._writer.close()
        self._tmp.replace(self.path)
        return ShardInfo(
            self.path, self.stats.records, self.path.stat().st_size, _sha256(self.path), self.stats.to_json()
        )


@dataclasses.dataclass
class ShardJob:
    """One shard to write: its index and the argument its records function reads (e.g. a row range)."""

    index: int
    count: int
    args: Any


@dataclasses.dataclass
class Written:
    """A shard set written: its shards, the records skipped as bad (with the first few reasons)."""

    directory: Path
    shards: list[ShardInfo]
    skipped: int
    skipped_examples: list[str]
    seconds: float

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)


# (context, job args) -> (where, record) pairs; a record may be an `Invalid` (refused while being built)
RecordsFn = Callable[[Any, Any], Iterable[tuple[str, Record | Invalid]]]

_context: Any = None
_progress: Any = None


def plain_signals() -> None:
    """A pool worker's signals: the default SIGTERM (the pool ends its workers with it) and no SIGINT (Ctrl-C
    reaches the parent, which ends the pool); not the handlers a forked CLI process inherits."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _init_worker(context: Any, progress: Any, forked: bool = True) -> None:
    global _context, _progress
    _context, _progress = context, progress
    if forked:
        plain_signals()


def _write_job(job: ShardJob, directory: Path, schema, records_fn, skip_bad: bool, compression: str):
    writer = ShardWriter(directory / shard_name(job.index, job.count), schema, compression)
    skipped, examples, since = 0, [], 0
    for where, record in records_fn(_context, job.args):
        try:
            if isinstance(record, Invalid):  # refused while being built (e.g. labels not one per candidate)
                raise record
            writer.write(record)
        except Invalid as e:
            if not skip_bad:
                raise BadRecord(f"{where}: {e}") from None
            skipped += 1
            if len(examples) < 5:
                examples.append(f"{where}: {e}")
        since += 1
        if since >= _PROGRESS_EVERY and _progress is not None:
            _progress.put(since)
            since = 0
    if since and _progress is not None:
        _progress.put(since)
    return writer.close(), skipped, examples


def write_shards(
    directory: str | Path,
    schema: RecordSchema,
    jobs: list[ShardJob],
    records_fn: RecordsFn,
    context: Any = None,
    *,
    workers: int | None = None,
    skip_bad: bool = False,
    compression: str = "none",
    total: int | None = None,
    desc: str = "records",
    source: dict[str, Any] | None = None,
    progress: bool = True,
) -> Written:
    """Writes `jobs` (one shard each) into `directory` with `workers` processes (default: every core),
    then its schema.json. `records_fn(context, job.args)` yields (where, record) pairs, `where` naming the
    record's origin for a BadRecord (e.g. "ratings.dat line 17"); with `skip_bad` such records are
    counted and left out instead. `total`: the records expected, for the progress bar."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [
        *directory.glob(f"part-*-of-*{SHARD_SUFFIX}"),
        *directory.glob(f"part-*-of-*{SHARD_SUFFIX}.tmp"),
    ]:
        stale.unlink()  # shards of an earlier conversion into this directory
    (directory / "schema.json").unlink(missing_ok=True)
    workers = min(workers or os.cpu_count() or 1, len(jobs)) or 1
    t0 = time.perf_counter()
    bar = None
    if progress:
        bar = tqdm(total=total, desc=desc, unit="rec", dynamic_ncols=True, file=sys.stderr)
    args = (directory, schema, records_fn, skip_bad, compression)
    try:
        if workers == 1:
            q: Any = queue.SimpleQueue()
            _init_worker(context, q, forked=False)
            results = []
            for job in jobs:
                results.append(_write_job(job, *args))
                _drain(q, bar)
        else:
            ctx = multiprocessing.get_context("fork")
            q = ctx.Queue()
            with ctx.Pool(workers, initializer=_init_worker, initargs=(context, q)) as pool:
                pending = pool.starmap_async(_write_job, [(job, *args) for job in jobs], chunksize=1)
                while not pending.ready():
                    pending.wait(0.2)
                    _drain(q, bar)
                results = pending.get()  # re-raises a worker's BadRecord
            _drain(q, bar)
    finally:
        if bar is not None:
            bar.close()
    shards = [r[0] for r in results]
    write_schema(directory, schema, shards, source)
    examples = [e for r in results for e in r[2]][:5]
    return Written(directory, shards, sum(r[1] for r in results), examples, time.perf_counter() - t0)


def _drain(q: Any, bar: Any) -> None:
    while True:
        try:
            n = q.get_nowait()
        except queue.Empty:
            return
        if bar is not None:
            bar.update(n)


def even_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) ranges splitting `total` items into `parts` nearly equal runs (none empty)."""
    parts = max(1, min(parts, total)) if total else 1
    bounds = [total * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
