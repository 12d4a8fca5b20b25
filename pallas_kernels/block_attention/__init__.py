"""BlockAttention: softmax attention within fixed-size blocks of jagged sequences."""

from pallas_kernels.block_attention.api import block_attention, kernel_for, kernels_in_use

__all__ = ["block_attention", "kernel_for", "kernels_in_use"]
