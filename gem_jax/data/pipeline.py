"""The synthetic ads input pipeline: example indices -> examples -> packs -> one stack per step.

Deterministic from the seed, sharded by process index, and checkpointable: the iterator's state
(a small dict) is saved by orbax beside the model (`grain.checkpoint.CheckpointSave`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import jax

from gem_jax.data.batch import pack_examples
from gem_jax.data.packing import PackIterDataset, stacked


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

    def pack(batch: list[dict[str, Any]]):
        return pack_examples(
            batch,
            examples_capacity=examples_capacity,
            tokens_capacity=tokens_capacity,
            num_sparse_features=num_sparse_features,
            max_bag_size=max_bag_size,
            prefix=prefix,
        )

    packs = PackIterDataset(
        examples,
        examples_capacity=examples_capacity,
        tokens_capacity=tokens_capacity,
        length=lambda example: prefix + len(example["item_ids"]),
        pack=pack,
    )
    return stacked(packs, shards_per_step)
