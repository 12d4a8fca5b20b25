"""`python -m experiments bench fp8 [--config configs/gem_h200.toml] [--small]`: FP8 Dense vs bf16 Dense.

For every distinct FP8 GEMM shape of the config's model (HSTU U/V/Q/K and output projections over
`data.tokens_per_shard` tokens, Wukong FM MLPs over examples x candidates rows) and an N^3 square:
1. compiles forward + backward of one FP8 Dense and counts `__cublas$lt$matmul$f8` calls in the
   optimised HLO: one per FP8 GEMM (Y, dX, dW) is the check that XLA reached the FP8 tensor cores
   (GPU only; on CPU XLA upcasts FP8 and there is nothing to count);
2. checks Y, dX, dW of the FP8 and the bf16 Dense against float32 on fresh random inputs, within
   `fp8.dot_error_bound` of their formats;
3. times forward + backward of both (median), and the bare forward GEMM (FP8 operands already
   quantised vs bf16), and prints a markdown table.
It also compiles the FP8 layer the way the train step runs it (vmapped over the packs of a device,
under shard_map) and counts its FP8 GEMMs per recipe. Exit code 1 if any check fails.
`--config` takes several configs (comma-separated); `--widths` adds (M, w, w) and (M, w, 4w) GEMMs; each row
prints as it is measured. `--write-table [PATH]` merges the first recipe's times into the table that
`precision.fp8 = "auto"` reads (gem_jax/model/fp8_auto.py), under this GPU's kind, each shape as soon as it is
measured and its checks passed.
The model's GEMM shapes come from the layers themselves: an abstract build of the model with every
`precision.fp8_layers` layer in FP8, whose Dense layers each keep their (M, K, N) (`Dense.fp8_decision`,
`model_gemm_shapes`). That build only reads shapes; which layers "auto" puts in FP8 is decided by the
precision policy as each layer of the trained model is built (gem_jax/precision.py), never here.
`--small`: the largest configs/tiny.toml GEMM and a 128^3 square, seconds on CPU (a test runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from experiments.benchmarks.timing import median_seconds
from gem_jax.config import Config, ConfigError, PrecisionConfig, load_config
from gem_jax.model import fp8, fp8_auto
from gem_jax.model.gem import GEMModel
from gem_jax.model.layers import Dense, fp8_decisions
from gem_jax.precision import RECIPES, PrecisionPolicy

CUBLAS_FP8 = 'custom_call_target="__cublas$lt$matmul$f8"'


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One FP8 GEMM shape: Y[M, N] = X[M, K] W[K, N], and the model's layers that have it."""

    layers: str  # the model's layers with this shape, comma-separated
    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:  # forward + backward: three GEMMs of 2 M K N
        return 3 * 2.0 * self.m * self.k * self.n


def model_gemm_shapes(config: Config) -> list[GemmShape]:
    """The distinct (M, K, N) of the ranking model's `precision.fp8_layers` layers, with the layers of each, as
    the layers record them when built (module docstring)."""
    if config.data.kind == "interactions":
        raise ConfigError("bench fp8 knows the ranking model's GEMMs only")
    precision = dataclasses.replace(config.precision, fp8=True, fp8_auto_choice=None)
    config = dataclasses.replace(config, precision=precision)
    model = nnx.eval_shape(lambda: GEMModel(config, rngs=nnx.Rngs(0)))
    groups: dict[tuple[int, int, int], list[str]] = {}
    for d in fp8_decisions(model):
        groups.setdefault((d.m, d.k, d.n), []).append(d.layer)
    return [GemmShape(", ".join(sorted(names)), *mkn) for mkn, names in sorted(groups.items())]


def _dense_pair(recipe: str, k: int, n: int) -> tuple[Dense, Dense]:
    """An FP8 Dense and a bf16 Dense with the same initial kernel."""
    cfg = PrecisionConfig(compute_dtype="bfloat16", fp8=True, fp8_layers=("fp8",), fp8_recipe=recipe)
    policy = PrecisionPolicy.from_config(cfg)
    return Dense("fp8", k, n, policy, rngs=nnx.Rngs(0)), Dense("bf16", k, n, policy, rngs=nnx.Rngs(0))


def _train_step(layer: Dense):
    """(jitted value_and_grad of sum(layer(x) * c) -> ((loss, y), (dparams, dprobes, dx)), state)."""
    graphdef, *states = nnx.split(layer, nnx.Param, fp8.FP8Meta, fp8.AmaxProbe)
    params, histories, probes = (nnx.to_pure_dict(s) for s in states)

    def loss(params, probes, histories, x, c):
        y = nnx.merge(graphdef, params, histories, probes)(x)
        return jnp.sum(y.astype(jnp.float32) * c), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3), has_aux=True)), params, histories, probes


@jax.jit
def _rel_error(a: jax.Array, b: jax.Array) -> jax.Array:
    """||a - b|| / ||b||, on the device (the gem_h200 outputs have 4e8 elements)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(a - b)) / jnp.sum(jnp.square(b)))


def relative_error(a, b) -> float:
    return float(_rel_error(a, b))


def _gemm_only(shape: GemmShape, key, reps: int) -> tuple[float, float, int]:
    """Seconds of the bare forward GEMM, FP8 (operands already quantised) and bf16; FP8 call count."""

    @jax.jit
    def operands(key):
        a = jax.random.normal(key, (shape.m, shape.k), jnp.float32)
        b = jax.random.normal(jax.random.fold_in(key, 1), (shape.k, shape.n), jnp.float32)
        sa, sb = (fp8.scale_from_amax(fp8.amax(t), fp8.E4M3, 0) for t in (a, b))
        return a, b, sa, sb, fp8.quantize(a, sa, fp8.E4M3), fp8.quantize(b, sb, fp8.E4M3)

    a, b, sa, sb, aq, bq = operands(key)
    # The FP8 Dense's forward GEMM (bf16 result, fast accumulation) against the bf16 Dense's (bf16 result).
    f8 = jax.jit(
        lambda aq, bq, sa, sb: fp8.scaled_dot(aq, bq, sa, sb, (1, 0), jnp.bfloat16, jax.lax.Precision.DEFAULT)
    )
    bf16 = jax.jit(jnp.dot)
    calls = (
        f8.lower(aq, bq, sa, sb).compile().as_text().count(CUBLAS_FP8)
        if jax.default_backend() == "gpu"
        else 0
    )
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return median_seconds(f8, aq, bq, sa, sb, reps=reps), median_seconds(bf16, a16, b16, reps=reps), calls


def bench_shape(shape: GemmShape, recipe: str, reps: int, seed: int = 0) -> tuple[dict, list[str]]:
    """Checks, then times, one shape and recipe; returns the table row and the failed checks."""
    on_gpu = jax.default_backend() == "gpu"
    key = jax.random.key(seed)
    x = jax.random.normal(key, (shape.m, shape.k), jnp.bfloat16)
    c = jax.random.normal(jax.random.fold_in(key, 1), (shape.m, shape.n), jnp.bfloat16).astype(jnp.float32)
    fp8_layer, bf16_layer = _dense_pair(recipe, shape.k, shape.n)
    kernel = fp8_layer.kernel[...]
    hi = jax.lax.Precision.HIGHEST
    ref = jax.jit(
        lambda x, w, c: (
            jnp.dot(x, w, precision=hi),
            jnp.dot(c, w.T, precision=hi),
            jnp.dot(x.T, c, precision=hi),
        )
    )(x.astype(jnp.float32), kernel, c)
    failures, row = [], {"gemm": shape, "recipe": recipe}
    for name, layer in (("fp8", fp8_layer), ("bf16", bf16_layer)):
        step, params, histories, probes = _train_step(layer)
        if histories:  # delayed scaling: one calibrating step records the amaxes the next ones use
            (_, _), (_, dprobes, _) = step(params, probes, histories, x, c)
            histories = fp8.update_meta(histories, dprobes)
        (_, y), (dparams, _, dx) = step(params, probes, histories, x, c)
        row[f"{name}_err"] = [
            relative_error(y, ref[0]),
            relative_error(dx, ref[1]),
            relative_error(dparams["kernel"], ref[2]),
        ]
        row[f"{name}_s"] = median_seconds(step, params, probes, histories, x, c, reps=reps)
        if name == "fp8":
            row["calls"] = None  # nothing to count on CPU
            if on_gpu:
                row["calls"] = (
                    step.lower(params, probes, histories, x, c).compile().as_text().count(CUBLAS_FP8)
                )
                if row["calls"] != 3:
                    failures.append(f"{shape.layers} {recipe}: {row['calls']} cuBLASLt FP8 GEMMs, expected 3")
    e4, e5, b16 = fp8.E4M3, fp8.E5M2, jnp.bfloat16
    bounds = {
        # Y and dX come out in bf16 (the compute dtype, x's dtype): one more rounding; dW in f32.
        "fp8": [
            fp8.dot_error_bound(e4, e4, b16),
            fp8.dot_error_bound(e5, e4, b16),
            fp8.dot_error_bound(e4, e5),
        ],
        "bf16": [fp8.dot_error_bound(b16, b16, b16)] * 3,
    }
    for name, errs in bounds.items():
        for what, err, bound in zip(("Y", "dX", "dW"), row[f"{name}_err"], errs):
            if not err < bound:
                failures.append(
                    f"{shape.layers} {recipe} {name} {what}: relative error {err:.4f} >= {bound:.4f}"
                )
    row["gemm_fp8_s"], row["gemm_bf16_s"], gemm_calls = _gemm_only(shape, jax.random.fold_in(key, 2), reps)
    if on_gpu and gemm_calls != 1:
        failures.append(
            f"{shape.layers}: bare FP8 GEMM compiled to {gemm_calls} cuBLASLt FP8 calls, expected 1"
        )
    return row, failures


def trainer_shaped_calls(shape: GemmShape, recipe: str, packs_per_device: int) -> int:
    """cuBLASLt FP8 calls when the layer runs as in the train step: per-pack loss vmapped over the
    packs of one device under shard_map, per-pack probes, gradients for params, probes and x.
    Compiled from abstract shapes (no memory)."""
    layer, _ = _dense_pair(recipe, shape.k, shape.n)
    graphdef, *states = nnx.split(layer, nnx.Param, fp8.FP8Meta, fp8.AmaxProbe)
    params, histories, probes = (nnx.to_pure_dict(s) for s in states)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def loss(params, pack_probes, histories, xs):
        def local(params, pack_probes, histories, xs):
            def per_pack(probes, x):
                return jnp.sum(nnx.merge(graphdef, params, histories, probes)(x).astype(jnp.float32))

            return jax.lax.psum(jax.vmap(per_pack)(pack_probes, xs).sum(), "data")

        spec = P("data")
        in_specs = (P(), spec, P(), spec)
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)(
            params, pack_probes, histories, xs
        )

    xs = jax.ShapeDtypeStruct((packs_per_device, shape.m, shape.k), jnp.bfloat16)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3)))
    text = step.lower(params, fp8.pack_probes(probes, packs_per_device), histories, xs).compile().as_text()
    return text.count(CUBLAS_FP8)


TABLE_HEADER = [
    "| FP8 layers | M x K x N | recipe | FP8 GEMM calls (of 3) | FP8 rel. err Y / dX / dW | bf16 rel. err "
    "Y / dX / dW | bf16 fwd+bwd ms | FP8 fwd+bwd ms | speedup | FP8 TFLOP/s | bare GEMM FP8 / bf16 "
    "TFLOP/s |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]


def _table_row(r: dict) -> str:
    g = r["gemm"]
    fwd = 2.0 * g.m * g.k * g.n
    calls = "n/a (CPU)" if r["calls"] is None else str(r["calls"])
    errs = {k: " / ".join(f"{e:.4f}" for e in r[f"{k}_err"]) for k in ("fp8", "bf16")}
    return (
        f"| {g.layers} | {g.m} x {g.k} x {g.n} | {r['recipe']} | {calls} | {errs['fp8']} | {errs['bf16']} | "
        f"{r['bf16_s'] * 1e3:.3f} | {r['fp8_s'] * 1e3:.3f} | {r['bf16_s'] / r['fp8_s']:.2f}x | "
        f"{g.flops / r['fp8_s'] / 1e12:.1f} | {fwd / r['gemm_fp8_s'] / 1e12:.1f} / "
        f"{fwd / r['gemm_bf16_s'] / 1e12:.1f} |"
    )


def _write_row(path: Path, device_kind: str, row: dict) -> None:
    """Merges one measured shape into the `"auto"` table at once (a run cut short keeps its rows)."""
    g = row["gemm"]
    measured = {"m": g.m, "k": g.k, "n": g.n, "fp8_s": row["fp8_s"], "bf16_s": row["bf16_s"]}
    measured.update(recipe=row["recipe"], date=str(datetime.date.today()), jax=jax.__version__)
    table = fp8_auto.merge_rows(fp8_auto.load_table(path), device_kind, [measured])
    path.write_text(json.dumps(table, indent=1) + "\n")


def _shapes(args, configs) -> list[GemmShape]:
    """Every distinct model GEMM of the configs, then the sweep's (M, w, w) and (M, w, 4 w) shapes (M: the
    first config's tokens per pack), then the square; each (M, K, N) once."""
    shapes: dict[tuple[int, int, int], GemmShape] = {}
    for path, config in configs:
        model = model_gemm_shapes(config)
        if args.small:  # the largest model GEMM only: the run is there to exercise the code
            model = [max(model, key=lambda g: g.flops)]
        for g in model:
            shapes.setdefault(
                (g.m, g.k, g.n), dataclasses.replace(g, layers=f"{Path(path).stem}: {g.layers}")
            )
    m = configs[0][1].data.tokens_per_shard
    for w in args.widths:
        for k, n in ((w, w), (w, 4 * w)):
            shapes.setdefault((m, k, n), GemmShape(f"width {w}", m, k, n))
    if args.square:
        s = args.square
        shapes.setdefault((s, s, s), GemmShape("square", s, s, s))
    return list(shapes.values())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments bench fp8", description=__doc__)
    parser.add_argument("--config", default="configs/gem_h200.toml", help="comma-separated configs")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--recipes", default="delayed,current", help="comma-separated FP8 recipes")
    parser.add_argument("--square", type=int, default=8192, help="also an N^3 GEMM (0: none)")
    parser.add_argument(
        "--widths",
        type=lambda t: [int(w) for w in t.split(",") if w],
        default=[],
        help="also (M, w, w) and (M, w, 4w) GEMMs for each width, M the first config's tokens per pack",
    )
    parser.add_argument(
        "--write-table",
        nargs="?",
        const=str(fp8_auto.TABLE),
        default=None,
        help=f'merge the first recipe\'s times into the table `precision.fp8 = "auto"` reads ({fp8_auto.TABLE.name})',
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    args = parser.parse_args(argv)
    if args.small:
        args.config, args.square, args.reps = "configs/tiny.toml", 128, 1
    recipes = args.recipes.split(",")
    for recipe in recipes:
        if recipe not in RECIPES:
            parser.error(f"--recipes: unknown recipe {recipe!r} (known: {', '.join(RECIPES)})")
    configs = [(path, load_config(path, args.overrides)) for path in args.config.split(",")]
    shapes = _shapes(args, configs)

    device = jax.devices()[0]
    print(f"# FP8 Dense vs bf16 Dense, {datetime.date.today()}, {device.device_kind}, jax {jax.__version__}")
    print(f"# configs {args.config} {' '.join(args.overrides)}; median of {args.reps} reps\n")
    print("\n".join(TABLE_HEADER), flush=True)
    rows, failures, written = [], [], 0
    for shape in shapes:  # each row as it is measured: a call cut short still shows (and keeps) what it got
        for recipe in recipes:
            row, failed = bench_shape(shape, recipe, args.reps)
            rows.append(row)
            failures += failed
            print(_table_row(row), flush=True)
            if args.write_table and recipe == recipes[0] and not failed:
                _write_row(Path(args.write_table), device.device_kind, row)
                written += 1

    print(
        "\n| recipe | packs per device | FP8 GEMM calls in the train-step shape (of 3) |\n| --- | --- | --- |"
    )
    big = max(model_gemm_shapes(configs[0][1]), key=lambda g: g.flops)
    for recipe in recipes:
        for packs in (1, 2):
            calls = trainer_shaped_calls(big, recipe, packs)
            shown = str(calls) if device.platform == "gpu" else "n/a (CPU)"
            print(f"| {recipe} | {packs} | {shown} ({big.layers}: {big.m} x {big.k} x {big.n}) |")
            if device.platform == "gpu" and recipe == "delayed" and calls != 3:
                failures.append(f"train-step shape, delayed, {packs} packs: {calls} FP8 GEMMs, expected 3")
    for f in failures:
        print(f"CHECK FAILED: {f}")
    if args.write_table:
        kind = device.device_kind
        print(
            f"wrote {written} {recipes[0]} rows (those whose checks passed) for {kind} into {args.write_table}"
        )
    return 1 if failures else 0
