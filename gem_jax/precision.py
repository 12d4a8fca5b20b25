"""Per-layer precision policy: which dtype each named layer stores its parameters and computes in.

Model code asks the policy by layer name (`policy.compute_dtype("hstu/0/uvqk")`); the config's
`precision.overrides` maps name prefixes to dtypes, so a layer's precision changes without touching
model code. FP8 GEMMs (the precision issue) plug in here as a new override value.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax.typing import DTypeLike

from gem_jax.config import ConfigError, PrecisionConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype(name: str, key: str) -> DTypeLike:
    if name not in _DTYPES:
        raise ConfigError(f"`precision.{key}` must be one of {tuple(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: DTypeLike
    default_compute: DTypeLike
    sensitive: DTypeLike
    overrides: tuple[tuple[str, DTypeLike], ...]

    @classmethod
    def from_config(cls, config: PrecisionConfig) -> PrecisionPolicy:
        overrides = tuple(
            sorted(
                ((prefix, _dtype(name, f"overrides.{prefix}")) for prefix, name in config.overrides.items()),
                key=lambda kv: -len(kv[0]),
            )
        )  # longest prefix wins
        return cls(
            param_dtype=_dtype(config.param_dtype, "param_dtype"),
            default_compute=_dtype(config.compute_dtype, "compute_dtype"),
            sensitive=_dtype(config.sensitive_dtype, "sensitive_dtype"),
            overrides=overrides,
        )

    def compute_dtype(self, layer: str, *, sensitive: bool = False) -> DTypeLike:
        """The compute dtype of `layer`; sensitive layers (heads, norms) default to `sensitive`."""
        for prefix, dtype in self.overrides:
            if layer.startswith(prefix):
                return dtype
        return self.sensitive if sensitive else self.default_compute
