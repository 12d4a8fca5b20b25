"""A shard set's schema: the small JSON beside the shards, and finding and checking the shards of a path.

A shard set is one directory of ArrayRecord files (`part-00000-of-00008.array_record`, ...) with its
`schema.json`: what every record holds (tasks, candidates per request, the named sparse and dense
features and their id ranges; docs/data.md) and, per shard, its record count, size in bytes, sha256 and
statistics (label sums, history lengths), written by `writer.py` once the shard is complete. Reading
checks every shard against it before the first record: a missing, truncated or rewritten shard is a
`BadShard` naming the file, never a silent short epoch.

`data.path` is a directory (every shard its schema lists) or a glob of shard files (each must be listed
in the schema.json of its directory, and the schemas of all directories must agree).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
from pathlib import Path
from typing import Any

from gem_jax.data.records.errors import BadShard
from gem_jax.paths import in_repository

SCHEMA_FILE = "schema.json"
SHARD_SUFFIX = ".array_record"
FORMAT = "gem-jax records"
VERSION = 1
# The record layout of VERSION (codec.py): ids and timestamps int32, labels and dense features float32.
DTYPES = {"ids": "int32", "timestamps": "int32", "floats": "float32"}
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SparseFeature:
    """A named bag of ids per request; ids lie in [0, vocab) (vocab None: any non-negative int32)."""

    name: str
    vocab: int | None = None


@dataclasses.dataclass(frozen=True)
class RecordSchema:
    """What every record of a shard set holds (docs/data.md)."""

    tasks: tuple[str, ...]  # one label per candidate and task, in this order
    num_candidates: int  # candidates per request (the same for every record of a shard set)
    item_vocab: int | None  # history and candidate item ids lie in [0, item_vocab)
    action_vocab: int | None  # history action types lie in [0, action_vocab)
    sparse_features: tuple[SparseFeature, ...]
    dense_features: tuple[str, ...]

    def __post_init__(self):
        names = [f.name for f in self.sparse_features]
        for kind, values in (
            ("tasks", self.tasks),
            ("sparse features", names),
            ("dense features", self.dense_features),
        ):
            if len(set(values)) != len(values):
                raise ValueError(f"the schema's {kind} repeat a name: {list(values)}")
        if not self.tasks:
            raise ValueError("the schema names no task")
        if self.num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {self.num_candidates}")
        for what, vocab in (("item_vocab", self.item_vocab), ("action_vocab", self.action_vocab)):
            if vocab is not None and not 1 <= vocab <= INT32_MAX + 1:
                raise ValueError(f"{what} must be in [1, 2^31], got {vocab}")

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.sparse_features)

    def to_json(self) -> dict[str, Any]:
        return {
            "tasks": list(self.tasks),
            "num_candidates": self.num_candidates,
            "items": {"vocab": self.item_vocab},
            "actions": {"vocab": self.action_vocab},
            "sparse_features": [{"name": f.name, "vocab": f.vocab} for f in self.sparse_features],
            "dense_features": list(self.dense_features),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RecordSchema:
        return cls(
            tasks=tuple(d["tasks"]),
            num_candidates=int(d["num_candidates"]),
            item_vocab=d["items"]["vocab"],
            action_vocab=d["actions"]["vocab"],
            sparse_features=tuple(SparseFeature(f["name"], f["vocab"]) for f in d["sparse_features"]),
            dense_features=tuple(d["dense_features"]),
        )


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard as its schema.json records it."""

    path: Path
    records: int
    bytes: int
    sha256: str
    stats: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.path.name,
            "records": self.records,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "stats": self.stats,
        }


def write_schema(
    directory: Path, schema: RecordSchema, shards: list[ShardInfo], source: dict[str, Any] | None = None
) -> Path:
    """Writes `directory/schema.json` (atomically: a reader never sees half of it)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "dtypes": DTYPES,
        **schema.to_json(),
        "source": source or {},
        "shards": [s.to_json() for s in sorted(shards, key=lambda s: s.path.name)],
    }
    path = Path(directory) / SCHEMA_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def read_schema(directory: Path) -> tuple[RecordSchema, list[ShardInfo], dict[str, Any]]:
    """(schema, shards, source) of `directory/schema.json`; a BadShard naming it if absent or malformed."""
    path = Path(directory) / SCHEMA_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadShard(
            f"{path}: no schema.json beside the shards (written by `python -m experiments data`)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise BadShard(f"{path}: unreadable schema ({e})") from None
    try:
        if doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')}; this code reads version {VERSION}")
        if doc.get("dtypes") != DTYPES:
            raise ValueError(f"dtypes {doc.get('dtypes')}, this code reads {DTYPES}")
        schema = RecordSchema.from_json(doc)
        shards = [
            ShardInfo(
                Path(directory) / s["file"], int(s["records"]), int(s["bytes"]), s["sha256"], s["stats"]
            )
            for s in doc["shards"]
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise BadShard(f"{path}: not a valid schema ({type(e).__name__}: {e})") from None
    return schema, shards, doc.get("source", {})


@dataclasses.dataclass
class ShardSet:
    """The shards a `data.path` names, with their (one) schema; `open` checks every file first."""

    schema: RecordSchema
    shards: list[ShardInfo]
    where: str  # the path as given, for messages

    @property
    def num_records(self) -> int:
        return sum(s.records for s in self.shards)

    @classmethod
    def open(cls, path: str, *, check_files: bool = True) -> ShardSet:
        """The shard set of a directory or a glob of shard files (relative: the working directory, then the
        repository root). Raises FileNotFoundError when nothing matches, BadShard when a shard is missing,
        unlisted, of another size than its schema says, or when schemas disagree."""
        directories = _matching(path)
        schema = None
        shards: list[ShardInfo] = []
        for directory, files in directories.items():
            this, listed, _ = read_schema(directory)
            if schema is not None and this != schema:
                raise BadShard(
                    f"{directory / SCHEMA_FILE}: its schema differs from {next(iter(directories)) / SCHEMA_FILE}'s "
                    f"(one shard set has one schema): {this} vs {schema}"
                )
            schema = this
            by_name = {s.path.name: s for s in listed}
            for f in files if files is not None else sorted(by_name):
                if f not in by_name:
                    raise BadShard(
                        f"{directory / f}: not listed in {directory / SCHEMA_FILE} (written by another run?)"
                    )
                shards.append(by_name[f])
        if not shards:
            raise FileNotFoundError(f"no shards in {path}")
        shard_set = cls(schema, shards, path)
        if check_files:
            shard_set.check_files()
        return shard_set

    def check_files(self) -> None:
        """Every shard exists with the size its schema recorded (a cut copy or a rewrite is caught here)."""
        for s in self.shards:
            try:
                size = s.path.stat().st_size
            except FileNotFoundError:
                raise BadShard(f"{s.path}: listed in {SCHEMA_FILE} but missing") from None
            if size != s.bytes:
                raise BadShard(
                    f"{s.path}: {size} bytes, its {SCHEMA_FILE} says {s.bytes} (truncated or rewritten)"
                )

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data (for the run record): the schema and every shard's name, size and
        sha256 as written; not where the files are (a moved shard set is the same data)."""
        return {
            "schema": self.schema.to_json(),
            "shards": [[s.path.name, s.records, s.bytes, s.sha256] for s in self.shards],
        }

    def stats(self) -> dict[str, Any]:
        """The shards' statistics added up (see `RecordStats`)."""
        return merge_stats([s.stats for s in self.shards])


def _matching(path: str) -> dict[Path, list[str] | None]:
    """Directory -> shard file names matched in it (None: every shard its schema lists)."""
    if any(ch in path for ch in "*?["):
        pattern = path if Path(path).is_absolute() or glob.glob(path) else str(in_repository(path))
        files = sorted(Path(f) for f in glob.glob(pattern) if f.endswith(SHARD_SUFFIX))
        if not files:
            raise FileNotFoundError(f"no shard files ({SHARD_SUFFIX}) match {path}")
        out: dict[Path, list[str] | None] = {}
        for f in files:
            out.setdefault(f.parent, []).append(f.name)
        return out
    directory = in_repository(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no shard directory {path}"
            + ("" if Path(path).is_absolute() else f" (also tried {directory})")
            + ": write the shards first with `python -m experiments data convert SRC --out DIR` (DIR/train, "
            "DIR/valid, ...; docs/data.md), from your Parquet logs or the MovieLens files (README, "
            '"Public data")'
        )
    return {directory: None}


# ----------------------------------------------------------------------------- statistics


def history_bucket(length: int) -> int:
    """Histogram bucket of a history length: 0 for none, b >= 1 for [2^(b-1), 2^b)."""
    return 0 if length <= 0 else int(length).bit_length()


def bucket_label(b: int) -> str:
    return str(b) if b <= 1 else f"{2 ** (b - 1)}-{2**b - 1}"


class RecordStats:
    """Counts a writer keeps per shard: records, label sums per task, history lengths (log2 histogram)."""

    def __init__(self, num_tasks: int):
        self.records = 0
        self.label_sums = [0.0] * num_tasks
        self.labels = 0  # labels per task (records x candidates)
        self.history_events = 0
        self.history_max = 0
        self.history_hist: dict[int, int] = {}

    def add(self, num_candidates: int, label_sums: list[float], history_len: int) -> None:
        self.records += 1
        self.labels += num_candidates
        for k, v in enumerate(label_sums):
            self.label_sums[k] += v
        self.history_events += history_len
        self.history_max = max(self.history_max, history_len)
        b = history_bucket(history_len)
        self.history_hist[b] = self.history_hist.get(b, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "labels": self.labels,
            "label_sums": self.label_sums,
            "history_events": self.history_events,
            "history_max": self.history_max,
            "history_hist": {str(b): n for b, n in sorted(self.history_hist.items())},
        }


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Shards' `RecordStats.to_json()` added up."""
    if not stats:
        return {}
    hist: dict[str, int] = {}
    for s in stats:
        for b, n in s["history_hist"].items():
            hist[b] = hist.get(b, 0) + n
    return {
        "records": sum(s["records"] for s in stats),
        "labels": sum(s["labels"] for s in stats),
        "label_sums": [math.fsum(v) for v in zip(*(s["label_sums"] for s in stats))],
        "history_events": sum(s["history_events"] for s in stats),
        "history_max": max(s["history_max"] for s in stats),
        "history_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
    }
