"""`SlotCache`: which slot of one device's HBM cache holds which row of its block of an offloaded
table, and which rows a batch evicts (least frequently used first).

Pure host bookkeeping (numpy), one per device block: gem_jax/embeddings/offload.py moves the values.
Every row a batch looks up must be cached while the step runs (the step reads and updates only the
cache), so there is no admission test: a missing row always comes in, and the evicted rows are the
least used of the slots that batch does not need, empty slots first. Use counts are kept per row for
the whole run (also while a row is out of the cache), so a row that comes back keeps its history.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jaxtyping import Int


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where one batch's rows went: their slots, and the slots filled from the host (with the row
    each now holds and the row it held before, -1 where it was empty)."""

    slots: Int[np.ndarray, " U"]  # slot of every requested row, in the order asked
    fill_slots: Int[np.ndarray, " M"]
    fill_rows: Int[np.ndarray, " M"]
    evicted_rows: Int[np.ndarray, " M"]

    @property
    def hits(self) -> int:
        return len(self.slots) - len(self.fill_slots)


class SlotCache:
    """`slots` cache slots for a block of `rows` rows (local indices on both sides). Host memory:
    8 bytes per row (slot, use count) and 4 per slot."""

    def __init__(self, rows: int, slots: int):
        self.slot_of = np.full(rows, -1, np.int32)  # row -> its slot, -1 when not cached
        self.row_in = np.full(slots, -1, np.int32)  # slot -> the row it holds, -1 when empty
        self.uses = np.zeros(rows, np.int32)  # lookups of each row so far (LFU)

    @property
    def num_slots(self) -> int:
        return len(self.row_in)

    def place(
        self, rows: Int[np.ndarray, " U"], counts: Int[np.ndarray, " U"], *, commit: bool = True
    ) -> Placed:
        """Caches the distinct `rows` (looked up `counts` times each), evicting others as needed.
        `commit=False`: where they would go, with nothing changed (evaluation, on a copy of the cache)."""
        if len(rows) > self.num_slots:
            raise ValueError(f"{len(rows)} distinct rows in one batch, over the {self.num_slots} slots")
        slots = self.slot_of[rows].astype(np.int64)
        missing = slots < 0
        need = int(missing.sum())
        fill = np.zeros(0, np.int64)
        if need:
            free = np.ones(self.num_slots, bool)
            free[slots[~missing]] = False  # the batch's own rows stay
            candidates = np.flatnonzero(free)
            held = self.row_in[candidates]
            key = np.where(held < 0, -1, self.uses[np.maximum(held, 0)])  # empty slots first, then LFU
            if need < len(candidates):
                candidates = candidates[np.sort(np.argpartition(key, need - 1)[:need])]
            fill = candidates[:need]
            slots[missing] = fill
        evicted = self.row_in[fill].astype(np.int64)
        if commit:
            self.slot_of[evicted[evicted >= 0]] = -1
            self.row_in[fill] = rows[missing]
            self.slot_of[rows[missing]] = fill
            self.uses[rows] += counts.astype(np.int32)
        return Placed(slots, fill, rows[missing], evicted)

    def cached(self) -> tuple[Int[np.ndarray, " C"], Int[np.ndarray, " C"]]:
        """(slots, rows) of every occupied slot."""
        slots = np.flatnonzero(self.row_in >= 0)
        return slots, self.row_in[slots]
