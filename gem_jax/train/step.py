"""Train state and the jitted train step, for any task.

The step is a short pure function `(state, batch) -> (state, metrics)`. The batch is a stack of
jagged packs (one per data-parallel shard). Everything per pack runs inside one `jax.shard_map`
over the shard mesh axes, so custom kernels (Pallas) see only their local packs and XLA never has
to partition them:

1. the sparse embeddings (gem_jax/embeddings, when the task has them) look up the pack's ids: ids
   travel to the devices owning their rows and the rows come back (all-to-all); no table is ever
   gathered whole;
2. `jax.vjp` of the per-pack loss sums (vmapped over the device's packs) w.r.t. the dense
   parameters, the looked-up activations and the FP8 amax probes (the FP8 layers multiply by the
   scales stored in the state, which enter the step as parameters: docs/fp8.md);
3. the sums are psum'ed, `task.loss` turns them into the loss, and its gradient w.r.t. the sums is
   pulled back: dense gradients (psum'ed), activation gradients (the sparse optimizer routes them
   to the rows' owners and updates only the rows looked up), FP8 amaxes (max over the global batch).

Offloaded tables (gem_jax/embeddings/offload.py) live in host memory with a cache of hot rows in
the state: `step` stages each batch's rows into the caches before dispatching the jitted step (which
then looks them up by slot), while the previous step still runs.

Outside the shard_map optax updates the dense parameters, the FP8 histories roll and the next
step's FP8 scales are computed from them. What differs
between tasks (model, ids, per-pack loss) comes from the Task and is chosen when the step is built.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gem_jax.embeddings.offload import host_device
from gem_jax.model import fp8
from gem_jax.model.layers import fp8_decisions
from gem_jax.parallel import batch_sharding, shard_axes, state_shardings
from gem_jax.precision import PrecisionPolicy
from gem_jax.train import compile_cache
from gem_jax.train.optimizer import learning_rate_schedule, make_optimizer
from gem_jax.train.task import Task


@typing.no_type_check  # pytrees are rebuilt with non-array leaves (see gem_jax/typing.py)
@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: Any  # the model's dense Params as a pure dict (nnx.to_pure_dict); nnx.merge takes it back
    opt_state: Any  # optax state of `params`
    rng: jax.Array  # base key; step keys are fold_in(rng, step), so resumption replays them exactly
    embeddings: Any  # sparse tables + row-wise optimizer state (EmbeddingCollection.init); {} if none
    fp8: Any  # FP8 amax histories and this step's scales of the delayed-scaling layers (fp8.FP8Meta); {} if none


class Trainer:
    """The sharded train state of a task's model, its jitted donating train step, and helpers to
    run functions of the model on every pack of a batch (evaluation)."""

    def __init__(self, task: Task, mesh: Mesh):
        self.task = task
        self.config = config = task.config
        compile_cache.configure(config.train.compilation_cache)  # before the first compile
        self.mesh = mesh
        self.embeddings = task.embeddings  # an EmbeddingCollection, or None (the model owns its tables)
        # FP8's settings as the layers get them (one object, built from the config by the policy)
        self.fp8_recipe = PrecisionPolicy.from_config(config.precision).fp8
        self.axes = shard_axes(config.parallel)
        self.batch_spec = P(self.axes if self.axes else None)
        abstract_model = nnx.eval_shape(task.build_model)
        # What each FP8-named layer decided as it was built (FP8 or not, and why): the loop records and
        # reports the "auto" choice from these.
        self.fp8_decisions = fp8_decisions(abstract_model)
        self.graphdef, abstract_params, _, abstract_probes = nnx.split(
            abstract_model, nnx.Param, fp8.FP8Meta, fp8.AmaxProbe
        )
        self.probe_template = nnx.to_pure_dict(abstract_probes)  # shapes of one pack's probes
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
            step=self.replicated,
            params=param_shardings,
            opt_state=opt_shardings,
            rng=self.replicated,
            embeddings=self.embeddings.state_shardings() if self.embeddings else {},
            fp8=jax.tree.map(lambda _: self.replicated, abstract_state.fp8),
        )
        self.abstract_state = abstract_state
        self._init_jit = jax.jit(self._init_state, out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            self._train_step, donate_argnums=(0,), out_shardings=(self.state_shardings, self.replicated)
        )
        self.offloaded = self.embeddings.offloaded_features() if self.embeddings else ()
        if self.offloaded:
            self._host_rows = jax.jit(self._table_rows)

    # ------------------------------------------------------------------------- checkpoints

    def saved_form(self, state: TrainState) -> TrainState:
        """The state as checkpoints hold it: embedding tables in their logical form (one [rows, dim]
        array per table), whose shapes do not depend on the device count or the sharding plan."""
        if not self.embeddings:
            return state
        return state.replace(embeddings=self.embeddings.to_logical(state.embeddings))

    def from_saved_form(self, saved: TrainState) -> TrainState:
        if not self.embeddings:
            return saved
        return saved.replace(embeddings=self.embeddings.from_logical(saved.embeddings))

    @property
    def saved_target(self) -> tuple[TrainState, TrainState]:
        """(abstract saved state, its shardings): the restore target of a checkpoint on this mesh."""
        if not self.embeddings:
            return self.abstract_state, self.state_shardings
        shardings = self.state_shardings.replace(embeddings=self.embeddings.logical_shardings())
        abstract = self.abstract_state.replace(embeddings=self.embeddings.logical_shapes())
        return abstract, shardings

    # ------------------------------------------------------------------------- batches

    def to_device(self, local_stack: Any) -> Any:
        """This process's numpy stack -> the global batch, split over the shard mesh axes."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), local_stack
        )

    def _model(self, params, fp8_meta, probes=None) -> nnx.Module:
        probes = probes if probes is not None else jax.tree.map(jnp.zeros_like, self.probe_template)
        return nnx.merge(self.graphdef, params, fp8_meta, probes)

    def _lookup(self, emb_state, packs, slots=None):
        """The packs' embeddings (inside the shard_map): activations with a leading pack axis.
        `slots`: the offloaded features' cache slots (from `stage`), in place of their raw ids."""
        if not self.embeddings:
            return {}, None
        ids = jax.vmap(self.task.embedding_ids)(packs)
        for name, values in (slots or {}).items():
            ids[name] = ids[name]._replace(values=values)
        return self.embeddings.lookup(emb_state, ids)

    # ------------------------------------------------------------------------- offloaded tables

    def _table_rows(self, stack):
        ids = jax.vmap(self.task.embedding_ids)(stack)
        return {name: self.embeddings.table_rows(name, ids[name]) for name in self.offloaded}

    def stage(self, emb_state, local_stack, *, commit: bool = True):
        """Caches the offloaded rows `local_stack` looks up (its ids resolved on the host's CPU);
        returns (embedding state, slots on the devices like the batch, cache counts)."""
        host = host_device()
        with jax.default_device(host):
            rows = jax.tree.map(np.asarray, self._host_rows(jax.device_put(local_stack, host)))
        emb_state, slots, counts = self.embeddings.stage(emb_state, rows, commit=commit)
        return emb_state, self.to_device(slots), counts

    def step(
        self, state: TrainState, local_stack: Any, compiled: Callable | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """One train step on this process's numpy stack: stages offloaded rows, then `train_step` (or
        `compiled`, from `lower_step`). The returned metrics add the caches' hits, misses and bytes
        moved (host floats)."""
        run = compiled or self.train_step
        batch = self.to_device(local_stack)
        if not self.offloaded:
            return run(state, batch)
        emb_state, slots, counts = self.stage(state.embeddings, local_stack)
        state, metrics = run(state.replace(embeddings=emb_state), batch, slots)
        return state, {**metrics, **counts}

    @property
    def abstract_sharded_state(self) -> TrainState:
        """The state as shapes with their shardings: traced (`trace_step`) or compiled without allocating it."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract_state,
            self.state_shardings,
        )

    def trace_step(self, state: TrainState, local_stack: Any) -> tuple[jax.stages.Traced, list[Any]]:
        """`train_step` traced on `state` (arrays or `abstract_sharded_state`) and this stack's shapes, for
        the memory plan (gem_jax/train/memory.py); returns it and the arguments after the state (the device
        batch, and where tables are offloaded their slot ids, all -1: no row is staged)."""
        batch = self.to_device(local_stack)
        if not self.offloaded:
            return self.train_step.trace(state, batch), [batch]
        rows = jax.eval_shape(self._host_rows, local_stack)
        slots = self.to_device({n: np.full(r.shape, -1, np.int32) for n, r in rows.items()})
        return self.train_step.trace(state, batch, slots), [batch, slots]

    def lower_step(self, state: TrainState, local_stack: Any) -> jax.stages.Lowered:
        """`train_step` lowered for this stack's shapes, for ahead-of-time compiles (benchmarks, memory
        estimates); run the compiled step with `step(state, stack, compiled)`, which stages offloaded
        rows first. Nothing is committed to the caches here."""
        batch = self.to_device(local_stack)
        if not self.offloaded:
            return self.train_step.lower(state, batch)
        _, slots, _ = self.stage(state.embeddings, local_stack, commit=False)
        return self.train_step.lower(state, batch, slots)

    def rotating_steps(self, compiled: Callable, stacks: list[Any]) -> Callable[[TrainState, int], Any]:
        """`(state, i) -> (state, metrics)`: `compiled` (from `lower_step`) on stacks[i % n], for the
        benchmarks and the profile. The batches go to the devices once, up front; with offloaded tables
        each call stages its stack's rows from host memory first, as training does (`step`)."""
        if self.offloaded:
            return lambda state, i: self.step(state, stacks[i % len(stacks)], compiled)
        batches = [self.to_device(s) for s in stacks]
        return lambda state, i: compiled(state, batches[i % len(batches)])

    def per_pack(self, fn: Callable[[nnx.Module, Any, dict], Any]) -> Callable[[TrainState, Any], Any]:
        """jit of `(state, batch) -> fn(model, pack, embedded)` on every pack, stacked like the batch
        and replicated on every device (evaluation outputs are small)."""
        emb_specs = self.embeddings.state_specs() if self.embeddings else {}

        def local(params, fp8_meta, emb_state, packs, slots):
            model = self._model(params, fp8_meta)
            acts, _ = self._lookup(emb_state, packs, slots)
            return jax.vmap(lambda pack, act: fn(model, pack, act))(packs, acts)

        sharded = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(P(), P(), emb_specs, self.batch_spec, self.batch_spec),
            out_specs=self.batch_spec,
            check_vma=False,
        )
        run = jax.jit(sharded, out_shardings=self.replicated)

        def call(state, batch):
            if not self.offloaded:
                return run(state.params, state.fp8, state.embeddings, batch, None)
            # A copy of the caches holding the batch's rows; the train state's stay as they were.
            emb_state, slots, _ = self.stage(state.embeddings, _process_local(batch), commit=False)
            return run(state.params, state.fp8, emb_state, batch, slots)

        return call

    def model_fn(self, fn: Callable[[nnx.Module], Any]) -> Callable[[TrainState], Any]:
        """jit of `state -> fn(model)`, replicated (e.g. the item table of a retrieval model)."""
        run = jax.jit(
            lambda params, fp8_meta: fn(self._model(params, fp8_meta)), out_shardings=self.replicated
        )
        return lambda state: run(state.params, state.fp8)

    # ------------------------------------------------------------------------- the step

    def init_state(self) -> TrainState:
        """The fresh sharded state (and the offloaded tables' host memory, filled alongside)."""
        state = self._init_jit()
        if self.offloaded:
            self.embeddings.init_host(self._embedding_key())
        return state

    def _embedding_key(self) -> jax.Array:
        return jax.random.key(self.config.train.seed + 2)

    def _init_state(self) -> TrainState:
        model = self.task.build_model()
        _, params, fp8_meta, _ = nnx.split(model, nnx.Param, fp8.FP8Meta, fp8.AmaxProbe)
        params = nnx.to_pure_dict(params)
        seed = self.config.train.seed
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            rng=jax.random.key_data(jax.random.key(seed + 1)),
            embeddings=self.embeddings.init(self._embedding_key(), host=False) if self.embeddings else {},
            fp8=nnx.to_pure_dict(fp8_meta),
        )

    def _local_step(self, params, fp8_meta, emb_state, packs, rng, slots):
        """One device's part of the step (inside the shard_map): see the module docstring."""
        index = jax.lax.axis_index(self.axes) if self.axes else 0
        n = jax.tree.leaves(packs)[0].shape[0]
        keys = jax.random.split(jax.random.fold_in(rng, index), n) if rng is not None else None
        with jax.named_scope("embeddings"):
            acts, residuals = self._lookup(emb_state, packs, slots)
        probes = fp8.pack_probes(self.probe_template, n)

        def sums(params, acts, probes):
            def one(pack, act, probe, key):
                return self.task.pack_loss(self._model(params, fp8_meta, probe), pack, act, key)

            out = jax.vmap(one, in_axes=(0, 0, 0, 0 if keys is not None else None))(packs, acts, probes, keys)
            return jax.tree.map(lambda x: x.sum(0), out)

        local_sums, pull_back = jax.vjp(sums, params, acts, probes)
        total = jax.lax.psum(local_sums, self.axes) if self.axes else local_sums
        with jax.named_scope("loss"):
            (loss, aux), d_total = jax.value_and_grad(self.task.loss, has_aux=True)(total)
        grads, act_grads, probe_grads = pull_back(d_total)
        amaxes = fp8.combine_meta_grads(probe_grads)  # max over this device's packs ...
        if self.axes:
            grads = jax.lax.psum(grads, self.axes)
            amaxes = jax.lax.pmax(amaxes, self.axes)  # ... and over every device: the global batch's
        if self.embeddings:
            with jax.named_scope("embeddings"):
                emb_state = self.embeddings.apply_gradients(
                    emb_state, residuals, act_grads, self.config.embeddings.learning_rate
                )
        return loss, aux, grads, amaxes, emb_state

    def _train_step(self, state: TrainState, batch, slots=None):
        if self.offloaded and slots is None:
            raise ValueError(
                f"embedding features {self.offloaded} read offloaded tables: their rows must be staged "
                "first; call Trainer.step(state, local_stack), not train_step"
            )
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if not self.task.loss_needs_rng:
            rng = None
        emb_specs = self.embeddings.state_specs() if self.embeddings else {}
        loss, aux, grads, amaxes, emb_state = jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            in_specs=(P(), P(), emb_specs, self.batch_spec, P(), self.batch_spec),
            out_specs=(P(), P(), P(), P(), emb_specs),
            check_vma=False,
        )(state.params, state.fp8, state.embeddings, batch, rng, slots)
        with jax.named_scope("optimizer"):  # named scopes label ops for `experiments profile`
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            # Roll the histories and compute the scales the next step's GEMMs will multiply by.
            fp8_meta = fp8.update_meta(state.fp8, amaxes, self.fp8_recipe.margin) if state.fp8 else state.fp8
        with jax.named_scope("metrics"):
            metrics = {
                "loss": loss,
                **aux,
                "grad_norm": optax.tree.norm(grads),
                "update_norm": optax.tree.norm(updates),
                "param_norm": optax.tree.norm(params),
                "learning_rate": self.schedule(state.step),
                **(fp8.saturation(state.fp8, amaxes) if state.fp8 else {}),
            }
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, embeddings=emb_state, fp8=fp8_meta
        )
        return new_state, metrics


def _process_local(batch: Any) -> Any:
    """This process's part of a global batch (what `Trainer.to_device` was given) as numpy: its
    devices' shards in order along the leading axis, a replicated shard once."""

    def local(x):
        shards = {}
        for s in x.addressable_shards:
            shards.setdefault(s.index[0].start or 0, s.data)
        return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])

    return jax.tree.map(local, batch)
