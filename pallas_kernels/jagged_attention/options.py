"""Kernel variants: switches that keep the semantics but change how a kernel computes (benchmarks A/B them)."""

from __future__ import annotations

import dataclasses

BIAS_PROBES = ("time_bucket", "pos_gather", "pos_grad", "time_grad", "hist_plain")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Static switches of the GPU kernels; the defaults are the shipped kernel. The TPU kernel ignores them.

    silu_bf16x2: the forward computes SiLU in packed bf16 (tanh.approx.bf16x2) for bf16 inputs, since P is
      rounded to bf16 for the P.V matmul anyway: a faster forward for a slightly larger error, inside the bf16
      tolerance (docs/kernels_jagged_attention.md). False: float32 SiLU. The backward is float32 either way.
    pos_expanded: the position bias of a tile is one block load of a per-tile-offset expanded table
      (built by XLA once per call). False: a per-cell gather of the table (a slower forward).
    pos_grad_stores: the dQ kernel hands each not-wholly-clipped tile's dScore (the position-table gradient,
      summed per diagonal in XLA) to XLA with a plain store into the program's own slot of a zeroed buffer
      (float32 [programs, tile offsets, bq, bk], used while it stays under pos_grad_max_bytes); False, or past
      that size: atomic adds into 4 shared slots.
    bias_rows: the relative bias (position + time) of every (row, key column) pair is built by XLA once per
      call into an [H, T, W] array of q's dtype (W: max_seq_len rounded up to the key tiles) that the forward
      and both backward kernels load tile by tile, instead of each recomputing it per head with
      compare-select loops over the tile's buckets. Only the dQ kernel still visits the buckets, for the
      time table's gradient. Used when the array stays under bias_rows_max_bytes and 2**31 elements (the
      kernels index with int32); otherwise the kernels compute the bias. api.py decides it once per call
      (KernelParams.bias_rows).
    hopper_backward_bias: the Mosaic GPU backward also takes calls with a relative bias (computed in its kernels
      from the tables and timestamps, O(T) memory; the table gradients through lane-private shared-memory
      histograms, sm90_dq.hist_add). False: such calls run the Triton backward.
    hopper_backward_d256: the Mosaic GPU backward also takes head dim 256 (Dqk = Dv = 256, no relative bias):
      a dK/dV kernel whose two consumer warpgroups split the work of one 64-key item by role (one computes S^T,
      P^T and dV, the other dP^T, dS^T and dK, the activation's derivative handed over in shared memory) and
      a dQ kernel with 32-key streamed tiles (gpu_sm90_backward.py, "Head dim 256"). True (the default since
      its H200 checks and times, docs/benchmarks.md 2026-12-03: 2.58x the Triton backward at D = 256);
      False: D = 256 runs the Triton backward.
    time_grad_runs: the Mosaic GPU dQ kernel sums the time table's gradient of a mask-free tile of a sequence
      whose timestamps do not decrease, when the tile's cells span at most RUN_THRESHOLDS + 1 buckets, by
      comparing each cell against those buckets' thresholds (sm90_dq.runs_add: a few shared-memory adds a tile);
      other tiles, and every tile of an unsorted sequence, add their runs of one bucket cell by cell
      (sm90_dq.hist_add). False: every tile cell by cell. Off: correct on an H100 but slower there (u1k dQ
      26.0 against 23.0 ms, docs/kernels_jagged_attention.md).
    warpgroup_semantics: the Mosaic GPU kernels (forward, dK/dV, dQ) are lowered with Mosaic GPU's Warpgroup
      semantics (layouts inferred by the compiler), the default of jax 0.11's `plgpu.CompilerParams`. False:
      Lane semantics, set explicitly, the default of jax 0.10 and what the kernels are written for (explicit
      wgmma register layouts, inline Mosaic GPU code for the scatter-adds): without the explicit setting the
      same code lowered differently on the two versions. True is for the A/B.
    bias_probe: benchmark-only, and WRONG results: parts of the relative bias the Mosaic GPU kernels skip, to
      time what each costs (scripts/device/bias_attribution.py). Names from BIAS_PROBES: "time_bucket" (no
      per-cell time bucket: neither the log2 nor the time table's gather; the time bias is bucket 0's scalar
      and the time gradient goes to bucket 0), "pos_gather" (the position bias is bucket 0's scalar; the
      buckets are still computed for the gradient), "pos_grad" and "time_grad" (the dQ kernel skips that
      table's gradient), "hist_plain" (the table gradients' shared-memory adds are plain load-add-stores, not
      atomics: racy). Empty (the default): the shipped kernels.
    split_meet: at head dim 256 the Mosaic GPU dK/dV kernel's two consumers meet once per query tile, so that
      the tensor cores run S^T alone, then dP^T while consumer 0 computes P^T and the dS factor
      (gpu_sm90_backward.py, "Head dim 256"). False: no meeting (both products issued at once), for the A/B.
    """

    silu_bf16x2: bool = True
    pos_expanded: bool = True
    pos_grad_stores: bool = True
    pos_grad_max_bytes: int = 4 << 30
    bias_rows: bool = True
    bias_rows_max_bytes: int = 8 << 30
    hopper_backward_bias: bool = True
    hopper_backward_d256: bool = True
    split_meet: bool = True
    time_grad_runs: bool = False
    warpgroup_semantics: bool = False
    bias_probe: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = sorted(set(self.bias_probe) - set(BIAS_PROBES))
        if unknown:
            raise ValueError(f"KernelOptions.bias_probe: unknown {unknown}, the names are {BIAS_PROBES}")

    def probe(self, part: str) -> bool:
        """Whether a benchmark asked the kernels to skip this part of the relative bias (bias_probe)."""
        return part in self.bias_probe

    def use_pos_grad_stores(self, nbytes: int) -> bool:
        """Whether the position gradient's per-program buffer of `nbytes` bytes is used."""
        return self.pos_grad_stores and nbytes <= self.pos_grad_max_bytes

    def use_bias_rows(self, *, rows: int, heads: int, width: int, itemsize: int) -> bool:
        """Whether a [heads, rows, width] bias_rows array of `itemsize`-byte elements is used."""
        n = heads * rows * width
        return self.bias_rows and n < 2**31 and n * itemsize <= self.bias_rows_max_bytes
