"""The GEM-like ranking model: embeddings -> HSTU tower <-> Wukong stack -> per-task heads.

Cross (InterFormer-style, both directions): non-sequence summaries fill the context slots at the
start of every sequence, and sequence summaries (each candidate's output token and the mean of the
history) join the Wukong stack's input tokens.

Named scopes ("embeddings", "input", "hstu/<i>/...", "cross", "wukong/<i>", "heads") label every op
for `python -m experiments profile`, which groups kernel time by them (docs/profiling.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import ArrayLike, Float, Int

from gem_jax.config import Config, DataConfig
from gem_jax.data.batch import JaggedBatch
from gem_jax.embeddings import FeatureIds, segment_ids
from gem_jax.model import fp8_auto
from gem_jax.model.hstu import HSTUTower
from gem_jax.model.layers import Dense
from gem_jax.model.wukong import WukongStack
from gem_jax.parallel import param
from gem_jax.precision import PrecisionPolicy

_FEATURE_SALT = 1_000_003  # keeps features' ids apart in the shared sparse table


class TaskHead(nnx.Module):
    """A small MLP producing one logit; "sensitive" precision."""

    def __init__(self, name: str, d_in: int, hidden: int, policy: PrecisionPolicy, *, rngs: nnx.Rngs):
        self.hidden = Dense(f"{name}/hidden", d_in, hidden, policy, rngs=rngs, sensitive=True)
        self.out = Dense(f"{name}/out", hidden, 1, policy, rngs=rngs, sensitive=True, axes=("mlp", "embed"))

    def __call__(self, x):
        with jax.named_scope("heads"):
            return self.out(jax.nn.silu(self.hidden(x)))[..., 0]


def sparse_feature_groups(data: DataConfig) -> dict[str, tuple[int, ...]]:
    """The feature map: embedding feature (`embeddings.features`) -> the sparse features (indices into a
    pack's F bags) it pools. `data.sparse_features` maps record features to embedding features; without
    it every bag feeds "sparse" (the synthetic task's F features, or every feature of the records)."""
    if not data.sparse_features:
        return {"sparse": tuple(range(data.num_sparse_features))}
    groups: dict[str, list[int]] = {}
    for f, feature in enumerate(data.sparse_features.values()):
        groups.setdefault(feature, []).append(f)
    return {name: tuple(members) for name, members in groups.items()}


def _select_bags(
    values: Int[ArrayLike, " S"], offsets: Int[ArrayLike, " BF1"], members: tuple[int, ...], f: int
) -> tuple[Int[ArrayLike, " S"], Int[ArrayLike, " N1"]]:
    """The bags of features `members` (of F per example), example by example, as one jagged array of the
    same capacity: (values, offsets over B x len(members) bags)."""
    starts = offsets[:-1].reshape(-1, f)[:, members].reshape(-1)
    ends = offsets[1:].reshape(-1, f)[:, members].reshape(-1)
    new_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(ends - starts).astype(jnp.int32)])
    capacity = values.shape[0]
    bag = jnp.minimum(segment_ids(new_offsets, capacity), starts.shape[0] - 1)
    position = jnp.arange(capacity)
    source = jnp.clip(starts[bag] + position - new_offsets[bag], 0, capacity - 1)
    return jnp.where(position < new_offsets[-1], values[source], 0), new_offsets


def embedding_ids(batch: JaggedBatch, groups: dict[str, tuple[int, ...]]) -> dict[str, FeatureIds]:
    """What the model looks up in the embedding tables for one pack: per-token item and action ids
    (positions past offsets[B] look up zeros) and, per embedding feature of `groups`
    (`sparse_feature_groups`), the bags it pools. Ids are salted by their feature's index, so features
    that share a table do not share rows."""
    f = sum(len(members) for members in groups.values())
    bag = segment_ids(batch.sparse_offsets, batch.sparse_values.shape[0])
    salted = batch.sparse_values + (bag % f) * _FEATURE_SALT
    ids = {
        "items": FeatureIds(batch.item_ids, batch.offsets),
        "actions": FeatureIds(batch.action_ids, batch.offsets),
    }
    for name, members in groups.items():
        if members == tuple(range(f)):
            ids[name] = FeatureIds(salted, batch.sparse_offsets)
        else:
            ids[name] = FeatureIds(*_select_bags(salted, batch.sparse_offsets, members, f))
    return ids


def gemm_rows(data: DataConfig) -> dict[str, int]:
    """The rows per pack (M) of each Dense layer's GEMM, by layer-name prefix: tokens for the token
    projection and the HSTU tower, examples for the per-example inputs, examples x candidates from the
    sequence summaries on (the precision policy decides `precision.fp8 = "auto"` layers by them)."""
    tokens, examples = data.tokens_per_shard, data.examples_per_shard
    candidates = examples * data.num_candidates
    return {
        "input/token": tokens,
        "hstu/": tokens,
        "input/dense": examples,
        "cross/context": examples,
        "cross/summary": candidates,
        "wukong/": candidates,
        "head/": candidates,
    }


class GEMModel(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        e, m, d = config.embeddings, config.model, config.data
        policy = PrecisionPolicy.from_config(
            config.precision, gemm_rows=gemm_rows(d), fp8_speedups=fp8_auto.speedups(config.precision)
        )
        self.config = config
        self.token_proj = Dense("input/token", e.dim, m.model_dim, policy, rngs=rngs)
        self.candidate_marker = param(
            rngs, nnx.initializers.normal(0.05), (m.model_dim,), ("embed",), policy.param_dtype
        )
        # Without dense features the dense token is zeros (a 0-wide Dense has no initialiser).
        self.dense_proj = (
            Dense("input/dense", d.num_dense_features, e.dim, policy, rngs=rngs)
            if d.num_dense_features
            else None
        )
        n_features = d.num_sparse_features + 1
        self.context = (
            Dense("cross/context", n_features * e.dim, m.num_context_tokens * m.model_dim, policy, rngs=rngs)
            if m.num_context_tokens
            else None
        )
        self.tower = HSTUTower(m, policy, rngs=rngs, max_targets=d.num_candidates)
        self.summary = Dense(
            "cross/summary", 2 * m.model_dim, m.num_summary_tokens * e.dim, policy, rngs=rngs
        )
        n_in = n_features + m.num_summary_tokens + 1
        self.wukong = WukongStack(
            n_in, m.wukong_tokens, e.dim, m.wukong_layers, m.wukong_fm_rank, policy, rngs=rngs
        )
        head_in = (m.wukong_tokens if m.wukong_layers else n_in) * e.dim
        self.heads = nnx.List(
            [TaskHead(f"head/{t}", head_in, m.head_hidden, policy, rngs=rngs) for t in m.tasks]
        )

    @property
    def max_seq_len(self) -> int:
        d, m = self.config.data, self.config.model
        return d.max_history_len + d.num_candidates + m.num_context_tokens

    def __call__(
        self, batch: JaggedBatch, embedded: dict[str, ArrayLike], *, rng: jax.Array | None = None
    ) -> Float[ArrayLike, "B C K"]:
        """Logits of one pack: [example capacity, candidates, tasks] (padding examples included).

        `embedded`: the pack's looked-up embeddings (gem_jax/embeddings, outside the model, so tables
        can be sharded and trained sparsely): "items" and "actions" [T, E] per token, and per embedding
        feature of the feature map ("sparse" by default) its pooled bags, [B * its features, E]
        (`embedding_ids`).
        """
        cfg, m = self.config, self.config.model
        e_dim, n_ctx = cfg.embeddings.dim, m.num_context_tokens
        t_cap = batch.item_ids.shape[0]
        b_cap = batch.num_targets.shape[0]
        c = batch.labels.shape[1]
        f = cfg.data.num_sparse_features
        offsets = batch.offsets

        # Non-sequence features: pooled sparse bags (in feature order, from their embedding features) +
        # projected dense features.
        groups = sparse_feature_groups(cfg.data)
        if len(groups) == 1:
            (name,) = groups
            pooled = embedded[name].reshape(b_cap, f, e_dim)
        else:
            pooled = jnp.zeros((b_cap, f, e_dim), jnp.float32)
            for name, members in groups.items():
                rows = embedded[name].reshape(b_cap, len(members), e_dim).astype(jnp.float32)
                pooled = pooled.at[:, jnp.array(members)].set(rows)
        with jax.named_scope("input"):
            dense = (
                self.dense_proj(batch.dense)
                if self.dense_proj is not None
                else jnp.zeros((b_cap, e_dim), jnp.float32)
            )
        feature_tokens = jnp.concatenate(
            [pooled.astype(jnp.float32), dense[:, None].astype(jnp.float32)],
            axis=1,
        )  # [B, F+1, E]

        # Sequence tokens: item + action embeddings; candidates marked; context slots filled.
        seg = segment_ids(offsets, t_cap)
        seg_c = jnp.minimum(seg, b_cap - 1)
        valid = jnp.arange(t_cap) < offsets[-1]
        pos = jnp.arange(t_cap) - offsets[seg_c]
        lengths = jnp.diff(offsets)
        is_target = pos >= (lengths - batch.num_targets)[seg_c]
        with jax.named_scope("input"):
            tokens = self.token_proj(embedded["items"] + embedded["actions"])
            tokens = tokens.astype(jnp.float32) + jnp.where(is_target[:, None], self.candidate_marker[...], 0)
            if self.context is not None:
                ctx = self.context(feature_tokens.reshape(b_cap, -1)).reshape(b_cap * n_ctx, m.model_dim)
                # The context slots are each real example's first n_ctx tokens: write them in place. A
                # scatter of B x n_ctx rows has a gather of as many as its gradient; gathering a context
                # row for every token would have a T-row scatter-add (9 ms of the gem_h200 step, 16 ms
                # of gem_long's, measured on the H200).
                slot = jnp.arange(n_ctx)[None, :]
                slots = jnp.where(slot < lengths[:, None], offsets[:-1, None] + slot, t_cap)  # [B, n_ctx]
                tokens = tokens.at[slots.reshape(-1)].set(ctx.astype(jnp.float32), mode="drop")
            x = jnp.where(valid[:, None], tokens, 0.0)

        x = self.tower(
            x, offsets, batch.num_targets, batch.timestamps, max_seq_len=self.max_seq_len, rng=rng
        ).astype(jnp.float32)

        # Sequence summaries: each candidate's output token and the mean over history tokens.
        target_idx = jnp.clip(offsets[1:, None] - c + jnp.arange(c)[None, :], 0, t_cap - 1)  # [B, C]
        with jax.named_scope("cross"):
            candidate_out = x[target_idx]
            is_history = valid & ~is_target & (pos >= n_ctx)
            hist_sum = jax.ops.segment_sum(jnp.where(is_history[:, None], x, 0), seg, num_segments=b_cap + 1)
            hist_count = jax.ops.segment_sum(is_history.astype(jnp.float32), seg, num_segments=b_cap + 1)
            hist_mean = hist_sum[:b_cap] / jnp.maximum(hist_count[:b_cap], 1)[:, None]
            summary_in = jnp.concatenate(
                [candidate_out, jnp.broadcast_to(hist_mean[:, None], candidate_out.shape)], axis=-1
            )
            summary = self.summary(summary_in).reshape(b_cap, c, m.num_summary_tokens, e_dim)

        candidate_emb = embedded["items"][target_idx][:, :, None]  # [B, C, 1, E]: the candidates' rows
        interaction_in = jnp.concatenate(
            [
                jnp.broadcast_to(feature_tokens[:, None], (b_cap, c, *feature_tokens.shape[1:])),
                summary.astype(jnp.float32),
                candidate_emb.astype(jnp.float32),
            ],
            axis=2,
        )
        n_in = interaction_in.shape[2]
        h = self.wukong(interaction_in.reshape(b_cap * c, n_in, e_dim)).reshape(b_cap * c, -1)
        logits = jnp.stack([head(h) for head in self.heads], axis=-1)
        return logits.reshape(b_cap, c, len(self.heads)).astype(jnp.float32)
