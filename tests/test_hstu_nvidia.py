"""configs/hstu_nvidia.toml (NVIDIA's HSTU benchmark model): its full-size embedding plan keeps every table in
an H200's memory and puts one in host memory on an 80 GB H100, its sequence lengths follow their Zipf draw,
and the config trains on CPU shrunk."""

import json
from pathlib import Path

import numpy as np
import pytest

from gem_jax.config import load_config
from gem_jax.data.synthetic import SyntheticAds
from gem_jax.embeddings.planner import plan_tables
from gem_jax.tasks import make_task
from gem_jax.train import loop
from gem_jax.train.step import Trainer
from tests.helpers import abstract_train_state

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "hstu_nvidia.toml"

# The model and data kept, every size cut down (tables, widths, lengths, packs).
SHRUNK = [
    "data.num_items=1000",
    "data.max_history_len=64",
    "data.tokens_per_shard=512",
    "data.examples_per_shard=8",
    "data.sparse_vocab=1000",
    "data.eval_examples=16",
    "data.num_workers=0",
    "embeddings.item_rows=1000",
    "embeddings.sparse_rows=1000",
    "model.model_dim=32",
    "model.attention_dim=8",
    "model.value_dim=8",
    "model.num_layers=2",
    "train.steps=2",
    "train.log_every=1",
    "train.eval_batches=1",
    "train.progress=false",
    "parallel.mesh_shape=[1]",
]


# What jax's allocator may use (`bytes_limit`) at its default XLA_PYTHON_CLIENT_MEM_FRACTION of 0.75.
H200_BYTES = int(0.75 * 143_771 * 2**20)
H100_80GB_BYTES = int(0.75 * 81_559 * 2**20)


def _plan_on(capacity: int):
    e = load_config(CONFIG).embeddings
    assert not e.device_memory_gib  # the device's own memory decides
    return plan_tables(
        e.resolved_tables(), {"data": 1}, ("data",), budget_bytes=int(capacity * e.memory_fraction)
    )


def test_full_size_tables_stay_in_hbm_on_one_h200():
    plan = _plan_on(H200_BYTES)
    used = int(plan.bytes_per_device().max())
    assert 45 * 2**30 < used <= plan.budget_bytes  # two 50M x 128 fp32 tables and their accumulators: 48 GiB
    assert {p.sharding for p in plan.placements.values()} == {"data_parallel"}


def test_full_size_tables_put_one_table_in_host_memory_on_an_80gb_h100():
    plan = _plan_on(H100_80GB_BYTES)
    kinds = {name: p.sharding for name, p in plan.placements.items()}
    assert kinds == {"items": "data_parallel", "actions": "data_parallel", "sparse": "offload"}
    assert "does not fit" in plan.placements["sparse"].why
    used = int(plan.bytes_per_device().max())
    assert 24 * 2**30 < used <= plan.budget_bytes  # items (24 GiB) + the cache of sparse (2.4 GiB)


@pytest.mark.slow
def test_lengths_follow_their_zipf_draw():
    """Their T = 2 S + 3, S ~ Zipf(1.2) cut at 4096: mean 1735, median 39, 17% at the cut; ours adds one
    candidate token. The median of 2 S is 36; that of 2,000 draws falls in 30-44."""
    c = load_config(CONFIG, ["data.num_items=1000"])
    gen = SyntheticAds(c.data, num_tasks=len(c.model.tasks))
    history = np.array([len(gen.example(i)["item_ids"]) - 1 for i in range(2000)])
    assert (history % 2 == 0).all() and history.min() >= 2 and history.max() == 8192
    assert 0.13 < (history == 8192).mean() < 0.21
    assert 28 <= np.median(history) <= 50
    assert 1400 < history.mean() < 2100


@pytest.mark.slow  # ~60 s on the 2-core machine: two compiles of an 8-task model
def test_trains_shrunk_on_cpu(tmp_path):
    c = load_config(CONFIG, SHRUNK)
    summary = loop.train(make_task(c), tmp_path)
    assert summary["step"] == 2
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    # Both FLOP counts are logged; theirs (HSTU layers only) is below ours here.
    assert 0 < steps[-1]["tflops_per_device_nvidia"] < steps[-1]["tflops_per_device"]


@pytest.mark.slow  # ~45 s: the full-size step (8 layers of 1024, 50M-row tables) compiled ahead of time
def test_full_size_step_compiles_on_abstract_state():
    """The train step at the config's own sizes, on one device: abstract parameters and tables (52 GB that are
    never allocated), one real pack of the generator's (num_items only shrinks the generator's tables)."""
    # an H200's memory (jax's 75% of 141 GB), where the config runs with both tables in HBM: the planner would
    # put them in host memory for the CPU's nominal 16 GiB, and allocate them there
    c = load_config(
        CONFIG,
        [
            "parallel.mesh_shape=[1]",
            "data.num_items=1000",
            "data.num_workers=0",
            "embeddings.device_memory_gib=105",
        ],
    )
    task = make_task(c)
    assert not task.embeddings.offload  # as on the H200
    trainer = Trainer(task, task.mesh)
    state = abstract_train_state(trainer)
    stack = next(iter(task.train_data(0, 1)))
    assert stack.item_ids.shape == (1, 65536) and stack.offsets[0, -1] > 30000
    compiled = trainer.train_step.lower(state, trainer.to_device(stack)).compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 48 * 2**30  # the tables are in the step
