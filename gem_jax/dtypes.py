"""Dtype names: which ones each setting accepts, and the one table from a name to its array dtype.

The config types its dtype settings with the `Literal`s below, so a name is checked when the config is
loaded; the precision policy and the embedding tables turn names into dtypes with `DTYPES`. The values
are numpy dtypes, the objects jax's dtype names stand for (`jnp.dtype("bfloat16")` is
`DTYPES["bfloat16"]`), so the config can use this module without importing jax.
"""

from __future__ import annotations

import typing
from typing import Literal

import ml_dtypes
import numpy as np

# Parameters, compute, sensitive ops (heads, losses, LayerNorm statistics) and per-layer overrides.
FloatDtype = Literal["float32", "bfloat16", "float16"]
# Embedding table storage; the sparse optimizers compute every update in float32.
TableDtype = Literal["float32", "bfloat16"]

FLOAT_DTYPES: tuple[str, ...] = typing.get_args(FloatDtype)
TABLE_DTYPES: tuple[str, ...] = typing.get_args(TableDtype)

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
