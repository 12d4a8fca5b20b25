"""HSTU sequence tower (Zhai et al. 2024) over jagged token arrays.

Per layer: U, V, Q, K = split(SiLU(LN(X) W1)); A = attention(Q, K, V) with a learned relative
position and log-time bias; Y = X + (LN(A) * U) W2.

With `model.frequency_mix` = alpha > 0, a layer also runs BSARec's frequency filter F over LN(X)
(gem_jax/model/frequency_filter.py) and mixes the two residual branches:
Y = X + alpha F(LN(X)) + (1 - alpha) (LN(A) * U) W2, BSARec's alpha * filter + (1 - alpha) * attention
written for a pre-norm residual stream. `model.wavelet_mix` = omega adds the wavelet branch W
(gem_jax/model/wavelet_branch.py) the same way: Y = X + alpha F(LN(X)) + omega W(LN(X)) + (1 - alpha - omega)
(LN(A) * U) W2.

With `model.sequence_mixer = "time_variant"`, A is TV-Rec's time-variant causal convolution of V
(gem_jax/model/time_variant_conv.py) instead of attention: U, V = split(SiLU(LN(X) W1)), no Q, K or
relative bias.

With `model.long_history`, the layers attend with `long_history_attention` (BlockAttention over the
older history, full jagged attention over the recent part) and `model.pyramid` runs deeper layers
on fewer tokens; see gem_jax/model/long_history.py.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import ArrayLike, Float, Int

from gem_jax.config import ModelConfig
from gem_jax.kernels import uvqk_widths
from gem_jax.model.attention import AttentionSpec, attention
from gem_jax.model.frequency_filter import FrequencyBranch
from gem_jax.model.layers import Dense, LayerNorm, dropout
from gem_jax.model.long_history import gather_rows, long_history_attention, pyramid_layout, scatter_rows
from gem_jax.model.sasrec import SASRecLayer
from gem_jax.model.time_variant_conv import TimeVariantConv
from gem_jax.model.wavelet_branch import WaveletBranch
from gem_jax.parallel import param
from gem_jax.precision import PrecisionPolicy
from pallas_kernels.norm_gemm import api as norm_gemm


def uvqk_fusion(c: ModelConfig, rows: int, x_dtype, compute_dtype, *, fp8: bool) -> tuple[str, bool] | None:
    """The (implementation=, interpret=) of pallas_kernels.norm_gemm that runs an HSTU layer's input norm + uvqk
    GEMM + SiLU + split for a pack of `rows` tokens, or None for the unfused path (the norm kernel, XLA's GEMM,
    SiLU). `model.uvqk_implementation` decides: "auto" takes the op's default order (the Mosaic GPU kernel on
    Hopper where it takes the call: tiles that fit, a float32 residual stream, a 16-bit GEMM) and the unfused
    path where that is the reference; a name is that backend. An FP8 uvqk GEMM, the frequency and wavelet
    branches and the time-variant mixer keep the unfused path."""
    if c.uvqk_implementation == "off" or fp8 or not c.uvqk_fusable():
        return None
    implementation, interpret = c.kernel("uvqk")
    if implementation is not None:
        return implementation, interpret
    x = jax.ShapeDtypeStruct((rows, c.model_dim), x_dtype)
    w = jax.ShapeDtypeStruct((c.model_dim, sum(uvqk_widths(c))), compute_dtype)
    forward, _ = norm_gemm.kernels_for(x, w, uvqk_widths(c), None)
    return None if forward == "reference" else (forward, False)


class HSTULayer(nnx.Module):
    def __init__(
        self,
        name: str,
        config: ModelConfig,
        policy: PrecisionPolicy,
        *,
        rngs: nnx.Rngs,
        max_targets: int = 1,
        max_seq_len: int = 0,
    ):
        """`max_seq_len`: the longest sequence, the time-variant mixer's window (next-item: retrieval.max_len)."""
        c = config
        self.config = c
        self.name = name  # also the layer's named scope (profile groups)
        self.max_targets = max_targets  # static bound on candidates per sequence (long-history layouts)
        self.attention_spec = AttentionSpec.from_config(c)
        h, dv = c.num_heads, c.value_dim
        norm, norm_interpret = c.kernel("norm")
        self.silu_kernel = c.kernel(
            "silu_backward_fp8"
        )  # (implementation, interpret) of the FP8 SiLU backward
        self.input_norm = LayerNorm(
            c.model_dim, policy, rngs=rngs, implementation=norm, interpret=norm_interpret
        )
        self.uvqk = Dense(f"{name}/uvqk", c.model_dim, sum(uvqk_widths(c)), policy, rngs=rngs)
        self.attn_norm = LayerNorm(h * dv, policy, rngs=rngs, implementation=norm, interpret=norm_interpret)
        self.out = Dense(f"{name}/out", h * dv, c.model_dim, policy, rngs=rngs, axes=("mlp", "embed"))
        zeros = nnx.initializers.zeros
        attends = c.sequence_mixer == "attention"
        self.pos_bias = (
            param(rngs, zeros, (h, c.num_position_buckets), ("heads", None), jnp.float32)
            if c.num_position_buckets and attends
            else None
        )
        self.time_bias = (
            param(rngs, zeros, (h, c.num_time_buckets), ("heads", None), jnp.float32)
            if c.num_time_buckets and attends
            else None
        )
        self.frequency = (
            FrequencyBranch(c.model_dim, low_bins=c.frequency_bins, rngs=rngs)
            if c.frequency_mix > 0
            else None
        )
        self.wavelet = (
            WaveletBranch(c.model_dim, levels=c.wavelet_levels, rngs=rngs) if c.wavelet_mix > 0 else None
        )
        if not attends and max_seq_len < 1:
            raise ValueError('model.sequence_mixer = "time_variant" needs the window (max_seq_len)')
        self.time_variant = (
            None
            if attends
            else TimeVariantConv(
                h,
                length=max_seq_len,
                taps=c.time_variant_taps or max_seq_len,
                basis=c.time_variant_basis,
                rngs=rngs,
            )
        )

    def __call__(
        self,
        x: Float[ArrayLike, "T D"],
        offsets: Int[ArrayLike, " B1"],
        num_targets: Int[ArrayLike, " B"],
        timestamps: Int[ArrayLike, " T"],
        *,
        max_seq_len: int,
        rng: jax.Array | None,
    ):
        c = self.config
        t = x.shape[0]
        h, dqk, dv = c.num_heads, c.attention_dim, c.value_dim
        with jax.named_scope(f"{self.name}/uvqk"):
            fused = uvqk_fusion(c, t, x.dtype, self.uvqk.compute_dtype, fp8=self.uvqk.fp8 is not None)
            if fused is not None:  # the norm on the GEMM's A tile, SiLU and the split in its epilogue
                u, v, q, k = self.fused_uvqk(x, *fused)
            else:
                # x: the residual stream (its gradient joins the norm's backward); xn straight in the GEMM's
                # dtype (bf16 from a float32 stream), unless a frequency or wavelet branch reads it too.
                out_dtype = self.uvqk.compute_dtype if not self.branches() else None
                x, xn = self.input_norm(x, with_input=True, out_dtype=out_dtype)
                # With precision.fp8_gemms = "backward", SiLU's backward quantises in its own kernel.
                implementation, interpret = self.silu_kernel
                u, v, q, k = self.uvqk.silu_split(
                    xn, uvqk_widths(c), implementation=implementation, interpret=interpret
                )
        attention_rng = None if rng is None else jax.random.fold_in(rng, 1)
        if self.time_variant is not None:
            with jax.named_scope(f"{self.name}/time_variant"):
                a = self.time_variant(v.reshape(t, h, dv), offsets)
        else:
            with jax.named_scope(f"{self.name}/attention"):
                a = self.attend(
                    q.reshape(t, h, dqk),
                    k.reshape(t, h, dqk),
                    v.reshape(t, h, dv),
                    offsets,
                    num_targets,
                    timestamps,
                    max_seq_len=max_seq_len,
                    rng=attention_rng,
                )
        with jax.named_scope(f"{self.name}/output"):
            y = self.attn_norm(a.reshape(t, h * dv), gate=u)
            attended = dropout(self.out(y), c.dropout, rng)
        branches = self.branches()
        if not branches:
            return (x + attended).astype(x.dtype)  # the residual stream keeps its dtype
        y, rest = x, 1.0
        for name, mix, branch, stream in branches:
            with jax.named_scope(f"{self.name}/{name}"):
                filtered = branch(xn, offsets, max_len=max_seq_len).astype(attended.dtype)
                filtered = dropout(
                    filtered, c.dropout, None if rng is None else jax.random.fold_in(rng, stream)
                )
                y, rest = y + mix * filtered, rest - mix
        return (y + rest * attended).astype(x.dtype)

    def branches(self) -> list[tuple[str, float, nnx.Module, int]]:
        """The filter branches beside attention that are on: (name, mix, module, dropout stream)."""
        c = self.config
        named = (
            ("frequency", c.frequency_mix, self.frequency, 2),
            ("wavelet", c.wavelet_mix, self.wavelet, 3),
        )
        return [b for b in named if b[2] is not None]

    def fused_uvqk(
        self, x: Float[ArrayLike, "T D"], implementation: str, interpret: bool
    ) -> tuple[Float[ArrayLike, "T _"], ...]:
        """U, V, Q, K = split(SiLU(LN(x) W + b)) through pallas_kernels.norm_gemm (this layer's parameters)."""
        norm, dense = self.input_norm, self.uvqk
        dtype = dense.compute_dtype
        return norm_gemm.norm_silu_gemm(
            x,
            norm.scale[...] if norm.scale is not None else jnp.ones(x.shape[-1], jnp.float32),
            norm.bias[...],
            dense.kernel[...].astype(dtype),
            dense.bias[...] if dense.bias is not None else jnp.zeros(dense.kernel.shape[1], jnp.float32),
            uvqk_widths(self.config),
            implementation=implementation,
            interpret=interpret,
        )

    def attend(self, q, k, v, offsets, num_targets, timestamps, *, max_seq_len: int, rng: jax.Array | None):
        """Full jagged attention over every sequence (weight dropout with `rng`, if configured)."""
        return attention(
            q,
            k,
            v,
            offsets,
            spec=self.attention_spec,
            max_seq_len=max_seq_len,
            num_targets=num_targets,
            timestamps=timestamps if self.time_bias is not None else None,
            pos_bias=self.pos_bias[...] if self.pos_bias is not None else None,
            time_bias=self.time_bias[...] if self.time_bias is not None else None,
            rng=rng,
        )


class LongHistoryLayer(HSTULayer):
    """The HSTU layer (same parameters and precision) with long-history attention."""

    def attend(self, q, k, v, offsets, num_targets, timestamps, *, max_seq_len: int, rng: jax.Array | None):
        """BlockAttention over the older history, full jagged attention over the recent part (no weight
        dropout: the config refuses `model.attention_dropout` with `model.long_history`)."""
        c = self.config
        return long_history_attention(
            q,
            k,
            v,
            offsets,
            num_targets,
            timestamps,
            num_context=c.num_context_tokens,
            recent_len=c.recent_len,
            max_targets=self.max_targets,
            block_size=c.block_size,
            max_seq_len=max_seq_len,
            spec=self.attention_spec,
            pos_bias=self.pos_bias[...] if self.pos_bias is not None else None,
            time_bias=self.time_bias[...] if self.time_bias is not None else None,
        )


class HSTUTower(nnx.Module):
    """HSTU layers over the jagged pack; with `long_history`, long-history layers and the pyramid;
    with `layer = "sasrec"`, SASRec's blocks (gem_jax/model/sasrec.py) instead."""

    def __init__(
        self,
        config: ModelConfig,
        policy: PrecisionPolicy,
        *,
        rngs: nnx.Rngs,
        max_targets: int = 1,
        max_seq_len: int = 0,
    ):
        """`max_seq_len`: the longest sequence, where a layer's parameters depend on it (the time-variant
        mixer's window)."""
        layer = LongHistoryLayer if config.long_history else HSTULayer
        if config.layer == "sasrec":
            if config.long_history:
                raise ValueError('model.layer = "sasrec" does not support model.long_history')
            layer = SASRecLayer
        self.max_targets = max_targets
        self.layers = nnx.List(
            [
                layer(
                    f"hstu/{i}", config, policy, rngs=rngs, max_targets=max_targets, max_seq_len=max_seq_len
                )
                for i in range(config.num_layers)
            ]
        )
        norm, norm_interpret = config.kernel("norm")
        self.final_norm = LayerNorm(
            config.model_dim, policy, rngs=rngs, implementation=norm, interpret=norm_interpret
        )
        self.residual_dtype = policy.residual  # the stream between layers (precision.residual_dtype)
        # Consecutive layers sharing a pyramid fraction run on one compacted layout: (start, stop, fraction).
        self.stages = tuple(_runs(config.pyramid or (1.0,) * config.num_layers))
        self.config = config

    def __call__(
        self,
        x: Float[ArrayLike, "T D"],
        offsets: Int[ArrayLike, " B1"],
        num_targets: Int[ArrayLike, " B"],
        timestamps: Int[ArrayLike, " T"],
        *,
        max_seq_len: int,
        rng: jax.Array | None = None,
    ):
        c = self.config
        x = x.astype(self.residual_dtype)
        for start, stop, fraction in self.stages:
            if fraction < 1.0:  # pyramid: run on the kept suffix, scatter back (dropped rows freeze)
                with jax.named_scope("hstu/pyramid"):
                    layout_offsets, rows = pyramid_layout(
                        offsets,
                        num_targets,
                        fraction,
                        num_context=c.num_context_tokens,
                        max_targets=self.max_targets,
                        num_tokens=x.shape[0],
                    )
                    xs, ts = gather_rows(x, rows), gather_rows(timestamps, rows)
            else:
                layout_offsets, xs, ts = offsets, x, timestamps
            for i in range(start, stop):
                layer_rng = None if rng is None else jax.random.fold_in(rng, i)
                xs = self.layers[i](
                    xs, layout_offsets, num_targets, ts, max_seq_len=max_seq_len, rng=layer_rng
                )
            if fraction < 1.0:
                with jax.named_scope("hstu/pyramid"):
                    x = scatter_rows(x, rows, xs)
            else:
                x = xs
        with jax.named_scope("hstu/final_norm"):
            return self.final_norm(x, out_dtype=jnp.float32)


def _runs(values):
    """(start, stop, value) for each run of equal consecutive values."""
    start = 0
    for value, group in itertools.groupby(values):
        stop = start + len(list(group))
        yield start, stop, value
        start = stop
