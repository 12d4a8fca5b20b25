"""Tasks the one training loop runs: model + data + loss + evaluation (see gem_jax/train/task.py)."""

from __future__ import annotations

from jax.sharding import Mesh

from gem_jax.config import Config
from gem_jax.parallel import make_mesh
from gem_jax.tasks.next_item import NextItemTask
from gem_jax.tasks.ranking import RankingTask
from gem_jax.train.task import Task

# `data.kind` -> the task that trains on that data.
TASKS = {"synthetic": RankingTask, "records": RankingTask, "interactions": NextItemTask}


def make_task(config: Config, mesh: Mesh | None = None) -> Task:
    """The task for `config.data.kind` on `mesh` (default: the config's mesh over all devices)."""
    return TASKS[config.data.kind](config, mesh if mesh is not None else make_mesh(config.parallel))


__all__ = ["TASKS", "NextItemTask", "RankingTask", "make_task"]
