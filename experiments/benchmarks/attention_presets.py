"""The preset table in one call: `python -m experiments bench attention --preset NAME[,NAME...]`.

Each preset (shapes.ATTENTION_PRESETS: a shape, its activation, its targets) runs every implementation side by
side: ours on the Mosaic GPU kernels (implementation="mosaic") and on the Triton ones ("triton"), and, on the
equal-length presets, the dense causal softmax of cuDNN (jax.nn.dot_product_attention) and of tokamax
(tokamax.dot_product_attention on its Mosaic GPU kernel; needs jax >= 0.11.1) on the same tokens as [B, N, H, D].
Each is first checked against the float32 reference on fresh random inputs (a few of the preset's sequences,
one of them full-length: the reference costs O(B N^2) memory), output and, where the preset times the backward,
the q, k, v gradients; then the forward is timed, and the backward where the preset has a backward target.
An implementation this machine lacks is a row "n/a (why)"; one that fails its check is a row "FAIL" and is not
timed. TFLOP/s by jagged_calls.fwd_flops for every implementation; "vs target" is TFLOP/s over the target's.

On CPU the Triton kernels run in Pallas interpret mode and --quick shrinks every preset (QUICK: B <= 2,
N <= 64, H <= 2), so the whole path, n/a rows included, runs in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import shapes
from experiments.benchmarks.jagged_calls import compare, fwd_bwd, fwd_flops, inputs, jagged, time_bwd
from experiments.benchmarks.timing import median_seconds
from pallas_kernels.implementations import is_hopper

try:  # optional dependency: tokamax, the dense softmax anchor (a wheel on the device; needs jax >= 0.11.1)
    import tokamax

    TOKAMAX_MISSING = ""
except Exception as e:  # whatever stops its import makes its rows n/a, never the benchmark fail
    tokamax = None
    TOKAMAX_MISSING = f"tokamax: {type(e).__name__}: {e}"

IMPLEMENTATIONS = ("mosaic", "triton", "cudnn", "tokamax")
LABELS = {
    "mosaic": "ours, Mosaic GPU",
    "triton": "ours, Triton",
    "cudnn": "cuDNN softmax, dense",
    "tokamax": "tokamax softmax, dense (Mosaic GPU)",
}
# the reference's float32 score arrays of the check's sequences stay under this (at least 2 sequences)
CHECK_BYTES = 2**31
QUICK = dict(batch=2, max_seq_len=64, heads=2)  # --quick: each preset's sizes at most these


class CheckFailed(AssertionError):
    """An implementation's output or gradients are off the reference (jagged_calls.CHECK_BAR) or not finite."""


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of a preset: its name, the activation it computes, and its call f(q, k, v, offsets) on
    the jagged [T, H, D] arrays, or (call None) why it cannot run here."""

    name: str
    label: str
    activation: str
    call: Callable | None
    missing: str = ""


def quick(shape: shapes.JaggedShape) -> shapes.JaggedShape:
    """The shape shrunk to QUICK (head dim and length mix kept): a preset's path on CPU in interpret mode."""
    return dataclasses.replace(shape, **{key: min(getattr(shape, key), cap) for key, cap in QUICK.items()})


def _dense(attention, n: int):
    """A dense causal attention(q, k, v) on [B, N, H, D] as a call on the jagged arrays of B sequences of N."""

    def call(q, k, v, off):
        t, h, b = q.shape[0], q.shape[1], off.shape[0] - 1
        to_dense = lambda x: x[: b * n].reshape(b, n, h, x.shape[-1])
        o = attention(to_dense(q), to_dense(k), to_dense(v)).reshape(b * n, h, -1)
        return jnp.pad(o, ((0, t - b * n), (0, 0), (0, 0)))  # rows past offsets[B] are zeros, as ours

    return call


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _tokamax(q, k, v):
    return tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic")


def implementations(shape: shapes.JaggedShape, activation: str) -> list[Impl]:
    """Every implementation of IMPLEMENTATIONS for a preset, in that order; those this machine lacks with why."""
    n, gpu = shape.max_seq_len, jax.default_backend() == "gpu"
    hopper = is_hopper()
    mosaic = jagged("mosaic", n, activation) if hopper else None
    triton = jagged("triton", n, activation, interpret=not gpu)  # no GPU: the kernels in interpret mode
    impls = [
        Impl("mosaic", LABELS["mosaic"], activation, mosaic, "" if hopper else "needs a Hopper GPU"),
        Impl("triton", LABELS["triton"] + ("" if gpu else " (interpret)"), activation, triton),
    ]
    for name, attention, missing in (
        ("cudnn", _cudnn, "" if gpu else "needs an NVIDIA GPU"),
        ("tokamax", _tokamax, TOKAMAX_MISSING),
    ):
        missing = missing if shape.lengths == "equal" else "dense kernel: equal lengths only"
        impls.append(Impl(name, LABELS[name], "softmax", None if missing else _dense(attention, n), missing))
    return impls


def check_lengths(shape: shapes.JaggedShape, rng) -> np.ndarray:
    """The check's sequences: one full-length, then the preset's own draw, as many as CHECK_BYTES allows."""
    n = shape.max_seq_len
    count = min(shape.batch, max(2, CHECK_BYTES // (4 * shape.heads * n * n)), 8)
    return np.concatenate([[n], shape.sample_lengths(rng)[: count - 1]])


def _outputs(f, q, k, v, off, do, backward: bool):
    """[out] of the call f, and with backward its q, k, v gradients under the loss sum(out * do)."""
    if not backward:
        return [f(q, k, v, off)]

    def loss(q, k, v):
        o = f(q, k, v, off)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

    grads, o = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [o, *grads]


_outputs_jit = jax.jit(_outputs, static_argnums=(0, 6))


def reference(case, activation: str, backward: bool) -> list:
    """The float32 reference's outputs (_outputs) on a check case (q, k, v, do, offsets, n)."""
    q, k, v, do, off, n = case
    f32 = lambda x: x.astype(jnp.float32)
    return _outputs_jit(jagged("reference", n, activation), f32(q), f32(k), f32(v), off, do, backward)


def check(impl: Impl, case, backward: bool, want: list) -> str:
    """Rel. L2 errors of impl on a check case against the reference's outputs `want`: "out=..." and, with
    backward, "dq=... dk=... dv=...". Raises CheckFailed past jagged_calls.CHECK_BAR or on NaN/inf."""
    q, k, v, do, off, _ = case
    ok, errs = compare(("out", "dq", "dk", "dv"), _outputs_jit(impl.call, q, k, v, off, do, backward), want)
    if not ok:
        raise CheckFailed(f"{impl.label}: {errs}")
    return errs


def _ratio(row: dict, rows: list[dict], target, key: str) -> str:
    """row's TFLOP/s over the target's: a number, or the TFLOP/s of the implementation it names in rows."""
    if isinstance(target, str):
        target = next((r[key] for r in rows if r["impl"] == target and r.get(key)), None)
    return f"{row[key] / target:.2f}x" if row.get(key) and target else "-"


def run_preset(name: str, preset: shapes.AttentionPreset, rng, reps: int, checked: bool) -> list[dict]:
    """One row per implementation of a preset: {"impl", "label", "activation", "fwd", "bwd" (TFLOP/s),
    "fwd_ms", "bwd_ms", "status" (empty, or n/a / FAIL / error with why), "vs_target"}."""
    shape, backward = preset.shape, preset.target_bwd is not None
    h, d, n = shape.heads, shape.head_dim, shape.max_seq_len
    lengths = shape.sample_lengths(rng)
    flops = fwd_flops(lengths, h, d, d)
    q, k, v, do, off = inputs(lengths, h, d, rng)
    case = (*inputs(check_lengths(shape, rng), h, d, rng), n)
    want = functools.cache(lambda activation: reference(case, activation, backward))
    rows = []
    for impl in implementations(shape, preset.activation):
        row = dict(preset=name, impl=impl.name, label=impl.label, activation=impl.activation, status="")
        rows.append(row)
        if impl.call is None:
            row["status"] = f"n/a ({impl.missing})"
            print(f"{name} {impl.label}: {row['status']}", flush=True)
            continue
        try:
            if checked:
                errs = check(impl, case, backward, want(impl.activation))
                print(f"check {name} {impl.label}: {errs} -> OK", flush=True)
            fwd, bwd = fwd_bwd(impl.call)
            tf = median_seconds(fwd, q, k, v, off, reps=reps, warmup=3)
            row.update(fwd=flops / tf / 1e12, fwd_ms=tf * 1e3)
            if backward:
                tb = time_bwd(bwd, q, k, v, off, do, reps)
                row.update(bwd=2.5 * flops / tb / 1e12, bwd_ms=tb * 1e3)
        except CheckFailed as e:
            row["status"] = f"FAIL ({e})"
        except Exception as e:  # one implementation's failure must not hide the others' numbers
            row["status"] = f"error ({type(e).__name__}: {str(e)[:300]})"
        print(f"{name} {impl.label}: {row['status'] or 'timed'} {_cells(row)}", flush=True)
    for row in rows:
        targets = [(preset.target_fwd, "fwd")] + ([(preset.target_bwd, "bwd")] if backward else [])
        row["vs_target"] = " / ".join(_ratio(row, rows, t, key) for t, key in targets)
    return rows


def _cells(row: dict) -> str:
    """fwd ms, fwd TFLOP/s, bwd ms, bwd TFLOP/s cells of a row ("-" where not timed)."""
    fmt = lambda key, spec: format(row[key], spec) if key in row else "-"
    return " | ".join((fmt("fwd_ms", ".3f"), fmt("fwd", ".1f"), fmt("bwd_ms", ".3f"), fmt("bwd", ".1f")))


def table(rows: list[dict]) -> str:
    """The markdown table of every preset's rows."""
    lines = [
        "| preset | activation | implementation | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | target | "
        "vs target |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        preset = shapes.ATTENTION_PRESETS[r["preset"]]
        targets = (preset.target_fwd, preset.target_bwd)
        target = " / ".join(LABELS.get(t, str(t)).split()[0] for t in targets if t is not None)
        status = r["status"].replace("|", "/").replace("\n", " ")  # an error's text stays in its cell
        cells = status + " | - | - | - |" if status else _cells(row=r) + " |"
        lines.append(
            f"| {r['preset']} | {r['activation']} | {r['label']} | {cells} {target} | {r['vs_target']} |"
        )
    return "\n".join(lines)


def run(names: list[str], *, quick_shapes: bool, reps: int, checked: bool, seed: int) -> int:
    """Every named preset, one table at the end; exit code 1 if a check failed or an implementation broke."""
    rng = np.random.default_rng(seed)
    rows = []
    for name in names:
        preset = shapes.ATTENTION_PRESETS[name]
        if quick_shapes:
            preset = dataclasses.replace(preset, shape=quick(preset.shape))
        s = preset.shape
        size = f"B={s.batch} N={s.max_seq_len} H={s.heads} D={s.head_dim}"
        print(f"preset {name}: {preset.activation} {size} lengths {s.lengths}", flush=True)
        rows += run_preset(name, preset, rng, reps, checked)
    print(table(rows))
    bad = [r for r in rows if r["status"].startswith(("FAIL", "error"))]
    print(
        f"correctness: {'not checked (--no-check)' if not checked else 'FAILED' if bad else 'OK'}; "
        f"{len(bad)} of {len(rows)} rows failed or broke"
    )
    return 1 if bad else 0
