"""What the BlockAttention kernels are specialised on: one hashable object, built once per call by api.py."""

from __future__ import annotations

import dataclasses

from pallas_kernels.block_attention.block_sizes import BlockSizes


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """The static arguments of every backend function (hashable: a nondiff argument of the custom VJP)."""

    block_size: int
    causal: bool
    alpha: float
    interpret: bool
    blocks: BlockSizes
