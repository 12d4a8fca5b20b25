"""`python -m experiments bench train_step --config C`: where a train step's time goes.

Times (1) the input pipeline alone (host: packs per second, after one untimed batch per data worker, over
at least two batches per worker; the generator, or the shards with `data.kind = "records"`) and
(2) the jitted train step alone on batches already on the device (median of repeated steps over a few
rotating batches, each waited for; then `step_s_back_to_back`: the same number of steps dispatched back to
back, as the train loop runs them; with offloaded tables each step also stages its rows from host memory
first, as training does: `host_staging` in the result, with the caches' counts; with `--batches` above
`--steps` + 2 every timed batch is one the caches have not seen), and reports both with the
analytic TFLOP/s and MFU (by our count, and `_nvidia` by NVIDIA recsys-examples' HSTU count:
gem_jax/train/flops.py), so a run's throughput can be attributed to host or device.

The step is compiled once, ahead of time (`compile_s`), and the GEMM custom calls of its optimised HLO
are counted (`gemm_calls`: cuBLASLt FP8, cuBLASLt, cuBLAS; GPU only). With `precision.fp8=true` it
also reports the FP8 dots of the lowered step (`fp8`: experiments/fp8_gemms.py, dots that read FP8,
those in the cuBLASLt FP8 pattern, those whose scales are step parameters) and, on a GPU, exits 1 when
fewer `__cublas$lt$matmul$f8` calls than FP8-pattern dots came out: XLA did not reach the FP8 GEMMs.
`--hlo-out PATH` writes the optimised HLO (gzip if PATH ends in .gz).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time

import jax
import numpy as np

from experiments.benchmarks.pipeline import pipeline_source, time_pipeline
from experiments.fp8_gemms import fp8_dots, summary
from gem_jax.config import load_config
from gem_jax.kernels import kernel_lines
from gem_jax.tasks import make_task
from gem_jax.train.flops import device_peak_flops, nvidia_hstu_flops, train_step_flops
from gem_jax.train.step import Trainer

WARMUP_STEPS = 2  # after compiling; few, so that with offloaded tables the timed batches' rows are new
GEMM_TARGETS = {
    "cublas_lt_f8": "__cublas$lt$matmul$f8",
    "cublas_lt": "__cublas$lt$matmul",
    "cublas": "__cublas$gemm",
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments bench train_step")
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--batches", type=int, default=4, help="distinct device batches to rotate over")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument(
        "--pipeline-steps", type=int, default=20, help="host batches to time (at least 2 per data worker)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=WARMUP_STEPS,
        help="untimed steps first (offloaded tables: enough fresh batches to fill the cache, so timed steps evict)",
    )
    parser.add_argument("--hlo-out", default=None, help="write the optimised HLO here (.gz: gzip)")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()

    def phase(name: str) -> None:
        """Progress on stderr as each phase ends: a call cut by its time limit still shows where it was."""
        print(
            f"bench train_step: {name} at {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True
        )

    config = load_config(args.config, args.overrides)
    task = make_task(config)
    trainer = Trainer(task, task.mesh)
    it = iter(task.train_data(jax.process_index(), jax.process_count()))
    # The generator's or the file pipeline's time per batch (experiments/benchmarks/pipeline.py: every
    # worker's first batch untimed, then two rounds of every worker; on the H200 host 4 timed batches
    # after 12 read 16 ms per batch in one call and 84 ms in the next).
    pipeline = time_pipeline(it, config.data.num_workers, args.pipeline_steps)
    host = pipeline.batches
    flops = [train_step_flops(config, h.offsets, h.num_targets) for h in host[: args.batches]]
    flops_nvidia = [nvidia_hstu_flops(config, h.offsets, h.num_targets) for h in host[: args.batches]]
    tokens = [float(h.offsets[:, -1].sum()) for h in host[: args.batches]]
    phase(f"{len(host)} host batches")
    state = trainer.init_state()
    phase("state initialised")
    lowered = trainer.lower_step(state, host[0])
    t0 = time.perf_counter()
    step = lowered.compile()
    compile_s = time.perf_counter() - t0
    phase("step compiled")
    hlo = step.as_text()
    if args.hlo_out:
        with (gzip.open if args.hlo_out.endswith(".gz") else open)(args.hlo_out, "wt") as f:
            f.write(hlo)
    gemm_calls = {name: hlo.count(f'custom_call_target="{target}"') for name, target in GEMM_TARGETS.items()}
    fp8 = summary(*fp8_dots(lowered)) if config.precision.fp8 else None
    stage_times: list[float] = []
    if trainer.offloaded:  # the host's staging time per step (in the waited-for loop: no device wait inside)
        stage = trainer.stage

        def timed_stage(*a, **k):
            t = time.perf_counter()
            out = stage(*a, **k)
            stage_times.append(time.perf_counter() - t)
            return out

        trainer.stage = timed_stage
    run = trainer.rotating_steps(step, host[: args.batches])

    warmup = args.warmup
    for i in range(warmup):
        state, m = run(state, i)
    jax.block_until_ready(m["loss"])
    phase(f"{warmup} warm-up steps")
    times, cache = [], {}
    stage_times.clear()
    for i in range(warmup, warmup + args.steps):
        t = time.perf_counter()
        state, m = run(state, i)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
        for k, v in m.items():  # offloaded tables: embeddings/TABLE/cache_hits, ..._bytes (host floats)
            if k.startswith("embeddings/"):
                cache[k] = cache.get(k, 0.0) + float(v) / args.steps
    host_stage_s = float(np.median(stage_times)) if stage_times else None
    # The same steps back to back, one wait at the end, as the train loop runs them: with offloaded tables
    # the host stages step i + 1's rows while the device runs step i.
    t = time.perf_counter()
    for i in range(warmup + args.steps, warmup + 2 * args.steps):
        state, m = run(state, i)
    jax.block_until_ready(m["loss"])
    pipelined_s = (time.perf_counter() - t) / args.steps
    step_s = float(np.median(times))
    peak = device_peak_flops(jax.devices()[0].device_kind)
    tflops = float(np.mean(flops)) / step_s / jax.device_count() / 1e12
    # NVIDIA's count applies to plain HSTU towers only (gem_jax/train/flops.py); elsewhere no _nvidia figures
    nvidia_applies = all(f is not None for f in flops_nvidia)
    tflops_nvidia = (
        float(np.mean(flops_nvidia)) / step_s / jax.device_count() / 1e12 if nvidia_applies else None
    )
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "pipeline": pipeline_source(config),
        "kernels": kernel_lines(config),  # which backend runs each op
        "pipeline_s_per_batch": pipeline.s_per_batch,
        "pipeline_batches": {"untimed": pipeline.untimed, "timed": pipeline.timed},
        "device_step_s_median": step_s,
        "device_step_s_min": float(np.min(times)),
        "step_s_back_to_back": pipelined_s,
        "tokens_per_step": float(np.mean(tokens)),
        "tokens_per_s_device_only": float(np.mean(tokens)) / step_s,
        "tflops_per_device": tflops,
        "mfu": (tflops * 1e12 / peak) if peak else None,
        "tflops_per_device_nvidia": tflops_nvidia,
        "mfu_nvidia": (tflops_nvidia * 1e12 / peak) if peak and nvidia_applies else None,
        "host_staging": bool(trainer.offloaded),
        "offloaded": {
            name: {"rows": t.rows, "cache_rows": t.devices * t.slots_per_device}
            for name, t in (trainer.embeddings.offload.items() if trainer.embeddings else ())
        },
        "host_stage_s_median": host_stage_s,
        "warmup_steps": warmup,
        "every_step_a_new_batch": warmup + 2 * args.steps <= args.batches,
        "cache_per_step": cache or None,
        "compile_s": compile_s,
        "gemm_calls": gemm_calls if jax.default_backend() == "gpu" else None,
        "fp8": fp8,
    }
    print(
        "\n".join(result["kernels"]), file=sys.stderr
    )  # for people; stdout is the report, one JSON document
    print(json.dumps(result, indent=1))
    if fp8 and jax.default_backend() == "gpu" and gemm_calls["cublas_lt_f8"] < fp8["fp8_pattern"]:
        print(
            f"CHECK FAILED: {gemm_calls['cublas_lt_f8']} cuBLASLt FP8 GEMMs in the compiled step for "
            f"{fp8['fp8_pattern']} dots in the FP8 pattern ({fp8['scales_are_arguments']} with parameter scales)"
        )
        return 1
    return 0
