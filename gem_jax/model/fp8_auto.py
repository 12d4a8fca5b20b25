"""`precision.fp8 = "auto"`: FP8 only on the layers whose GEMMs measured faster in FP8 on this GPU kind.

FP8 pays only where a GEMM is large enough to hide its quantisation passes (amax and cast of each input,
memory round trips): on the H200 the gem_h200 step (width 512) was slower in FP8 than in bf16. So "auto"
asks a table of measurements instead of guessing: `python -m experiments bench fp8 --sweep --write-table`
times forward + backward of one Dense layer, FP8 (with its quantisation passes) against bf16, for every
GEMM shape of the shipped configs and a sweep of widths, and stores the medians in `fp8_speedups.json`
beside this module, per GPU kind (`jax.Device.device_kind`).

`resolve(config)` (called when the task is built) turns "auto" into `fp8 = true` with `fp8_layers` the
exact names of the layers that pay, or `fp8 = false` when none does. A layer pays when the table holds its
(K, N) for this GPU kind at a token count M within a factor of 2 of its own and FP8 was at least
`MIN_SPEEDUP` faster there (the nearest such M decides). A shape the table lacks, a GPU kind it lacks and
any CPU run stay in bf16, so "auto" is never slower than bf16 by the table's measurements. The run record
holds the resolved config, so a resumed run keeps its layers whatever GPU it resumes on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
from flax import nnx

from gem_jax.config import Config, ConfigError
from gem_jax.model.gem import GEMModel
from gem_jax.model.layers import Dense

TABLE = Path(__file__).with_name("fp8_speedups.json")
# FP8 must beat bf16 by more than noise and than what the layer bench misses: on the H200 (2026-12-03) the
# hstu_nvidia uvqk layers measured 1.08x alone, yet the step with FP8 on them ran at 0.99x of bf16.
MIN_SPEEDUP = 1.10
MAX_M_RATIO = 2.0  # a measured token count stands for the layer's within this factor


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


def layer_gemm_shapes(config: Config) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of every Dense layer `precision.fp8_layers` names in the ranking model: K and N from the
    model itself (built abstractly), M from the batch: tokens for the HSTU tower, examples x candidates
    for the Wukong stack."""
    if config.data.kind == "interactions":
        raise ConfigError(
            '`precision.fp8 = "auto"` knows the ranking model\'s GEMMs only; the next-item model takes '
            "true or false"
        )
    config = dataclasses.replace(config, precision=dataclasses.replace(config.precision, fp8=True))
    model = nnx.eval_shape(lambda: GEMModel(config, rngs=nnx.Rngs(0)))
    d = config.data
    rows = {"hstu/": d.tokens_per_shard, "wukong/": d.examples_per_shard * d.num_candidates}
    shapes = {}
    for _, layer in nnx.iter_graph(model):
        if isinstance(layer, Dense) and layer.fp8 is not None:
            m = next((r for prefix, r in rows.items() if layer.name.startswith(prefix)), d.tokens_per_shard)
            shapes[layer.name] = (m, *layer.kernel.shape)
    return shapes


def model_gemm_shapes(config: Config) -> list[GemmShape]:
    """The distinct (M, K, N) of the model's FP8 layers, with the layers of each."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for name, mkn in layer_gemm_shapes(config).items():
        groups.setdefault(mkn, []).append(name)
    return [GemmShape(", ".join(sorted(names)), *mkn) for mkn, names in sorted(groups.items())]


def load_table(path: Path | None = None) -> dict:
    """{device_kind: [{"m", "k", "n", "fp8_s", "bf16_s", "date", "jax"}, ...]} ({} when absent); the
    shipped TABLE by default."""
    path = TABLE if path is None else path
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: not valid JSON ({e}); rewrite it with `bench fp8 --sweep --write-table`"
        ) from e


def speedup(table: dict, device_kind: str, m: int, k: int, n: int) -> float | None:
    """bf16 time / FP8 time measured for (K, N) at the token count nearest M (within MAX_M_RATIO), or None."""
    rows = [r for r in table.get(device_kind, []) if (r["k"], r["n"]) == (k, n)]
    rows = [r for r in rows if abs(math.log(r["m"] / m)) <= math.log(MAX_M_RATIO)]
    if not rows:
        return None
    best = min(rows, key=lambda r: abs(math.log(r["m"] / m)))
    return best["bf16_s"] / best["fp8_s"]


def resolve(config: Config, device_kind: str | None = None, table: dict | None = None) -> Config:
    """`config` with "auto" replaced by the measured choice (module docstring); any other value as is."""
    if config.precision.fp8 != "auto":
        return config
    kind = device_kind if device_kind is not None else jax.devices()[0].device_kind
    table = load_table() if table is None else table
    shapes = layer_gemm_shapes(config)
    gains = {name: speedup(table, kind, *mkn) for name, mkn in shapes.items()}
    chosen = tuple(sorted(name for name, g in gains.items() if g is not None and g >= MIN_SPEEDUP))
    unmeasured = sorted(name for name, g in gains.items() if g is None)
    print(
        f'precision.fp8 = "auto" on {kind}: FP8 on {len(chosen)} of {len(shapes)} layers'
        + (f" ({', '.join(chosen)})" if chosen else "")
        + (
            f"; not measured at their shapes on this GPU kind, so bf16: {', '.join(unmeasured)}"
            if unmeasured
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    precision = dataclasses.replace(
        config.precision, fp8=bool(chosen), fp8_layers=chosen or config.precision.fp8_layers
    )
    return dataclasses.replace(config, precision=precision)


def merge_rows(table: dict, device_kind: str, rows: list[dict]) -> dict:
    """`table` with `rows` (one per measured shape) replacing this GPU kind's rows of the same (M, K, N)."""
    fresh = {(r["m"], r["k"], r["n"]) for r in rows}
    kept = [r for r in table.get(device_kind, []) if (r["m"], r["k"], r["n"]) not in fresh]
    out = dict(table)
    out[device_kind] = sorted(kept + rows, key=lambda r: (r["k"], r["n"], r["m"]))
    return out
