"""`python -m experiments profile --config C [--set k=v ...] [--steps N] [--out DIR]`: where a train
step's time goes, by named scope (docs/profiling.md).

Builds the task and trainer as `train` does, compiles the step, warms it up, times it untraced,
then traces `--steps` steps with `jax.profiler.trace` (TensorBoard/XProf `.xplane.pb` and
Perfetto `perfetto_trace.json.gz`) on batches already on the device. It reads the trace back
(experiments/trace_analysis.py), groups device time by the model's named scopes, adds the input
pipeline's time per batch (timed on its own, host only) and the analytic FLOPs per group, and
writes to `--out` (default runs/profile/<config name>):

  breakdown.md / breakdown.csv   per-step table: ms, share, TFLOP/s and MFU per group, idle time
  ops.csv                        every HLO op: group, named scope, kernels, ms and count per step
  summary.json                   pipeline, untraced step, peak memory, paths, the table rows
  memory.prof                    device memory profile (pprof), `jax.profiler.save_device_memory_profile`
  memory_timeline.csv            allocator bytes-in-use over the trace, where the platform records it
  trace/                         the TensorBoard log directory (plugins/profile/<run>/...)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from experiments import trace_analysis as ta
from experiments.benchmarks.pipeline import pipeline_source, time_pipeline
from gem_jax.config import load_config
from gem_jax.kernels import kernel_lines
from gem_jax.tasks import make_task
from gem_jax.train.flops import device_peak_flops, train_step_flops_by_group
from gem_jax.train.step import Trainer


@dataclasses.dataclass
class ProfileResult:
    out: Path
    trace_file: Path  # the Chrome-trace JSON jax wrote (TensorBoard's trace viewer reads the xplane)
    perfetto_file: Path | None
    memory_profile: Path
    breakdown: ta.Breakdown
    rows: list[dict[str, Any]]  # the table (trace_analysis.table_rows)
    summary: dict[str, Any]
    memory_timeline: list[tuple[float, float]]

    def markdown(self) -> str:
        s = self.summary
        lines = [
            f"Profile of `{' '.join([s['config'], *s['overrides']])}` on {s['devices']} x {s['device']} "
            f"(jax {s['jax']}), {s['steps']} traced steps, ops from {self.breakdown.source}.",
            "",
            ta.markdown_table(self.rows),
            "",
            f"- step window (traced): {s['traced_step_ms']:.2f} ms; untraced step (median of "
            f"{s['untraced_steps']}, blocking each): {s['untraced_step_ms']:.2f} ms",
            f"- input pipeline ({s['pipeline']}; host, {s['pipeline_batches']} batches): "
            f"{s['pipeline_ms_per_batch']:.2f} "
            f"ms/batch ({s['pipeline_ms_per_batch'] / s['untraced_step_ms']:.2f} x the untraced step)",
            f"- ops matched to a named scope: {s['named_fraction']:.1%} of busy time",
            f"- peak memory: {_gib(s['peak_bytes_in_use'])} in use (device memory_stats), "
            f"{_gib(s['compiled_peak_bytes'])} for the step (compiled: arguments + outputs + temporaries "
            f"- aliased)",
        ]
        return "\n".join(lines)


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def run_profile(
    config_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    steps: int = 5,
    warmup: int = 2,
    batches: int = 2,
    pipeline_batches: int = 10,
    out: str | Path | None = None,
) -> ProfileResult:
    """Profiles the train step of a config (module docstring); returns the table and file paths."""
    if steps < 1 or warmup < 1 or batches < 1 or pipeline_batches < 1:
        raise ValueError("--steps, --warmup, --batches and --pipeline-batches must be >= 1")
    config = load_config(config_path, overrides)
    out = Path(out) if out is not None else Path("runs") / "profile" / Path(config_path).stem
    out.mkdir(parents=True, exist_ok=True)
    task = make_task(config)
    trainer = Trainer(task, task.mesh)

    # The input pipeline alone (host; the generator, or the shards of a records config), timed as
    # `bench train_step` and `bench pipeline` do (experiments/benchmarks/pipeline.py).
    it = iter(task.train_data(jax.process_index(), jax.process_count()))
    timing = time_pipeline(it, config.data.num_workers, pipeline_batches)
    host, pipeline_s = timing.untimed_batches + timing.batches, timing.s_per_batch  # traced: the first ones
    stacks = host[:batches] + [next(it) for _ in range(batches - len(host))]

    state = trainer.init_state()
    compiled = trainer.lower_step(state, stacks[0]).compile()
    run = trainer.rotating_steps(compiled, stacks)
    hlo_text = compiled.as_text()
    module = re.search(r"^HloModule\s+([^\s,]+)", hlo_text, re.MULTILINE)
    for i in range(warmup):
        state, metrics = run(state, i)
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        state, metrics = run(state, i)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)

    # The traced steps: dispatched back to back, as the training loop does, then waited for.
    trace_dir = out / "trace"
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                state, metrics = run(state, i)
        jax.block_until_ready((state, metrics))
    finally:
        jax.profiler.stop_trace()
    memory_profile = out / "memory.prof"
    jax.profiler.save_device_memory_profile(str(memory_profile))
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    analysis = compiled.memory_analysis()
    compiled_peak = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
        if analysis is not None
        else None
    )

    trace_file = ta.find_trace_file(trace_dir)
    trace = ta.load_trace(trace_file)
    events, source = ta.device_events(trace, device=0)
    b = ta.breakdown(
        events, ta.parse_hlo_ops(hlo_text), steps=steps, module=module[1] if module else None, source=source
    )
    # Analytic FLOPs per group, per step and device of the mesh, averaged over the traced batches.
    used = [stacks[i % len(stacks)] for i in range(steps)]
    step_flops = float(np.mean([task.batch_counts(s).get("flops", np.nan) for s in used])) / trainer.mesh.size
    if np.isfinite(step_flops):
        parts = [train_step_flops_by_group(config, s.offsets, s.num_targets) for s in used]
        for row in b.rows:
            if row.group in parts[0]:
                row.flops = float(np.mean([p[row.group] for p in parts])) / trainer.mesh.size
    peak_flops = device_peak_flops(device.device_kind)
    rows = ta.table_rows(b, peak_flops)
    perfetto = trace_file.parent / "perfetto_trace.json.gz"
    summary = {
        "config": str(config_path),
        "overrides": list(overrides),
        "device": device.device_kind,
        "devices": trainer.mesh.size,
        "jax": jax.__version__,
        "steps": steps,
        "module": module[1] if module else None,
        "traced_step_ms": b.step_ms,
        "untraced_step_ms": statistics.median(times) * 1e3,
        "untraced_steps": steps,
        "pipeline": pipeline_source(config),
        "pipeline_ms_per_batch": pipeline_s * 1e3,
        "pipeline_batches": timing.timed,
        "kernels": kernel_lines(config),  # which backend runs each op
        "named_fraction": b.named_fraction,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "compiled_peak_bytes": compiled_peak,
        "compiled_memory": {
            "arguments": analysis.argument_size_in_bytes,
            "outputs": analysis.output_size_in_bytes,
            "temporaries": analysis.temp_size_in_bytes,
            "aliased (donated)": analysis.alias_size_in_bytes,
        }
        if analysis is not None
        else None,
        "peak_device_flops": peak_flops,
        "train_step_flops_per_device": step_flops if np.isfinite(step_flops) else None,
        "trace_dir": str(trace_dir),
        "trace_file": str(trace_file),
        "perfetto_file": str(perfetto) if perfetto.exists() else None,
        "memory_profile": str(memory_profile),
        "rows": rows,
    }
    result = ProfileResult(
        out=out,
        trace_file=trace_file,
        perfetto_file=perfetto if perfetto.exists() else None,
        memory_profile=memory_profile,
        breakdown=b,
        rows=rows,
        summary=summary,
        memory_timeline=ta.memory_timeline(trace),
    )
    if jax.process_index() == 0:
        _write(result)
    return result


def _write(r: ProfileResult) -> None:
    (r.out / "breakdown.md").write_text(r.markdown() + "\n")
    (r.out / "summary.json").write_text(json.dumps(r.summary, indent=1, default=str))
    _write_csv(r.out / "breakdown.csv", r.rows, [key for key, _, _ in ta.COLUMNS])
    _write_csv(
        r.out / "ops.csv",
        r.breakdown.ops,
        ["group", "ms", "count", "scope", "backward", "hlo_op", "module", "kernels"],
    )
    if r.memory_timeline:
        _write_csv(
            r.out / "memory_timeline.csv",
            [{"time_us": t, "bytes_in_use": v} for t, v in r.memory_timeline],
            ["time_us", "bytes_in_use"],
        )


def _write_csv(path: Path, rows: list[dict[str, Any]], fields: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments profile", description=__doc__)
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=5, help="traced steps (and untraced timed steps)")
    parser.add_argument("--warmup", type=int, default=2, help="steps run after compiling, before timing")
    parser.add_argument("--batches", type=int, default=2, help="distinct device batches to rotate over")
    parser.add_argument("--pipeline-batches", type=int, default=10, help="host batches to time")
    parser.add_argument("--out", default=None, help="output directory (default runs/profile/<config>)")
    parser.add_argument("--top", type=int, default=15, help="print the N most expensive ops")
    args = parser.parse_args(argv)
    # XLA:GPU replays most of a step as CUDA graphs (command buffers): a trace then shows one event per
    # graph (seen on the H200: one 120 ms event holding ~800 fusions) and nothing can be grouped by op.
    # Profile with command buffers off, so every kernel is its own event; the untraced step time is
    # measured the same way (without graphs the host launches each kernel: compare with `bench train_step`).
    if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
        ).strip()
    result = run_profile(
        args.config,
        args.overrides,
        steps=args.steps,
        warmup=args.warmup,
        batches=args.batches,
        pipeline_batches=args.pipeline_batches,
        out=args.out,
    )
    print("\n".join(result.summary["kernels"]))
    print(result.markdown())
    print(f"\nTop {args.top} ops (ms/step, group, scope, kernels):")
    for op in result.breakdown.ops[: args.top]:
        kernels = op["kernels"] if len(op["kernels"]) < 80 else op["kernels"][:77] + "..."
        bwd = " (bwd)" if op["backward"] else ""
        print(f"  {op['ms']:9.3f}  {op['group']:<17} {op['scope'] or '-'}{bwd}  [{kernels}]")
    print(
        f"\nwrote {result.out}/breakdown.md, breakdown.csv, ops.csv, summary.json, memory.prof\n"
        f"trace: tensorboard --logdir {result.out / 'trace'} (profile tab; needs tensorboard-plugin-profile)"
        f" or xprof --logdir {result.out / 'trace'}\n"
        f"perfetto: open {result.perfetto_file} at ui.perfetto.dev"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
