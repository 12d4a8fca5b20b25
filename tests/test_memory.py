"""Fitting the train step into a device's memory before it compiles (gem_jax/train/memory.py), and the
persistent compilation cache that lets a second run skip the compile (gem_jax/train/compile_cache.py).

The device's memory is faked with `embeddings.device_memory_gib` (CPU devices report none): the
planner must move a table to host memory when the step would not fit otherwise, a step that cannot fit
is refused in one line before anything compiles, and the estimate stays within a band of XLA's own
figure for the compiled step."""

from __future__ import annotations

import contextlib
import io
import types

import jax
import jax.numpy as jnp
import pytest

from experiments.__main__ import main
from gem_jax.config import ConfigError, load_config
from gem_jax.embeddings import EmbeddingCollection
from gem_jax.embeddings.planner import DEFAULT_DEVICE_BYTES, device_capacity
from gem_jax.paths import REPO_ROOT
from gem_jax.tasks import make_task
from gem_jax.train import compile_cache, loop, memory
from gem_jax.train.step import Trainer

# The main job's model on one device, with an item table large enough (512 K rows: 66 MiB with its
# accumulator) that where it lives decides whether the step fits.
TINY = REPO_ROOT / "configs" / "tiny.toml"
BIG_TABLE = [
    "parallel.mesh_shape=[1]",
    "embeddings.item_rows=524288",
    "embeddings.memory_fraction=1.0",
    "train.progress=false",
    "train.checkpoint_every=0",
    "train.async_checkpointing=false",
]


def _estimate(config, budget: int | None = None) -> tuple[memory.StepMemory, Trainer]:
    """The step's planned memory on a huge device, with the tables planned for `budget` when given."""
    task = make_task(config)
    if budget is not None:
        task.embeddings = EmbeddingCollection.from_config(config, task.mesh, budget_bytes=budget)
    trainer = Trainer(task, task.mesh)
    stack = next(iter(task.train_data(0, 1)))
    state = trainer.abstract_sharded_state
    traced, rest = trainer.trace_step(state, stack)
    return memory.plan_step(traced, state, rest, (1 << 40, "test")), trainer


@pytest.fixture
def restore_cache_folder():
    """The tests' shared compilation cache (tests/conftest.py) again after a test points jax elsewhere."""
    before = jax.config.jax_compilation_cache_dir
    yield
    compile_cache.configure(before or "off")


@pytest.fixture(scope="module")
def windows():
    """The step's estimate with the item table in device memory and in host memory, and a device memory
    between the two (GiB)."""
    config = load_config(TINY, BIG_TABLE)
    in_hbm, _ = _estimate(config)
    offloaded, trainer = _estimate(config, budget=in_hbm.tables // 4)
    assert "items" in trainer.embeddings.offload and in_hbm.tables > 64 << 20
    assert offloaded.estimate < in_hbm.estimate - (32 << 20), (offloaded.line(), in_hbm.line())
    between = (offloaded.estimate + in_hbm.estimate) / 2
    assert in_hbm.tables < between  # the tables alone fit it: the planner keeps them in device memory first
    return in_hbm, offloaded, between / 2**30


def test_device_capacity_is_the_devices_own_limit_else_the_config_else_a_default():
    gpu = types.SimpleNamespace(
        memory_stats=lambda: {"bytes_limit": 60 << 30}, platform="gpu", device_kind="NVIDIA H100 80GB HBM3"
    )
    assert device_capacity(0.0, gpu) == (60 << 30, "bytes_limit of the NVIDIA H100 80GB HBM3")
    assert device_capacity(2.0, gpu) == (2 << 30, "embeddings.device_memory_gib")
    cpu = types.SimpleNamespace(memory_stats=lambda: None, platform="cpu", device_kind="cpu")
    capacity, source = device_capacity(0.0, cpu)
    assert capacity == DEFAULT_DEVICE_BYTES and "no limit" in source


def test_estimate_is_within_a_band_of_xlas_figure_for_a_small_step():
    """A two-layer MLP's forward and backward, donated parameters: the estimate is at or above XLA's
    figure and within 2x of it."""

    def step(params, x):
        def loss(p):
            h = jax.nn.silu(x @ p["w1"])
            return jnp.mean((h @ p["w2"]) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"w1": jnp.ones((256, 1024)), "w2": jnp.ones((1024, 256))}
    x = jnp.ones((2048, 256))
    fn = jax.jit(step, donate_argnums=(0,))
    traced = fn.trace(params, x)
    estimate = memory.estimate_peak_bytes(traced, [params, x], [True, False])
    compiled = memory.compiled_bytes(traced.lower().compile())
    assert compiled <= estimate <= 2 * compiled, (estimate, compiled)


@pytest.mark.slow  # two training runs end to end (the slow tier: long end-to-end tests)
def test_the_planner_puts_a_table_in_host_memory_when_the_step_would_not_fit_and_a_second_run_loads_it(
    tmp_path, windows, restore_cache_folder, monkeypatch
):
    """Device memory between the two estimates: the item table moves to host memory before anything
    compiles, the run trains, the estimate is within a band of XLA's figure; a second run of the config
    in a new workdir loads the step from the cache without tracing it (gem_jax/train/step_cache.py), on
    the tables planned again the same way."""
    monkeypatch.setenv("GEM_JAX_STEP_CACHE", "1")  # (the suite turns it off: tests/conftest.py)
    in_hbm, offloaded, gib = windows
    overrides = [
        *BIG_TABLE,
        f"embeddings.device_memory_gib={gib}",
        f"train.compilation_cache={tmp_path / 'xla'}",
    ]
    config = load_config(TINY, overrides)
    runs = []
    for name in ("first", "second"):
        log = io.StringIO()
        task = make_task(config)
        assert task.embeddings.plan.placements["items"].sharding != "offload"  # by the tables' own budget
        with contextlib.redirect_stderr(log):
            summary = loop.train(task, tmp_path / name, stop_after=1)
        assert summary["step"] == 1
        assert task.embeddings.plan.placements["items"].sharding == "offload", log.getvalue()
        assert "tables planned again" in log.getvalue()
        runs.append((summary, log.getvalue()))
    (first, first_log), (second, second_log) = runs
    assert (
        first["memory_compiled_bytes"] <= first["memory_estimate_bytes"] <= 2 * first["memory_compiled_bytes"]
    )
    assert first["memory_estimate_bytes"] <= first["memory_capacity_bytes"]
    assert not first["step_compile_cached"] and "written to the compilation cache" in first_log
    assert any((tmp_path / "xla").iterdir())
    assert second["step_compile_cached"] and "loaded from the compilation cache" in second_log
    assert first["step_traced"] and not second["step_traced"]
    assert second["memory_compiled_bytes"] == first["memory_compiled_bytes"]
    assert second["step_compile_s"] < first["step_compile_s"] / 3, (
        first["step_compile_s"],
        second["step_compile_s"],
    )


def test_a_step_that_cannot_fit_is_refused_in_one_line_before_compiling(
    windows, tmp_path, monkeypatch, capsys
):
    _, offloaded, _ = windows
    gib = offloaded.estimate / 2 / 2**30  # under the step with every table in host memory

    def compile_timed(lowered):
        raise AssertionError("compiled a step that cannot fit")

    monkeypatch.setattr(compile_cache, "compile_timed", compile_timed)
    args = ["train", "--config", str(TINY), "--workdir", str(tmp_path / "run")]
    overrides = [*BIG_TABLE, f"embeddings.device_memory_gib={gib}"]
    assert main([*args, *(x for o in overrides for x in ("--set", o))]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the start-up's lines (the mesh), then the error
    errors = [line for line in err if "error" in line.lower()]
    assert errors == err[-1:] and err[-1].startswith("config error: the train step does not fit"), err
    for way_out in (
        "data.tokens_per_shard",
        "offload",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "train.check_memory",
    ):
        assert way_out in err[-1]
    with pytest.raises(ConfigError, match="does not fit"):
        loop.train(make_task(load_config(TINY, overrides)), tmp_path / "again")


def test_cache_folder_setting(monkeypatch, tmp_path, restore_cache_folder):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == tmp_path / "xdg" / "gem-jax" / "xla"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.resolve("auto") == tmp_path / "env"
    assert compile_cache.resolve("off") is None
    assert compile_cache.resolve(str(tmp_path / "c")) == tmp_path / "c"
    assert compile_cache.configure("off") is None and not jax.config.jax_enable_compilation_cache
    assert compile_cache.configure(str(tmp_path / "c")) == tmp_path / "c"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    assert jax.config.jax_enable_compilation_cache
