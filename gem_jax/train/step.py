"""Train state, loss and the jitted train / eval steps.

The step is a short pure function `(state, batch) -> (state, metrics)`. The batch is a stack of
jagged packs (one per data-parallel shard); the per-pack forward runs under `jax.shard_map` over
the shard mesh axes, so custom kernels (Pallas) see only their local packs and XLA never has to
partition them. Variants (model, optimizer) are chosen when the step is built, not inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gem_jax.config import Config, TrainConfig
from gem_jax.data.batch import JaggedBatch
from gem_jax.model.gem import GEMModel
from gem_jax.parallel import batch_sharding, shard_axes, state_shardings
from gem_jax.train.optimizer import learning_rate_schedule, make_optimizer


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: Any  # the model's Params as a pure dict (nnx.to_pure_dict); nnx.merge takes it back
    opt_state: Any
    rng: jax.Array  # base key; step keys are fold_in(rng, step), so resumption replays them exactly


def create_model(config: Config, seed: int) -> GEMModel:
    return GEMModel(config, rngs=nnx.Rngs(seed))


class ShardedTrainer:
    """What every task's trainer shares: the sharded train state, the per-pack forward under
    `jax.shard_map`, and the jitted, donating optimizer step.

    A task subclasses it with `_model()` (the NNX module) and `_loss(params, batch, rng) ->
    (loss, aux metrics)`, usually summing `_sharded(per_pack_fn, ...)` over the packs.
    """

    def __init__(self, config: Config, mesh: Mesh, train_config: TrainConfig | None = None):
        self.config = config
        self.mesh = mesh
        train_config = train_config or config.train
        self.graphdef, abstract_params = nnx.split(nnx.eval_shape(self._model), nnx.Param)
        self.optimizer = make_optimizer(train_config)
        self.schedule = learning_rate_schedule(train_config)
        self.batch_sharding = batch_sharding(mesh, config.parallel)
        param_shardings = state_shardings(abstract_params, mesh, config.parallel)
        replicated = NamedSharding(mesh, P())
        abstract_state = jax.eval_shape(self._init_state)
        # Optimizer moments follow their parameters' sharding.
        opt_shardings = optax.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            abstract_state.opt_state,
            param_shardings,
            transform_non_params=lambda _: replicated,
        )
        self.state_shardings = TrainState(
            step=replicated, params=param_shardings, opt_state=opt_shardings, rng=replicated
        )
        self.abstract_state = abstract_state
        self.init_state = jax.jit(self._init_state, out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            self._train_step, donate_argnums=(0,), out_shardings=(self.state_shardings, replicated)
        )

    def _model(self) -> nnx.Module:
        raise NotImplementedError

    def _loss(self, params, batch, rng) -> tuple[jax.Array, dict[str, jax.Array]]:
        raise NotImplementedError

    def _init_state(self) -> TrainState:
        params = nnx.to_pure_dict(nnx.state(self._model(), nnx.Param))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            rng=jax.random.key_data(jax.random.key(self.config.train.seed + 1)),
        )

    def _sharded(self, per_pack: Callable, params, batch, rng):
        """Runs `per_pack(params, pack, rng) -> pytree of sums` on every pack; returns the global sums.

        Each pack gets its own key (split from `rng` and the shard index); `rng=None` passes None.
        """
        axes = shard_axes(self.config.parallel)

        def local(params, packs, rng):
            index = jax.lax.axis_index(axes) if axes else 0
            n = jax.tree.leaves(packs)[0].shape[0]
            keys = jax.random.split(jax.random.fold_in(rng, index), n) if rng is not None else None
            out = jax.vmap(per_pack, in_axes=(None, 0, 0 if keys is not None else None))(params, packs, keys)
            out = jax.tree.map(lambda x: x.sum(0), out)
            return jax.lax.psum(out, axes) if axes else out

        spec = P(axes if axes else None)
        return jax.shard_map(
            local, mesh=self.mesh, in_specs=(P(), spec, P()), out_specs=P(), check_vma=False
        )(params, batch, rng)

    def _per_pack(self, fn: Callable, params, batch):
        """`fn(model, pack)` on every pack, outputs stacked on the shard axis like the batch."""
        axes = shard_axes(self.config.parallel)

        def local(params, packs):
            model = nnx.merge(self.graphdef, params)
            return jax.vmap(lambda pack: fn(model, pack))(packs)

        spec = P(axes if axes else None)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(), spec), out_specs=spec, check_vma=False)(
            params, batch
        )

    def _train_step(self, state: TrainState, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        (loss, aux), grads = jax.value_and_grad(self._loss, has_aux=True)(state.params, batch, rng)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            **aux,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(params),
            "learning_rate": self.schedule(state.step),
        }
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


class Trainer(ShardedTrainer):
    """The ads ranking task: BCE per task on every candidate of every real example."""

    def __init__(self, config: Config, mesh: Mesh):
        super().__init__(config, mesh)
        replicated = NamedSharding(mesh, P())
        self.predict = jax.jit(
            lambda params, batch: self._per_pack(
                lambda model, pack: jax.nn.sigmoid(model(pack)), params, batch
            ),
            out_shardings=replicated,
        )

    def _model(self) -> GEMModel:
        return create_model(self.config, self.config.train.seed)

    def _pack_loss(self, params, pack: JaggedBatch, rng):
        model = nnx.merge(self.graphdef, params)
        logits = model(pack, rng=rng)  # [B, C, K]
        weight = pack.example_mask[:, None, None].astype(jnp.float32)
        bce = optax.sigmoid_binary_cross_entropy(logits, pack.labels) * weight
        count = jnp.broadcast_to(weight, bce.shape)
        return {"bce_sum": bce.sum((0, 1)), "count": count.sum((0, 1))}

    def _loss(self, params, batch, rng):
        dropout_rng = rng if self.config.model.dropout > 0 else None
        sums = self._sharded(self._pack_loss, params, batch, dropout_rng)
        per_task = sums["bce_sum"] / jnp.maximum(sums["count"], 1.0)
        return per_task.sum(), {f"loss_{t}": per_task[i] for i, t in enumerate(self.config.model.tasks)}
