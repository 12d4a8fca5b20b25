"""The fused norm-GEMM-SiLU kernel against XLA's route: `python -m experiments bench norm_gemm`.

The HSTU layer's uvqk step, split(SiLU(LN(x) W + b)) with x the float32 residual stream, at gem_h200's
(T=196,608, 512 -> 4 x 512) and hstu_nvidia's (T=65,536, 1024 -> 4 x 1024) sizes: "reference" is plain jnp
(XLA: the layer-norm fusion, cuBLAS, the SiLU fusion) and "kernel" pallas_kernels.norm_gemm on a Hopper
GPU, with the default tiles and a few others. Every variant is first checked against the reference on fresh
inputs (max difference of the pieces, in bf16 units of the reference's magnitude); a wrong one is reported
and not timed. TFLOP/s count 2 M K N.

"backward" rows: the backward's dz = dy * SiLU'(z), dxn = dz W^T and bias-gradient step (api.silu_backward;
dW and LayerNorm's backward are the same jnp in both): "jnp" is XLA's SiLU-backward fusion, column-sum
reduction and cuBLAS GEMM, "kernel" the backward kernel (gpu_sm90_backward.py) with the default tiles and a
few others, checked against the jnp outputs (dz, dxn, db) on fresh inputs before timing.
On CPU the kernel rows say n/a (tests/test_norm_gemm*.py check the kernels in the Mosaic GPU interpreter).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.timing import median_seconds
from pallas_kernels.norm_gemm import norm_silu_gemm
from pallas_kernels.norm_gemm.api import silu_backward
from pallas_kernels.norm_gemm.tiles import BackwardTiles, Tiles

# (name, M, K, widths)
CASES = [("gem_h200 uvqk", 196_608, 512, (512,) * 4), ("hstu_nvidia uvqk", 65_536, 1024, (1024,) * 4)]
# Forward tile sets by name; "one_per_cta" is the default tiles on a grid of one CTA per output tile (not
# persistent: no CTA runs a second tile), a check of the persistent loop's hand-over between tiles.
TILES = {
    "default": None,
    "one_per_cta": "one_per_cta",
    "n128s2": Tiles(block_n=128, stages=2),
    "n64s3": Tiles(block_n=64, stages=3),
}
BACKWARD_TILES = {
    "default": BackwardTiles(),
    "s2": BackwardTiles(stages=2),
    "n128s4": BackwardTiles(block_n=128, stages=4),
}


def _names(text: str, known: dict) -> list[str]:
    names = [] if text == "none" else (list(known) if text == "all" else text.split(","))
    for name in names:
        if name not in known:
            raise SystemExit(f"unknown tile set {name!r} (known: {', '.join(known)}, all, none)")
    return names


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
    p.add_argument("--forward", default="all", help=f"forward tile sets: {', '.join(TILES)}, all or none")
    p.add_argument(
        "--backward", default="all", help=f"backward tile sets: {', '.join(BACKWARD_TILES)}, all, none"
    )
    args = p.parse_args(argv)
    forward, backward = _names(args.forward, TILES), _names(args.backward, BACKWARD_TILES)
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
        for name in [] if on_cpu else forward:
            t = TILES[name]
            if t == "one_per_cta":
                t = Tiles()
                t = Tiles(num_ctas=(m // (2 * t.block_m)) * (sum(widths) // t.block_n))
            fn = jax.jit(
                lambda *a, t=t, widths=widths: norm_silu_gemm(*a, widths, implementation="mosaic", tiles=t)
            )
            label = f"kernel {name} {t or Tiles()}"
            ok = _check_and_time(label, fn, arrays, want, base, flops, args.reps, "reference") and ok
        if backward:
            ok = _backward(m, k, widths, seed, args.reps, on_cpu, backward) and ok
    return 0 if ok else 1


def _backward(m, k, widths, seed, reps, on_cpu, names) -> bool:
    """The backward's dz / dxn / db step: jnp against the kernel (each tile set checked, then timed)."""
    ks = jax.random.split(jax.random.key(100 + seed), 2 + len(widths))
    n = sum(widths)
    z = (2 * jax.random.normal(ks[0], (m, n))).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    d_pieces = tuple(jax.random.normal(key, (m, wd)).astype(jnp.bfloat16) for key, wd in zip(ks[2:], widths))
    flops = 2.0 * m * k * n
    ref = jax.jit(lambda dp, z, w: silu_backward(dp, z, w, "reference"))
    want = [np.asarray(y, np.float32) for y in ref(d_pieces, z, w)]
    base = median_seconds(ref, d_pieces, z, w, reps=reps)
    print(f"  backward dz/dxn/db jnp: {base * 1e3:.3f} ms ({flops / base / 1e12:.0f} TFLOP/s)", flush=True)
    if on_cpu:
        print("  backward kernel: n/a (needs a Hopper GPU)", flush=True)
        return True
    ok = True
    for name in names:
        t = BACKWARD_TILES[name]
        label = f"backward kernel {name} {t}"
        if not t.applies(m, k, widths):
            print(f"  {label}: does not fit the shape", flush=True)
            continue
        fn = jax.jit(lambda dp, z, w, t=t: silu_backward(dp, z, w, "mosaic", t))
        ok = _check_and_time(label, fn, (d_pieces, z, w), want, base, flops, reps, "jnp") and ok
    return ok


def _check_and_time(label, fn, args, want, base, flops, reps, baseline) -> bool:
    """Runs fn(*args) and compares its outputs with `want` (the largest difference, relative to each output's
    magnitude); times it if right. False where it failed or was wrong (then not timed)."""
    try:
        got = [np.asarray(y, np.float32) for y in fn(*args)]
    except Exception as e:  # a tile set that does not compile: say so, go on
        print(f"  {label}: failed ({type(e).__name__}: {str(e)[:160]})", flush=True)
        return False
    err = max(float(np.max(np.abs(g - r)) / (np.max(np.abs(r)) + 1e-6)) for g, r in zip(got, want))
    if err > 2e-2:
        print(f"  {label}: WRONG (max difference {err:.3g} of the {baseline}'s magnitude)", flush=True)
        return False
    seconds = median_seconds(fn, *args, reps=reps)
    print(f"  {label}: {seconds * 1e3:.3f} ms ({flops / seconds / 1e12:.0f} TFLOP/s), "
          f"{base / seconds:.2f}x {baseline}; max difference {err:.2g}", flush=True)  # fmt: skip
    return True
