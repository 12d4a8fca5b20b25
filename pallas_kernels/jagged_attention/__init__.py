"""Jagged (variable-length) causal attention for HSTU-style sequence towers, as Pallas kernels."""

from pallas_kernels.jagged_attention.api import jagged_attention, kernels_for, kernels_in_use

__all__ = ["jagged_attention", "kernels_for", "kernels_in_use"]
