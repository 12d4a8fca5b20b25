"""Tile sizes of the jagged attention kernels: every tile default of every backend, in one place."""

from __future__ import annotations

import dataclasses

# One tail program of a GPU kernel zeroes ZERO_TILES tiles of the rows past offsets[B].
ZERO_TILES = 8


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query/key tile rows of the forward and the two backward kernels, plus Triton launch knobs.

    block_q/block_k tile the forward and the dQ kernel; block_q_dkv/block_k_dkv tile the dK/dV kernel.
    All must be powers of two >= 16 on GPU (Triton dot tiles) and multiples of 8 on TPU (which uses
    block_q only: one tile size for the tile-major layout).
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 128
    block_k_dkv: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2

    @classmethod
    def get_default(
        cls,
        platform: str,
        *,
        head_dim: int,
        max_seq_len: int,
        has_bias: bool = False,
        bias_rows: bool = False,
        itemsize: int = 2,
    ) -> BlockSizes:
        """Defaults tuned on the H200 for Dqk=Dv=128 (GPU); small tiles for short sequences and CPU tests.

        platform: "gpu", "tpu", or "cpu" (a kernel in interpret mode). head_dim: max(Dqk, Dv). bias_rows: the
        GPU kernels load the bias from the bias_rows array (KernelOptions) rather than computing it. itemsize: bytes
        per q/k/v element (float32 tiles take twice the shared memory). No default key tile exceeds 128, the
        bias_rows array's column step.
        """
        if platform == "tpu":
            return cls(block_q=128, block_k=128, block_q_dkv=128, block_k_dkv=128)
        if max_seq_len <= 64 or platform == "cpu":
            sizes = cls(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, num_warps=4, num_warps_bwd=4)
        elif head_dim > 128:
            sizes = cls(block_q=64, block_k=32, block_q_dkv=32, block_k_dkv=64)
        else:
            sizes = cls()
        if platform == "gpu" and has_bias and not bias_rows:
            # With both tables computed in the kernels, the bias tiles overflow the no-bias defaults' shared
            # memory: 64x128 dK/dV tiles and 2 forward stages are faster there (docs/benchmarks.md). Loading the
            # bias from bias_rows, the no-bias defaults stay the fastest.
            sizes = dataclasses.replace(sizes, block_q_dkv=64, block_k_dkv=128, num_stages=2)
        if platform == "gpu" and itemsize >= 4 and head_dim >= 128 and max_seq_len > 64:
            # float32 (the exactness path, not a fast one): the bf16 tiles ask for more shared memory than the
            # H200's 227 KiB (the fuzz: 288 KiB for the forward at D=128 with bias_rows); half-size tiles fit.
            sizes = dataclasses.replace(
                sizes, block_q=64, block_k=32, block_q_dkv=64, block_k_dkv=32, num_stages=2, num_stages_bwd=2
            )
        return sizes
