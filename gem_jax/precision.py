"""Per-layer precision policy: which dtype each named layer stores its parameters and computes in, and
whether its GEMM runs in FP8.

Model code asks the policy by layer name (`policy.compute_dtype("hstu/0/uvqk")`); the config's
`precision.overrides` maps name prefixes to dtypes, so a layer's precision changes without touching
model code. With `precision.fp8`, each Dense layer asks `policy.fp8_decision(name, d_in, d_out)` as it is
built and gets back its `FP8Decision`: the `FP8Recipe` its GEMM runs with (gem_jax/model/fp8.py applies
it), or None to stay in its compute dtype; the output keeps the layer's compute dtype either way.

The FP8 decision is made here and only here, per layer, from the layer's own GEMM: `precision.fp8 = true`
puts every layer `precision.fp8_layers` names in FP8; "auto" only those whose (M, K, N) measured at least
`MIN_SPEEDUP` faster in FP8 on this GPU kind (`FP8Speedups`, read from the table by
gem_jax/model/fp8_auto.py), or, once a run has chosen, exactly the layers its run record names
(`precision.fp8_auto_choice`). K and N are the layer's widths; M, the rows it multiplies per pack, comes
from the model that built the policy (`gemm_rows`), which alone knows its batch. Each layer keeps its
decision (`Dense.fp8_decision`): the trainer records and reports the choice from there, and the FP8 bench
reads the model's GEMM shapes from there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from jax.typing import DTypeLike

from gem_jax.config import ConfigError, PrecisionConfig
from gem_jax.dtypes import DTYPES, FLOAT_DTYPES

# FP8 must beat bf16 by more than noise and than what the layer bench misses: on the H200 (2026-12-03) the
# hstu_nvidia uvqk layers measured 1.08x alone, yet the step with FP8 on them ran at 0.99x of bf16.
MIN_SPEEDUP = 1.10
MAX_M_RATIO = 2.0  # a measured token count stands for the layer's within this factor


def _dtype(name: str, key: str) -> DTypeLike:
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"`precision.{key}` must be one of {FLOAT_DTYPES}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class FP8Speedups:
    """What "auto" decides on: one GPU kind's measured speedups (bf16 time / FP8 time of a Dense layer's
    forward + backward, quantisation included) by GEMM shape, as `bench fp8 --write-table` stored them."""

    device_kind: str
    measured: tuple[tuple[int, int, int, float], ...] = ()  # (M, K, N, speedup)

    def at(self, m: int, k: int, n: int) -> float | None:
        """The speedup measured for (K, N) at the token count nearest M within MAX_M_RATIO, or None."""
        near = [
            (abs(math.log(mm / m)), s)
            for mm, kk, nn, s in self.measured
            if (kk, nn) == (k, n) and abs(math.log(mm / m)) <= math.log(MAX_M_RATIO)
        ]
        return min(near, key=lambda d_s: d_s[0])[1] if near else None  # a tie: the table's first row


@dataclass(frozen=True)
class FP8Decision:
    """One Dense layer that `precision.fp8_layers` names: its GEMM Y[M, N] = X[M, K] W[K, N] per pack, the
    recipe it runs with (None: its compute dtype) and, when the table decided ("auto"), the speedup it read."""

    layer: str
    m: int | None  # None: the model gave no row count for this layer
    k: int
    n: int
    recipe: FP8Recipe | None
    speedup: float | None = None  # None: not measured at this shape, or not asked


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: DTypeLike
    default_compute: DTypeLike
    sensitive: DTypeLike
    overrides: tuple[tuple[str, DTypeLike], ...]
    fp8: FP8Recipe | None = None  # None: no FP8 layers
    fp8_layers: tuple[str, ...] = ()
    fp8_auto: bool = False  # precision.fp8 = "auto": the table (or the run's recorded choice) decides
    fp8_auto_choice: tuple[str, ...] | None = None  # the run's recorded choice: wins over the table
    fp8_speedups: FP8Speedups | None = None  # this GPU kind's measurements ("auto" with no recorded choice)
    gemm_rows: tuple[tuple[str, int], ...] = ()  # (layer-name prefix, rows per pack), longest prefix first
    residual: DTypeLike = DTYPES["float32"]  # the sequence tower's residual stream (precision.residual_dtype)

    @classmethod
    def from_config(
        cls,
        config: PrecisionConfig,
        *,
        gemm_rows: Mapping[str, int] | None = None,
        fp8_speedups: FP8Speedups | None = None,
    ) -> PrecisionPolicy:
        """The policy of `config`. `gemm_rows` (layer-name prefix -> rows per pack) and `fp8_speedups` come
        from the model: "auto" needs both to decide a layer (gem_jax/model/gem.py gives them)."""
        overrides = tuple(
            sorted(
                ((prefix, _dtype(name, f"overrides.{prefix}")) for prefix, name in config.overrides.items()),
                key=lambda kv: -len(kv[0]),
            )
        )  # longest prefix wins
        fp8 = (
            FP8Recipe(config.fp8_recipe, config.fp8_amax_history, config.fp8_margin, config.fp8_gemms)
            if config.fp8
            else None
        )
        return cls(
            param_dtype=_dtype(config.param_dtype, "param_dtype"),
            default_compute=_dtype(config.compute_dtype, "compute_dtype"),
            sensitive=_dtype(config.sensitive_dtype, "sensitive_dtype"),
            overrides=overrides,
            fp8=fp8,
            fp8_layers=tuple(config.fp8_layers),
            fp8_auto=config.fp8 == "auto",
            fp8_auto_choice=config.fp8_auto_choice,
            fp8_speedups=fp8_speedups,
            gemm_rows=tuple(sorted((gemm_rows or {}).items(), key=lambda kv: -len(kv[0]))),
            residual=_dtype(config.residual_dtype, "residual_dtype"),
        )

    def compute_dtype(self, layer: str, *, sensitive: bool = False) -> DTypeLike:
        """The compute dtype of `layer`; sensitive layers (heads, norms) default to `sensitive`."""
        for prefix, dtype in self.overrides:
            if layer.startswith(prefix):
                return dtype
        return self.sensitive if sensitive else self.default_compute

    def rows(self, layer: str) -> int | None:
        """The rows per pack of `layer`'s GEMM (its M), as the model said; None where it did not."""
        return next((m for prefix, m in self.gemm_rows if layer.startswith(prefix)), None)

    def fp8_decision(
        self, layer: str, d_in: int, d_out: int, *, sensitive: bool = False
    ) -> FP8Decision | None:
        """Whether Dense layer `layer` (x[M, d_in] @ w[d_in, d_out]) runs its GEMM in FP8, and with which
        recipe; None when FP8 is off or `precision.fp8_layers` does not name the layer (module docstring).

        A sensitive layer (task head, logit layer) named by `precision.fp8_layers` is a config error:
        those stay out of FP8 whatever the prefixes say.
        """
        if self.fp8 is None:
            return None
        prefix = next((p for p in self.fp8_layers if layer.startswith(p)), None)
        if prefix is None:
            return None
        if sensitive:
            raise ConfigError(
                f"`precision.fp8_layers` entry {prefix!r} names the sensitive layer {layer!r}; "
                "task heads and logit layers never run in FP8"
            )
        m = self.rows(layer)
        if not self.fp8_auto:
            return FP8Decision(layer, m, d_in, d_out, self.fp8)
        if self.fp8_auto_choice is not None:
            return FP8Decision(layer, m, d_in, d_out, self.fp8 if layer in self.fp8_auto_choice else None)
        if self.fp8_speedups is None:
            raise ConfigError(
                f'`precision.fp8 = "auto"` cannot decide layer {layer!r}: the model that built it gave no '
                "measured speedups (only the ranking model does)"
            )
        speedup = None if m is None else self.fp8_speedups.at(m, d_in, d_out)
        pays = speedup is not None and speedup >= MIN_SPEEDUP
        return FP8Decision(layer, m, d_in, d_out, self.fp8 if pays else None, speedup)


# The recipe is defined here, a floor below the model, so that the policy can hold one.
RECIPES = ("delayed", "current")


@dataclass(frozen=True)
class FP8Recipe:
    """How an FP8 layer scales its tensors and which of its GEMMs run in FP8 (from `precision.fp8_recipe`,
    `_amax_history`, `_margin`, `_gemms`)."""

    kind: str = "delayed"  # "delayed" | "current"
    amax_history: int = 1024  # steps of amax kept by the delayed recipe (TE's and flax's default)
    margin: int = 0  # binades of headroom below the format's max
    gemms: str = "all"  # "all": Y, dX and dW in FP8; "backward": dX and dW only (precision.fp8_gemms)

    def __post_init__(self):
        if self.kind not in RECIPES:
            raise ValueError(f"FP8 recipe must be one of {RECIPES}, got {self.kind!r}")
        if self.gemms not in ("all", "backward"):
            raise ValueError(f"FP8 gemms must be 'all' or 'backward', got {self.gemms!r}")
        if self.amax_history < 1 or self.margin < 0:
            raise ValueError(f"FP8 amax_history must be >= 1 and margin >= 0, got {self}")
