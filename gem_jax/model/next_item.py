"""Next-item (retrieval) sequence model and its training losses.

Item embedding (dense ids, row 0 = padding) x sqrt(d) + optional learned position embedding ->
dropout -> the HSTU tower (the ads model's tower, activation "softmax" for SASRec or "silu" for
HSTU) -> one user vector per position. Scores are dot products with the same item table (tied
input/output embeddings, as SASRec and HSTU do), optionally L2-normalised (HSTU).

Positions count back from each sequence's last item: SASRec pads sequences on the left, so its
position index is also "distance from the newest item", and that is what makes the index carry
recency.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from gem_jax.config import Config
from gem_jax.embeddings import HashedEmbedding, segment_ids
from gem_jax.model.hstu import HSTUTower
from gem_jax.model.layers import Dense, dropout
from gem_jax.model.spectral_views import band_stop_view
from gem_jax.parallel import param
from gem_jax.precision import PrecisionPolicy


class NextItemModel(nnx.Module):
    def __init__(self, config: Config, num_items: int, *, rngs: nnx.Rngs):
        e, m, r = config.embeddings, config.model, config.retrieval
        policy = PrecisionPolicy.from_config(config.precision)
        self.config = config
        self.num_items = num_items
        self.items = HashedEmbedding(num_items + 1, e.dim, policy, rngs=rngs, hashed=False)
        self.positions = (
            param(
                rngs, nnx.initializers.normal(0.05), (r.max_len, e.dim), (None, "embed"), policy.param_dtype
            )
            if r.position_embedding
            else None
        )
        # Projections only when the item and tower widths differ (SASRec and HSTU tie them).
        same = e.dim == m.model_dim
        self.input_proj = None if same else Dense("retrieval/input", e.dim, m.model_dim, policy, rngs=rngs)
        self.output_proj = (
            None if same else Dense("retrieval/output", m.model_dim, e.dim, policy, rngs=rngs, sensitive=True)
        )
        self.tower = HSTUTower(m, policy, rngs=rngs, max_seq_len=r.max_len)
        # ICLRec's intent centroids (`retrieval.intent_weight`): written by the task's k-means at epoch
        # starts, read without gradient (so the optimizer leaves them: zero gradients, zero Adam moments);
        # a Param so that checkpoints keep them. Absent when the intent loss is off (the model as before).
        self.intent_centroids = (
            nnx.Param(jnp.zeros((r.intent_clusters, e.dim), jnp.float32), logical_axes=(None, None))
            if r.intent_weight > 0
            else None
        )

    def item_table(self) -> Float[ArrayLike, "N1 d"]:
        """The scoring table (row 0 = padding), normalised when the config says so."""
        table = self.items.table[...].astype(jnp.float32)
        return _l2_normalize(table) if self.config.retrieval.normalize else table

    def __call__(
        self, item_ids: Int[ArrayLike, " T"], offsets: Int[ArrayLike, " B1"], *, rng: jax.Array | None = None
    ) -> Float[ArrayLike, "T d"]:
        """Per-position user vectors of one pack (zeros past offsets[B])."""
        return self.encode(self.embed(item_ids, offsets), offsets, rng=rng)

    def embed(
        self, item_ids: Int[ArrayLike, " T"], offsets: Int[ArrayLike, " B1"]
    ) -> Float[ArrayLike, "T d"]:
        """The tower's input before dropout: item embedding x sqrt(d) (+ the position embedding)."""
        cfg = self.config
        t_cap = item_ids.shape[0]
        seg = jnp.minimum(segment_ids(offsets, t_cap), offsets.shape[0] - 2)
        with jax.named_scope("embeddings"):  # scopes label ops for the profile's groups
            x = self.items.lookup(item_ids).astype(jnp.float32) * (cfg.embeddings.dim**0.5)
            if self.positions is not None:
                back = jnp.clip(offsets[seg + 1] - 1 - jnp.arange(t_cap), 0, cfg.retrieval.max_len - 1)
                x = x + jnp.take(self.positions[...].astype(jnp.float32), back, axis=0)
            return x

    def encode(
        self, x: Float[ArrayLike, "T d"], offsets: Int[ArrayLike, " B1"], *, rng: jax.Array | None = None
    ) -> Float[ArrayLike, "T d"]:
        """Per-position user vectors from the embedded rows `x` (`embed`): dropout, tower, output."""
        cfg = self.config
        t_cap = x.shape[0]
        valid = jnp.arange(t_cap) < offsets[-1]
        with jax.named_scope("input"):
            x = dropout(x, cfg.model.dropout, None if rng is None else jax.random.fold_in(rng, 1 << 20))
            if self.input_proj is not None:
                x = self.input_proj(x)
            x = jnp.where(valid[:, None], x, 0.0)
        zeros_b = jnp.zeros((offsets.shape[0] - 1,), jnp.int32)
        x = self.tower(
            x, offsets, zeros_b, jnp.zeros((t_cap,), jnp.int32), max_seq_len=cfg.retrieval.max_len, rng=rng
        ).astype(jnp.float32)
        with jax.named_scope("output"):
            if self.output_proj is not None:
                x = self.output_proj(x).astype(jnp.float32)
            x = _l2_normalize(x) if cfg.retrieval.normalize else x
            return jnp.where(valid[:, None], x, 0.0)

    def last_vectors(
        self, item_ids: Int[ArrayLike, " T"], offsets: Int[ArrayLike, " B1"], *, rng: jax.Array | None = None
    ) -> Float[ArrayLike, "B d"]:
        """Each example's user vector at its newest item (evaluation; with `rng`, training's dropout);
        an empty example gets the vector of the token before it (token 0 at the start)."""
        x = self(item_ids, offsets, rng=rng)
        last = jnp.clip(offsets[1:] - 1, 0, item_ids.shape[0] - 1)
        return x[last]

    def sequence_vectors(
        self,
        item_ids: Int[ArrayLike, " T"],
        offsets: Int[ArrayLike, " B1"],
        pooling: str,
        *,
        rng: jax.Array | None = None,
    ) -> Float[ArrayLike, "B d"]:
        """One vector per example for the contrastive and intent losses: "last", the user vector at its
        newest item (`last_vectors`); "mean", the mean of its per-position user vectors (ICLRec's
        sequence representation), L2-normalised again when `retrieval.normalize` is on. An empty example
        gets zeros under "mean"."""
        return pool_examples(
            self(item_ids, offsets, rng=rng), offsets, pooling, self.config.retrieval.normalize
        )

    def spectral_views(
        self,
        item_ids: Int[ArrayLike, " T"],
        offsets: Int[ArrayLike, " B1"],
        pooling: str,
        *,
        key: jax.Array,
        rng: jax.Array | None = None,
    ) -> Float[ArrayLike, "N d"]:
        """Two views of every example made in the frequency domain (gem_jax/model/spectral_views.py, bands
        drawn with `key`), one vector each as `sequence_vectors` (with `rng`, the training dropout): the
        examples' first views, then their second."""
        r = self.config.retrieval
        x = self.embed(item_ids, offsets)
        vectors = []
        for i, view_key in enumerate(jax.random.split(key)):
            view = band_stop_view(x, offsets, view_key, max_len=r.max_len, band=r.frequency_contrastive_band)
            user = self.encode(view, offsets, rng=None if rng is None else jax.random.fold_in(rng, i))
            vectors.append(pool_examples(user, offsets, pooling, r.normalize))
        return jnp.concatenate(vectors)


def pool_examples(
    x: Float[ArrayLike, "T d"], offsets: Int[ArrayLike, " B1"], pooling: str, normalize: bool
) -> Float[ArrayLike, "B d"]:
    """One vector per example from per-position vectors (see `NextItemModel.sequence_vectors`)."""
    t_cap, b_cap = x.shape[0], offsets.shape[0] - 1
    if pooling == "last":
        return x[jnp.clip(offsets[1:] - 1, 0, t_cap - 1)]
    seg = segment_ids(offsets, t_cap)  # b_cap past offsets[B]: dropped by the sum
    total = jax.ops.segment_sum(x, seg, num_segments=b_cap)
    lengths = (offsets[1:] - offsets[:-1]).astype(jnp.float32)
    mean = total / jnp.maximum(lengths, 1.0)[:, None]
    return _l2_normalize(mean) if normalize else mean


def _l2_normalize(x: Array) -> Array:
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), 1e-12))


# ----------------------------------------------------------------------------- losses
# Each returns (sum of per-position losses, number of positions) so packs and shards add up exactly.


def bce_loss(
    user: Float[ArrayLike, "T d"],
    table: Float[ArrayLike, "N1 d"],
    targets: Int[ArrayLike, " T"],
    negatives: Int[ArrayLike, " T"],
) -> tuple[Array, Array]:
    """SASRec: -log sigmoid(u.e_pos) - log(1 - sigmoid(u.e_neg)) per position with a target."""
    mask = (targets > 0).astype(jnp.float32)
    pos = jnp.einsum("td,td->t", user, table[targets])
    neg = jnp.einsum("td,td->t", user, table[negatives])
    per = optax.sigmoid_binary_cross_entropy(pos, jnp.ones_like(pos)) + optax.sigmoid_binary_cross_entropy(
        neg, jnp.zeros_like(neg)
    )
    return jnp.sum(per * mask), jnp.sum(mask)


def sampled_softmax_loss(
    user: Float[ArrayLike, "T d"],
    table: Float[ArrayLike, "N1 d"],
    targets: Int[ArrayLike, " T"],
    negatives: Int[ArrayLike, "T K"] | Int[ArrayLike, " K"],
    temperature: float,
) -> tuple[Array, Array]:
    """HSTU: cross-entropy of the target against sampled negatives, logits = score / temperature.

    `negatives` is [T, K] (per-position uniform samples) or [K] (shared by every position, e.g.
    the pack's own targets for in-batch negatives). A negative equal to the position's target,
    or id 0 (padding), is masked out, so an accidental hit is never pushed down.
    """
    mask = (targets > 0).astype(jnp.float32)
    pos = jnp.einsum("td,td->t", user, table[targets])
    if negatives.ndim == 1:
        neg = user @ table[negatives].T  # [T, K]
        neg_ids = negatives[None, :]
    else:
        neg = jnp.einsum("td,tkd->tk", user, table[negatives])
        neg_ids = negatives
    keep = (neg_ids != targets[:, None]) & (neg_ids > 0)
    logits = jnp.concatenate([pos[:, None], jnp.where(keep, neg, -jnp.inf)], axis=1) / temperature
    per = jax.nn.logsumexp(logits, axis=1) - logits[:, 0]
    return jnp.sum(per * mask), jnp.sum(mask)


def full_softmax_loss(
    user: Float[ArrayLike, "T d"],
    table: Float[ArrayLike, "N1 d"],
    targets: Int[ArrayLike, " T"],
    temperature: float,
    label_smoothing: float = 0.0,
) -> tuple[Array, Array]:
    """Cross-entropy of the target against every item 1..N (row 0, padding, is never a class).

    With `label_smoothing` e, the target distribution is (1 - e) on the target plus e / N on every
    item. Memory is T x N logits: fine for 10^4-10^5 items, the sampled loss is for larger tables.
    """
    mask = (targets > 0).astype(jnp.float32)
    logits = (user @ table[1:].T) / temperature  # [T, N]
    lse = jax.nn.logsumexp(logits, axis=1)
    target_logit = jnp.take_along_axis(logits, jnp.maximum(targets - 1, 0)[:, None], axis=1)[:, 0]
    per = lse - (1.0 - label_smoothing) * target_logit
    if label_smoothing > 0:
        per = per - label_smoothing * jnp.mean(logits, axis=1)
    return jnp.sum(per * mask), jnp.sum(mask)


def info_nce_loss(
    first: Float[ArrayLike, "B d"],
    second: Float[ArrayLike, "B d"],
    valid: Bool[ArrayLike, " B"],
    temperature: float,
    groups: Int[ArrayLike, " B"] | None = None,
) -> tuple[Array, Array]:
    """InfoNCE between two views (CL4SRec's NT-Xent): each of the 2n valid vectors has its other view as
    the positive and the other 2n - 2 vectors of the batch as negatives; logits = dot / temperature.
    With `second` the examples' intent centroids, it is ICLRec's intent loss (its NCELoss(view, intent)).
    `groups` (ICLRec's de-noising): vectors of examples in the same group are not each other's negatives.

    Returns (sum of the 2n per-vector losses, 2n); invalid rows (empty examples) neither count nor serve
    as negatives.
    """
    b = first.shape[0]
    z = jnp.concatenate([first, second]).astype(jnp.float32)
    both = jnp.concatenate([valid, valid])
    logits = (z @ z.T) / temperature
    partner = jnp.concatenate([jnp.arange(b, 2 * b), jnp.arange(b)])
    keep = both[None, :] & ~jnp.eye(2 * b, dtype=bool)
    if groups is not None:
        g = jnp.concatenate([groups, groups])
        keep = keep & ((g[:, None] != g[None, :]) | (jnp.arange(2 * b)[None, :] == partner[:, None]))
    # A finite floor, not -inf: an invalid row stays finite (its zero cotangent must not meet a NaN).
    logits = jnp.where(keep, logits, _MASKED_LOGIT)
    positive = jnp.take_along_axis(logits, partner[:, None], axis=1)[:, 0]
    per = jax.nn.logsumexp(logits, axis=1) - positive
    return jnp.sum(jnp.where(both, per, 0.0)), jnp.sum(both.astype(jnp.float32))


_MASKED_LOGIT = -1e9


# ----------------------------------------------------------------------------- intent clustering


def kmeans(x: Float[ArrayLike, "n d"], k: int, iterations: int, key: jax.Array) -> Array:
    """Lloyd's k-means (squared L2) of `x`, from k distinct points drawn with `key`; a cluster left empty
    keeps its centroid. Returns the [k, d] centroids (ICLRec: faiss k-means, 20 iterations)."""
    x = jnp.asarray(x, jnp.float32)
    centroids = x[jax.random.choice(key, x.shape[0], (k,), replace=False)]
    norms = jnp.sum(x * x, axis=1)

    def update(_, c):
        assign = nearest_centroid(x, c, norms)
        sums = jax.ops.segment_sum(x, assign, num_segments=k)
        counts = jax.ops.segment_sum(jnp.ones_like(norms), assign, num_segments=k)
        return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], c)

    return jax.lax.fori_loop(0, iterations, update, centroids)


def nearest_centroid(
    x: Float[ArrayLike, "n d"], centroids: Float[ArrayLike, "k d"], norms: Array | None = None
) -> Int[Array, " n"]:
    """Index of each row's nearest centroid (squared L2, as ICLRec's faiss index)."""
    norms = jnp.sum(x * x, axis=1) if norms is None else norms
    dist = norms[:, None] - 2.0 * (x @ centroids.T) + jnp.sum(centroids * centroids, axis=1)[None, :]
    return jnp.argmin(dist, axis=1).astype(jnp.int32)
