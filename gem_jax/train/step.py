"""Train state and the jitted train step, for any task.

The step is a short pure function `(state, batch) -> (state, metrics)`. The batch is a stack of
jagged packs (one per data-parallel shard); the per-pack loss runs under `jax.shard_map` over the
shard mesh axes, so custom kernels (Pallas) see only their local packs and XLA never has to
partition them. What differs between tasks (model, per-pack loss) comes from the Task and is
chosen when the step is built, not inside it.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gem_jax.parallel import batch_sharding, shard_axes, state_shardings
from gem_jax.train.optimizer import learning_rate_schedule, make_optimizer
from gem_jax.train.task import Task


@typing.no_type_check  # pytrees are rebuilt with non-array leaves (see gem_jax/typing.py)
@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: Any  # the model's Params as a pure dict (nnx.to_pure_dict); nnx.merge takes it back
    opt_state: Any
    rng: jax.Array  # base key; step keys are fold_in(rng, step), so resumption replays them exactly


class Trainer:
    """The sharded train state of a task's model, its jitted donating train step, and helpers to
    run functions of the model on every pack of a batch (evaluation)."""

    def __init__(self, task: Task, mesh: Mesh):
        self.task = task
        self.config = config = task.config
        self.mesh = mesh
        self.graphdef, abstract_params = nnx.split(nnx.eval_shape(task.build_model), nnx.Param)
        schedule_steps = max(task.schedule_steps(), 1)
        self.optimizer = make_optimizer(config.train, schedule_steps)
        self.schedule = learning_rate_schedule(config.train, schedule_steps)
        self.batch_sharding = batch_sharding(mesh, config.parallel)
        self.replicated = NamedSharding(mesh, P())
        param_shardings = state_shardings(abstract_params, mesh, config.parallel)
        abstract_state = jax.eval_shape(self._init_state)
        # Optimizer moments follow their parameters' sharding.
        opt_shardings = optax.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            abstract_state.opt_state,
            param_shardings,
            transform_non_params=lambda _: self.replicated,
        )
        self.state_shardings = TrainState(
            step=self.replicated, params=param_shardings, opt_state=opt_shardings, rng=self.replicated
        )
        self.abstract_state = abstract_state
        self.init_state = jax.jit(self._init_state, out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            self._train_step, donate_argnums=(0,), out_shardings=(self.state_shardings, self.replicated)
        )

    # ------------------------------------------------------------------------- batches

    def to_device(self, local_stack: Any) -> Any:
        """This process's numpy stack -> the global batch, split over the shard mesh axes."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), local_stack
        )

    def per_pack(self, fn: Callable[[nnx.Module, Any], Any]) -> Callable[[Any, Any], Any]:
        """jit of `(params, batch) -> fn(model, pack)` on every pack, stacked like the batch and
        replicated on every device (evaluation outputs are small)."""
        axes = shard_axes(self.config.parallel)
        spec = P(axes if axes else None)

        def local(params, packs):
            model = nnx.merge(self.graphdef, params)
            return jax.vmap(lambda pack: fn(model, pack))(packs)

        sharded = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), spec), out_specs=spec, check_vma=False)
        return jax.jit(sharded, out_shardings=self.replicated)

    def model_fn(self, fn: Callable[[nnx.Module], Any]) -> Callable[[Any], Any]:
        """jit of `params -> fn(model)`, replicated (e.g. the item table of a retrieval model)."""
        return jax.jit(lambda params: fn(nnx.merge(self.graphdef, params)), out_shardings=self.replicated)

    # ------------------------------------------------------------------------- the step

    def _init_state(self) -> TrainState:
        params = nnx.to_pure_dict(nnx.state(self.task.build_model(), nnx.Param))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            rng=jax.random.key_data(jax.random.key(self.config.train.seed + 1)),
        )

    def _pack_loss(self, params, pack, rng):
        return self.task.pack_loss(nnx.merge(self.graphdef, params), pack, rng)

    def _sharded_sums(self, params, batch, rng):
        """Sums `task.pack_loss` over every pack of the global batch.

        Each pack gets its own key (split from `rng` and the shard index); `rng=None` passes None.
        """
        axes = shard_axes(self.config.parallel)

        def local(params, packs, rng):
            index = jax.lax.axis_index(axes) if axes else 0
            n = jax.tree.leaves(packs)[0].shape[0]
            keys = jax.random.split(jax.random.fold_in(rng, index), n) if rng is not None else None
            out = jax.vmap(self._pack_loss, in_axes=(None, 0, 0 if keys is not None else None))(
                params, packs, keys
            )
            out = jax.tree.map(lambda x: x.sum(0), out)
            return jax.lax.psum(out, axes) if axes else out

        spec = P(axes if axes else None)
        return jax.shard_map(
            local, mesh=self.mesh, in_specs=(P(), spec, P()), out_specs=P(), check_vma=False
        )(params, batch, rng)

    def _loss(self, params, batch, rng):
        return self.task.loss(self._sharded_sums(params, batch, rng))

    def _train_step(self, state: TrainState, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if not self.task.loss_needs_rng:
            rng = None
        (loss, aux), grads = jax.value_and_grad(self._loss, has_aux=True)(state.params, batch, rng)
        with jax.named_scope("optimizer"):  # named scopes label ops for `experiments profile`
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        with jax.named_scope("metrics"):
            metrics = {
                "loss": loss,
                **aux,
                "grad_norm": optax.tree.norm(grads),
                "update_norm": optax.tree.norm(updates),
                "param_norm": optax.tree.norm(params),
                "learning_rate": self.schedule(state.step),
            }
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
