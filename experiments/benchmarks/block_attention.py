"""Benchmark of BlockAttention: `python -m experiments bench block_attention [--smoke]`.

1. Correctness: the kernel (the platform's default, Triton interpreted on CPU) against the fp32
   reference on fresh random inputs (ragged, empty, exact-multiple sequences, spare
   capacity filled with NaN), forward and the three gradients, several block sizes.
2. Flatness: time per token for histories of 1k, 4k, 16k, 64k events at a fixed ~4M
   tokens per batch (bf16, H=4, D=128, block_size=64), forward and forward+backward,
   with achieved TFLOP/s and HBM GB/s, against XLA (einsum) and cuDNN on the same
   blocks (aligned reshape: valid because every length is a multiple of block_size).
3. Crossover, per layer, forward+backward: a long-history layer (BlockAttention over
   the prefix, causal softmax jagged attention over the last `--suffix` events, with
   the gather/scatter that splits them) against causal softmax jagged attention over
   the whole history (pallas_kernels.jagged_attention).

FLOPs: a block of n tokens costs 2 H (Dqk + Dv) n^2 forward (half that when causal,
docs/design.md's convention), backward = 2.5 x forward. Bytes: each input read once and
each output written once (forward: q, k, v, o; backward: q, k, v, do, dq, dk, dv).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import shapes
from experiments.benchmarks.timing import median_seconds
from pallas_kernels.block_attention import block_attention
from pallas_kernels.jagged_attention import jagged_attention


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _normal(seed, shape, dtype):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _time(fn, *args, reps: int) -> float:
    return median_seconds(fn, *args, reps=reps, warmup=2)


def _rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _kernel() -> dict:
    """The kernel keywords of the calls timed and checked: the platform's default backend; on CPU the GPU's
    (Triton), interpreted."""
    return dict(implementation=None, interpret=jax.default_backend() == "cpu")


# --- 1. correctness ------------------------------------------------------------------


def check(seed: int, smoke: bool, num_cases: int) -> bool:
    kernel = _kernel()
    cases = [(16, False, jnp.float32), (64, True, jnp.bfloat16), (128, False, jnp.bfloat16)]
    if not smoke:
        cases += [(64, False, jnp.float32), (64, False, jnp.bfloat16), (16, True, jnp.bfloat16)]
    cases = cases[:num_cases]
    shape = shapes.BLOCK_SMOKE if smoke else shapes.BLOCK_FLATNESS
    heads, d = shape.heads, shape.head_dim
    ok = True
    rng = np.random.default_rng(seed)
    for block_size, causal, dtype in cases:
        lengths = [block_size // 2 + 1, 0, 2 * block_size, 3 * block_size + 5, 1]
        lengths += list(rng.integers(0, 4 * block_size, size=2 if smoke else 20))
        offsets = _offsets(lengths)
        real = int(offsets[-1])
        t = real + 37
        seed += 1
        q, k, v, do = (_normal(seed * 10 + i, (t, heads, d), dtype) for i in range(4))
        q, k, v = (x.at[real:].set(jnp.nan) for x in (q, k, v))  # spare capacity
        off = jnp.asarray(offsets)

        def run(which):
            return jax.jit(
                lambda q, k, v, do: (
                    jax.vjp(
                        lambda q, k, v: block_attention(
                            q, k, v, off, block_size=block_size, causal=causal, **which
                        ),
                        q,
                        k,
                        v,
                    )[1](do)
                    + (block_attention(q, k, v, off, block_size=block_size, causal=causal, **which),)
                )
            )

        got = run(kernel)(q, k, v, do)
        ref = run(dict(implementation="reference"))(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), do.astype(jnp.float32)
        )
        errs = {name: _rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "out"), got, ref)}
        # bf16 operands: ~2e-3 expected. fp32: Triton's fp32 dots on the H200 ran at
        # TF32 precision (4-5e-4 measured on the H200), like XLA's default on GPU.
        tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
        spare_zero = all(bool(jnp.all(x[real:] == 0)) for x in got)
        finite = all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in got)
        good = spare_zero and finite and all(e < tol for e in errs.values())
        ok &= good
        print(
            f"check bs={block_size:3d} causal={causal!s:5} {jnp.dtype(dtype).name:8} "
            f"T={t:6d} "
            + " ".join(f"{n}={e:.1e}" for n, e in errs.items())
            + f" spare_zero={spare_zero} finite={finite} -> {'OK' if good else 'FAIL'}",
            flush=True,
        )
    return ok


def _train_step(fn):
    """Forward output and the three gradients: what a training step needs. (Returning
    the gradients alone lets XLA drop a forward whose output the backward never reads.)"""

    def step(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do)

    return jax.jit(step)


# --- 2. flatness -----------------------------------------------------------------------


def _block_flops(lengths, block_size, heads, dqk, dv, causal) -> float:
    n_full, rest = np.divmod(np.asarray(lengths, np.int64), block_size)
    sq = float(np.sum(n_full) * block_size**2 + np.sum(rest**2))
    return 2.0 * heads * (dqk + dv) * sq * (0.5 if causal else 1.0)


def _dense_blocks(implementation, block_size, causal):
    """XLA / cuDNN attention on the [T / bs, bs, H, D] reshape (aligned blocks only)."""

    def fn(q, k, v):
        t, h, d = q.shape
        r = lambda x: x.reshape(t // block_size, block_size, h, x.shape[-1])
        out = jax.nn.dot_product_attention(r(q), r(k), r(v), is_causal=causal, implementation=implementation)
        return out.reshape(t, h, v.shape[-1])

    return fn


def flatness(args, results) -> None:
    heads, d, bs = args.heads, args.dim, args.block_size
    print(
        f"\n== flatness: ~{args.total_tokens} tokens, H={heads} D={d} bf16, "
        f"block_size={bs}, causal={args.causal}",
        flush=True,
    )
    for length in args.lengths:
        num = max(1, args.total_tokens // length)
        lengths = [length] * num
        t = length * num
        off = jnp.asarray(_offsets(lengths))
        q, k, v, do = (_normal(length + i, (t, heads, d), jnp.bfloat16) for i in range(4))
        flops = _block_flops(lengths, bs, heads, d, d, args.causal)
        impls = {
            "pallas": lambda q, k, v: block_attention(
                q, k, v, off, block_size=bs, causal=args.causal, **_kernel()
            )
        }
        for name in args.baselines if not args.smoke else ():
            impls[name] = _dense_blocks(name, bs, args.causal)
        for name, fn in impls.items():
            fwd = jax.jit(fn)
            fwd_bwd = _train_step(fn)
            for mode, f, a, fl, nbytes in (
                ("fwd", fwd, (q, k, v), flops, 4 * t * heads * d * 2),
                ("fwd+bwd", fwd_bwd, (q, k, v, do), 3.5 * flops, 11 * t * heads * d * 2),
                # (bytes: the forward's q, k, v, o plus the backward's 7 arrays)
            ):
                try:
                    sec = _time(f, *a, reps=args.reps)
                except Exception as e:  # noqa: BLE001 - report and go on: the other rows still run
                    print(
                        f"  L={length:6d} {name:6s} {mode:7s} FAILED: {type(e).__name__}: {str(e)[:300]}",
                        flush=True,
                    )
                    continue
                row = dict(
                    section="flatness",
                    length=length,
                    seqs=num,
                    tokens=t,
                    impl=name,
                    mode=mode,
                    ms=sec * 1e3,
                    ns_per_token=sec / t * 1e9,
                    tflops=fl / sec / 1e12,
                    gbps=nbytes / sec / 1e9,
                )
                results.append(row)
                print(
                    f"  L={length:6d} B={num:5d} {name:6s} {mode:7s} {sec * 1e3:8.3f} ms "
                    f"{row['ns_per_token']:7.3f} ns/token {row['tflops']:6.1f} TFLOP/s "
                    f"{row['gbps']:7.0f} GB/s",
                    flush=True,
                )
        del q, k, v, do


# --- 3. crossover ----------------------------------------------------------------------


def crossover(args, results) -> None:
    heads, d, bs, s = args.heads, args.dim, args.block_size, args.suffix
    kernel = _kernel()
    print(
        f"\n== crossover (per layer, fwd+bwd, causal softmax): ~{args.crossover_tokens} "
        f"tokens, suffix={s} events by jagged attention, prefix by BlockAttention bs={bs}",
        flush=True,
    )
    for length in args.crossover_lengths:
        num = max(1, args.crossover_tokens // length)
        t = length * num
        off = _offsets([length] * num)
        # Each history split in place into prefix and suffix "sequences" (so block
        # attention needs no copy); the suffix rows are gathered into their own jagged
        # layout for jagged attention and scattered back over the block output.
        starts = off[:-1]
        pre_len = max(length - s, 0)
        suf_len = length - pre_len
        split_off = jnp.asarray(np.stack([starts, starts + pre_len], 1).reshape(-1).tolist() + [t], jnp.int32)
        suf_idx = (starts[:, None] + pre_len + np.arange(suf_len)[None]).reshape(-1)
        suf_off = jnp.asarray(_offsets([suf_len] * num))
        suf_idx, offj = jnp.asarray(suf_idx), jnp.asarray(off)
        q, k, v, do = (_normal(7 * length + i, (t, heads, d), jnp.bfloat16) for i in range(4))

        def full(q, k, v):
            return jagged_attention(q, k, v, offj, max_seq_len=length, activation="softmax", **kernel)

        def tower(q, k, v):
            # Block attention also runs over the suffix rows (s / L of the work) and
            # is overwritten there: cheaper than gathering the prefix.
            out = block_attention(q, k, v, split_off, block_size=bs, causal=True, **kernel)
            return out.at[suf_idx].set(
                jagged_attention(
                    q[suf_idx],
                    k[suf_idx],
                    v[suf_idx],
                    suf_off,
                    max_seq_len=suf_len,
                    activation="softmax",
                    **kernel,
                )
            )

        row = dict(section="crossover", length=length, seqs=num, tokens=t)
        for name, fn in (("full_jagged", full), ("long_history", tower)):
            f = _train_step(fn)
            try:
                row[name + "_ms"] = _time(f, q, k, v, do, reps=max(3, args.reps // 4)) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"  L={length:6d} {name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        results.append(row)
        if "full_jagged_ms" in row and "long_history_ms" in row:
            print(
                f"  L={length:6d} B={num:5d} full jagged {row['full_jagged_ms']:9.3f} ms  "
                f"long-history {row['long_history_ms']:9.3f} ms  ratio "
                f"{row['full_jagged_ms'] / row['long_history_ms']:5.2f}",
                flush=True,
            )
        del q, k, v, do


# --- main --------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments bench block_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, interpret mode)")
    flat = shapes.BLOCK_FLATNESS
    p.add_argument("--total-tokens", type=int, default=flat.total_tokens)
    p.add_argument("--lengths", type=_ints, default=list(flat.lengths))
    p.add_argument("--heads", type=int, default=flat.heads)
    p.add_argument("--dim", type=int, default=flat.head_dim)
    p.add_argument("--block-size", type=int, default=flat.block_size)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--crossover-tokens", type=int, default=1 << 20)
    p.add_argument("--crossover-lengths", type=_ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument(
        "--suffix", type=int, default=256, help="recent events handled by full jagged attention in the tower"
    )
    p.add_argument("--skip", default="", help="comma list of sections to skip: check,flatness,crossover")
    p.add_argument(
        "--baselines",
        type=lambda x: [b for b in x.split(",") if b],
        default=["xla", "cudnn"],
        help="jax.nn.dot_product_attention implementations timed on the blocks",
    )
    p.add_argument("--check-cases", type=int, default=6)
    p.add_argument("--json", default=None, help="write all rows here")
    args = p.parse_args(argv)
    if args.smoke:
        smoke = shapes.BLOCK_SMOKE
        args.total_tokens, args.lengths = smoke.total_tokens, list(smoke.lengths)
        args.heads, args.dim = smoke.heads, smoke.head_dim
        args.reps, args.crossover_tokens, args.crossover_lengths = 2, 1024, [256, 512]
        args.suffix = 64
    skip = set(args.skip.split(","))
    dev = jax.devices()[0]
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"jax {jax.__version__}, {dev.platform} {dev.device_kind}",
        flush=True,
    )
    results: list[dict] = []
    ok = True
    if "check" not in skip:
        ok = check(seed=int(time.time()) % 100_000, smoke=args.smoke, num_cases=args.check_cases)
        print(f"correctness: {'OK' if ok else 'FAILED'}", flush=True)
    for name, section in (("flatness", flatness), ("crossover", crossover)):
        if name in skip:
            continue
        try:
            section(args, results)
        except Exception:  # noqa: BLE001 - keep the other section's numbers
            traceback.print_exc()
            ok = False
    pallas = {
        (r["length"], r["mode"]): r["ns_per_token"]
        for r in results
        if r.get("section") == "flatness" and r["impl"] == "pallas"
    }
    for mode in ("fwd", "fwd+bwd"):
        vals = [v for (length, m), v in pallas.items() if m == mode]
        if len(vals) > 1:
            print(f"flatness {mode}: max/min time per token = {max(vals) / min(vals):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
