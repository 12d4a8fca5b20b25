"""Which kernel runs each op of the model, from its config: one line per op (`kernel_lines`, which train, bench
and profile print) and the check, when a config loads, that every op's setting can run the model's calls
(`check_kernels`, which gem_jax/config.py calls).

Each answer is the op's own decision (its package's kernels_in_use, the same function its calls make), asked
with the shapes of one pack of `data.tokens_per_shard` tokens in the compute dtype. The ops and their keys
(`model.<op>_implementation`, gem_jax/config.py): attention, block_attention, norm, silu_backward_fp8, uvqk.
This module sits below the config (which calls it), so it reads a `Config` and its sections without
importing their types.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import implementations
from pallas_kernels.block_attention import api as block_attention
from pallas_kernels.jagged_attention import api as jagged_attention
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.layer_norm import api as layer_norm
from pallas_kernels.norm_gemm import api as norm_gemm
from pallas_kernels.silu_backward_fp8 import api as silu_backward_fp8

OPS = ("attention", "block_attention", "norm", "silu_backward_fp8", "uvqk")
LABELS = {
    "attention": "attention",
    "block_attention": "block attention",
    "norm": "layer norm",
    "silu_backward_fp8": "silu backward fp8",
    "uvqk": "uvqk norm+gemm",
}
UNFUSED = "the norm kernel, XLA's GEMM, then SiLU"


Config = Any  # gem_jax.config.Config (the module docstring says why it is not imported)
ModelConfig = Any  # gem_jax.config.ModelConfig


def uvqk_widths(m: ModelConfig) -> tuple[int, int, int, int]:
    """The widths of U, V, Q and K in an HSTU layer's uvqk projection (no Q or K for the time-variant mixer)."""
    h = m.num_heads
    qk = 0 if m.sequence_mixer == "time_variant" else h * m.attention_dim
    return (h * m.value_dim, h * m.value_dim, qk, qk)


def attention_options(m: ModelConfig) -> KernelOptions:
    """The jagged attention kernels' variants of `m`: the bias_rows array's cap from
    `model.attention_bias_rows_gib` (0: the kernels compute the bias)."""
    gib = m.attention_bias_rows_gib
    return KernelOptions(bias_rows=gib > 0, bias_rows_max_bytes=int(gib * 2**30))


def unused(config: Config, op: str) -> str | None:
    """None if the model calls `op`, else why not (the settings that would)."""
    m, p = config.model, config.precision
    if op == "block_attention" and not m.long_history:
        return "model.long_history = false"
    if op == "silu_backward_fp8" and (
        m.layer != "hstu" or p.fp8 is False or p.fp8_gemms != "backward" or p.fp8_recipe != "delayed"
    ):
        return 'only with HSTU layers, precision.fp8, fp8_gemms = "backward" and fp8_recipe = "delayed"'
    if op == "uvqk" and m.uvqk_implementation == "off":
        return f"model.uvqk_implementation = 'off': {UNFUSED}"
    if op == "uvqk" and not m.uvqk_fusable():
        return f"only HSTU attention layers without model.frequency_mix or wavelet_mix fuse it: {UNFUSED}"
    if op == "attention" and m.sequence_mixer != "attention":
        return f"model.sequence_mixer = {m.sequence_mixer!r}"
    return None


def in_use(config: Config, op: str, platform: str | None = None) -> str:
    """What runs `op` for one pack (its package's kernels_in_use): a ValueError where the op's setting cannot
    run it. platform: one of implementations.PLATFORMS (None: this process's)."""
    m, d, p = config.model, config.data, config.precision
    implementation, interpret = m.kernel(op)
    ask = dict(interpret=interpret, platform=platform)
    rows, dtype = d.tokens_per_shard, jnp.dtype(p.compute_dtype)
    if op == "attention":
        shape = lambda dim: jax.ShapeDtypeStruct((rows, m.num_heads, dim), dtype)
        forward, backward = jagged_attention.kernels_in_use(
            shape(m.attention_dim),
            shape(m.value_dim),
            max_seq_len=d.max_history_len + d.num_candidates + m.num_context_tokens,
            activation="softmax" if m.layer == "sasrec" else m.activation,  # SASRec's blocks: softmax
            has_targets=True,
            max_attn_len=m.max_attn_len,
            num_pos=m.num_position_buckets or None,
            num_time=m.num_time_buckets or None,
            implementation=implementation,
            options=attention_options(m),
            **ask,
        )
        # (Pallas's Mosaic GPU tiles a TMA's whole array in 8-row groups: any other T is copied into one)
        pad = "mosaic" in (forward, backward) and rows % 8
        note = f"; {rows} tokens a pack, not a multiple of 8: every call copies q, k and v" if pad else ""
        return f"forward {forward}, backward {backward}{note}"
    if op == "block_attention":
        return block_attention.kernels_in_use(m.block_size, implementation, **ask)
    if op == "norm":
        widths = sorted({m.model_dim, m.num_heads * m.value_dim} if m.layer == "hstu" else {m.model_dim})
        names = {w: layer_norm.kernels_in_use(w, implementation, **ask) for w in widths}
        if len(set(names.values())) == 1:
            return names[widths[0]]
        return ", ".join(f"{name} (width {w})" for w, name in names.items())
    widths = uvqk_widths(m)
    if op == "silu_backward_fp8":
        return silu_backward_fp8.kernels_in_use(rows, widths, implementation, **ask)
    x = jax.ShapeDtypeStruct((rows, m.model_dim), jnp.dtype(p.residual_dtype))
    w = jax.ShapeDtypeStruct((m.model_dim, sum(widths)), dtype)
    forward, backward = norm_gemm.kernels_in_use(x, w, widths, implementation, **ask)
    if implementation is None and forward == "reference":  # "auto": the kernel where it runs, else unfused
        return f"unfused: {UNFUSED}"
    fp8_named = p.fp8 is not False and any("hstu/0/uvqk".startswith(prefix) for prefix in p.fp8_layers)
    note = "; unfused where its GEMM runs FP8" if fp8_named else ""
    return f"norm_gemm forward {forward}, backward {backward}{note}"


def check_kernels(config: Config) -> None:
    """A ValueError naming the key where an op's setting cannot run the model's calls: a named backend that
    does not take them, or "auto" where some platform's default order has none that does."""
    for op in OPS:
        if unused(config, op):
            continue
        name = getattr(config.model, f"{op}_implementation")
        for platform in implementations.PLATFORMS if name == "auto" else (None,):
            try:
                in_use(config, op, platform)
            except ValueError as e:
                where = f" on {platform}" if platform else ""
                raise ValueError(f"`model.{op}_implementation = {name!r}`{where}: {e}") from None


def kernel_lines(config: Config) -> list[str]:
    """One line per op naming the backend that runs it in this process, with the key that decides."""
    lines = [f"kernels (jax {jax.__version__}, {implementations.this_platform()}):"]
    for op in OPS:
        why = unused(config, op)
        name = getattr(config.model, f"{op}_implementation")
        what = f"unused ({why})" if why else f"{in_use(config, op)} (model.{op}_implementation = {name!r})"
        lines.append(f"  {LABELS[op]}: {what}")
    return lines
