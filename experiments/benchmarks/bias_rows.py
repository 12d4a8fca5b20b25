"""How long the jagged attention's bias_rows array takes to build: `python -m experiments bench bias_rows`.

The GPU kernels load the relative bias from an [H, T, W] array that XLA builds once per call
(pallas_kernels.jagged_attention.gpu_layout.bias_rows). This times the shipped build against other formulations and
two lower bounds (the head-independent bucket array alone; writing the array without computing it), on the
attention benchmark's uniform shape and a gem_h200-like heavy-tailed one, with the forward (bias_rows, bias
computed in the kernels, no bias) beside them. Each variant is checked against the shipped build first.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.timing import median_seconds
from pallas_kernels.jagged_attention import gpu_layout, jagged_attention, tiling
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.params import KernelParams

# Every variant has gpu_layout.bias_rows's signature:
# (offsets, ts, pos_tab, time_tab, params, *, total_rows, heads, dtype).


def combined_table(offsets, ts, pos_tab, time_tab, params, *, total_rows, heads, dtype):
    """One gather per element from an [H, P * NT] table of position + time sums (instead of two)."""
    delta, bucket = gpu_layout.bias_cells(offsets, ts, params, t=total_rows)
    width = time_tab.shape[1]
    table = (pos_tab[:, : params.num_pos, None] + time_tab[:heads, None, :]).reshape(heads, -1)
    return table[:, jnp.clip(delta, 0, params.num_pos - 1) * width + bucket].astype(dtype)


def bucket_array_only(offsets, ts, pos_tab, time_tab, params, *, total_rows, heads, dtype):
    """Lower bound: the head- and layer-independent [T, W] time-bucket array (shared by a model's layers)."""
    return gpu_layout.bias_cells(offsets, ts, params, t=total_rows)[1]


def write_only(offsets, ts, pos_tab, time_tab, params, *, total_rows, heads, dtype):
    """Lower bound: writing an [H, T, W] array of one value per head."""
    width = tiling.bias_width(params.max_seq_len, params.blocks)
    return jnp.zeros((heads, total_rows, width), dtype) + pos_tab[:, :1, None].astype(dtype)


VARIANTS = {
    "shipped (bucket array, two gathers)": gpu_layout.bias_rows,
    "one gather from a pos + time table": combined_table,
    "bucket array alone (bound)": bucket_array_only,
    "write only (bound)": write_only,
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments bench bias_rows", description=__doc__)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small shapes (smoke test, e.g. on CPU)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    h, d = 4, 128
    if args.quick:
        cases = [("uniform N=64 B=4", rng.integers(58, 64, 4), 64)]
    else:
        heavy = np.minimum(np.exp(rng.normal(np.log(400), 1.0, 300)).astype(int) + 1, 2048)
        cases = [
            ("uniform N=1024 B=512", rng.integers(922, 1024, 512), 1024),
            ("log-normal median 400, cut at 2048", heavy, 2048),
        ]
    kernel = dict(implementation="triton", interpret=jax.default_backend() == "cpu")  # the bias_rows array's
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    ok = True
    for name, lengths, n in cases:
        off = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        t = int(off[-1])
        ts = jnp.asarray(np.cumsum(rng.integers(1, 120, t)), jnp.int32)
        pos = jnp.asarray(rng.standard_normal((h, 128)) * 0.1, jnp.float32)
        tim = jnp.asarray(rng.standard_normal((h, 64)) * 0.1, jnp.float32)
        params = KernelParams.build(
            n,
            "silu",
            alpha=1 / np.sqrt(d),
            num_pos=128,
            num_time=64,
            interpret=False,
            blocks=BlockSizes(),
            bias_rows=True,
        )
        zeros = jnp.zeros((t, h, d), jnp.bfloat16)
        inputs = gpu_layout.to_kernel_layout(zeros, zeros, zeros, off, None, ts, pos, tim, params)
        build_args = (inputs[3], inputs[5], inputs[6], inputs[7])
        sizes = dict(total_rows=t, heads=h, dtype=jnp.bfloat16)
        shipped = jax.jit(lambda *a: gpu_layout.bias_rows(*a, params, **sizes))(*build_args)
        width = tiling.bias_width(n, params.blocks)
        print(f"{name}: T {t}, {h * t * width / 1e9:.2f} G cells (H x T x W)", flush=True)
        for label, fn in VARIANTS.items():
            f = jax.jit(lambda *a, fn=fn: fn(*a, params, **sizes))
            out = f(*build_args)
            same = "-"
            if out.shape == shipped.shape and "bound" not in label:
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - shipped.astype(jnp.float32))))
                same = "yes" if err <= 1e-2 else f"NO (max abs diff {err:.3g})"
                ok &= err <= 1e-2
            del out
            ms = median_seconds(f, *build_args, reps=args.reps, warmup=2) * 1e3
            print(f"  build, {label}: {ms:.3f} ms (equals the shipped build: {same})", flush=True)
        del shipped
        q, k, v = (
            jax.random.normal(jax.random.key(i), (t, h, d), jnp.float32).astype(jnp.bfloat16)
            for i in range(3)
        )
        bias = dict(timestamps=ts, pos_bias=pos, time_bias=tim)
        for label, kw in [
            ("bias_rows", bias),
            ("bias computed in the kernels", dict(bias, options=KernelOptions(bias_rows=False))),
            ("no bias", {}),
        ]:
            f = jax.jit(functools.partial(jagged_attention, max_seq_len=n, **kernel, **kw))
            ms = median_seconds(f, q, k, v, off, reps=args.reps, warmup=2) * 1e3
            print(f"  forward, {label}: {ms:.3f} ms", flush=True)
    return 0 if ok else 1
