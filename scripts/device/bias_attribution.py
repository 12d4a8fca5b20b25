"""Where the relative bias's time goes in the Hopper (Mosaic GPU) jagged attention kernels, on one GPU.

  python3 scripts/device/bias_attribution.py SHAPE [SHAPE ...] [--reps R] [--only fwd|bwd] [--variants L,...]
  python3 scripts/device/bias_attribution.py --check     (the default call vs the float32 reference first)
  python3 scripts/device/bias_attribution.py u1k h4k --jobs 8   (one process a variant, compiled in parallel)

SHAPE: u1k (B=512, lengths in [0.9N, N), N=1024), u4k (the same at N=4096), h4k (B=2048, log-normal lengths,
N=4096); H=4, D=128, bf16, SiLU, the GEM bias (position 128 + time 64 buckets, sorted timestamps about a minute
apart). For each shape, on fresh random inputs: the forward (gpu_sm90.forward) and the backward
(gpu_sm90_backward.backward_mosaic_gpu, on the residuals of one forward; its dK/dV and dQ kernels timed apart, each
in a jit that returns only its outputs) timed without the bias, with
it, and with each part of it skipped through KernelOptions.bias_probe (benchmark-only: those rows compute
WRONG results, they time what each part costs). Each variant compiles its own kernels; a ROW line is printed
as each finishes (TFLOP/s by generative-recommenders' count: forward = sum_b 2 H (Dqk + Dv) L_b^2 / 2,
backward = 2.5x), then a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import jagged_calls, shapes
from experiments.benchmarks.timing import median_seconds
from pallas_kernels.jagged_attention import gpu_layout, gpu_sm90, gpu_sm90_backward, jagged_attention
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.params import KernelParams

SHAPES = {"u1k": shapes.PEER_N1024, "u4k": shapes.PEER_N4096, "h4k": shapes.HEAVY_TAIL}
MOSAIC = KernelOptions()
# (label, bias on, the parts skipped (KernelOptions.bias_probe) and "+NAME" KernelOptions switched on); the
# forward has no table gradients
FORWARD = [
    ("no bias", False, ()),
    ("bias", True, ()),
    ("- time bucket", True, ("time_bucket",)),
    ("- pos gather", True, ("pos_gather",)),
    ("- both", True, ("time_bucket", "pos_gather")),
    # jax 0.11 lowers with Warpgroup semantics unless a kernel says otherwise; the kernels ask for Lane
    ("warpgroup: no bias", False, ("+warpgroup_semantics",)),
    ("warpgroup: bias", True, ("+warpgroup_semantics",)),
]
BACKWARD = (
    FORWARD[:4]
    + FORWARD[5:]
    + [
        ("- pos grad", True, ("pos_grad",)),
        ("- time grad", True, ("time_grad",)),
        ("- atomics", True, ("hist_plain",)),
        ("- both grads", True, ("pos_grad", "time_grad")),
        ("- everything", True, ("time_bucket", "pos_gather", "pos_grad", "time_grad")),
        ("bias + time grad runs", True, ("+time_grad_runs",)),
    ]
)


def _inputs(shape: shapes.JaggedShape, rng):
    lengths = shape.sample_lengths(rng)
    h, d = shape.heads, shape.head_dim
    q, k, v, do, off = jagged_calls.inputs(lengths, h, d, rng)
    b = shapes.GEM_H200_BIAS
    ts = jnp.asarray(np.cumsum(rng.integers(1, 120, size=q.shape[0])), jnp.int32)
    pos = jnp.asarray(rng.standard_normal((h, b.num_pos)) * 0.1, jnp.float32)
    tim = jnp.asarray(rng.standard_normal((h, b.num_time)) * 0.1, jnp.float32)
    return lengths, q, k, v, do, off, ts, pos, tim


def _params(shape: shapes.JaggedShape, bias: bool, probe: tuple[str, ...]) -> KernelParams:
    b = shapes.GEM_H200_BIAS
    fields = dict(num_pos=b.num_pos, num_time=b.num_time) if bias else {}
    switches = {name[1:]: True for name in probe if name.startswith("+")}
    skips = tuple(name for name in probe if not name.startswith("+"))
    options = dataclasses.replace(MOSAIC, bias_probe=skips, **switches)
    params = KernelParams.build(shape.max_seq_len, "silu", shape.head_dim, options=options, **fields)
    return dataclasses.replace(params, forward_kernel="mosaic", backward_kernel="mosaic")


def check(seed: int) -> bool:
    """The default call (implementation=None: the Mosaic GPU kernels on Hopper) with the GEM bias against the
    float32 reference on fresh inputs at a small shape, sorted and unsorted timestamps, with and without
    KernelOptions.time_grad_runs: output and the gradients of q, k, v and both tables, rel. L2 < 1e-2 each and
    finite."""
    rng = np.random.default_rng(seed)
    shape = shapes.JaggedShape(batch=16, max_seq_len=1024, heads=4, head_dim=128)
    ok_all = True
    for sort in (True, False):
        lengths, q, k, v, do, off, ts, pos, tim = _inputs(shape, rng)
        if not sort:
            ts = jnp.asarray(rng.permutation(np.asarray(ts)))

        def loss(impl, options, q, k, v, pos, tim):
            o = jagged_attention(
                q,
                k,
                v,
                off,
                max_seq_len=1024,
                implementation=impl,
                options=options,
                timestamps=ts,
                pos_bias=pos,
                time_bias=tim,
            )
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

        grad = jax.jit(jax.grad(loss, argnums=(2, 3, 4, 5, 6), has_aux=True), static_argnums=(0, 1))
        f32 = lambda x: x.astype(jnp.float32)
        want = grad("reference", None, f32(q), f32(k), f32(v), pos, tim)
        for runs in (False, True):  # the shipped kernels; the time gradient's sorted path (time_grad_runs)
            got = grad(None, KernelOptions(time_grad_runs=runs), q, k, v, pos, tim)
            parts, ok = [], True
            for label, a, r in zip(
                ("out", "dq", "dk", "dv", "dpos", "dtime"), (got[1], *got[0]), (want[1], *want[0])
            ):
                a, r = f32(a), f32(r)
                err = float(jnp.linalg.norm(a - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30))
                ok = ok and err < 1e-2 and bool(jnp.isfinite(a).all())
                parts.append(f"{label}={err:.1e}")
            verdict = "OK" if ok else "FAIL"
            print(f"CHECK sorted={sort} time_grad_runs={runs} {' '.join(parts)} -> {verdict}", flush=True)
            ok_all = ok_all and ok
    return ok_all


@contextlib.contextmanager
def _gpu_turn(lock: str | None):
    """Exclusive use of the GPU among this script's processes (--jobs): they compile in parallel and take turns
    to run. No lock: this process is alone."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(
    name: str,
    reps: int,
    only: str | None,
    labels: list[str] | None = None,
    seed: int | None = None,
    lock: str | None = None,
) -> list[tuple]:
    """ROW tuples (shape, direction, label, ms, TFLOP/s) of the variants asked for, on inputs drawn from `seed`
    (the same for every process of one --jobs run). Each variant is compiled first, then run in its GPU turn."""
    shape = SHAPES[name]
    rng = np.random.default_rng(int(time.time()) if seed is None else seed)
    lengths, q, k, v, do, off, ts, pos, tim = _inputs(shape, rng)
    flops = jagged_calls.fwd_flops(lengths, shape.heads, shape.head_dim, shape.head_dim)
    rows = []

    def layout(params, bias):
        args = (ts, pos, tim) if bias else (None, None, None)
        return gpu_layout.to_kernel_layout(q, k, v, off, None, *args, params)

    for direction, variants in (("fwd", FORWARD), ("bwd", BACKWARD)):
        if only not in (None, direction):
            continue
        for label, bias, probe in variants:
            if labels and label not in labels:
                continue
            t0 = time.perf_counter()
            params = _params(shape, bias, probe)
            inputs = layout(params, bias)
            if direction == "fwd":
                f = jax.jit(lambda x, p=params: gpu_sm90.forward(x, p)[0]).lower(inputs).compile()
                with _gpu_turn(lock):
                    sec = median_seconds(f, inputs, reps=reps, warmup=3)
                tflops = flops / sec / 1e12
            else:
                # the shipped forward's residuals (bias_probe does not change them), and each backward kernel
                # alone: a jit that returns only its outputs (XLA drops the other kernel's call)
                full = _params(shape, bias, ())
                fwd = jax.jit(lambda x, p=full: gpu_layout.forward(x, p)[1])
                res_spec = jax.eval_shape(fwd, layout(full, bias))
                kernels = {}
                for kernel, keep in (("dkv", (1, 2)), ("dq", (0, 6, 7))):
                    kernels[kernel] = (
                        jax.jit(
                            lambda res, do, p=params, keep=keep: [
                                gpu_sm90_backward.backward_mosaic_gpu(res, do, p)[i] for i in keep
                            ]
                        )
                        .lower(res_spec, do)
                        .compile()
                    )
                with _gpu_turn(lock):
                    residuals = jax.block_until_ready(fwd(layout(full, bias)))
                    parts = {
                        k: median_seconds(f, residuals, do, reps=reps, warmup=3) for k, f in kernels.items()
                    }
                    del residuals
                sec = parts["dkv"] + parts["dq"]
                tflops = 2.5 * flops / sec / 1e12
                label += f" (dkv {parts['dkv'] * 1e3:.3f} + dq {parts['dq'] * 1e3:.3f} ms)"
            row = (name, direction, label, sec * 1e3, tflops)
            rows.append(row)
            print(
                f"ROW | {name} | {direction} | {label} | {sec * 1e3:.3f} ms | {tflops:.1f} TFLOP/s | "
                f"({time.perf_counter() - t0:.0f} s with compile)",
                flush=True,
            )
    return rows


def run_parallel(names: list[str], reps: int, only: str | None, labels: list[str] | None, jobs: int):
    """The same rows from one process per (shape, direction, variant), `jobs` at a time: they compile in
    parallel (the compiles are most of the time) and run on the GPU in turns (a file lock)."""
    seed = int(time.time())
    lock = tempfile.mkstemp(suffix=".gpu_lock")[1]
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    todo = [
        (name, direction, label)
        for name in names
        for direction, variants in (("fwd", FORWARD), ("bwd", BACKWARD))
        if only in (None, direction)
        for label, _, _ in variants
        if not labels or label in labels
    ]
    procs, rows = [], []
    for name, direction, label in todo:
        cmd = [sys.executable, __file__, name, "--only", direction, "--variants", label, "--reps", str(reps)]
        cmd += ["--seed", str(seed), "--lock", lock, "--rows-only"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        while sum(p.poll() is None for p in procs) >= jobs:
            time.sleep(0.5)
    for p in procs:
        out, _ = p.communicate()
        for line in out.splitlines():
            if line.startswith("ROW | "):
                print(line, flush=True)
                name, direction, label, ms, tflops = [c.strip() for c in line.split("|")[1:6]]
                rows.append((name, direction, label, float(ms.split()[0]), float(tflops.split()[0])))
        if p.returncode:
            print(f"a variant's process failed (exit {p.returncode}): {p.args}", flush=True)
    order = {t: i for i, t in enumerate(todo)}
    return sorted(rows, key=lambda r: order.get((r[0], r[1], r[2].split(" (")[0]), 0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", help=f"any of {sorted(SHAPES)}")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--only", choices=("fwd", "bwd"))
    p.add_argument("--variants", help="comma-separated labels to time (default: all), e.g. 'no bias,bias'")
    p.add_argument("--check", action="store_true", help="first the default call against the reference")
    p.add_argument("--jobs", type=int, default=1, help="variants compiled in parallel processes")
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)  # (--jobs: the same inputs in every process)
    p.add_argument("--lock", help=argparse.SUPPRESS)  # (--jobs: the GPU's turns)
    p.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shapes {unknown}: choose from {sorted(SHAPES)}")
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    if args.check and not check(int(time.time())):
        return 1
    rows = []
    labels = args.variants.split(",") if args.variants else None
    known = {label for label, _, _ in FORWARD + BACKWARD}
    if labels and set(labels) - known:
        p.error(
            f"unknown variants {sorted(set(labels) - known)}: choose from {sorted(known)} (comma-separated)"
        )
    if args.jobs > 1:
        rows = run_parallel(args.shapes, args.reps, args.only, labels, args.jobs)
    else:
        for name in args.shapes:
            rows += run(name, args.reps, args.only, labels, args.seed, args.lock)
    if args.rows_only:
        return 0
    base = {(r[0], r[1]): r[3] for r in rows if r[2].split(" (")[0] == "bias"}
    nobias = {(r[0], r[1]): r[3] for r in rows if r[2].split(" (")[0] == "no bias"}
    print("\n| shape | dir | variant | ms | TFLOP/s | ms saved vs bias | share of the bias's cost |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, direction, label, ms, tflops in rows:
        full, none = base.get((name, direction)), nobias.get((name, direction))
        saved = share = ""
        if full is not None and label.split(" (")[0] not in ("bias", "no bias"):
            saved = f"{full - ms:.3f}"
            if none is not None and full > none:
                share = f"{(full - ms) / (full - none):.0%}"
        print(f"| {name} | {direction} | {label} | {ms:.3f} | {tflops:.1f} | {saved} | {share} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
