"""The ranking input pipeline: a dataset of examples -> packs -> one stack per step.

The examples are any random-access grain dataset: the synthetic generator (`MapDataset.range(...).map
(example)`, deterministic from the seed) or records read from shards (gem_jax/data/records/). One example
stream per data-parallel shard (so each process reads only its shards' examples), and checkpointable: the
iterator's state (a small dict) is saved by orbax beside the model (`grain.checkpoint.CheckpointSave`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import grain
import jax

from gem_jax.data.balance import balance_stack
from gem_jax.data.batch import pack_examples
from gem_jax.data.packing import PackIterDataset, ShardStacks


def packed_dataset(
    examples: grain.MapDataset,
    *,
    examples_capacity: int,
    tokens_capacity: int,
    num_sparse_features: int,
    max_bag_size: int,
    prefix: int,
    shards: int,
    process_index: int | None = None,
    process_count: int | None = None,
    stream: Callable[[grain.IterDataset], grain.IterDataset] | None = None,
    read_options: grain.ReadOptions | None = None,
    balance: bool = False,
) -> grain.IterDataset:
    """Examples `0, 1, ...` of `examples` -> this process's stacks of its `shards / process_count` packs.

    Batch shard g (of `shards`, all processes) packs examples `g, g + shards, ...` in order, and
    process p reads shards `p * L .. (p + 1) * L - 1` (L packs per process and step): each process
    reads only its examples, and the global batch of a step is the same for any number of processes (a
    run can resume on a different number; on a different number of shards, every shard resumes past
    the furthest example read). An infinite `examples` (length `sys.maxsize`: the synthetic train set,
    repeated shards) streams forever; otherwise the dataset ends when every shard has run out, and a
    stack may hold empty packs (eval), so every example is seen exactly once. `stream` wraps each
    shard's example stream before packing (records: skip bad records, count what was cut); `read_options`
    are grain's threads and buffer that produce each stream's examples ahead (default: grain's). `balance`
    regroups each stack's examples so that its packs carry about the same attention work
    (gem_jax/data/balance.py: the same examples per step, and the same iterator state).
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if shards % process_count:
        raise ValueError(f"{shards} batch shards do not split over {process_count} processes")
    local = shards // process_count

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
        shard_examples = examples[g::shards].to_iter_dataset(read_options)
        streams[g] = PackIterDataset(
            stream(shard_examples) if stream is not None else shard_examples,
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

    stacks = ShardStacks(streams, shards, reshard)
    if not balance:
        return stacks
    return stacks.map(
        functools.partial(
            balance_stack, prefix=prefix, num_sparse_features=num_sparse_features, max_bag_size=max_bag_size
        )
    )


def example_range(
    example_fn: Callable[[int], dict[str, Any]], start: int, num: int | None
) -> grain.MapDataset:
    """Examples `example_fn(start), example_fn(start + 1), ...`: `num` of them, or endless for None."""
    stop = start + num if num is not None else 2**62
    return grain.MapDataset.range(start, stop).map(example_fn)


class WorkerBlockExamples(grain.MapDataset):
    """The endless examples `example_fn(0), example_fn(1), ...`, handed out to grain's worker processes
    a whole block at a time.

    Examples are drawn `block` at a time (the synthetic generator's numpy blocks). grain's default worker
    slicing gives worker i of W every W-th example, so every worker would draw every block and use 1/W of
    it: 12 workers ran no faster than one (hstu_nvidia on the H200: 169 ms per pack with 12 workers). With
    `mp_prefetch(..., sequential_slice=True)` grain hands this dataset the worker's slice instead
    (`set_slice`), and worker i reads blocks i, i + W, i + 2W, ... whole. Without workers it is
    `example_range(example_fn, 0, None)`, example for example; with them, which examples a step holds
    depends on W, as it does anyway once packs come from W workers in turn.
    """

    def __init__(self, example_fn: Callable[[int], dict[str, Any]], block: int):
        super().__init__()
        self._example_fn, self._block = example_fn, block
        self._worker, self._workers = 0, 1

    def __len__(self) -> int:
        return 2**62

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """grain's per-worker slice `slice(worker, None, workers)` (its in-place slicing protocol)."""
        if sl.stop is not None or not 0 <= sl.start < sl.step:
            raise ValueError(f"expected a worker's slice slice(i, None, n) with 0 <= i < n, got {sl}")
        self._worker, self._workers = sl.start, sl.step

    def example_index(self, index: int) -> int:
        """The example at position `index` of this worker's stream."""
        number, offset = divmod(int(index), self._block)
        return (number * self._workers + self._worker) * self._block + offset

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._example_fn(self.example_index(index))

    def __str__(self) -> str:
        return f"WorkerBlockExamples(block={self._block}, worker {self._worker} of {self._workers})"
