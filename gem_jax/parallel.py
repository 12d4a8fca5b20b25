"""Meshes and shardings: logical axis names -> mesh axes through one rules table.

The mesh follows the network: axes are listed slow (across hosts/slices) to fast (inside a host),
and `jax.make_mesh` lays devices out so that the fast axes stay inside a host. A batch is a stack
of jagged packs whose leading "shard" axis is split over the data-parallel mesh axes; parameters
carry logical names (see `model/layers.param`) that the rules map to mesh axes.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gem_jax.config import ConfigError, ParallelConfig


def make_mesh(config: ParallelConfig, devices: list | None = None) -> Mesh:
    """The device mesh of the config; a -1 in `mesh_shape` takes all remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    shape = list(config.mesh_shape)
    known = math.prod(s for s in shape if s != -1)
    if shape.count(-1) > 1:
        raise ConfigError(f"`parallel.mesh_shape` {tuple(shape)} has more than one -1")
    if -1 in shape:
        if len(devices) % known:
            raise ConfigError(f"`parallel.mesh_shape` {tuple(shape)} does not divide {len(devices)} devices")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) > len(devices):
        raise ConfigError(
            f"`parallel.mesh_shape` {tuple(shape)} needs {math.prod(shape)} devices, "
            f"{len(devices)} are present"
        )
    devices = devices[: math.prod(shape)]  # a mesh may use fewer devices than the machine has
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(tuple(shape), tuple(config.mesh_axes), axis_types=auto, devices=devices)


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


def state_shardings(abstract_params: nnx.State, mesh: Mesh, config: ParallelConfig) -> dict:
    """NamedShardings, as a pure dict like `nnx.to_pure_dict(params)`, from Params' `logical_axes`."""

    def convert(node):
        if isinstance(node, nnx.Variable):
            names = node.get_metadata().get("logical_axes") or (None,) * len(node.get_value().shape)
            return NamedSharding(mesh, logical_spec(tuple(names), config.rules))
        return {k: convert(v) for k, v in node.items()}

    return convert(abstract_params)
