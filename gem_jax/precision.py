"""Per-layer precision policy: which dtype each named layer stores its parameters and computes in.

Model code asks the policy by layer name (`policy.compute_dtype("hstu/0/uvqk")`); the config's
`precision.overrides` maps name prefixes to dtypes, so a layer's precision changes without touching
model code. With `precision.fp8`, the Dense layers named by `precision.fp8_layers` run their GEMMs in
FP8 with the `FP8Recipe` that `policy.fp8_recipe(name)` returns (gem_jax/model/fp8.py applies it);
their output keeps the layer's compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.typing import DTypeLike

from gem_jax.config import ConfigError, PrecisionConfig
from gem_jax.dtypes import DTYPES, FLOAT_DTYPES


def _dtype(name: str, key: str) -> DTypeLike:
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"`precision.{key}` must be one of {FLOAT_DTYPES}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: DTypeLike
    default_compute: DTypeLike
    sensitive: DTypeLike
    overrides: tuple[tuple[str, DTypeLike], ...]
    fp8: FP8Recipe | None = None  # None: no FP8 layers
    fp8_layers: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: PrecisionConfig) -> PrecisionPolicy:
        overrides = tuple(
            sorted(
                ((prefix, _dtype(name, f"overrides.{prefix}")) for prefix, name in config.overrides.items()),
                key=lambda kv: -len(kv[0]),
            )
        )  # longest prefix wins
        if config.fp8 == "auto":  # a model built straight from a config: no GPU table was asked
            raise ConfigError(
                '`precision.fp8 = "auto"` must be resolved to the measured layers before the model is built '
                "(gem_jax.model.fp8_auto.resolve; make_task does it)"
            )
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
        )

    def compute_dtype(self, layer: str, *, sensitive: bool = False) -> DTypeLike:
        """The compute dtype of `layer`; sensitive layers (heads, norms) default to `sensitive`."""
        for prefix, dtype in self.overrides:
            if layer.startswith(prefix):
                return dtype
        return self.sensitive if sensitive else self.default_compute

    def fp8_recipe(self, layer: str, *, sensitive: bool = False) -> FP8Recipe | None:
        """The FP8 recipe of Dense layer `layer`, or None when its GEMM runs in its compute dtype.

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
        return self.fp8


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
