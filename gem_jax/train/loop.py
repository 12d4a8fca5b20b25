"""The training and evaluation loops behind `python -m experiments train|eval`.

A run directory holds `config.toml` (resolved), `checkpoints/` (orbax), `metrics.jsonl` (one JSON
object per logged step or eval) and, when tensorboardX is installed, TensorBoard event files.
Re-running on an existing directory resumes from the latest checkpoint (state, step, RNG and the
data iterator's position). SIGINT/SIGTERM save a checkpoint before exit; a NaN/Inf loss or
parameter norm stops the run without saving, so the last good checkpoint survives.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from gem_jax.config import Config, config_to_toml
from gem_jax.data.batch import JaggedBatch
from gem_jax.data.pipeline import packed_dataset
from gem_jax.data.synthetic import SyntheticAds
from gem_jax.parallel import make_mesh, num_batch_shards
from gem_jax.train import retrieval
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.flops import device_peak_flops, train_step_flops
from gem_jax.train.metrics import auc, normalized_entropy
from gem_jax.train.step import Trainer

EVAL_START = 10**12  # eval examples are indexed far from the (streaming) train examples


class TrainingDiverged(RuntimeError):
    """The loss or parameters became NaN/Inf; the run stopped without saving."""


# ----------------------------------------------------------------------------- data


def _datasets(config: Config, local_shards: int):
    d, m = config.data, config.model
    generator = SyntheticAds(d, num_tasks=len(m.tasks))
    common = dict(
        examples_capacity=d.examples_per_shard,
        tokens_capacity=d.tokens_per_shard,
        num_sparse_features=d.num_sparse_features,
        max_bag_size=d.max_bag_size,
        prefix=m.num_context_tokens,
        shards_per_step=local_shards,
    )
    train = packed_dataset(generator.example, num_examples=None, start=0, **common)
    if d.num_workers:
        from absl import flags  # grain's workers read absl flags, which a plain script never parses

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        train = train.mp_prefetch(grain.MultiprocessingOptions(num_workers=d.num_workers))
    evaluation = packed_dataset(generator.example, num_examples=d.eval_examples, start=EVAL_START, **common)
    return train, evaluation


def _pad_stack(stack: JaggedBatch, shards: int) -> JaggedBatch:
    """Pads a short last stack (end of the eval set) with empty packs."""
    have = stack.num_targets.shape[0]
    if have == shards:
        return stack

    def pad(x):
        empty = np.zeros((shards - have, *x.shape[1:]), x.dtype)
        return np.concatenate([x, empty])

    padded = jax.tree.map(pad, stack)
    # Empty packs: all offsets equal 0 (zeros already), no targets (zeros already).
    return padded


def _to_global(stack: JaggedBatch, sharding) -> JaggedBatch:
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), stack)


# ----------------------------------------------------------------------------- logging


class MetricsWriter:
    """metrics.jsonl (always) and TensorBoard events (if tensorboardX is installed); process 0 only."""

    def __init__(self, workdir: Path):
        self.enabled = jax.process_index() == 0
        self.file = open(workdir / "metrics.jsonl", "a") if self.enabled else None
        self.tb = None
        if self.enabled:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(workdir / "tensorboard"))
            except ImportError:
                pass

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record["step"]
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps (so it can checkpoint)."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # second signal: give up at once
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------- evaluation


def evaluate(
    trainer: Trainer, params, eval_batches: Iterator[JaggedBatch], local_shards: int, max_batches: int = 0
) -> dict[str, dict[str, float]]:
    """AUC and NE per task over the eval set (all processes' examples)."""
    probabilities, labels, masks = [], [], []
    for i, stack in enumerate(eval_batches):
        if max_batches and i >= max_batches:
            break
        batch = _to_global(_pad_stack(stack, local_shards), trainer.batch_sharding)
        p = trainer.predict(params, batch)
        probabilities.append(np.asarray(multihost_utils.process_allgather(p, tiled=True)))
        labels.append(np.asarray(multihost_utils.process_allgather(batch.labels, tiled=True)))
        masks.append(np.asarray(multihost_utils.process_allgather(batch.num_targets > 0, tiled=True)))
    p = np.concatenate([x.reshape(-1, *x.shape[-2:]) for x in probabilities])  # [N, C, K]
    y = np.concatenate([x.reshape(-1, *x.shape[-2:]) for x in labels])
    mask = np.concatenate([x.reshape(-1) for x in masks])
    p, y = p[mask], y[mask]
    results = {}
    for k, task in enumerate(trainer.config.model.tasks):
        results[task] = {
            "auc": auc(y[..., k], p[..., k]),
            "ne": normalized_entropy(y[..., k], p[..., k]),
            "positive_rate": float(y[..., k].mean()),
            "examples": int(y[..., k].size),
        }
    return results


# ----------------------------------------------------------------------------- training


def _check_finite(metrics: dict[str, Any], step: int, checkpointer: Checkpointer) -> dict[str, float]:
    values = {k: float(v) for k, v in metrics.items()}
    if not (math.isfinite(values["loss"]) and math.isfinite(values["param_norm"])):
        checkpointer.wait()
        raise TrainingDiverged(
            f"loss = {values['loss']}, param norm = {values['param_norm']} at step {step}: stopping "
            f"without saving; the last good checkpoint is step {checkpointer.latest_step()}"
        )
    return values


def train(config: Config, workdir: str | Path, *, stop_after: int | None = None) -> dict[str, Any]:
    """Trains (or resumes) in `workdir` until `config.train.steps`; returns the final summary.

    `stop_after` ends this invocation (with a checkpoint) after that global step, as a preemption
    would; re-running resumes.
    """
    if config.data.kind == "interactions":
        return retrieval.train(config, workdir, stop_after=stop_after)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tc = config.train
    if jax.process_index() == 0:
        (workdir / "config.toml").write_text(config_to_toml(config))
    mesh = make_mesh(config.parallel)
    trainer = Trainer(config, mesh)
    shards = num_batch_shards(mesh, config.parallel)
    if shards % jax.process_count():
        raise ValueError(f"{shards} batch shards do not split over {jax.process_count()} processes")
    local_shards = shards // jax.process_count()
    train_data, eval_data = _datasets(config, local_shards)
    train_iter = iter(train_data)
    checkpointer = Checkpointer(workdir / "checkpoints", tc)
    latest = checkpointer.latest_step()
    if latest is not None:
        state = checkpointer.restore(latest, trainer.abstract_state, trainer.state_shardings, train_iter)
        print(f"resumed from step {latest} in {workdir}", file=sys.stderr)
    else:
        state = trainer.init_state()
    start = int(state.step)
    writer = MetricsWriter(workdir)
    peak = device_peak_flops(jax.devices()[0].device_kind)
    last_step = min(tc.steps, stop_after) if stop_after else tc.steps
    interval = {"examples": 0.0, "tokens": 0.0, "flops": 0.0, "steps": 0}
    previous: tuple[int, dict] | None = None
    t_interval = time.perf_counter()
    t_start = time.perf_counter()
    last_values: dict[str, float] = {}
    eval_results = None
    progress = None
    if tc.progress and jax.process_index() == 0:
        from tqdm import tqdm

        progress = tqdm(total=tc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    try:
        with _StopRequest() as stop:
            step = start
            while step < last_step and stop.signal is None:
                stack = next(train_iter)
                interval["examples"] += float((stack.num_targets > 0).sum()) * jax.process_count()
                interval["tokens"] += float(stack.offsets[:, -1].sum()) * jax.process_count()
                interval["flops"] += (
                    train_step_flops(config, stack.offsets, stack.num_targets) * jax.process_count()
                )
                interval["steps"] += 1
                state, metrics = trainer.train_step(state, _to_global(stack, trainer.batch_sharding))
                step += 1
                # Check the previous step's metrics while this one runs (one step of overlap).
                if previous is not None:
                    last_values = _check_finite(previous[1], previous[0], checkpointer)
                previous = (step, metrics)
                log_now = step % tc.log_every == 0 or step == last_step
                save_now = tc.checkpoint_every and step % tc.checkpoint_every == 0
                if log_now or save_now:
                    last_values = _check_finite(metrics, step, checkpointer)
                    previous = None
                if log_now:
                    elapsed = time.perf_counter() - t_interval
                    record = {
                        "step": step,
                        **last_values,
                        "examples_per_s": interval["examples"] / elapsed,
                        "tokens_per_s": interval["tokens"] / elapsed,
                        "step_time_s": elapsed / interval["steps"],
                        "tflops_per_device": interval["flops"] / elapsed / jax.device_count() / 1e12,
                    }
                    record["mfu"] = (record["tflops_per_device"] * 1e12 / peak) if peak else None
                    writer.write(record)
                    if progress is not None:
                        progress.set_postfix(
                            loss=f"{last_values['loss']:.4f}",
                            ex_s=f"{record['examples_per_s']:.0f}",
                            refresh=False,
                        )
                    interval = {"examples": 0.0, "tokens": 0.0, "flops": 0.0, "steps": 0}
                    t_interval = time.perf_counter()
                if save_now:
                    checkpointer.save(step, state, train_iter)
                if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
                    results = evaluate(trainer, state.params, iter(eval_data), local_shards, tc.eval_batches)
                    writer.write({"step": step, "eval": results})
                if progress is not None:
                    progress.update(1)
            if previous is not None:
                last_values = _check_finite(previous[1], previous[0], checkpointer)
            if checkpointer.latest_step() != step and step > start:
                checkpointer.save(step, state, train_iter)
            interrupted = stop.signal is not None
        if step >= tc.steps and not interrupted:
            eval_results = evaluate(trainer, state.params, iter(eval_data), local_shards, tc.eval_batches)
            writer.write({"step": step, "eval": eval_results})
    finally:
        if progress is not None:
            progress.close()
        checkpointer.wait()
        checkpointer.close()
        writer.close()
    return {
        "workdir": str(workdir),
        "step": step,
        "steps": tc.steps,
        "interrupted": interrupted,
        "wall_time_s": time.perf_counter() - t_start,
        "final": last_values,
        "eval": eval_results,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
    }


def evaluate_checkpoint(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Evaluates the latest checkpoint in `workdir` (used by `python -m experiments eval`)."""
    if config.data.kind == "interactions":
        return retrieval.evaluate_checkpoint(config, workdir)
    workdir = Path(workdir)
    mesh = make_mesh(config.parallel)
    trainer = Trainer(config, mesh)
    local_shards = num_batch_shards(mesh, config.parallel) // jax.process_count()
    checkpointer = Checkpointer(workdir / "checkpoints", config.train)
    step = checkpointer.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {workdir / 'checkpoints'}")
    state = checkpointer.restore(step, trainer.abstract_state, trainer.state_shardings, None)
    checkpointer.close()
    _, eval_data = _datasets(config, local_shards)
    results = evaluate(trainer, state.params, iter(eval_data), local_shards, config.train.eval_batches)
    return {"workdir": str(workdir), "step": step, "eval": results}
