"""Jagged (variable-length) causal attention for HSTU-style sequence towers, as Pallas kernels."""

from pallas_kernels.jagged_attention.api import default_implementation, jagged_attention

__all__ = ["jagged_attention", "default_implementation"]
