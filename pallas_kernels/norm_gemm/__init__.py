"""The HSTU layer's input GEMM with its glue inside: split(SiLU(LayerNorm(x) W + b)) in one Hopper kernel."""

from pallas_kernels.norm_gemm.api import norm_silu_gemm

__all__ = ["norm_silu_gemm"]
