"""BlockAttention: softmax attention within fixed-size blocks of jagged sequences."""

from pallas_kernels.block_attention.api import block_attention

__all__ = ["block_attention"]
