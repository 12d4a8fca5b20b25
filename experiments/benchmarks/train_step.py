"""`python -m experiments bench train_step --config C`: where a train step's time goes.

Times (1) the input pipeline alone (host: packs per second) and (2) the jitted train step alone on
batches already on the device (median of repeated steps over a few rotating batches), and reports
both with the analytic TFLOP/s and MFU, so a run's throughput can be attributed to host or device.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments bench train_step")
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--batches", type=int, default=4, help="distinct device batches to rotate over")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--pipeline-steps", type=int, default=20, help="host batches to time")
    args = parser.parse_args(argv)

    from gem_jax.config import load_config
    from gem_jax.tasks import make_task
    from gem_jax.train.flops import device_peak_flops, train_step_flops
    from gem_jax.train.step import Trainer

    config = load_config(args.config, args.overrides)
    task = make_task(config)
    trainer = Trainer(task, task.mesh)
    it = iter(task.train_data(jax.process_index(), jax.process_count()))
    next(it)  # start workers
    t0 = time.perf_counter()
    host = [next(it) for _ in range(args.pipeline_steps)]
    pipeline_s = (time.perf_counter() - t0) / args.pipeline_steps
    batches = [trainer.to_device(h) for h in host[: args.batches]]
    flops = [train_step_flops(config, h.offsets, h.num_targets) for h in host[: args.batches]]
    tokens = [float(h.offsets[:, -1].sum()) for h in host[: args.batches]]
    state = trainer.init_state()
    for b in batches:  # compile + warm up
        state, m = trainer.train_step(state, b)
    jax.block_until_ready(m["loss"])
    times = []
    for i in range(args.steps):
        t = time.perf_counter()
        state, m = trainer.train_step(state, batches[i % len(batches)])
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    peak = device_peak_flops(jax.devices()[0].device_kind)
    tflops = float(np.mean(flops)) / step_s / jax.device_count() / 1e12
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "pipeline_s_per_batch": pipeline_s,
        "device_step_s_median": step_s,
        "device_step_s_min": float(np.min(times)),
        "tokens_per_step": float(np.mean(tokens)),
        "tokens_per_s_device_only": float(np.mean(tokens)) / step_s,
        "tflops_per_device": tflops,
        "mfu": (tflops * 1e12 / peak) if peak else None,
    }
    print(json.dumps(result, indent=1))
    return 0
