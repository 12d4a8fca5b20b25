"""Single-pass (dQ by atomics) vs two-kernel GPU backward of jagged attention: `python -m experiments.bench_fused_bwd`.

Correctness first: both backwards against the float32 reference (bf16 inputs, fresh random inputs, rel. L2,
NaN check) on a small jagged batch with and without targets + window, and the fused one against the
two-kernel one on every timed shape. Then the median of --reps timed calls (after warm-up) of each backward
alone: residuals (o, lse) are computed once before timing, as experiments/bench_attention.py does.
TFLOP/s: backward = 2.5 x forward, forward = sum_b 2 H (Dqk + Dv) L_b^2 / 2 (DESIGN.md).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_attention import _inputs, _lengths, _relaxed_atomics, fwd_flops
from experiments.timing import median_seconds
from pallas_kernels.jagged_attention import gpu, gpu_fused_bwd, jagged_attention
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.tiling import Static


def _static(n, d, activation, blocks=None, targets=False, window=0) -> Static:
  interpret = jax.default_backend() == "cpu"
  blocks = blocks or BlockSizes.get_default("cpu" if interpret else "gpu", d, n)
  return Static(max_seq_len=n, activation=activation, alpha=1.0 / math.sqrt(d), max_attn_len=window,
                has_targets=targets, has_pos=False, has_time=False, num_pos=1, num_time=1, interpret=interpret,
                blocks=blocks)


def _extras(b, h):
  """(targets, ts, pos_tab, time_tab) placeholders as jagged_attention_gpu builds them without bias."""
  return (jnp.zeros((b,), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((h, 16), jnp.float32),
          jnp.zeros((h, 16), jnp.float32))


@jax.jit
def _rel_err(a, r):
  """(||a - r|| / ||r||, all finite) on the device: the N=4096 gradients are 2 GB each."""
  a, r = a.astype(jnp.float32), r.astype(jnp.float32)
  return jnp.linalg.norm(a - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30), jnp.isfinite(a).all()


def _rel(a, r) -> str:
  e, finite = _rel_err(a, r)
  return f"{float(e):.1e}" + ("" if bool(finite) else "(NaN!)")


def check(rng, n=512, b=24, h=4, d=128) -> list[str]:
  """Rel. L2 of dq, dk, dv of the fused and the two-kernel backward vs the float32 reference."""
  rows = []
  lengths = np.concatenate([[0, 1, n, n - 1], rng.integers(1, n, size=b - 4)])
  for activation in ("silu", "softmax"):
    for targets in (False, True):
      q, k, v, do, off = _inputs(lengths, h, d, rng)
      window = 100 if targets else 0
      tgt = jnp.asarray(rng.integers(0, 5, size=b), jnp.int32) if targets else jnp.zeros((b,), jnp.int32)
      s = _static(n, d, activation, targets=targets, window=window)
      extras = (tgt,) + _extras(b, h)[1:]
      ref = lambda q, k, v: jagged_attention(q, k, v, off, max_seq_len=n, activation=activation,
                                             max_attn_len=window, num_targets=tgt if targets else None,
                                             implementation="reference")
      f32 = lambda x: x.astype(jnp.float32)
      want = jax.jit(lambda *x: jax.vjp(ref, *x[:3])[1](x[3]))(f32(q), f32(k), f32(v), f32(do))
      line = f"check {activation:7s} {'targets+window' if targets else 'plain':14s}"
      for name, attn in (("fused", gpu_fused_bwd.attention), ("two-kernel", gpu._attention)):
        fn = lambda q, k, v, do, attn=attn: jax.vjp(lambda q, k, v: attn(q, k, v, off, *extras, s=s), q, k, v)[1](do)
        got = jax.jit(fn)(q, k, v, do)
        line += f" | {name}: " + " ".join(f"{nm}={_rel(a, r)}" for nm, a, r in zip(("dq", "dk", "dv"), got, want))
      rows.append(line)
      print(line, flush=True)
  return rows


def _residuals(s, q, k, v, off):
  extras = _extras(off.shape[0] - 1, q.shape[1])
  o, lse = jax.jit(functools.partial(gpu._forward, s=s))(q, k, v, off, *extras)
  return jax.block_until_ready((q, k, v, off) + extras + (o, lse))


def bench_case(name, n, activation, rng, reps, variants, b=512, h=4, d=128):
  """Times each variant's backward on one shape; returns table rows (name, variant, TFLOP/s, ms, max rel err)."""
  lengths = _lengths("uniform", b, n, rng)
  q, k, v, do, off = _inputs(lengths, h, d, rng)
  flops = 2.5 * fwd_flops(lengths, h, d, d)
  base = None
  rows = []
  res = _residuals(_static(n, d, activation), q, k, v, off)  # the sweep changes only the backward's tiles
  for label, blocks, fused, relaxed in variants:
    s = _static(n, d, activation, blocks)
    try:
      fn = gpu._backward if fused is None else functools.partial(gpu_fused_bwd.backward_fused, dq_probe=fused)
      if relaxed:  # does the probe reach the lowering? (its kernel text must differ from the default's)
        lowered = lambda: jax.jit(functools.partial(fn, s)).lower(res, do).as_text()
        default = lowered()
        with _relaxed_atomics():
          print(f"{label}: lowering differs from acq_rel: {lowered() != default}", flush=True)
      with _relaxed_atomics() if relaxed else contextlib.nullcontext():
        # a fresh function object per variant: jit must re-lower (the relaxed patch acts at lowering time)
        bwd = jax.jit(functools.partial(fn, s))
        grads = jax.block_until_ready(bwd(res, do))[:3]
      err = "-"
      if base is None:
        base = grads
      else:
        err = " ".join(f"{nm}={_rel(a, r)}" for nm, a, r in zip(("dq", "dk", "dv"), grads, base))
      del grads
      sec = median_seconds(bwd, res, do, reps=reps, warmup=3)
    except Exception as e:  # one failing variant (e.g. shared memory) must not hide the others
      print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
      continue
    rows.append((name, label, flops / sec / 1e12, sec * 1e3, err))
    print(f"{name} | {label} | {rows[-1][2]:.1f} TFLOP/s | {rows[-1][3]:.3f} ms | vs first: {err}", flush=True)
  return rows


SWEEP = "64x128s2,128x128s2,128x128s1,128x64s1,128x64s3,32x128s2"


def _variants(tiles: str, relaxed: bool, probes: bool = False):
  """(label, BlockSizes, dq mode or None for two-kernel, relaxed) per timed backward: the two-kernel baseline
  first, then the fused one at the default tiles and at each BQxBKsSTAGES[wWARPS] of `tiles`, each also with
  relaxed atomics and the cost probes (gpu_fused_bwd.DQ_PROBES: wrong dQ, for attribution) if asked."""
  two = BlockSizes()
  out = [("two-kernel (gpu._backward)", two, None, False)]
  for spec in ["128x64s2"] + [x for x in tiles.split(",") if x and x != "128x64s2"]:
    shape, _, rest = spec.partition("s")
    stages, _, warps = rest.partition("w")
    bq, bk = (int(x) for x in shape.split("x"))
    bs = dataclasses.replace(two, block_q_dkv=bq, block_k_dkv=bk, num_stages_bwd=int(stages),
                             num_warps_bwd=int(warps or two.num_warps_bwd))
    label = f"fused {bq}x{bk} w{bs.num_warps_bwd} s{bs.num_stages_bwd}"
    out.append((label, bs, "atomic", False))
    if relaxed:
      out.append((label + " relaxed", bs, "atomic", True))
    if probes:
      out += [(f"{label} probe dq={p} (wrong dQ)", bs, p, False) for p in gpu_fused_bwd.DQ_PROBES[1:]]
  return out


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="python -m experiments.bench_fused_bwd", description=__doc__)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--cases", default="1024:silu,4096:silu,1024:softmax", help="comma list of N:activation")
  p.add_argument("--batch", type=int, default=512)
  p.add_argument("--sweep", action="store_true", help=f"also time the fused backward at --tiles")
  p.add_argument("--tiles", default=SWEEP, help="comma list of BQxBKsSTAGES[wWARPS] for --sweep")
  p.add_argument("--sweep-cases", default="1024:silu", help="cases the sweep applies to")
  p.add_argument("--relaxed", action="store_true", help="also time relaxed-ordering atomics (jax-internal probe)")
  p.add_argument("--probes", action="store_true", help="also time the fused kernel without dQ atomics (wrong dQ)")
  p.add_argument("--no-check", action="store_true")
  p.add_argument("--quick", action="store_true", help="small shapes (smoke test, e.g. on CPU)")
  args = p.parse_args(argv)
  rng = np.random.default_rng(int(time.time()))
  print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} "
        f"date={time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC", flush=True)
  checks = [] if args.no_check else check(rng, *((64, 8, 2, 16) if args.quick else ()))
  rows = []
  kw = dict(b=8, h=2, d=16) if args.quick else dict(b=args.batch)
  for case in args.cases.split(","):
    n, activation = case.split(":")
    variants = _variants(args.tiles if args.sweep and case in args.sweep_cases.split(",") else "", args.relaxed, args.probes)
    rows += bench_case(f"{activation} uniform N={n} B={kw['b']}", int(n), activation, rng, args.reps, variants,
                       **kw)
  print("\n| case | backward | TFLOP/s | ms | vs two-kernel |\n| --- | --- | --- | --- | --- |")
  base = {}
  for name, label, tf, ms, _ in rows:
    base.setdefault(name, tf)
    print(f"| {name} | {label} | {tf:.1f} | {ms:.3f} | {tf / base[name]:.2f}x |")
  print("\n".join(checks))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
