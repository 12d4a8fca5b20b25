"""SiLU's backward that writes its gradient straight in FP8: the e5m2 gradient, its transpose, its amax and
its column sums in one pass, for the FP8 gradient GEMMs of a Dense + SiLU layer (gem_jax/model/fp8_backward.py)."""

from pallas_kernels.silu_backward_fp8.api import silu_backward_fp8

__all__ = ["silu_backward_fp8"]
