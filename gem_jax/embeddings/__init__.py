"""Sparse embeddings: tables, their sharding plan, lookups inside `jax.shard_map`, sparse optimizers.

How a train step uses it (docs/embeddings.md has the data movement and the sharding types):

    emb = EmbeddingCollection.from_config(config, mesh)     # plans the tables; print(emb.plan.format())
    state = emb.init(rng)                                   # {key: {"table", "accumulator"}}, sharded

    def local_step(dense_params, emb_state, packs, lr):     # under jax.shard_map over emb.batch_axes,
        ids = {name: FeatureIds(values, offsets), ...}      #   in_specs=(P(), emb.state_specs(), ...)
        acts, residuals = emb.lookup(emb_state, ids)        # fp32 [..., N, D] per feature
        (loss, aux), (dense_grads, act_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            dense_params, acts, packs)                      # never a gradient w.r.t. a table
        emb_state = emb.apply_gradients(emb_state, residuals, act_grads, lr)
        return ..., emb_state                               # out_specs=emb.state_specs() for it

`act_grads` must be the gradient of the global loss w.r.t. this device's activations. Dense
parameters keep optax. A table is only ever touched on the rows the batch looks up: no table-sized
gradient, optimizer pass or collective. Checkpoints: save `emb.to_logical(state)` (one `[rows, dim]`
array and `[rows]` accumulator per table, shapes independent of the device count and plan) and
restore with `emb.from_logical(...)` onto any plan, using `emb.logical_shardings()` as the target.

Tables with sharding `offload` (offload.py) live in host memory with an HBM cache of hot rows in the
state: before each step, `emb.stage(state, rows)` caches the batch's rows and returns slot ids that
`lookup` takes in place of those features' raw ids (gem_jax/train/step.py: `Trainer.step`).

`hash_ids` and `segment_ids` are shared with the models; `HashedEmbedding` is the dense nnx table the
next-item model keeps its item table in (dense.py says why).
"""

from gem_jax.embeddings.collection import EmbeddingCollection, FeatureIds, Residuals
from gem_jax.embeddings.dense import HashedEmbedding
from gem_jax.embeddings.hashing import hash_ids, segment_ids
from gem_jax.embeddings.optimizers import RowWiseAdagrad, SparseSGD
from gem_jax.embeddings.planner import Placement, Plan, plan_tables

__all__ = [
    "EmbeddingCollection",
    "FeatureIds",
    "HashedEmbedding",
    "Placement",
    "Plan",
    "Residuals",
    "RowWiseAdagrad",
    "SparseSGD",
    "hash_ids",
    "plan_tables",
    "segment_ids",
]
