"""Shared test fixtures: a very small config and batches from the real data pipeline."""

from __future__ import annotations

import jax

from gem_jax.config import Config, load_config
from gem_jax.data.pipeline import packed_dataset
from gem_jax.data.synthetic import SyntheticAds

SMALL = [
    "data.num_items=500",
    "data.max_history_len=24",
    "data.examples_per_shard=8",
    "data.tokens_per_shard=256",
    "data.eval_examples=64",
    "data.num_sparse_features=2",
    "embeddings.dim=16",
    "embeddings.item_rows=512",
    "embeddings.sparse_rows=256",
    "model.model_dim=32",
    "model.num_heads=2",
    "model.attention_dim=8",
    "model.value_dim=8",
    "model.wukong_tokens=4",
    "model.head_hidden=16",
    "model.num_position_buckets=16",
    "model.num_time_buckets=8",
    "model.attention_implementation=reference",
    "train.steps=40",
    "train.warmup_steps=5",
    "train.log_every=5",
    "train.checkpoint_every=10",
    "train.progress=false",
    "train.async_checkpointing=false",
    "parallel.mesh_shape=[1]",
]


def small_config(*overrides: str) -> Config:
    return load_config(None, [*SMALL, *overrides])


def stacks(config: Config, shards: int, start: int = 0):
    """An iterator of numpy batch stacks (one pack per shard) from the real pipeline."""
    d, m = config.data, config.model
    gen = SyntheticAds(d, num_tasks=len(m.tasks))
    ds = packed_dataset(
        gen.example,
        num_examples=None,
        start=start,
        examples_capacity=d.examples_per_shard,
        tokens_capacity=d.tokens_per_shard,
        num_sparse_features=d.num_sparse_features,
        max_bag_size=d.max_bag_size,
        prefix=m.num_context_tokens,
        shards=shards,
        process_index=0,
        process_count=1,
    )
    return iter(ds)


def first_pack(stack):
    return jax.tree.map(lambda x: x[0], stack)
