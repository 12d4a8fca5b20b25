"""The norm_gemm kernels' tile sizes, apart from the kernels so that choosing a kernel (api.py) does not
import Mosaic GPU on a machine without a GPU."""

from __future__ import annotations

import dataclasses

COMPUTE_WGS = 2  # consumer warpgroups per CTA, in both kernels
BACKWARD_EPI_N = 32  # the backward's accumulator columns per epilogue store: 128 bytes of float32


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The forward kernel's tile sizes (gpu_sm90.py); `num_ctas`: the persistent grid (one CTA per SM)."""

    block_m: int = 64  # rows per consumer warpgroup (a wgmma's M)
    block_n: int = 128
    block_k: int = 64  # 128 bytes of bf16: the A and W tiles' swizzle
    stages: int = 3  # 4 exceeds the 227 KiB of shared memory with float32 x tiles
    num_ctas: int | None = None  # None: one per SM of the device (mosaic_common.num_sms)

    def applies(self, m: int, k: int, widths: tuple[int, ...]) -> bool:
        """Whether the forward kernel takes these shapes. At least two K steps: jax's warp-specialised pipeline
        (delay_release=1) releases a tile's ring slots only from its second step on, so with one step the
        producer runs into the next tile's loads without waiting for the consumers (the interpreter reports a
        barrier completed twice, and wrong values)."""
        return (
            m % (COMPUTE_WGS * self.block_m) == 0
            and k % self.block_k == 0
            and k >= 2 * self.block_k
            and all(w % self.block_n == 0 for w in widths)
        )


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """The backward kernel's tile sizes (gpu_sm90_backward.py); `num_ctas`: the persistent grid."""

    block_m: int = 64  # rows per consumer warpgroup (a wgmma's M), and per bias partial
    block_n: int = 256  # output (D) columns: 64 x 256 float32 accumulator = 128 registers a thread
    block_k: int = 64  # 128 bytes of bf16: the swizzle of the A and W^T tiles
    stages: int = 3  # 3 x 64 KiB; 4 exceeds the 227 KiB of shared memory
    num_ctas: int | None = None  # None: one per SM of the device (mosaic_common.num_sms)

    def applies(self, m: int, d: int, widths: tuple[int, ...]) -> bool:
        return (
            m % (COMPUTE_WGS * self.block_m) == 0
            and d % self.block_n == 0
            and self.block_n % BACKWARD_EPI_N == 0
            and all(w % self.block_k == 0 for w in widths)
        )
