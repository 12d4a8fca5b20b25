"""Orbax checkpoints: train state, grain iterator position and the loop's progress, async, keep-last-N.

A checkpoint is one orbax step directory holding up to three items: `state` (the sharded train
state), `data` (the grain iterator's state, a small dict) and `progress` (the loop's JSON record:
best validation metric so far, evaluations without improvement, training time spent...). All
three commit together, so a resumed run continues exactly where the saved one was. Each process
saves its own data position (grain); a run resumed on another number of processes merges them
(`merge_process_states`), so a checkpoint written by 2 processes resumes in 1 and back.
"""

from __future__ import annotations

import json
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
        data_dir = self.directory / str(step) / "data"
        own_data = data_dir / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        if data_iterator is not None and own_data.exists():
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        has_progress = (self.directory / str(step) / "progress").exists()
        if has_progress:
            items["progress"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        if data_iterator is not None and not own_data.exists():
            # Written by another number of processes: every process's position, merged.
            files = sorted(data_dir.glob("process_*-of-*.json"))
            if not files:
                raise FileNotFoundError(f"{data_dir}: no data-iterator position saved")
            data_iterator.set_state(merge_process_states([json.loads(f.read_text()) for f in files]))
        return restored["state"], (restored["progress"] if has_progress else None)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def merge_process_states(states: list[Any], path: str = "") -> Any:
    """One data-iterator position from every process's: the union of their keys, where a value two
    processes both hold must agree. Positions that are global (next-item: epoch and step) or keyed by
    global batch shard (ranking: `packing.ShardStacks`) merge; per-worker positions of grain's
    multiprocess prefetch do not (resume with the number of processes that wrote them)."""
    if all(isinstance(s, dict) for s in states):
        keys = dict.fromkeys(k for s in states for k in s)
        return {k: merge_process_states([s[k] for s in states if k in s], f"{path}/{k}") for k in keys}
    if any(s != states[0] for s in states):
        raise ValueError(
            f"data positions of different processes disagree at {path or '/'} ({states[0]!r} vs "
            f"{next(s for s in states if s != states[0])!r}): this checkpoint's data position cannot be "
            "restored on another number of processes"
        )
    return states[0]
