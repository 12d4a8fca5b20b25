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

How: the step's examples are placed heaviest first, each into the pack with the least work so far that
still has room for it (token and example capacity): longest-processing-time first, whose busiest pack is
within 4/3 of the best possible where capacities do not bind. Where some example fits no pack that way,
the step starts from its packs as they were. Then single moves and swaps unload the busiest pack while
they fit and leave both packs below its load. Within a pack the examples keep their order in the step.

What stays: the step holds the same examples (only which device holds each changes), so an epoch sees
the same examples; and the regrouping is a function of the step's stack alone, so the data iterator's
state, and therefore resume, are those of the unbalanced pipeline. The loss is a mean over the step's
examples, so the regrouping changes only the order of floating-point sums (and, with dropout, which
random mask an example draws). A process regroups the packs
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
    fallback: list[list[int]] | None = None,
) -> list[list[int]] | None:
    """Example indices of each of `packs` packs (each list ascending), balancing `attention_work` within
    the capacities: longest-processing-time first, else (some example fit no pack) `fallback`, a grouping
    that fits; then moves and swaps that unload the busiest pack. None: no placement and no fallback."""
    lengths = np.asarray(lengths, np.int64)
    work = attention_work(lengths, tile)
    groups = _longest_first(lengths, work, packs, examples_capacity, tokens_capacity)
    if groups is None:
        if fallback is None:
            return None
        groups = [list(g) for g in fallback]
    groups = _unload_busiest(groups, lengths, work, examples_capacity, tokens_capacity)
    return [sorted(g) for g in groups]


def _longest_first(lengths, work, packs, examples_capacity, tokens_capacity) -> list[list[int]] | None:
    """Heaviest first into the least loaded pack with room (the first such); None if one fits nowhere."""
    load, tokens, count = [0] * packs, [0] * packs, [0] * packs
    groups: list[list[int]] = [[] for _ in range(packs)]
    # Among equal work, longest first (fewer stranded tokens at the end), then in order.
    for i in np.lexsort((np.arange(len(lengths)), -lengths, -work)).tolist():
        n, w = int(lengths[i]), int(work[i])
        room = [p for p in range(packs) if tokens[p] + n <= tokens_capacity and count[p] < examples_capacity]
        if not room:
            return None
        p = min(room, key=load.__getitem__)
        load[p] += w
        tokens[p] += n
        count[p] += 1
        groups[p].append(i)
    return groups


def _unload_busiest(groups, lengths, work, examples_capacity, tokens_capacity, max_rounds: int = 1000):
    """Repeatedly moves one example out of the busiest pack, or swaps one of its examples for a lighter
    one, towards a less loaded pack, where that fits and leaves both below the busiest pack's old load."""
    for _ in range(max_rounds):
        load = [int(work[g].sum()) for g in groups]
        tokens = [int(lengths[g].sum()) for g in groups]
        p = int(np.argmax(load))
        best = None  # (the larger of the two new loads, q, i, j or None)
        for q in np.argsort(load, kind="stable").tolist():
            if q == p or load[q] >= load[p]:
                continue
            mine, theirs = np.array(groups[p], np.int64), np.array(groups[q] + [-1], np.int64)
            # Every (i of p, j of q or nothing): the work and tokens that move from p to q.
            shift = work[mine][:, None] - np.where(theirs >= 0, work[theirs], 0)[None, :]
            moved = lengths[mine][:, None] - np.where(theirs >= 0, lengths[theirs], 0)[None, :]
            fits = (tokens[q] + moved <= tokens_capacity) & (tokens[p] - moved <= tokens_capacity)
            fits[:, -1] &= len(groups[q]) < examples_capacity
            after = np.maximum(load[p] - shift, load[q] + shift)
            after = np.where(fits & (shift > 0), after, load[p])
            a, b = np.unravel_index(int(np.argmin(after)), after.shape)
            if after[a, b] < load[p] and (best is None or after[a, b] < best[0]):
                best = (int(after[a, b]), q, int(mine[a]), int(theirs[b]) if theirs[b] >= 0 else None)
        if best is None:
            return groups
        _, q, i, j = best
        groups[p].remove(i)
        groups[q].append(i)
        if j is not None:
            groups[q].remove(j)
            groups[p].append(j)
    return groups


def balance_stack(
    stack: JaggedBatch,
    *,
    prefix: int,
    num_sparse_features: int,
    max_bag_size: int,
    tile: int = ATTENTION_TILE,
) -> JaggedBatch:
    """The (numpy) stack's examples regrouped into as many packs of the same capacities, balancing the
    attention work (module docstring); the stack itself where it has one pack or no example."""
    packs, tokens_capacity = stack.item_ids.shape
    examples_capacity = stack.num_targets.shape[1]
    if packs == 1:
        return stack
    examples = []
    for s in range(packs):
        pack = jax.tree.map(lambda x, s=s: x[s], stack)
        examples += unpack_examples(pack, prefix=prefix, num_sparse_features=num_sparse_features)
    lengths = np.array([prefix + len(e["item_ids"]) for e in examples], np.int64)
    if not examples:
        return stack
    sizes = np.asarray(stack.num_targets > 0).sum(-1)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    groups = balanced_groups(
        lengths,
        packs=packs,
        examples_capacity=examples_capacity,
        tokens_capacity=tokens_capacity,
        tile=tile,
        fallback=[list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])],
    )
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
