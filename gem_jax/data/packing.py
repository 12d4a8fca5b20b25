"""The one packer: examples -> fixed-capacity jagged packs -> one stack of packs per step.

Both tasks pack the same way. A pack has a token capacity and an example capacity (static shapes
under jit); examples are taken in order and an example that does not fit opens the next pack
(sequential first-fit, order preserving, so resumption is exact and a pack's contents depend only on
where it starts). `fits` is that rule; `PackIterDataset` applies it to a stream (the synthetic ads
task) and `greedy_groups` to a list of known lengths (an epoch of next-item users).

grain's own packers (`FirstFitPackIterDataset`, ...) pack into fixed-length *rows* with segment ids,
the LM layout; our batch is one flat jagged buffer with offsets per pack, so the packer is ours.
A step's batch is a stack of packs (one per data-parallel shard of this process); a short last
stack (end of a finite dataset or of an epoch) is padded with empty packs (all zeros: offsets 0, no
targets), which every task treats as padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import numpy as np


def fits(
    num_examples: int, num_tokens: int, length: int, *, examples_capacity: int, tokens_capacity: int
) -> bool:
    """Whether one more example of `length` tokens fits a pack holding `num_examples` / `num_tokens`."""
    return num_examples + 1 <= examples_capacity and num_tokens + length <= tokens_capacity


def _too_long(length: int, tokens_capacity: int) -> ValueError:
    return ValueError(f"an example of {length} tokens does not fit an empty pack of {tokens_capacity} tokens")


def greedy_groups(
    lengths: Sequence[int], *, examples_capacity: int, tokens_capacity: int
) -> list[tuple[int, int]]:
    """The packs `fits` makes of examples with these token lengths, in order: [(start, stop)) runs."""
    groups: list[tuple[int, int]] = []
    start = count = tokens = 0
    for i, n in enumerate(lengths):
        n = int(n)
        if n > tokens_capacity:
            raise _too_long(n, tokens_capacity)
        if not fits(count, tokens, n, examples_capacity=examples_capacity, tokens_capacity=tokens_capacity):
            groups.append((start, i))
            start, count, tokens = i, 0, 0
        count += 1
        tokens += n
    if count:
        groups.append((start, len(lengths)))
    return groups


def pad_stack(stack: Any, shards: int) -> Any:
    """Pads a stack of fewer than `shards` packs (leading axis) with empty (all-zero) packs."""
    have = jax.tree.leaves(stack)[0].shape[0]
    if have == shards:
        return stack
    return jax.tree.map(
        lambda x: np.concatenate([x, np.zeros((shards - have, *x.shape[1:]), x.dtype)]), stack
    )


def stack_packs(packs: Sequence[Any], shards: int | None = None) -> Any:
    """Stacks packs on a new leading shard axis, padded to `shards` packs when given."""
    stack = jax.tree.map(lambda *xs: np.stack(xs), *packs)
    return stack if shards is None else pad_stack(stack, shards)


class _PackIterator(grain.DatasetIterator):
    """Greedily fills packs in order; an example that does not fit opens the next pack."""

    def __init__(self, parent: grain.DatasetIterator, dataset: PackIterDataset):
        super().__init__(parent)
        self._ds = dataset
        self._pending: Any = None
        # Parent state from before `_pending` was read: restoring it re-reads that example, so the
        # checkpointed state stays a small dict instead of holding arrays.
        self._state_before_pending: dict[str, Any] | None = None

    def __next__(self) -> Any:
        ds = self._ds
        examples: list[Any] = []
        tokens = 0
        while True:
            if self._pending is None:
                state = self._parent.get_state()
                try:
                    self._pending = next(self._parent)
                except StopIteration:
                    break
                self._state_before_pending = state
            n = ds.length(self._pending)
            if not fits(
                len(examples),
                tokens,
                n,
                examples_capacity=ds.examples_capacity,
                tokens_capacity=ds.tokens_capacity,
            ):
                if not examples:
                    raise _too_long(n, ds.tokens_capacity)
                break
            examples.append(self._pending)
            tokens += n
            self._pending = None
        if not examples:
            raise StopIteration
        return ds.pack(examples)

    def get_state(self) -> dict[str, Any]:
        if self._pending is not None:
            return {"parent": self._state_before_pending}
        return {"parent": self._parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._pending = None
        self._state_before_pending = None


class PackIterDataset(grain.IterDataset):
    """Packs a stream of examples into packs of fixed capacity (`fits`, in order).

    Args:
      parent: the examples.
      length: an example's token count in the pack (including any prefix slots).
      pack: builds one pack from a list of examples that fit.
    """

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        examples_capacity: int,
        tokens_capacity: int,
        length: Callable[[Any], int],
        pack: Callable[[list[Any]], Any],
    ):
        super().__init__(parent)
        self.examples_capacity = examples_capacity
        self.tokens_capacity = tokens_capacity
        self.length = length
        self.pack = pack

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self)


class _ShardStackIterator(grain.DatasetIterator):
    def __init__(self, dataset: ShardStacks):
        super().__init__([it.__iter__() for it in dataset.streams.values()])
        self._ds = dataset
        self._shards = [str(g) for g in dataset.streams]

    def __next__(self) -> Any:
        packs = []
        for it in self._parents:
            try:
                packs.append(next(it))
            except StopIteration:
                packs.append(None)
        live = [p for p in packs if p is not None]
        if not live:
            raise StopIteration
        if len(live) < len(packs):  # (made only when needed: a pack of 196,608 tokens costs ms to zero)
            empty = jax.tree.map(np.zeros_like, live[0])  # all zeros: offsets 0, no targets (padding)
            packs = [p if p is not None else empty for p in packs]
        return stack_packs(packs)

    def get_state(self) -> dict[str, Any]:
        # `num_shards`: each process saves only its own shards, so their count alone cannot say
        # whether the run that saved them had as many batch shards as this one.
        shards = {g: it.get_state() for g, it in zip(self._shards, self._parents, strict=True)}
        return {"shards": shards, "num_shards": self._ds.shards}

    def set_state(self, state: dict[str, Any]) -> None:
        """Takes this process's shards from `state`, which may hold other processes' shards too
        (a checkpoint written by a different number of processes, see `train/checkpoint.py`); a
        state of another number of batch shards goes through the dataset's `reshard`."""
        saved = state["shards"]
        old = state.get("num_shards")
        if old is None:  # written before `num_shards` was saved: one process's shards, or all of them
            keys = {int(g) for g in saved}
            same = {int(g) for g in self._shards} <= keys and max(keys) < self._ds.shards
            old = self._ds.shards if same else len(saved)
        if old != self._ds.shards and self._ds.reshard:
            if len(saved) != old:
                raise ValueError(
                    f"the data state holds {len(saved)} of the {old} batch shards it was saved with: "
                    "resume on the number of batch shards that saved it, or on as many processes"
                )
            for g, it in zip(self._shards, self._parents, strict=True):
                it.set_state(self._ds.reshard(saved, int(g)))
            return
        for g, it in zip(self._shards, self._parents, strict=True):
            if g not in saved:
                raise ValueError(
                    f"the data state holds no position for batch shard {g}: {sorted(state['shards'])}"
                )
            it.set_state(state["shards"][g])


class ShardStacks(grain.IterDataset):
    """One stack per step from several pack streams, one per data-parallel shard (keyed by its global
    shard index): stream g's packs always land in batch shard g, whichever process reads it, so a
    global batch does not depend on the number of processes. A finite stream that ends first is
    padded with empty packs until every stream has ended."""

    def __init__(
        self,
        streams: dict[int, grain.IterDataset],
        shards: int,
        reshard: Callable[[dict[str, Any], int], Any] | None = None,
    ):
        """Args:
        streams: global batch shard index -> its pack stream (this process's shards).
        shards: batch shards of a step, all processes.
        reshard: `(positions saved with another number of shards, shard) -> its position`; None:
          such a state is an error.
        """
        super().__init__(list(streams.values()))
        self.streams = streams
        self.shards = shards
        self.reshard = reshard

    def __iter__(self) -> _ShardStackIterator:
        return _ShardStackIterator(self)
