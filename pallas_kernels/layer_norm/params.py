"""What the layer-norm kernels are specialised on: one hashable object, built once per call by api.py."""

from __future__ import annotations

import dataclasses

FAMILIES = ("mosaic", "triton")  # the GPU kernels: gpu_sm90.py (Mosaic GPU, Hopper), gpu.py (Triton)


@dataclasses.dataclass(frozen=True)
class NormParams:
    """The static settings of one call (hashable: the custom VJP's nondiff argument).

    rows: rows per Triton program, or per Mosaic GPU pipeline step (a multiple of 4: a warpgroup's four warps
    take one row each). num_warps: Triton's. stages, num_ctas: the Mosaic GPU kernels' ring of row blocks in
    flight per CTA and their persistent grid.
    """

    rows: int
    eps: float
    has_gate: bool
    has_residual: bool  # backward: add the gradient of the input passed through (api's with_input)
    out_dtype: str  # the output's dtype name (e.g. bf16 from a float32 residual stream, for the next GEMM)
    interpret: bool
    family: str = "triton"  # one of FAMILIES
    num_warps: int = 4
    stages: int = 2
    num_ctas: int | None = None  # None: one per SM of the device (mosaic_common.num_sms)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"NormParams.family must be one of {FAMILIES}, got {self.family!r}")
