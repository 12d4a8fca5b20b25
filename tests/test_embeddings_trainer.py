"""The sparse embeddings inside the real train step (8 fake CPU devices): no table-sized
collective in the compiled step, every sharding type trains like data parallel, and a checkpoint
written on 4 devices resumes on 8."""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest

from gem_jax.tasks import make_task
from gem_jax.train import loop
from gem_jax.train.step import Trainer
from tests.helpers import abstract_train_state, small_config, stacks

LEAN = ("model.num_layers=1", "model.wukong_layers=1", "train.log_every=1")
_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|all-to-all)(?:-start)?\(")
_SHAPE = re.compile(r"[a-z0-9]+\[([\d,]*)\]")


def _sharded(kind: str, *extra: str):
    """The small config on 8 devices with all three tables of one sharding type."""
    return small_config(
        "parallel.mesh_shape=[8]",
        *LEAN,
        "embeddings.item_rows=512",
        "embeddings.action_rows=16",
        "embeddings.sparse_rows=256",
        "embeddings.tables={}",
        *(
            f"embeddings.tables.{t}={{rows={r}, dim=16, sharding='{kind}'}}"
            for t, r in (("items", 512), ("actions", 16), ("sparse", 256))
        ),
        "embeddings.features.items={table='items', pooling='none'}",
        "embeddings.features.actions={table='actions', pooling='none'}",
        "embeddings.features.sparse={table='sparse', pooling='mean'}",
        *extra,
    )


@pytest.mark.slow
def test_compiled_train_step_moves_no_table_sized_operand():
    """Tables of 2^17 x 16 rows (8 MiB), row-wise over 8 devices: every all-gather and all-reduce of
    the compiled train step is far below one device's shard of a table (the dense gradients'
    all-reduce included: the tables are not dense parameters)."""
    rows = 1 << 17
    c = small_config(
        "parallel.mesh_shape=[8]",
        *LEAN,
        f"embeddings.tables.items={{rows={rows}, dim=16, sharding='row_wise'}}",
        f"embeddings.tables.actions={{rows={rows}, dim=16, sharding='row_wise'}}",
        f"embeddings.tables.sparse={{rows={rows}, dim=16, sharding='row_wise'}}",
        "embeddings.features.items={table='items', pooling='none'}",
        "embeddings.features.actions={table='actions', pooling='none'}",
        "embeddings.features.sparse={table='sparse', pooling='mean'}",
    )
    task = make_task(c)
    trainer = Trainer(task, task.mesh)
    abstract = abstract_train_state(trainer)
    batch = trainer.to_device(next(stacks(c, shards=8)))
    hlo = trainer.train_step.lower(abstract, batch).compile().as_text()
    sizes = {"all-gather": [], "all-reduce": [], "all-to-all": []}
    for shapes, op in _COLLECTIVE.findall(hlo):
        for dims in _SHAPE.findall(shapes):
            sizes[op].append(math.prod(int(d) for d in dims.split(",") if d))
    assert sizes["all-to-all"], "ids were not routed to their rows' owners"
    assert sizes["all-reduce"], "no all-reduce found: the HLO pattern no longer matches"
    shard = rows * 16 // 8
    for op in ("all-gather", "all-reduce"):
        assert max(sizes[op], default=0) < shard // 4, (op, max(sizes[op], default=0), shard)
    # The dense parameters' gradient all-reduce is there, and the tables are not dense parameters.
    assert "items" not in trainer.abstract_state.params


@functools.cache
def _six_steps(kind: str, extra: tuple[str, ...]) -> list[float]:
    """The losses of six train steps on one batch, all tables `kind`. Cached: the row-, table- and
    column-wise cases compare with the same data-parallel curve, computed once per test process."""
    c = _sharded(kind, *extra)
    task = make_task(c)
    trainer = Trainer(task, task.mesh)
    assert {p.sharding for p in task.embeddings.plan.placements.values()} == {kind}
    state = trainer.init_state()
    batch = trainer.to_device(next(stacks(c, shards=8)))  # one batch, so the loss must fall
    losses = []
    for _ in range(6):
        state, m = trainer.train_step(state, batch)
        losses.append(float(m["loss"]))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["row_wise", "table_wise", "column_wise", "two_d"])
def test_every_sharding_type_trains_like_data_parallel(kind):
    """Six steps of the real train step: the losses match the data_parallel run's (same math, other
    collectives: only summation order differs)."""
    two_d = (
        "parallel.mesh_axes=['dcn','data']",
        "parallel.mesh_shape=[2,4]",
        "parallel.rules={shard=['dcn','data']}",
    )
    extra = (*(two_d if kind == "two_d" else ()), "train.warmup_steps=1")
    curves = [_six_steps("data_parallel", extra), _six_steps(kind, extra)]
    # Same math, other summation order (column_wise sums g^2 over column shards): differences of
    # ~1e-7 grow to ~1e-3 as the loss falls from 1.4 to 0.6 in six steps on one batch.
    np.testing.assert_allclose(curves[1], curves[0], rtol=3e-3)
    assert curves[0][-1] < curves[0][0], "training did not lower the loss"


@pytest.mark.slow
def test_checkpoint_from_4_devices_resumes_on_8(tmp_path):
    """A run stopped on a 4-device mesh (row-wise tables) resumes on 8 devices (table-wise for one):
    the tables come back through their logical form and training continues."""
    common = ("train.steps=6", "train.checkpoint_every=3")
    c4 = _sharded("row_wise", "parallel.mesh_shape=[4]", *common)
    first = loop.train(make_task(c4), tmp_path, stop_after=3)
    assert first["step"] == 3
    c8 = _sharded("row_wise", *common, "embeddings.tables.sparse={rows=256, dim=16, sharding='table_wise'}")
    task8 = make_task(c8)
    trainer = Trainer(task8, task8.mesh)
    from gem_jax.train.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "checkpoints", c8.train)
    saved, _ = ck.restore(3, *trainer.saved_target)
    ck.close()
    state = trainer.from_saved_form(saved)
    back = trainer.saved_form(state)
    for name in ("items", "sparse"):
        np.testing.assert_array_equal(
            np.asarray(back.embeddings[name]["table"]), np.asarray(saved.embeddings[name]["table"])
        )
    second = loop.train(task8, tmp_path)
    assert second["step"] == 6 and np.isfinite(second["final"]["loss"])
