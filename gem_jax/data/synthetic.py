"""A synthetic ads task with a planted, learnable signal.

The world (fixed by the seed): every item has a latent factor; items are Zipf-popular. Each user
has a latent taste vector. The user's history is drawn from popular items tilted towards the
user's taste, so the history reveals the taste; one sparse feature carries a coarse user segment
(so users with empty histories are not pure noise), another the candidate's category. A click is
Bernoulli(sigmoid(taste . item factor + dense signal)); a conversion needs a click and a second,
related draw. A model that learns shows it in AUC; one that does not stays near 0.5.
History lengths are log-normal or Zipf (heavy-tailed), with a fraction of empty histories.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gem_jax.config import DataConfig

_NUM_SEGMENTS = 16
_CATEGORY_SIZE = 16  # items per category for the candidate-category feature


class SyntheticAds:
    """Deterministic generator: `example(i)` depends only on (seed, i)."""

    def __init__(self, config: DataConfig, num_tasks: int):
        self.config = config
        self.num_tasks = num_tasks
        world = np.random.default_rng([config.seed, 0x5EED])
        r = config.latent_dim
        # Items of one category share most of their factor, so what is learnt about one transfers.
        categories = world.normal(0, 1, (config.num_items // _CATEGORY_SIZE + 2, r))
        own = world.normal(0, 0.4, (config.num_items + 1, r))
        factors = categories[np.arange(config.num_items + 1) // _CATEGORY_SIZE] + own
        self.item_factors = (factors / np.linalg.norm(factors, axis=1, keepdims=True)).astype(np.float32)
        ranks = np.arange(1, config.num_items + 1, dtype=np.float64)
        p = ranks**-config.zipf_exponent
        self.item_cdf = np.cumsum(p / p.sum())
        self.segment_directions = world.normal(0, 1, (_NUM_SEGMENTS, r)).astype(np.float32)
        self.dense_weights = world.normal(0, 1, config.num_dense_features).astype(np.float32)
        self.dense_weights /= max(1.0, np.linalg.norm(self.dense_weights))

    def _zipf_items(self, rng: np.random.Generator, n: int) -> np.ndarray:
        ids = np.searchsorted(self.item_cdf, rng.random(n)) + 1
        return np.minimum(ids, self.config.num_items).astype(np.int32)

    def example(self, index: int) -> dict[str, Any]:
        c = self.config
        rng = np.random.default_rng([c.seed, 1, int(index)])
        taste = rng.normal(0, 1, c.latent_dim).astype(np.float32)
        taste *= 3.5 / np.linalg.norm(taste)
        if rng.random() < c.empty_history_fraction:
            length = 0
        elif c.history_len_distribution == "zipf":
            draw = min(int(rng.zipf(c.history_len_zipf_alpha)), c.max_history_len)  # (the draw is unbounded)
            length = int(np.clip(c.history_len_unit * draw, 1, c.max_history_len))
        else:
            length = int(
                np.clip(
                    np.round(rng.lognormal(np.log(c.history_len_mean), c.history_len_sigma)),
                    1,
                    c.max_history_len,
                )
            )
        # History: popular items tilted towards the user's taste (Gumbel top-k over a Zipf pool).
        pool = self._zipf_items(rng, max(4 * length, 1))
        affinity = self.item_factors[pool] @ taste
        keys = affinity + rng.gumbel(size=len(pool))
        history = pool[np.argsort(-keys)[:length]]
        rng.shuffle(history)
        hist_affinity = self.item_factors[history] @ taste
        # Stronger affinity -> deeper action (view < click < cart < purchase).
        actions = 1 + np.clip(
            (hist_affinity + rng.normal(0, 0.5, length) + 1.0).astype(np.int32), 0, c.num_actions - 1
        )
        gaps = rng.exponential(3600.0, length + 1).astype(np.int64) + 1
        times = np.cumsum(gaps)
        request_time = int(times[-1])
        candidates = self._zipf_items(rng, c.num_candidates)
        dense = rng.normal(0, 1, c.num_dense_features).astype(np.float32)
        cand_affinity = self.item_factors[candidates] @ taste
        dense_signal = float(dense @ self.dense_weights)
        click_logit = 1.6 * cand_affinity + 0.8 * dense_signal - 0.5
        clicks = rng.random(c.num_candidates) < 1 / (1 + np.exp(-click_logit))
        labels = np.zeros((c.num_candidates, self.num_tasks), np.float32)
        labels[:, 0] = clicks
        if self.num_tasks > 1:
            conv_logit = 2.0 * cand_affinity - 1.0
            labels[:, 1] = clicks & (rng.random(c.num_candidates) < 1 / (1 + np.exp(-conv_logit)))
        segment = int(np.argmax(self.segment_directions @ taste))
        sparse_ids = []
        for f in range(c.num_sparse_features):
            size = int(rng.integers(1, c.max_bag_size + 1))
            if f == 0:  # user segment, plus noise ids
                bag = np.concatenate([[1 + segment], rng.integers(1, c.sparse_vocab, size - 1)])
            elif f == 1:  # candidate category
                bag = 1 + _NUM_SEGMENTS + candidates // _CATEGORY_SIZE
            else:  # pure noise
                bag = rng.integers(1, c.sparse_vocab, size)
            sparse_ids.append(np.asarray(bag, np.int32))
        return {
            "item_ids": np.concatenate([history, candidates]).astype(np.int32),
            "action_ids": np.concatenate([actions, np.zeros(c.num_candidates)]).astype(np.int32),
            "timestamps": np.concatenate([times[:-1], np.full(c.num_candidates, request_time)]).astype(
                np.int32
            ),
            "num_targets": c.num_candidates,
            "sparse_ids": sparse_ids,
            "dense": dense,
            "labels": labels,
            "click_logit": click_logit,  # the planted truth, for oracle checks (not batched)
        }
