"""Meshes and shardings: the mesh follows the network; logical axis names -> mesh axes by one rules table.

Topology (`[parallel]`): `mesh_axes` are listed slow to fast; the leading `slow_axes` cross hosts or
slices (DCN, InfiniBand) and the rest stay inside one host or slice (NVLink, ICI). On several hosts
the mesh comes from `mesh_utils.create_hybrid_device_mesh`: every fast-axis row of the mesh is the
devices of one host (a slice where jax reports `slice_index`, else a process), so collectives over
fast axes never leave a host, and hosts are ordered by process (slice) index. On one host it comes
from `mesh_utils.create_device_mesh` (slow axes are then contiguous groups of devices, which is the
same layout the hybrid mesh gives). `describe_mesh` prints the chosen device order at start.

A batch is a stack of jagged packs whose leading "shard" axis is split over the data-parallel mesh
axes; process p feeds the contiguous block of packs its devices hold (`check_process_shards`).
Parameters carry logical names (`param` tags them, `state_shardings` reads them) that the rules map to
mesh axes.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gem_jax.config import ConfigError, ParallelConfig


@dataclasses.dataclass(frozen=True)
class Topology:
    """The resolved mesh layout: axis sizes split into slow (across hosts) and fast (inside one)."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]  # -1 resolved
    num_slow: int  # the first `num_slow` axes are slow
    hosts: int  # hosts (slices / processes) that hold the mesh's devices
    devices_per_host: int

    @property
    def slow_shape(self) -> tuple[int, ...]:
        return self.shape[: self.num_slow]

    @property
    def fast_shape(self) -> tuple[int, ...]:
        return self.shape[self.num_slow :]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def resolve_topology(config: ParallelConfig, num_devices: int, hosts: int, multi_process: bool) -> Topology:
    """Checks the config's shape against the machine and resolves its -1; a misfit is a ConfigError.

    Args:
      num_devices: devices of all processes.
      hosts: how many hosts (slices, or processes where jax reports no slices) hold them, evenly.
      multi_process: with several processes every device must be in the mesh (each process feeds
        its own devices); a single process may use the first devices only.
    """
    shape = list(config.mesh_shape)
    axes = tuple(config.mesh_axes)
    if len(shape) != len(axes):
        raise ConfigError(
            f"`parallel.mesh_axes` {axes} and `parallel.mesh_shape` {tuple(shape)} differ in length"
        )
    if shape.count(-1) > 1:
        raise ConfigError(f"`parallel.mesh_shape` {tuple(shape)} has more than one -1")
    num_slow = len(config.slow_axes)
    if tuple(config.slow_axes) != axes[:num_slow]:
        raise ConfigError(f"`parallel.slow_axes` {config.slow_axes} must be the leading axes of {axes}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ConfigError(f"`parallel.mesh_shape` {tuple(shape)} does not divide {num_devices} devices")
        shape[shape.index(-1)] = num_devices // known
    need = math.prod(shape)
    if need > num_devices or (multi_process and need != num_devices):
        raise ConfigError(
            f"`parallel.mesh_shape` {tuple(shape)} needs {need} devices, {num_devices} are present"
            + (" (with several processes the mesh must use every device)" if multi_process else "")
        )
    per_host = num_devices // hosts
    topology = Topology(axes, tuple(shape), num_slow, hosts, per_host)
    if hosts > 1:
        named = dict(zip(axes, shape, strict=True))
        fast = {a: n for a, n in named.items() if a not in config.slow_axes}
        slow = {a: n for a, n in named.items() if a in config.slow_axes}
        if math.prod(fast.values()) != per_host:
            raise ConfigError(
                f"`parallel.mesh_shape`: the fast axes {fast} hold {math.prod(fast.values())} devices, but a "
                f"host holds {per_host} ({hosts} hosts): the fast axes must be exactly one host's devices; "
                "name the axes that cross hosts in `parallel.slow_axes`"
            )
        if math.prod(slow.values()) != hosts:
            raise ConfigError(
                f"`parallel.slow_axes` {slow or '()'} span {math.prod(slow.values())} hosts, but the mesh "
                f"runs on {hosts}"
            )
    return topology


def host_groups(devices: list) -> tuple[str, list[list]]:
    """Devices grouped by the unit of the slow network, in index order, and that unit's attribute.

    TPU: slices (`slice_index`; one slice is one ICI domain, whatever its hosts). GPU and CPU:
    processes, unless the processes report several `slice_index` values (set with
    `JAX_PARTITION_INDEX`, e.g. the node of each one-GPU process under SLURM).
    """
    slices = [getattr(d, "slice_index", None) for d in devices]
    spread = None not in slices and len(set(slices)) > 1
    attr = "slice_index" if devices[0].platform == "tpu" or spread else "process_index"
    groups: dict = collections.defaultdict(list)
    for d in devices:
        groups[getattr(d, attr, 0)].append(d)
    return attr, [groups[k] for k in sorted(groups)]


def make_mesh(config: ParallelConfig, devices: list | None = None) -> Mesh:
    """The device mesh of the config (see the module docstring); misfits are ConfigErrors."""
    array = device_array(config, list(devices if devices is not None else jax.devices()))
    auto = (jax.sharding.AxisType.Auto,) * array.ndim
    mesh = Mesh(array, tuple(config.mesh_axes), axis_types=auto)
    check_process_shards(array, config)
    return mesh


def device_array(config: ParallelConfig, devices: list) -> np.ndarray:
    """The devices in mesh order (an array of the mesh's shape)."""
    attr, groups = host_groups(devices)
    sizes = {len(g) for g in groups}
    if len(sizes) > 1:
        raise ConfigError(f"hosts hold different numbers of devices {sorted(sizes)}: no regular mesh fits")
    multi_process = len({d.process_index for d in devices}) > 1
    topology = resolve_topology(config, len(devices), len(groups), multi_process)
    if topology.hosts > 1:
        return mesh_utils.create_hybrid_device_mesh(
            (1,) * topology.num_slow + topology.fast_shape,
            topology.slow_shape + (1,) * (len(topology.shape) - topology.num_slow),
            devices,
            process_is_granule=attr == "process_index",
        )
    return mesh_utils.create_device_mesh(topology.shape, devices[: topology.size])


def describe_mesh(mesh: Mesh, config: ParallelConfig) -> str:
    """The mesh's axes (slow/fast) and device order, one line per host-sized row, for the log."""
    axes = " x ".join(
        f"{a}={n} ({'slow' if a in config.slow_axes else 'fast'})" for a, n in mesh.shape.items()
    )
    processes = len({d.process_index for d in mesh.devices.flat})
    lines = [f"mesh {axes}: {mesh.size} devices of {processes} process(es), device ids in mesh order:"]
    num_slow = len(config.slow_axes)
    slow_shape = mesh.devices.shape[:num_slow]
    rows = mesh.devices.reshape(math.prod(slow_shape), -1)
    for i, row in enumerate(rows):
        where = ",".join(
            f"{a}={j}" for a, j in zip(config.slow_axes, np.unravel_index(i, slow_shape), strict=True)
        )
        procs = sorted({d.process_index for d in row})
        ids = " ".join(str(d.id) for d in row)
        lines.append(f"  {where + ': ' if where else ''}[{ids}] (process {','.join(map(str, procs))})")
    return "\n".join(lines)


def fast_axes(config: ParallelConfig) -> tuple[str, ...]:
    """The mesh axes inside one host or slice (all axes after `slow_axes`)."""
    return tuple(config.mesh_axes[len(config.slow_axes) :])


def logical_spec(names: tuple[str | None, ...], rules: dict[str, tuple[str, ...]]) -> P:
    """PartitionSpec for logical axis names; a mesh axis is used at most once (later dims replicate)."""
    used: set[str] = set()
    spec = []
    for name in names:
        axes = tuple(a for a in rules.get(name, ()) if a not in used) if name else ()
        used.update(axes)
        spec.append(axes if len(axes) > 1 else (axes[0] if axes else None))
    return P(*spec)


def shard_axes(config: ParallelConfig) -> tuple[str, ...]:
    """The mesh axes the batch's leading shard axis is split over (data parallelism)."""
    return tuple(config.rules.get("shard", ()))


def num_batch_shards(mesh: Mesh, config: ParallelConfig) -> int:
    return math.prod(mesh.shape[a] for a in shard_axes(config))


def batch_sharding(mesh: Mesh, config: ParallelConfig) -> NamedSharding:
    axes = shard_axes(config)
    return NamedSharding(mesh, P(axes if axes else None))


def check_process_shards(devices: np.ndarray, config: ParallelConfig) -> None:
    """Process p must hold the packs [p * L, (p + 1) * L) of a batch (the tasks' data split, L packs
    per process); a rules table that interleaves processes along the shard axis is a ConfigError.

    Args:
      devices: the mesh's devices in mesh order (`Mesh.devices`).
    """
    processes = sorted({d.process_index for d in devices.flat})
    if len(processes) == 1:
        return
    axes = shard_axes(config)
    position = {a: i for i, a in enumerate(config.mesh_axes)}
    sizes = [devices.shape[position[a]] for a in axes]
    shards = math.prod(sizes)
    if shards % len(processes):
        raise ConfigError(
            f"`parallel.rules.shard` {axes}: {shards} batch shards do not split over {len(processes)} processes"
        )
    local = shards // len(processes)
    owned: dict[int, set[int]] = collections.defaultdict(set)
    for index in np.ndindex(devices.shape):
        shard = int(np.ravel_multi_index([index[position[a]] for a in axes], sizes)) if axes else 0
        owned[devices[index].process_index].add(shard)
    for p in processes:
        if owned[p] != set(range(p * local, (p + 1) * local)):
            raise ConfigError(
                f"`parallel.rules.shard` {axes}: process {p} holds batch shards {sorted(owned[p])}, not "
                f"the block {p * local}..{(p + 1) * local - 1}; list the slow axes first in the rule"
            )


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype) -> nnx.Param:
    """A parameter tagged with logical axis names (mapped to mesh axes by `state_shardings`).

    Here rather than in the model's layers so that the embeddings' dense table, a floor below the
    model, tags its rows the same way.
    """
    assert len(axes) == len(shape), (axes, shape)
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


def state_shardings(abstract_params: nnx.State, mesh: Mesh, config: ParallelConfig) -> dict:
    """NamedShardings, as a pure dict like `nnx.to_pure_dict(params)`, from Params' `logical_axes`."""

    def convert(node):
        if isinstance(node, nnx.Variable):
            names = node.get_metadata().get("logical_axes") or (None,) * len(node.get_value().shape)
            return NamedSharding(mesh, logical_spec(tuple(names), config.rules))
        return {k: convert(v) for k, v in node.items()}

    return convert(abstract_params)
