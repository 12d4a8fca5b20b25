"""`OffloadedTable`: an embedding table in host memory with an HBM cache of its hot rows.

The host (numpy, this process) holds the whole `[rows, dim]` table and its row-wise accumulator,
split in contiguous row blocks over the devices like a `row_wise` table. Each device holds a cache of
`cache_rows / devices` slots for its own block; the train state holds the caches (`[cache_rows, dim]`,
sharded by rows), so the step's lookup and sparse update run unchanged on them, with slot ids in
place of row ids (slot `d * C + s`, C slots per device, lives on device d, as row `d * R + r` would).

Before a step (`stage`), the host gives each distinct row of the batch a slot on its owner
(host_cache.py: sampled LFU among the slots the batch does not need), then one jitted exchange per table
reads the evicted slots' values out of the cache and writes the missing rows in. The exchange runs
after the previous step on the device (it takes that step's output), so an evicted row carries every
update; its values reach the host table when the next `stage` (or `flush`) collects them. A row's
live value is thus in exactly one place: the cache while cached, else the host table. Hence training
with `offload` computes what the in-HBM run computes, step for step.

Staging batch t + 1 happens while step t runs (the host dispatches ahead of the device): the host
waits only for the exchange before step t (to collect its evictions), never for step t itself.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from gem_jax.config import ConfigError
from gem_jax.embeddings.host_cache import SlotCache

Cache = dict[str, Array]  # {"table": [cache_rows, dim], "accumulator": [cache_rows]} (no accumulator: SGD)


def host_device() -> jax.Device:
    """The CPU device host tables are computed and restored on (never an accelerator's memory)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError as e:
        raise ConfigError(
            "offloaded embedding tables need jax's CPU backend (JAX_PLATFORMS must include cpu)"
        ) from e


class OffloadedTable:
    """One table's host copy, its devices' slot maps and the device exchange (module docstring)."""

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
        self.table = np.zeros((rows, dim), self.dtype)
        self.accumulator = None if initial_accumulator is None else np.zeros(rows, np.float32)
        self.caches = [SlotCache(self.block, self.slots_per_device) for _ in range(self.devices)]
        self.pending: list[tuple[np.ndarray, Cache]] = []  # (evicted rows [G, K], their values)
        spec = P(self.axes or None)
        self.leading = NamedSharding(mesh, spec)
        cache_specs = {"table": P(self.axes or None, None), "accumulator": spec}
        if self.accumulator is None:
            del cache_specs["accumulator"]
        self.cache_shardings = {k: NamedSharding(mesh, s) for k, s in cache_specs.items()}
        self._exchange = _exchange_fn(mesh, self.axes, self.accumulator is not None, donate=True)
        self._exchange_copy = _exchange_fn(mesh, self.axes, self.accumulator is not None, donate=False)
        self._empty = jax.jit(self._zeros, out_shardings=self.cache_shardings)

    # ------------------------------------------------------------------------- state

    def _zeros(self) -> Cache:
        n = self.devices * self.slots_per_device
        out = {"table": jnp.zeros((n, self.dim), self.dtype)}
        if self.accumulator is not None:
            out["accumulator"] = jnp.zeros((n,), jnp.float32)
        return out

    def load(self, table: Float[np.ndarray, "V E"], accumulator: Float[np.ndarray, " V"] | None) -> Cache:
        """Fills the host table (a checkpoint's or a fresh one); returns an empty device cache."""
        self.table[...] = table
        if self.accumulator is not None:
            self.accumulator[...] = (
                self.initial_accumulator if accumulator is None else np.asarray(accumulator, np.float32)
            )
        return self.reset()

    def reset(self) -> Cache:
        """Empties the slot maps (the host table holds every value); returns an empty device cache."""
        self.caches = [SlotCache(self.block, self.slots_per_device) for _ in range(self.devices)]
        self.pending = []
        return self._empty()

    def _settle(self) -> None:
        """Writes the values of rows evicted by earlier exchanges into the host table."""
        for evicted, values in self.pending:
            keep = evicted >= 0
            self.table[evicted[keep]] = np.asarray(values["table"])[keep]
            if self.accumulator is not None:
                self.accumulator[evicted[keep]] = np.asarray(values["accumulator"])[keep]
        self.pending = []

    def flush(self, cache: Cache) -> None:
        """Writes every cached row back to the host table (the rows stay cached)."""
        self._settle()
        values = {k: np.asarray(v) for k, v in cache.items()}
        for d, slot_cache in enumerate(self.caches):
            slots, rows = slot_cache.cached()
            slots, rows = slots + d * self.slots_per_device, rows + d * self.block
            self.table[rows] = values["table"][slots]
            if self.accumulator is not None:
                self.accumulator[rows] = values["accumulator"][slots]

    def logical(self, cache: Cache) -> dict[str, np.ndarray]:
        """The table and accumulator as checkpoints hold them (copies: training may go on meanwhile)."""
        self.flush(cache)
        out = {"table": self.table.copy()}
        if self.accumulator is not None:
            out["accumulator"] = self.accumulator.copy()
        return out

    # ------------------------------------------------------------------------- staging

    def stage(
        self, cache: Cache, rows: Int[np.ndarray, "..."], *, commit: bool = True
    ) -> tuple[Cache, Int[np.ndarray, "..."], dict[str, float]]:
        """Caches every row in `rows` (table rows, -1: none); returns the cache, the slot of each
        position (-1 where none) and counts. `commit=False` (evaluation) returns a changed copy and
        leaves the cache, the slot maps and the use counts as they were."""
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
        source = np.maximum(fill_rows, 0)  # padding reads row 0 into a slot past the cache: dropped
        values = {"table": self.table[source]}
        if self.accumulator is not None:
            values["accumulator"] = self.accumulator[source]
        exchange = self._exchange if commit else self._exchange_copy
        cache, old = exchange(
            cache, jax.device_put(fill_slots, self.leading), jax.device_put(values, self.leading)
        )
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
    """The jitted exchange (one per mesh, axes and state slots: tables of one shape compile it once)."""
    spec = P(axes or None)
    cache_specs = {"table": P(axes or None, None), "accumulator": spec}
    if not accumulator:
        del cache_specs["accumulator"]
    exchange = jax.shard_map(
        _exchange,
        mesh=mesh,
        in_specs=(cache_specs, spec, spec),
        out_specs=(cache_specs, spec),
        check_vma=False,
    )
    return jax.jit(exchange, donate_argnums=(0,) if donate else ())


def _exchange(cache: Cache, slots: Int[Array, "1 K"], values: dict[str, Array]) -> tuple[Cache, Cache]:
    """One device (inside shard_map): the old values of `slots`, then `values` written into them
    (slots past the cache: padding, read as zeros and dropped)."""
    s = slots[0]
    old = {k: x.at[s].get(mode="fill", fill_value=0)[None] for k, x in cache.items()}
    new = {k: x.at[s].set(values[k][0].astype(x.dtype), mode="drop") for k, x in cache.items()}
    return new, old
