"""`python -m experiments bench fp8_out [--config ...] [--small]`: can XLA's FP8 GEMM write bf16?

Why: on jax 0.11.2 the FP8 Dense's GEMM (`gem_jax/model/fp8.py`: a dot of f32 dequantisations with an f32
result) compiles to a cuBLASLt FP8 GEMM that writes float32, and XLA casts to bf16 after. On gem_h200 those
casts cost more than the FP8 GEMMs save (docs/fp8.md). openxla's GEMM rewriter accepts a bf16 result for an
FP8 GEMM when the dot itself is bf16-typed; this benchmark checks which way of writing the forward GEMM gets
there, for each of a layer's GEMMs (`--gemms`) at every FP8 GEMM shape of the configs' models:

  fwd   Y = X W      e4m3 x e4m3 -> bf16, fast accumulation
  dx    dX = dY W^T  e5m2 x e4m3 -> bf16 (both operands contracted along their rows: no transpose)
  dw    dW = X^T dY  e4m3 x e5m2 -> f32, both contracted over M: XLA transposes them for cuBLASLt
  dw_t  the same from X^T and dY^T stored [K, M] and [N, M] (what a producer writing them transposed gives)

in these forms (the forward's names; the gradients' likewise):

  bf16          bf16 x bf16, the baseline
  f32_out       dot(f32(xq) * sx, f32(wq) * sw) -> f32, then cast: what the FP8 Dense ran until 2026-12-05
  bf16_out      the same dot with preferred_element_type=bf16 (the dot typed bf16; not for dW's f32 result)
  raw_bf16_out  dot_general(xq, wq) -> bf16 on the FP8 arrays themselves, times sx * sw in bf16 after (exact for
                power-of-two scales): the FP8 Dense's form since (`fp8.scaled_dot`)
  raw_bf16_out_f32_scale   the same, the scale applied in float32 to the bf16 result (no rounded scale)
  raw_f32_out   dot_general(xq, wq) -> f32 on the FP8 arrays, times sx * sw, then cast

For each: how many `__cublas$lt$matmul$f8` calls the optimised HLO holds and the dtype of their result, the
fusions around them, the relative error against float32 on fresh random inputs (within
`fp8.dot_error_bound(e4m3, e4m3, bf16)`: a failed check exits 1), and the median time with its speedup over
bf16 in the same run. A form that fails to compile is a row saying so (and exits 1). Run it under
`XLA_FLAGS=--xla_gpu_enable_triton_gemm=false` too: XLA reaches cuBLASLt FP8 through its Triton GEMM fusion's
autotuner by default (docs/fp8.md). On CPU XLA upcasts FP8 (nothing to count): `--small` runs tiny shapes
there to exercise the code (a test runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from experiments.benchmarks.fp8 import CUBLAS_FP8, GemmShape, model_gemm_shapes, relative_error
from experiments.benchmarks.timing import median_seconds
from gem_jax.config import load_config
from gem_jax.model import fp8


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One of a Dense layer's three GEMMs at a model shape: its operands' shapes and FP8 formats."""

    name: str  # fwd: Y = X W; dx: dX = dY W^T; dw: dW = X^T dY; dw_t: dW from X^T and dY^T stored transposed
    a: tuple[int, int]
    a_fmt: object
    b: tuple[int, int]
    b_fmt: object
    dims: tuple[tuple[int], tuple[int]]  # contracting axes of a and b
    out: object  # the result dtype the layer needs: bf16 activations, f32 weight gradients
    precision: object  # DEFAULT turns on cuBLASLt's fast FP8 accumulation (the forward's), HIGHEST not


def layer_gemms(shape: GemmShape) -> dict[str, Gemm]:
    m, k, n = shape.m, shape.k, shape.n
    e4, e5, hi, lo = fp8.E4M3, fp8.E5M2, lax.Precision.HIGHEST, lax.Precision.DEFAULT
    return {
        "fwd": Gemm("fwd", (m, k), e4, (k, n), e4, ((1,), (0,)), jnp.bfloat16, lo),
        "dx": Gemm("dx", (m, n), e5, (k, n), e4, ((1,), (1,)), jnp.bfloat16, hi),
        "dw": Gemm("dw", (m, k), e4, (m, n), e5, ((0,), (0,)), jnp.float32, hi),
        "dw_t": Gemm("dw_t", (k, m), e4, (n, m), e5, ((1,), (1,)), jnp.float32, hi),
    }


def _dot(a, b, g: Gemm, dtype):
    return lax.dot_general(a, b, (g.dims, ((), ())), precision=g.precision, preferred_element_type=dtype)


def _dequantize(q, scale):
    """The operand form XLA's GEMM rewriter documents (and the FP8 Dense used until 2026-12-05)."""
    return q.astype(jnp.float32) * scale


def _f32_out(g: Gemm, a, b, sa, sb):
    return _dot(_dequantize(a, sa), _dequantize(b, sb), g, jnp.float32).astype(g.out)


def _bf16_out(g: Gemm, a, b, sa, sb):
    return _dot(_dequantize(a, sa), _dequantize(b, sb), g, g.out)


def _raw_bf16_out(g: Gemm, a, b, sa, sb):
    return (_dot(a, b, g, jnp.bfloat16) * (sa * sb).astype(jnp.bfloat16)).astype(g.out)


def _raw_bf16_out_f32_scale(g: Gemm, a, b, sa, sb):
    return (_dot(a, b, g, jnp.bfloat16).astype(jnp.float32) * (sa * sb)).astype(g.out)


def _raw_f32_out(g: Gemm, a, b, sa, sb):
    return (_dot(a, b, g, jnp.float32) * (sa * sb)).astype(g.out)


FP8_FORMS = {
    "f32_out": _f32_out,
    "bf16_out": _bf16_out,
    "raw_bf16_out": _raw_bf16_out,
    "raw_bf16_out_f32_scale": _raw_bf16_out_f32_scale,
    "raw_f32_out": _raw_f32_out,
}
FP8_RESULT = re.compile(r"=\s*\(?(\w+)\[[^\n]*" + re.escape(CUBLAS_FP8))


def fp8_calls(hlo: str) -> tuple[int, list[str]]:
    """(number of cuBLASLt FP8 GEMMs in an optimised HLO text, the dtype each writes)."""
    lines = [line for line in hlo.splitlines() if CUBLAS_FP8 in line]
    return len(lines), [m.group(1) for m in (FP8_RESULT.search(line) for line in lines) if m]


def entry_fusions(hlo: str) -> int:
    """Fusion kernels XLA launches in the entry computation (the casts and scalings around the GEMM)."""
    entry = hlo[hlo.find("ENTRY") :]
    return len(re.findall(r"\bfusion\(", entry[: entry.find("\n}") if "\n}" in entry else None]))


def bench_gemm(shape: GemmShape, g: Gemm, reps: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    """Checks, then times, every form of one GEMM at one shape; returns one row per form and the failed
    checks. The baseline is the same GEMM in bf16 (result in `g.out`)."""
    key = jax.random.key(seed)

    @jax.jit
    def operands(key):
        a = jax.random.normal(key, g.a, jnp.float32)
        b = jax.random.normal(jax.random.fold_in(key, 1), g.b, jnp.float32) / g.a[g.dims[0][0]] ** 0.5
        sa, sb = fp8.scale_from_amax(fp8.amax(a), g.a_fmt, 0), fp8.scale_from_amax(fp8.amax(b), g.b_fmt, 0)
        return a, b, sa, sb, fp8.quantize(a, sa, g.a_fmt), fp8.quantize(b, sb, g.b_fmt)

    a, b, sa, sb, aq, bq = operands(key)
    want = jax.jit(
        lambda a, b: _dot(a, b, dataclasses.replace(g, precision=lax.Precision.HIGHEST), jnp.float32)
    )(a, b)
    bf16 = jnp.bfloat16
    forms = {"bf16": (jax.jit(lambda a, b: _dot(a, b, g, g.out)), (a.astype(bf16), b.astype(bf16)))}
    forms.update(
        {
            name: (jax.jit(partial(f, g)), (aq, bq, sa, sb))
            for name, f in FP8_FORMS.items()
            if not (name == "bf16_out" and g.out == jnp.float32)  # f32_out then
        }
    )
    rows, failures = [], []
    on_gpu = jax.default_backend() == "gpu"
    for name, (fn, args) in forms.items():
        row = {"shape": shape, "gemm": g.name, "form": name}
        try:
            y = fn(*args)
            hlo = fn.lower(*args).compile().as_text()
        except (
            Exception
        ) as e:  # e.g. "GEMM is not supported by cublasLt" under some flags: a row, not a crash
            failures.append(
                f"{shape.layers} {g.name} {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            )
            rows.append(row | {"failed": str(e).splitlines()[0][:80]})
            continue
        calls, dtypes = fp8_calls(hlo)
        err = relative_error(y, want)
        fmts = (bf16, bf16) if name == "bf16" else (g.a_fmt, g.b_fmt)
        limit = fp8.dot_error_bound(*fmts, bf16)  # bf16: the raw forms round once to bf16 before scaling
        if not (err < limit and y.dtype == g.out):
            failures.append(
                f"{shape.layers} {g.name} {name}: {y.dtype} result, relative error {err:.4f} (bound {limit:.4f})"
            )
        row |= {
            "calls": calls if on_gpu else None,
            "result": ",".join(dtypes) if on_gpu else None,
            "fusions": entry_fusions(hlo),
            "err": err,
            "s": median_seconds(fn, *args, reps=reps),
        }
        rows.append(row)
    base = rows[0].get("s")
    for r in rows:
        if "s" in r:
            r["speedup"] = base / r["s"] if base else float("nan")
    return rows, failures


HEADER = (
    "| layers (M x K x N) | GEMM | form | cuBLASLt FP8 calls | their result | entry fusions | rel. error | ms "
    "| vs bf16 |",
    "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
)


def _row(r: dict) -> str:
    g = r["shape"]
    if "failed" in r:
        return f"| {g.layers}: {g.m} x {g.k} x {g.n} | {r['gemm']} | {r['form']} | failed: {r['failed']} | | | | | |"
    calls = "n/a (CPU)" if r["calls"] is None else str(r["calls"])
    result = "n/a" if r["result"] is None else (r["result"] or "-")
    return (
        f"| {g.layers}: {g.m} x {g.k} x {g.n} | {r['gemm']} | {r['form']} | {calls} | {result} | {r['fusions']} | "
        f"{r['err']:.4f} | {r['s'] * 1e3:.3f} | {r['speedup']:.3f}x |"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments bench fp8_out", description=__doc__)
    parser.add_argument("--config", default="configs/gem_h200.toml,configs/hstu_nvidia.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--gemms", default="fwd,dx,dw,dw_t", help="which of a layer's GEMMs (module docstring)"
    )
    parser.add_argument(
        "--small", action="store_true", help="configs/tiny.toml's GEMMs, one rep (CPU smoke run)"
    )
    args = parser.parse_args(argv)
    if args.small:
        args.config, args.reps = "configs/tiny.toml", 1
    shapes: dict[tuple[int, int, int], GemmShape] = {}
    for path in args.config.split(","):
        for g in model_gemm_shapes(load_config(path, args.overrides)):
            shapes.setdefault((g.m, g.k, g.n), g)
    device = jax.devices()[0]
    print(f"# FP8 GEMM result dtype, {datetime.date.today()}, {device.device_kind}, jax {jax.__version__}")
    print(f"# configs {args.config}; median of {args.reps} reps; forms: module docstring\n")
    print("\n".join(HEADER), flush=True)
    failures = []
    for shape in shapes.values():  # rows print as measured: a call cut short keeps what it got
        gemms = layer_gemms(shape)
        for name in args.gemms.split(","):
            rows, failed = bench_gemm(shape, gemms[name], args.reps)
            failures += failed
            for r in rows:
                print(_row(r), flush=True)
    for f in failures:
        print(f"CHECK FAILED: {f}")
    return 1 if failures else 0
