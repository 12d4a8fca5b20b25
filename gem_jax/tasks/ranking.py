"""The ads ranking task: the GEM model, BCE per task on every candidate, AUC and NE.

Data: the synthetic generator (`data.kind = "synthetic"`: planted signal, Zipf ids, log-normal
histories; evaluation on a fixed held-out range of example indices, `EVAL_START`, so the train stream
never contains an eval example) or ranking records from shards (`data.kind = "records"`,
gem_jax/data/records/: train shuffled, validation and test splits of their own), both streamed through
the one packer.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags  # grain's workers read absl flags, which a plain script never parses
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from gem_jax.config import Config, ConfigError
from gem_jax.data.batch import JaggedBatch
from gem_jax.data.pipeline import WorkerBlockExamples, example_range, packed_dataset
from gem_jax.data.records.dataset import READ_OPTIONS, RecordsData
from gem_jax.data.records.reader import COUNTS
from gem_jax.data.synthetic import BLOCK, SyntheticAds
from gem_jax.data.synthetic import READ_OPTIONS as SYNTHETIC_READ_OPTIONS
from gem_jax.embeddings import EmbeddingCollection, FeatureIds
from gem_jax.model.gem import GEMModel, embedding_ids, sparse_feature_groups
from gem_jax.parallel import num_batch_shards
from gem_jax.train import interrupt
from gem_jax.train.flops import nvidia_hstu_flops, train_step_flops
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
        self.records = RecordsData(config) if config.data.kind == "records" else None
        self.generator = (
            None if self.records else SyntheticAds(config.data, num_tasks=len(config.model.tasks))
        )
        self.feature_groups = sparse_feature_groups(config.data)
        self.embeddings = EmbeddingCollection.from_config(config, mesh)
        features = self.embeddings.features
        reads = {
            "items": ("none",),
            "actions": ("none",),
            **dict.fromkeys(self.feature_groups, ("sum", "mean")),
        }
        for name, pooling in reads.items():
            if name not in features or features[name].pooling not in pooling:
                raise ConfigError(
                    f"the ranking model reads embedding feature {name!r} with pooling in {pooling}; "
                    f"`embeddings.features` has { ({n: f.pooling for n, f in features.items()}) }"
                )

    def describe(self) -> str:
        data = f"{self.records.describe()}\n" if self.records else ""
        return (
            data
            + "embedding tables (gem_jax/embeddings: sharded, row-wise sparse updates):\n"
            + (self.embeddings.plan.format())
        )

    # ------------------------------------------------------------------------- model and data

    def build_model(self) -> GEMModel:
        return GEMModel(self.config, rngs=nnx.Rngs(self.config.train.seed))

    def _examples(self, split: str) -> grain.MapDataset | None:
        """A split's examples ("train": endless); None where the records have no such split."""
        if self.records is not None:
            return self.records.examples(split)
        if split == "train":  # a grain worker draws whole blocks (WorkerBlockExamples)
            return WorkerBlockExamples(self.generator.example, BLOCK)
        return example_range(self.generator.example, EVAL_START, self.config.data.eval_examples)

    def _dataset(self, split: str, *, process_index: int, process_count: int) -> grain.IterDataset:
        d, m = self.config.data, self.config.model
        return packed_dataset(
            self._examples(split),
            examples_capacity=d.examples_per_shard,
            tokens_capacity=d.tokens_per_shard,
            num_sparse_features=d.num_sparse_features,
            max_bag_size=d.max_bag_size,
            prefix=m.num_context_tokens,
            shards=self.shards,
            process_index=process_index,
            process_count=process_count,
            stream=self.records.stream if self.records is not None else None,
            read_options=READ_OPTIONS if self.records is not None else SYNTHETIC_READ_OPTIONS,
            balance=d.balance == "attention",
        )

    def train_data(self, process_index: int, process_count: int) -> grain.IterDataset:
        data = self._dataset("train", process_index=process_index, process_count=process_count)
        workers = self.config.data.num_workers
        if workers:
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            data = data.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=workers, per_worker_buffer_size=self.config.data.worker_buffer_size
                ),
                worker_init_fn=interrupt.worker_init,
                # The generator's examples take each worker's slice as whole blocks; records stay strided.
                sequential_slice=self.records is None,
            )
        return data

    def batch_counts(self, stack: JaggedBatch) -> dict[str, float]:
        counts = {
            "examples": float((stack.num_targets > 0).sum()),
            "tokens": float(stack.offsets[:, -1].sum()),
            "flops": train_step_flops(self.config, stack.offsets, stack.num_targets),
        }
        nvidia = nvidia_hstu_flops(self.config, stack.offsets, stack.num_targets)
        if nvidia is not None:  # only where NVIDIA's formula applies (the loop then logs mfu_nvidia)
            counts["flops_nvidia"] = nvidia
        return counts

    # ------------------------------------------------------------------------- loss

    def data_metrics(self, data_state: Any) -> dict[str, float]:
        """Records: bad records skipped, histories and bags cut so far (every process's; a collective,
        so every process calls it at the same steps); TooManyBadRecords past `data.max_bad_records`."""
        if self.records is None:
            return {}
        counts = self.records.counts(data_state)
        local = np.array([counts[k] for k in COUNTS], np.int64)
        total = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(COUNTS)).sum(0)
        metrics = {f"data/{k}": float(v) for k, v in zip(COUNTS, total)}
        self.records.check_cap(metrics["data/skipped_records"])
        return metrics

    def embedding_ids(self, pack: JaggedBatch) -> dict[str, FeatureIds]:
        return embedding_ids(pack, self.feature_groups)

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
        """Per task the validation metrics ("eval"), then the test split's where the run scored one."""
        lines = []
        if best := summary.get("best"):
            value = f"{best['metric']} {best['value']:.4f}"
            lines.append(f"   chosen checkpoint: step {best['step']}, {value} on validation")
        for split in ("eval", "test"):
            lines += [
                f"   {split} {task:<10} AUC {m['auc']:.4f}  NE {m['ne']:.4f}  "
                f"(positives {m['positive_rate']:.3f} of {m['examples']})"
                for task, m in (summary.get(split) or {}).items()
            ]
        return lines


class RankingEvaluator:
    """AUC and NE per task over the whole eval set (every process's examples)."""

    def __init__(self, task: RankingTask, trainer):
        self.task = task
        self.trainer = trainer
        self.predict = trainer.per_pack(lambda model, pack, embedded: jax.nn.sigmoid(model(pack, embedded)))
        # Records without validation shards evaluate nothing; with test shards, the loop scores them once.
        records = task.records
        self.splits = ("valid", "test") if records and records.splits["test"] else ("valid",)

    def __call__(self, state: Any, split: str) -> Metrics:
        if split not in self.splits:
            raise ValueError(f"the ranking task has no {split!r} split")
        c = self.task.config
        if self.task._examples(split) is None:
            return {}
        data = self.task._dataset(split, process_index=jax.process_index(), process_count=jax.process_count())
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
