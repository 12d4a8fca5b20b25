"""The Hopper (Mosaic GPU) jagged attention backward against the Triton one, on the device (H100/H200).

  python3 scripts/device/attention_bwd_sm90.py check [I ...]    (small shapes vs the float32 reference; I: case indices)
  python3 scripts/device/attention_bwd_sm90.py time CASE [REPS]  (CASE: one of CASES)
  python3 scripts/device/attention_bwd_sm90.py sweep CASE [REPS]  (the Mosaic backward's tile knobs, KNOBS)
  python3 scripts/device/attention_bwd_sm90.py meet [CASE [REPS]]  (D=256: KernelOptions.split_meet on / off)

`check` runs jagged_attention's gradients (dq, dk, dv; dpos, dtime with the bias) with the default kernels
(on Hopper Mosaic GPU wherever it takes the call) against the float32 reference on fresh random inputs: SiLU and
softmax, window and targets, D = 64, 128 and 256, unaligned sequence starts, length 1 and empty sequences, capacity past
offsets[B] (must come out zero), and reduced-batch versions of the timed shapes. `time` first checks the Mosaic backward
against the Triton backward on the full shape's fresh inputs (rel. L2 < 1e-2, finite, tail rows zero), then
times both backwards (residuals computed once, the backward alone: experiments/benchmarks/attention.py) and
prints one ROW line. TFLOP/s by the peer's count: backward = 2.5 x sum_b 2 H (Dqk + Dv) L_b^2 / 2. Each line says
which backward actually ran (a call gpu_sm90_backward.supports rejects runs the Triton one). The relative bias
is opted in (KernelOptions.hopper_backward_bias) here, and so is head dim 256 (KernelOptions.hopper_backward_d256:
the role-split dK/dV kernel, off by default until these checks and times pass on a device). `sweep` times
backward_mosaic_gpu itself with each knob set of KNOBS on the residuals of one forward (checked against the default
knobs' gradients first; at D=256 only the default 64:2:32:2 fits shared memory, D256_KNOBS). `meet` times the
D=256 backward with and without the consumers' meeting per query tile (KernelOptions.split_meet), each
checked against the first.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import jagged_calls, shapes
from experiments.benchmarks.jagged_calls import fwd_flops
from pallas_kernels.jagged_attention import gpu_layout, jagged_attention
from pallas_kernels.jagged_attention import gpu_sm90_backward as mosaic_bwd
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.params import KernelParams

BAR = 1e-2  # rel. L2 of a bf16-input kernel against the float32 reference (the CPU tests' bar)
# (implementation, options) of each backward: the default (Mosaic GPU wherever gpu_sm90_backward.supports takes
# the call, the bias and D = 256 opted in) and Triton's, A/B by name
MOSAIC = (None, KernelOptions(hopper_backward_bias=True, hopper_backward_d256=True))
TRITON = ("triton", None)
# backward_mosaic_gpu knob sets for `sweep`: (dK/dV query-tile rows, its slots, dQ key-tile rows, its slots)
KNOBS = {"64:2:64:2": (64, 2, 64, 2), "128:2:64:2": (128, 2, 64, 2), "64:3:64:3": (64, 3, 64, 3)}
KNOBS["64:2:128:2"] = (64, 2, 128, 2)
# at D=256 (the role-split dK/dV kernel): the default, and 32-row query tiles (the exchange tile and the dV/dK
# wgmmas' K halve; 64-byte swizzle) with 3 slots, which fits beside the resident K and V
D256_KNOBS = {"64:2:32:2": (64, 2, 32, 2), "32:3:32:2": (32, 3, 32, 2)}
SWEEP_KW = {}  # further backward_mosaic_gpu arguments (a CPU smoke run: interpret mode)

CASES = {
    "n1024": ("silu N=1024 B=512 D=128", shapes.PEER_N1024, "silu", None),
    "n4096": ("silu N=4096 B=512 D=128", shapes.PEER_N4096, "silu", None),
    "heavy": ("silu heavy-tailed N=4096 B=2048 D=128", shapes.HEAVY_TAIL, "silu", None),
    "d64": ("silu full N=16384 B=16 D=64", shapes.NVIDIA_D64, "silu", None),
    "d256": ("silu full N=4096 B=64 D=256", shapes.NVIDIA_D256, "silu", None),
    "bias1024": ("silu N=1024 B=512 + pos 128 + time 64", shapes.PEER_N1024, "silu", shapes.GEM_H200_BIAS),
    "softmax": ("softmax dense B=8 T=4096 H=16 D=128", shapes.DENSE_H16, "softmax", None),
}


def _extras(rng, t, h, b, targets, window, bias: shapes.RelativeBias | None, unsorted=False):
    kw = {}
    if targets:
        kw["num_targets"] = jnp.asarray(rng.integers(0, 40, size=b), jnp.int32)
    if window:
        kw["max_attn_len"] = window
    if bias is not None:
        ts = np.cumsum(rng.integers(1, 120, size=t))
        if unsorted:
            ts = rng.permutation(ts)
        kw["timestamps"] = jnp.asarray(ts, jnp.int32)
        kw["pos_bias"] = jnp.asarray(rng.standard_normal((h, bias.num_pos)) * 0.3, jnp.float32)
        kw["time_bias"] = jnp.asarray(rng.standard_normal((h, bias.num_time)) * 0.3, jnp.float32)
    return kw


def _grads(q, k, v, off, do, n, activation, impl, options, kw):
    """(dq, dk, dv[, dpos, dtime]) of sum(out * do) in float32 (on the device), and whether the Mosaic GPU
    backward ran (the Triton backward's kernels are not in the lowered graph)."""
    tables = [kw.get("pos_bias"), kw.get("time_bias")] if "pos_bias" in kw else []
    rest = {key: val for key, val in kw.items() if key not in ("pos_bias", "time_bias")}

    # do, off and the extras are arguments, not closed over: captured as constants they cost minutes of compile
    def loss(q, k, v, tables, do, off, rest):
        extra = dict(zip(("pos_bias", "time_bias"), tables))
        o = jagged_attention(
            q, k, v, off, max_seq_len=n, activation=activation, implementation=impl, options=options,
            **rest, **extra,
        )  # fmt: skip
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    statics = {key: val for key, val in rest.items() if not isinstance(val, jax.Array)}
    arrays = {key: val for key, val in rest.items() if isinstance(val, jax.Array)}
    grad = jax.grad(lambda q, k, v, tables, do, off, arrays: loss(q, k, v, tables, do, off, arrays | statics),
                    argnums=(0, 1, 2, 3))  # fmt: skip
    args = (q, k, v, tables, do, off, arrays)
    lowered = jax.jit(grad).lower(*args)  # lowered and compiled once: its text says which backward ran
    text = lowered.as_text() if impl != "reference" else ""
    mosaic = "mosaic_gpu" in text and "jagged_attention_bwd_dq" not in text
    dq, dk, dv, dtables = lowered.compile()(*args)
    return [g.astype(jnp.float32) for g in (dq, dk, dv, *dtables)], mosaic


def _rel(a, r) -> float:
    return float(jnp.linalg.norm(a - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30))


def _compare(got, want, tail, triton=None) -> tuple[bool, str]:
    """Rel. L2 errors; each must be < BAR, or (given the Triton backward's gradients) at most 1.5x Triton's own
    error against the same reference (softmax's time-table gradient sums dS whose rows sum to zero: bf16 O in
    delta moves it past the bar for both kernels)."""
    ok, parts = True, []
    for i, (name, a, r) in enumerate(zip(("dq", "dk", "dv", "dpos", "dtime"), got, want)):
        e = _rel(a, r)
        bar = BAR if triton is None else max(BAR, 1.5 * _rel(triton[i], r))
        finite = bool(jnp.isfinite(a).all())
        tail_zero = name in ("dpos", "dtime") or not bool(jnp.any(a[tail:] != 0))
        ok = ok and finite and tail_zero and e < bar
        if triton is not None and bar > BAR:
            name += f"(Triton {_rel(triton[i], r):.1e})"
        parts.append(f"{name}={e:.1e}" + ("" if finite else "(NaN!)") + ("" if tail_zero else "(tail!)"))
    return ok, " ".join(parts)


def check(only: list[int] | None = None) -> bool:
    """The cases below (or those of the given indices, in that order) against the float32 reference."""
    rng = np.random.default_rng(int(time.time()))
    bias = shapes.RelativeBias(num_pos=40, num_time=16)
    short = [200, 5, 130, 1, 0, 256, 64, 77]
    cases = [  # activation, lengths, N, D, window, targets, bias
        ("silu", short, 256, 128, 0, False, None),
        ("softmax", short, 256, 128, 0, False, None),
        ("silu", short, 256, 64, 0, True, None),
        ("silu", short, 256, 128, 100, True, None),
        ("softmax", short, 256, 128, 40, True, None),
        ("silu", short, 256, 128, 0, True, bias),
        ("softmax", short, 256, 128, 40, True, bias),
        ("silu", list(rng.integers(900, 1024, size=8)), 1024, 128, 0, False, None),
        ("silu", list(rng.integers(3600, 4096, size=3)), 4096, 128, 0, False, None),
        ("silu", [4096] * 2, 4096, 64, 0, False, None),
        ("silu", list(rng.integers(900, 1024, size=8)), 1024, 128, 0, False, shapes.GEM_H200_BIAS),
        # head dim 256 (KernelOptions.hopper_backward_d256): cases 11-14
        ("silu", short, 256, 256, 0, True, None),
        ("softmax", short, 256, 256, 40, True, None),
        ("silu", short, 256, 256, 100, False, None),
        ("silu", [4096] * 2, 4096, 256, 0, False, None),
    ]
    ok_all = True
    for activation, lengths, n, d, window, targets, b in (
        cases if only in (None, []) else [cases[i] for i in only]
    ):
        t0 = time.perf_counter()
        q, k, v, do, off = jagged_calls.inputs(np.asarray(lengths), 2, d, rng)
        extra_rows = 24  # capacity past offsets[B]: those rows must come out zero
        pad = lambda x: jnp.pad(x, ((0, extra_rows), (0, 0), (0, 0)))
        q, k, v, do = pad(q), pad(k), pad(v), pad(do)
        kw = _extras(rng, q.shape[0], 2, len(lengths), targets, window, b, unsorted=b is not None)
        got, mosaic = _grads(q, k, v, off, do, n, activation, *MOSAIC, kw)
        f32 = lambda x: x.astype(jnp.float32)
        want, _ = _grads(f32(q), f32(k), f32(v), off, do, n, activation, "reference", None, kw)
        triton = None
        if b is not None:  # the shipped backward's error too (the bar for softmax's dtime: _compare)
            triton, _ = _grads(q, k, v, off, do, n, activation, *TRITON, kw)
        ok, errs = _compare(got, want, int(off[-1]), triton)
        ok_all = ok_all and ok
        print(
            f"check {activation} N={n} D={d} B={len(lengths)} window={window} targets={targets} bias={b} "
            f"[{'mosaic' if mosaic else 'TRITON'} bwd] {errs} -> {'OK' if ok else 'FAIL'} "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    return ok_all


def time_case(case: str, reps: int) -> bool:
    name, shape, activation, bias = CASES[case]
    rng = np.random.default_rng(int(time.time()))
    lengths = shape.sample_lengths(rng)
    h, d, n = shape.heads, shape.head_dim, shape.max_seq_len
    q, k, v, do, off = jagged_calls.inputs(lengths, h, d, rng)
    kw = _extras(rng, q.shape[0], h, len(lengths), False, 0, bias)
    flops = 2.5 * fwd_flops(lengths, h, d, d)
    # the check: the Mosaic backward against the Triton one on this shape's fresh inputs
    t0 = time.perf_counter()
    got, mosaic = _grads(q, k, v, off, do, n, activation, *MOSAIC, kw)
    want, _ = _grads(q, k, v, off, do, n, activation, *TRITON, kw)
    ok, errs = _compare(got, want, int(off[-1]))
    del got, want
    print(
        f"check vs Triton {name} [{'mosaic' if mosaic else 'TRITON (not supported)'} bwd] {errs} -> "
        f"{'OK' if ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    tflops = {}
    variants = [("triton", TRITON, kw), ("mosaic", MOSAIC, kw)]
    if bias is not None:  # the bias's cost: the same shape without it
        variants += [("triton_nobias", TRITON, {}), ("mosaic_nobias", MOSAIC, {})]
    for label, (impl, options), extra in variants:
        if label.startswith("mosaic") and not ok:
            tflops[label] = float("nan")
            continue
        fwd, bwd = jagged_calls.fwd_bwd(jagged_calls.jagged(impl, n, activation, None, options, **extra))
        sec = jagged_calls.time_bwd(bwd, q, k, v, off, do, reps)
        tflops[label] = flops / sec / 1e12
        print(f"{name} {label} bwd: {sec * 1e3:.3f} ms {tflops[label]:.1f} TFLOP/s", flush=True)
        del fwd, bwd
    row = (
        f"ROW | {name} | {tflops['triton']:.1f} | {tflops['mosaic']:.1f}{'' if mosaic else ' (Triton ran)'} |"
    )
    row += f" {tflops['mosaic'] / tflops['triton']:.2f} |"
    if bias is not None:
        row += (
            f" bias/no-bias: Triton {tflops['triton'] / tflops['triton_nobias']:.2f}x,"
            f" Mosaic {tflops['mosaic'] / tflops['mosaic_nobias']:.2f}x |"
        )
    print(row, flush=True)
    return ok


def _one_forward(case: str):
    """(name, q, k, v, do, offsets, params, the forward's residuals, backward FLOPs) of one case's fresh inputs:
    what sweep and meet time backward_mosaic_gpu on."""
    name, shape, activation, bias = CASES[case]
    rng = np.random.default_rng(int(time.time()))
    lengths = shape.sample_lengths(rng)
    h, d, n = shape.heads, shape.head_dim, shape.max_seq_len
    q, k, v, do, off = jagged_calls.inputs(lengths, h, d, rng)
    kw = _extras(rng, q.shape[0], h, len(lengths), False, 0, bias)
    fields = dict(num_pos=bias.num_pos, num_time=bias.num_time) if bias else {}
    params = KernelParams.build(n, activation, d, options=MOSAIC[1], **fields)
    inputs = gpu_layout.to_kernel_layout(
        q, k, v, off, None, kw.get("timestamps"), kw.get("pos_bias"), kw.get("time_bias"), params
    )
    residuals = jax.block_until_ready(jax.jit(lambda x: gpu_layout.forward(x, params)[1])(inputs))
    return name, q, k, v, do, off, params, residuals, 2.5 * fwd_flops(lengths, h, d, d)


def sweep(case: str, reps: int) -> bool:
    name, q, k, v, do, off, params, residuals, flops = _one_forward(case)
    d = q.shape[-1]
    ok_all, want = True, None
    for label, (bq, sq, bk, sk) in (D256_KNOBS if d > 128 else KNOBS).items():
        f = jax.jit(
            lambda res, do, bq=bq, sq=sq, bk=bk, sk=sk: mosaic_bwd.backward_mosaic_gpu(
                res, do, params, block_q=bq, stages_dkv=sq, block_k=bk, stages_dq=sk, **SWEEP_KW
            )[:3]
        )
        try:
            got = [g.astype(jnp.float32) for g in f(residuals, do)]
        except Exception as e:  # e.g. a knob set past shared memory: the others still run
            print(f"sweep {name} {label}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        ok, errs = (True, "(the reference knobs)") if want is None else _compare(got, want, int(off[-1]))
        want = got if want is None else want
        ok_all = ok_all and ok
        sec = jagged_calls.time_bwd((lambda *_: residuals, f), q, k, v, off, do, reps) if ok else float("nan")
        print(
            f"SWEEP | {name} | {label} | {flops / sec / 1e12:.1f} TFLOP/s | {sec * 1e3:.3f} ms | {errs} |",
            flush=True,
        )
    return ok_all


def meet(case: str, reps: int) -> bool:
    """Times backward_mosaic_gpu at D=256 on one shape's residuals with KernelOptions.split_meet on, then off
    (each a new trace), the second checked against the first."""
    name, q, k, v, do, off, params, residuals, flops = _one_forward(case)
    ok_all, want = True, None
    for flag in (True, False):
        p = dataclasses.replace(params, options=dataclasses.replace(params.options, split_meet=flag))
        f = jax.jit(lambda res, do, p=p: mosaic_bwd.backward_mosaic_gpu(res, do, p, **SWEEP_KW)[:3])
        got = [g.astype(jnp.float32) for g in f(residuals, do)]
        ok, errs = (True, "(the reference setting)") if want is None else _compare(got, want, int(off[-1]))
        want = got if want is None else want
        ok_all = ok_all and ok
        sec = jagged_calls.time_bwd((lambda *_: residuals, f), q, k, v, off, do, reps) if ok else float("nan")
        print(
            f"MEET | {name} | {flag} | {flops / sec / 1e12:.1f} TFLOP/s | {sec * 1e3:.3f} ms | {errs} |",
            flush=True,
        )
    return ok_all


def main(argv: list[str]) -> int:
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind}", flush=True)
    if argv[0] == "check":
        return 0 if check([int(i) for i in argv[1:]]) else 1
    if argv[0] == "time":
        return 0 if time_case(argv[1], int(argv[2]) if len(argv) > 2 else 10) else 1
    if argv[0] == "sweep":
        return 0 if sweep(argv[1], int(argv[2]) if len(argv) > 2 else 10) else 1
    if argv[0] == "meet":  # meet [CASE [REPS]]
        case = argv[1] if len(argv) > 1 else "d256"
        return 0 if meet(case, int(argv[2]) if len(argv) > 2 else 10) else 1
    raise ValueError(
        "usage: check | time CASE [REPS] | sweep CASE [REPS] | meet [CASE [REPS]],"
        f" CASE one of {sorted(CASES)}"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
