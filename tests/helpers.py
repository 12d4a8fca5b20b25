"""Shared test fixtures: a very small config and batches from the real data pipeline."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax.config import Config, load_config
from gem_jax.data.pipeline import example_range, packed_dataset
from gem_jax.data.synthetic import SyntheticAds
from gem_jax.model.hstu import HSTULayer
from gem_jax.precision import PrecisionPolicy

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def on_platform(name: str):
    """implementation=None picks as on `name` (one of implementations.PLATFORMS, e.g. "hopper"): the kernels
    are then lowered for it here, not run. The jitted entry points' traces are dropped before and after, so
    none made on this CPU is reused, nor one made here afterwards."""
    from unittest import mock

    from pallas_kernels import implementations
    from pallas_kernels.block_attention import block_attention
    from pallas_kernels.jagged_attention import jagged_attention

    def clear():
        jagged_attention.clear_cache()
        block_attention.clear_cache()

    clear()
    try:
        with mock.patch.object(implementations, "this_platform", lambda interpret=False: name):
            yield
    finally:
        clear()


def public_data_file(name: str) -> Path | None:
    """A public data file or folder (README, "Public data": e.g. "sasrec/Games.txt"), or None where no copy is here.

    Looked up, in this order, in the repository's own data/ folder (where the README says to put the files),
    in $GEM_JAX_PUBLIC_DATA (the README names it), then in ../shared/data beside the checkout (where the
    project's own machines keep a copy; the package itself never looks there).
    """
    folders = [ROOT / "data", os.environ.get("GEM_JAX_PUBLIC_DATA"), ROOT.parent / "shared" / "data"]
    found = [Path(f) / name for f in folders if f and (Path(f) / name).exists()]
    return found[0] if found else None


def cli_env() -> dict[str, str]:
    """The environment of a CLI subprocess: one CPU device, as a user's machine (conftest's 8 fake
    devices and compilation cache are inherited otherwise; the cache is kept)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None, **kwargs):
    """Runs `python -m experiments ARGS` from the repository root with `cli_env()` (one CPU device) and
    returns the finished process, its output captured as text; `kwargs` go to subprocess.run."""
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args],
        cwd=ROOT,
        env=cli_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def start_cli(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """`run_cli` without waiting: the running process (pipes, signals are the caller's: `kwargs` go to
    subprocess.Popen; by default stdout and stderr are text pipes)."""
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return subprocess.Popen(
        [sys.executable, "-m", "experiments", *args],
        cwd=ROOT,
        env=cli_env() if env is None else env,
        **kwargs,
    )


def child_pids(pid: int) -> list[int]:
    """The process ids of `pid`'s children (Linux /proc): e.g. the trainer under its supervisor."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def last_logged_step(path: Path) -> int:
    """The last training step in a metrics.jsonl being written (0 if none; a cut last line is skipped)."""
    step = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if "loss" in record and "split" not in record:
                step = max(step, record["step"])
    return step


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


def stacks(config: Config, shards: int, start: int = 0, examples=None):
    """An iterator of numpy batch stacks (one pack per shard) from the real pipeline: of `examples`, or
    the synthetic generator's from example `start`."""
    d, m = config.data, config.model
    if examples is None:
        examples = example_range(SyntheticAds(d, num_tasks=len(m.tasks)).example, start, None)
    ds = packed_dataset(
        examples,
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


def abstract_train_state(trainer):
    """The trainer's state as shapes with their shardings, to compile the step ahead of time without
    allocating it (full-size tables included)."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        trainer.abstract_state,
        trainer.state_shardings,
    )


def first_pack(stack):
    return jax.tree.map(lambda x: x[0], stack)


def model_logits_and_grads(config: Config):
    """The GEM model's logits on the first synthetic pack of `config`, and the gradients of
    sum(sin(logits)) with respect to every parameter (an nnx.State)."""
    from flax import nnx

    from gem_jax.model.gem import GEMModel

    model = GEMModel(config, rngs=nnx.Rngs(0))
    pack = first_pack(next(stacks(config, 1)))
    embedded = dense_embeddings(config, pack)
    graph, params = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graph, params)(pack, embedded)
        return jnp.sum(jnp.sin(logits)), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return model, logits, grads


def poison_loss(monkeypatch, from_step: int) -> None:
    """Makes the reported loss NaN for every step whose input state is at `from_step` or later."""
    import jax.numpy as jnp

    from gem_jax.train.step import Trainer

    original = Trainer._train_step

    def poisoned(self, state, batch):
        new_state, metrics = original(self, state, batch)
        metrics["loss"] = jnp.where(state.step >= from_step, jnp.nan, metrics["loss"])
        return new_state, metrics

    monkeypatch.setattr(Trainer, "_train_step", poisoned)


_TABLES: dict = {}


def dense_embeddings(config: Config, pack, seed: int = 0) -> dict:
    """The pack's looked-up embeddings from dense stand-in tables (gem_jax.embeddings.reference):
    model-level tests call the model directly, without the sharded EmbeddingCollection."""
    from gem_jax.embeddings import reference
    from gem_jax.model.gem import embedding_ids, sparse_feature_groups

    specs, features = config.embeddings.resolved_tables(), config.embeddings.resolved_features()
    key = (tuple(sorted((n, t.rows, t.dim) for n, t in specs.items())), seed)
    if key not in _TABLES:
        _TABLES[key] = {
            name: 0.05 * jax.random.normal(jax.random.key(seed + i), (t.rows, t.dim))
            for i, (name, t) in enumerate(sorted(specs.items()))
        }
    ids = embedding_ids(pack, sparse_feature_groups(config.data))
    batch = {
        name: (jnp.asarray(f.values), None if f.offsets is None else jnp.asarray(f.offsets))
        for name, f in ids.items()
    }
    return reference.lookup(_TABLES[key], specs, features, batch)


# ----------------------------------------------------------------------------- jagged sequence filters

FILTER_LAYER_ARGS = (
    "data.kind=interactions",
    "data.path=unused.txt",
    "model.model_dim=8",
    "model.num_heads=2",
    "model.attention_dim=4",
    "model.value_dim=4",
    "model.num_time_buckets=0",
    "model.attention_implementation=reference",
    "precision.compute_dtype=float32",
)


def filter_layer(max_len: int, *overrides: str, seed: int = 0):
    """An HSTU layer (model width 8, 2 heads) of a next-item config with `retrieval.max_len = max_len` and
    `overrides`, and its call on a pack of [T, 8] rows without dropout: `call(x, offsets)` (or
    `call(x, offsets, module)`, another layer of the same config, e.g. under nnx.grad)."""
    config = load_config(None, [*FILTER_LAYER_ARGS, f"retrieval.max_len={max_len}", *overrides])
    layer = HSTULayer(
        "hstu/0",
        config.model,
        PrecisionPolicy.from_config(config.precision),
        rngs=nnx.Rngs(seed),
        max_seq_len=max_len,
    )

    def call(x, offsets, module=layer):
        return _layer_call(module, x, offsets, max_len)

    return layer, call


@functools.partial(nnx.jit, static_argnums=3)
def _layer_call(module, x, offsets, max_len: int):
    """A filter_layer's call, compiled once per config and pack shape (eagerly, a property test's examples
    took seconds each in op dispatch)."""
    b, t = offsets.shape[0] - 1, x.shape[0]
    zeros_b, zeros_t = jnp.zeros((b,), jnp.int32), jnp.zeros((t,), jnp.int32)
    return module(x, offsets, zeros_b, zeros_t, max_seq_len=max_len, rng=None)


def jagged_rows(lengths: list[int], spare: int, width, seed: int = 0):
    """A pack of sequences of these lengths and `spare` rows of unused capacity: (x [T, *width] float32
    normal rows, offsets [B + 1]) as jnp arrays."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    shape = (int(offsets[-1]) + spare, *((width,) if isinstance(width, int) else width))
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(offsets)


def rows_changed(a, b, atol: float = 1e-6):
    """Indices of the rows (first axis) where two arrays differ by more than `atol`."""
    diff = np.abs(np.asarray(a) - np.asarray(b)).reshape(np.shape(a)[0], -1).max(axis=1)
    return set(np.flatnonzero(diff > atol).tolist())
