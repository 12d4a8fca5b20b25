"""The Task protocol: what the one training loop needs to know about a task, and nothing more.

A task (gem_jax/tasks/) owns its model, its data, its loss and its evaluation. The loop
(gem_jax/train/loop.py) owns everything that is the same for every task: the sharded train state
and step (gem_jax/train/step.py), checkpoints and resumption, the NaN stop, signals, the time
budget, evaluation points, best-checkpoint selection and early stopping, metrics and progress.

Batches flow one way: `train_data` (a checkpointable grain dataset of numpy stacks, one pack per
local data-parallel shard) -> `Trainer.to_device` -> the step, which looks up `embedding_ids` in
the sparse tables, sums `pack_loss` over every pack of the global batch and hands the sums to `loss`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import grain
import jax
from flax import nnx
from jax.sharding import Mesh

from gem_jax.config import Config

Metrics = dict[str, Any]  # nested dicts of floats, e.g. {"click": {"auc": 0.7}} or {"full/HR@10": 0.1}


@runtime_checkable
class Task(Protocol):
    """One kind of training run. Implementations: RankingTask, NextItemTask (gem_jax/tasks/)."""

    config: Config
    mesh: Mesh  # the device mesh the task's batches are laid out for
    shards: int  # packs per global batch (the product of the shard mesh axes)
    # The validation metric that picks the best checkpoint (flattened name, e.g. "full/NDCG@10" or
    # "click/auc"); None keeps no best checkpoint and never stops early.
    select_metric: str | None
    # Whether the dropout/sampling key is passed to `pack_loss` (None otherwise: no randomness).
    loss_needs_rng: bool
    # The sparse embedding tables the step looks up outside the model (gem_jax.embeddings
    # EmbeddingCollection), or None when the model owns all its parameters.
    embeddings: Any

    def build_model(self) -> nnx.Module:
        """The NNX model, initialised from `config.train.seed`."""
        ...

    def describe(self) -> str:
        """A few lines about the data for the log ("" for nothing)."""
        ...

    def train_data(self, process_index: int, process_count: int) -> grain.IterDataset:
        """This process's training stacks: `shards // process_count` packs each, numpy leaves."""
        ...

    def embedding_ids(self, pack: Any) -> dict[str, Any]:
        """The ids one pack looks up in `embeddings`: feature name -> gem_jax.embeddings.FeatureIds."""
        ...

    def pack_loss(
        self, model: nnx.Module, pack: Any, embedded: dict[str, jax.Array], rng: jax.Array | None
    ) -> dict[str, jax.Array]:
        """Sums over one pack (so packs and shards add up exactly), e.g. loss sum and count.
        `embedded`: the pack's looked-up embeddings, feature name -> activations."""
        ...

    def loss(self, sums: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, logged auxiliaries) from the sums over the whole global batch."""
        ...

    def total_steps(self) -> int:
        """How many global steps a complete run trains."""
        ...

    def schedule_steps(self) -> int:
        """Length of the learning-rate schedule."""
        ...

    def is_boundary(self, step: int) -> bool:
        """Whether the time budget may end the run after this step (e.g. epoch ends only)."""
        ...

    def eval_due(self, step: int) -> bool:
        """Whether to evaluate on the validation split after this step."""
        ...

    def position(self, step: int) -> dict[str, Any]:
        """Task-specific position after `step` for records and summaries, e.g. {"epoch": 3}."""
        ...

    def batch_counts(self, stack: Any) -> dict[str, float]:
        """This process's "examples", "tokens" and (if the task has a FLOP model) "flops" in a stack; other
        FLOP counts of the same step as "flops_NAME" (the log reports each as tflops_per_device_NAME and
        mfu_NAME)."""
        ...

    def data_metrics(self, data_state: Any) -> dict[str, float]:
        """Counters of what the input pipeline left out or cut so far (e.g. bad records skipped), from
        the train data iterator's state, for the log records ({} for none). Called at every logged step
        by every process (it may run a collective); raises to stop the run (too many bad records)."""
        ...

    def evaluator(self, trainer: Any) -> Evaluator:
        """Builds (and compiles lazily) the evaluation functions with the trainer's helpers
        (`per_pack`, `model_fn`, `to_device`; a gem_jax.train.step.Trainer, which imports this
        module, hence `Any`)."""
        ...

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """What the CLI prints about a finished or interrupted run, beyond the common lines."""
        ...

    # Optional (not part of the runtime check): `refresh(trainer, state, step) -> state`, called before
    # every step, for state the task derives from the parameters at some steps (the next-item task's
    # intent centroids, at epoch starts). It must depend only on `state` and `step`, so that a resumed run
    # recomputes what the interrupted one did.


@runtime_checkable
class Evaluator(Protocol):
    splits: tuple[str, ...]  # e.g. ("valid",) or ("valid", "test"); "test" is scored once, at the end

    def __call__(self, state: Any, split: str) -> Metrics:
        """Metrics of the train state (gem_jax.train.step.TrainState) on one split."""
        ...


def flatten(metrics: Metrics, prefix: str = "") -> dict[str, Any]:
    """{"click": {"auc": x}} -> {"click/auc": x}."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Metric names (last part of a flattened name) where lower is better; every other one is better higher.
LOWER_IS_BETTER = ("ne", "loss")


def higher_is_better(metric: str) -> bool:
    return metric.rsplit("/", 1)[-1] not in LOWER_IS_BETTER
