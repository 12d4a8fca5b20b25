"""FP8 in the real train step: the amax histories and the scales live in the train state, roll every
step with the global batch's amaxes, reach the GEMMs as parameters of the step, survive
checkpoint/resume bitwise, and an FP8 run learns like BF16."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.fp8_gemms import fp8_dots
from gem_jax.model import fp8
from gem_jax.tasks import make_task
from gem_jax.train import loop
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.step import Trainer
from tests.helpers import run_cli, small_config, stacks

ROOT = Path(__file__).resolve().parent.parent
FP8 = ("precision.fp8=true", "model.num_layers=1", "model.wukong_layers=1")


def _state(workdir: Path, config):
    task = make_task(config)
    trainer = Trainer(task, task.mesh)
    ck = Checkpointer(workdir / "checkpoints", config.train)
    saved, _ = ck.restore(ck.latest_step(), *trainer.saved_target)
    ck.close()
    return trainer.from_saved_form(saved)


# Only the backward GEMMs in FP8, HSTU's gradient quantised in the SiLU-backward kernel (interpret mode).
BACKWARD = (
    "precision.fp8_gemms=backward",
    "model.norm_implementation=triton",
    "model.silu_backward_fp8_implementation=triton",
    "model.interpret_kernels=true",
)


@pytest.mark.slow
@pytest.mark.parametrize("gemms", [(), BACKWARD], ids=["all", "backward"])
def test_histories_roll_with_the_global_amax_on_8_devices(gemms):
    """Two steps on 8 fake devices: every FP8 layer's history gets one new, positive amax per step
    (input, weight, gradient), the same on every device (replicated), and nothing else moves."""
    c = small_config(*FP8, "parallel.mesh_shape=[8]", *gemms)
    task = make_task(c)
    trainer = Trainer(task, task.mesh)
    state = trainer.init_state()
    assert state.fp8, "precision.fp8=true must give the state FP8 histories"
    batch = trainer.to_device(next(stacks(c, shards=8)))
    layers = _fp8_layers(state.fp8)
    assert layers and all(
        np.asarray(m[k]) == 1.0 for m in layers.values() for k in fp8.SCALES
    )  # step 1: s = 1
    for step in (1, 2):
        used = jax.tree.map(np.asarray, _fp8_layers(state.fp8))  # this step's scales (the step donates them)
        state, metrics = trainer.train_step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
        # fp8_saturated: the tensors whose new amax (history column 0) is beyond the range of the scale
        # they used by more than half an ulp.
        ratios, clipped = [], 0
        for name, meta in _fp8_layers(state.fp8).items():
            for i, (key, fmt) in enumerate(zip(fp8.SCALES, (fp8.E4M3, fp8.E4M3, fp8.E5M2))):
                ratios.append(np.asarray(meta["amax_history"])[i, 0] / (used[name][key] * fp8.fp8_max(fmt)))
                clipped += ratios[-1] > 1 + float(jnp.finfo(fmt).eps) / 2
        assert float(metrics["fp8_saturated"]) == clipped
        np.testing.assert_allclose(float(metrics["fp8_overshoot"]), max(ratios), rtol=1e-6)
        for meta in _fp8_layers(state.fp8).values():
            h = np.asarray(meta["amax_history"])
            assert (h[:, :step] > 0).all() and not h[:, step:].any(), h[:, :3]
            # The scales the next step will use: those of the rolled history, stored beside it.
            for key, scale in fp8.scales_from_history(meta["amax_history"], c.precision.fp8_margin).items():
                assert np.asarray(meta[key]) == np.asarray(scale) != 1.0, key
            assert all(leaf.sharding.is_fully_replicated for leaf in meta.values())


def _fp8_layers(meta: dict, prefix: str = "") -> dict[str, dict]:
    """The FP8 state of every layer by its path in `TrainState.fp8` (jax.tree_util.keystr form)."""
    if "amax_history" in meta:
        return {prefix: meta}
    return {k: v for key, sub in meta.items() for k, v in _fp8_layers(sub, f"{prefix}[{key!r}]").items()}


# The scales each FP8 GEMM multiplies its operands by, by the operands' formats.
_GEMM_SCALES = {
    ("f8E4M3FN", "f8E4M3FN"): ("x_scale", "w_scale"),  # Y = X W
    ("f8E5M2", "f8E4M3FN"): ("g_scale", "w_scale"),  # dX = dY W^T
    ("f8E4M3FN", "f8E5M2"): ("x_scale", "g_scale"),  # dW = X^T dY
}


def _lowered_step(*overrides: str):
    """The lowered train step on 2 devices x 2 packs (shard_map and vmap, as on a real mesh), and
    its FP8 state."""
    c = small_config(*FP8, "parallel.mesh_shape=[2]", *overrides)
    task = make_task(c)
    trainer = Trainer(task, task.mesh)
    state = trainer.init_state()
    batch = trainer.to_device(next(stacks(c, shards=4)))
    return trainer.train_step.lower(state, batch), state


@pytest.mark.slow
@pytest.mark.parametrize("gemms", [(), BACKWARD], ids=["all", "backward"])
def test_every_fp8_gemm_multiplies_by_scales_that_enter_the_step_as_parameters(gemms):
    """XLA rewrote a dot into a cuBLASLt FP8 GEMM on the H200 only when its dequantisation scales were
    entry parameters of the jitted program (docs/fp8.md). Follow the scales of every FP8 dot of the
    lowered train step back through shard_map, vmap, calls and the custom VJP: each must be the
    TrainState.fp8 leaf of its own layer and operand, with no arithmetic on the way. (The step that
    computed the scales from the histories inside it fails here: the scale is a select.)"""
    lowered, state = _lowered_step(*gemms)
    dots, total = fp8_dots(lowered)
    gemm_formats = [f for f in _GEMM_SCALES if not gemms or f != ("f8E4M3FN", "f8E4M3FN")]  # backward: no Y
    layers = _fp8_layers(state.fp8)
    assert len(layers) == 3 and total > len(dots)  # uvqk, out, fm_mlp; and the bf16 dots are not counted
    seen = []
    for dot in dots:
        formats = (dot.lhs.format, dot.rhs.format)
        assert dot.has_pattern and formats in gemm_formats, dot
        names = []
        for operand, key in zip((dot.lhs, dot.rhs), _GEMM_SCALES[formats]):
            assert operand.scale_arg is not None, (
                f"{formats}: the {key} is computed in the step ({operand.scale_op})"
            )
            layer, _, leaf = operand.scale_arg.removeprefix("state.fp8").rpartition("[")
            assert operand.scale_arg.startswith("state.fp8[") and leaf == f"{key!r}]", operand.scale_arg
            names.append(layer)
        assert names[0] == names[1] and names[0] in layers, names  # both scales of the same layer
        seen.append((names[0], formats))
    assert sorted(seen) == sorted((layer, f) for layer in layers for f in gemm_formats)  # each GEMM once


@pytest.mark.slow
def test_current_scaling_computes_its_scales_in_the_step():
    """The check above can fail: the current recipe's scales come from the tensors themselves (under the
    packs' vmap not even rank 0), so none of its step's FP8 dots multiplies by parameter scales, though
    each is still a dot of two FP8 arrays."""
    lowered, state = _lowered_step("precision.fp8_recipe=current")
    dots, _ = fp8_dots(lowered)
    assert not state.fp8 and len(dots) == 9
    assert all(d.lhs.format and d.rhs.format for d in dots)
    assert not any(d.scales_are_arguments for d in dots)


@pytest.mark.slow
def test_fp8_state_survives_resume_bitwise(tmp_path):
    c = small_config(*FP8, "train.steps=12", "train.checkpoint_every=4")
    loop.train(make_task(c), tmp_path / "whole")
    loop.train(make_task(c), tmp_path / "split", stop_after=6)
    loop.train(make_task(c), tmp_path / "split")
    a, b = _state(tmp_path / "whole", c), _state(tmp_path / "split", c)
    assert int(a.step) == int(b.step) == 12
    for x, y in zip(
        jax.tree.leaves((a.params, a.fp8, a.embeddings)), jax.tree.leaves((b.params, b.fp8, b.embeddings))
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_fp8_run_reaches_the_auc_bar_of_the_default_config(tmp_path):
    """The README's main job with FP8 on (the tolerant HSTU and Wukong layers), cut to 250 of its 400
    steps (the suite's time budget; the schedule follows): click AUC >= 0.70 (the full BF16 run is held
    to 0.75 in tests/test_train.py; a model that does not learn stays near 0.5). Measured 0.737 on CPU
    with the previous default (600 steps, relative biases on); not measured since."""
    r = run_cli(
        "train",
        "--workdir",
        str(tmp_path),
        "--set",
        "train.progress=false",
        "--set",
        "precision.fp8=true",
        "--set",
        "train.steps=250",
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["eval"]["click"]["auc"] >= 0.70, summary["eval"]
