"""Parquet in (and out): one row per request, the log schema as columns (docs/data.md).

Columns, found by name (Spark and Hive exports write such tables):

    request_id          int64 or string (strings are hashed to int64); optional (default: row number)
    user_id             int64 or string (hashed); optional (default 0)
    timestamp           request time: int64 seconds, or a Parquet timestamp
    candidates          list<int>: the candidate item ids
    label_<task>        list<number> (one per candidate) or a number (one candidate): one column per task
    sparse_<name>       list<int> (a bag of ids) or int (a bag of one): one column per sparse feature
    dense_<name>        number: one column per dense feature
    history_items       list<int>, oldest first      \
    history_actions     list<int>                     | parallel lists of equal length; optional
    history_timestamps  list<int> seconds, or timestamps /

A column of the wrong type stops the conversion naming the file and column; a row that breaks the schema
(lists of unequal length, a negative id, a NaN) names the file and row (or, skipping bad rows, is counted).
Needs pyarrow (`pip install -e '.[data]'`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gem_jax.data.records.codec import Invalid, Record
from gem_jax.data.records.errors import BadRecord
from gem_jax.data.records.schema import RecordSchema, SparseFeature

HISTORY = ("history_items", "history_actions", "history_timestamps")


def _pyarrow():
    try:
        import pyarrow as pa  # optional dependency: the data extra (Parquet)
        import pyarrow.parquet as pq  # optional dependency: the data extra (Parquet)
    except ImportError:
        raise ImportError("Parquet needs pyarrow: pip install -e '.[data]'") from None
    return pa, pq


def parquet_files(paths: list[str]) -> list[Path]:
    """Files (a directory: its *.parquet files, sorted) in order."""
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.parquet")) if p.is_dir() else [p]
    if not out:
        raise FileNotFoundError(f"no Parquet files in {paths}")
    return out


def infer_schema(files: list[Path], tasks: list[str] | None = None) -> RecordSchema:
    """The record schema of Parquet files, from the first file's columns and first row (candidates)."""
    pa, pq = _pyarrow()
    f = pq.ParquetFile(files[0])
    names = f.schema_arrow.names
    labels = [n[len("label_") :] for n in names if n.startswith("label_")]
    if tasks:
        missing = [t for t in tasks if t not in labels]
        if missing:
            raise BadRecord(f"{files[0]}: no label column for tasks {missing} (label columns: {labels})")
        labels = tasks
    if "candidates" not in names or not labels:
        raise BadRecord(f"{files[0]}: needs a `candidates` column and `label_<task>` columns; it has {names}")
    first = f.read_row_group(0, columns=["candidates"]).column(0)
    if not len(first):
        raise BadRecord(f"{files[0]}: its first row group is empty")
    num_candidates = len(first[0].as_py() or [])
    return RecordSchema(
        tasks=tuple(labels),
        num_candidates=num_candidates,
        item_vocab=None,
        action_vocab=None,
        sparse_features=tuple(SparseFeature(n[len("sparse_") :]) for n in names if n.startswith("sparse_")),
        dense_features=tuple(n[len("dense_") :] for n in names if n.startswith("dense_")),
    )


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


class _Columns:
    """One row group's columns as numpy, read per row without Python objects per value."""

    def __init__(self, table: Any, where: str):
        self.pa = _pyarrow()[0]
        self.table = table
        self.where = where
        self.rows = table.num_rows

    def _column(self, name: str):
        return self.table.column(name).combine_chunks()

    def ids(self, name: str, *, integer: bool = True):
        """(values, offsets) of a list column, or of a scalar column as bags of one; None if absent."""
        pa = self.pa
        if name not in self.table.column_names:
            return None
        col = self._column(name)
        t = col.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            value_type = t.value_type
            values, offsets = col.values, col.offsets.to_numpy()
            if col.null_count:
                raise BadRecord(
                    f"{self.where}: column {name} has null rows (row {col.is_null().index(True).as_py()})"
                )
        else:
            value_type, values, offsets = t, col, np.arange(self.rows + 1)
        if pa.types.is_timestamp(value_type):
            values = values.cast(pa.timestamp("s")).cast(pa.int64())
        elif integer and not pa.types.is_integer(value_type):
            raise BadRecord(f"{self.where}: column {name} holds {value_type}, expected integer ids")
        elif not integer and not (
            pa.types.is_integer(value_type)
            or pa.types.is_floating(value_type)
            or pa.types.is_boolean(value_type)
        ):
            raise BadRecord(f"{self.where}: column {name} holds {value_type}, expected numbers")
        if values.null_count:
            raise BadRecord(f"{self.where}: column {name} holds null values")
        return values.to_numpy(zero_copy_only=False), offsets

    def scalars(self, name: str, default: Any) -> np.ndarray:
        pa = self.pa
        if name not in self.table.column_names:
            return np.full(self.rows, default)
        col = self._column(name)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            return np.array(
                [_hash64(x) if x is not None else default for x in col.to_pylist()], dtype=np.int64
            )
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.timestamp("s")).cast(pa.int64())
        elif not pa.types.is_integer(col.type):
            raise BadRecord(f"{self.where}: column {name} holds {col.type}, expected integers")
        if col.null_count:
            raise BadRecord(f"{self.where}: column {name} has null rows")
        return col.to_numpy()

    def numbers(self, name: str) -> np.ndarray:
        pa = self.pa
        col = self._column(name)
        if not (
            pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)
        ):
            raise BadRecord(f"{self.where}: column {name} holds {col.type}, expected numbers")
        return col.to_numpy(zero_copy_only=False).astype(np.float32)  # nulls become NaN: the row is refused


def _row(values_offsets, i: int) -> np.ndarray:
    values, offsets = values_offsets
    return values[offsets[i] : offsets[i + 1]]


def parquet_records(schema: RecordSchema, pieces: list[tuple[str, int, int]]) -> Iterator[tuple[str, Record]]:
    """`writer.write_shards` records function: the rows of (file, row group, first row number) pieces."""
    _, pq = _pyarrow()
    for file, group, first_row in pieces:
        table = pq.ParquetFile(file).read_row_group(group)
        cols = _Columns(table, file)
        for column in ("candidates", *(f"label_{t}" for t in schema.tasks)):
            if column not in table.column_names:
                raise BadRecord(f"{file}: no column {column}")
        candidates = cols.ids("candidates")
        labels = [cols.ids(f"label_{t}", integer=False) for t in schema.tasks]
        sparse = [cols.ids(f"sparse_{f.name}") for f in schema.sparse_features]
        missing = [f.name for f, s in zip(schema.sparse_features, sparse) if s is None]
        if missing:
            raise BadRecord(f"{file}: no column sparse_{missing[0]}")
        dense = (
            np.stack([cols.numbers(f"dense_{n}") for n in schema.dense_features], 1)
            if schema.dense_features
            else np.zeros((cols.rows, 0), np.float32)
        )
        history = [cols.ids(n) for n in HISTORY]
        if any(h is None for h in history) and not all(h is None for h in history):
            absent = [n for n, h in zip(HISTORY, history) if h is None]
            raise BadRecord(f"{file}: history columns {absent} missing (the three come together)")
        request_ids = cols.scalars("request_id", -1)
        user_ids = cols.scalars("user_id", 0)
        timestamps = cols.scalars("timestamp", 0)
        empty = np.zeros(0, np.int64)
        for i in range(cols.rows):
            row = first_row + i
            cands = _row(candidates, i)
            label_rows = [_row(lab, i) for lab in labels]
            lengths = {len(lab) for lab in label_rows}
            if lengths != {len(cands)}:
                lens = dict(zip(schema.tasks, map(len, label_rows)))
                yield f"{file} row {row}", Invalid(f"{len(cands)} candidates but labels of lengths {lens}")
                continue
            yield (
                f"{file} row {row}",
                Record(
                    request_id=int(request_ids[i]) if request_ids[i] != -1 else row,
                    user_id=int(user_ids[i]),
                    timestamp=int(timestamps[i]),
                    candidates=cands,
                    labels=np.stack(label_rows, 1).astype(np.float32)
                    if label_rows
                    else np.zeros((len(cands), 0)),
                    sparse=[_row(s, i) for s in sparse],
                    dense=dense[i],
                    history_items=_row(history[0], i) if history[0] is not None else empty,
                    history_actions=_row(history[1], i) if history[1] is not None else empty,
                    history_timestamps=_row(history[2], i) if history[2] is not None else empty,
                ),
            )


def row_groups(files: list[Path]) -> list[tuple[str, int, int, int]]:
    """Every (file, row group, first row number in the file, rows) of the files."""
    _, pq = _pyarrow()
    out = []
    for f in files:
        meta = pq.ParquetFile(f).metadata
        row = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            out.append((str(f), g, row, n))
            row += n
    return out


def write_parquet(
    records: list[Record], schema: RecordSchema, path: str | Path, row_group_size: int = 1 << 16
) -> None:
    """Records as a Parquet file in the layout above (for tests, samples and exports)."""
    pa, pq = _pyarrow()
    columns: dict[str, Any] = {
        "request_id": pa.array([r.request_id for r in records], pa.int64()),
        "user_id": pa.array([r.user_id for r in records], pa.int64()),
        "timestamp": pa.array([r.timestamp for r in records], pa.int64()),
        "candidates": pa.array([np.asarray(r.candidates).tolist() for r in records], pa.list_(pa.int64())),
    }
    for k, task in enumerate(schema.tasks):
        columns[f"label_{task}"] = pa.array(
            [np.asarray(r.labels)[:, k].tolist() for r in records], pa.list_(pa.float32())
        )
    for j, f in enumerate(schema.sparse_features):
        columns[f"sparse_{f.name}"] = pa.array(
            [np.asarray(r.sparse[j]).tolist() for r in records], pa.list_(pa.int64())
        )
    for j, name in enumerate(schema.dense_features):
        columns[f"dense_{name}"] = pa.array([float(r.dense[j]) for r in records], pa.float32())
    for name, field in zip(HISTORY, ("history_items", "history_actions", "history_timestamps")):
        columns[name] = pa.array(
            [np.asarray(getattr(r, field)).tolist() for r in records], pa.list_(pa.int64())
        )
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
