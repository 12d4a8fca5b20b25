"""Ranking records as the task's data (`data.kind = "records"`): the config's shard sets, checked against
the config, as grain datasets of examples for the one packer.

Training reads `data.path` globally shuffled (`data.seed`), a new order every epoch, endlessly (the run's
length is `train.steps`); validation (`data.eval_path`) and test (`data.test_path`) read every record
once, in order. The config picks from each shard set's schema by name: `model.tasks` (a subset of the
schema's tasks), `data.sparse_features` / `data.dense_features`; `data.num_candidates` must be the
schema's. A mismatch is a ConfigError naming the key and the schema file, before anything is read.
"""

from __future__ import annotations

from typing import Any

import grain

from gem_jax.config import Config, ConfigError, DataConfig
from gem_jax.data.records.errors import TooManyBadRecords
from gem_jax.data.records.reader import CountedRecords, ExampleDecoder, ShardSource, counts_in_state
from gem_jax.data.records.schema import SCHEMA_FILE, ShardSet

SPLITS = {"train": "path", "valid": "eval_path", "test": "test_path"}
# Threads that decode a stream's records ahead, and how far. grain's default (16 threads, 500 ahead) scans its
# whole buffer of futures on every element: at gem_h200's 256 examples per pack that cost more than the
# decoding (345 vs 117 ms per pack in one process on the 2-core dev machine; no threads: 273 ms).
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=32)


def open_split(d: DataConfig, split: str) -> ShardSet | None:
    """The shard set of a split (None where its path is ""); a ConfigError if the path matches nothing."""
    key = SPLITS[split]
    path = getattr(d, key)
    if not path:
        return None
    try:
        return ShardSet.open(path)
    except FileNotFoundError as e:
        raise ConfigError(f"`data.{key}`: {e}") from None


def records_fingerprint(d: DataConfig) -> dict[str, Any]:
    """The run record's identity of the data: each split's schema and shards (not their paths)."""
    out = {}
    for split in SPLITS:
        shard_set = open_split(d, split)
        out[split] = None if shard_set is None else shard_set.fingerprint()
    return out


def _pick(wanted: list[str], have: tuple[str, ...], what: str, key: str) -> list[int]:
    missing = [w for w in wanted if w not in have]
    if missing:
        raise ConfigError(
            f"`{key}` names {what} {missing} that the shards do not have (they have {list(have)})"
        )
    return [have.index(w) for w in wanted]


def _features(named, have: tuple[str, ...], kind: str, count: int, where: str) -> list[int]:
    """Indices of the `kind` features the model reads: those `data.{kind}_features` names, else all the
    shards have; as many as `data.num_{kind}_features` says."""
    wanted = list(named) or list(have)
    picked = _pick(wanted, have, f"{kind} features", f"data.{kind}_features")
    if len(wanted) != count:
        raise ConfigError(
            f"`data.num_{kind}_features` is {count}, the model reads {len(wanted)} {kind} features {wanted} "
            f"{where}; set it, or name the features in `data.{kind}_features`"
        )
    return picked


class RecordsData:
    """The config's record splits and how each record becomes an example (`ExampleDecoder`)."""

    def __init__(self, config: Config):
        d = config.data
        self.config = config
        self.splits = {s: open_split(d, s) for s in SPLITS}
        train = self.splits["train"]
        for split, shard_set in self.splits.items():
            if shard_set is not None and shard_set.schema != train.schema:
                raise ConfigError(
                    f"`data.{SPLITS[split]}`: the {split} shards' schema differs from the training shards' "
                    f"({shard_set.schema} vs {train.schema})"
                )
        self.schema = schema = train.schema
        where = f"(the shards' {SCHEMA_FILE} in {d.path})"
        if d.num_candidates != schema.num_candidates:
            raise ConfigError(
                f"`data.num_candidates` is {d.num_candidates}, the shards have {schema.num_candidates} "
                f"candidates per request {where}"
            )
        self.tasks = _pick(list(config.model.tasks), schema.tasks, "tasks", "model.tasks")
        self.sparse = _features(
            d.sparse_features, schema.sparse_names, "sparse", d.num_sparse_features, where
        )
        self.dense = _features(d.dense_features, schema.dense_features, "dense", d.num_dense_features, where)
        self.sources = {s: ShardSource(shard_set) for s, shard_set in self.splits.items() if shard_set}

    def decoder(self, split: str) -> ExampleDecoder:
        d = self.config.data
        return ExampleDecoder(
            self.sources[split],
            self.schema,
            tasks=self.tasks,
            sparse=self.sparse,
            dense=self.dense,
            max_history_len=d.max_history_len,
            max_bag_size=d.max_bag_size,
            skip_bad=d.bad_records == "skip",
        )

    def examples(self, split: str) -> grain.MapDataset | None:
        """A split's examples: train shuffled and endless, the others once in order; None if no such split."""
        if split not in self.sources:
            return None
        ds = grain.MapDataset.source(self.sources[split])
        if split == "train":
            ds = ds.shuffle(seed=self.config.data.seed).repeat()
        return ds.map(self.decoder(split))

    def stream(self, examples: grain.IterDataset) -> grain.IterDataset:
        return CountedRecords(examples, self.config.data.max_bad_records)

    def counts(self, data_state: Any) -> dict[str, int]:
        """This process's counters in its data-iterator state (every stream, every grain worker)."""
        return counts_in_state(data_state)

    def check_cap(self, skipped: float) -> None:
        """TooManyBadRecords when a run's skipped records (all processes) pass `data.max_bad_records` (each
        stream also stops at the cap on its own)."""
        cap = self.config.data.max_bad_records
        if skipped > cap:
            raise TooManyBadRecords(
                f"{skipped:.0f} bad records skipped, more than data.max_bad_records = {cap}"
            )

    def describe(self) -> str:
        lines = []
        for split, shard_set in self.splits.items():
            if shard_set is not None:
                lines.append(
                    f"{split}: {shard_set.num_records:,} records in {len(shard_set.shards)} shards ({shard_set.where})"
                )
        return "records " + "; ".join(lines)
