"""Analytic FLOP count of one train step, for TFLOP/s and MFU.

Counted (a multiply-add = 2 FLOPs; backward = 2 x forward for every GEMM, so a trained GEMM costs
3 x its forward):
- per real token: the token projection (2 E D) and, per HSTU layer, the fused UVQK projection
  (2 D H (2 Dv + 2 Dqk)) and the output projection (2 H Dv D);
- attention, per HSTU layer and per sequence of length L, as the kernel peers count it
  (docs/design.md): forward 2 H (Dqk + Dv) L^2 / 2, backward 2.5 x forward (so 3.5 x forward in all).
  With `model.long_history`, a layer does full attention over the R = context + min(recent_len,
  history) + candidates recent rows (R^2 / 2 in place of L^2 / 2) plus causal BlockAttention over
  all L rows (about L * block_size / 2); a pyramid layer with fraction f counts ceil(f * history)
  history events, for the attention and for the per-token GEMMs;
- per real example: the context projection; per (example, candidate): the summary projection, the
  Wukong layers (FM compression, FM MLP, linear compression, residual mix) and the task heads.
Embedding lookups, norms, activations and the optimizer are memory-bound and not counted.
"""

from __future__ import annotations

import numpy as np

from gem_jax.config import Config

# Dense bf16 peak per device (vendor datasheets), for MFU. Unknown devices (CPU) report no MFU.
PEAK_BF16_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


def device_peak_flops(device_kind: str) -> float | None:
    return PEAK_BF16_FLOPS.get(device_kind)


# The parts of `train_step_flops`, named like the profile's kernel groups (experiments/profile.py):
# GEMMs by layer kind (forward + backward, 3 x forward) and attention forward / backward.
FLOP_GROUPS = (
    "attention fwd",
    "attention bwd",
    "gemm input",
    "gemm hstu",
    "gemm cross",
    "gemm wukong",
    "gemm heads",
)


def train_step_flops(config: Config, offsets: np.ndarray, num_targets: np.ndarray) -> float:
    """FLOPs of one train step over packs with these offsets [..., B+1] and num_targets [..., B]."""
    return sum(train_step_flops_by_group(config, offsets, num_targets).values())


def train_step_flops_by_group(
    config: Config, offsets: np.ndarray, num_targets: np.ndarray
) -> dict[str, float]:
    """`train_step_flops` split into FLOP_GROUPS (the profile divides each by its kernels' time):

    - "gemm input": the token projection, the context projection and the dense-feature projection;
    - "gemm hstu": the HSTU layers' UVQK and output projections;
    - "gemm cross": the summary projection (sequence summaries -> interaction tokens);
    - "gemm wukong": the Wukong layers; "gemm heads": the task heads;
    - "attention fwd" / "attention bwd": 1 x and 2.5 x the attention forward count.
    """
    m, e, d = config.model, config.embeddings, config.data
    lengths = np.diff(np.asarray(offsets, np.int64), axis=-1).astype(np.float64)
    targets = np.asarray(num_targets, np.float64)
    tokens = float(lengths.sum())
    examples = float((targets > 0).sum())
    pairs = examples * d.num_candidates
    h, dqk, dv, dm = m.num_heads, m.attention_dim, m.value_dim, m.model_dim
    layer_gemm = 2 * dm * h * (2 * dv + 2 * dqk) + 2 * h * dv * dm
    per_token_attention = 2 * h * (dqk + dv)
    context = np.minimum(np.maximum(lengths - targets, 0), m.num_context_tokens)
    history = np.maximum(lengths - targets - context, 0)
    layer_tokens = 0.0
    attention_fwd = 0.0
    for layer in range(m.num_layers):
        fraction = m.pyramid[layer] if m.pyramid else 1.0
        kept = np.ceil(fraction * history)
        rows = context + kept + targets
        layer_tokens += float(rows.sum())
        if m.long_history:
            recent = context + np.minimum(kept, m.recent_len) + targets
            pair_count = (recent**2).sum() / 2 + (rows * m.block_size).sum() / 2
        else:
            pair_count = (rows**2).sum() / 2
        attention_fwd += per_token_attention * float(pair_count)
    n_features = d.num_sparse_features + 1
    per_example = 2 * n_features * e.dim * m.num_context_tokens * dm + 2 * d.num_dense_features * e.dim
    n = n_features + m.num_summary_tokens + 1
    cross = 2 * 2 * dm * m.num_summary_tokens * e.dim
    wukong = 0.0
    for _ in range(m.wukong_layers):
        n_fm = m.wukong_tokens // 2
        n_lc = m.wukong_tokens - n_fm
        wukong += 2 * 2 * n * m.wukong_fm_rank * e.dim  # Z = Y^T X, then X Z^T
        wukong += 2 * n * m.wukong_fm_rank * n_fm * e.dim  # FM MLP
        wukong += 2 * n * n_lc * e.dim + (2 * n * m.wukong_tokens * e.dim if n != m.wukong_tokens else 0)
        n = m.wukong_tokens
    heads = len(m.tasks) * (2 * n * e.dim * m.head_hidden + 2 * m.head_hidden)
    return {
        "attention fwd": attention_fwd,
        "attention bwd": 2.5 * attention_fwd,
        "gemm input": 3.0 * (tokens * 2 * e.dim * dm + examples * per_example),
        "gemm hstu": 3.0 * layer_tokens * layer_gemm,
        "gemm cross": 3.0 * pairs * cross,
        "gemm wukong": 3.0 * pairs * wukong,
        "gemm heads": 3.0 * pairs * heads,
    }


def nvidia_hstu_flops(config: Config, offsets: np.ndarray, num_targets: np.ndarray) -> float | None:
    """FLOPs of one train step as NVIDIA recsys-examples count them for their HSTU MFU
    (examples/commons/utils/perf.py, `cal_hstu_flops_single_rank`; their E2E_BENCHMARK.md and
    PERF_ANALYSIS.md quote it), so `mfu_nvidia` compares with their published 31.4%.

    They count the HSTU layers only, on each sequence's own length T (no padding), with C context tokens,
    K candidates and H = T - C - K history tokens, N heads of width D, model width W:
    - attention per layer: 4 N T (C + H) D - 2 N H^2 D + 4 N K D (every row against the context and
      history, less the upper triangle of history x history, plus each candidate on itself), x 3.5 with
      the backward;
    - GEMMs per layer: 2 T (4 N D) W (UVQK) + 2 T (N D) W (output), x 3 with the backward;
    - elementwise per layer: 2 T N D (the U product, forward and backward) + T N W (the residual).
    Their D is both the Q/K and the V width; with `attention_dim != value_dim` the QK^T half uses
    attention_dim and the PV half value_dim (4 N D -> 2 N (Dqk + Dv)), as do U, V, Q, K in UVQK. Not
    counted: embeddings, our token/context projections, the Wukong stack and the heads (their prediction
    head is not counted either). It knows only the plain HSTU layer, so with `model.long_history` (block
    attention over most of the history, and a pyramid) it does not apply: None, and no `mfu_nvidia`.
    """
    m = config.model
    if m.long_history:
        return None
    lengths = np.diff(np.asarray(offsets, np.int64), axis=-1).astype(np.float64)
    candidates = np.asarray(num_targets, np.float64)
    context = np.minimum(np.maximum(lengths - candidates, 0), m.num_context_tokens)
    history = np.maximum(lengths - candidates - context, 0)
    n, dqk, dv, w = m.num_heads, m.attention_dim, m.value_dim, m.model_dim
    pair = 2 * n * (dqk + dv)  # QK^T and PV of one (row, column) pair: their 4 N D
    attention = pair * lengths * (context + history) - pair / 2 * history**2 + pair * candidates
    gemms = 2 * lengths * n * (2 * dqk + 2 * dv) * w + 2 * lengths * n * dv * w
    elementwise = 2 * lengths * n * dv + lengths * n * w
    per_layer = 3.5 * attention + 3.0 * gemms + elementwise
    return float(per_layer.sum()) * m.num_layers
