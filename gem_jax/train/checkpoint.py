"""Orbax checkpoints: train state, grain iterator position and the loop's progress, async, keep-last-N.

A checkpoint is one orbax step directory holding up to three items: `state` (the sharded train
state), `data` (the grain iterator's state, a small dict) and `progress` (the loop's JSON record:
best validation metric so far, evaluations without improvement, training time spent...). All
three commit together, so a resumed run continues exactly where the saved one was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from gem_jax.config import TrainConfig


class Checkpointer:
    def __init__(self, directory: Path, config: TrainConfig, *, keep: int | None = None):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep is not None else config.keep_checkpoints,
            enable_async_checkpointing=config.async_checkpointing,
            create=True,
        )
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(
        self,
        step: int,
        state,
        data_iterator: grain.DatasetIterator | None = None,
        progress: dict[str, Any] | None = None,
    ) -> None:
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        if progress is not None:
            items["progress"] = ocp.args.JsonSave(progress)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(
        self, step: int, abstract_state, shardings, data_iterator: grain.DatasetIterator | None = None
    ) -> tuple[Any, dict[str, Any] | None]:
        """(state on `shardings`, progress or None); restores the iterator position in place if given."""
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
        )
        items = {"state": ocp.args.StandardRestore(target)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        has_progress = (self.directory / str(step) / "progress").exists()
        if has_progress:
            items["progress"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], (restored["progress"] if has_progress else None)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
