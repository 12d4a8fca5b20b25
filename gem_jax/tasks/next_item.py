"""The next-item (retrieval) task on an interactions file (`data.kind = "interactions"`).

* Data: leave-one-out users (gem_jax/data/next_item.py); one epoch visits every training user
  once; a run is `retrieval.epochs` epochs.
* Losses (`retrieval.loss`): SASRec's BCE with one negative per position (drawn on the host,
  uniformly from items the user never had in training), HSTU's sampled softmax (uniform
  negatives drawn on device, one set per pack shared by its positions, or the pack's own targets),
  or the full softmax over every item (optionally label-smoothed). They score every position with a
  target, or (`retrieval.train_targets = "last_of_prefixes"`) each example's last position only.
  With `retrieval.contrastive_weight` > 0, InfoNCE between the user vectors of two augmented views of
  each example is added with that weight (reported as `contrastive`, the next-item part as
  `next_item_loss`); with `retrieval.intent_weight` > 0, ICLRec's InfoNCE between each view and its
  example's intent centroid (reported as `intent`; the centroids come from k-means over every training
  example, redone at the start of every `retrieval.intent_every_epochs` epochs by `refresh`); with
  `retrieval.frequency_contrastive_weight` > 0, InfoNCE between two views of each example made in the
  frequency domain by the model (reported as `frequency_contrastive`).
* Evaluation after every `retrieval.eval_every_epochs` epochs (and after the last, and when the
  time budget ends the run) on the validation targets: 100 sampled negatives (HR@10, NDCG@10)
  and/or full ranking (HR/NDCG@5/10/20). The test split is scored once, at the end, for the
  checkpoint chosen on validation (`train.select_metric`, default "sampled/NDCG@10").
"""

from __future__ import annotations

import bisect
import functools
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gem_jax.config import Config, ConfigError
from gem_jax.data.next_item import (
    EvalSet,
    NextItemEpochs,
    NextItemPack,
    eval_stacks,
    load_next_item_data,
)
from gem_jax.model.next_item import (
    NextItemModel,
    _l2_normalize,
    bce_loss,
    full_softmax_loss,
    info_nce_loss,
    kmeans,
    nearest_centroid,
    pool_examples,
    sampled_softmax_loss,
)
from gem_jax.parallel import num_batch_shards
from gem_jax.train.retrieval_metrics import (
    RetrievalAccumulator,
    full_ranking_ranks,
    sampled_ranks_from_vectors,
)
from gem_jax.train.task import Metrics

SAMPLED_KS = (10,)
FULL_KS = (5, 10, 20)
EVAL_CHUNK = 2048  # users per jitted sampled-protocol call (padded, so one compilation)
DEFAULT_SELECT_METRIC = "sampled/NDCG@10"


class NextItemTask:
    loss_needs_rng = True  # dropout and the sampled-softmax negatives

    def __init__(self, config: Config, mesh: Mesh):
        self.config = config
        self.mesh = mesh
        self.shards = num_batch_shards(mesh, config.parallel)
        self.select_metric = config.train.select_metric or DEFAULT_SELECT_METRIC
        # The item table stays a dense parameter of the model, trained by the dense optimizer: it is the
        # tied softmax output layer (every loss and evaluation reads rows of it, full ranking reads all
        # of it) and small (10^4-10^5 items), TorchRec's case for a data-parallel table with a dense
        # optimizer. The configs' tuned results (docs/results.md) were made so.
        self.embeddings = None
        self.data = load_next_item_data(config)
        self.num_items = self.data.num_items
        # Epoch structure (same on every process): global steps per epoch, cumulative, grown lazily.
        self._epochs = NextItemEpochs(self.data, config, shards=self.shards)
        self._epoch_ends: list[int] = []
        r = config.retrieval
        self._scored_positions = _last_positions if r.train_targets == "last_of_prefixes" else _all_positions
        if r.intent_weight > 0 and r.intent_clusters > len(self.data.inputs):
            raise ConfigError(
                f"`retrieval.intent_clusters` ({r.intent_clusters}) exceeds the {len(self.data.inputs)} "
                "training examples that k-means clusters"
            )
        self._encode = None  # the intent clustering's jitted encoder (built on first use)

    def describe(self) -> str:
        return (
            f"{self.data.interactions.summary()}\n{self.data.split.summary()}\n{len(self.data.inputs)} training "
            f"examples, {self._epochs.steps_in_epoch(0)} steps per epoch on {self.shards} shard(s)"
        )

    # ------------------------------------------------------------------------- model and data

    def build_model(self) -> NextItemModel:
        return NextItemModel(self.config, self.num_items, rngs=nnx.Rngs(self.config.train.seed))

    def train_data(self, process_index: int, process_count: int) -> grain.IterDataset:
        return NextItemEpochs(
            self.data,
            self.config,
            shards=self.shards,
            process_index=process_index,
            process_count=process_count,
        )

    def batch_counts(self, stack: NextItemPack) -> dict[str, float]:
        return {
            "examples": float((np.diff(stack.offsets, axis=-1) > 0).sum()),
            "tokens": float(stack.offsets[:, -1].sum()),
        }

    def data_metrics(self, data_state: Any) -> dict[str, float]:
        return {}  # an epoch reads every user of an in-memory file: nothing is skipped or cut

    # ------------------------------------------------------------------------- loss

    def embedding_ids(self, pack: NextItemPack) -> dict[str, Any]:
        return {}  # no sparse tables: the item table is a dense parameter of the model (see __init__)

    def pack_loss(
        self, model: NextItemModel, pack: NextItemPack, embedded: dict[str, jax.Array], rng: jax.Array | None
    ) -> dict[str, jax.Array]:
        dropout_key, negative_key = jax.random.split(rng)
        user = model(pack.item_ids, pack.offsets, rng=dropout_key)
        with jax.named_scope("loss"):
            sums = self._loss_sums(model, *self._scored_positions(pack, user), negative_key)
        r, b = self.config.retrieval, pack.num_examples_capacity
        valid = _nonempty(pack.offsets)
        if r.frequency_contrastive_weight > 0:
            with jax.named_scope("frequency_contrastive"):
                view_rng = jax.random.fold_in(rng, 3) if r.contrastive_dropout else None
                vectors = model.spectral_views(
                    pack.item_ids,
                    pack.offsets,
                    r.contrastive_pooling,
                    key=jax.random.fold_in(rng, 2),
                    rng=view_rng,
                )
                total, count = info_nce_loss(vectors[:b], vectors[b:], valid, r.contrastive_temperature)
            sums = {**sums, "frequency_contrastive_sum": total, "frequency_contrastive_count": count}
        if pack.views is None:
            return sums
        views = pack.views
        view_rng = jax.random.fold_in(rng, 1) if r.contrastive_dropout else None
        vectors = model.sequence_vectors(views.item_ids, views.offsets, r.contrastive_pooling, rng=view_rng)
        if r.contrastive_weight > 0:
            with jax.named_scope("contrastive"):
                total, count = info_nce_loss(vectors[:b], vectors[b:], valid, r.contrastive_temperature)
            sums = {**sums, "contrastive_sum": total, "contrastive_count": count}
        if r.intent_weight > 0:
            with jax.named_scope("intent"):
                # ICLRec: the example's intent is the centroid nearest to its representation in the
                # training forward (dropout on), without gradient; the loss reads the normalised centroid.
                centroids = jax.lax.stop_gradient(model.intent_centroids[...])
                sequence = pool_examples(
                    jax.lax.stop_gradient(user), pack.offsets, r.contrastive_pooling, r.normalize
                )
                intent = nearest_centroid(sequence, centroids)
                target = _l2_normalize(centroids)[intent]
                groups = intent if r.intent_denoise else None
                parts = [
                    info_nce_loss(view, target, valid, r.contrastive_temperature, groups)
                    for view in (vectors[:b], vectors[b:])
                ]
            sums = {
                **sums,
                "intent_sum": parts[0][0] + parts[1][0],
                "intent_count": parts[0][1] + parts[1][1],
            }
        return sums

    def _loss_sums(self, model, user, targets, negatives, negative_key) -> dict[str, jax.Array]:
        r = self.config.retrieval
        table = model.item_table()
        if r.loss == "bce":
            total, count = bce_loss(user, table, targets, negatives)
        elif r.loss == "full_softmax":
            total, count = full_softmax_loss(user, table, targets, r.temperature, r.label_smoothing)
        else:
            if r.negatives == "in_batch":
                negatives = targets
            else:
                # One draw per pack, shared by its positions: a [T, d] x [d, K] matmul instead of a
                # [T, K, d] gather, so K can be large (HSTU draws per position; same estimator family).
                negatives = jax.random.randint(negative_key, (r.num_negatives,), 1, self.num_items + 1)
            total, count = sampled_softmax_loss(user, table, targets, negatives, r.temperature)
        return {"loss_sum": total, "count": count}

    def loss(self, sums: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        r = self.config.retrieval
        loss = sums["loss_sum"] / jnp.maximum(sums["count"], 1.0)
        weights = (
            ("contrastive", r.contrastive_weight),
            ("intent", r.intent_weight),
            ("frequency_contrastive", r.frequency_contrastive_weight),
        )
        if not any(f"{name}_sum" in sums for name, _ in weights):
            return loss, {"positions": sums["count"]}
        total, aux = loss, {"positions": sums["count"], "next_item_loss": loss}
        for name, weight in weights:
            if f"{name}_sum" in sums:
                aux[name] = sums[f"{name}_sum"] / jnp.maximum(sums[f"{name}_count"], 1.0)
                total = total + weight * aux[name]
        return total, aux

    # ------------------------------------------------------------------------- intent clustering

    def refresh(self, trainer, state: Any, step: int) -> Any:
        """Called by the loop before every step: at the start of every `retrieval.intent_every_epochs`
        epochs (step 0 included) the intent centroids in `state` are recomputed from its parameters (so a
        run resumed mid-epoch keeps the checkpoint's, and one resumed at an epoch end recomputes the same
        ones). Other steps, and runs without the intent loss: `state` as it is."""
        r = self.config.retrieval
        if r.intent_weight == 0 or (step and self.epoch_end(step) is None):
            return state
        epoch = self.position(step)["epoch"]
        if epoch % r.intent_every_epochs or epoch >= self.epochs:
            return state
        centroids = self.intent_centroids(trainer, state, epoch)
        params = dict(state.params)
        params["intent_centroids"] = jax.device_put(
            centroids.astype(params["intent_centroids"].dtype),
            trainer.state_shardings.params["intent_centroids"],
        )
        return state.replace(params=params)

    def intent_centroids(self, trainer, state: Any, epoch: int) -> jax.Array:
        """k-means centroids of every training example's representation (no dropout), as ICLRec's
        clustering pass before each epoch."""
        r = self.config.retrieval
        if self._encode is None:
            self._encode = trainer.per_pack(
                lambda model, pack, embedded: model.sequence_vectors(
                    pack.item_ids, pack.offsets, r.contrastive_pooling
                )
            )
        examples = EvalSet(self.data.inputs, np.zeros(0), np.zeros((0, 0)), None)
        vectors = encode_examples(self._encode, trainer, state, examples, self.config, self.shards)
        key = jax.random.fold_in(jax.random.key(self.config.train.seed), epoch)
        return _kmeans(jnp.asarray(vectors), key, r.intent_clusters, r.intent_kmeans_iterations)

    # ------------------------------------------------------------------------- schedule

    def _ends_through(self, step: int) -> None:
        while (not self._epoch_ends or self._epoch_ends[-1] < step) and len(self._epoch_ends) < self.epochs:
            previous = self._epoch_ends[-1] if self._epoch_ends else 0
            self._epoch_ends.append(previous + self._epochs.steps_in_epoch(len(self._epoch_ends)))

    @property
    def epochs(self) -> int:
        return self.config.retrieval.epochs

    def epoch_end(self, step: int) -> int | None:
        """The epoch (1-based count of epochs done) that `step` completes, or None mid-epoch."""
        self._ends_through(step)
        i = bisect.bisect_left(self._epoch_ends, step)
        return i + 1 if i < len(self._epoch_ends) and self._epoch_ends[i] == step else None

    def total_steps(self) -> int:
        self._ends_through(2**62)
        return self._epoch_ends[-1]

    def schedule_steps(self) -> int:
        # Steps of the first epoch x epochs (epochs differ by a step or so as their orders differ).
        return self._epochs.steps_in_epoch(0) * self.epochs

    def is_boundary(self, step: int) -> bool:
        return self.epoch_end(step) is not None

    def eval_due(self, step: int) -> bool:
        epoch = self.epoch_end(step)
        return epoch is not None and (
            epoch % self.config.retrieval.eval_every_epochs == 0 or epoch == self.epochs
        )

    def position(self, step: int) -> dict[str, Any]:
        self._ends_through(step)
        return {"epoch": bisect.bisect_right(self._epoch_ends, step)}

    # ------------------------------------------------------------------------- evaluation

    def evaluator(self, trainer) -> NextItemEvaluator:
        return NextItemEvaluator(self, trainer)

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        lines = []
        best = summary.get("best") or {}
        if best:
            lines.append(
                f"   chosen checkpoint: step {best['step']} (epoch {best.get('epoch')}), {best['metric']} "
                f"{best['value']:.4f} on validation"
            )
        for split in ("test",):
            metrics = summary.get(split) or {}
            if metrics:
                shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "users")
                lines.append(f"   {split}: {shown}")
        return lines


def _all_positions(pack: NextItemPack, user: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(user vectors, targets, BCE negatives) of every token; tokens without a target have target 0."""
    return user, pack.targets, pack.negatives


def _last_positions(pack: NextItemPack, user: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same at each example's last token only (target 0 for an empty example): [B, ...] instead of
    [T, ...], so the full softmax scores B rows, not T."""
    last = jnp.clip(pack.offsets[1:] - 1, 0, user.shape[0] - 1)
    targets = jnp.where(_nonempty(pack.offsets), pack.targets[last], 0)
    return user[last], targets, pack.negatives[last]


def encode_examples(
    encode: Any, trainer: Any, state: Any, examples: EvalSet, config: Config, shards: int
) -> np.ndarray:
    """One vector per example of `examples`, in its order: `encode` (a `Trainer.per_pack` function of
    the state and a device stack) over the packed stacks of this process's share."""
    vectors = []
    for stack, chunk in eval_stacks(
        examples,
        config,
        shards=shards,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    ):
        out = np.asarray(encode(state, trainer.to_device(stack)))  # [shards, B, d]
        vectors.extend(out[i, : b - a] for i, (a, b) in enumerate(chunk))
    return np.concatenate(vectors)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _kmeans(x: jax.Array, key: jax.Array, k: int, iterations: int) -> jax.Array:
    return kmeans(x, k, iterations, key)


def _nonempty(offsets: jax.Array) -> jax.Array:
    return offsets[1:] > offsets[:-1]


class NextItemEvaluator:
    """HR/NDCG of one split under the configured protocols, keys like "sampled/NDCG@10"."""

    splits = ("valid", "test")

    def __init__(self, task: NextItemTask, trainer):
        self.task = task
        self.trainer = trainer
        self.user_vectors = trainer.per_pack(
            lambda model, pack, embedded: model.last_vectors(pack.item_ids, pack.offsets)
        )
        self.item_table = trainer.model_fn(lambda model: model.item_table())

    def __call__(self, state: Any, split: str) -> Metrics:
        task, r = self.task, self.task.config.retrieval
        eval_set = task.data.eval_sets[split]
        users = encode_examples(self.user_vectors, self.trainer, state, eval_set, task.config, task.shards)
        table = self.item_table(state)
        results: dict[str, float] = {}
        if r.eval_protocol in ("sampled", "both"):
            acc = RetrievalAccumulator(SAMPLED_KS)
            n = len(users)
            for a in range(0, n, EVAL_CHUNK):
                b = min(a + EVAL_CHUNK, n)
                pad = EVAL_CHUNK - (b - a)
                ranks = sampled_ranks_from_vectors(
                    jnp.asarray(np.pad(users[a:b], ((0, pad), (0, 0)))),
                    table,
                    jnp.asarray(np.pad(eval_set.targets[a:b], (0, pad), constant_values=1)),
                    jnp.asarray(np.pad(eval_set.negatives[a:b], ((0, pad), (0, 0)), constant_values=1)),
                )
                acc.update(ranks, np.arange(EVAL_CHUNK) < b - a)
            results.update({f"sampled/{k}": v for k, v in acc.compute().items()})
        if r.eval_protocol in ("full", "both"):
            # "full/": as configured; with exclude_history, "full_incl_history/" also keeps the user's
            # items and "full_zeroed/" scores them 0 (the published baselines' code: see full_ranking_ranks).
            variants = {"full": (eval_set.exclude, False)}
            if eval_set.exclude is not None:
                variants["full_incl_history"] = (None, False)
                variants["full_zeroed"] = (eval_set.exclude, True)
            for prefix, (exclude, zero_excluded) in variants.items():
                ranks = full_ranking_ranks(
                    jnp.asarray(users),
                    table,
                    jnp.asarray(eval_set.targets),
                    None if exclude is None else jnp.asarray(exclude),
                    zero_excluded=zero_excluded,
                )
                acc = RetrievalAccumulator(FULL_KS)
                acc.update(ranks)
                results.update({f"{prefix}/{k}": v for k, v in acc.compute().items()})
        results["users"] = len(users)
        return results
