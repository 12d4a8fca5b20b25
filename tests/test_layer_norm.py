"""The fused layer-norm kernel (Pallas interpret mode) against its jnp reference, and in the HSTU model."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.layer_norm import layer_norm
from pallas_kernels.layer_norm.api import block_rows, kernel_applies
from pallas_kernels.layer_norm.reference import layer_norm_reference
from tests.helpers import model_logits_and_grads, small_config, stacks


def _inputs(seed, shape, dtype):
    k = jax.random.split(jax.random.key(seed), 5)
    width = shape[-1]
    x = (jax.random.normal(k[0], shape) * 3 + 1).astype(dtype)
    gate = jax.random.normal(k[1], shape).astype(dtype)
    scale = 1 + 0.5 * jax.random.normal(k[2], (width,))
    bias = jax.random.normal(k[3], (width,))
    probe = jax.random.normal(k[4], shape)  # a random cotangent direction
    return x, gate, scale, bias, probe


def _value_and_grads(implementation, x, gate, scale, bias, probe, with_input, **kw):
    def loss(x, scale, bias, gate):
        out = layer_norm(x, scale, bias, gate, with_input=with_input, implementation=implementation, **kw)
        if with_input:
            passed, out = out
            return jnp.sum(out.astype(jnp.float32) * probe) + jnp.sum(jnp.sin(passed.astype(jnp.float32)))
        return jnp.sum(out.astype(jnp.float32) * probe)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, scale, bias, gate)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_input", [False, True])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_kernel_matches_reference(gated, with_input, dtype, tol):
    x, gate, scale, bias, probe = _inputs(0, (96, 64), dtype)
    gate = gate if gated else None
    ref = _value_and_grads("reference", x, gate, scale, bias, probe, with_input)
    out = _value_and_grads(
        "triton", x, gate, scale, bias, probe, with_input, interpret=True, rows_per_block=16
    )
    for name, a, b in zip(
        ["loss", "dx", "dscale", "dbias", "dgate"], jax.tree.leaves(ref), jax.tree.leaves(out)
    ):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert b.shape == a.shape, name
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * max(1.0, np.abs(a).max()), err_msg=name)


def test_forward_values_and_leading_axes():
    """[2, 3, 32] rows of width 64: the kernel's output is the reference's, with the input's shape."""
    x, gate, scale, bias, _ = _inputs(1, (2, 3, 32, 64), jnp.float32)
    ref = layer_norm_reference(x, scale, bias, gate)
    out = layer_norm(x, scale, bias, gate, implementation="triton", interpret=True)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # Rows normalised: mean 0, variance 1 before scale and bias.
    plain = layer_norm(x, None, jnp.zeros(64), implementation="triton", interpret=True)
    np.testing.assert_allclose(np.asarray(plain).mean(-1), 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(plain).var(-1), 1, atol=1e-3)


def test_odd_row_counts_and_unsupported_widths():
    """37 rows run one row per program; a width of 48 (not a power of two) runs the reference by default (the
    GPU's order, interpreted), and is refused by name."""
    assert block_rows(37, 64) == 1 and block_rows(96, 64) == 32 and block_rows(4096, 512) == 8
    assert kernel_applies(64) and not kernel_applies(48) and not kernel_applies(8)
    for shape in [(37, 64), (10, 48)]:
        x, gate, scale, bias, probe = _inputs(2, shape, jnp.float32)
        ref = _value_and_grads("reference", x, gate, scale, bias, probe, True)
        out = _value_and_grads(None, x, gate, scale, bias, probe, True, interpret=True)
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="width 48.*use implementation=None"):
        _value_and_grads("triton", x, gate, scale, bias, probe, True, interpret=True)


def test_bad_shapes_name_the_argument():
    """The function's own checks (what callers get without GEM_JAX_TYPECHECK; the suite's shape checker
    would reject the shapes first), and a tile that does not divide the rows."""
    unchecked = inspect.unwrap(layer_norm)
    x = jnp.zeros((8, 64))
    with pytest.raises(ValueError, match="bias"):
        unchecked(x, jnp.ones(64), jnp.zeros(32), implementation="triton", interpret=True)
    with pytest.raises(ValueError, match="gate"):
        unchecked(x, jnp.ones(64), jnp.zeros(64), jnp.zeros((8, 32)), implementation="triton", interpret=True)
    with pytest.raises(ValueError, match="rows_per_block"):
        layer_norm(x, jnp.ones(64), jnp.zeros(64), implementation="triton", interpret=True, rows_per_block=3)


@pytest.mark.slow
def test_the_hstu_model_runs_the_kernel_with_the_same_function():
    """model.norm_implementation = "triton" (interpreted) puts the kernels into every HSTU layer (widths 32 and 16;
    float32, so the gate's one rounding less does not show): the logits and the gradients of every
    parameter are the reference's."""
    results = {}
    for impl in ("reference", "triton"):
        c = small_config(
            f'model.norm_implementation="{impl}"',
            "model.interpret_kernels=true",
            "precision.compute_dtype=float32",
        )
        model, logits, grads = model_logits_and_grads(c)
        results[impl] = (logits, grads)
        norm = model.tower.layers[0].input_norm
        assert (norm.implementation, norm.interpret) == ((impl, True) if impl == "triton" else (impl, False))
    (ref_logits, ref_grads), (logits, grads) = results["reference"], results["triton"]
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
    flat_ref, flat = nnx.to_flat_state(ref_grads), nnx.to_flat_state(grads)
    checked = 0
    for (path, a), (_, b) in zip(flat_ref, flat):
        a, b = (
            np.asarray(a.get_value() if hasattr(a, "get_value") else a[...]),
            np.asarray(b.get_value() if hasattr(b, "get_value") else b[...]),
        )
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5 * max(1.0, np.abs(a).max()), err_msg=str(path))
        checked += "norm" in str(path)
    assert checked >= 6  # every HSTU layer's two norms and the final norm were differentiated


def test_bf16_output_from_a_float32_residual_stream():
    """out_dtype=bf16 on float32 x (the HSTU input norm): y is the reference's bf16 y, x's gradient (with the
    residual's) stays float32 and equals the reference's."""
    x, _, scale, bias, probe = _inputs(3, (64, 64), jnp.float32)

    def run(implementation):
        def loss(x, scale, bias):
            passed, y = layer_norm(
                x,
                scale,
                bias,
                with_input=True,
                out_dtype=jnp.bfloat16,
                implementation=implementation,
                interpret=implementation != "reference",
            )
            assert y.dtype == jnp.bfloat16 and passed.dtype == jnp.float32
            return jnp.sum(y.astype(jnp.float32) * probe) + jnp.sum(jnp.sin(passed))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, scale, bias)

    ref, out = run("reference"), run("triton")
    assert out[1][0].dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3 * max(1.0, float(np.abs(a).max())))


@pytest.mark.slow
def test_sharded_train_steps_run_the_kernels_inside_the_shard_map():
    """Two train steps on 2 fake devices with 2 packs each (the kernels under jax.shard_map and the packs'
    vmap, as on a GPU host): the losses are the reference norms' (float32)."""
    from gem_jax.tasks import make_task
    from gem_jax.train.step import Trainer

    assert jax.device_count() >= 2, "conftest sets 8 fake CPU devices"
    losses = {}
    for impl in ("reference", "triton"):
        c = small_config(
            "parallel.mesh_shape=[2]",
            "precision.compute_dtype=float32",
            "model.num_layers=1",
            "model.wukong_layers=1",
            f'model.norm_implementation="{impl}"',
            "model.interpret_kernels=true",
        )
        trainer = Trainer(make_task(c), make_task(c).mesh)
        state = trainer.init_state()
        batch = jax.device_put(next(stacks(c, shards=4)), trainer.batch_sharding)
        traced = str(jax.make_jaxpr(trainer.train_step)(state, batch))
        assert ("layer_norm_bwd" in traced) == (impl == "triton")  # the kernels are in the step
        curve = []
        for _ in range(2):
            state, m = trainer.train_step(state, batch)
            curve.append(float(m["loss"]))
        losses[impl] = curve
    np.testing.assert_allclose(losses["triton"], losses["reference"], rtol=1e-5)
    assert losses["reference"][1] != losses["reference"][0]  # the second step saw the first's update
