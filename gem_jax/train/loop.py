"""The one training loop behind `python -m experiments train|eval`, for any Task.

A run directory holds `config.toml` (resolved), `checkpoints/` (orbax: train state, data-iterator
position and the loop's progress), `best/` (the checkpoint chosen on validation, when the task has
a selection metric), `metrics.jsonl` (one JSON object per logged step or evaluation),
`test.json` (tasks with a test split: scored once, for the chosen checkpoint) and, when
tensorboardX is installed, TensorBoard event files.

What the loop does for every task: resume from the latest checkpoint (state, step, RNG, data
position, best-so-far, time spent) at any step; stop on NaN/Inf without saving (the last good
checkpoint survives); turn SIGINT/SIGTERM into a checkpoint and a clean exit; evaluate where the
task says (`eval_due`), keep the best checkpoint and stop early after `train.patience` evaluations
without improvement; stop at the first task boundary past `train.max_minutes` (with a last
evaluation); log throughput, MFU and norms; show a progress bar.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax

from gem_jax.config import config_to_toml
from gem_jax.distributed import process_zero_says
from gem_jax.parallel import describe_mesh
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.flops import device_peak_flops
from gem_jax.train.profiling import TraceWindow
from gem_jax.train.step import Trainer
from gem_jax.train.task import Task, flatten, higher_is_better


class TrainingDiverged(RuntimeError):
    """The loss or parameters became NaN/Inf; the run stopped without saving."""


# ----------------------------------------------------------------------------- records


class MetricsWriter:
    """metrics.jsonl (always) and TensorBoard events (if tensorboardX is installed); process 0 only."""

    def __init__(self, workdir: Path):
        self.enabled = jax.process_index() == 0
        self.file = open(workdir / "metrics.jsonl", "a") if self.enabled else None  # noqa: SIM115 (closed in close())
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
            for key, value in flatten(record).items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Writes atomically (a crash leaves the old file or the new one, never half of one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


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


# ----------------------------------------------------------------------------- progress


@dataclasses.dataclass
class Progress:
    """The loop's own state, saved in every checkpoint beside the train state."""

    best_step: int | None = None
    best_value: float | None = None
    best_position: dict[str, Any] = dataclasses.field(default_factory=dict)
    bad_evals: int = 0  # evaluations since the best one
    stopped: str | None = None  # "patience" | "time": the run ended before its last step
    train_time_s: float = 0.0  # wall time of training so far, over every invocation (the time budget)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Progress:
        return cls(**d) if d else cls()

    def improves(self, value: float, metric: str) -> bool:
        """Strictly better than the best so far (ties keep the earlier checkpoint)."""
        if self.best_value is None:
            return True
        return value > self.best_value if higher_is_better(metric) else value < self.best_value


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


class _Throughput:
    """Examples, tokens and FLOPs since the last log line (all processes)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts: dict[str, float] = {}
        self.steps = 0
        self.t0 = time.perf_counter()

    def add(self, counts: dict[str, float]) -> None:
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + v * jax.process_count()
        self.steps += 1

    def record(self, peak: float | None) -> dict[str, float | None]:
        elapsed = time.perf_counter() - self.t0
        out: dict[str, float | None] = {
            f"{k}_per_s": v / elapsed for k, v in self.counts.items() if k != "flops"
        }
        out["step_time_s"] = elapsed / max(self.steps, 1)
        if "flops" in self.counts:
            tflops = self.counts["flops"] / elapsed / jax.device_count() / 1e12
            out["tflops_per_device"] = tflops
            out["mfu"] = tflops * 1e12 / peak if peak else None
        return out


def train(
    task: Task,
    workdir: str | Path,
    *,
    stop_after: int | None = None,
    profile_steps: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) `task` in `workdir` until its last step or an early stop; returns a summary.

    `stop_after` ends this invocation (with a checkpoint) after that global step, as a preemption
    would; re-running resumes. `profile_steps=(A, B)` traces global steps A..B-1 into
    `workdir/profile` (gem_jax/train/profiling.py).
    """
    t_start = time.perf_counter()
    config, tc = task.config, task.config.train
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (workdir / "config.toml").write_text(config_to_toml(config))
        print(describe_mesh(task.mesh, config.parallel), file=sys.stderr)
    if task.describe():
        print(task.describe(), file=sys.stderr)
    trainer = Trainer(task, task.mesh)
    evaluate = task.evaluator(trainer)
    data_iter = iter(task.train_data(jax.process_index(), jax.process_count()))
    checkpoints = Checkpointer(workdir / "checkpoints", tc)
    best = Checkpointer(workdir / "best", tc, keep=1) if task.select_metric else None
    latest = checkpoints.latest_step()
    if latest is not None:
        state, saved = checkpoints.restore(latest, *trainer.saved_target, data_iter)
        state = trainer.from_saved_form(state)
        progress = Progress.from_dict(saved)
        print(f"resumed from step {latest} {_where(task, latest)}in {workdir}", file=sys.stderr)
    else:
        state, progress = trainer.init_state(), Progress()
    step = start = int(state.step)
    total = task.total_steps()
    writer = MetricsWriter(workdir)
    peak = device_peak_flops(jax.devices()[0].device_kind)
    throughput = _Throughput()
    t_train = time.perf_counter() - progress.train_time_s  # the time budget spans resumptions
    last_values: dict[str, float] = {}
    last_eval: dict[str, Any] | None = None
    saved_step = latest
    bar = None
    window = TraceWindow(profile_steps, workdir / "profile")
    if tc.progress and jax.process_index() == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def save() -> None:
        nonlocal saved_step
        progress.train_time_s = time.perf_counter() - t_train
        checkpoints.save(step, trainer.saved_form(state), data_iter, dataclasses.asdict(progress))
        saved_step = step

    try:
        with _StopRequest() as stop:
            previous: tuple[int, dict] | None = None  # metrics checked one step late (overlap)
            while step < total and progress.stopped is None and stop.signal is None:
                if stop_after is not None and step >= stop_after:
                    break
                window.before(step)
                with jax.profiler.TraceAnnotation("data"):  # host-side labels in traces
                    stack = next(data_iter)
                throughput.add(task.batch_counts(stack))
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    state, metrics = trainer.train_step(state, trainer.to_device(stack))
                step += 1
                window.after(step, metrics)
                if previous is not None:
                    last_values = _check_finite(previous[1], previous[0], checkpoints)
                previous = (step, metrics)
                log_now = step % tc.log_every == 0 or step == total
                out_of_time = (
                    bool(tc.max_minutes)
                    and task.is_boundary(step)
                    and process_zero_says(time.perf_counter() - t_train >= 60 * tc.max_minutes)
                )
                eval_now = task.eval_due(step) or out_of_time
                save_now = bool(tc.checkpoint_every and step % tc.checkpoint_every == 0) or eval_now
                if log_now or save_now:
                    last_values = _check_finite(metrics, step, checkpoints)
                    previous = None
                if log_now:
                    record = {"step": step, **task.position(step), **last_values, **throughput.record(peak)}
                    writer.write(record)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{last_values['loss']:.4f}",
                            ex_s=f"{record.get('examples_per_s', 0):.0f}",
                            refresh=False,
                        )
                    throughput.reset()
                if eval_now:
                    with jax.profiler.TraceAnnotation("evaluation"):
                        last_eval = _evaluate(
                            task, evaluate, trainer, state, step, progress, best, writer, last_values, t_start
                        )
                    if out_of_time and progress.stopped is None:
                        progress.stopped = "time"
                        print(
                            f"stopping: train.max_minutes={tc.max_minutes} spent at step {step}",
                            file=sys.stderr,
                        )
                if save_now:
                    save()
                if bar is not None:
                    bar.update(1)
            if previous is not None:
                last_values = _check_finite(previous[1], previous[0], checkpoints)
            if saved_step != step and step > start:
                save()
            signalled = stop.signal is not None
        finished = progress.stopped is not None or step >= total
        test = (
            _score_test(task, evaluate, trainer, best, checkpoints, progress, workdir, writer)
            if finished
            else None
        )
    finally:
        window.close()
        if bar is not None:
            bar.close()
        checkpoints.wait()
        checkpoints.close()
        if best is not None:
            best.wait()
            best.close()
        writer.close()
    return {
        "workdir": str(workdir),
        "step": step,
        "steps": total,
        **task.position(step),
        "interrupted": not finished,
        "signalled": signalled,
        "stopped_early": progress.stopped == "patience",
        "out_of_time": progress.stopped == "time",
        "best": _best(task, progress),
        "best_step": progress.best_step,
        "best_epoch": progress.best_position.get("epoch"),
        "eval": last_eval,
        "test": test,
        "final": last_values,
        "wall_time_s": time.perf_counter() - t_start,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
    }


def _where(task: Task, step: int) -> str:
    position = task.position(step)
    return "".join(f"({k} {v}) " for k, v in position.items())


def _best(task: Task, progress: Progress) -> dict[str, Any] | None:
    if progress.best_step is None:
        return None
    return {
        "step": progress.best_step,
        "metric": task.select_metric,
        "value": progress.best_value,
        **progress.best_position,
    }


def _evaluate(
    task, evaluate, trainer, state, step, progress, best, writer, last_values, t_start
) -> dict[str, Any]:
    """Validation metrics after `step`; keeps the best checkpoint and counts towards patience."""
    t_eval = time.perf_counter()
    valid = evaluate(state, "valid")
    improved = False
    if task.select_metric is not None:
        value = flatten(valid)[task.select_metric]
        improved = progress.improves(value, task.select_metric)
        if improved:
            if step not in best.all_steps():  # a replay after a crash may reach a saved best step again
                best.save(step, trainer.saved_form(state))
            progress.best_step, progress.best_value = step, value
            progress.best_position = task.position(step)
            progress.bad_evals = 0
        else:
            progress.bad_evals += 1
            patience = task.config.train.patience
            if patience and progress.bad_evals >= patience:
                progress.stopped = "patience"
    writer.write(
        {
            "step": step,
            **task.position(step),
            "split": "valid",
            "valid": valid,
            "best_step": progress.best_step,
            "eval_time_s": time.perf_counter() - t_eval,
            "elapsed_s": time.perf_counter() - t_start,
        }
    )
    shown = "  ".join(f"{k} {v:.4f}" for k, v in flatten(valid).items() if isinstance(v, float))
    loss = f"loss {last_values['loss']:.4f} " if "loss" in last_values else ""
    print(f"step {step} {_where(task, step)}{loss}valid {shown}{' *' if improved else ''}", file=sys.stderr)
    if progress.stopped == "patience":
        print(
            f"stopping: {progress.bad_evals} evaluations without a better {task.select_metric}",
            file=sys.stderr,
        )
    return valid


def _score_test(
    task, evaluate, trainer, best, checkpoints, progress, workdir, writer
) -> dict[str, Any] | None:
    """The test split, scored once per run for the chosen checkpoint; later calls read test.json."""
    if "test" not in evaluate.splits:
        return None
    path = workdir / "test.json"
    recorded = read_json(path)
    if recorded is None:
        source = best if best is not None and progress.best_step is not None else checkpoints
        step = progress.best_step if source is best else source.latest_step()
        source.wait()
        state, _ = source.restore(step, *trainer.saved_target)
        state = trainer.from_saved_form(state)
        recorded = {
            "step": step,
            **task.position(step),
            "valid": evaluate(state, "valid"),
            "test": evaluate(state, "test"),
        }
        if jax.process_index() == 0:
            write_json(path, recorded)
        writer.write({"split": "test", **recorded})
    return recorded["test"]


def evaluate_run(task: Task, workdir: str | Path) -> dict[str, Any]:
    """Validation metrics of a run's chosen checkpoint (else its latest), and the recorded test
    metrics (`python -m experiments eval`; the test split is never scored again here)."""
    workdir = Path(workdir)
    trainer = Trainer(task, task.mesh)
    for sub in ("best", "checkpoints"):
        checkpoints = Checkpointer(workdir / sub, task.config.train)
        step = checkpoints.latest_step()
        if step is not None:
            break
        checkpoints.close()
    else:
        raise FileNotFoundError(f"no checkpoint in {workdir / 'best'} or {workdir / 'checkpoints'}")
    state, _ = checkpoints.restore(step, *trainer.saved_target)
    state = trainer.from_saved_form(state)
    checkpoints.close()
    recorded = read_json(workdir / "test.json")
    return {
        "workdir": str(workdir),
        "step": step,
        **task.position(step),
        "checkpoint": sub,
        "eval": task.evaluator(trainer)(state, "valid"),
        "test": None if recorded is None else recorded["test"],
    }
