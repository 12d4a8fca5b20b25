"""What every Hopper (Mosaic GPU) jagged attention kernel shares: per-cell gathers from shared-memory bias tables
and the tables' TMA copies, jagged row stores (what every Mosaic GPU kernel shares, the layouts among it, is in
pallas_kernels/mosaic_common.py).

The forward (gpu_sm90.py) and the backward kernels (sm90_dkv.py, sm90_dq.py, driven by gpu_sm90_backward.py)
import these; each helper takes `interpret` and swaps in plain jnp for what the CPU tests' Mosaic GPU interpreter
lacks (layouts, inline Mosaic GPU code).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir  # Mosaic GPU's own API, for the inline code Pallas has no primitive for
from jax._src.lib.mlir.dialects import arith, memref
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv
from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.reference import LOG_TIME_DIVISOR

ZERO_TILES = 8  # a tail item zeroes ZERO_TILES * 2 * BLOCK_Q rows past offsets[B]
LOG2E = 1.4426950408889634
ALIGN = tiling.MOSAIC_ALIGN  # row alignment of a TMA box's start (the module docstring: aligned frames)
LOG2_TO_BUCKET = math.log(2.0) / LOG_TIME_DIVISOR  # log(x) / LOG_TIME_DIVISOR = log2(x) * this
TABLE_ALIGN = 32  # floats: each consumer's copy of a bias table starts 128-byte aligned in shared memory
TMA_BOX = 256  # a TMA copy moves at most this many elements along each dimension: tables go in chunks


def table_width(n: int) -> int:
    """Floats of shared memory a bias table of n buckets takes per consumer (TABLE_ALIGN-aligned)."""
    return cdiv(n, TABLE_ALIGN) * TABLE_ALIGN


def table_chunks(n: int) -> int:
    """TMA copies that bring one head's row of an n-bucket table into shared memory."""
    return cdiv(table_width(n), TMA_BOX)


def time_buckets(gap, num_time: int):
    """int32 log-time buckets of a tile of float32 time gaps: floor(log2(max(gap, 1)) * LOG2_TO_BUCKET), clipped
    to [0, num_time) (the reference's floor(log(gap) / LOG_TIME_DIVISOR) up to float rounding at bucket edges).

    The floor without a float -> int conversion (a quarter-rate instruction with a long latency, on the chain
    every score cell waits on): v + (2**23 - 0.5) rounds to floor(v) + 2**23, an integer float whose bits minus
    those of 2**23 are floor(v) (a tie at an integer v may round one down: a bucket edge, where log2's
    approximation decides anyway). A gap of 1 (v = 0) stays 8388607.5, below 2**23: -1, clipped to 0."""
    v = jnp.log2(jnp.maximum(gap, 1.0)) * LOG2_TO_BUCKET + (2.0**23 - 0.5)
    return jnp.clip(lax.bitcast_convert_type(v, jnp.int32) - 0x4B000000, 0, num_time - 1)


def gather(interpret: bool, table_ref, idx):
    """table_ref[idx] for an int32 [bq, bk] tile in the wgmma layout: one ld.shared per element (Pallas Mosaic
    GPU has no gather, so the loads are written in Mosaic GPU's own API, inline)."""
    if interpret:
        return table_ref[...][idx]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA),
        return_type=plgpu.ShapeDtypeStruct(idx.shape, jnp.float32, plgpu.Layout.WGMMA),
    )
    def gather(ctx, table, cells):
        del ctx
        index = ir.IndexType.get()
        return cells.foreach(lambda v, _: memref.load(table, [arith.index_cast(index, v)]), create_array=True)

    return gather(table_ref, idx)


def copy_table(src, dst, barrier):
    """TMA copies of one head's bias table row into shared memory, TMA_BOX floats at a time (table_chunks of
    them, each arriving once on `barrier`)."""
    width = dst.shape[0]
    for start in range(0, width, TMA_BOX):
        size = min(TMA_BOX, width - start)
        plgpu.copy_gmem_to_smem(src.at[pl.ds(start, size)], dst.at[pl.ds(start, size)], barrier)


def store_rows(src_smem, dst, nrows, max_rows: int, first=0):
    """TMA-stores rows [first, first + nrows) of src_smem to dst(row_offset, size) as power-of-two row boxes."""
    off = 0
    size = max_rows
    while size >= 1:

        @pl.when((nrows & size) != 0)
        def _(off=off, size=size):
            plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(first + off, size)], dst(off, size))

        off = off + (nrows & size)
        size //= 2


def table_rows(table, heads: int, width: int):
    """The first `heads` rows of a float32 bias table, `width` (a multiple of TABLE_ALIGN) wide."""
    table = table[:heads, :width]
    return jnp.pad(table, ((0, 0), (0, width - table.shape[1])))
