"""`python -m experiments bench fp8_out [--config ...] [--small]`: can XLA's FP8 GEMM write bf16?

Why: on jax 0.11.2 the FP8 Dense's GEMM (`gem_jax/model/fp8.py`: a dot of f32 dequantisations with an f32
result) compiles to a cuBLASLt FP8 GEMM that writes float32, and XLA casts to bf16 after. On gem_h200 those
casts cost more than the FP8 GEMMs save (docs/fp8.md). openxla's GEMM rewriter accepts a bf16 result for an
FP8 GEMM when the dot itself is bf16-typed; this benchmark checks which way of writing the forward GEMM gets
there, on every FP8 GEMM shape of the configs' models:

  bf16          bf16 x bf16 -> bf16, the baseline
  f32_out       dot(f32(xq) * sx, f32(wq) * sw) -> f32, then bf16: what the FP8 Dense runs today
  bf16_out      the same dot with preferred_element_type=bf16 (the dot typed bf16)
  raw_bf16_out  dot_general(xq, wq) -> bf16 on the FP8 arrays themselves, times sx * sw (rounded to bf16) after
  raw_bf16_out_f32_scale   the same, the scale applied in float32 to the bf16 result (no rounded scale)
  raw_f32_out   dot_general(xq, wq) -> f32 on the FP8 arrays, times sx * sw, then bf16

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
import datetime
import re

import jax
import jax.numpy as jnp
from jax import lax

from experiments.benchmarks.fp8 import CUBLAS_FP8, GemmShape, model_gemm_shapes, relative_error
from experiments.benchmarks.timing import median_seconds
from gem_jax.config import load_config
from gem_jax.model import fp8


def _f32_out(xq, wq, sx, sw):
    return fp8.fp8_dot(fp8.dequantize(xq, sx), fp8.dequantize(wq, sw), (1, 0), None).astype(jnp.bfloat16)


def _bf16_out(xq, wq, sx, sw):
    a, b = fp8.dequantize(xq, sx), fp8.dequantize(wq, sw)
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)


def _raw_bf16_out(xq, wq, sx, sw):
    y = lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return y * (sx * sw).astype(jnp.bfloat16)


def _raw_bf16_out_f32_scale(xq, wq, sx, sw):
    y = lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return (y.astype(jnp.float32) * (sx * sw)).astype(jnp.bfloat16)


def _raw_f32_out(xq, wq, sx, sw):
    y = lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (sx * sw)).astype(jnp.bfloat16)


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


def bench_shape(shape: GemmShape, reps: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    """Checks, then times, every form at one shape; returns one row per form and the failed checks."""
    key = jax.random.key(seed)

    @jax.jit
    def operands(key):
        x = jax.random.normal(key, (shape.m, shape.k), jnp.float32)
        w = jax.random.normal(jax.random.fold_in(key, 1), (shape.k, shape.n), jnp.float32) / shape.k**0.5
        sx, sw = (fp8.scale_from_amax(fp8.amax(t), fp8.E4M3, 0) for t in (x, w))
        return x, w, sx, sw, fp8.quantize(x, sx, fp8.E4M3), fp8.quantize(w, sw, fp8.E4M3)

    x, w, sx, sw, xq, wq = operands(key)
    want = jax.jit(lambda x, w: jnp.dot(x, w, precision=lax.Precision.HIGHEST))(x, w)
    bound = fp8.dot_error_bound(fp8.E4M3, fp8.E4M3, jnp.bfloat16)
    forms = {"bf16": (jax.jit(jnp.dot), (x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))}
    forms.update({name: (jax.jit(f), (xq, wq, sx, sw)) for name, f in FP8_FORMS.items()})
    rows, failures = [], []
    on_gpu = jax.default_backend() == "gpu"
    for name, (fn, args) in forms.items():
        try:
            y = fn(*args)
            hlo = fn.lower(*args).compile().as_text()
        except (
            Exception
        ) as e:  # e.g. "GEMM is not supported by cublasLt" under some XLA flags: a row, not a crash
            failures.append(f"{shape.layers} {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append({"shape": shape, "form": name, "failed": str(e).splitlines()[0][:80]})
            continue
        calls, dtypes = fp8_calls(hlo)
        err = relative_error(y, want)
        limit = bound if name != "bf16" else fp8.dot_error_bound(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
        if not (err < limit and y.dtype == jnp.bfloat16):
            failures.append(
                f"{shape.layers} {name}: {y.dtype} result, relative error {err:.4f} (bound {limit:.4f})"
            )
        rows.append(
            {
                "shape": shape,
                "form": name,
                "calls": calls if on_gpu else None,
                "result": ",".join(dtypes) if on_gpu else None,
                "fusions": entry_fusions(hlo),
                "err": err,
                "s": median_seconds(fn, *args, reps=reps),
            }
        )
    base = rows[0].get("s")
    for r in rows:
        if "s" in r:
            r["speedup"] = base / r["s"] if base else float("nan")
    return rows, failures


HEADER = (
    "| GEMM (M x K x N) | form | cuBLASLt FP8 calls | their result | entry fusions | rel. error | ms | vs bf16 |",
    "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
)


def _row(r: dict) -> str:
    g = r["shape"]
    if "failed" in r:
        return f"| {g.layers}: {g.m} x {g.k} x {g.n} | {r['form']} | failed: {r['failed']} | | | | | |"
    calls = "n/a (CPU)" if r["calls"] is None else str(r["calls"])
    result = "n/a" if r["result"] is None else (r["result"] or "-")
    return (
        f"| {g.layers}: {g.m} x {g.k} x {g.n} | {r['form']} | {calls} | {result} | {r['fusions']} | "
        f"{r['err']:.4f} | {r['s'] * 1e3:.3f} | {r['speedup']:.3f}x |"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments bench fp8_out", description=__doc__)
    parser.add_argument("--config", default="configs/gem_h200.toml,configs/hstu_nvidia.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--reps", type=int, default=20)
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
        rows, failed = bench_shape(shape, args.reps)
        failures += failed
        for r in rows:
            print(_row(r), flush=True)
    for f in failures:
        print(f"CHECK FAILED: {f}")
    return 1 if failures else 0
