"""One sweep point: build a config's train step, compile it ahead of time and run K steps.

    python -m experiments.measure --config C [--set k=v ...] --steps K --out result.json

Records (JSON, written atomically to --out and printed): `status` ("ok", "invalid" for a config or
mesh that does not fit the machine, "oom", "error"), compile seconds, median step seconds (steps
after `--warmup`), tokens/s and examples/s, TFLOP/s per device and MFU (tasks with a FLOP model),
the loss after the last step, memory per device from the compiled executable's memory analysis
(arguments + outputs - aliased + temporaries) and as measured by the device allocator where it
reports one (`memory_stats()["peak_bytes_in_use"]`, max over the mesh's devices; not on CPU), and
the bytes per collective kind in the compiled HLO (`experiments/hlo.py`). `python -m experiments
sweep` runs this in a subprocess per point, so an OOM or a crash cannot take the sweep down.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from experiments.hlo import collective_bytes
from gem_jax.config import ConfigError, load_config
from gem_jax.parallel import describe_mesh
from gem_jax.tasks import make_task
from gem_jax.train.files import write_json
from gem_jax.train.flops import device_peak_flops
from gem_jax.train.step import Trainer

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


def measure(config_path: str | None, overrides: list[str], *, steps: int, warmup: int, batches: int) -> dict:

    config = load_config(config_path, overrides)
    task = make_task(config)
    mesh = task.mesh
    print(describe_mesh(mesh, config.parallel), file=sys.stderr)
    trainer = Trainer(task, mesh)
    data = iter(task.train_data(jax.process_index(), jax.process_count()))
    host = [next(data) for _ in range(max(1, min(batches or steps, steps)))]
    counts = [task.batch_counts(h) for h in host]
    state = trainer.init_state()

    t0 = time.perf_counter()
    compiled = trainer.lower_step(state, host[0]).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()
    estimate = None
    if memory is not None:
        estimate = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
            + memory.generated_code_size_in_bytes
        )
    collectives = collective_bytes(compiled.as_text())
    run = trainer.rotating_steps(compiled, host)

    times, losses = [], []
    for i in range(steps):
        t = time.perf_counter()
        state, metrics = run(state, i)
        jax.block_until_ready((state.step, metrics["loss"]))
        times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    timed = times[warmup:] if len(times) > warmup else times
    step_s = statistics.median(timed)
    used = [counts[i % len(counts)] for i in range(steps)][warmup:] or counts
    per_step = {k: float(np.mean([c.get(k, 0.0) for c in used])) for k in used[0]}
    peak = device_peak_flops(mesh.devices.flat[0].device_kind)
    tflops = per_step["flops"] / step_s / mesh.size / 1e12 if "flops" in per_step else None
    nvidia = per_step["flops_nvidia"] / step_s / mesh.size / 1e12 if "flops_nvidia" in per_step else None

    measured = []
    for d in mesh.devices.flat:
        stats = d.memory_stats() if d.process_index == jax.process_index() else None
        if stats and "peak_bytes_in_use" in stats:
            measured.append(stats["peak_bytes_in_use"])
    return {
        "status": "ok" if all(np.isfinite(losses)) else "diverged",
        "devices": int(mesh.size),
        "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": {a: int(n) for a, n in mesh.shape.items()},
        "jax": jax.__version__,
        "compile_s": compile_s,
        "step_s_median": step_s,
        "step_s_min": min(timed),
        "tokens_per_step": per_step.get("tokens"),
        "examples_per_step": per_step.get("examples"),
        "tokens_per_s": per_step["tokens"] / step_s if "tokens" in per_step else None,
        "examples_per_s": per_step["examples"] / step_s if "examples" in per_step else None,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / peak if tflops is not None and peak else None,
        "mfu_nvidia": nvidia * 1e12 / peak if nvidia is not None and peak else None,  # NVIDIA's HSTU count
        "loss": losses[-1],
        "loss_first": losses[0],
        "steps": steps,
        "memory_estimate_bytes": estimate,
        "memory_measured_bytes": max(measured) if measured else None,
        "collectives": collectives,
    }


def classify_failure(error: BaseException) -> str:
    """ "invalid" (the config or mesh does not fit), "oom" or "error"."""
    if isinstance(error, ConfigError):
        return "invalid"
    text = f"{type(error).__name__}: {error}"
    return "oom" if any(m in text for m in OOM_MARKERS) else "error"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.measure", description=__doc__)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--batches", type=int, default=0, help="distinct batches cycled (0: one per step)")
    parser.add_argument("--out", default=None, help="write the record here (JSON)")
    args = parser.parse_args(argv)
    try:
        record = measure(
            args.config, args.overrides, steps=args.steps, warmup=args.warmup, batches=args.batches
        )
    except Exception as e:  # noqa: BLE001 (every failure of a point is a record, never a crash)
        record = {
            "status": classify_failure(e),
            "error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    if args.out:
        write_json(Path(args.out), record)
    print(json.dumps({k: v for k, v in record.items() if k != "traceback"}, indent=1))
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
