"""Reading shards into examples: a grain random-access source, the record -> example decoder, and the
stream that skips bad records and counts what it cut.

`ShardSource` is a grain data source over every record of a shard set (global index -> (index, bytes)),
so a global shuffle, per-process and per-worker slices and a checkpointable position come from grain
as they do for the generator. Readers open lazily, per process, and read one record per call
(`read(i, i + 1)`: ~10 us; array_record's list read costs ~100 us per call).

`ExampleDecoder` turns a record into the packer's example dict (gem_jax/data/batch.py): the model's
tasks, sparse and dense features picked by name, the history cut to its most recent
`max_history_len` events. A record that breaks the schema raises `BadRecord` naming the shard file and
the record's index in it, or with `skip_bad` becomes a `Skipped` marker that `CountedRecords` drops and
counts. Counts live in the iterator's state, so they are checkpointed and resume with the run.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from gem_jax.data.records.codec import Invalid, check, parse
from gem_jax.data.records.errors import BadRecord, BadShard, TooManyBadRecords
from gem_jax.data.records.schema import RecordSchema, ShardSet

COUNTS = ("skipped_records", "histories_cut", "bags_cut")  # the counters, summed over streams
_STATE_KEY = "data_counts"


class ShardSource:
    """grain random-access source: record `i` of the shard set (shards in order) -> `(i, bytes)`."""

    def __init__(self, shard_set: ShardSet):
        self.paths = [str(s.path) for s in shard_set.shards]
        self.counts = [s.records for s in shard_set.shards]
        self.starts = list(np.cumsum([0, *self.counts[:-1]]).tolist())
        self._total = sum(self.counts)
        self._readers: list[Any] = [None] * len(self.paths)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._total

    def locate(self, index: int) -> tuple[str, int]:
        """(shard file, index of the record in it) of global record `index`."""
        shard = bisect.bisect_right(self.starts, index) - 1
        return self.paths[shard], index - self.starts[shard]

    def _reader(self, shard: int):
        reader = self._readers[shard]
        if reader is not None:
            return reader

        with self._lock:
            if self._readers[shard] is None:
                path = self.paths[shard]
                try:
                    reader = ArrayRecordReader(path, "readahead_buffer_size:0,max_parallelism:0")
                except Exception as e:  # noqa: BLE001 (the reader's own error types are not exported)
                    raise BadShard(f"{path}: unreadable ({type(e).__name__}: {e})") from None
                if not reader.ok():
                    raise BadShard(f"{path}: unreadable (truncated, or not an ArrayRecord file)")
                if reader.num_records() != self.counts[shard]:
                    raise BadShard(
                        f"{path}: {reader.num_records()} records, its schema.json says {self.counts[shard]}"
                    )
                self._readers[shard] = reader
            return self._readers[shard]

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        index = int(index)
        if not 0 <= index < self._total:
            raise IndexError(f"record {index} of {self._total}")
        shard = bisect.bisect_right(self.starts, index) - 1
        local = index - self.starts[shard]
        try:
            return index, self._reader(shard).read(local, local + 1)[0]
        except BadShard:
            raise
        except Exception as e:  # noqa: BLE001 (a corrupt chunk: riegeli's RuntimeError)
            raise BadShard(
                f"{self.paths[shard]}: record {local} unreadable ({type(e).__name__}: {e})"
            ) from None

    def __getstate__(self) -> dict[str, Any]:  # grain pickles sources into its worker processes
        state = dict(self.__dict__)
        state["_readers"] = [None] * len(self.paths)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class Skipped:
    """A bad record left out (`data.bad_records = "skip"`): what was wrong with it, for the log."""

    def __init__(self, message: str):
        self.message = message


class ExampleDecoder:
    """`(index, bytes)` -> the packer's example dict, or `Skipped`; raises BadRecord otherwise.

    Args:
      source: names a record's shard and index in messages.
      tasks / sparse / dense: indices into the schema's tasks, sparse and dense features, in the
        model's order (None: all, in the schema's order).
      max_history_len: longer histories keep their most recent events (counted: "histories_cut").
      max_bag_size: longer bags are cut by the packer (counted here: "bags_cut").
    """

    def __init__(
        self,
        source: ShardSource,
        schema: RecordSchema,
        *,
        tasks: list[int] | None,
        sparse: list[int] | None,
        dense: list[int] | None,
        max_history_len: int,
        max_bag_size: int,
        skip_bad: bool,
    ):
        self.source = source
        self.schema = schema
        self.tasks = None if tasks == list(range(len(schema.tasks))) else tasks
        self.sparse = None if sparse == list(range(len(schema.sparse_features))) else sparse
        self.dense = None if dense == list(range(len(schema.dense_features))) else dense
        self.max_history_len = max_history_len
        self.max_bag_size = max_bag_size
        self.skip_bad = skip_bad
        self.num_candidates = schema.num_candidates

    def __call__(self, item: tuple[int, bytes]) -> dict[str, Any] | Skipped:
        index, data = item
        try:
            p = parse(data, self.schema)
            check(p, self.schema)
        except Invalid as e:
            path, local = self.source.locate(index)
            message = f"{path}: record {local}: {e}"
            if self.skip_bad:
                return Skipped(message)
            raise BadRecord(message) from None
        c, n = self.num_candidates, p.num_history
        items, actions, times = p.items, p.actions, p.times
        cut = n > self.max_history_len
        if cut:
            keep = self.max_history_len
            items, actions, times = items[n - keep :], actions[n - keep :], times[n - keep :]
            n = keep
        labels = p.labels if self.tasks is None else p.labels[:, self.tasks]
        bags = p.bags()
        if self.sparse is not None:
            bags = [bags[j] for j in self.sparse]
        return {
            "item_ids": items,
            "action_ids": np.concatenate([actions, np.zeros(c, np.int32)]),
            "timestamps": np.concatenate([times, np.full(c, p.timestamp, np.int32)]),
            "num_targets": c,
            "sparse_ids": bags,
            "dense": p.dense if self.dense is None else p.dense[self.dense],
            "labels": labels,
            "history_cut": cut,
            "bags_cut": sum(len(b) > self.max_bag_size for b in bags),
        }


class _CountedIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, max_bad: int):
        super().__init__(parent)
        self._max_bad = max_bad
        self._counts = dict.fromkeys(COUNTS, 0)

    def __next__(self) -> dict[str, Any]:
        while True:
            example = next(self._parent)
            if isinstance(example, Skipped):
                self._counts["skipped_records"] += 1
                if self._counts["skipped_records"] > self._max_bad:
                    raise TooManyBadRecords(
                        f"more than data.max_bad_records = {self._max_bad} bad records skipped; the last: "
                        f"{example.message}"
                    )
                continue
            self._counts["histories_cut"] += example["history_cut"]
            self._counts["bags_cut"] += example["bags_cut"]
            return example

    def get_state(self) -> dict[str, Any]:
        return {**self._parent.get_state(), _STATE_KEY: dict(self._counts)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state({k: v for k, v in state.items() if k != _STATE_KEY})
        # A position carried over from another number of batch shards has no counts: they restart.
        self._counts = {k: int(state.get(_STATE_KEY, {}).get(k, 0)) for k in COUNTS}


class CountedRecords(grain.IterDataset):
    """Drops `Skipped` records (past `max_bad` of them in this stream: TooManyBadRecords) and counts
    skipped records, cut histories and cut bags in the iterator state."""

    def __init__(self, parent: grain.IterDataset, max_bad: int):
        super().__init__(parent)
        self.max_bad = max_bad

    def __iter__(self) -> _CountedIterator:
        return _CountedIterator(self._parent.__iter__(), self.max_bad)


def counts_in_state(state: Any) -> dict[str, int]:
    """The counters of every stream in a data-iterator state (any nesting: shards, grain workers)."""
    total = dict.fromkeys(COUNTS, 0)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == _STATE_KEY and isinstance(v, dict):
                    for name in COUNTS:
                        total[name] += int(v.get(name, 0))
                else:
                    walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(state)
    return total
