"""Balanced packs: a step's packs regrouped so that every device gets about the same attention work.

Why: a data-parallel step lasts as long as its slowest device. Under jit every pack has the same static
shapes, so the GEMMs, norms, lookups and heads cost each device the pack's capacity, the same everywhere;
only attention follows the sequences. The jagged attention kernels list (sequence, tile) work items only
for tiles that hold rows of a sequence (pallas_kernels/jagged_attention/tiling.py): query tile m of a
sequence scans its m + 1 causal key tiles (dK/dV mirror it), so a sequence of L rows costs n (n + 1) / 2
tile pairs, n = ceil(L / tile), about L^2 / 2 tile^2 for long ones and one tile for short ones. Histories
are heavy-tailed: one pack may draw several of the longest sequences while another holds only short
ones at the same token count. NVIDIA's workload-balanced shuffler (recsys-examples, HSTU benchmark) does
this across GPUs by the same L^2 cost and gained 1.53x step throughput on Zipf lengths.

How: the step's examples are placed longest work first, each into the pack with the least work so far
that still has room for it (token and example capacity): longest-processing-time-first, whose largest
pack is within 4/3 of the best possible. Within a pack the examples keep their order in the step. If
some example fits no pack (capacities too tight) the step keeps its packs as they were.

What stays: the step holds the same examples (only which device holds each changes), so an epoch sees
the same examples; and the regrouping is a function of the step's stack alone, so the data iterator's
state, and therefore resume, are those of the unbalanced pipeline. The loss is a mean over the step's
examples, so the regrouping changes only the order of floating-point sums. A process regroups the packs
it builds (its devices): across hosts each host balances its own.
"""

from __future__ import annotations

import jax
import numpy as np
from jaxtyping import ArrayLike, Int

from gem_jax.data.batch import JaggedBatch, pack_examples, unpack_examples
from gem_jax.data.packing import stack_packs

# Query-tile rows of the GPU attention kernels (the Triton kernels' block_q, the Hopper forward's two
# 64-row consumers): the unit of the cost model. Only ratios matter, so the exact tile is secondary.
ATTENTION_TILE = 128


def attention_work(lengths: Int[ArrayLike, "..."], tile: int = ATTENTION_TILE) -> np.ndarray:
    """Causal attention tile pairs of sequences of these lengths: n (n + 1) / 2, n = ceil(L / tile)."""
    n = -(-np.asarray(lengths, np.int64) // tile)
    return n * (n + 1) // 2


def pack_work(stack: JaggedBatch, tile: int = ATTENTION_TILE) -> np.ndarray:
    """Attention work of each pack of a (numpy) stack: [packs]."""
    return attention_work(np.diff(np.asarray(stack.offsets), axis=-1), tile).sum(-1)


def balanced_groups(
    lengths: Int[ArrayLike, " N"],
    *,
    packs: int,
    examples_capacity: int,
    tokens_capacity: int,
    tile: int = ATTENTION_TILE,
) -> list[list[int]] | None:
    """Example indices of each of `packs` packs (each list ascending), balancing `attention_work`; None
    when some example fits no pack."""
    lengths = np.asarray(lengths, np.int64)
    work = attention_work(lengths, tile)
    load = np.zeros(packs, np.int64)
    tokens = np.zeros(packs, np.int64)
    count = np.zeros(packs, np.int64)
    groups: list[list[int]] = [[] for _ in range(packs)]
    # Heaviest first; among equal work, longest first (fewer stranded tokens at the end); then in order.
    for i in np.lexsort((np.arange(len(lengths)), -lengths, -work)):
        room = (tokens + lengths[i] <= tokens_capacity) & (count < examples_capacity)
        if not room.any():
            return None
        p = int(np.argmin(np.where(room, load, np.iinfo(np.int64).max)))  # the first of the least loaded
        load[p] += work[i]
        tokens[p] += lengths[i]
        count[p] += 1
        groups[p].append(int(i))
    return [sorted(g) for g in groups]


def balance_stack(
    stack: JaggedBatch,
    *,
    prefix: int,
    num_sparse_features: int,
    max_bag_size: int,
    tile: int = ATTENTION_TILE,
) -> JaggedBatch:
    """The (numpy) stack's examples regrouped into as many packs of the same capacities, balancing the
    attention work (module docstring); the stack itself where one pack or no balanced placement."""
    packs, tokens_capacity = stack.item_ids.shape
    examples_capacity = stack.num_targets.shape[1]
    if packs == 1:
        return stack
    examples = []
    for s in range(packs):
        pack = jax.tree.map(lambda x, s=s: x[s], stack)
        examples += unpack_examples(pack, prefix=prefix, num_sparse_features=num_sparse_features)
    lengths = np.array([prefix + len(e["item_ids"]) for e in examples], np.int64)
    groups = balanced_groups(
        lengths, packs=packs, examples_capacity=examples_capacity, tokens_capacity=tokens_capacity, tile=tile
    )
    if groups is None or not examples:
        return stack
    built = [
        pack_examples(
            [examples[i] for i in group],
            examples_capacity=examples_capacity,
            tokens_capacity=tokens_capacity,
            num_sparse_features=num_sparse_features,
            max_bag_size=max_bag_size,
            prefix=prefix,
        )
        if group
        else None
        for group in groups
    ]
    # Fewer examples than packs: the rest are empty packs (all zeros), as at the end of a finite dataset.
    empty = jax.tree.map(np.zeros_like, next(p for p in built if p is not None))
    return stack_packs([p if p is not None else empty for p in built])
