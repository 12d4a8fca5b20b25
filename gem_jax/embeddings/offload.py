"""`OffloadedTable`: an embedding table in host memory with an HBM cache of its hot rows.

The table and its row-wise accumulator are split in contiguous row blocks over the devices like a
`row_wise` table (block d: rows `[d * R, (d + 1) * R)`, device d of the mesh's row axes), and each
process holds in host memory (numpy) only the blocks of its own devices (all of them in a
one-process run). Each device holds a cache of `cache_rows / devices` slots for its own block; the
train state holds the caches (`[cache_rows, dim]`, sharded by rows), so the step's lookup and sparse
update run unchanged on them, with slot ids in place of row ids (slot `d * C + s`, C slots per
device, lives on device d, as row `d * R + r` would).

Before a step (`stage`), the host gives each distinct row of the batch a slot on its owner
(host_cache.py: sampled LFU among the slots the batch does not need), then one jitted exchange per table
reads the evicted slots' values out of the cache and writes the missing rows in. The exchange runs
after the previous step on the device (it takes that step's output), so an evicted row carries every
update; its values reach the host table when the next `stage` (or `flush`) collects them. A row's
live value is thus in exactly one place: the cache while cached, else the host table. Hence training
with `offload` computes what the in-HBM run computes, step for step.

Several processes: a batch's ids on one process may live on another's devices (the lookup routes
them to their owners), so every process keeps the slot maps of EVERY device (8 bytes per row of the
table) and runs the same bookkeeping on the same input: the rows of the global batch, which `stage`
takes already gathered from every process (collection.py). The maps are deterministic (each
SlotCache samples its evictions from its own seeded generator), so they agree everywhere, and every
process knows the slot of each of its ids. Values move only between a process's host blocks and its
own devices' caches: the exchange's inputs are built from each process's own blocks, and each
process collects the evicted values of its own devices alone.

The logical form (checkpoints) is one `[rows, dim]` array sharded by rows like the caches' blocks,
in the devices' host memory (`pinned_host`): each process writes and restores only its own blocks,
and no device memory ever holds them.

Staging batch t + 1 happens while step t runs (the host dispatches ahead of the device): the host
waits only for the exchange before step t (to collect its evictions), never for step t itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from gem_jax.config import ConfigError
from gem_jax.embeddings.host_cache import SlotCache

Cache = dict[str, Array]  # {"table": [cache_rows, dim], "accumulator": [cache_rows]} (no accumulator: SGD)
HOST_MEMORY = "pinned_host"  # the memory kind of the logical form's shards (host memory of each device)


def host_device() -> jax.Device:
    """This process's CPU device, which computes the rows a batch stages (never an accelerator's
    memory)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError as e:
        raise ConfigError(
            "offloaded embedding tables need jax's CPU backend (JAX_PLATFORMS must include cpu)"
        ) from e


def host_memory_kind(mesh: Mesh) -> str | None:
    """`pinned_host` where the mesh's devices have it (GPUs, TPUs and CPUs do), else None (their own
    memory)."""
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return HOST_MEMORY if HOST_MEMORY in kinds else None


def _start(index: tuple[slice, ...]) -> int:
    return index[0].start or 0


class OffloadedTable:
    """One table's host blocks, every device's slot maps and the device exchange (module docstring)."""

    def __init__(
        self,
        name: str,
        rows: int,
        dim: int,
        dtype: np.dtype,
        cache_rows: int,
        mesh: Mesh,
        axes: tuple[str, ...],
        initial_accumulator: float | None,
    ):
        self.name, self.rows, self.dim, self.dtype = name, rows, dim, np.dtype(dtype)
        self.mesh, self.axes = mesh, tuple(axes)
        self.devices = math.prod(mesh.shape[a] for a in self.axes)
        self.block = rows // self.devices
        self.slots_per_device = cache_rows // self.devices
        self.initial_accumulator = initial_accumulator
        self.row_bytes = dim * self.dtype.itemsize + (4 if initial_accumulator is not None else 0)
        spec = P(self.axes or None)
        self.leading = NamedSharding(mesh, spec)  # [devices, ...]: block d on device d (and its replicas)
        # The blocks of this process's devices, and where each lies in host memory (-1: another's).
        self.own = np.array(
            sorted(
                {_start(i) for i in self.leading.addressable_devices_indices_map((self.devices,)).values()}
            ),
            np.int64,
        )
        self.local_block = np.full(self.devices, -1, np.int64)
        self.local_block[self.own] = np.arange(len(self.own))
        self.table = np.zeros((len(self.own) * self.block, dim), self.dtype)
        self.accumulator = (
            None if initial_accumulator is None else np.zeros(len(self.own) * self.block, np.float32)
        )
        self.caches = [SlotCache(self.block, self.slots_per_device) for _ in range(self.devices)]
        self.pending: list[tuple[np.ndarray, Cache]] = []  # (evicted rows [G, K], their values)
        cache_specs = {"table": P(self.axes or None, None), "accumulator": spec}
        if self.accumulator is None:
            del cache_specs["accumulator"]
        self.cache_shardings = {k: NamedSharding(mesh, s) for k, s in cache_specs.items()}
        memory = host_memory_kind(mesh)
        self.logical_shardings = {
            k: NamedSharding(mesh, s, memory_kind=memory) for k, s in cache_specs.items()
        }
        self._exchange = _exchange_fn(mesh, self.axes, self.accumulator is not None, donate=True)
        self._exchange_copy = _exchange_fn(mesh, self.axes, self.accumulator is not None, donate=False)
        self._empty = jax.jit(self._zeros, out_shardings=self.cache_shardings)

    # ------------------------------------------------------------------------- host blocks

    def local(self, rows: Int[np.ndarray, "..."]) -> Int[np.ndarray, "..."]:
        """Where table rows of this process's blocks lie in its host arrays."""
        return self.local_block[rows // self.block] * self.block + rows % self.block

    def own_ranges(self) -> list[tuple[int, int]]:
        """The table rows this process holds, as [start, stop) runs of consecutive blocks."""
        runs: list[tuple[int, int]] = []
        for d in self.own.tolist():
            start, stop = d * self.block, (d + 1) * self.block
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], stop)
            else:
                runs.append((start, stop))
        return runs

    # ------------------------------------------------------------------------- state

    def _zeros(self) -> Cache:
        n = self.devices * self.slots_per_device
        out = {"table": jnp.zeros((n, self.dim), self.dtype)}
        if self.accumulator is not None:
            out["accumulator"] = jnp.zeros((n,), jnp.float32)
        return out

    def _slots(self) -> dict[str, np.ndarray]:
        out = {"table": self.table}
        if self.accumulator is not None:
            out["accumulator"] = self.accumulator
        return out

    def load(self, logical: dict) -> Cache:
        """Fills this process's host blocks from a logical form (a checkpoint's: global arrays, of which
        it reads only the shards of its own devices; or numpy arrays of the whole table); returns an
        empty device cache. No accumulator saved (an SGD run's): the initial one."""
        for slot, host in self._slots().items():
            if slot not in logical:
                host[...] = self.initial_accumulator
                continue
            x = logical[slot]
            if isinstance(x, jax.Array):  # shard by shard: never the whole array in one place
                pieces = {_start(s.index): s.data for s in x.addressable_shards}
            else:
                pieces = {0: x}
            done = np.zeros(len(self.own), bool)
            for start, data in sorted(pieces.items(), key=lambda kv: kv[0]):
                stop = start + data.shape[0]
                wanted = [
                    i
                    for i, d in enumerate(self.own.tolist())
                    if not done[i] and start <= d * self.block and (d + 1) * self.block <= stop
                ]
                if not wanted:
                    continue
                data = np.asarray(data)
                for i in wanted:  # every own block the piece covers
                    first = self.own[i] * self.block - start
                    host[i * self.block : (i + 1) * self.block] = data[first : first + self.block]
                    done[i] = True
            if not done.all():
                raise ValueError(
                    f"embedding table {self.name!r} (offload): the restored {slot} holds no rows of "
                    f"blocks {self.own[~done].tolist()} on this process"
                )
        return self.reset()

    def reset(self) -> Cache:
        """Empties the slot maps (the host table holds every value); returns an empty device cache."""
        self.caches = [SlotCache(self.block, self.slots_per_device) for _ in range(self.devices)]
        self.pending = []
        return self._empty()

    def _own_shards(self, x: Array, per_device: int) -> list[tuple[int, Array]]:
        """(block, shard) of each of this process's blocks in `x` (split in `per_device` rows per
        block), a replicated block once."""
        out = {}
        for s in x.addressable_shards:
            out.setdefault(_start(s.index) // per_device, s.data)
        return sorted(out.items(), key=lambda kv: kv[0])

    def _settle(self) -> None:
        """Writes the values of rows evicted by earlier exchanges into the host table."""
        for evicted, values in self.pending:
            for slot, host in self._slots().items():
                for d, data in self._own_shards(values[slot], 1):
                    keep = evicted[d] >= 0
                    host[self.local(evicted[d][keep])] = np.asarray(data)[0][keep]
        self.pending = []

    def flush(self, cache: Cache) -> None:
        """Writes every cached row of this process's devices back to the host table (the rows stay
        cached)."""
        self._settle()
        for slot, host in self._slots().items():
            for d, data in self._own_shards(cache[slot], self.slots_per_device):
                slots, rows = self.caches[d].cached()
                host[self.local(rows + d * self.block)] = np.asarray(data)[slots]

    def logical(self, cache: Cache) -> dict[str, Array]:
        """The table and accumulator as checkpoints hold them: global arrays in host memory
        (`logical_shardings`), each process's shards copied from its host blocks (copies: training may
        go on meanwhile)."""
        self.flush(cache)
        out = {}
        for slot, host in self._slots().items():

            def piece(index, host=host):  # a copy: a device may alias, or read later, what it is given
                first = self.local_block[_start(index) // self.block] * self.block
                return host[first : first + self.block].copy()

            sharding = self.logical_shardings[slot]
            out[slot] = jax.make_array_from_callback((self.rows, *host.shape[1:]), sharding, piece)
        return out

    # ------------------------------------------------------------------------- staging

    def stage(
        self, cache: Cache, rows: Int[np.ndarray, "..."], *, commit: bool = True
    ) -> tuple[Cache, Int[np.ndarray, "..."], dict[str, float]]:
        """Caches every row in `rows` (table rows of the GLOBAL batch, every process's; -1: none);
        returns the cache, the slot of each position (-1 where none) and counts. `commit=False`
        (evaluation) returns a changed copy and leaves the cache, the slot maps and the use counts as
        they were."""
        self._settle()
        valid = rows >= 0
        unique, inverse, counts = np.unique(rows[valid], return_inverse=True, return_counts=True)
        owner = unique // self.block
        unique_slots = np.empty(len(unique), np.int64)
        placed = []
        for d in range(self.devices):
            mine = owner == d
            try:
                p = self.caches[d].place(unique[mine] - d * self.block, counts[mine], commit=commit)
            except ValueError as e:
                raise ValueError(
                    f"embedding table {self.name!r} (offload): {e} of device {d}'s cache; raise "
                    f"`embeddings.tables.{self.name}.cache_rows` (or cache_fraction)"
                ) from None
            unique_slots[mine] = p.slots + d * self.slots_per_device
            placed.append(p)
        width = _bucket(max(len(p.fill_slots) for p in placed))
        fill_slots = np.full((self.devices, width), self.slots_per_device, np.int32)
        fill_rows = np.full((self.devices, width), -1, np.int64)
        evicted = np.full((self.devices, width), -1, np.int64)
        for d, p in enumerate(placed):
            m = len(p.fill_slots)
            fill_slots[d, :m] = p.fill_slots
            fill_rows[d, :m] = p.fill_rows + d * self.block
            evicted[d, :m] = np.where(p.evicted_rows >= 0, p.evicted_rows + d * self.block, -1)
        filled = fill_rows >= 0

        def fills(index, host):  # device d's new rows, from this process's block d
            d = _start(index)
            # padding reads the block's first row into a slot past the cache: dropped
            source = self.local(np.where(filled[d], fill_rows[d], d * self.block))
            return host[source][None]

        values = {
            slot: jax.make_array_from_callback(
                (self.devices, width, *host.shape[1:]), self.leading, functools.partial(fills, host=host)
            )
            for slot, host in self._slots().items()
        }
        slot_array = jax.make_array_from_callback(fill_slots.shape, self.leading, lambda i: fill_slots[i])
        exchange = self._exchange if commit else self._exchange_copy
        cache, old = exchange(cache, slot_array, values)
        misses = int(filled.sum())
        if commit:
            self.pending.append((evicted, old))
        slots = np.full(rows.shape, -1, np.int32)
        slots[valid] = unique_slots[inverse.reshape(-1)]
        stats = {
            "cache_hits": float(len(unique) - misses),
            "cache_misses": float(misses),
            "host_to_device_bytes": float(misses * self.row_bytes),
            "device_to_host_bytes": float((evicted >= 0).sum() * self.row_bytes),
        }
        return cache, slots, stats


def _bucket(n: int) -> int:
    """Fill widths rounded up to a power of two (>= 8): few distinct shapes, few compilations."""
    return max(8, 1 << max(n - 1, 0).bit_length())


@functools.cache
def _exchange_fn(mesh: Mesh, axes: tuple[str, ...], accumulator: bool, donate: bool):
    """The exchange (one per mesh, axes and state slots: tables of one shape compile it once): the old
    values of the slots read by one program, then the new ones written by a second (donated: in place).
    One program doing both makes XLA copy the whole cache to keep the read's operand alive (a cache-sized
    temporary: 6 GiB for a 6 GiB cache on CPU, an out-of-memory of 24 GiB on the H200), so two it is."""
    spec = P(axes or None)
    cache_specs = {"table": P(axes or None, None), "accumulator": spec}
    if not accumulator:
        del cache_specs["accumulator"]
    read = jax.jit(
        jax.shard_map(_read_slots, mesh=mesh, in_specs=(cache_specs, spec), out_specs=spec, check_vma=False)
    )
    write = jax.jit(
        jax.shard_map(
            _write_slots,
            mesh=mesh,
            in_specs=(cache_specs, spec, spec),
            out_specs=cache_specs,
            check_vma=False,
        ),
        donate_argnums=(0,) if donate else (),
    )

    return _Exchange(read, write)


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """The two jitted programs of one exchange; called, the old values of `slots` and the new cache."""

    read: Callable
    write: Callable

    def __call__(
        self, cache: Cache, slots: Int[Array, "G K"], values: dict[str, Array]
    ) -> tuple[Cache, Cache]:
        old = self.read(cache, slots)  # dispatched first: the donated write waits for it
        return self.write(cache, slots, values), old


def _read_slots(cache: Cache, slots: Int[Array, "1 K"]) -> Cache:
    """One device (inside shard_map): the values of `slots` (slots past the cache: padding, zeros)."""
    return {k: x.at[slots[0]].get(mode="fill", fill_value=0)[None] for k, x in cache.items()}


def _write_slots(cache: Cache, slots: Int[Array, "1 K"], values: dict[str, Array]) -> Cache:
    """One device (inside shard_map): `values` written into `slots` (slots past the cache: dropped)."""
    return {k: x.at[slots[0]].set(values[k][0].astype(x.dtype), mode="drop") for k, x in cache.items()}
