"""Kernels not (yet) behind a public entry point: kept, tested and benchmarked, but no package calls them.

mosaic_gpu_jagged_attention: a Mosaic GPU (Hopper) forward for jagged attention; it joins
pallas_kernels.jagged_attention behind a supports() check once it is measured faster than the Triton
forward there (docs/kernels_jagged_attention.md).
"""
