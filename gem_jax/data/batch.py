"""The jagged batch: flat token arrays plus int32 offsets, never padded per example.

One *pack* holds the examples of one data-parallel shard: token arrays of a fixed token capacity
`T` and per-example arrays of a fixed example capacity `B`, so shapes stay static under `jit`.
Example b owns tokens `offsets[b]:offsets[b+1]`; the unused tail (tokens past `offsets[B]`,
examples with no tokens) is padding. A global batch stacks one pack per shard on a leading axis.

Sequence layout of one example: `prefix` context slots (filled by the model with non-sequence
summaries), then the history events oldest first, then `num_targets` candidate tokens.
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np
from flax import struct
from jaxtyping import ArrayLike, Bool, Float, Int


@typing.no_type_check  # pytrees are rebuilt with non-array leaves (see gem_jax/typing.py)
@struct.dataclass
class JaggedBatch:
    """One pack (or, with a leading shard axis on every field, a stack of packs)."""

    item_ids: Int[ArrayLike, "... T"]  # raw item ids; 0 on context slots and padding
    action_ids: Int[ArrayLike, "... T"]  # action type of history events; 0 elsewhere
    timestamps: Int[ArrayLike, "... T"]  # seconds; candidates carry the request time
    offsets: Int[ArrayLike, "... B1"]  # int32[B+1], offsets[0] = 0
    num_targets: Int[ArrayLike, "... B"]  # candidate tokens at the end of each sequence; 0 = padding
    sparse_values: Int[ArrayLike, "... S"]  # all non-sequence bags, flattened
    sparse_offsets: Int[ArrayLike, "... BF1"]  # bag (b, f) is values[o[b*F+f]:o[b*F+f+1]]
    dense: Float[ArrayLike, "... B Fd"]
    labels: Float[ArrayLike, "... B C K"]  # per candidate, per task

    @property
    def example_mask(self) -> Bool[ArrayLike, "... B"]:
        return self.num_targets > 0

    @property
    def num_examples_capacity(self) -> int:
        return self.num_targets.shape[-1]

    @property
    def token_capacity(self) -> int:
        return self.item_ids.shape[-1]


EXAMPLE_FIELDS = ("item_ids", "action_ids", "timestamps", "sparse_ids", "dense", "labels")


def pack_examples(
    examples: list[dict[str, Any]],
    *,
    examples_capacity: int,
    tokens_capacity: int,
    num_sparse_features: int,
    max_bag_size: int,
    prefix: int,
) -> JaggedBatch:
    """Packs examples (numpy dicts, see `synthetic.py`) into one pack of numpy arrays.

    Each example dict has: `item_ids`, `action_ids`, `timestamps` (history + candidates, without
    the prefix slots), `num_targets` (int), `sparse_ids` (list of F id arrays), `dense`, `labels`
    [C, K]. The caller guarantees the examples fit (see `packing.fits`).
    """
    n = len(examples)
    if n > examples_capacity:
        raise ValueError(f"{n} examples exceed the example capacity {examples_capacity}")
    lengths = np.array([prefix + len(e["item_ids"]) for e in examples], np.int64)
    total = int(lengths.sum())
    if total > tokens_capacity:
        raise ValueError(f"{total} tokens exceed the token capacity {tokens_capacity}")
    f = num_sparse_features
    offsets = np.full(examples_capacity + 1, total, np.int32)
    offsets[0] = 0
    offsets[1 : n + 1] = np.cumsum(lengths)
    item_ids = np.zeros(tokens_capacity, np.int32)
    action_ids = np.zeros(tokens_capacity, np.int32)
    timestamps = np.zeros(tokens_capacity, np.int32)
    num_targets = np.zeros(examples_capacity, np.int32)
    sparse_values = np.zeros(examples_capacity * f * max_bag_size, np.int32)
    bag_lengths = np.zeros(examples_capacity * f, np.int64)
    first = examples[0] if examples else None
    dense = np.zeros((examples_capacity, first["dense"].shape[0] if first else 0), np.float32)
    labels_shape = first["labels"].shape if first else (0, 0)
    labels = np.zeros((examples_capacity, *labels_shape), np.float32)
    cursor = 0
    for b, e in enumerate(examples):
        start = offsets[b] + prefix
        end = offsets[b + 1]
        item_ids[start:end] = e["item_ids"]
        action_ids[start:end] = e["action_ids"]
        timestamps[start:end] = e["timestamps"]
        # Context slots take the time of the first event so time deltas stay small.
        timestamps[offsets[b] : start] = e["timestamps"][0]
        num_targets[b] = e["num_targets"]
        for j, bag in enumerate(e["sparse_ids"]):
            bag = bag[:max_bag_size]
            sparse_values[cursor : cursor + len(bag)] = bag
            bag_lengths[b * f + j] = len(bag)
            cursor += len(bag)
        dense[b] = e["dense"]
        labels[b] = e["labels"]
    sparse_offsets = np.zeros(examples_capacity * f + 1, np.int32)
    sparse_offsets[1:] = np.cumsum(bag_lengths)
    return JaggedBatch(
        item_ids=item_ids,
        action_ids=action_ids,
        timestamps=timestamps,
        offsets=offsets,
        num_targets=num_targets,
        sparse_values=sparse_values,
        sparse_offsets=sparse_offsets,
        dense=dense,
        labels=labels,
    )


def unpack_examples(pack: JaggedBatch, *, prefix: int, num_sparse_features: int) -> list[dict[str, Any]]:
    """The real examples of one (numpy) pack, in order, as `pack_examples` takes them: packing them again
    (same prefix, bags already cut) gives the same pack."""
    o, so, f = np.asarray(pack.offsets), np.asarray(pack.sparse_offsets), num_sparse_features
    examples = []
    for b in np.flatnonzero(np.asarray(pack.num_targets) > 0):
        start, end = o[b] + prefix, o[b + 1]
        examples.append(
            {
                "item_ids": pack.item_ids[start:end],
                "action_ids": pack.action_ids[start:end],
                "timestamps": pack.timestamps[start:end],
                "num_targets": int(pack.num_targets[b]),
                "sparse_ids": [pack.sparse_values[so[b * f + j] : so[b * f + j + 1]] for j in range(f)],
                "dense": pack.dense[b],
                "labels": pack.labels[b],
            }
        )
    return examples


def check_pack(batch: JaggedBatch) -> None:
    """Raises AssertionError if a (numpy) pack breaks the jagged-batch invariants."""
    o = np.asarray(batch.offsets)
    b_cap = batch.num_targets.shape[-1]
    assert o.shape == (b_cap + 1,), f"offsets shape {o.shape}, expected {(b_cap + 1,)}"
    assert o.dtype == np.int32, o.dtype
    assert o[0] == 0, f"offsets[0] = {o[0]}"
    assert np.all(np.diff(o) >= 0), "offsets must be non-decreasing"
    assert o[-1] <= batch.item_ids.shape[-1], "offsets[B] exceeds the token capacity"
    lengths = np.diff(o)
    nt = np.asarray(batch.num_targets)
    assert np.all(nt <= lengths), "an example has more targets than tokens"
    assert np.all((lengths == 0) == (nt == 0)), "a padding example owns tokens (or vice versa)"
    tail = slice(int(o[-1]), None)
    for name in ("item_ids", "action_ids"):
        assert not np.asarray(getattr(batch, name))[tail].any(), f"{name} nonzero past offsets[B]"
    so = np.asarray(batch.sparse_offsets)
    assert so[0] == 0 and np.all(np.diff(so) >= 0)
    assert so[-1] <= batch.sparse_values.shape[-1]
