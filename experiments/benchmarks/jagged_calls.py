"""What the attention benchmarks share: fresh inputs, the FLOP count, jitted forward and backward of a call,
and the error measure of the correctness checks (one definition for `bench attention` and its presets).

A call is f(q, k, v, offsets) on [T, H, D] token-major arrays; `jagged` makes one of jagged_attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.timing import median_seconds
from pallas_kernels.jagged_attention import jagged_attention

# rel. L2 error bar of a bf16-input kernel against the float32 reference (the CPU tests' bar for bf16)
CHECK_BAR = 1e-2


def inputs(lengths, h, d, rng, dtype=jnp.bfloat16):
    """(q, k, v, do, offsets) of fresh random values for sequences of these lengths."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    # token capacity: the tokens rounded up to a multiple of 8 (a packed batch's capacity is; the Mosaic GPU
    # forward needs it)
    t = -(-int(offsets[-1]) // 8) * 8
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 4)
    q, k, v, do = (jax.random.normal(key, (t, h, d), jnp.float32).astype(dtype) for key in keys)
    return q, k, v, do, jnp.asarray(offsets)


def fwd_flops(lengths, h, dqk, dv) -> float:
    """generative-recommenders' count of the causal forward: sum_b 2 H (Dqk + Dv) L_b^2 / 2 (backward: 2.5x)."""
    return float(sum(2 * h * (dqk + dv) * int(l) ** 2 / 2 for l in lengths))


def jagged(impl, n, activation, block_sizes=None, options=None, interpret=False, **kw):
    """jagged_attention as a call f(q, k, v, offsets) with everything else fixed."""
    return functools.partial(
        jagged_attention,
        max_seq_len=n,
        activation=activation,
        implementation=impl,
        interpret=interpret,
        block_sizes=block_sizes,
        options=options,
        **kw,
    )


def fwd_bwd(f):
    """(forward, (residuals, pullback)) of a call f(q, k, v, offsets), jitted: time_bwd times the pullback
    alone."""
    fwd = jax.jit(f)

    @jax.jit
    def residuals(q, k, v, off):
        return jax.vjp(lambda q, k, v: f(q, k, v, off), q, k, v)[1]

    pullback = jax.jit(lambda vjp, do: vjp(do))
    return fwd, (residuals, pullback)


def time_bwd(bwd, q, k, v, off, do, reps):
    """Median seconds of the backward pass alone (residuals computed once, outside the timed region)."""
    residuals, pullback = bwd
    vjp = jax.block_until_ready(residuals(q, k, v, off))
    return median_seconds(pullback, vjp, do, reps=reps, warmup=3)


def compare(names, got, want) -> tuple[bool, str]:
    """(whether every array is finite and within CHECK_BAR of its reference by rel. L2 error, "name=error ...")
    of arrays against their references, compared in float32."""
    ok, parts = True, []
    for name, a, r in zip(names, got, want):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        e = float(np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30))
        finite = bool(np.isfinite(a).all())
        ok = ok and finite and e < CHECK_BAR
        parts.append(f"{name}={e:.1e}" + ("" if finite else "(NaN!)"))
    return ok, " ".join(parts)
