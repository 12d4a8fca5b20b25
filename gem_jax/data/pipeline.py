"""The synthetic ads input pipeline: example indices -> examples -> packs -> one stack per step.

Deterministic from the seed, one example stream per data-parallel shard (so each process reads
only its shards' examples), and checkpointable: the iterator's state
(a small dict) is saved by orbax beside the model (`grain.checkpoint.CheckpointSave`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import jax

from gem_jax.data.batch import pack_examples
from gem_jax.data.packing import PackIterDataset, ShardStacks


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
    shards: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.IterDataset:
    """Examples `start, start+1, ...` -> this process's stacks of its `shards / process_count` packs.

    Batch shard g (of `shards`, all processes) packs examples `start + g, start + g + shards, ...` in
    order, and process p reads shards `p * L .. (p + 1) * L - 1` (L packs per process and step):
    each process reads only its examples, and the global batch of a step is the same for any number
    of processes (a run can resume on a different number; on a different number of shards, every
    shard resumes past the furthest example read). `num_examples=None` streams forever (the
    synthetic train set); otherwise the dataset ends when every shard has run out, and a stack may
    hold empty packs (eval), so every example is seen exactly once.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if shards % process_count:
        raise ValueError(f"{shards} batch shards do not split over {process_count} processes")
    local = shards // process_count
    stop = start + num_examples if num_examples is not None else 2**62

    def pack(batch: list[dict[str, Any]]):
        return pack_examples(
            batch,
            examples_capacity=examples_capacity,
            tokens_capacity=tokens_capacity,
            num_sparse_features=num_sparse_features,
            max_bag_size=max_bag_size,
            prefix=prefix,
        )

    streams = {}
    for g in range(process_index * local, (process_index + 1) * local):
        examples = grain.MapDataset.range(start, stop)[g::shards].map(example_fn).to_iter_dataset()
        streams[g] = PackIterDataset(
            examples,
            examples_capacity=examples_capacity,
            tokens_capacity=tokens_capacity,
            length=lambda example: prefix + len(example["item_ids"]),
            pack=pack,
        )

    def reshard(saved: dict[str, Any], shard: int) -> dict[str, Any]:
        # A position saved with another number of shards (a run resumed on another mesh): every
        # stream starts past the furthest example any old stream had reached, so no example is read
        # twice (the few the slower old streams had not reached are skipped).
        old = len(saved)
        reached = max(int(g) + state["parent"]["next_index"] * old for g, state in saved.items())
        return {"parent": {"next_index": max(0, -(-(reached - shard) // shards))}}

    return ShardStacks(streams, shards, reshard)
