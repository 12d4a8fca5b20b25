"""Wukong interaction stack (Zhang et al. 2024) over a set of feature embeddings.

A layer maps n input tokens [n, d] to m output tokens: a factorisation-machine block (FMB:
the pairwise dot products X X^T, compressed by a learned projection Y as X (X^T Y), then an MLP)
gives half of them, a linear compression block (LCB: a learned mix of the n tokens) the rest;
then residual and LayerNorm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import ArrayLike, Float

from gem_jax.model.layers import Dense, LayerNorm
from gem_jax.parallel import param
from gem_jax.precision import PrecisionPolicy


class WukongLayer(nnx.Module):
    def __init__(
        self,
        name: str,
        n_in: int,
        n_out: int,
        dim: int,
        fm_rank: int,
        policy: PrecisionPolicy,
        *,
        rngs: nnx.Rngs,
    ):
        self.name = name  # also the layer's named scope (profile groups)
        self.n_fm = n_out // 2
        self.n_lc = n_out - self.n_fm
        self.dim = dim
        init = nnx.initializers.lecun_normal()
        self.fm_projection = param(rngs, init, (n_in, fm_rank), (None, None), policy.param_dtype)
        self.fm_mlp = Dense(f"{name}/fm_mlp", n_in * fm_rank, self.n_fm * dim, policy, rngs=rngs)
        self.lc_mix = param(rngs, init, (n_in, self.n_lc), (None, None), policy.param_dtype)
        self.residual = (
            param(rngs, init, (n_in, n_out), (None, None), policy.param_dtype) if n_in != n_out else None
        )
        self.norm = LayerNorm(dim, policy, rngs=rngs)

    def __call__(self, x: Float[ArrayLike, "N n d"]) -> Float[ArrayLike, "N m d"]:
        with jax.named_scope(self.name):
            return self._forward(x)

    def _forward(self, x: Float[ArrayLike, "N n d"]) -> Float[ArrayLike, "N m d"]:
        x32 = x.astype(jnp.float32)
        # FMB: X X^T Y without forming the n x n matrix: Z = Y^T X is [k, d], then X Z^T is [n, k].
        z = jnp.einsum("bnd,nk->bkd", x32, self.fm_projection[...])
        fm = jnp.einsum("bnd,bkd->bnk", x32, z).reshape(x.shape[0], -1)
        fm_tokens = jax.nn.silu(self.fm_mlp(fm)).reshape(x.shape[0], self.n_fm, self.dim)
        lc_tokens = jnp.einsum("bnd,nm->bmd", x32, self.lc_mix[...])
        out = jnp.concatenate([fm_tokens.astype(jnp.float32), lc_tokens], axis=1)
        residual = x32 if self.residual is None else jnp.einsum("bnd,nm->bmd", x32, self.residual[...])
        return self.norm(out + residual)


class WukongStack(nnx.Module):
    def __init__(
        self,
        n_in: int,
        n_tokens: int,
        dim: int,
        num_layers: int,
        fm_rank: int,
        policy: PrecisionPolicy,
        *,
        rngs: nnx.Rngs,
    ):
        sizes = [n_in] + [n_tokens] * num_layers
        self.layers = nnx.List(
            [
                WukongLayer(f"wukong/{i}", sizes[i], sizes[i + 1], dim, fm_rank, policy, rngs=rngs)
                for i in range(num_layers)
            ]
        )

    def __call__(self, x: Float[ArrayLike, "N n d"]) -> Float[ArrayLike, "N m d"]:
        for layer in self.layers:
            x = layer(x)
        return x
