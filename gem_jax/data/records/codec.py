"""One request as bytes: a compact little-endian layout that decodes with one `np.frombuffer` and slices.

A record is int32 words (floats are float32 bit patterns in the same buffer, read through `.view`):

    MAGIC  DTYPES  L_items  L_actions  L_times  C  K  D  F  request_time
    request_id (2 words)  user_id (2 words)  bag_length x F
    history items [L] | candidate items [C]   (contiguous: the example's item ids, oldest first)
    history actions [L]   history timestamps [L]
    labels [C x K] (float32)   dense [D] (float32)   sparse ids [sum of bag lengths]

Every list carries its own length and every record the counts and dtypes it was written with, so a
record that breaks its shard set's schema (another dtype, a cut record, history lists of unequal length,
an id out of range, a NaN) is recognised when read and named, not misread. `check` is the one set of
rules: the writers apply it before writing, the reader (reader.py) and `data validate` after reading.
Decoding and checking a record is a dozen numpy reductions over views, no copies (tens of microseconds).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from gem_jax.data.records.schema import INT32_MAX, RecordSchema

MAGIC = int.from_bytes(b"GEMR", "little")
DTYPES = int.from_bytes(b"i\x04f\x04", "little")  # ids int32, floats float32
_FIXED = 14  # header words before the bag lengths


class Invalid(ValueError):
    """A record breaks the schema; the message says how (the caller names the shard and index)."""


@dataclasses.dataclass
class Record:
    """One request (docs/data.md): the log schema as numpy arrays."""

    request_id: int
    user_id: int
    timestamp: int  # request time, seconds (candidates carry it)
    candidates: np.ndarray  # int [C] item ids
    labels: np.ndarray  # float [C, K]: one label per candidate and task
    sparse: list[np.ndarray]  # F bags of ids, in the schema's order
    dense: np.ndarray  # float [D]
    history_items: np.ndarray  # int [L], oldest first
    history_actions: np.ndarray  # int [L]
    history_timestamps: np.ndarray  # int [L], non-decreasing, <= timestamp


# ----------------------------------------------------------------------------- encoding


def _ids(name: str, values: Any) -> np.ndarray:
    """Integer ids as given (int64 or narrower); their int32 range is checked once per record in `encode`."""
    a = np.asarray(values)
    if a.size == 0:
        return np.zeros(0, np.int32)
    if a.dtype.kind not in "iu":
        raise Invalid(f"{name} are {a.dtype}, expected integers")
    if a.ndim != 1:
        raise Invalid(f"{name} have shape {a.shape}, expected a list")
    return a


def _floats(name: str, values: Any) -> np.ndarray:
    a = np.asarray(values)
    if a.size and a.dtype.kind not in "fiub":
        raise Invalid(f"{name} are {a.dtype}, expected numbers")
    return a.astype(np.float32, copy=False)


def _int64_words(value: int, name: str) -> np.ndarray:
    if not -(2**63) <= int(value) < 2**63:
        raise Invalid(f"{name} {value} does not fit int64")
    return np.array([int(value)], np.int64).view(np.int32)


_INT_FIELDS = (
    "history item ids",
    "candidate item ids",
    "history action ids",
    "history timestamps",
    "sparse ids",
)


def encode(record: Record) -> bytes:
    """The record's bytes. Raises Invalid for values of the wrong type (e.g. float ids) or outside int32;
    the schema's rules are `check`'s."""
    items = _ids("history item ids", record.history_items)
    candidates = _ids("candidate item ids", record.candidates)
    actions = _ids("history action ids", record.history_actions)
    times = _ids("history timestamps", record.history_timestamps)
    bags = [_ids(f"sparse feature {j} ids", b) for j, b in enumerate(record.sparse)]
    labels = _floats("labels", record.labels)
    if labels.ndim != 2 or labels.shape[0] != len(candidates):
        raise Invalid(f"labels have shape {labels.shape}, expected [{len(candidates)} candidates, tasks]")
    dense = _floats("dense features", record.dense)
    if dense.ndim != 1:
        raise Invalid(f"dense features have shape {dense.shape}, expected a list")
    timestamp = int(record.timestamp)
    if not -(2**31) <= timestamp <= INT32_MAX:
        raise Invalid(f"request timestamp {timestamp} outside int32 (seconds)")
    ints = np.concatenate([items, candidates, actions, times, *bags])
    if ints.size and (ints.min() < -(2**31) or ints.max() > INT32_MAX):
        sizes = np.cumsum([len(items), len(candidates), len(actions), len(times), ints.size])
        first = int(np.flatnonzero((ints < -(2**31)) | (ints > INT32_MAX))[0])
        field = _INT_FIELDS[int(np.searchsorted(sizes, first, side="right"))]
        raise Invalid(f"{field} hold {ints[first]}, outside int32")
    header = np.array(
        [
            *(
                MAGIC,
                DTYPES,
                len(items),
                len(actions),
                len(times),
                len(candidates),
                labels.shape[1],
                len(dense),
            ),
            *(len(bags), timestamp),
        ],
        np.int32,
    )
    n_hist = len(items) + len(candidates)
    parts = [
        header,
        _int64_words(record.request_id, "request id"),
        _int64_words(record.user_id, "user id"),
        np.array([len(b) for b in bags], np.int32),
        ints[:n_hist].astype(np.int32),
        ints[n_hist : n_hist + len(actions) + len(times)].astype(np.int32),
        labels.reshape(-1).view(np.int32),
        dense.view(np.int32),
        ints[n_hist + len(actions) + len(times) :].astype(np.int32),
    ]
    return np.concatenate(parts).astype("<i4", copy=False).tobytes()


# ----------------------------------------------------------------------------- decoding


@dataclasses.dataclass
class Parsed:
    """Views into one record's words (no copies)."""

    words: np.ndarray
    timestamp: int
    items: np.ndarray  # [L + C]: history, then candidates
    num_history: int
    actions: np.ndarray  # [L]
    times: np.ndarray  # [L]
    labels: np.ndarray  # [C, K] float32
    dense: np.ndarray  # [D] float32
    bag_lengths: list[int]  # [F]
    sparse_values: np.ndarray  # [sum of bag lengths]

    @property
    def request_id(self) -> int:
        return int(self.words[10:12].view(np.int64)[0])

    @property
    def user_id(self) -> int:
        return int(self.words[12:14].view(np.int64)[0])

    def bags(self) -> list[np.ndarray]:
        """The F sparse bags, as views."""
        out, start = [], 0
        for n in self.bag_lengths:
            out.append(self.sparse_values[start : start + n])
            start += n
        return out


def parse(data: bytes, schema: RecordSchema) -> Parsed:
    """The record's fields as views, after checking its layout against the schema (Invalid if not)."""
    if len(data) % 4 or len(data) < 4 * _FIXED:
        raise Invalid(f"{len(data)} bytes: not a record (cut or of another format)")
    w = np.frombuffer(data, "<i4")
    magic, dtypes, n_items, n_actions, n_times, c, k, d, f, timestamp = w[:10].tolist()
    if magic != MAGIC:
        raise Invalid("not a gem-jax record (bad magic): another format, or a corrupt record")
    if dtypes != DTYPES:
        kinds = int(dtypes).to_bytes(4, "little", signed=True)
        raise Invalid(
            f"wrong type: written with ids {chr(kinds[0])}{kinds[1]} and floats {chr(kinds[2])}{kinds[3]}, "
            "the schema has ids i4 and floats f4"
        )
    if not n_items == n_actions == n_times:
        raise Invalid(
            f"history lists of unequal length: {n_items} items, {n_actions} actions, {n_times} timestamps"
        )
    expect = (
        schema.num_candidates,
        len(schema.tasks),
        len(schema.dense_features),
        len(schema.sparse_features),
    )
    if (c, k, d, f) != expect:
        raise Invalid(
            f"{c} candidates, {k} labels each, {d} dense and {f} sparse features; the schema has "
            f"{expect[0]}, {expect[1]}, {expect[2]} and {expect[3]}"
        )
    if n_items < 0:
        raise Invalid(f"negative history length {n_items}")
    bags = w[_FIXED : _FIXED + f].tolist()
    if f and min(bags) < 0:
        raise Invalid(f"negative bag length {min(bags)}")
    p = _FIXED + f
    body = 3 * n_items + c + c * k + d + sum(bags)
    if len(w) != p + body:
        raise Invalid(
            f"{len(data)} bytes where its lengths need {4 * (p + body)} (a cut or malformed record)"
        )
    items = w[p : p + n_items + c]
    p += n_items + c
    actions = w[p : p + n_items]
    times = w[p + n_items : p + 2 * n_items]
    p += 2 * n_items
    labels = w[p : p + c * k].view(np.float32).reshape(c, k)
    dense = w[p + c * k : p + c * k + d].view(np.float32)
    return Parsed(w, timestamp, items, n_items, actions, times, labels, dense, bags, w[p + c * k + d :])


def _out_of_range(name: str, values: np.ndarray, vocab: int | None) -> str | None:
    if not values.size:
        return None
    lo, hi = values.min(), values.max()
    if lo < 0:
        return f"negative {name} {lo}"
    if vocab is not None and hi >= vocab:
        return f"{name} {hi} out of range [0, {vocab})"
    return None


@functools.cache
def _sparse_limits(schema: RecordSchema) -> np.ndarray | None:
    """Per sparse feature, one past its largest id (None where no feature has a vocab)."""
    vocabs = [f.vocab for f in schema.sparse_features]
    if all(v is None for v in vocabs):
        return None
    return np.array([INT32_MAX + 1 if v is None else v for v in vocabs], np.int64)


def check(p: Parsed, schema: RecordSchema) -> None:
    """The schema's rules on a parsed record (Invalid naming the first one broken): ids in their ranges,
    history time-ordered and not after the request, labels in [0, 1], dense features finite."""
    problem = _out_of_range("item id", p.items, schema.item_vocab) or _out_of_range(
        "action id", p.actions, schema.action_vocab
    )
    if problem:
        raise Invalid(problem)
    values = p.sparse_values
    if values.size:
        limits = _sparse_limits(schema)
        if values.min() < 0 or (limits is not None and (values >= np.repeat(limits, p.bag_lengths)).any()):
            start = 0
            for j, n in enumerate(p.bag_lengths):
                feature = schema.sparse_features[j]
                problem = _out_of_range(f"{feature.name} id", values[start : start + n], feature.vocab)
                if problem:
                    raise Invalid(problem)
                start += n
    if p.num_history:
        if p.times[0] < 0:
            raise Invalid(f"negative history timestamp {p.times[0]}")
        if p.num_history > 1 and (p.times[1:] < p.times[:-1]).any():
            raise Invalid("history timestamps are not in time order (oldest first)")
        if p.times[-1] > p.timestamp:
            raise Invalid(
                f"history event at {p.times[-1]} after the request at {p.timestamp} (a future event)"
            )
    if not np.isfinite(p.dense).all():
        j = int(np.flatnonzero(~np.isfinite(p.dense))[0])
        raise Invalid(f"dense feature {schema.dense_features[j]} is {p.dense[j]}")
    if not ((p.labels >= 0) & (p.labels <= 1)).all():  # NaN fails too
        raise Invalid(f"labels outside [0, 1]: {p.labels[~((p.labels >= 0) & (p.labels <= 1))][:3].tolist()}")


def decode(data: bytes, schema: RecordSchema) -> Record:
    """The checked record (Invalid if it breaks the schema); arrays are copies."""
    p = parse(data, schema)
    check(p, schema)
    return Record(
        request_id=p.request_id,
        user_id=p.user_id,
        timestamp=p.timestamp,
        candidates=p.items[p.num_history :].copy(),
        labels=p.labels.copy(),
        sparse=[b.copy() for b in p.bags()],
        dense=p.dense.copy(),
        history_items=p.items[: p.num_history].copy(),
        history_actions=p.actions.copy(),
        history_timestamps=p.times.copy(),
    )


def check_record(record: Record, schema: RecordSchema) -> bytes:
    """The record's bytes if it keeps the schema's rules (the writers' check); Invalid otherwise."""
    data = encode(record)
    check(parse(data, schema), schema)
    return data
