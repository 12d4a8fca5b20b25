"""Row-wise layer norm (optionally times a gate, optionally passing its input through for a residual) as one
Pallas pass forward and one backward: the HSTU layer's glue around its GEMMs (docs/design.md, Kernels)."""

from pallas_kernels.layer_norm.api import layer_norm

__all__ = ["layer_norm"]
