"""Randomized correctness sweep of the jagged-attention kernel against the float32 reference.

    python -m experiments fuzz attention --seconds 360          (GPU: the Pallas kernels)
    python -m experiments fuzz attention --seconds 60 --max-cases 4   (CPU: the kernel in interpret mode)
    python -m experiments fuzz attention --seed 0 --replay 3:17  (one case again: family 3, case 17)

A *family* fixes everything that is static under jit (token capacity, batch capacity, heads, head
dims, max_seq_len, activation, dtype, targets on/off, window, bias table sizes): one compilation
each (about 40 s on the H200 for the kernel's three Pallas programs). A *case* draws everything
else afresh: jagged lengths (empty, length 1, full, anything between, tails that leave unused
capacity), targets (also more than a sequence's length), timestamps (sorted or not, small and
large deltas), bias tables and q/k/v/cotangent values, with NaN in every unused capacity row of
q, k and v. So new families are compiled only during the first `--compile-share` of the budget
(the first four cover bf16/fp32 x silu/softmax x targets x window x each bias table); the rest of
the time goes to cases of the compiled families.

Checks per case, forward and every gradient (q, k, v, and each bias table), against the float32
reference (`implementation="reference"`, matmuls at full float32 precision, on the float32 cast of
the same inputs and output cotangent, rounded to the family's dtype as the kernel sees them): every
value finite, rows past offsets[B] zero in the output, the relative L2
error of the whole array and of each sequence's rows within tolerance (float32 inputs 1e-4 / 1e-3,
bf16 inputs 1e-2 / 5e-2; a wrong mask or bias shows as O(1) errors). A crash (an exception from the
kernel: compilation or execution) is a failure too; its family is skipped from then on, and three
crashes in a row end the sweep. It prints the case count, the worst error per check and dtype, and
every failure with its replay argument; exit code 1 if anything failed.

A bias table's gradient sums dScore over every cell of a bucket, and those sums can cancel: with one
position bucket a softmax's is exactly 0 (each row of dScore sums to 0; the kernel's comes from the output
rounded to bf16), and a SiLU's was 0.09 over terms whose magnitudes sum to 116. Against such a sum any
rounding in the terms is a large relative error. So a bias-table gradient that fails the plain check is
judged again against the exact sums (float64, from the reference's per-cell dScore) with the denominator
at least CANCELLATION x the norm of the per-bucket sums of |dScore|: gradient moved between buckets still
fails once it is over tolerance x CANCELLATION of those magnitudes (a whole bucket's sum, in the test).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.jagged_attention import jagged_attention
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.reference import jagged_attention_reference, padded_buckets

# Static sizes a family draws from, per platform: small enough that a case runs in milliseconds on the
# GPU (the padded reference is O(B N^2)), and tiny on the CPU, where the kernel is interpreted.
SIZES = {
    "gpu": dict(
        capacity=(1024, 4096),
        batch=(8, 32),
        heads=(1, 2, 4),
        dqk=(64, 128),
        dv=(64, 128),
        max_seq_len=(64, 256, 1024),
    ),
    "cpu": dict(capacity=(80,), batch=(5,), heads=(2,), dqk=(16,), dv=(16,), max_seq_len=(32,)),
}
# The first families cover every switch at least once; later ones are drawn at random.
COVER = (
    dict(dtype="bfloat16", activation="silu", targets=True, window=True, pos=True, time=True),
    dict(dtype="float32", activation="softmax", targets=False, window=False, pos=True, time=False),
    dict(dtype="bfloat16", activation="softmax", targets=True, window=True, pos=False, time=True),
    dict(dtype="float32", activation="silu", targets=True, window=False, pos=False, time=False),
)
# (whole array, per sequence) relative L2 tolerances by input dtype.
TOLERANCE = {"float32": (1e-4, 1e-3), "bfloat16": (1e-2, 5e-2)}
CHECKS = ("out", "dq", "dk", "dv", "dpos", "dtime")
# A gradient's error is relative to max(its reference norm, this x the case's |dv| reference): a softmax
# delta computed from dO rounded differently in two places gives |dq| 0.76 against |dv| 450 (ratio 1.7e-3,
# x10^4 = 17, a failure); a correct kernel's float32 noise is about 5e-5 (0.001 after the floor).
ZERO_REFERENCE_FLOOR = 1e-4
# A bias-table gradient's error is also relative to this x |per-bucket sums of |dScore|| (module docstring).
CANCELLATION = 0.1
BIAS_CHECKS = ("dpos", "dtime")
ROUNDED = ("q", "k", "v", "do")  # case arrays the kernel sees in the family's dtype
# A crashed family is skipped from then on; this many crashes in a row (a device that is gone, e.g. after
# an illegal memory access) end the sweep.
MAX_CRASHES_IN_A_ROW = 3


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything static under jit: one compilation."""

    capacity: int
    batch: int
    heads: int
    dqk: int
    dv: int
    max_seq_len: int
    activation: str
    dtype: str
    targets: bool
    window: int
    num_pos: int  # 0: no position bias table
    num_time: int  # 0: no time bias table
    # The GPU kernels, by name: None runs the default (on Hopper Mosaic GPU where it takes the call, bf16 and any
    # T, each direction), "triton" the Triton ones; so bf16 families cover both GPU families. The run's
    # --implementation, when given, names the kernels of every family instead.
    implementation: str | None = None
    # KernelOptions.hopper_backward_bias: the Mosaic GPU backward also takes the relative bias (the default;
    # False: such calls run the Triton backward after the Mosaic forward)
    hopper_backward_bias: bool = True
    # KernelOptions.time_grad_runs: the Mosaic GPU dQ kernel's sorted path for the time gradient (drawn on a GPU)
    time_grad_runs: bool = False

    def __str__(self) -> str:
        bias = [f"pos {self.num_pos}"] * bool(self.num_pos) + [f"time {self.num_time}"] * bool(self.num_time)
        return (
            f"{self.dtype} {self.activation} T={self.capacity} B={self.batch} H={self.heads} "
            f"D={self.dqk}/{self.dv} N={self.max_seq_len} targets={'yes' if self.targets else 'no'} "
            f"window={self.window} bias={'+'.join(bias) or 'none'}"
            + ("" if self.implementation is None else f" implementation={self.implementation}")
            + ("" if self.hopper_backward_bias else " hopper_backward_bias=False")
            + (" time_grad_runs" if self.time_grad_runs else "")
        )


def make_family(seed: int, index: int, platform: str) -> Family:
    rng = np.random.default_rng([seed, index, 0])
    sizes = SIZES[platform]
    pick = lambda name: int(rng.choice(sizes[name]))  # noqa: E731
    switches = (
        COVER[index]
        if index < len(COVER)
        else dict(
            dtype=str(rng.choice(["bfloat16", "float32"])),
            activation=str(rng.choice(["silu", "softmax"])),
            targets=bool(rng.random() < 0.7),
            window=bool(rng.random() < 0.4),
            pos=bool(rng.random() < 0.6),
            time=bool(rng.random() < 0.6),
        )
    )
    n = pick("max_seq_len")
    # Bias table sizes from their own stream; the covering families get non-degenerate tables (one
    # bucket, where every cell is clipped, is left to the random ones).
    tables = np.random.default_rng([seed, index, 1])
    cover = index < len(COVER)
    num_pos = int(tables.choice([n // 2, n + 17] if cover else [1, 5, n // 2, n + 17]))
    num_time = int(tables.choice([12, 64] if cover else [1, 12, 64]))
    # the Mosaic backward's bias switch from a third stream (the families' other draws stay as they were): the
    # covering families take the bias in the Mosaic backward
    backward = np.random.default_rng([seed, index, 2])
    backward_bias = cover or bool(backward.random() < 0.5)
    # on a GPU, the token capacity's residue mod 8 from a fourth stream: the Mosaic GPU kernels pad T to a
    # multiple of 8 (in interpret mode no kernel cares, and the CPU families stay as they were)
    residue = int(np.random.default_rng([seed, index, 3]).integers(0, 8)) if platform == "gpu" else 0
    # on a GPU, half the families take the time gradient's sorted path (a fifth stream)
    runs = platform == "gpu" and bool(np.random.default_rng([seed, index, 4]).random() < 0.5)
    return Family(
        capacity=max(pick("capacity"), n) + residue,
        batch=pick("batch"),
        heads=pick("heads"),
        dqk=pick("dqk"),
        dv=pick("dv"),
        max_seq_len=n,
        activation=switches["activation"],
        dtype=switches["dtype"],
        targets=switches["targets"],
        window=int(rng.integers(1, n)) if switches["window"] else 0,
        num_pos=num_pos if switches["pos"] else 0,
        num_time=num_time if switches["time"] else 0,
        # Covering families 0 and 2 (bf16) take one GPU family each; the others draw it.
        implementation=(None, None, "triton", None)[index]
        if cover
        else (None if rng.random() < 0.5 else "triton"),
        hopper_backward_bias=backward_bias,
        time_grad_runs=runs,
    )


@dataclasses.dataclass
class Case:
    offsets: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    num_targets: np.ndarray | None
    timestamps: np.ndarray | None
    pos_bias: np.ndarray | None
    time_bias: np.ndarray | None


def make_case(family: Family, seed: int, index: int, case: int) -> Case:
    f = family
    rng = np.random.default_rng([seed, index, case + 1])
    kind = rng.choice(4, size=f.batch, p=[0.15, 0.15, 0.1, 0.6])  # empty, one, full, anything
    lengths = np.select(
        [kind == 0, kind == 1, kind == 2], [0, 1, f.max_seq_len], rng.integers(2, f.max_seq_len + 1, f.batch)
    )
    room = f.capacity - int(rng.integers(0, f.capacity // 4 + 1))  # usually leave unused capacity rows
    for b in range(f.batch):  # sequences past the room are cut (to zero length at the end)
        lengths[b] = min(lengths[b], room)
        room -= lengths[b]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    scale = float(rng.choice([0.5, 1.0, 3.0]))  # large scores test the softmax's max subtraction

    def values(d, s=1.0):
        x = (rng.standard_normal((f.capacity, f.heads, d)) * s).astype(np.float32)
        x[offsets[-1] :] = np.nan  # unused capacity must never leak into a result
        return x

    do = rng.standard_normal((f.capacity, f.heads, f.dv)).astype(np.float32)
    targets = None
    if f.targets:
        targets = rng.integers(0, 5, f.batch)
        over = rng.random(f.batch) < 0.1  # more targets than positions: clipped to the length
        targets = np.where(over, lengths + rng.integers(0, 3, f.batch), targets).astype(np.int32)
    timestamps = None
    if f.num_time:
        ts = rng.integers(0, 10 ** int(rng.integers(1, 10)), f.capacity)
        timestamps = (np.sort(ts) if rng.random() < 0.7 else ts).astype(np.int32)
    table = lambda n: None if not n else (rng.standard_normal((f.heads, n)) * 0.3).astype(np.float32)  # noqa: E731
    return Case(
        offsets=offsets,
        q=values(f.dqk, scale),
        k=values(f.dqk),
        v=values(f.dv),
        do=do,
        num_targets=targets,
        timestamps=timestamps,
        pos_bias=table(f.num_pos),
        time_bias=table(f.num_time),
    )


def _gradient_fn(family: Family, implementation: str | None, interpret: bool = False) -> Callable:
    """jit of (q, k, v, do, offsets, targets, timestamps, pos, time) -> (out, (dq, dk, dv, dpos, dtime)) with
    the named kernels (None: the family's)."""

    def loss(q, k, v, pos, tim, do, offsets, targets, timestamps):
        out = jagged_attention(
            q,
            k,
            v,
            offsets,
            max_seq_len=family.max_seq_len,
            activation=family.activation,
            num_targets=targets,
            max_attn_len=family.window,
            timestamps=timestamps,
            pos_bias=pos,
            time_bias=tim,
            implementation=implementation or family.implementation,
            interpret=interpret,
            options=KernelOptions(
                hopper_backward_bias=family.hopper_backward_bias, time_grad_runs=family.time_grad_runs
            ),
        )
        return jnp.sum(out.astype(jnp.float32) * do), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def _optional(dtype) -> Callable:
    """x -> x as a jax array of `dtype`, None kept (a case's absent targets, timestamps or tables)."""
    return lambda x: None if x is None else jnp.asarray(x, dtype)


@functools.cache
def _score_grad_fn(family: Family) -> Callable:
    """jit of (q, k, v, pos, time, do, offsets, targets, timestamps) -> the reference's dScore [B, H, N, N]."""

    def loss(offset, q, k, v, pos, tim, do, offsets, targets, timestamps):
        out = jagged_attention_reference(
            q, k, v, offsets, max_seq_len=family.max_seq_len, activation=family.activation,
            num_targets=targets, max_attn_len=family.window, timestamps=timestamps, pos_bias=pos,
            time_bias=tim, score_offset=offset,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * do)

    return jax.jit(jax.grad(loss))


def _bias_sums(family: Family, case: Case, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(exact [H, buckets] gradient of the bias table `name`, per-bucket sums of |dScore|), in float64 from
    the reference's per-cell dScore on the case's inputs (already rounded to the family's dtype)."""
    f32, i32 = _optional(jnp.float32), _optional(jnp.int32)
    zeros = jnp.zeros((family.batch, family.heads, family.max_seq_len, family.max_seq_len), jnp.float32)
    with jax.default_matmul_precision("float32"):
        ds = _score_grad_fn(family)(
            zeros, f32(case.q), f32(case.k), f32(case.v), f32(case.pos_bias), f32(case.time_bias),
            f32(case.do), i32(case.offsets), i32(case.num_targets), i32(case.timestamps),
        )  # fmt: skip
    num = family.num_pos if name == "dpos" else family.num_time
    pos_bucket, time_bucket = padded_buckets(
        case.offsets, case.timestamps, max_seq_len=family.max_seq_len, num_pos=max(family.num_pos, 1),
        num_time=max(family.num_time, 1),
    )  # fmt: skip
    bucket = np.asarray(pos_bucket)[None, None] if name == "dpos" else np.asarray(time_bucket)[:, None]
    ds = np.asarray(ds, np.float64)
    index = (np.arange(family.heads)[None, :, None, None] * num + np.broadcast_to(bucket, ds.shape)).ravel()
    size = family.heads * num
    sums = np.bincount(index, weights=ds.ravel(), minlength=size).reshape(family.heads, num)
    magnitudes = np.bincount(index, weights=np.abs(ds).ravel(), minlength=size).reshape(family.heads, num)
    return sums, magnitudes


def _bias_error(got: np.ndarray, exact: np.ndarray, magnitudes: np.ndarray, floor: float) -> float:
    """Relative L2 error of a bias-table gradient against its exact sums, the denominator at least
    CANCELLATION x |magnitudes| (and `floor`): rounding in many cancelling terms is not an error."""
    scale = max(floor, CANCELLATION * float(np.linalg.norm(magnitudes)))
    return _errors(got, exact, None, scale)[0]


def _run(fn: Callable, case: Case, dtype) -> tuple[np.ndarray, list[np.ndarray | None]]:
    cast, f32, i32 = _optional(dtype), _optional(jnp.float32), _optional(jnp.int32)
    grads, out = fn(
        cast(case.q),
        cast(case.k),
        cast(case.v),
        f32(case.pos_bias),
        f32(case.time_bias),
        f32(case.do),
        i32(case.offsets),
        i32(case.num_targets),
        i32(case.timestamps),
    )
    out, grads = jax.device_get((out, grads))
    return np.asarray(out), [None if g is None else np.asarray(g) for g in grads]


def _errors(
    got: np.ndarray, want: np.ndarray, offsets: np.ndarray | None, floor: float = 0.0
) -> tuple[float, float]:
    """(relative L2 of the whole array, worst relative L2 of one sequence's rows); inf if not finite.

    `floor` bounds the denominator from below: a gradient whose reference is exactly zero (e.g. dq
    when every row is a target that sees only itself, so P = 1) is judged against the case's gradient
    scale instead of dividing float32 noise by 1e-30."""
    a, b = got.astype(np.float64), want.astype(np.float64)
    if not np.isfinite(a).all():
        return np.inf, np.inf
    norm = np.linalg.norm(b)
    whole = np.linalg.norm(a - b) / max(norm, floor, 1e-30)
    if offsets is None:
        return whole, whole
    used = max(int(offsets[-1]), 1)
    row_norm = norm / np.sqrt(used)  # a typical row's norm: the floor for sequences with tiny values
    worst = 0.0
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        if hi > lo:
            err = np.linalg.norm(a[lo:hi] - b[lo:hi])
            seq_floor = max(row_norm, floor / np.sqrt(used)) * np.sqrt(hi - lo)
            worst = max(worst, err / max(np.linalg.norm(b[lo:hi]), seq_floor, 1e-30))
    return whole, worst


@dataclasses.dataclass
class Report:
    cases: int = 0
    families: list[Family] = dataclasses.field(default_factory=list)
    compile_s: float = 0.0
    worst: dict[tuple[str, str], tuple[float, float]] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    crashed: set[int] = dataclasses.field(default_factory=set)  # families whose kernel raised
    crashes_in_a_row: int = 0


def check_case(report: Report, seed: int, index: int, case_index: int, family: Family, fns) -> None:
    """Runs one case through the kernel and the reference and records its errors and failures."""
    case = make_case(family, seed, index, case_index)
    replay = f"--seed {seed} --replay {index}:{case_index}"
    kernel, reference = fns
    try:
        got_out, got_grads = _run(kernel, case, jnp.dtype(family.dtype))
    except Exception as e:  # a crash is a failure; its family is not run again
        first_line = (str(e).splitlines() or [""])[0][:200]
        report.failures.append(f"CRASH {type(e).__name__}: {first_line} ({family}; {replay})")
        report.crashed.add(index)
        report.crashes_in_a_row += 1
        return
    report.crashes_in_a_row = 0
    with jax.default_matmul_precision("float32"):
        # the reference on the float32 cast of the same (rounded) inputs, and of the cotangent the kernel sees:
        # its output is in the family's dtype, so d(out) arrives rounded to it (unrounded, a SiLU one-bucket
        # position gradient differed from the kernel's by 0.44; rounded, by 5.8e-3: case 10:341 of seed 0)
        rounded = dataclasses.replace(
            case, **{x: np.asarray(jnp.asarray(getattr(case, x), family.dtype), np.float32) for x in ROUNDED}
        )
        want_out, want_grads = _run(reference, rounded, jnp.float32)
    report.cases += 1
    whole_tol, seq_tol = TOLERANCE[family.dtype]
    problems = []
    if got_out.dtype != jnp.dtype(family.dtype) or got_out.shape != want_out.shape:
        problems.append(
            f"out has {got_out.dtype}{list(got_out.shape)}, expected {family.dtype}{list(want_out.shape)}"
        )
    if np.any(got_out[case.offsets[-1] :].astype(np.float32) != 0):
        problems.append("out: rows past offsets[B] are not zero")
    results = [("out", got_out, want_out, case.offsets)]
    for name, g, w in zip(CHECKS[1:], got_grads, want_grads):
        if w is not None:
            results.append((name, g, w, case.offsets if name in ("dq", "dk", "dv") else None))
    # The case's gradient scale: dv = P^T dO is never zero for a non-empty case.
    floor = ZERO_REFERENCE_FLOOR * float(
        np.linalg.norm(np.asarray(want_grads[CHECKS.index("dv") - 1], np.float64))
    )
    for name, got, want, offsets in results:
        whole, per_seq = _errors(got, want, offsets, floor if name != "out" else 0.0)
        if name in BIAS_CHECKS and not (whole <= whole_tol and per_seq <= seq_tol) and np.isfinite(whole):
            whole = per_seq = _bias_error(got, *_bias_sums(family, rounded, name), floor)
        key = (name, family.dtype)
        old = report.worst.get(key, (0.0, 0.0))
        report.worst[key] = (max(old[0], whole), max(old[1], per_seq))
        if not (whole <= whole_tol and per_seq <= seq_tol):
            problems.append(
                f"{name}: rel L2 {whole:.2e} (tol {whole_tol:g}), worst sequence {per_seq:.2e} (tol {seq_tol:g})"
            )
    for p in problems:
        report.failures.append(f"WRONG {p} ({family}; lengths {np.diff(case.offsets).tolist()}; {replay})")


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def default_implementation() -> str | None:
    """The kernels every family runs unless the run names them: on a GPU each family's (None: as drawn), else
    Triton's, interpreted."""
    return None if _on_gpu() else "triton"


def fuzz(
    *,
    seconds: float,
    seed: int = 0,
    implementation: str | None = None,
    sizes: str | None = None,
    max_cases: int | None = None,
    max_families: int = 12,
    compile_share: float = 0.6,
    replay: tuple[int, int] | None = None,
    log: Callable[[str], None] = print,
) -> Report:
    """Runs cases until `seconds` (or `max_cases`) are spent; see the module docstring."""
    implementation = implementation or default_implementation()
    sizes = sizes or ("gpu" if _on_gpu() else "cpu")
    report = Report()
    compiled: dict[int, tuple[Family, tuple[Callable, Callable]]] = {}

    def get(index: int) -> tuple[Family, tuple[Callable, Callable]]:
        if index not in compiled:
            family = make_family(seed, index, sizes)
            compiled[index] = (
                family,
                (
                    _gradient_fn(family, implementation, interpret=not _on_gpu()),
                    _gradient_fn(family, "reference"),
                ),
            )
            report.families.append(family)
        return compiled[index]

    if replay is not None:
        index, case_index = replay
        family, fns = get(index)
        log(f"replaying family {index} ({family}), case {case_index}")
        check_case(report, seed, index, case_index, family, fns)
        return report
    t0 = time.perf_counter()
    rng = np.random.default_rng([seed, 2**31])
    next_case: dict[int, int] = {}
    while report.crashes_in_a_row < MAX_CRASHES_IN_A_ROW:
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds or (max_cases is not None and report.cases >= max_cases):
            break
        working = sorted(set(compiled) - report.crashed)
        new = len(compiled) < max_families and (not working or elapsed < compile_share * seconds)
        if not new and not working:
            break
        index = len(compiled) if new else int(rng.choice(working))
        t_case = time.perf_counter()
        family, fns = get(index)
        case_index = next_case.get(index, 0)
        next_case[index] = case_index + 1
        failures = len(report.failures)
        check_case(report, seed, index, case_index, family, fns)
        if new:
            report.compile_s += time.perf_counter() - t_case
            log(f"family {index}: {family} (compiled and first case in {time.perf_counter() - t_case:.1f} s)")
        for line in report.failures[failures:]:
            log(line)
    return report


def format_report(report: Report, seconds: float, implementation: str | None) -> str:
    kernels = "each family's" if implementation is None else repr(implementation)
    lines = [
        f"{report.cases} cases in {seconds:.0f} s over {len(report.families)} families "
        f"({report.compile_s:.0f} s compiling), kernel implementation {kernels}"
        f"{'' if _on_gpu() or implementation == 'reference' else ' (interpret)'}, "
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}",
        "",
        "| check | dtype | worst rel. L2 (whole array) | worst rel. L2 (one sequence) | tolerance |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (name, dtype), (whole, per_seq) in sorted(
        report.worst.items(), key=lambda kv: (CHECKS.index(kv[0][0]), kv[0][1])
    ):
        tol = TOLERANCE[dtype]
        lines.append(f"| {name} | {dtype} | {whole:.2e} | {per_seq:.2e} | {tol[0]:g} / {tol[1]:g} |")
    lines.append("")
    lines.append(
        f"failures: {len(report.failures)}"
        + ("" if not report.failures else "\n" + "\n".join(report.failures))
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", choices=["attention"])
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget, compilation included")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-cases", type=int, default=None)
    parser.add_argument("--max-families", type=int, default=12)
    parser.add_argument(
        "--compile-share", type=float, default=0.6, help="new families only in this share of the time"
    )
    parser.add_argument(
        "--implementation",
        default=None,
        help="the kernels of every family (default: on a GPU each family's, the default or Triton; else Triton "
        "in Pallas's interpreter)",
    )
    parser.add_argument(
        "--sizes", choices=sorted(SIZES), default=None, help="size table (default: by platform)"
    )
    parser.add_argument("--replay", default=None, metavar="FAMILY:CASE", help="run one case again")
    args = parser.parse_args(argv)
    replay = tuple(int(x) for x in args.replay.split(":")) if args.replay else None
    t0 = time.perf_counter()
    report = fuzz(
        seconds=args.seconds,
        seed=args.seed,
        implementation=args.implementation,
        sizes=args.sizes,
        max_cases=args.max_cases,
        max_families=args.max_families,
        compile_share=args.compile_share,
        replay=replay,
        log=lambda line: print(line, flush=True),
    )
    implementation = args.implementation or default_implementation()
    print(format_report(report, time.perf_counter() - t0, implementation), flush=True)
    return 1 if report.failures or report.cases == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
