"""The one training loop behind `python -m experiments train|eval`, for any Task.

A run directory holds the run record (`config.toml`, `run.json`, `resumes.jsonl`: see
gem_jax/train/run_record.py), `checkpoints/` (orbax: train state, data-iterator position and the
loop's progress, each step with a checksum manifest), `best/` (the checkpoint chosen on validation,
when the task has a selection metric), `metrics.jsonl` (one JSON object per logged step or
evaluation), `test.json` (tasks with a test split: scored once, for the chosen checkpoint), when
tensorboardX is installed `tensorboard/`, and `.lock` (the workdir lock; gem_jax/train/workdir_lock.py).

What the loop does for every task: refuse a re-run whose config or data differ from the run record,
and a second trainer on the same workdir, before writing anything; resume from the newest intact
checkpoint (state, step, RNG, data position, best-so-far, time spent) at any step, dropping the
metrics records past it; stop on NaN/Inf without saving (the last intact checkpoint survives); turn
SIGINT/SIGTERM into a checkpoint and a clean exit (gem_jax/train/interrupt.py); evaluate where the
task says (`eval_due`), keep the best checkpoint and stop early after `train.patience` evaluations
without improvement; stop at the first task boundary past `train.max_minutes` (with a last
evaluation); log throughput, MFU and norms; show a progress bar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from gem_jax.distributed import agree, wait_for_all
from gem_jax.kernels import kernel_lines
from gem_jax.model import fp8_auto
from gem_jax.parallel import describe_mesh
from gem_jax.train import compile_cache, files, interrupt, memory, step_cache, watchdog
from gem_jax.train.checkpoint import Checkpointer, NoIntactCheckpoint
from gem_jax.train.flops import device_peak_flops
from gem_jax.train.profiling import TraceWindow
from gem_jax.train.run_record import RunRecord, data_fingerprint
from gem_jax.train.run_status import STATUS
from gem_jax.train.step import Trainer
from gem_jax.train.task import Task, flatten, higher_is_better
from gem_jax.train.workdir_lock import WorkdirError, WorkdirLock, check_usable


class TrainingDiverged(RuntimeError):
    """The loss or parameters became NaN/Inf; the run stopped without saving."""


# ----------------------------------------------------------------------------- records


class MetricsWriter:
    """metrics.jsonl (always) and TensorBoard events (if tensorboardX is installed); process 0 only.

    A run resumed from step S first drops the records past S (written after the checkpoint it resumes
    from, and about to be written again): metrics.jsonl is rewritten atomically without them, and
    TensorBoard is told to hide events from step S + 1 on (`purge_step`).
    """

    def __init__(self, workdir: Path, resume_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.file = None
        self.tb = None
        if not self.enabled:
            return
        self.path = workdir / "metrics.jsonl"
        drop_records_after(self.path, resume_step)
        with files.writing(self.path):
            self.file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        try:
            from tensorboardX import SummaryWriter  # optional dependency: the tensorboard extra

            with files.writing(workdir / "tensorboard"):
                self.tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=resume_step + 1)
        except ImportError:
            pass

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with files.writing(self.path):  # a full disk: one line naming the file (files.WriteFailed)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb is not None:
            step = record["step"]
            for key, value in flatten(record).items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.file:
            with contextlib.suppress(OSError):  # every line was flushed already (or its failure raised)
                self.file.close()
        if self.tb is not None:
            # TensorBoard's events are a view of metrics.jsonl: a full disk while flushing them must
            # not hide the failure that stopped the run (raised already, from the record itself).
            with contextlib.suppress(OSError):
                self.tb.close()


def drop_records_after(path: Path, step: int) -> None:
    """Rewrites metrics.jsonl (atomically) without records past `step` and without a line cut by a crash."""
    if not path.exists():
        return
    text = path.read_text()
    lines = text.splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    if len(kept) != len(lines) or (text and not text.endswith("\n")):
        files.write_text(path, "".join(line + "\n" for line in kept))


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
        try:  # name only a checkpoint that passes its integrity check now
            good = checkpointer.newest_intact(move_aside=False)
        except NoIntactCheckpoint:
            good = None
        last = "there is no intact checkpoint" if good is None else f"the last good checkpoint is step {good}"
        raise TrainingDiverged(
            f"loss = {values['loss']}, param norm = {values['param_norm']} at step {step}: stopping "
            f"without saving; {last}"
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
            f"{k}_per_s": v / elapsed for k, v in self.counts.items() if not k.startswith("flops")
        }
        out["step_time_s"] = elapsed / max(self.steps, 1)
        # "flops" (our count) -> tflops_per_device, mfu; "flops_nvidia" -> tflops_per_device_nvidia, mfu_nvidia
        for key, flops in self.counts.items():
            if key.startswith("flops"):
                suffix = key.removeprefix("flops")
                tflops = flops / elapsed / jax.device_count() / 1e12
                out[f"tflops_per_device{suffix}"] = tflops
                out[f"mfu{suffix}"] = tflops * 1e12 / peak if peak else None
        return out


def train(
    task: Task,
    workdir: str | Path,
    *,
    stop_after: int | None = None,
    profile_steps: tuple[int, int] | None = None,
    restart: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) `task` in `workdir` until its last step or an early stop; returns a summary.

    `stop_after` ends this invocation (with a checkpoint) after that global step, as a preemption
    would; re-running resumes. `profile_steps=(A, B)` traces global steps A..B-1 into
    `workdir/profile` (gem_jax/train/profiling.py). `restart`: this invocation is a supervisor's
    relaunch (gem_jax/train/supervisor.py), recorded in resumes.jsonl. Raises WorkdirError (the
    workdir is unusable, locked by another trainer, holds a run with other settings, or no intact
    checkpoint) before writing anything, and files.WriteFailed when the disk refuses a write.
    """
    workdir = Path(workdir)
    check_usable(workdir)
    record = RunRecord(workdir)
    fingerprint = data_fingerprint(task.config)
    record.check(task.config, fingerprint)  # reads only: a refused re-run leaves the workdir as it was
    lock = WorkdirLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
    with interrupt.INTERRUPTS.handling() as interrupts, lock:
        plan = record.check(task.config, fingerprint)  # again: no other trainer can write now
        checkpoints = Checkpointer(workdir / "checkpoints", task.config.train)  # removes unfinished saves
        STATUS.training(checkpoints.directory)  # for reports of stops from outside the loop
        best = Checkpointer(workdir / "best", task.config.train, keep=1) if task.select_metric else None
        try:
            latest = checkpoints.newest_intact()
            if best is not None:
                best.newest_intact(required=False)
            t_start = time.perf_counter()
            trainer = Trainer(task, task.mesh)  # builds the model: "auto" FP8 layers decide here
            if jax.process_index() == 0:
                # A new "auto" run records the layers its model chose (a resume's config holds them already).
                config = fp8_auto.recorded_choice(task.config, trainer.fp8_decisions)
                record.write(plan, config, fingerprint, resumed_from=latest, restart=restart)
            return _train(
                task,
                trainer,
                workdir,
                checkpoints,
                best,
                latest,
                interrupts,
                stop_after,
                profile_steps,
                t_start,
                fingerprint,
            )
        finally:
            checkpoints.close()
            if best is not None:
                best.close()


def _train(
    task,
    trainer,
    workdir,
    checkpoints,
    best,
    latest,
    interrupts,
    stop_after,
    profile_steps,
    t_start,
    fingerprint,
) -> dict[str, Any]:
    tc = task.config.train
    if jax.process_index() == 0:
        _line(describe_mesh(task.mesh, task.config.parallel))
        if task.config.precision.fp8 == "auto":
            _line(fp8_auto.describe(task.config.precision, trainer.fp8_decisions))
    total = task.total_steps()
    with interrupt.blocked():  # grain worker processes start in here: Ctrl-C must not reach them
        data_iter = iter(task.train_data(jax.process_index(), jax.process_count()))
        # A batch's shapes for the memory plan, made before anything is allocated; a fresh run trains on it
        # first, a resumed one draws its next batch from the restored position.
        probe = next(data_iter)
        # The step compiled by an earlier run from the same inputs, found without tracing it
        # (gem_jax/train/step_cache.py); else the memory plan traces it, and it is compiled below.
        steps_folder = step_cache.folder_of(compile_cache.resolve(tc.compilation_cache))
        key = None
        cached = None
        if steps_folder is not None:
            capacity = memory.device_capacity(task.config)
            key = step_cache.step_key(task, trainer, probe, fingerprint, capacity)
            cached = step_cache.load(steps_folder, key, _line)
        if cached is not None:
            trainer = _replan(task, trainer, None, cached.table_budget)
            if not step_cache.matches(cached, trainer.abstract_sharded_state):
                _line(f"train step: the cached executable {cached.path} takes another state; compiling it")
                cached = None
        if cached is not None:
            planned, table_budget = cached.planned, cached.table_budget
        else:
            trainer, planned, table_budget = _fit_memory(task, trainer, probe)
        if task.describe():
            _line(task.describe())
        if jax.process_index() == 0:
            _line(planned.line())
        evaluate = task.evaluator(trainer)
        if latest is not None:
            state, saved = checkpoints.restore(latest, *trainer.saved_target, data_iter)
            state = trainer.from_saved_form(state)
            progress = Progress.from_dict(saved)
            _line(f"resumed from step {latest} {_where(task, latest)}in {workdir}")
        else:
            state, progress = trainer.init_state(), Progress()
        step = start = int(state.step)
        already_finished = progress.stopped is not None or step >= total
        will_train = not already_finished and (stop_after is None or step < stop_after)
        first = (probe if latest is None else next(data_iter)) if will_train else None
        probe_shapes = _shapes(probe)
        del probe
    writer = MetricsWriter(workdir, resume_step=start)
    peak = device_peak_flops(jax.devices()[0].device_kind)
    throughput = _Throughput()
    t_train = time.perf_counter() - progress.train_time_s  # the time budget spans resumptions
    last_values: dict[str, float] = {}
    last_eval: dict[str, Any] | None = None
    saved_step = latest
    bar = None
    window = TraceWindow(profile_steps, workdir / "profile")
    if tc.progress and jax.process_index() == 0 and will_train:
        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
    say = _message_printer(bar)
    startup: dict[str, Any] = {}
    if will_train and jax.process_index() == 0:
        for line in kernel_lines(task.config):
            say(line)

    def save() -> None:
        nonlocal saved_step
        progress.train_time_s = time.perf_counter() - t_train
        checkpoints.save(step, trainer.saved_form(state), data_iter, dataclasses.asdict(progress))
        saved_step = step

    try:
        # Until this invocation's first step is done (compiled) there is nothing to save, and a signal
        # ends the process at once; from then on it asks for a checkpoint (gem_jax/train/interrupt.py).
        with contextlib.ExitStack() as protect:
            previous: tuple[int, dict] | None = None  # metrics checked one step late (overlap)
            # Multi-process runs stop on a signal only when all processes agree to (`agree` below):
            # a process that left the loop alone would wait in the checkpoint save's collectives
            # while the others wait for it in the next step's. One process reads its own flag.
            multi = jax.process_count() > 1
            agreed_signal = False

            def signal_pending() -> bool:
                return agreed_signal if multi else interrupts.requested is not None

            stall = protect.enter_context(
                watchdog.Watchdog(
                    tc.first_step_timeout_s,
                    tc.stall_timeout_s,
                    watchdog.exit_stalled(
                        workdir, jax.process_index(), start, tc.first_step_timeout_s, tc.stall_timeout_s
                    ),
                )
            )

            compiled, compiled_for = None, None
            refresh = getattr(task, "refresh", None)  # optional: `Task` documents it
            if first is not None:
                # Compiled ahead (or loaded from the persistent cache: gem_jax/train/compile_cache.py),
                # timed, and XLA's memory figure checked before the first step allocates anything.
                if cached is not None and _shapes(first) == probe_shapes:
                    compiled, lowered_s = cached.compiled, 0.0
                    compile_report = compile_cache.CompileReport(
                        cached.seconds, True, False, 0.0, steps_folder, untraced=cached.path
                    )
                else:
                    t_lower = time.perf_counter()
                    lowered = trainer.lower_step(state, first)
                    lowered_s = time.perf_counter() - t_lower
                    compiled, compile_report = compile_cache.compile_timed(lowered)
                compiled_for = _shapes(first)
                planned = dataclasses.replace(planned, compiled=memory.compiled_bytes(compiled))
                if cached is None and key is not None:
                    step_cache.save(steps_folder, key, compiled, planned, table_budget, say)
                if jax.process_index() == 0:
                    say(
                        compile_report.line("train step", lowered_s)
                        + (
                            f"; XLA: {memory.size_text(planned.compiled)} per device"
                            if planned.compiled
                            else ""
                        )
                    )
                if tc.check_memory:
                    memory.check(planned)
                startup = {
                    "step_compile_s": compile_report.seconds,
                    "step_compile_cached": compile_report.from_cache,
                    "step_traced": compile_report.untraced is None,
                    "step_lower_s": lowered_s,
                    "startup_s": time.perf_counter() - t_start,
                }
            if multi and first is not None:
                # Compiled first, then meet: the first step's collectives then start together. A process
                # that compiled longer (a restart, a loaded host) would otherwise reach them more than
                # gloo's 30 s after the others (gem_jax/distributed.py: wait_for_all).
                wait_for_all(f"gem_jax/first_step/{step}", tc.first_step_timeout_s)
            while step < total and progress.stopped is None and not signal_pending():
                if stop_after is not None and step >= stop_after:
                    break
                window.before(step)
                if refresh is not None:  # task state computed from the parameters (e.g. intent centroids)
                    with stall.paused():
                        state = refresh(trainer, state, step)
                if first is not None:  # fetched before the loop (gem_jax/train/interrupt.py: blocked())
                    stack, first = first, None
                else:
                    with jax.profiler.TraceAnnotation("data"):  # host-side labels in traces
                        stack = next(data_iter)
                throughput.add(task.batch_counts(stack))
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    same = compiled is not None and _shapes(stack) == compiled_for
                    state, metrics = trainer.step(state, stack, compiled if same else None)
                step += 1
                stall.beat(step)
                STATUS.at_step(step)
                if step == start + 1:
                    protect.enter_context(interrupts.saving())
                checkpoints.poll()
                window.after(step, metrics)
                if previous is not None:
                    last_values = _check_finite(previous[1], previous[0], checkpoints)
                previous = (step, metrics)
                log_now = step % tc.log_every == 0 or step == total
                time_up = (  # process 0's clock decides, at a task boundary (all processes alike)
                    bool(tc.max_minutes)
                    and task.is_boundary(step)
                    and time.perf_counter() - t_train >= 60 * tc.max_minutes
                )
                if multi:
                    # One collective per step, in multi-process runs only: has any process a pending
                    # signal, and is process 0's time up? Costs a host sync per step (the host waits
                    # for the all-gather, which the devices run after this step, before dispatching
                    # the next one); needed so that every process leaves the loop, and saves, at the
                    # same step.
                    agreed_signal, out_of_time = agree(
                        anyone=interrupts.requested is not None, process_zero=time_up
                    )
                else:
                    out_of_time = time_up
                eval_now = task.eval_due(step) or out_of_time
                save_now = bool(tc.checkpoint_every and step % tc.checkpoint_every == 0) or eval_now
                if log_now or save_now:
                    last_values = _check_finite(metrics, step, checkpoints)
                    previous = None
                if log_now:
                    record = {"step": step, **task.position(step), **last_values, **throughput.record(peak)}
                    record.update(task.data_metrics(data_iter.get_state()))
                    writer.write(record)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{last_values['loss']:.4f}",
                            ex_s=f"{record.get('examples_per_s', 0):.0f}",
                            refresh=False,
                        )
                    throughput.reset()
                if eval_now:
                    with jax.profiler.TraceAnnotation("evaluation"), stall.paused():
                        last_eval = _evaluate(
                            task,
                            evaluate,
                            trainer,
                            state,
                            step,
                            progress,
                            best,
                            writer,
                            last_values,
                            t_start,
                            say=say,
                        )
                    if out_of_time and progress.stopped is None:
                        progress.stopped = "time"
                        say(f"stopping: train.max_minutes={tc.max_minutes} spent at step {step}")
                if save_now:
                    with stall.paused():
                        save()
                if bar is not None:
                    bar.update(1)
            stall.close()  # the loop's steps are done: the last save and the test split are not steps
            if previous is not None:
                last_values = _check_finite(previous[1], previous[0], checkpoints)
            if saved_step != step and step > start:
                save()
            checkpoints.wait()
            if best is not None:
                best.wait()
        # Agreed again: a signal may have come during the last save, after the loop's last agreement.
        # Every process then scores the test split, or none.
        signalled = agree(anyone=interrupts.requested is not None)[0] if multi else signal_pending()
        finished = progress.stopped is not None or step >= total
        test = (
            _score_test(task, evaluate, trainer, best, checkpoints, progress, workdir, writer, say)
            if finished and not signalled
            else None
        )
    finally:
        window.close()
        if bar is not None:
            bar.close()
        writer.close()
    if already_finished:  # nothing trained: report what the run's records hold
        last_values, last_eval = _recorded_metrics(workdir, step)
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
        "already_finished": already_finished,
        "wall_time_s": time.perf_counter() - t_start,
        # Training time over every invocation of the run (the time budget's clock; compilation and
        # start-up excluded), as recorded at the last checkpoint when nothing was trained now.
        "train_time_s": progress.train_time_s if already_finished else time.perf_counter() - t_train,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        # Start-up of this invocation: the step's compile (or load from the compilation cache), seconds
        # from the trainer's start to its first step, and the memory plan (bytes per device).
        **startup,
        "memory_capacity_bytes": planned.capacity,
        "memory_estimate_bytes": planned.estimate,
        "memory_compiled_bytes": planned.compiled,
    }


def _fit_memory(task: Task, trainer: Trainer, stack: Any) -> tuple[Trainer, memory.StepMemory, int | None]:
    """The step's memory per device, planned before it compiles (gem_jax/train/memory.py). When the
    estimate exceeds the device's memory and tables planned `auto` could leave it, the tables are
    planned again with what the rest of the step leaves them (a new trainer on the new plan; the budget
    is returned, None where the tables kept their plan). Raises ConfigError, in one line, when the step
    still does not fit (unless `train.check_memory` is off)."""
    config = task.config
    capacity = memory.device_capacity(config)
    state = trainer.abstract_sharded_state
    traced, extra = trainer.trace_step(state, stack)
    planned = memory.plan_step(traced, state, extra, capacity)
    if planned.fits or not config.train.check_memory:
        return trainer, planned, None
    budget = memory.table_budget(planned, config.embeddings.memory_fraction)
    replanned = _replan(task, trainer, planned.estimate, budget)
    if replanned is not trainer:
        trainer = replanned
        state = trainer.abstract_sharded_state
        traced, extra = trainer.trace_step(state, stack)
        planned = memory.plan_step(traced, state, extra, capacity)
    else:
        budget = None
    memory.check(planned)
    return trainer, planned, budget


def _replan(task: Task, trainer: Trainer, needs: int | None, budget: int | None) -> Trainer:
    """A trainer on the tables planned again for `budget` bytes per device (said in one line: why, from the
    step's estimate `needs`, or that a cached step was compiled so), or `trainer` where there is no budget
    or the plan does not change."""
    if budget is None or not memory.replan_tables(task, budget):
        return trainer
    if jax.process_index() == 0:
        capacity = memory.device_capacity(task.config)[0]
        why = (
            f"the step needs ~{memory.size_text(needs)} per device of {memory.size_text(capacity)}"
            if needs is not None
            else "as when the cached step was compiled"
        )
        _line(
            f"{why}: tables planned again for the {memory.size_text(budget)} the rest of the step leaves them"
        )
    return Trainer(task, task.mesh)


def _shapes(stack: Any) -> Any:
    """The shapes and dtypes of a host batch: the step compiled ahead for one runs any batch alike."""
    return jax.tree.map(lambda x: (np.shape(x), getattr(x, "dtype", type(x))), stack)


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


def _line(text: str) -> None:
    """`text` and its newline on stderr in one write: `print` writes them apart, and a signal handler
    that ends the process in between (gem_jax/train/interrupt.py) would glue its own line to this one."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


def _message_printer(bar) -> Callable[[str], None]:
    """Prints the loop's messages to stderr, each on a line of its own while the progress bar shows.

    In a terminal tqdm clears the bar, prints and redraws it. In a log file nothing is redrawn (the
    bar's updates are separated by carriage returns only), so the message starts a new line after
    the bar's last state instead of sharing its line.
    """

    def say(text: str) -> None:
        if bar is None:
            _line(text)
        elif sys.stderr.isatty():
            bar.write(text, file=sys.stderr)
        else:
            _line(f"\n{text}")

    return say


def _recorded_metrics(workdir: Path, step: int) -> tuple[dict[str, float], dict[str, Any] | None]:
    """The last logged training values and validation metrics at or before `step`, from metrics.jsonl."""
    final: dict[str, float] = {}
    valid = None
    path = workdir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record.get("step", step + 1) > step:
            continue
        if record.get("split") == "valid":
            valid = record["valid"]
        elif "loss" in record:
            final = {k: v for k, v in record.items() if k != "step" and isinstance(v, float)}
    return final, valid


def _evaluate(
    task, evaluate, trainer, state, step, progress, best, writer, last_values, t_start, *, say
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
    say(f"step {step} {_where(task, step)}{loss}valid {shown}{' *' if improved else ''}")
    if progress.stopped == "patience":
        say(f"stopping: {progress.bad_evals} evaluations without a better {task.select_metric}")
    return valid


def _score_test(
    task, evaluate, trainer, best, checkpoints, progress, workdir, writer, say
) -> dict[str, Any] | None:
    """The test split, scored once per run for the chosen checkpoint; later calls read test.json."""
    if "test" not in evaluate.splits:
        return None
    path = workdir / "test.json"
    recorded = files.read_json(path)
    if recorded is None:
        source, step = checkpoints, None
        if best is not None and progress.best_step is not None:
            problem = best.problem(progress.best_step)
            if problem is None:
                source, step = best, progress.best_step
            else:
                say(
                    f"the chosen checkpoint (step {progress.best_step}) is {problem}: scoring the newest "
                    "intact checkpoint instead"
                )
        if step is None:
            step = checkpoints.newest_intact(move_aside=False)
        state, _ = source.restore(step, *trainer.saved_target)
        state = trainer.from_saved_form(state)
        recorded = {
            "step": step,
            **task.position(step),
            "checkpoint": "best" if source is best else "checkpoints",
            "valid": evaluate(state, "valid"),
            "test": evaluate(state, "test"),
        }
        if jax.process_index() == 0:
            files.write_json(path, recorded)
        writer.write({"split": "test", **recorded})
    return recorded["test"]


def evaluate_run(task: Task, workdir: str | Path) -> dict[str, Any]:
    """Validation metrics of a run's chosen checkpoint (else its latest), and the recorded test
    metrics (`python -m experiments eval`; the test split is never scored again here).

    Reads only (no lock, nothing written), so it may run beside the trainer; each checkpoint is
    verified against its manifest first, and a failed one is reported and skipped.
    """
    workdir = Path(workdir)
    for sub in ("best", "checkpoints"):
        if not (workdir / sub).is_dir():
            continue
        checkpoints = Checkpointer(workdir / sub, task.config.train, read_only=True)
        try:
            step = checkpoints.newest_intact()
        except NoIntactCheckpoint:
            step = None
        if step is not None:
            break
        checkpoints.close()
    else:
        raise WorkdirError(f"no intact checkpoint in {workdir / 'best'} or {workdir / 'checkpoints'}")
    trainer = Trainer(task, task.mesh)
    state, _ = checkpoints.restore(step, *trainer.saved_target)
    state = trainer.from_saved_form(state)
    checkpoints.close()
    recorded = files.read_json(workdir / "test.json")
    return {
        "workdir": str(workdir),
        "step": step,
        **task.position(step),
        "checkpoint": sub,
        "eval": task.evaluator(trainer)(state, "valid"),
        "test": None if recorded is None else recorded["test"],
    }
