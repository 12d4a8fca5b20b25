"""The mesh follows the network: slow axes across hosts, fast axes inside one; misfits are config
errors naming the key; the device order is printed; each process feeds a contiguous block of packs."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from gem_jax import distributed
from gem_jax.config import ConfigError, load_config
from gem_jax.parallel import (
    check_process_shards,
    describe_mesh,
    device_array,
    fast_axes,
    host_groups,
    make_mesh,
)

TWO_LEVEL = [
    'parallel.mesh_axes=["dcn", "data"]',
    "parallel.mesh_shape=[-1, 4]",
    'parallel.slow_axes=["dcn"]',
    'parallel.rules={shard=["dcn", "data"]}',
]


def _parallel(*overrides: str):
    return load_config(None, list(overrides)).parallel


def _hosts(processes: int, per_host: int, platform: str = "gpu") -> list:
    """Fake devices of several processes, listed out of order (as no launcher promises an order)."""
    devices = [
        SimpleNamespace(id=100 * p + i, process_index=p, platform=platform, device_kind="fake")
        for p in range(processes)
        for i in range(per_host)
    ]
    return devices[::-1]


def test_fast_axes_stay_inside_a_host():
    config = _parallel(*TWO_LEVEL)
    array = device_array(config, _hosts(2, 4))
    assert array.shape == (2, 4)
    for row, process in zip(array, (0, 1)):
        assert {d.process_index for d in row} == {process}  # a fast-axis row is one host
    assert sorted(d.id for d in array[1]) == [100, 101, 102, 103]
    assert fast_axes(config) == ("data",)
    check_process_shards(array, config)  # process p holds batch shards 4p..4p+3


def test_four_hosts_two_slow_axes():
    config = _parallel(
        'parallel.mesh_axes=["replica", "dcn", "data"]',
        "parallel.mesh_shape=[2, 2, 2]",
        'parallel.slow_axes=["replica", "dcn"]',
        'parallel.rules={shard=["replica", "dcn", "data"]}',
    )
    array = device_array(config, _hosts(4, 2))
    assert [[{d.process_index for d in row} for row in block] for block in array] == [[{0}, {1}], [{2}, {3}]]


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        # All axes fast on 2 hosts: the fast axes would be 8 devices, a host has 4.
        (["parallel.mesh_shape=[8]"], "parallel.mesh_shape", ["fast axes", "a host holds 4", "slow_axes"]),
        ([*TWO_LEVEL, "parallel.mesh_shape=[1, 8]"], "parallel.mesh_shape", ["fast axes", "8 devices"]),
        ([*TWO_LEVEL, "parallel.mesh_shape=[4, 2]"], "parallel.mesh_shape", ["a host holds 4"]),
        ([*TWO_LEVEL, "parallel.mesh_shape=[2, 2]"], "parallel.mesh_shape", ["every device"]),
        ([*TWO_LEVEL, "parallel.mesh_shape=[4, 4]"], "parallel.mesh_shape", ["needs 16 devices, 8"]),
        ([*TWO_LEVEL, "parallel.mesh_shape=[-1, 3]"], "parallel.mesh_shape", ["does not divide"]),
        # The batch interleaves processes: process 0 would hold shards 0, 2, 4, 6.
        ([*TWO_LEVEL, 'parallel.rules={shard=["data", "dcn"]}'], "parallel.rules.shard", ["block 0..3"]),
    ],
)
def test_misfits_name_the_key(overrides, key, words):
    config = _parallel(*overrides)
    with pytest.raises(ConfigError) as e:
        check_process_shards(device_array(config, _hosts(2, 4)), config)  # what make_mesh runs
    for w in [key, *words]:
        assert w in str(e.value), str(e.value)


def test_config_checks_slow_axes():
    with pytest.raises(ConfigError, match="`parallel.slow_axes`.*leading axes"):
        _parallel(
            'parallel.mesh_axes=["dcn", "data"]', "parallel.mesh_shape=[2, 4]", 'parallel.slow_axes=["data"]'
        )
    with pytest.raises(ConfigError, match="`parallel.mesh_shape`.*at most one -1"):
        _parallel('parallel.mesh_axes=["dcn", "data"]', "parallel.mesh_shape=[-1, -1]")


def test_one_host_emulates_slow_axes_with_contiguous_groups():
    config = _parallel(*TWO_LEVEL)
    mesh = make_mesh(config)
    assert mesh.shape == {"dcn": 2, "data": 4}
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    text = describe_mesh(mesh, config)
    assert "dcn=2 (slow) x data=4 (fast)" in text
    assert "dcn=0: [0 1 2 3] (process 0)" in text and "dcn=1: [4 5 6 7] (process 0)" in text


def test_one_process_may_use_fewer_devices():
    mesh = make_mesh(_parallel("parallel.mesh_shape=[2]"))
    assert mesh.size == 2 and jax.device_count() == 8
    assert describe_mesh(mesh, _parallel()).endswith("[0 1] (process 0)")


def test_hosts_are_slices_on_tpu_and_processes_elsewhere():
    """On TPU one slice is one ICI domain whatever its hosts (2 processes of one slice: one host); on
    GPU a process is a host unless the processes report several slices (JAX_PARTITION_INDEX)."""
    for platform, expected in (("tpu", ("slice_index", 1)), ("gpu", ("process_index", 2))):
        devices = _hosts(2, 4, platform=platform)
        for d in devices:
            d.slice_index = 0
        attr, groups = host_groups(devices)
        assert (attr, len(groups)) == expected, platform
    devices = _hosts(4, 2)
    for d in devices:
        d.slice_index = d.process_index // 2  # two nodes of two one-GPU processes each
    attr, groups = host_groups(devices)
    assert attr == "slice_index" and [sorted(d.process_index for d in g) for g in groups] == [
        [0, 0, 1, 1],
        [2, 2, 3, 3],
    ]


def test_distributed_flags_must_come_together(monkeypatch):
    for name in distributed.ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False  # nothing asked: a single-process run
    with pytest.raises(distributed.DistributedError, match="--num-processes.*--process-id"):
        distributed.initialize("127.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(distributed.DistributedError, match="JAX_NUM_PROCESSES"):
        distributed.initialize("127.0.0.1:1234")
    with pytest.raises(distributed.DistributedError, match="--process-id 2 is not in"):
        distributed.initialize("127.0.0.1:1234", 2, 2)


def test_check_process_shards_accepts_model_axes():
    """A model axis after the data axes (not in the shard rule) replicates packs inside a host."""
    config = _parallel(
        'parallel.mesh_axes=["dcn", "data", "model"]',
        "parallel.mesh_shape=[2, 2, 2]",
        'parallel.slow_axes=["dcn"]',
        'parallel.rules={shard=["dcn", "data"]}',
    )
    array = device_array(config, _hosts(2, 4))
    check_process_shards(array, config)
    assert np.asarray([[d.process_index for d in row.flat] for row in array]).tolist() == [[0] * 4, [1] * 4]


def test_embedding_planner_takes_its_fast_axes_from_the_topology():
    """two_d tables split rows over the axes inside a host: those not in parallel.slow_axes."""
    from gem_jax.embeddings import EmbeddingCollection

    axes = ['parallel.mesh_axes=["dcn", "data", "x"]', "parallel.mesh_shape=[2, 2, 2]"]
    axes.append('parallel.rules={shard=["dcn", "data", "x"]}')
    for slow, fast in (('parallel.slow_axes=["dcn"]', ("data", "x")), ("parallel.slow_axes=[]", ("x",))):
        config = load_config(None, [*axes, slow])
        plan = EmbeddingCollection.from_config(config, make_mesh(config.parallel)).plan
        assert plan.fast_axes == fast, slow
