"""The train step found by its inputs, without tracing it (gem_jax/train/step_cache.py): a second run of a
config loads it without tracing or lowering anything and trains exactly as the first; a corrupt entry is said
in one line and compiled again; the key follows the config, the batch's shapes and the source."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from gem_jax.config import load_config
from gem_jax.paths import REPO_ROOT
from gem_jax.tasks import make_task
from gem_jax.train import compile_cache, loop, step_cache
from gem_jax.train.step import Trainer

TINY = REPO_ROOT / "configs" / "tiny.toml"
SMALL = [
    "parallel.mesh_shape=[1]",
    "train.steps=3",
    "train.eval_every=0",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.async_checkpointing=false",
]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The step cache on (the suite turns it off: tests/conftest.py) in a folder of this test's own; the
    suite's compilation cache again afterwards."""
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("GEM_JAX_STEP_CACHE", "1")
    yield tmp_path / "xla"
    compile_cache.configure(before or "off")


def _run(config, workdir) -> tuple[dict, str, list[float]]:
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        summary = loop.train(make_task(config), workdir)
    losses = [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").open() if '"loss"' in line]
    return summary, log.getvalue(), losses


@pytest.mark.slow  # ~30 s: two training runs
def test_a_second_run_loads_the_step_without_tracing_and_trains_the_same(cache, tmp_path, monkeypatch):
    config = load_config(TINY, [*SMALL, f"train.compilation_cache={cache}"])
    first, first_log, first_losses = _run(config, tmp_path / "first")
    assert first["step_traced"] and not first["step_compile_cached"]
    assert len(list((cache / "steps").glob("*.pkl"))) == 1

    def refuse(*_args, **_kwargs):
        raise AssertionError("traced the step although the cache holds it")

    monkeypatch.setattr(Trainer, "trace_step", refuse)
    monkeypatch.setattr(Trainer, "lower_step", refuse)
    second, second_log, second_losses = _run(config, tmp_path / "second")
    assert not second["step_traced"] and second["step_compile_cached"]
    assert "found by its inputs, not traced or lowered" in second_log, second_log
    assert second_losses == first_losses and len(first_losses) >= 1
    assert second["memory_compiled_bytes"] == first["memory_compiled_bytes"]


@pytest.mark.slow  # ~25 s: a training run
def test_a_corrupt_entry_is_said_and_the_step_compiled_again(cache, tmp_path):
    config = load_config(TINY, [*SMALL, f"train.compilation_cache={cache}"])
    task = make_task(config)
    trainer = Trainer(task, task.mesh)
    stack = next(iter(task.train_data(0, 1)))
    from gem_jax.train import memory  # noqa: PLC0415 (beside its one use: the key's inputs)
    from gem_jax.train.run_record import data_fingerprint  # noqa: PLC0415

    key = step_cache.step_key(task, trainer, stack, data_fingerprint(config), memory.device_capacity(config))
    entry = cache / "steps" / f"{key}.pkl"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"not a pickle")
    summary, log, _ = _run(config, tmp_path / "run")
    assert summary["step_traced"]
    assert f"the cached executable {entry} did not load" in log, log
    assert entry.stat().st_size > 1000  # written again, whole
    assert step_cache.load(entry.parent, key) is not None


def test_the_key_follows_the_config_the_batch_and_the_source(monkeypatch):
    def key(overrides, packs=1):
        config = load_config(TINY, [*SMALL, *overrides])
        task = make_task(config)
        trainer = Trainer(task, task.mesh)
        stack = next(iter(task.train_data(0, 1)))
        stack = jax.tree.map(lambda x: np.concatenate([x] * packs), stack)  # [packs, ...] leaves
        return step_cache.step_key(task, trainer, stack, {"data": 1}, (1 << 30, "test"))

    base = key([])
    assert key([]) == base
    assert key(["train.compilation_cache=/elsewhere"]) == base  # where the cache is does not change the step
    assert key(["model.num_layers=2"]) != base
    assert key([], packs=2) != base
    monkeypatch.setattr(step_cache, "source_digest", lambda: "another source")
    assert key([]) != base
