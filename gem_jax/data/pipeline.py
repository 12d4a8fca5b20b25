"""The grain input pipeline: examples -> token-budget packs -> one stack of packs per step.

Deterministic from the seed, sharded by process index, and checkpointable: the iterator's state
(a small dict) is saved by orbax beside the model (`grain.checkpoint.CheckpointSave`).

grain's own packers (`FirstFitPackIterDataset`, ...) pack into fixed-length *rows* with segment
ids, the LM layout; our batch is one flat jagged buffer with offsets, so the greedy packer below is
ours. It is sequential first-fit (order preserving), which keeps resumption exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import jax

from gem_jax.data.batch import JaggedBatch, fits, pack_examples


class _PackIterator(grain.DatasetIterator):
    """Greedily fills packs in order; an example that does not fit opens the next pack."""

    def __init__(
        self,
        parent: grain.DatasetIterator,
        pack: Callable[[list[dict[str, Any]]], JaggedBatch],
        examples_capacity: int,
        tokens_capacity: int,
        prefix: int,
    ):
        super().__init__(parent)
        self._pack = pack
        self._examples_capacity = examples_capacity
        self._tokens_capacity = tokens_capacity
        self._prefix = prefix
        self._pending: dict[str, Any] | None = None
        # Parent state from before `_pending` was read: restoring it re-reads that example, so the
        # checkpointed state stays a small dict instead of holding arrays.
        self._state_before_pending: dict[str, Any] | None = None

    def __next__(self) -> JaggedBatch:
        examples: list[dict[str, Any]] = []
        tokens = 0
        while True:
            if self._pending is None:
                state = self._parent.get_state()
                try:
                    self._pending = next(self._parent)
                except StopIteration:
                    break
                self._state_before_pending = state
            example = self._pending
            if not fits(
                len(examples),
                tokens,
                example,
                prefix=self._prefix,
                examples_capacity=self._examples_capacity,
                tokens_capacity=self._tokens_capacity,
            ):
                if not examples:
                    raise ValueError(
                        f"an example of {len(example['item_ids']) + self._prefix} tokens does not fit an "
                        f"empty pack of {self._tokens_capacity} tokens"
                    )
                break
            examples.append(example)
            tokens += self._prefix + len(example["item_ids"])
            self._pending = None
        if not examples:
            raise StopIteration
        return self._pack(examples)

    def get_state(self) -> dict[str, Any]:
        if self._pending is not None:
            return {"parent": self._state_before_pending}
        return {"parent": self._parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._pending = None
        self._state_before_pending = None


class PackIterDataset(grain.IterDataset):
    """Packs a stream of example dicts into `JaggedBatch` packs of fixed capacity."""

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        examples_capacity: int,
        tokens_capacity: int,
        num_sparse_features: int,
        max_bag_size: int,
        prefix: int,
    ):
        super().__init__(parent)
        self._kwargs = dict(
            examples_capacity=examples_capacity, tokens_capacity=tokens_capacity, prefix=prefix
        )

        def pack(examples):
            return pack_examples(
                examples, num_sparse_features=num_sparse_features, max_bag_size=max_bag_size, **self._kwargs
            )

        self._pack_fn = pack

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self._pack_fn, **self._kwargs)


def packed_dataset(
    example_fn: Callable[[int], dict[str, Any]],
    *,
    num_examples: int | None,
    start: int,
    examples_capacity: int,
    tokens_capacity: int,
    num_sparse_features: int,
    max_bag_size: int,
    prefix: int,
    shards_per_step: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.IterDataset:
    """Examples `start, start+1, ...` (this process's share) -> stacks of `shards_per_step` packs.

    `num_examples=None` streams forever (the synthetic train set); otherwise the dataset ends and
    the last stack may hold empty packs (eval), so every example is seen exactly once.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    stop = start + num_examples if num_examples is not None else 2**62
    indices = grain.MapDataset.range(start, stop)[process_index::process_count]
    examples = indices.map(example_fn).to_iter_dataset()
    packs = PackIterDataset(
        examples,
        examples_capacity=examples_capacity,
        tokens_capacity=tokens_capacity,
        num_sparse_features=num_sparse_features,
        max_bag_size=max_bag_size,
        prefix=prefix,
    )
    return packs.batch(shards_per_step, drop_remainder=False)
