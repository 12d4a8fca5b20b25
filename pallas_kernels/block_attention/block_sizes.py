"""Kernel tile sizes for BlockAttention, derived from block_size.

One kernel program owns one sequence block (see block_table.py), so its query and key
tiles are both the block itself, rounded up to a power of two (Triton's tensors must
have power-of-two sides; Mosaic TPU wants a multiple of 8 sublanes) and at least 16
rows (the smallest bf16 MMA). Rows of the tile past the block's length are masked.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import next_pow2

MIN_TILE = 16
# One program holds the whole block's scores (tile x tile fp32) and, in the backward
# pass, four such tiles; beyond 128 rows that spills registers on a GPU SM.
MAX_TILE = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile rows per program and GPU launch knobs (ignored on TPU)."""

    tile: int
    num_warps: int
    num_stages: int = 1  # no key loop to pipeline: the block is one tile

    @classmethod
    def get_default(cls, platform: str, *, block_size: int) -> BlockSizes:
        """The tiles of one block; ValueError for a block_size the kernels do not support.

        platform: "gpu", "tpu", or "cpu" (a kernel in interpret mode); the tile is the same on each, the
        launch knobs matter on GPU only.
        """
        del platform
        tile = next_pow2(block_size, at_least=MIN_TILE)
        if tile > MAX_TILE:
            raise ValueError(
                f"block_size={block_size} needs a {tile}-row tile; the Pallas kernels "
                f"support block_size <= {MAX_TILE} (use implementation='reference')"
            )
        return cls(tile=tile, num_warps=4 if tile <= 64 else 8)
