"""Named problem sizes shared by the kernel tests and the benchmarks: one definition per shape.

Device shapes are the ones docs/benchmarks.md and docs/design.md report numbers for; small shapes are what
the CPU tests run in Pallas interpret mode (and the benchmarks' smoke modes).
"""

from __future__ import annotations

import dataclasses

import numpy as np

LENGTH_MIXES = ("uniform", "lognormal", "equal")


def sample_lengths(kind: str, batch: int, max_seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """int lengths of `batch` sequences, each <= max_seq_len, drawn from a named mix.

    uniform: in [0.9 N, N) (the peer's benchmark mix); lognormal: heavy tail, median ~ N/16, clipped to
    [1, N]; equal: all N.
    """
    n = max_seq_len
    if kind == "uniform":
        return rng.integers(int(0.9 * n), n, size=batch)
    if kind == "lognormal":
        return np.clip(rng.lognormal(np.log(n / 16), 1.0, size=batch), 1, n).astype(np.int64)
    if kind == "equal":
        return np.full(batch, n)
    raise ValueError(f"length mix must be one of {LENGTH_MIXES}, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class JaggedShape:
    """B sequences of at most N tokens with lengths from a named mix, H heads of D features (Dqk = Dv)."""

    batch: int
    max_seq_len: int
    heads: int
    head_dim: int
    lengths: str = "uniform"

    def sample_lengths(self, rng: np.random.Generator) -> np.ndarray:
        return sample_lengths(self.lengths, self.batch, self.max_seq_len, rng)


@dataclasses.dataclass(frozen=True)
class RelativeBias:
    """Bucket counts of the relative position and log-time bias tables."""

    num_pos: int
    num_time: int


@dataclasses.dataclass(frozen=True)
class AttentionPreset:
    """A row of the preset table (`bench attention --preset NAME`): a shape, its activation, and the targets in
    TFLOP/s, or as the name of an implementation timed in the same call ("cudnn", "tokamax"). A row without a
    backward target times the forward only."""

    shape: JaggedShape
    activation: str
    target_fwd: float | str
    target_bwd: float | str | None = None


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """BlockAttention: ~total_tokens per batch cut into histories of each length, H heads of D features."""

    total_tokens: int
    lengths: tuple[int, ...]
    heads: int
    head_dim: int
    block_size: int


# --- device shapes (bf16) ---------------------------------------------------------------------------------

# generative-recommenders' HSTU benchmark shapes (docs/benchmarks.md): the peer comparison
PEER_N1024 = JaggedShape(batch=512, max_seq_len=1024, heads=4, head_dim=128)
PEER_N4096 = JaggedShape(batch=512, max_seq_len=4096, heads=4, head_dim=128)
HEAVY_TAIL = JaggedShape(batch=2048, max_seq_len=4096, heads=4, head_dim=128, lengths="lognormal")
# NVIDIA's CUTLASS HSTU kernel's published H100 shapes (full-length sequences): D=256 at N=4096, D=64 at N=16384
NVIDIA_D256 = JaggedShape(batch=64, max_seq_len=4096, heads=4, head_dim=256, lengths="equal")
NVIDIA_D64 = JaggedShape(batch=16, max_seq_len=16384, heads=4, head_dim=64, lengths="equal")
# dense causal, equal lengths (B=8 T=4096 H=16): the cuDNN and tokamax comparison, SiLU and softmax
DENSE_H16 = JaggedShape(batch=8, max_seq_len=4096, heads=16, head_dim=128, lengths="equal")
# dense causal softmax at D=256, equal lengths (B=4 T=8192 H=4): where tokamax leads cuDNN
DENSE_D256 = JaggedShape(batch=4, max_seq_len=8192, heads=4, head_dim=256, lengths="equal")
# the relative bias of configs/gem_h200.toml (num_position_buckets, num_time_buckets), and a wide one
GEM_H200_BIAS = RelativeBias(num_pos=128, num_time=64)
WIDE_BIAS = RelativeBias(num_pos=1024, num_time=64)
# the preset table, a row a preset (H200, bf16, causal; docs/benchmarks.md): the peer's shapes, the dense
# rows where cuDNN and tokamax (softmax) are the anchors, and NVIDIA's CUTLASS shapes at full length
ATTENTION_PRESETS = {
    "u1k": AttentionPreset(PEER_N1024, "silu", 330),
    "u4k": AttentionPreset(PEER_N4096, "silu", 480),
    "h4k": AttentionPreset(HEAVY_TAIL, "silu", 375),
    "dense8x4k_h16d128": AttentionPreset(DENSE_H16, "silu", 500),
    "b64n4k_d256": AttentionPreset(NVIDIA_D256, "silu", 580),
    "b16n16k_d64": AttentionPreset(NVIDIA_D64, "silu", 480),
    "softmax8x4k_h16d128": AttentionPreset(DENSE_H16, "softmax", "cudnn", "cudnn"),
    "b4n8k_d256": AttentionPreset(DENSE_D256, "softmax", "tokamax"),
}
# the jagged benchmark's correctness check on fresh inputs (before timing); QUICK: its --quick variant
CHECK = JaggedShape(batch=24, max_seq_len=512, heads=4, head_dim=128)
CHECK_QUICK = JaggedShape(batch=8, max_seq_len=64, heads=4, head_dim=128)
# BlockAttention flatness: time per token for 1k..64k-event histories at a fixed ~4M tokens per batch
BLOCK_FLATNESS = BlockShape(
    total_tokens=4_000_000, lengths=(1024, 4096, 16384, 65536), heads=4, head_dim=128, block_size=64
)

# --- small shapes (CPU tests in interpret mode, benchmark smoke runs) --------------------------------------

# jagged attention kernels: max_seq_len 64 is 4 tiles of 16 rows, so interior (mask-free) tiles are exercised
SMALL = JaggedShape(batch=6, max_seq_len=64, heads=2, head_dim=16)
SMALL_LENGTHS = (0, 1, 17, 64, 33, 2)  # empty, length 1, not multiples of the tile, full
SMALL_CAPACITY = 160  # token capacity, > sum(SMALL_LENGTHS): rows past offsets[B] must come out zero
# the Mosaic GPU forward needs D = 128; sequences of up to two 128-row work items
MOSAIC_SMALL = JaggedShape(batch=6, max_seq_len=256, heads=2, head_dim=128)
BLOCK_SMOKE = BlockShape(total_tokens=2048, lengths=(256, 1024), heads=2, head_dim=32, block_size=64)
