"""What the layer-norm kernels are specialised on: one hashable object, built once per call by api.py."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class NormParams:
    """The static settings of one call (hashable: the custom VJP's nondiff argument): rows per program,
    warps, eps, which inputs exist."""

    rows: int
    eps: float
    has_gate: bool
    has_residual: bool  # backward: add the gradient of the input passed through (api's with_input)
    out_dtype: str  # the output's dtype name (e.g. bf16 from a float32 residual stream, for the next GEMM)
    interpret: bool
    num_warps: int = 4
