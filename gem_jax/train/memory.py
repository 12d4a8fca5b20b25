"""Whether the train step fits a device's memory: planned before the step compiles, checked after.

Per device the step holds its arguments (the train state: dense parameters, optimizer state, FP8 state,
the embedding tables and accumulators kept in device memory; and the batch) and its temporaries
(activations kept for the backward, gradients, the optimizer's intermediates). The arguments' sizes
are exact, from their shapes and shardings. The temporaries are estimated from the step's jaxpr, before
anything compiles: each equation's outputs are allocated when it runs and freed after their last use
(the donated train state at its own), an output may reuse an input of its size that dies with it, and
the estimate is the peak of what is live, inside nested calls (the shard_map, custom VJPs, loops) too.
XLA fuses elementwise chains and recomputes cheap values instead of keeping them, so it needs less:
the estimate was 1.1-1.7x XLA's own figure (`compiled.memory_analysis()`: arguments + outputs - donated
aliases + temporaries) on the shipped configs shrunk to CPU sizes (tests/test_memory.py checks a band).

The device's memory is `embeddings.device_memory_gib` when set, else what the device reports
(`memory_stats()["bytes_limit"]`: the memory jax's allocator may use; on GPUs XLA_PYTHON_CLIENT_MEM_FRACTION
of the card, 75% by default), else `DEFAULT_DEVICE_BYTES` (CPU devices report none).

The loop (gem_jax/train/loop.py) plans before it compiles: when the estimate exceeds the device's memory
and some `auto` tables are still in device memory, the tables are planned again with what the rest of
the step leaves them (the planner then puts the largest in host memory: `offload`), and a step that
still does not fit is refused in one line naming the sizes and the ways out. After the compile XLA's
figure is checked the same way, before the first step allocates anything. `train.check_memory = false`
turns both checks off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core

from gem_jax.config import Config, ConfigError
from gem_jax.embeddings import EmbeddingCollection, planner
from gem_jax.embeddings.planner import size_text

# Primitives whose sub-jaxpr runs once, as a call (its inputs and outputs are the call's).
_CALLS = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "remat",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "shard_map",
}
_LOOPS = {"while", "scan"}  # the body's temporaries once (buffers are reused between iterations)
_VIEWS = {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "iota"}  # fused into their consumers


def device_capacity(config: Config, device: Any = None) -> tuple[int, str]:
    """(bytes one device may use, where that figure comes from)."""
    return planner.device_capacity(config.embeddings.device_memory_gib, device)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of arrays (or shapes with shardings): the largest shard's
    share where a leaf is split, all of it where it is replicated or has no sharding."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and hasattr(sharding, "shard_shape"):
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * _itemsize(dtype)
    return total


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys): their raw data
        return getattr(dtype, "itemsize", 4) or 4


def _aval_bytes(aval: Any) -> int:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * _itemsize(dtype)


def _sub_jaxprs(eqn: Any) -> list[Any]:
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, core.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, core.Jaxpr):
                out.append(v)
    return out


def _is_var(v: Any) -> bool:
    return isinstance(v, core.Var) and not isinstance(v, core.Literal)


def _peak(jaxpr: Any, sizes: Sequence[int], owned: Sequence[bool]) -> int:
    """The peak of the bytes `jaxpr` allocates beyond its inputs while it runs, less its owned inputs
    already freed (`owned`: inputs it may free after their last use). `sizes`: the inputs' bytes."""
    n = len(jaxpr.eqns)
    last: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if _is_var(v):
                last[v] = i
    for v in jaxpr.outvars:
        if _is_var(v):
            last[v] = n
    size = dict(zip(jaxpr.invars, sizes, strict=True))
    for v in jaxpr.constvars:
        size[v] = _aval_bytes(v.aval)
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    freeable = {v for v, own in zip(jaxpr.invars, owned, strict=True) if own}
    live = peak = 0
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        dying, seen = [], set()
        for v in eqn.invars:
            if _is_var(v) and v not in seen and last.get(v) == i and (v in freeable or v not in inputs):
                dying.append(v)
                seen.add(v)
        subs = _sub_jaxprs(eqn) if name in _CALLS or name in _LOOPS or name == "cond" else []
        if name in _VIEWS:
            outs = [0] * len(eqn.outvars)
        elif name == "shard_map" and subs:  # the body's shapes are one device's
            outs = [_aval_bytes(v.aval) for v in subs[0].outvars]
        else:
            outs = [_aval_bytes(v.aval) for v in eqn.outvars]
        freed = sum(size.get(v, 0) for v in dying)
        if subs and name == "cond":
            inner = max(
                _peak(j, [_aval_bytes(v.aval) for v in j.invars], [False] * len(j.invars)) for j in subs
            )
            transient = live + max(inner, sum(outs))
        elif subs and name in _LOOPS:
            inner = max(
                _peak(j, [_aval_bytes(v.aval) for v in j.invars], [False] * len(j.invars)) for j in subs
            )
            transient = live + inner + sum(outs)
        elif subs and len(subs[0].invars) == len(eqn.invars):
            body = subs[0]
            body_sizes = [_aval_bytes(v.aval) for v in body.invars]
            inner = _peak(body, body_sizes, [_is_var(v) and v in seen for v in eqn.invars])
            transient = live + inner
        else:  # an opaque primitive (a kernel, a collective): its outputs, some perhaps in place of inputs
            pool = sorted((size.get(v, 0) for v in dying), reverse=True)
            reused = 0
            for o in sorted(outs, reverse=True):
                if o in pool:
                    pool.remove(o)
                    reused += o
            transient = live + sum(outs) - reused
        for v, s in zip(eqn.outvars, outs, strict=True):
            size[v] = s
        kept = sum(s for v, s in zip(eqn.outvars, outs, strict=True) if _is_var(v) and v in last)
        live += kept - freed
        peak = max(peak, transient, live)
    return peak


def estimate_peak_bytes(traced: Any, args: Sequence[Any], donated: Sequence[bool]) -> int:
    """Per-device peak of a traced jitted function (`jit(f).trace(*args)`): its arguments plus the
    temporaries estimated from its jaxpr (module docstring). `donated`: per top-level argument."""
    closed = traced.jaxpr
    leaves, owned = [], []
    for arg, donate in zip(args, donated, strict=True):
        for leaf in jax.tree.leaves(arg):
            leaves.append(per_device_bytes(leaf))
            owned.append(donate)
    jaxpr = closed.jaxpr
    if len(leaves) != len(jaxpr.invars):  # arguments jax dropped or added (none today): count as given
        leaves = [_aval_bytes(v.aval) for v in jaxpr.invars]
        owned = [False] * len(jaxpr.invars)
    return sum(leaves) + _peak(jaxpr, leaves, owned)


def compiled_bytes(compiled: Any) -> int | None:
    """XLA's figure for a compiled step, per device: arguments + outputs - donated aliases + temporaries
    (None where the backend gives no memory analysis)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not implemented on every backend
        return None
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes
    )


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One device's memory for the train step. `total` is the estimate (arguments + estimated
    temporaries) until `compiled` (XLA's figure) is known."""

    capacity: int
    capacity_source: str
    tables: int  # embedding tables + accumulators (offloaded tables: their HBM caches)
    dense: int  # the rest of the train state: dense parameters, optimizer and FP8 state
    batch: int  # the batch (and offloaded tables' slot ids)
    estimate: int  # arguments + temporaries, from the jaxpr
    compiled: int | None = None

    @property
    def temporaries(self) -> int:
        return max(self.estimate - self.tables - self.dense - self.batch, 0)

    @property
    def total(self) -> int:
        return self.compiled if self.compiled is not None else self.estimate

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def line(self) -> str:
        """e.g. "memory per device: tables 26.5 GiB + dense state 1.1 GiB + batch 2.1 MiB + temporaries
        ~12.0 GiB (estimate) = 39.6 GiB of 59.6 GiB (bytes_limit of the NVIDIA H100 80GB HBM3)"."""
        parts = (
            f"tables {size_text(self.tables)} + dense state {size_text(self.dense)} + batch "
            f"{size_text(self.batch)} + temporaries ~{size_text(self.temporaries)}"
        )
        text = f"memory per device: {parts} (estimate) = {size_text(self.estimate)}"
        if self.compiled is not None:
            text += f"; compiled step {size_text(self.compiled)} (XLA)"
        return f"{text} of {size_text(self.capacity)} ({self.capacity_source})"

    def refusal(self) -> str:
        """The one-line error of a step that does not fit, with the ways out."""
        what = "XLA's figure for the compiled step" if self.compiled is not None else "the estimate"
        return (
            f"the train step does not fit one device's memory: {what} is {size_text(self.total)} per device "
            f"(tables {size_text(self.tables)}, dense state {size_text(self.dense)}, batch "
            f"{size_text(self.batch)}, temporaries ~{size_text(self.total - self.tables - self.dense - self.batch)}) "
            f"of {size_text(self.capacity)} ({self.capacity_source}); ways out: fewer tokens per pack "
            '(data.tokens_per_shard), tables in host memory (embeddings.tables.NAME.sharding = "offload", or a '
            "lower embeddings.memory_fraction), more devices (parallel.mesh_shape), more of the GPU for jax "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION), or train.check_memory = false to compile and try anyway"
        )


def plan_step(traced: Any, state: Any, batch: Sequence[Any], capacity: tuple[int, str]) -> StepMemory:
    """The step's memory per device before it compiles: `traced, batch = trainer.trace_step(state, ...)`
    (`batch`: the arguments after the state: the device batch, and slots where tables are offloaded)."""
    tables = per_device_bytes(state.embeddings)
    dense = per_device_bytes(state) - tables
    batch_bytes = per_device_bytes(batch)
    estimate = estimate_peak_bytes(traced, [state, *batch], [True] + [False] * len(batch))
    return StepMemory(capacity[0], capacity[1], tables, dense, batch_bytes, estimate)


def table_budget(memory: StepMemory, fraction: float) -> int:
    """What the tables may use per device so that the step fits: the device's memory less the rest of
    the step (dense state, batch, temporaries), capped at `fraction` of the device's memory."""
    rest = memory.total - memory.tables
    return max(min(int(memory.capacity * fraction), memory.capacity - rest), 0)


def replan_tables(task: Any, budget: int) -> bool:
    """Plans `task.embeddings` again for `budget` bytes per device; True where the new plan keeps fewer
    bytes in device memory (the task then holds it), False where it cannot (no `auto` table left to put in
    host memory, or the tables named in the config alone exceed the budget)."""
    old = task.embeddings
    if old is None:
        return False
    try:
        new = EmbeddingCollection(
            old.tables,
            old.features,
            old.mesh,
            old.batch_axes,
            optimizer=old.optimizer,
            fast_axes=old.plan.fast_axes,
            budget_bytes=budget,
        )
    except ConfigError:
        return False
    if new.plan.bytes_per_device().max() >= old.plan.bytes_per_device().max():
        return False
    task.embeddings = new
    return True


def check(memory: StepMemory) -> None:
    if not memory.fits:
        raise ConfigError(memory.refusal())
