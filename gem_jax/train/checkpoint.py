"""Orbax checkpoints of the train state and the grain iterator position, async, keep-last-N."""

from __future__ import annotations

from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp

from gem_jax.config import TrainConfig


class Checkpointer:
    def __init__(self, directory: Path, config: TrainConfig):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_checkpoints,
            enable_async_checkpointing=config.async_checkpointing,
            create=True,
        )
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_iterator: grain.DatasetIterator | None) -> None:
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state, shardings, data_iterator: grain.DatasetIterator | None):
        """Restores the state onto `shardings` and, if given, the iterator position in place."""
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
        )
        items = {"state": ocp.args.StandardRestore(target)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
