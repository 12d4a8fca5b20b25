"""HSTU sequence tower (Zhai et al. 2024) over jagged token arrays.

Per layer: U, V, Q, K = split(SiLU(LN(X) W1)); A = attention(Q, K, V) with a learned relative
position and log-time bias; Y = X + (LN(A) * U) W2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from gem_jax.config import ModelConfig
from gem_jax.model.attention import attention
from gem_jax.model.layers import Dense, LayerNorm, dropout, param
from gem_jax.precision import PrecisionPolicy


class HSTULayer(nnx.Module):
    def __init__(self, name: str, config: ModelConfig, policy: PrecisionPolicy, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        h, dqk, dv = c.num_heads, c.attention_dim, c.value_dim
        self.input_norm = LayerNorm(c.model_dim, policy, rngs=rngs)
        self.uvqk = Dense(f"{name}/uvqk", c.model_dim, h * (2 * dv + 2 * dqk), policy, rngs=rngs)
        self.attn_norm = LayerNorm(h * dv, policy, rngs=rngs)
        self.out = Dense(f"{name}/out", h * dv, c.model_dim, policy, rngs=rngs, axes=("mlp", "embed"))
        zeros = nnx.initializers.zeros
        self.pos_bias = (param(rngs, zeros, (h, c.num_position_buckets), ("heads", None), jnp.float32)
                         if c.num_position_buckets else None)
        self.time_bias = (param(rngs, zeros, (h, c.num_time_buckets), ("heads", None), jnp.float32)
                          if c.num_time_buckets else None)

    def __call__(self, x: Float[Array, "T D"], offsets: Int[Array, "B1"], num_targets: Int[Array, "B"],
                 timestamps: Int[Array, "T"], *, max_seq_len: int, rng: jax.Array | None):
        c = self.config
        t = x.shape[0]
        h, dqk, dv = c.num_heads, c.attention_dim, c.value_dim
        uvqk = jax.nn.silu(self.uvqk(self.input_norm(x)))
        u, v, q, k = jnp.split(uvqk, [h * dv, 2 * h * dv, 2 * h * dv + h * dqk], axis=-1)
        a = attention(
            q.reshape(t, h, dqk), k.reshape(t, h, dqk), v.reshape(t, h, dv), offsets,
            max_seq_len=max_seq_len, activation=c.activation, implementation=c.attention_implementation,
            num_targets=num_targets, max_attn_len=c.max_attn_len,
            timestamps=timestamps if self.time_bias is not None else None,
            pos_bias=self.pos_bias[...] if self.pos_bias is not None else None,
            time_bias=self.time_bias[...] if self.time_bias is not None else None)
        y = self.attn_norm(a.reshape(t, h * dv)) * u
        return x + dropout(self.out(y), c.dropout, rng)


class HSTUTower(nnx.Module):
    def __init__(self, config: ModelConfig, policy: PrecisionPolicy, *, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [HSTULayer(f"hstu/{i}", config, policy, rngs=rngs) for i in range(config.num_layers)])
        self.final_norm = LayerNorm(config.model_dim, policy, rngs=rngs)

    def __call__(self, x, offsets, num_targets, timestamps, *, max_seq_len: int, rng=None):
        for i, layer in enumerate(self.layers):
            layer_rng = None if rng is None else jax.random.fold_in(rng, i)
            x = layer(x, offsets, num_targets, timestamps, max_seq_len=max_seq_len, rng=layer_rng)
        return self.final_norm(x)
