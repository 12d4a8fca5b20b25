"""The synthetic ads ranking task: the GEM model, BCE per task on every candidate, AUC and NE.

Data: `SyntheticAds` examples (planted signal, Zipf ids, log-normal histories) streamed through the
one packer; evaluation uses a fixed held-out range of example indices (`EVAL_START`), so the train
stream never contains an eval example.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from gem_jax.config import Config, ConfigError
from gem_jax.data.batch import JaggedBatch
from gem_jax.data.pipeline import example_range, packed_dataset
from gem_jax.data.synthetic import SyntheticAds
from gem_jax.embeddings import EmbeddingCollection, FeatureIds
from gem_jax.model.gem import GEMModel, embedding_ids
from gem_jax.parallel import num_batch_shards
from gem_jax.train import interrupt
from gem_jax.train.flops import train_step_flops
from gem_jax.train.metrics import auc, normalized_entropy
from gem_jax.train.task import Metrics

EVAL_START = 10**12  # eval examples are indexed far from the (streaming) train examples


class RankingTask:
    loss_needs_rng: bool

    def __init__(self, config: Config, mesh: Mesh):
        self.config = config
        self.mesh = mesh
        self.shards = num_batch_shards(mesh, config.parallel)
        self.select_metric = config.train.select_metric or None
        self.loss_needs_rng = config.model.dropout > 0
        self.generator = SyntheticAds(config.data, num_tasks=len(config.model.tasks))
        self.embeddings = EmbeddingCollection.from_config(config, mesh)
        features = self.embeddings.features
        for name, pooling in (("items", ("none",)), ("actions", ("none",)), ("sparse", ("sum", "mean"))):
            if name not in features or features[name].pooling not in pooling:
                raise ConfigError(
                    f"the ranking model reads embedding feature {name!r} with pooling in {pooling}; "
                    f"`embeddings.features` has { ({n: f.pooling for n, f in features.items()}) }"
                )

    def describe(self) -> str:
        return "embedding tables (gem_jax/embeddings: sharded, row-wise sparse updates):\n" + (
            self.embeddings.plan.format()
        )

    # ------------------------------------------------------------------------- model and data

    def build_model(self) -> GEMModel:
        return GEMModel(self.config, rngs=nnx.Rngs(self.config.train.seed))

    def _dataset(self, *, num_examples: int | None, start: int, process_index: int, process_count: int):
        d, m = self.config.data, self.config.model
        return packed_dataset(
            example_range(self.generator.example, start, num_examples),
            examples_capacity=d.examples_per_shard,
            tokens_capacity=d.tokens_per_shard,
            num_sparse_features=d.num_sparse_features,
            max_bag_size=d.max_bag_size,
            prefix=m.num_context_tokens,
            shards=self.shards,
            process_index=process_index,
            process_count=process_count,
        )

    def train_data(self, process_index: int, process_count: int) -> grain.IterDataset:
        data = self._dataset(
            num_examples=None, start=0, process_index=process_index, process_count=process_count
        )
        workers = self.config.data.num_workers
        if workers:
            from absl import flags  # grain's workers read absl flags, which a plain script never parses

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            data = data.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=workers), worker_init_fn=interrupt.worker_init
            )
        return data

    def batch_counts(self, stack: JaggedBatch) -> dict[str, float]:
        return {
            "examples": float((stack.num_targets > 0).sum()),
            "tokens": float(stack.offsets[:, -1].sum()),
            "flops": train_step_flops(self.config, stack.offsets, stack.num_targets),
        }

    # ------------------------------------------------------------------------- loss

    def embedding_ids(self, pack: JaggedBatch) -> dict[str, FeatureIds]:
        return embedding_ids(pack, self.config.data.num_sparse_features)

    def pack_loss(
        self, model: GEMModel, pack: JaggedBatch, embedded: dict[str, jax.Array], rng: jax.Array | None
    ) -> dict[str, jax.Array]:
        logits = model(pack, embedded, rng=rng)  # [B, C, K]
        with jax.named_scope("loss"):
            weight = pack.example_mask[:, None, None].astype(jnp.float32)
            bce = optax.sigmoid_binary_cross_entropy(logits, pack.labels) * weight
            count = jnp.broadcast_to(weight, bce.shape)
            return {"bce_sum": bce.sum((0, 1)), "count": count.sum((0, 1))}

    def loss(self, sums: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        per_task = sums["bce_sum"] / jnp.maximum(sums["count"], 1.0)
        return per_task.sum(), {f"loss_{t}": per_task[i] for i, t in enumerate(self.config.model.tasks)}

    # ------------------------------------------------------------------------- schedule

    def total_steps(self) -> int:
        return self.config.train.steps

    def schedule_steps(self) -> int:
        return self.config.train.steps

    def is_boundary(self, step: int) -> bool:
        return True

    def eval_due(self, step: int) -> bool:
        every = self.config.train.eval_every
        return step == self.total_steps() or bool(every and step % every == 0)

    def position(self, step: int) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------------- evaluation

    def evaluator(self, trainer) -> RankingEvaluator:
        return RankingEvaluator(self, trainer)

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        return [
            f"   eval {task:<10} AUC {m['auc']:.4f}  NE {m['ne']:.4f}  "
            f"(positives {m['positive_rate']:.3f} of {m['examples']})"
            for task, m in (summary.get("eval") or {}).items()
        ]


class RankingEvaluator:
    """AUC and NE per task over the whole eval set (every process's examples)."""

    splits = ("valid",)

    def __init__(self, task: RankingTask, trainer):
        self.task = task
        self.trainer = trainer
        self.predict = trainer.per_pack(lambda model, pack, embedded: jax.nn.sigmoid(model(pack, embedded)))

    def __call__(self, state: Any, split: str) -> Metrics:
        if split != "valid":
            raise ValueError(f"the ranking task has no {split!r} split")
        c = self.task.config
        data = self.task._dataset(
            num_examples=c.data.eval_examples,
            start=EVAL_START,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        probabilities, labels, masks = [], [], []
        for i, stack in enumerate(data):
            if c.train.eval_batches and i >= c.train.eval_batches:
                break
            batch = self.trainer.to_device(stack)
            p = self.predict(state, batch)
            probabilities.append(np.asarray(multihost_utils.process_allgather(p, tiled=True)))
            labels.append(np.asarray(multihost_utils.process_allgather(batch.labels, tiled=True)))
            masks.append(np.asarray(multihost_utils.process_allgather(batch.num_targets > 0, tiled=True)))
        p = np.concatenate([x.reshape(-1, *x.shape[-2:]) for x in probabilities])  # [N, C, K]
        y = np.concatenate([x.reshape(-1, *x.shape[-2:]) for x in labels])
        mask = np.concatenate([x.reshape(-1) for x in masks])
        p, y = p[mask], y[mask]
        return {
            task: {
                "auc": auc(y[..., k], p[..., k]),
                "ne": normalized_entropy(y[..., k], p[..., k]),
                "positive_rate": float(y[..., k].mean()),
                "examples": int(y[..., k].size),
            }
            for k, task in enumerate(c.model.tasks)
        }
