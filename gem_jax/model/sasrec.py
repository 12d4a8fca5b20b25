"""SASRec's self-attention block (Kang & McAuley 2018), as an alternative layer of the sequence tower.

Per block, as the authors' code does it: Xn = LN(X); A = attention(Xn Wq, X Wk, X Wv) (causal
softmax, keys and values from the un-normalised input); H = Xn + A; Hn = LN(H);
Y = Hn + dropout(W2 dropout(ReLU(W1 Hn))). No output projection. The authors drop attention
weights: with `model.attention_dropout` > 0 the block does that (through the padded jnp attention, which
the kernels lack) and leaves the attention output alone, as their code; with 0 (the kernels' case) it
drops the attention output with `model.dropout` instead.
The attention goes through the same `gem_jax.model.attention.attention` entry as HSTU's layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import ArrayLike, Float, Int

from gem_jax.config import ModelConfig
from gem_jax.model.attention import AttentionSpec, attention
from gem_jax.model.layers import Dense, LayerNorm, dropout
from gem_jax.precision import PrecisionPolicy


class SASRecLayer(nnx.Module):
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
        """`max_targets` and `max_seq_len`: the HSTU layers' signature (a SASRec block needs neither)."""
        c = config
        if c.num_position_buckets or c.num_time_buckets:
            raise ValueError(
                'model.layer = "sasrec" has no relative bias: set model.num_position_buckets '
                f"and model.num_time_buckets to 0 (got {c.num_position_buckets}, {c.num_time_buckets})"
            )
        self.config = c
        self.name = name  # also the layer's named scope (profile groups)
        self.attention_spec = AttentionSpec.from_config(c, activation="softmax")
        h, dqk, dv = c.num_heads, c.attention_dim, c.value_dim
        if h * dv != c.model_dim:
            raise ValueError(
                f'model.layer = "sasrec" adds the attention output to the input: num_heads x '
                f"value_dim ({h} x {dv}) must equal model_dim ({c.model_dim})"
            )
        self.attn_norm = LayerNorm(c.model_dim, policy, rngs=rngs)
        self.q = Dense(f"{name}/q", c.model_dim, h * dqk, policy, rngs=rngs)
        self.kv = Dense(f"{name}/kv", c.model_dim, h * (dqk + dv), policy, rngs=rngs)
        self.ffn_norm = LayerNorm(c.model_dim, policy, rngs=rngs)
        self.ffn_in = Dense(f"{name}/ffn_in", c.model_dim, c.model_dim, policy, rngs=rngs)
        self.ffn_out = Dense(
            f"{name}/ffn_out", c.model_dim, c.model_dim, policy, rngs=rngs, axes=("mlp", "embed")
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
        with jax.named_scope(self.name):
            return self._forward(x, offsets, num_targets, max_seq_len=max_seq_len, rng=rng)

    def _forward(self, x, offsets, num_targets, *, max_seq_len: int, rng: jax.Array | None):
        c = self.config
        t = x.shape[0]
        h, dqk, dv = c.num_heads, c.attention_dim, c.value_dim
        rngs = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
        attention_rng = None if rng is None else jax.random.fold_in(rng, 3)
        xn = self.attn_norm(x)
        k, v = jnp.split(self.kv(x), [h * dqk], axis=-1)
        q = self.q(xn)
        with jax.named_scope("attention"):
            a = attention(
                q.reshape(t, h, dqk),
                k.reshape(t, h, dqk),
                v.reshape(t, h, dv),
                offsets,
                spec=self.attention_spec,
                max_seq_len=max_seq_len,
                num_targets=num_targets,
                rng=attention_rng,
            )
        a = a.reshape(t, h * dv).astype(xn.dtype)
        hn = self.ffn_norm(xn + (a if c.attention_dropout > 0 else dropout(a, c.dropout, rngs[0])))
        f = dropout(jax.nn.relu(self.ffn_in(hn)), c.dropout, rngs[1])
        return hn + dropout(self.ffn_out(f), c.dropout, rngs[2])
