"""A synthetic ads task with a planted, learnable signal.

The world (fixed by the seed): every item has a latent factor; items are Zipf-popular. Each user
has a latent taste vector. The user's history is drawn from popular items tilted towards the
user's taste, so the history reveals the taste; one sparse feature carries a coarse user segment
(so users with empty histories are not pure noise), another the candidate's category. A click is
Bernoulli(sigmoid(taste . item factor + dense signal)); a conversion needs a click and a second,
related draw. A model that learns shows it in AUC; one that does not stays near 0.5.
History lengths are log-normal or Zipf (heavy-tailed), with a fraction of empty histories.

Memory does not grow with the item space past `TABLE_ITEMS` items. Up to it the items' factors and the
Zipf CDF are tables over every item (`data.num_items` + 1 rows; stream 2, what every run so far drew). Past
it they would cost ~40 bytes per item in the trainer and in each data worker (grain pickles the generator
to every worker: 5 GB each at 126 M items, and ~220 bytes per item while building), so the world is drawn
per item instead (stream 3): an item's factor comes from a counter-based hash of (seed, item), the same
construction (its category's factor plus its own) with the HEAD_ITEMS most popular items' factors kept in
a table, and a Zipf id is the head's exact CDF or, past it, the inverse of the law's integral (each rank k
gets the integral of x^-s over [k - 1/2, k + 1/2): k^-s within a relative ~0.1 / k^2, 1e-12 past the
head). About 10 MB per process at any item count.
"""

from __future__ import annotations

import threading
from typing import Any

import grain
import numpy as np

from gem_jax.config import DataConfig

_NUM_SEGMENTS = 16
_CATEGORY_SIZE = 16  # items per category for the candidate-category feature
BLOCK = 64  # examples drawn together
# Which random stream the settings draw: a run's fingerprint records it (`stream_version`), so a resume
# refuses data that the same settings would now draw differently. Change them with any change to what a seed
# yields: STREAM_VERSION for item spaces up to TABLE_ITEMS (the tables), HASHED_STREAM_VERSION past it.
STREAM_VERSION = 2
HASHED_STREAM_VERSION = 3
TABLE_ITEMS = 2**22  # item spaces up to this draw the world as tables over every item (module docstring)
HEAD_ITEMS = 2**18  # past it: the most drawn items, whose factors and CDF are kept (85% of draws at 126 M)
_CACHED_BLOCKS = 16  # per generator: every shard's stream reads from the few newest blocks
# No reader threads: a block costs ~3 ms of numpy, and grain's 16 default threads cost more than that in
# switching (one pack of the tiny config: 14 ms with them, 5 ms without). The training loop draws the
# next pack while the device runs the step it dispatched.
READ_OPTIONS = grain.ReadOptions(num_threads=0)


def stream_version(config: DataConfig) -> int:
    """The version of the random stream these settings draw (a run's data fingerprint)."""
    return STREAM_VERSION if config.num_items <= TABLE_ITEMS else HASHED_STREAM_VERSION


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _hash_normals(key: np.uint64, index: np.ndarray, r: int) -> np.ndarray:
    """[len(index), r] standard normals (float64), each a function of (key, index, column) alone: the
    SplitMix64 output for its counter, Box-Muller on its two 32-bit halves."""
    counter = index.astype(np.uint64)[:, None] * np.uint64(r) + np.arange(1, r + 1, dtype=np.uint64)
    z = counter * _GOLDEN + key
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    z ^= z >> np.uint64(31)
    u1 = ((z >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32  # (0, 1)
    u2 = (z & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _grouped_order(group: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The order sorting by `group` (< 2**15), then by `key`: np.lexsort's, in a fifth of its time."""
    order = np.argsort(key)
    return order[np.argsort(group.astype(np.int16)[order], kind="stable")]


def _rank_in_group(sizes: np.ndarray) -> np.ndarray:
    """Each element's position inside its group, for consecutive groups of `sizes` elements."""
    return np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


class SyntheticAds:
    """Deterministic generator: `example(i)` depends only on (seed, i), drawn with the other examples of
    its block of `BLOCK` (`block`); thread-safe (grain's prefetch threads share it)."""

    def __init__(self, config: DataConfig, num_tasks: int):
        self.config = config
        self.num_tasks = num_tasks
        world = np.random.default_rng([config.seed, 0x5EED])
        r, n, zipf = config.latent_dim, config.num_items, config.zipf_exponent
        self._keys: np.ndarray | None = None  # the hash keys of the factors (category, own) past TABLE_ITEMS
        if n <= TABLE_ITEMS:  # every item's factor and CDF as tables (stream 2)
            # Items of one category share most of their factor, so what is learnt about one transfers.
            categories = world.normal(0, 1, (n // _CATEGORY_SIZE + 2, r))
            own = world.normal(0, 0.4, (n + 1, r))
            factors = categories[np.arange(n + 1) // _CATEGORY_SIZE] + own
            self.item_factors = (factors / np.linalg.norm(factors, axis=1, keepdims=True)).astype(np.float32)
            ranks = np.arange(1, n + 1, dtype=np.float64)
            p = ranks**-zipf
            self.item_cdf = np.cumsum(p / p.sum())
        else:  # per item (stream 3): the same construction from a hash, the head's factors and CDF kept
            self._keys = world.integers(0, 2**64, 2, dtype=np.uint64, endpoint=False)
            # The table of the most drawn items, 0..HEAD_ITEMS (`factors` hashes the others as they come).
            self.item_factors = self._hashed_factors(np.arange(HEAD_ITEMS + 1))
            p = np.arange(1, HEAD_ITEMS + 1, dtype=np.float64) ** -zipf
            # The tail's mass: the integral of x^-s over [HEAD_ITEMS + 1/2, n + 1/2).
            self._a = 1.0 - zipf  # the integral's exponent (0: logarithm)
            self._c = self._power(HEAD_ITEMS + 0.5)
            self._head_mass = float(p.sum())
            self._total_mass = self._head_mass + (self._power(n + 0.5) - self._c)
            self.item_cdf = np.cumsum(p) / self._total_mass  # the head's: its last entry is below 1
        self.segment_directions = world.normal(0, 1, (_NUM_SEGMENTS, r)).astype(np.float32)
        self.dense_weights = world.normal(0, 1, config.num_dense_features).astype(np.float32)
        self.dense_weights /= max(1.0, np.linalg.norm(self.dense_weights))
        self._lock = threading.Lock()
        self._blocks: dict[int, list[dict[str, Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:  # grain worker processes get a copy without lock or cache
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_blocks")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _blocks={})

    def _power(self, x: float | np.ndarray) -> float | np.ndarray:
        """The integral of t^-s up to x (up to a constant): x^(1-s) / (1-s), or log x when s = 1."""
        return np.log(x) if self._a == 0 else np.power(x, self._a) / self._a

    def _hashed_factors(self, ids: np.ndarray) -> np.ndarray:
        """Items' unit factors from the hash (past TABLE_ITEMS): their category's, plus their own (std 0.4)."""
        r = self.config.latent_dim
        factors = _hash_normals(self._keys[0], ids // _CATEGORY_SIZE, r) + 0.4 * _hash_normals(
            self._keys[1], ids, r
        )
        return (factors / np.linalg.norm(factors, axis=1, keepdims=True)).astype(np.float32)

    def factors(self, ids: np.ndarray) -> np.ndarray:
        """[..., latent_dim] unit factors of the items `ids` (from the table, or for ids past its rows,
        which only a world past TABLE_ITEMS has, from the hash)."""
        if self._keys is None:
            return self.item_factors[ids]
        out = np.empty((*ids.shape, self.config.latent_dim), np.float32)
        head = ids < len(self.item_factors)
        out[head] = self.item_factors[ids[head]]
        out[~head] = self._hashed_factors(ids[~head])
        return out

    def zipf_ids(self, u: np.ndarray) -> np.ndarray:
        """Item ids (int32, 1..num_items, Zipf(zipf_exponent) by rank) of uniforms `u` in [0, 1): the
        inverse of the CDF."""
        n = self.config.num_items
        ids = np.searchsorted(self.item_cdf, u) + 1
        if self._keys is not None:  # past the head: invert the integral of the tail (module docstring)
            tail = u > self.item_cdf[-1]
            w = u[tail] * self._total_mass - self._head_mass  # the tail's mass below each draw
            x = np.exp(self._c + w) if self._a == 0 else np.power(self._a * (self._c + w), 1.0 / self._a)
            ids[tail] = np.clip(np.floor(x + 0.5), HEAD_ITEMS + 1, n)
        return np.minimum(ids, n).astype(np.int32)

    def _zipf_items(self, rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
        return self.zipf_ids(rng.random(shape))

    def example(self, index: int) -> dict[str, Any]:
        """Example `index`, from its block (drawn once, then cached)."""
        number, i = divmod(int(index), BLOCK)
        with self._lock:  # one thread draws a block; the others wait for it instead of drawing it again
            if number not in self._blocks:
                if len(self._blocks) >= _CACHED_BLOCKS:
                    del self._blocks[next(iter(self._blocks))]  # the oldest
                self._blocks[number] = self.block(number)
            return self._blocks[number][i]

    def block(self, block: int) -> list[dict[str, Any]]:
        """Examples `block * BLOCK ..` drawn at once with numpy (one Python loop only to cut them apart):
        per-example draws cost ~0.3 ms of GIL-held Python each, which bounds the input pipeline."""
        c = self.config
        n, r, k = BLOCK, c.latent_dim, c.num_candidates
        rng = np.random.default_rng([c.seed, 2, int(block)])
        taste = rng.normal(0, 1, (n, r)).astype(np.float32)
        taste *= 3.5 / np.linalg.norm(taste, axis=1, keepdims=True)
        empty = rng.random(n) < c.empty_history_fraction
        if c.history_len_distribution == "zipf":
            draw = np.minimum(rng.zipf(c.history_len_zipf_alpha, n), c.max_history_len)
            lengths = np.clip(c.history_len_unit * draw, 1, c.max_history_len)
        else:
            draw = np.round(rng.lognormal(np.log(c.history_len_mean), c.history_len_sigma, n))
            lengths = np.clip(draw, 1, c.max_history_len)
        lengths = np.where(empty, 0, lengths).astype(np.int64)
        # History: popular items tilted towards each user's taste (Gumbel top-k over a Zipf pool).
        pool_sizes = np.maximum(4 * lengths, 1)
        pool_owner = np.repeat(np.arange(n), pool_sizes)
        pool = self._zipf_items(rng, len(pool_owner))
        pool_factors = self.factors(pool)
        affinity = np.einsum("pr,pr->p", pool_factors, taste[pool_owner])
        keys = affinity + rng.gumbel(size=len(pool))
        by_key = _grouped_order(pool_owner, -keys)  # each user's pool, best key first
        rank = _rank_in_group(pool_sizes)
        chosen = by_key[rank < lengths[pool_owner]]
        owner = pool_owner[chosen]  # sorted: each user's chosen items together
        chosen = chosen[_grouped_order(owner, rng.random(len(chosen)))]  # each user's in random order
        history = pool[chosen]
        hist_affinity = np.einsum("tr,tr->t", pool_factors[chosen], taste[owner])
        # Stronger affinity -> deeper action (view < click < cart < purchase).
        noise = rng.normal(0, 0.5, len(history))
        actions = 1 + np.clip((hist_affinity + noise + 1.0).astype(np.int32), 0, c.num_actions - 1)
        # Times: exponential gaps, one more per user than its history (the request comes after it).
        gaps = rng.exponential(3600.0, int(lengths.sum()) + n).astype(np.int64) + 1
        time_ends = np.cumsum(lengths + 1)
        times = np.cumsum(gaps)
        times -= np.repeat(np.concatenate([[0], times[time_ends[:-1] - 1]]), lengths + 1)
        candidates = self._zipf_items(rng, (n, k))
        dense = rng.normal(0, 1, (n, c.num_dense_features)).astype(np.float32)
        cand_affinity = np.einsum("ncr,nr->nc", self.factors(candidates), taste)
        click_logit = 1.6 * cand_affinity + 0.8 * (dense @ self.dense_weights)[:, None] - 0.5
        clicks = rng.random((n, k)) < 1 / (1 + np.exp(-click_logit))
        labels = np.zeros((n, k, self.num_tasks), np.float32)
        labels[..., 0] = clicks
        if self.num_tasks > 1:
            conv_logit = 2.0 * cand_affinity - 1.0
            labels[..., 1] = clicks & (rng.random((n, k)) < 1 / (1 + np.exp(-conv_logit)))
        segment = np.argmax(taste @ self.segment_directions.T, axis=1)
        bag_sizes = rng.integers(1, c.max_bag_size + 1, (n, c.num_sparse_features))
        noise_ids = rng.integers(1, c.sparse_vocab, (n, c.num_sparse_features, c.max_bag_size)).astype(
            np.int32
        )
        if c.num_sparse_features:  # feature 0: the user's segment, then noise ids
            noise_ids[:, 0, 0] = 1 + segment
        category = (1 + _NUM_SEGMENTS + candidates // _CATEGORY_SIZE).astype(np.int32)
        # Each example's tokens: its history, then its candidates (at the request time, action 0).
        sizes = lengths + k
        token_owner = np.repeat(np.arange(n), sizes)
        is_history = _rank_in_group(sizes) < lengths[token_owner]
        is_event = np.ones(len(times), bool)
        is_event[time_ends - 1] = False
        item_ids = np.empty(len(token_owner), np.int32)
        item_ids[is_history] = history
        item_ids[~is_history] = candidates.reshape(-1)
        action_ids = np.zeros(len(token_owner), np.int32)
        action_ids[is_history] = actions
        timestamps = np.empty(len(token_owner), np.int32)
        timestamps[is_history] = times[is_event]
        timestamps[~is_history] = np.repeat(times[time_ends - 1], k)
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        bag_sizes = bag_sizes.tolist()
        examples = []
        for i in range(n):
            tokens = slice(bounds[i], bounds[i + 1])
            examples.append(
                {
                    "item_ids": item_ids[tokens],
                    "action_ids": action_ids[tokens],
                    "timestamps": timestamps[tokens],
                    "num_targets": k,
                    # feature 1: the candidates' categories; the others: noise ids
                    "sparse_ids": [
                        category[i] if f == 1 else noise_ids[i, f, : bag_sizes[i][f]]
                        for f in range(c.num_sparse_features)
                    ],
                    "dense": dense[i],
                    "labels": labels[i],
                    "click_logit": click_logit[i],  # the planted truth, for oracle checks (not batched)
                }
            )
        return examples
