"""The sharding planner: one sharding type per table, from table sizes, the mesh and device memory.

Rules for `sharding = "auto"`, in order (the plan's `why` column names the rule that fired):

1. one device on the batch axes -> `data_parallel` (nothing to split);
2. table + accumulator <= `SMALL_TABLE_BYTES` -> `data_parallel`: every lookup stays local and only
   the touched rows' gradients travel (an all-gather of sparse rows), cheaper than any all-to-all;
3. a slow axis exists (more than one group of fast devices) and the rows divide over the fast group
   and fit its memory -> `two_d`: the id all-to-all stays on the fast axes (NVLink / ICI) and only
   sparse row gradients cross the slow axis;
4. the rows divide over all devices -> `row_wise`;
5. else -> `table_wise` on the least-loaded device (rows that do not divide cannot be split evenly).

When the plan so made needs more than a device's budget, the largest `auto` tables (by bytes per
device) become `offload`, one at a time, until it fits (the `why` column says so): the table and its
accumulator live in host memory, split in row blocks over the devices like `row_wise`, and each
device keeps an HBM cache of its block's hot rows (gem_jax/embeddings/offload.py). A table may also
name `offload`; its cache is `cache_rows` rows over all devices, or `cache_fraction` of its rows.

`column_wise` is never chosen automatically: with our fixed-capacity all-to-all it moves as much as
`row_wise` and adds an all-gather of every device's ids; name it in the config to get it. Explicit
choices are checked (divisibility) and kept. The plan fails, naming the table, when a device would
need more than its budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np

from gem_jax.config import ConfigError, TableConfig
from gem_jax.dtypes import DTYPES, TABLE_DTYPES

SMALL_TABLE_BYTES = 2 << 20
ACCUMULATOR_BYTES_PER_ROW = 4  # row-wise Adagrad: one fp32 per row
DEFAULT_DEVICE_BYTES = 16 << 30  # CPU devices report no memory limit: `embeddings.device_memory_gib` sets one


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one table lives. Row-major device indices over the batch axes."""

    name: str
    rows: int
    dim: int
    dtype: str
    sharding: str  # never "auto"
    why: str
    row_axes: tuple[str, ...]  # mesh axes the rows are split over (contiguous blocks)
    column_axes: tuple[str, ...]  # mesh axes the columns are split over (column_wise)
    replica_axes: tuple[str, ...]  # batch axes holding identical copies (their updates are synced)
    owner: int = -1  # table_wise: the device holding the table
    bytes: int = 0  # table + accumulator, all of it (offload: in host memory)
    cache_rows: int = 0  # offload: rows of the HBM cache over all devices
    devices: int = 1  # devices that hold a part (one replica)
    bytes_per_device: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    placements: dict[str, Placement]
    batch_axes: tuple[str, ...]
    fast_axes: tuple[str, ...]
    axis_sizes: dict[str, int]
    budget_bytes: int  # per device, for the tables

    def format(self) -> str:
        """The plan as a markdown table, one row per table, plus the per-device totals."""
        head = "| table | rows | dim | dtype | bytes | sharding | devices | bytes / device | why |"
        lines = [head, "| --- | ---: | ---: | --- | ---: | --- | --- | ---: | --- |"]
        for p in self.placements.values():
            devices = f"device {p.owner}" if p.sharding == "table_wise" else _devices_text(p, self.axis_sizes)
            lines.append(
                f"| {p.name} | {p.rows:,} | {p.dim} | {p.dtype} | {size_text(p.bytes)} | {p.sharding} | "
                f"{devices} | {size_text(p.bytes_per_device)} | {p.why} |"
            )
        per_device = self.bytes_per_device()
        mesh = " x ".join(f"{a}={self.axis_sizes[a]}" for a in self.batch_axes) or "one device"
        lines.append(
            f"\nmesh {mesh} (fast: {', '.join(self.fast_axes) or '-'}); per device: max "
            f"{size_text(int(per_device.max()))}, min {size_text(int(per_device.min()))} of a "
            f"{size_text(self.budget_bytes)} budget"
        )
        return "\n".join(lines)

    def bytes_per_device(self) -> np.ndarray:
        """Table + accumulator bytes held by each device (row-major over the batch axes)."""
        g = math.prod(self.axis_sizes[a] for a in self.batch_axes)
        out = np.zeros(max(g, 1), np.int64)
        for p in self.placements.values():
            if p.sharding == "table_wise":
                out[p.owner] += p.bytes_per_device
            else:
                out += p.bytes_per_device
        return out


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _devices_text(p: Placement, sizes: dict[str, int]) -> str:
    def axes(names):
        return "x".join(f"{a}({sizes[a]})" for a in names)

    if p.sharding == "data_parallel":
        return f"all {p.devices * math.prod(sizes[a] for a in p.replica_axes)} (copies)"
    if p.sharding == "column_wise":
        return f"{p.devices} (columns over {axes(p.column_axes)})"
    if p.sharding == "two_d":
        return f"{p.devices} (rows over {axes(p.row_axes)}) x {axes(p.replica_axes)} copies"
    if p.sharding == "offload":
        return (
            f"{p.devices} (rows over {axes(p.row_axes)}; cache of {p.cache_rows:,} rows, rest in host memory)"
        )
    return f"{p.devices} (rows over {axes(p.row_axes)})"


def device_memory_bytes(device=None, default: int | None = DEFAULT_DEVICE_BYTES) -> int | None:
    """The memory jax's allocator may use on `device` (GPU/TPU report it: `bytes_limit`), else `default`."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else default


def device_capacity(device_memory_gib: float = 0.0, device=None) -> tuple[int, str]:
    """(bytes one device may use, where the figure comes from): `device_memory_gib` when set (the
    `embeddings.device_memory_gib` key), else the device's own `bytes_limit`, else DEFAULT_DEVICE_BYTES."""
    if device_memory_gib:
        return int(device_memory_gib * (1 << 30)), "embeddings.device_memory_gib"
    device = device or jax.devices()[0]
    reported = device_memory_bytes(device, default=None)
    if reported is None:
        return DEFAULT_DEVICE_BYTES, f"{device.platform} devices report no limit: the default"
    return reported, f"bytes_limit of the {device.device_kind}"


def plan_tables(
    tables: Mapping[str, TableConfig],
    axis_sizes: Mapping[str, int],
    batch_axes: tuple[str, ...],
    *,
    fast_axes: tuple[str, ...] = (),
    budget_bytes: int = DEFAULT_DEVICE_BYTES // 2,
    accumulator: bool = True,
) -> Plan:
    """Chooses a sharding type per table (rules in the module docstring).

    Args:
      tables: table name -> spec; `sharding != "auto"` is kept (after checks).
      axis_sizes: mesh axis name -> size (`dict(mesh.shape)`).
      batch_axes: the data-parallel mesh axes, slow to fast: lookups run under `jax.shard_map` over them.
      fast_axes: the axes inside a host; default: the last batch axis.
      budget_bytes: what tables and accumulators may use per device.
      accumulator: whether the optimizer keeps one fp32 per row (row-wise Adagrad).
    """
    sizes = {a: int(axis_sizes[a]) for a in axis_sizes}
    for a in batch_axes:
        if a not in sizes:
            raise ConfigError(f"embedding plan: batch axis {a!r} is not a mesh axis {tuple(sizes)}")
    fast = tuple(fast_axes) or batch_axes[-1:]
    for a in fast:
        if a not in batch_axes:
            raise ConfigError(f"`embeddings.fast_axes`: {a!r} is not a data-parallel mesh axis {batch_axes}")
    slow = tuple(a for a in batch_axes if a not in fast)
    g = math.prod(sizes[a] for a in batch_axes)
    f = math.prod(sizes[a] for a in fast)
    acc_row = ACCUMULATOR_BYTES_PER_ROW if accumulator else 0
    placements: dict[str, Placement] = {}
    for name, t in tables.items():
        if t.dtype not in TABLE_DTYPES:
            raise ConfigError(
                f"`embeddings.tables.{name}.dtype` must be one of {TABLE_DTYPES}, got {t.dtype!r}"
            )
        total = t.rows * (t.dim * DTYPES[t.dtype].itemsize + acc_row)
        kind, why = t.sharding, "config"
        if kind == "auto":
            kind, why = _auto(t, total, g, f, slow, budget_bytes)
        placements[name] = _place(name, t, kind, why, total, batch_axes, fast, slow, sizes, acc_row)
    placements = _assign_table_wise(placements, g)
    plan = Plan(placements, tuple(batch_axes), fast, sizes, budget_bytes)
    per_device = plan.bytes_per_device()
    while per_device.max() > budget_bytes:  # offload the largest auto tables until the rest fits
        candidates = [
            p for p in placements.values()
            if tables[p.name].sharding == "auto" and p.sharding != "offload" and p.rows % g == 0
        ]  # fmt: skip
        if not candidates:
            break
        p = max(candidates, key=lambda p: (p.bytes_per_device, p.name))
        t = tables[p.name]
        why = (
            f"does not fit: {size_text(int(per_device.max()))} per device over the {size_text(budget_bytes)} budget; "
            "host memory + HBM cache"
        )
        placements[p.name] = _place(
            p.name, t, "offload", why, p.bytes, batch_axes, fast, slow, sizes, acc_row
        )
        placements = _assign_table_wise(placements, g)
        plan = Plan(placements, tuple(batch_axes), fast, sizes, budget_bytes)
        per_device = plan.bytes_per_device()
    if per_device.max() > budget_bytes:
        worst = int(per_device.argmax())
        raise ConfigError(
            f"embedding plan: device {worst} needs {size_text(int(per_device[worst]))} for tables, over its "
            f"{size_text(budget_bytes)} budget (the device's memory x embeddings.memory_fraction):\n{plan.format()}"
        )
    return plan


def _auto(t: TableConfig, total: int, g: int, f: int, slow: tuple[str, ...], budget: int) -> tuple[str, str]:
    if g == 1:
        return "data_parallel", "one device"
    if total <= SMALL_TABLE_BYTES:
        return "data_parallel", f"small (<= {size_text(SMALL_TABLE_BYTES)}): local lookups"
    if slow and f < g and t.rows % f == 0 and total // f <= budget:
        return "two_d", "all-to-all on the fast axes only"
    if t.rows % g == 0:
        return "row_wise", "largest split"
    return "table_wise", f"rows do not divide over {g} devices"


def _place(name, t, kind, why, total, batch_axes, fast, slow, sizes, acc_row) -> Placement:
    g = math.prod(sizes[a] for a in batch_axes)
    f = math.prod(sizes[a] for a in fast)
    common = dict(name=name, rows=t.rows, dim=t.dim, dtype=t.dtype, sharding=kind, why=why, bytes=total)
    if kind == "data_parallel":
        return Placement(
            **common, row_axes=(), column_axes=(), replica_axes=batch_axes, bytes_per_device=total
        )
    if kind == "row_wise":
        _divides(name, "rows", t.rows, g, kind)
        return Placement(
            **common,
            row_axes=batch_axes,
            column_axes=(),
            replica_axes=(),
            devices=g,
            bytes_per_device=total // g,
        )
    if kind == "two_d":
        _divides(name, "rows", t.rows, f, kind)
        return Placement(
            **common, row_axes=fast, column_axes=(), replica_axes=slow, devices=f, bytes_per_device=total // f
        )
    if kind == "column_wise":
        _divides(name, "dim", t.dim, g, kind)
        per = t.rows * (t.dim // g * DTYPES[t.dtype].itemsize + acc_row)  # the accumulator is replicated
        return Placement(
            **common, row_axes=(), column_axes=batch_axes, replica_axes=(), devices=g, bytes_per_device=per
        )
    if kind == "table_wise":
        return Placement(
            **common, row_axes=batch_axes, column_axes=(), replica_axes=(), devices=1, bytes_per_device=total
        )
    if kind == "offload":
        _divides(name, "rows", t.rows, g, kind)
        cache = cache_rows(name, t, g)
        return Placement(
            **common,
            row_axes=batch_axes,
            column_axes=(),
            replica_axes=(),
            devices=g,
            cache_rows=cache,
            bytes_per_device=total // t.rows * cache // g,
        )
    raise ConfigError(f"`embeddings.tables.{name}.sharding`: unknown sharding type {kind!r}")


def cache_rows(name: str, t: TableConfig, devices: int) -> int:
    """Rows of an offloaded table's HBM cache over all `devices` (each caches its block's rows)."""
    key = f"`embeddings.tables.{name}"
    if t.cache_rows:
        if t.cache_rows % devices or t.cache_rows > t.rows:
            raise ConfigError(
                f"{key}.cache_rows` = {t.cache_rows} must be a multiple of the {devices} devices the cache "
                f"is split over and at most the table's {t.rows} rows"
            )
        return t.cache_rows
    per_device = max(1, math.ceil(t.rows * t.cache_fraction / devices))
    return min(per_device, t.rows // devices) * devices


def _divides(name: str, what: str, n: int, parts: int, kind: str) -> None:
    if n % parts:
        raise ConfigError(
            f"`embeddings.tables.{name}.sharding` = {kind!r} needs its {what} ({n}) divisible by the "
            f"{parts} devices it is split over; round {what} up or pick another sharding type"
        )


def _assign_table_wise(placements: dict[str, Placement], g: int) -> dict[str, Placement]:
    """Greedy bin packing of the table_wise tables, largest first, onto the least-loaded device."""
    load = np.zeros(g, np.int64)
    for p in placements.values():
        if p.sharding != "table_wise":
            load += p.bytes_per_device
    out = dict(placements)
    for p in sorted(
        (p for p in placements.values() if p.sharding == "table_wise"), key=lambda p: (-p.bytes, p.name)
    ):
        owner = int(load.argmin())
        load[owner] += p.bytes
        out[p.name] = dataclasses.replace(p, owner=owner)
    return out
