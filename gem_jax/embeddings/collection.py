"""`EmbeddingCollection`: the tables of a model, their sharded state, lookups and sparse updates.

The state is a plain dict (orbax checkpoints it as is): `state[key] = {"table": [rows, dim],
"accumulator": [rows]}` (no accumulator for SGD), one entry per table, except that `table_wise`
tables of one (dim, dtype) share one stacked array (`table_wise_<dim>_<dtype>`) whose contiguous
row blocks are the devices' shards, each holding whole tables. Its shape depends on the device
count; `to_logical` / `from_logical` convert to and from one `[rows, dim]` array per table, whose
shape never does (save that form to restore on another device count or plan).

An `offload` table's entry is its HBM cache (`[cache_rows, dim]`, row blocks per device); the table
itself is host memory in `self.offload[name]` (offload.py). Its features then take slot ids, which
`stage` hands out, in place of raw ids; its logical form comes from, and goes back to, host memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import zlib
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from gem_jax.config import POOLINGS, Config, ConfigError, FeatureConfig, TableConfig
from gem_jax.dtypes import DTYPES
from gem_jax.embeddings import routing
from gem_jax.embeddings.hashing import hash_ids, segment_ids
from gem_jax.embeddings.offload import OffloadedTable
from gem_jax.embeddings.optimizers import RowWiseAdagrad, SparseOptimizer
from gem_jax.embeddings.optimizers import from_config as optimizer_from_config
from gem_jax.embeddings.planner import Plan, device_capacity, device_memory_bytes, plan_tables
from gem_jax.parallel import fast_axes, shard_axes

INIT_BLOCK_ROWS = 1 << 16  # rows drawn from one key (a table's values do not depend on how it is filled)
INIT_CHUNK_BYTES = 1 << 28  # float32 bytes an offloaded table's init draws on the device at a time


def _init_block_rows(rows: int) -> int:
    return min(INIT_BLOCK_ROWS, rows)


def _gather_rows(local: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, slice]]:
    """Every process's rows of each table (`local`: this process's, the same lengths everywhere, as
    every process's part of a batch has the same shapes), in process order, in one all-gather; and
    where this process's lie among them."""
    if jax.process_count() == 1 or not local:
        return local, dict.fromkeys(local, slice(None))

    names = sorted(local)
    sizes = [len(local[t]) for t in names]
    flat = np.concatenate([local[t] for t in names]).astype(np.int32)  # `table_rows` gives int32 rows
    gathered = np.asarray(multihost_utils.process_allgather(flat)).astype(np.int64)  # [processes, sum]
    every, mine, at = {}, {}, 0
    # Row p holds the processes of the p-th `local_device_count` devices of `jax.devices()` (process_allgather).
    groups = np.array(jax.devices(), dtype=object).reshape(jax.process_count(), -1)[:, 0]
    me = [d.process_index for d in groups].index(jax.process_index())
    for t, n in zip(names, sizes, strict=True):
        every[t] = gathered[:, at : at + n].reshape(-1)
        mine[t] = slice(me * n, (me + 1) * n)
        at += n
    return every, mine


class FeatureIds(NamedTuple):
    """One feature's ids on one device. Leading dims (e.g. packs) are kept in the output.

    Pooled features: `values[..., S]` raw ids and `offsets[..., N + 1]` jagged bags (positions past
    offsets[N] are unused capacity). `pooling = "none"`: one output row per value; `offsets`, if
    given, marks positions past offsets[-1] unused (they look up zeros).
    """

    values: Int[Array, "... S"]
    offsets: Int[Array, "... N1"] | None = None


@struct.dataclass
class Residuals:
    """What `apply_gradients` needs from `lookup`: routed ids per state entry, mean-pool scales."""

    routed: dict[str, routing.Routed]
    scales: dict[str, Array]
    features: tuple[str, ...] = struct.field(pytree_node=False, default=())  # looked-up features


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One state entry: a table, or a stack of table_wise tables, and how it lies on the mesh."""

    key: str
    rows: int  # global rows of the array (a stack: devices x block)
    dim: int
    dtype: str
    columns: bool  # column_wise
    row_axes: tuple[str, ...]
    replica_axes: tuple[str, ...]  # axes of size > 1 holding copies whose updates are synced
    column_axes: tuple[str, ...]
    block: int  # rows of one device's block
    bases: dict[str, int]  # table -> its first row in the array
    offload: bool = False  # the array is an offloaded table's cache: ids are slots, not rows


class _Flat(NamedTuple):
    """One feature's ids flattened over its packs (see `EmbeddingCollection._flatten`)."""

    rows: Array  # [S] global row of each position; the entry's row count for none
    bags: Array  # [S] bag of each position, sorted
    num_bags: int
    shape: tuple[int, ...]  # leading dims + bags of the activations
    scale: Array | None  # [packs, N] mean pooling's 1 / length
    starts: Array  # [N] first position of each bag
    ends: Array  # [N] one past its last position
    max_bag: int  # the feature's declared longest bag (1 unpooled; 0 unknown)


class EmbeddingCollection:
    """Tables + features + plan on a mesh; see the package docstring for how a train step uses it."""

    def __init__(
        self,
        tables: Mapping[str, TableConfig],
        features: Mapping[str, FeatureConfig],
        mesh: Mesh,
        batch_axes: tuple[str, ...],
        *,
        optimizer: SparseOptimizer | None = None,
        fast_axes: tuple[str, ...] = (),
        budget_bytes: int | None = None,
        plan: Plan | None = None,
    ):
        self.tables = dict(tables)
        self.features = dict(sorted(features.items()))
        for name, f in self.features.items():
            if f.table not in self.tables:
                raise ConfigError(
                    f"feature {name!r} reads table {f.table!r}, not one of {tuple(self.tables)}"
                )
            if f.pooling not in POOLINGS:
                raise ConfigError(f"feature {name!r}: pooling must be one of {POOLINGS}, got {f.pooling!r}")
        self.mesh = mesh
        self.batch_axes = tuple(batch_axes)
        self.optimizer = optimizer if optimizer is not None else RowWiseAdagrad()
        if plan is None:
            budget = budget_bytes if budget_bytes is not None else device_memory_bytes() // 2
            plan = plan_tables(
                self.tables,
                dict(mesh.shape),
                self.batch_axes,
                fast_axes=fast_axes,
                budget_bytes=budget,
                accumulator=self.optimizer.has_accumulator,
            )
        self.plan = plan
        self.entries = self._entries()
        self._table_entry = {t: e for e in self.entries.values() for t in e.bases}
        self.offload = {
            name: OffloadedTable(
                name, p.rows, p.dim, DTYPES[p.dtype], p.cache_rows, mesh, p.row_axes,
                self.optimizer.initial_accumulator if self.optimizer.has_accumulator else None,
            )
            for name, p in self.plan.placements.items()
            if p.sharding == "offload"
        }  # fmt: skip

    @classmethod
    def from_config(
        cls,
        config: Config,
        mesh: Mesh,
        extra_tables: Mapping[str, TableConfig] | None = None,
        *,
        budget_bytes: int | None = None,
    ) -> EmbeddingCollection:
        """The collection the config describes (`extra_tables`: e.g. a model's data-sized table). The
        tables' budget per device: `budget_bytes`, else `embeddings.memory_fraction` of the device's memory
        (`embeddings.device_memory_gib`, else what the device reports)."""
        e = config.embeddings
        batch_axes = shard_axes(config.parallel)
        fast = e.fast_axes
        if not fast and config.parallel.slow_axes:  # the topology says which axes stay inside a host
            fast = tuple(a for a in fast_axes(config.parallel) if a in batch_axes)
        tables = {**e.resolved_tables(), **(extra_tables or {})}
        if budget_bytes is None:
            budget_bytes = int(device_capacity(e.device_memory_gib)[0] * e.memory_fraction)
        return cls(
            tables,
            e.resolved_features(),
            mesh,
            batch_axes,
            optimizer=optimizer_from_config(e.optimizer, e.adagrad_eps, e.adagrad_initial_accumulator),
            fast_axes=fast,
            budget_bytes=budget_bytes,
        )

    # ------------------------------------------------------------------------- layout

    def _size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def _entries(self) -> dict[str, _Entry]:
        entries: dict[str, _Entry] = {}
        stacks: dict[tuple[int, str], list[str]] = {}
        for name, p in self.plan.placements.items():
            replicas = tuple(a for a in p.replica_axes if self.mesh.shape[a] > 1)
            if p.sharding == "table_wise":
                stacks.setdefault((p.dim, p.dtype), []).append(name)
                continue
            rows = p.cache_rows if p.sharding == "offload" else p.rows
            block = rows // self._size(p.row_axes)
            entries[name] = _Entry(
                name, rows, p.dim, p.dtype, p.sharding == "column_wise", p.row_axes, replicas,
                p.column_axes, block, {name: 0}, p.sharding == "offload",
            )  # fmt: skip
        g = self._size(self.batch_axes)
        for (dim, dtype), names in sorted(stacks.items()):
            key = f"table_wise_{dim}_{dtype}"
            if key in self.plan.placements:
                raise ConfigError(f"table name {key!r} is reserved for the stack of table_wise tables")
            fill = [0] * g
            offsets = {}
            for name in sorted(names):
                owner = self.plan.placements[name].owner
                offsets[name] = (owner, fill[owner])
                fill[owner] += self.plan.placements[name].rows
            block = max(8, -(-max(fill) // 8) * 8)
            bases = {name: owner * block + off for name, (owner, off) in offsets.items()}
            entries[key] = _Entry(key, g * block, dim, dtype, False, self.batch_axes, (), (), block, bases)
        return entries

    def _specs(self, entry: _Entry) -> dict[str, P]:
        if entry.columns:
            specs = {"table": P(None, entry.column_axes), "accumulator": P()}
        else:
            rows = entry.row_axes or None
            specs = {"table": P(rows, None), "accumulator": P(rows)}
        if not self.optimizer.has_accumulator:
            del specs["accumulator"]
        return specs

    def state_specs(self) -> dict[str, dict[str, P]]:
        """PartitionSpecs of the state, for the train step's `shard_map` in_specs / out_specs."""
        return {k: self._specs(e) for k, e in self.entries.items()}

    def state_shardings(self) -> dict[str, dict[str, NamedSharding]]:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs())

    def logical_shardings(self) -> dict[str, dict[str, jax.sharding.Sharding]]:
        """Shardings of the `to_logical` form: the table's own, or row blocks for a stacked table."""
        out = {}
        for name, t in self.tables.items():
            entry = self._table_entry[name]
            if entry.offload:  # restored into host memory (each process its own blocks), never into HBM
                out[name] = dict(self.offload[name].logical_shardings)
                continue
            if entry.key == name:
                specs = self._specs(entry)
            else:
                rows = self.batch_axes if t.rows % self._size(self.batch_axes) == 0 else None
                specs = {"table": P(rows, None), "accumulator": P(rows)}
                if not self.optimizer.has_accumulator:
                    del specs["accumulator"]
            out[name] = {k: NamedSharding(self.mesh, s) for k, s in specs.items()}
        return out

    def logical_shapes(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
        """Shapes and dtypes of the `to_logical` form."""
        out = {}
        for name, t in self.tables.items():
            out[name] = {"table": jax.ShapeDtypeStruct((t.rows, t.dim), DTYPES[t.dtype])}
            if self.optimizer.has_accumulator:
                out[name]["accumulator"] = jax.ShapeDtypeStruct((t.rows,), jnp.float32)
        return out

    # ------------------------------------------------------------------------- state

    def _init_values(self, rng: jax.Array, name: str, first_block: int | Array, blocks: int) -> Array:
        """Rows `[first_block * b, (first_block + blocks) * b)` of table `name`'s initial values, b =
        `_init_block_rows`: each block of rows is drawn from its own key, so any run of blocks (a host
        table filled a chunk at a time, or the whole table at once) gets the same values."""
        t = self.tables[name]
        block = _init_block_rows(t.rows)
        key = jax.random.fold_in(rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
        keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(first_block + jnp.arange(blocks))
        shape = (block, t.dim)
        if t.initializer == "normal":
            draw = lambda k: t.init_scale * jax.random.normal(k, shape, jnp.float32)  # noqa: E731
        elif t.initializer == "uniform":
            draw = lambda k: jax.random.uniform(k, shape, jnp.float32, -t.init_scale, t.init_scale)  # noqa: E731
        elif t.initializer == "zeros":
            draw = lambda k: jnp.zeros(shape, jnp.float32)  # noqa: E731
        else:
            raise ConfigError(f"table {name!r}: unknown initializer {t.initializer!r}")
        return jax.vmap(draw)(keys).reshape(blocks * block, t.dim).astype(DTYPES[t.dtype])

    def _init_table(self, rng: jax.Array, name: str) -> dict[str, Array]:
        t = self.tables[name]
        blocks = -(-t.rows // _init_block_rows(t.rows))
        out = {"table": self._init_values(rng, name, 0, blocks)[: t.rows]}
        if self.optimizer.has_accumulator:
            out["accumulator"] = self.optimizer.init_accumulator(t.rows)
        return out

    def _logical_init(self, rng: jax.Array) -> dict[str, dict[str, Array]]:
        return {name: self._init_table(rng, name) for name in sorted(self.tables) if name not in self.offload}

    def _from_logical(self, logical):
        state = {}
        for key, entry in self.entries.items():
            if entry.offload:
                state[key] = self.offload[key]._zeros()  # filled by `stage`
                continue
            if entry.bases == {key: 0} and key in self.tables:
                state[key] = dict(logical[key])
                continue
            slots = {"table": jnp.zeros((entry.rows, entry.dim), DTYPES[entry.dtype])}
            if self.optimizer.has_accumulator:
                slots["accumulator"] = jnp.zeros((entry.rows,), jnp.float32)
            for name, base in entry.bases.items():
                for slot in slots:
                    slots[slot] = jax.lax.dynamic_update_slice_in_dim(
                        slots[slot], logical[name][slot], base, 0
                    )
            state[key] = slots
        return state

    def _to_logical(self, state):
        out = {}
        for name, t in self.tables.items():
            entry = self._table_entry[name]
            if entry.offload:
                continue
            base = entry.bases[name]
            out[name] = {slot: x[base : base + t.rows] for slot, x in state[entry.key].items()}
        return out

    def init(self, rng: jax.Array, *, host: bool = True) -> dict[str, dict[str, Array]]:
        """Fresh sharded state. A table's values depend only on `rng` and its name, not on the plan.
        Offloaded tables get empty caches; `host=True` also fills their host tables (`init_host`),
        which cannot run under a trace: a jitted caller passes False and calls `init_host` after."""
        fn = jax.jit(
            lambda r: self._from_logical(self._logical_init(r)), out_shardings=self.state_shardings()
        )
        state = fn(rng)
        if host:
            self.init_host(rng)
        return state

    def init_host(self, rng: jax.Array) -> None:
        """The offloaded tables' initial values, drawn a chunk of rows at a time on this process's
        default device (an accelerator draws a 60 GB table in seconds, a host CPU in many minutes) and
        copied into host memory: no device ever holds more than one chunk, and each process draws
        only the rows of its own blocks."""
        for name, table in self.offload.items():
            t = self.tables[name]
            block = _init_block_rows(t.rows)
            per_chunk = max(1, INIT_CHUNK_BYTES // (block * t.dim * 4))
            draw = jax.jit(self._init_values, static_argnums=(1, 3))
            for start, stop in table.own_ranges():  # table rows [start, stop): init blocks [lo, hi)
                lo, hi = start // block, -(-stop // block)
                for first in range(lo, hi, per_chunk):
                    n = min(per_chunk, hi - first)
                    a, b = max(start, first * block), min(stop, (first + n) * block)
                    values = np.asarray(draw(rng, name, first, n))[a - first * block : b - first * block]
                    at = int(table.local(np.array([a]))[0])  # a run of consecutive blocks lies in one piece
                    table.table[at : at + b - a] = values
            if table.accumulator is not None:
                table.accumulator[...] = table.initial_accumulator
            table.reset()

    def _resident(self, tree):
        return {k: v for k, v in tree.items() if k not in self.offload}

    def to_logical(self, state):
        """One `[rows, dim]` table and `[rows]` accumulator per table name (checkpoint form); an
        offloaded table's rows are written back from its cache first and come as arrays in host
        memory (`logical_shardings`: each process holds its own blocks)."""
        shardings = self._resident(self.logical_shardings())
        out = jax.jit(self._to_logical, out_shardings=shardings)(self._resident(state))
        for name, table in self.offload.items():
            out[name] = table.logical(state[name])
        return out

    def from_logical(self, logical):
        """Inverse of `to_logical`, onto this collection's plan (which may differ from the saver's)."""
        resident = self._resident(logical)
        state = jax.jit(self._from_logical, out_shardings=self.state_shardings())(resident)
        for name, table in self.offload.items():
            state[name] = table.load(logical[name])
        return state

    # ------------------------------------------------------------------------- offloaded tables

    def offloaded_features(self) -> tuple[str, ...]:
        """The features whose table is offloaded: `lookup` takes `stage`'s slot ids for them."""
        return tuple(n for n, f in self.features.items() if f.table in self.offload)

    def table_rows(self, name: str, ids: FeatureIds) -> Int[Array, "... S"]:
        """The table row each id position of feature `name` looks up (-1: none), resolved as `lookup`
        resolves raw ids (hashing, range, bags' capacity). The host runs it to know what to stage."""
        t = self.tables[self.features[name].table]
        logical = _Entry(
            name, t.rows, t.dim, t.dtype, False, (), (), (), t.rows, {self.features[name].table: 0}
        )
        rows = self._flatten(name, ids, logical).rows
        return jnp.where(rows < t.rows, rows, -1).reshape(ids.values.shape)

    def stage(
        self, state, rows: dict[str, np.ndarray], *, commit: bool = True
    ) -> tuple[dict, dict[str, np.ndarray], dict[str, float]]:
        """Brings the rows of the next batch's offloaded features into their caches.

        `rows`: feature -> `table_rows` (numpy) of this process's part of the batch (the same shapes
        on every process: in a multi-process run, every process calls `stage` with its own part and
        they gather the global batch's rows, one collective per call). Returns the state (the caches
        donated and replaced; with `commit=False`, for evaluation, changed copies and no bookkeeping),
        feature -> slot ids of this process's positions, to pass to `lookup` as that feature's
        `FeatureIds.values`, and per table the cache hits, misses and bytes moved of the global batch
        (`embeddings/<table>/...`).
        """
        state, slots, stats = dict(state), {}, {}
        work = {}  # table -> the features reading it
        for n in rows:
            if self.features[n].table in self.offload:
                work.setdefault(self.features[n].table, []).append(n)
        local = {
            t: np.concatenate([np.asarray(rows[n]).reshape(-1) for n in names]) for t, names in work.items()
        }
        every, mine = _gather_rows(local)  # table -> the global batch's rows, and this process's part

        def one(table_name: str):
            cache, flat_slots, counts = self.offload[table_name].stage(
                state[table_name], every[table_name], commit=commit
            )
            return cache, flat_slots[mine[table_name]], counts

        # Tables are independent host work (numpy sorts and gathers release the GIL): one thread each.
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(work), os.cpu_count() or 1))) as pool:
            results = dict(zip(work, pool.map(one, work), strict=True))
        for table_name, (cache, flat_slots, counts) in results.items():
            state[table_name] = cache
            start = 0
            for n in work[table_name]:
                size = np.asarray(rows[n]).size
                slots[n] = flat_slots[start : start + size].reshape(np.shape(rows[n]))
                start += size
            stats.update({f"embeddings/{table_name}/{k}": v for k, v in counts.items()})
        return state, slots, stats

    # ------------------------------------------------------------------------- lookup / update
    # Both run INSIDE a `jax.shard_map` over `batch_axes`, on local state blocks and local ids.

    def _flatten(self, name: str, ids: FeatureIds, entry: _Entry) -> _Flat:
        """Raw ids of one feature (any leading pack dims) -> one flat list of rows and bags."""
        f, t = self.features[name], self.tables[self.features[name].table]
        values = ids.values
        lead, s = values.shape[:-1], values.shape[-1]
        packs = math.prod(lead)
        values = values.reshape(packs, s)
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (packs, s))
        scale = None
        if f.pooling == "none":
            n, bags = s, positions
            if ids.offsets is None:
                valid = jnp.ones((packs, s), bool)
            else:
                valid = positions < ids.offsets.reshape(packs, -1)[:, -1:]
            starts, ends = positions, positions + valid
        else:
            if ids.offsets is None:
                raise ValueError(f"feature {name!r} pools bags ({f.pooling}); its FeatureIds need offsets")
            offsets = ids.offsets.reshape(packs, -1)
            n = offsets.shape[-1] - 1
            seg = jax.vmap(segment_ids, in_axes=(0, None))(offsets, s)
            valid = seg < n
            bags = jnp.minimum(seg, n - 1)  # unused capacity pools a zero row into the last bag (keeps order)
            starts, ends = offsets[:, :-1], offsets[:, 1:]
            if f.pooling == "mean":
                scale = 1.0 / jnp.maximum(jnp.diff(offsets, axis=-1), 1).astype(jnp.float32)
        if entry.offload:  # slot ids from `stage`
            valid = valid & (values >= 0) & (values < entry.rows)
            rows = values
        elif t.hashed:
            rows = hash_ids(values, t.rows)
        else:
            valid = valid & (values >= 0) & (values < t.rows)
            rows = values
        rows = jnp.where(valid, entry.bases[f.table] + rows, entry.rows)  # entry.rows: no row
        pack = jnp.arange(packs, dtype=jnp.int32)[:, None]
        return _Flat(
            rows.reshape(-1),
            (bags + pack * n).reshape(-1),
            packs * n,
            (*lead, n),
            scale,
            (starts + pack * s).reshape(-1),
            (ends + pack * s).reshape(-1),
            1 if f.pooling == "none" else f.max_bag_size,
        )

    def lookup(
        self, state, batch: Mapping[str, FeatureIds]
    ) -> tuple[dict[str, Float[Array, "... N E"]], Residuals]:
        """Pooled (or, for `pooling = "none"`, per-id) fp32 activations of every feature in `batch`.

        Call inside `jax.shard_map` over `batch_axes` with `state_specs()`; every device passes its
        own ids (any leading pack dims). Returns the activations and the residuals for
        `apply_gradients`.
        """
        unknown = set(batch) - set(self.features)
        if unknown:
            raise ValueError(f"lookup: unknown features {sorted(unknown)} (known: {list(self.features)})")
        out, routed, scales = {}, {}, {}
        for key, entry in self.entries.items():
            names = [n for n in self.features if n in batch and self.features[n].table in entry.bases]
            if not names:
                continue
            flats = {name: self._flatten(name, batch[name], entry) for name in names}
            shapes, first, position = {}, 0, 0
            rows, bags, starts, ends = [], [], [], []
            for name, fl in flats.items():
                rows.append(fl.rows)
                bags.append(fl.bags + first)
                starts.append(fl.starts + position)
                ends.append(fl.ends + position)
                shapes[name] = (first, fl.num_bags, fl.shape)
                first += fl.num_bags
                position += fl.rows.shape[0]
                if fl.scale is not None:
                    scales[name] = fl.scale
            rows, bags = jnp.concatenate(rows), jnp.concatenate(bags)
            table = state[key]["table"]
            if entry.columns:
                pooled, routed[key] = routing.column_sharded_lookup(
                    table, rows, bags, first, entry.column_axes
                )
            else:
                bound = (
                    0
                    if any(fl.max_bag == 0 for fl in flats.values())
                    else max(fl.max_bag for fl in flats.values())
                )
                spans = (jnp.concatenate(starts), jnp.concatenate(ends)) if bound else None
                pooled, routed[key] = routing.row_sharded_lookup(
                    table, rows, bags, first, entry.row_axes, sorted_bags=True, spans=spans, max_bag=bound
                )
            for name, (first, n, shape) in shapes.items():
                x = pooled[first : first + n].reshape(*shape, entry.dim)
                if name in scales:
                    x = x * scales[name].reshape(shape)[..., None]
                out[name] = x
        return out, Residuals(routed, scales, tuple(n for n in self.features if n in batch))

    def apply_gradients(
        self,
        state,
        residuals: Residuals,
        activation_grads: Mapping[str, Float[Array, "... N E"]],
        learning_rate: Float[Array, ""] | float,
    ):
        """One sparse optimizer step from d(loss)/d(activations) of this device's lookup.

        Call inside the same `jax.shard_map` as `lookup`, with the gradient of the GLOBAL loss w.r.t.
        this device's activations. Only rows some device looked up change; replicas stay identical.
        """
        if set(activation_grads) != set(residuals.features):
            raise ValueError(
                f"apply_gradients: gradients for {sorted(activation_grads)}, but the lookup was of "
                f"{sorted(residuals.features)}"
            )
        new_state = dict(state)
        for key, entry in self.entries.items():
            if key not in residuals.routed:
                continue
            names = [
                n for n in self.features if self.features[n].table in entry.bases and n in activation_grads
            ]
            parts = []
            for name in names:
                g = activation_grads[name].astype(jnp.float32)
                if name in residuals.scales:
                    g = g * residuals.scales[name][..., None]
                parts.append(g.reshape(-1, entry.dim))
            bag_grads = jnp.concatenate(parts)
            routed = residuals.routed[key]
            if entry.columns:
                rows, grads, sq_mean = routing.column_sharded_gradients(
                    routed, bag_grads, entry.block, entry.column_axes
                )
            else:
                rows, grads = routing.row_sharded_gradients(
                    routed, bag_grads, entry.block, entry.row_axes, entry.replica_axes
                )
                sq_mean = jnp.mean(grads * grads, axis=-1)
            table, acc = self.optimizer.update(
                state[key]["table"], state[key].get("accumulator"), rows, grads, sq_mean, learning_rate
            )
            new_state[key] = {"table": table} if acc is None else {"table": table, "accumulator": acc}
        return new_state
