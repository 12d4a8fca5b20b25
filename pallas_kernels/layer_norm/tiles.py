"""The Hopper (Mosaic GPU) kernels' sizes, apart from the kernels so that choosing a kernel (api.py) does not
import Mosaic GPU on a machine without a GPU."""

from __future__ import annotations

import dataclasses

ROWS_PER_GROUP = 4  # rows a warpgroup normalises at once: one per warp
MAX_WIDTH = 1024  # the backward keeps about eight [4, D] float32 arrays live: D / 32 floats each per thread
STEP_BYTES = 32 * 1024  # shared memory one pipeline step's row blocks aim at (in and out)
MAX_ROWS = 32  # rows per step at most (the step's row groups are unrolled)
SMEM_BYTES = 232448 - 8192  # the H100/H200's 227 KiB per block, less barriers and alignment


def mosaic_applies(width: int) -> bool:
    """Whether the Mosaic GPU kernels take rows of this width: a multiple of 32 (a warp's 32 lanes share a
    row), at most MAX_WIDTH."""
    return width % 32 == 0 and 32 <= width <= MAX_WIDTH


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    rows: int  # per pipeline step, a multiple of ROWS_PER_GROUP
    stages: int  # row blocks in flight per CTA
    ctas_per_sm: int  # 2 where two CTAs' shared memory fits in one SM: twice the warps to hide latency


def mosaic_tiles(row_bytes: int, fixed_bytes: int, rows: int | None = None) -> MosaicTiles | None:
    """The tiles of a kernel whose row blocks take `row_bytes` of shared memory per row (every row array in
    and out) besides `fixed_bytes` (scale, bias, partial sums), as many stages as fit (3 at most; 1: no
    overlap of loads and compute); None where one stage of `rows` rows does not fit. `rows` None: the most
    rows, up to MAX_ROWS, whose step stays within STEP_BYTES (ROWS_PER_GROUP at least)."""
    if rows is None:
        rows = ROWS_PER_GROUP
        while 2 * rows <= MAX_ROWS and 2 * rows * row_bytes <= STEP_BYTES:
            rows *= 2
    if rows % ROWS_PER_GROUP:
        return None
    for stages in (3, 2, 1):
        smem = fixed_bytes + stages * rows * row_bytes
        if smem <= SMEM_BYTES:
            return MosaicTiles(rows, stages, 2 if 2 * smem <= SMEM_BYTES else 1)
    return None
