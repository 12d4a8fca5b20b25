"""The fused norm-GEMM-SiLU kernel against XLA's route: `python -m experiments bench norm_gemm`.

The HSTU layer's uvqk step, split(SiLU(LN(x) W + b)) with x the float32 residual stream, at gem_h200's
(T=196,608, 512 -> 4 x 512) and hstu_nvidia's (T=65,536, 1024 -> 4 x 1024) sizes: "reference" is plain jnp
(XLA: the layer-norm fusion, cuBLAS, the SiLU fusion) and "kernel" pallas_kernels.norm_gemm on a Hopper
GPU, with the default tiles and a few others. Every variant is first checked against the reference on fresh
inputs (max difference of the pieces, in bf16 units of the reference's magnitude); a wrong one is reported
and not timed. Times are forward only (the kernel's backward is XLA's in both); TFLOP/s count 2 M K N.
On CPU the kernel rows say n/a (tests/test_norm_gemm.py checks the kernel in the Mosaic GPU interpreter).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.timing import median_seconds
from pallas_kernels.norm_gemm import norm_silu_gemm
from pallas_kernels.norm_gemm.gpu_sm90 import Tiles

# (name, M, K, widths)
CASES = [("gem_h200 uvqk", 196_608, 512, (512,) * 4), ("hstu_nvidia uvqk", 65_536, 1024, (1024,) * 4)]
TILES = [
    None,
    Tiles(block_n=128, stages=2),
    Tiles(block_n=64, stages=3),
    Tiles(block_k=64, block_n=128, stages=3),
]


def _inputs(m, k, widths, seed):
    ks = jax.random.split(jax.random.key(seed), 5)
    n = sum(widths)
    x = jax.random.normal(ks[0], (m, k)) * 2 + 0.5
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (k,))
    beta = 0.1 * jax.random.normal(ks[2], (k,))
    w = (jax.random.normal(ks[3], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    return x, gamma, beta, w, 0.1 * jax.random.normal(ks[4], (n,))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments bench norm_gemm", description=__doc__)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="one small case: a smoke test of the command (CPU)")
    args = p.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    cases = CASES if not args.quick else [("small", 128, 128, (64,))]
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    ok = True
    for seed, (name, m, k, widths) in enumerate(cases):
        arrays = _inputs(m, k, widths, seed)
        flops = 2.0 * m * k * sum(widths)
        ref = jax.jit(lambda *a, widths=widths: norm_silu_gemm(*a, widths, implementation="reference"))
        want = [np.asarray(y, np.float32) for y in ref(*arrays)]
        base = median_seconds(ref, *arrays, reps=args.reps)
        print(f"{name} (M={m} K={k} N={sum(widths)}): reference {base * 1e3:.3f} ms "
              f"({flops / base / 1e12:.0f} TFLOP/s)", flush=True)  # fmt: skip
        if on_cpu:  # the interpreter is far too slow at these shapes; tests/test_norm_gemm.py runs small ones
            print("  kernel: n/a (needs a Hopper GPU)", flush=True)
            continue
        for t in TILES:
            label = f"kernel {t or 'default tiles'}"
            fn = jax.jit(
                lambda *a, t=t, widths=widths: norm_silu_gemm(*a, widths, implementation="pallas", tiles=t)
            )
            try:
                got = [np.asarray(y, np.float32) for y in fn(*arrays)]
            except Exception as e:  # a tile that does not compile: say so, go on
                print(f"  {label}: failed ({type(e).__name__}: {str(e)[:160]})", flush=True)
                ok = False
                continue
            err = max(float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-6)) for g, w in zip(got, want))
            if err > 2e-2:
                print(f"  {label}: WRONG (max difference {err:.3g} of the reference's magnitude)", flush=True)
                ok = False
                continue
            seconds = median_seconds(fn, *arrays, reps=args.reps)
            print(f"  {label}: {seconds * 1e3:.3f} ms ({flops / seconds / 1e12:.0f} TFLOP/s), "
                  f"{base / seconds:.2f}x reference; max difference {err:.2g}", flush=True)  # fmt: skip
    return 0 if ok else 1
