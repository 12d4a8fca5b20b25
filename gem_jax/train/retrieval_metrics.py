"""Retrieval metrics for next-item evaluation: target ranks, HR@K and NDCG@K, both protocols.

Both protocols reduce to "rank of the target among candidate scores" and share one function,
:func:`target_rank`, so they share one tie rule:

* Ties are counted **pessimistically**: rank = number of *other* candidates whose score is
  ``>=`` the target's. A model that scores everything equally gets the worst rank, never the
  best (with optimistic ties a constant model would score HR@K = 1).
* Masked candidates carry ``-inf`` and so never outrank a finite target score.
* NaN is pessimistic too: a NaN candidate outranks the target, a NaN target is ranked last.

Protocols (docs/results.md, "Protocol", has the published numbers of each):

* sampled (SASRec): the target against 100 negatives drawn by
  ``gem_jax.data.interactions.sample_negatives`` -> :func:`sampled_ranks`.
* full ranking (ICLRec): the target against all items 1..N (row 0 of the item table is
  padding, never a candidate) -> :func:`full_ranking_ranks`; the user's training items stay
  candidates unless ``exclude`` is given (ICLRec keeps them).

HR@K = [rank < K]; NDCG@K = [rank < K] / log2(rank + 2) (one relevant item, so IDCG = 1).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

DEFAULT_KS = (5, 10, 20)
# Users per chunk in the full-ranking helper: chunk x (N + 1) fp32 scores live at once
# (1024 x 18358 x 4 B = 75 MB for Sports; 35k users x 18k items at once would be 2.6 GB).
DEFAULT_CHUNK = 1024


@jax.jit
def target_rank(scores: Float[ArrayLike, "B N"], target_index: Int[ArrayLike, " B"]) -> Int[ArrayLike, " B"]:
    """0-based rank of ``scores[b, target_index[b]]`` in row b, ties and NaN pessimistic.

    Args:
      scores: [B, N] candidate scores; ``-inf`` marks a masked candidate.
      target_index: [B] column of each row's target, in [0, N).

    Returns:
      int32[B]: the number of other candidates scoring ``>=`` the target.
    """
    if scores.ndim != 2 or target_index.shape != scores.shape[:1]:
        raise ValueError(f"scores {scores.shape} and target_index {target_index.shape}: expected [B, N], [B]")
    scores = scores.astype(jnp.float32)
    target = jnp.take_along_axis(scores, target_index[:, None].astype(jnp.int32), axis=1)
    target = jnp.where(jnp.isnan(target), -jnp.inf, target)
    candidates = jnp.where(jnp.isnan(scores), jnp.inf, scores)
    # The target's own column always counts (x >= x, +inf >= -inf): subtract it.
    return jnp.sum(candidates >= target, axis=1, dtype=jnp.int32) - 1


def _per_example(ranks: Int[ArrayLike, " B"], ks: Sequence[int]) -> dict[str, Array]:
    """Per-example HR@K and NDCG@K (float32[B] each)."""
    ranks = ranks.astype(jnp.float32)
    gain = 1.0 / jnp.log2(ranks + 2.0)
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"HR@{k}"] = hit.astype(jnp.float32)
        out[f"NDCG@{k}"] = jnp.where(hit, gain, 0.0)
    return out


_per_example_jit = jax.jit(_per_example, static_argnames="ks")


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks or min(ks) < 1:
        raise ValueError(f"ks={ks}; expected a non-empty sequence of positive cut-offs")
    return ks


@functools.partial(jax.jit, static_argnames=("ks",))
def _batch_sums(ranks, valid, ks):
    weights = valid.astype(jnp.float32)
    return {name: jnp.sum(v * weights) for name, v in _per_example(ranks, ks).items()}


def hr_ndcg(
    ranks: Int[ArrayLike, " B"],
    ks: Sequence[int] = DEFAULT_KS,
    valid: Bool[ArrayLike, " B"] | None = None,
) -> dict[str, Array]:
    """Batch means of HR@K and NDCG@K, keys ``"HR@10"``, ``"NDCG@10"``, ...

    ``valid`` (optional) masks padding rows out of the mean. For means over many batches use
    :class:`RetrievalAccumulator` (exact sums and counts, not a mean of batch means).
    """
    ks = _check_ks(ks)
    ranks = jnp.asarray(ranks)
    valid = jnp.ones(ranks.shape, bool) if valid is None else jnp.asarray(valid, bool)
    count = jnp.sum(valid.astype(jnp.float32))
    return {name: total / count for name, total in _batch_sums(ranks, valid, ks).items()}


@functools.partial(jax.jit, static_argnames=("chunk_size", "zero_excluded"))
def _full_ranking(user_vecs, item_table, targets, exclude, chunk_size, zero_excluded):
    num_users = user_vecs.shape[0]
    num_chunks = -(-num_users // chunk_size)
    pad = num_chunks * chunk_size - num_users
    # Padding rows score a zero vector against target 0 (the padding item); cut off below.
    user_vecs = jnp.pad(user_vecs, ((0, pad), (0, 0)))
    targets = jnp.pad(targets, (0, pad))
    exclude = jnp.pad(exclude, ((0, pad), (0, 0)))
    table = item_table.astype(jnp.float32)
    is_padding_item = jnp.arange(table.shape[0]) == 0

    def one_chunk(args):
        u, t, ex = args
        scores = jnp.dot(
            u.astype(jnp.float32), table.T, precision=jax.lax.Precision.HIGHEST
        )  # [chunk, N + 1]
        rows = jnp.arange(u.shape[0])[:, None]
        # Exclusion ids are item ids; 0 pads the lists and hits the padding column, masked anyway;
        # ids outside 0..N are ignored (negative ones would otherwise wrap around).
        ex = jnp.where(ex < 0, scores.shape[1], ex)
        masked = jnp.zeros(scores.shape, bool).at[rows, ex].set(True, mode="drop")
        if zero_excluded:  # their score becomes 0, the target's too when it is listed
            scores = jnp.where(masked, 0.0, scores)
            return target_rank(jnp.where(is_padding_item, -jnp.inf, scores), t)
        masked = (masked | is_padding_item) & (jnp.arange(scores.shape[1]) != t[:, None])
        return target_rank(jnp.where(masked, -jnp.inf, scores), t)

    chunks = (
        user_vecs.reshape(num_chunks, chunk_size, -1),
        targets.reshape(num_chunks, chunk_size),
        exclude.reshape(num_chunks, chunk_size, -1),
    )
    ranks = jax.lax.map(one_chunk, chunks)
    return ranks.reshape(-1)[:num_users]


def full_ranking_ranks(
    user_vecs: Float[ArrayLike, "B D"],
    item_table: Float[ArrayLike, "N1 D"],
    targets: Int[ArrayLike, " B"],
    exclude: Int[ArrayLike, "B L"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    zero_excluded: bool = False,
) -> Int[ArrayLike, " B"]:
    """Rank of each target among all items 1..N by dot-product score (ICLRec protocol).

    Args:
      user_vecs: [B, D] user representations (e.g. the last position of the sequence tower).
      item_table: [N + 1, D] item embeddings; row 0 is padding and never a candidate.
      targets: [B] target item ids in 1..N.
      exclude: optional [B, L] item ids to drop from each user's candidates (e.g. its training
        items, padded with 0). The target itself is never dropped, even if listed (a repeat
        interaction); off by default, as in ICLRec.
      chunk_size: users scored at once; memory is chunk_size x (N + 1) fp32 scores.
      zero_excluded: instead of dropping the `exclude` items, set their scores to 0 and keep them,
        the target included when listed: the masking of ICLRec's, ICSRec's and BSARec's evaluation
        code (`rating_pred[train_matrix[users].toarray() > 0] = 0`). An excluded item can then still
        outrank a target with a negative score, and a repeated target scores 0.

    Returns:
      int32[B] 0-based ranks (ties pessimistic, see the module docstring). Scores are computed
      in fp32 at HIGHEST matmul precision.
    """
    if user_vecs.ndim != 2 or item_table.ndim != 2 or user_vecs.shape[1] != item_table.shape[1]:
        raise ValueError(
            f"user_vecs {user_vecs.shape} and item_table {item_table.shape}: expected [B, D] and [N + 1, D]"
        )
    if targets.shape != user_vecs.shape[:1]:
        raise ValueError(f"targets {targets.shape}; expected [{user_vecs.shape[0]}]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}; expected >= 1")
    if exclude is None:
        exclude = jnp.zeros((user_vecs.shape[0], 1), jnp.int32)
    elif exclude.ndim != 2 or exclude.shape[0] != user_vecs.shape[0]:
        raise ValueError(f"exclude {exclude.shape}; expected [{user_vecs.shape[0]}, L]")
    chunk_size = min(chunk_size, max(user_vecs.shape[0], 1))
    return _full_ranking(
        user_vecs,
        item_table,
        jnp.asarray(targets, jnp.int32),
        jnp.asarray(exclude, jnp.int32),
        chunk_size,
        zero_excluded,
    )


@jax.jit
def sampled_ranks(
    target_scores: Float[ArrayLike, " B"], negative_scores: Float[ArrayLike, "B M"]
) -> Int[ArrayLike, " B"]:
    """Rank of the target among itself and its M sampled negatives (SASRec protocol, M = 100)."""
    if target_scores.shape != negative_scores.shape[:1] or negative_scores.ndim != 2:
        raise ValueError(
            f"target_scores {target_scores.shape} and negative_scores {negative_scores.shape}: "
            f"expected [B] and [B, M]"
        )
    scores = jnp.concatenate([target_scores[:, None], negative_scores], axis=1)
    return target_rank(scores, jnp.zeros(target_scores.shape, jnp.int32))


@jax.jit
def sampled_ranks_from_vectors(
    user_vecs: Float[ArrayLike, "B D"],
    item_table: Float[ArrayLike, "N1 D"],
    targets: Int[ArrayLike, " B"],
    negatives: Int[ArrayLike, "B M"],
) -> Int[ArrayLike, " B"]:
    """:func:`sampled_ranks` with dot-product scores of user vectors against item rows."""
    u = user_vecs.astype(jnp.float32)
    table = item_table.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    target_scores = jnp.einsum("bd,bd->b", u, table[targets], precision=hi)
    negative_scores = jnp.einsum("bd,bmd->bm", u, table[negatives], precision=hi)
    return sampled_ranks(target_scores, negative_scores)


class RetrievalAccumulator:
    """Exact running means of HR@K / NDCG@K over eval batches: float64 sums over a count.

    Every example weighs the same, whatever the batch sizes (a mean of batch means would not);
    ``valid`` drops padding rows of a last, partial batch. flax's ``nnx.metrics.Average`` does
    the same idea with float32 device sums; host float64 keeps 35k-user sums exact to ~1e-12.
    """

    def __init__(self, ks: Sequence[int] = DEFAULT_KS):
        self.ks = _check_ks(ks)
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.sums = {name: 0.0 for k in self.ks for name in (f"HR@{k}", f"NDCG@{k}")}

    def update(self, ranks: Int[ArrayLike, " B"], valid: Bool[ArrayLike, " B"] | None = None) -> None:
        ranks = jnp.asarray(ranks)
        valid = jnp.ones(ranks.shape, bool) if valid is None else jnp.asarray(valid, bool)
        if valid.shape != ranks.shape:
            raise ValueError(f"valid {valid.shape} and ranks {ranks.shape}: expected equal")
        per_example = _per_example_jit(ranks, self.ks)
        keep = np.asarray(valid)
        for name, values in per_example.items():
            self.sums[name] += float(np.asarray(values, np.float64)[keep].sum())
        self.count += int(keep.sum())

    def compute(self) -> Mapping[str, float]:
        """Means so far; raises if nothing was accumulated (a silent 0 would look like a result)."""
        if self.count == 0:
            raise ValueError("RetrievalAccumulator.compute() with count=0: no examples seen")
        return {name: total / self.count for name, total in self.sums.items()}
