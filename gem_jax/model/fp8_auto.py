"""`precision.fp8 = "auto"`: the table of measurements it decides on, and what a run records of its choice.

FP8 pays only where a GEMM is large enough to hide its quantisation passes (amax and cast of each input,
memory round trips): on the H200 the gem_h200 step (width 512) was slower in FP8 than in bf16. So "auto"
asks a table of measurements instead of guessing: `python -m experiments bench fp8 --widths ... --write-table`
times forward + backward of one Dense layer, FP8 (with its quantisation passes) against bf16, for every
GEMM shape of the shipped configs and a sweep of widths, and stores the medians in `fp8_speedups.json`
beside this module, per GPU kind (`jax.Device.device_kind`).

The decision is not made here: each Dense layer asks the precision policy as it is built, from its own
(M, K, N) (`PrecisionPolicy.fp8_decision`, gem_jax/precision.py: FP8 where the table holds its (K, N) for
this GPU kind at a token count within 2x of its own, the nearest deciding, and FP8 was at least
`MIN_SPEEDUP` faster; bf16 for a shape or GPU kind the table lacks and on CPU). This module reads the table
for the policy (`speedups`), and afterwards turns the decisions the built layers keep into what the run
record stores (`recorded_choice`: `precision.fp8_auto_choice`, the exact layer names, so a resume or
`eval` builds the same layers whatever GPU it runs on) and into the line the trainer prints (`describe`).
No model is built here: the layers' shapes are known where the layers are built, and a second, abstract
build to read them would be a second place deciding.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from gem_jax.config import Config, ConfigError, PrecisionConfig
from gem_jax.precision import FP8Decision, FP8Speedups

TABLE = Path(__file__).with_name("fp8_speedups.json")


def load_table(path: Path | None = None) -> dict:
    """{device_kind: [{"m", "k", "n", "fp8_s", "bf16_s", "date", "jax"}, ...]} ({} when absent); the
    shipped TABLE by default."""
    path = TABLE if path is None else path
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); rewrite it with `bench fp8 --write-table`") from e


def device_kind() -> str:
    """The GPU kind the table is keyed by ("cpu" on a CPU run, which no table holds)."""
    return jax.devices()[0].device_kind


def speedups(precision: PrecisionConfig) -> FP8Speedups | None:
    """This GPU kind's rows of the table, for the policy to decide "auto" layers by; None when the config
    does not ask the table (fp8 is not "auto", or the run's recorded choice decides)."""
    if precision.fp8 != "auto" or precision.fp8_auto_choice is not None:
        return None
    kind = device_kind()
    rows = load_table().get(kind, [])
    return FP8Speedups(kind, tuple((r["m"], r["k"], r["n"], r["bf16_s"] / r["fp8_s"]) for r in rows))


def recorded_choice(config: Config, decisions: list[FP8Decision]) -> Config:
    """`config` as the run record keeps it: with "auto" undecided, `precision.fp8_auto_choice` becomes the
    layers that `decisions` (the built model's, `fp8_decisions`) put in FP8; any other config as is."""
    p = config.precision
    if p.fp8 != "auto" or p.fp8_auto_choice is not None:
        return config
    chosen = tuple(sorted(d.layer for d in decisions if d.recipe is not None))
    return dataclasses.replace(config, precision=dataclasses.replace(p, fp8_auto_choice=chosen))


def describe(precision: PrecisionConfig, decisions: list[FP8Decision]) -> str:
    """The start-up line of an "auto" run: which layers run FP8, and why the others do not."""
    chosen = sorted(d.layer for d in decisions if d.recipe is not None)
    on = f"FP8 on {len(chosen)} of {len(decisions)} layers" + (f" ({', '.join(chosen)})" if chosen else "")
    if precision.fp8_auto_choice is not None:
        return f'precision.fp8 = "auto": {on}, as the run chose when it started (precision.fp8_auto_choice)'
    unmeasured = sorted(d.layer for d in decisions if d.speedup is None)
    return f'precision.fp8 = "auto" on {device_kind()}: {on}' + (
        f"; not measured at their shapes on this GPU kind, so bf16: {', '.join(unmeasured)}"
        if unmeasured
        else ""
    )


def merge_rows(table: dict, kind: str, rows: list[dict]) -> dict:
    """`table` with `rows` (one per measured shape) replacing GPU kind `kind`'s rows of the same (M, K, N)."""
    fresh = {(r["m"], r["k"], r["n"]) for r in rows}
    kept = [r for r in table.get(kind, []) if (r["m"], r["k"], r["n"]) not in fresh]
    out = dict(table)
    out[kind] = sorted(kept + rows, key=lambda r: (r["k"], r["n"], r["m"]))
    return out
