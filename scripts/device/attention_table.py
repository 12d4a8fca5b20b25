"""The jagged attention kernels' table on one GPU: the default call at any token count T, with and without the
GEM relative bias, against the same call with T padded to a multiple of 8 and the Triton kernels by name.

  python3 scripts/device/attention_table.py SHAPE [SHAPE ...] [--reps R] [--no-triton]

SHAPE: u1k (B=512, lengths in [0.9N, N), N=1024), u4k (the same, N=4096), h4k (B=2048, log-normal lengths,
N=4096); H=4, D=128, bf16, SiLU. The bias is configs/gem_h200.toml's (position 128 + time 64 buckets, sorted
timestamps about a minute apart).

For each shape and bias setting, on fresh random inputs with T = the exact token count: first the default call's
output and gradients (q, k, v and the bias tables) against implementation="triton"'s on the same inputs
(rel. L2 < 1e-2, finite: the two families share no code), then forward and backward timed (median of R after
warm-up; the backward alone, its residuals computed once) at that T and at T rounded up to a multiple of 8,
and (without --no-triton) the Triton kernels by name at the padded T. Prints one ROW line per timing with
TFLOP/s by generative-recommenders' count (forward = sum_b 2 H (Dqk + Dv) L_b^2 / 2, backward = 2.5x) and
which kernels ran (pallas_kernels.jagged_attention.kernels_in_use), then a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import shapes
from experiments.benchmarks.timing import median_seconds
from pallas_kernels.jagged_attention import jagged_attention, kernels_in_use

SHAPES = {"u1k": shapes.PEER_N1024, "u4k": shapes.PEER_N4096, "h4k": shapes.HEAVY_TAIL}
BAR = 1e-2


def _inputs(lengths, shape: shapes.JaggedShape, rng, bias: bool):
    """(q, k, v, do, offsets, extras) with T = the exact token count (no capacity past offsets[B])."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t, h, d = int(offsets[-1]), shape.heads, shape.head_dim
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 4)
    q, k, v, do = (jax.random.normal(key, (t, h, d), jnp.float32).astype(jnp.bfloat16) for key in keys)
    extras = {}
    if bias:
        b = shapes.GEM_H200_BIAS
        extras["timestamps"] = jnp.asarray(np.cumsum(rng.integers(1, 120, size=t)), jnp.int32)
        extras["pos_bias"] = jnp.asarray(rng.standard_normal((h, b.num_pos)) * 0.1, jnp.float32)
        extras["time_bias"] = jnp.asarray(rng.standard_normal((h, b.num_time)) * 0.1, jnp.float32)
    return q, k, v, do, jnp.asarray(offsets), extras


def _padded(q, k, v, do, extras):
    """The same call with T rounded up to a multiple of 8 (rows past offsets[B] are unused capacity)."""
    t = q.shape[0]
    rows = -(-t // 8) * 8 - t
    pad = lambda x: jnp.pad(x, ((0, rows),) + ((0, 0),) * (x.ndim - 1))
    extras = dict(extras)
    if "timestamps" in extras:
        extras["timestamps"] = pad(extras["timestamps"])
    return pad(q), pad(k), pad(v), pad(do), extras


def _call(n, impl, q, k, v, off, tables, rest):
    return jagged_attention(q, k, v, off, max_seq_len=n, implementation=impl, **rest, **tables)


def _split(extras):
    tables = {key: extras[key] for key in ("pos_bias", "time_bias") if key in extras}
    return tables, {key: val for key, val in extras.items() if key not in tables}


def check(n, q, k, v, do, off, extras) -> tuple[bool, str]:
    """The default call's output and gradients against implementation="triton"'s on the same inputs."""
    tables, rest = _split(extras)

    def loss(impl, q, k, v, tables, do, off, rest):
        o = _call(n, impl, q, k, v, off, tables, rest)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True), static_argnums=0)
    got, want = (grad(impl, q, k, v, tables, do, off, rest) for impl in (None, "triton"))
    flat = lambda g: [g[1], *g[0][:3], *jax.tree.leaves(g[0][3])]
    ok, parts = True, []
    for name, a, r in zip(("out", "dq", "dk", "dv", "dpos", "dtime"), flat(got), flat(want)):
        a, r = a.astype(jnp.float32), r.astype(jnp.float32)
        e = float(jnp.linalg.norm(a - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30))
        finite = bool(jnp.isfinite(a).all())
        ok = ok and finite and e < BAR
        parts.append(f"{name}={e:.1e}" + ("" if finite else "(NaN!)"))
    return ok, " ".join(parts)


def timed(n, impl, reps, q, k, v, do, off, extras) -> tuple[float, float]:
    """(forward s, backward s): medians; the backward alone (residuals computed once)."""
    tables, rest = _split(extras)  # (arrays are arguments: closed over, jit would embed them as constants)
    f = functools.partial(_call, n, impl)
    fwd = jax.jit(f)
    residuals = jax.jit(
        lambda q, k, v, off, tables, rest: jax.vjp(
            lambda q, k, v, tables: f(q, k, v, off, tables, rest), q, k, v, tables
        )[1]
    )
    pullback = jax.jit(lambda vjp, do: vjp(do))
    tf = median_seconds(fwd, q, k, v, off, tables, rest, reps=reps, warmup=3)
    vjp = jax.block_until_ready(residuals(q, k, v, off, tables, rest))
    tb = median_seconds(pullback, vjp, do, reps=reps, warmup=3)
    return tf, tb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-triton", action="store_true")
    args = p.parse_args()
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    rng = np.random.default_rng(int(time.time()))
    rows, ok_all = [], True
    for name in args.shapes:
        shape = SHAPES[name]
        n = shape.max_seq_len
        lengths = shape.sample_lengths(rng)
        flops = float(sum(2 * shape.heads * 2 * shape.head_dim * int(x) ** 2 / 2 for x in lengths))
        for bias in (False, True):
            q, k, v, do, off, extras = _inputs(lengths, shape, rng, bias)
            label = f"{name} {'bias' if bias else 'no bias'}"
            spec = jax.ShapeDtypeStruct(q.shape, q.dtype)
            b = shapes.GEM_H200_BIAS
            bias_kw = dict(num_pos=b.num_pos, num_time=b.num_time) if bias else {}
            t0 = time.perf_counter()
            ok, errs = check(n, q, k, v, do, off, extras)
            ok_all = ok_all and ok
            print(f"CHECK {label} T={q.shape[0]} default vs triton: {errs} -> {'OK' if ok else 'FAIL'} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
            padded = _padded(q, k, v, do, extras)
            runs = [("default", None, (q, k, v, do, extras)), ("padded T", None, padded)]
            if not args.no_triton:
                runs.append(("triton, padded T", "triton", padded))
            for what, impl, (qq, kk, vv, dd, ex) in runs:
                used = kernels_in_use(jax.ShapeDtypeStruct(qq.shape, qq.dtype), spec, max_seq_len=n,
                                      implementation=impl, **bias_kw)  # fmt: skip
                tf, tb = timed(n, impl, args.reps, qq, kk, vv, dd, off, ex)
                row = (
                    label,
                    what,
                    qq.shape[0],
                    flops / tf / 1e12,
                    2.5 * flops / tb / 1e12,
                    tf * 1e3,
                    tb * 1e3,
                )
                rows.append((*row, "/".join(used)))
                print("ROW", rows[-1], flush=True)
    print("\n| case | call | T | fwd TFLOP/s | bwd TFLOP/s | fwd ms | bwd ms | kernels (fwd/bwd) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for label, what, t, f, b, tf, tb, used in rows:
        print(f"| {label} | {what} | {t} | {f:.0f} | {b:.0f} | {tf:.3f} | {tb:.3f} | {used} |")
    print("checks:", "all OK" if ok_all else "FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
