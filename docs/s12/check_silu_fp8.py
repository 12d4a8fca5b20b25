"""Session 12: the SiLU-backward FP8 kernel on the GPU against its jnp reference, fresh random inputs at
gem_h200's uvqk shape (196,608 x 4 x 512) and hstu_nvidia's (65,536 x 4 x 1024), then both timed.
`python docs/s12/check_silu_fp8.py`; exit 1 if the kernel disagrees."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.timing import median_seconds
from pallas_kernels.silu_backward_fp8 import silu_backward_fp8


def timed(f, *args):
    return median_seconds(f, *args, reps=20) * 1e3


def main():
    ok = True
    for m, w in ((196608, 512), (65536, 1024)):
        keys = jax.random.split(jax.random.key(m + w), 5)
        dys = tuple(jax.random.normal(keys[i], (m, w), jnp.bfloat16) * 0.01 for i in range(4))
        z = jax.random.normal(keys[4], (m, 4 * w), jnp.bfloat16) * 2
        scale = jnp.float32(0.05 / 57344)  # the largest |g| is ~0.05: a few clip
        run = {
            impl: jax.jit(lambda d, z, s, impl=impl: silu_backward_fp8(d, z, s, implementation=impl))
            for impl in ("pallas", "reference")
        }
        got, want = run["pallas"](dys, z, scale), run["reference"](dys, z, scale)
        q, q_ref = np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32))
        qt = np.asarray(got[1].astype(jnp.float32))
        differ = np.mean(q != q_ref)
        step = np.max(np.abs(q - q_ref) / np.maximum(np.abs(q_ref), 2.0**-16))
        transposed = np.array_equal(qt, q.T)
        amax_rel = abs(float(got[2]) - float(want[2])) / float(want[2])
        sums_rel = float(jnp.linalg.norm(got[3] - want[3]) / jnp.linalg.norm(want[3]))
        good = differ < 1e-3 and step <= 0.25 and transposed and amax_rel < 1e-5 and sums_rel < 1e-4
        ok &= good
        print(
            f"M={m} pieces 4 x {w}: q differs in {differ:.2e} of elements (largest relative step {step:.3f}), "
            f"q^T is q transposed: {transposed}, amax rel {amax_rel:.1e}, column sums rel {sums_rel:.1e}: "
            f"{'ok' if good else 'WRONG'}",
            flush=True,
        )
        ms = {impl: timed(f, dys, z, scale) for impl, f in run.items()}
        gb = 6 * m * 4 * w / 1e9  # reads dys and z in bf16 (4 bytes an element), writes q and q^T in e5m2 (2)
        print(
            f"  kernel {ms['pallas']:.3f} ms ({gb / ms['pallas'] * 1e3:.0f} GB/s counted once), XLA reference "
            f"{ms['reference']:.3f} ms: {ms['reference'] / ms['pallas']:.2f}x",
            flush=True,
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
