"""The Hopper (Mosaic GPU) layer-norm kernels (pallas_kernels/layer_norm/gpu_sm90.py): which kernel a call runs,
their lowering for the GPU at the GPU configs' shapes, and the kernels in the Mosaic GPU interpreter against
reference.py, forward and backward, every option.

Lowering (`lower(lowering_platforms=("cuda",))` on CPU) runs the whole Pallas -> Mosaic GPU lowering (register
layouts, TMA boxes, the shared-memory budget), so a construct Mosaic GPU rejects fails here; ptxas and the
hardware run only on the GPU (`python -m experiments bench norm`). The interpreter runs the same kernels on
whole arrays, without register layouts, and TMA copies eagerly: it checks the arithmetic, the row-block ring's
indexing and its barriers' arrival counts.

No train step under jax.shard_map here (tests/test_layer_norm.py runs one through the Triton kernels): the
interpreter ends every kernel call at a barrier across the shard_map's devices, and XLA:CPU may run a
collective of the step on one device while another waits at that barrier, so such a run can stop for good
(seen: a 2-device train step stopped with one device in that barrier). On a GPU each device's kernel is its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_norm import api, gpu_sm90, layer_norm, tiles
from pallas_kernels.layer_norm.params import NormParams
from pallas_kernels.layer_norm.reference import layer_norm_reference

sd = jax.ShapeDtypeStruct


def _inputs(seed, shape, dtype, gate_dtype=None):
    k = jax.random.split(jax.random.key(seed), 6)
    width = shape[-1]
    x = (jax.random.normal(k[0], shape) * 3 + 1).astype(dtype)  # an offset mean: the norm must remove it
    gate = jax.random.normal(k[1], shape).astype(gate_dtype or dtype)
    scale = 1 + 0.5 * jax.random.normal(k[2], (width,))
    bias = jax.random.normal(k[3], (width,))
    probe = jax.random.normal(k[4], shape)  # a random cotangent direction of y
    probe_x = jax.random.normal(k[5], shape)  # ... and of the input passed through
    return x, gate, scale, bias, probe, probe_x


def _value_and_grads(implementation, x, gate, scale, bias, probe, probe_x, with_input, **kw):
    def loss(x, scale, bias, gate):
        out = layer_norm(x, scale, bias, gate, with_input=with_input, implementation=implementation, **kw)
        if with_input:
            passed, out = out
            return jnp.sum(out.astype(jnp.float32) * probe) + jnp.sum(passed.astype(jnp.float32) * probe_x)
        return jnp.sum(out.astype(jnp.float32) * probe)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, scale, bias, gate)


def _check(ref, out, tol):
    names = ["loss", "dx", "dscale", "dbias", "dgate"]
    for name, a, b in zip(names, jax.tree.leaves(ref), jax.tree.leaves(out)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert b.shape == a.shape, name
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * max(1.0, np.abs(a).max()), err_msg=name)


def test_which_kernel_runs():
    """None: the reference on CPU and TPU; on every GPU, Hopper included, Triton where it takes the width, else
    the reference, until the Mosaic GPU kernels are measured on the H200; interpreted, as on a pre-Hopper GPU.
    A backend named explicitly that does not take the width is refused, naming what does."""
    assert api.kernel_for(None, 512) == "reference"
    assert api.kernel_for(None, 512, interpret=True) == "triton"
    assert api.kernel_for("mosaic", 512, interpret=True) == "mosaic"
    assert api.kernel_for("triton", 512) == "triton"
    with pytest.raises(ValueError, match="width 48.*'reference'"):
        api.kernel_for("mosaic", 48, interpret=True)
    with pytest.raises(ValueError, match="must be None or one of"):
        api.kernel_for("tpu", 512)
    assert tiles.mosaic_applies(96) and not tiles.mosaic_applies(64 + 16) and not tiles.mosaic_applies(2048)
    for platform in ("hopper", "gpu"):
        assert [api.kernel_for(None, w, platform=platform) for w in (512, 1024, 96, 16, 48)] == [
            "triton",
            "triton",
            "reference",  # a multiple of 32 but no power of two: only "mosaic" takes it
            "triton",
            "reference",
        ]
    assert api.kernel_for(None, 512, platform="tpu") == "reference"
    assert api.kernel_for("mosaic", 96) == "mosaic"


def test_tiles_fit_shared_memory():
    """Steps of 4-32 rows within 32 KiB, as many stages as fit (3 at most), two CTAs an SM where they fit: the
    backward of gem_h200's bf16 norm with the residual (x, dy, dx, its gradient: 8 bytes a row element), of
    hstu_nvidia's float32 input norm (14 bytes), of a narrow bf16 one; the all-float32 backward of 1024-wide
    rows with both gate and residual fits only one stage."""
    assert tiles.mosaic_tiles(512 * 8, 512 * 40) == tiles.MosaicTiles(rows=8, stages=3, ctas_per_sm=1)
    assert tiles.mosaic_tiles(1024 * 14, 1024 * 40) == tiles.MosaicTiles(rows=4, stages=3, ctas_per_sm=1)
    assert tiles.mosaic_tiles(128 * 8, 128 * 40) == tiles.MosaicTiles(rows=32, stages=3, ctas_per_sm=2)
    assert tiles.mosaic_tiles(1024 * 24, 1024 * 40).stages == 1
    assert tiles.mosaic_tiles(512 * 8, 512 * 40, rows=6) is None  # not a multiple of 4


@pytest.mark.parametrize(
    "rows,width,dtype,gated,with_input,out_dtype",
    [
        (196608, 512, jnp.float32, False, True, jnp.bfloat16),  # gem_h200: the input norm
        (196608, 512, jnp.bfloat16, True, False, None),  # ... the attention-output norm times the gate
        (65536, 1024, jnp.float32, False, True, jnp.bfloat16),  # hstu_nvidia's
        (65536, 1024, jnp.bfloat16, True, False, None),
        (65536, 1024, jnp.float32, True, True, None),  # every row array float32: one stage fits
    ],
)
def test_lowers_to_mosaic_gpu(rows, width, dtype, gated, with_input, out_dtype):
    """Forward and backward through the api (its tiles), lowered for the GPU: a layout, TMA box or
    shared-memory size Mosaic GPU rejects raises here."""

    def loss(x, scale, bias, gate):
        out = layer_norm(
            x, scale, bias, gate, with_input=with_input, out_dtype=out_dtype, implementation="mosaic"
        )
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(out))

    args = (sd((rows, width), dtype), sd((width,), jnp.float32), sd((width,), jnp.float32))
    args += (sd((rows, width), dtype) if gated else None,)
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3) if gated else (0, 1, 2)))
    text = grads.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2  # the forward and the backward kernel


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_input", [False, True])
def test_kernel_matches_reference(gated, with_input):
    """float32, 256 wide (one chunk), 96 rows in 4-row steps: 24 row blocks over 24 CTAs (the api's grid)."""
    x, gate, scale, bias, probe, probe_x = _inputs(0, (96, 256), jnp.float32)
    gate = gate if gated else None
    ref = _value_and_grads("reference", x, gate, scale, bias, probe, probe_x, with_input)
    out = _value_and_grads(
        "mosaic", x, gate, scale, bias, probe, probe_x, with_input, interpret=True, rows_per_block=4
    )
    _check(ref, out, 2e-5)


def test_bf16_with_gate_and_residual():
    """bf16 rows of 512 (two chunks), the gate and the residual's gradient together."""
    x, gate, scale, bias, probe, probe_x = _inputs(1, (64, 512), jnp.bfloat16)
    ref = _value_and_grads("reference", x, gate, scale, bias, probe, probe_x, True)
    out = _value_and_grads("mosaic", x, gate, scale, bias, probe, probe_x, True, interpret=True)
    _check(ref, out, 3e-2)


def test_bf16_output_from_a_float32_residual_stream():
    """out_dtype=bf16 on float32 x (the HSTU input norm): y is the reference's bf16 y; x's gradient, with the
    residual's, stays float32."""
    x, _, scale, bias, probe, probe_x = _inputs(2, (64, 128), jnp.float32)

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
            return jnp.sum(y.astype(jnp.float32) * probe) + jnp.sum(passed * probe_x)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, scale, bias)

    ref, out = run("reference"), run("mosaic")
    assert out[1][0].dtype == jnp.float32
    _check(ref, out, 1e-3)


@pytest.mark.parametrize("shape", [(37, 96), (2, 3, 5, 160)])
def test_odd_row_counts_are_padded(shape):
    """37 and 30 rows (no multiple of 4) are padded with zero rows up to a whole step; widths 96 and 160 are
    one chunk of 1- and 2-element vectors per lane. Values and gradients are the reference's, in x's shape."""
    x, gate, scale, bias, probe, probe_x = _inputs(3, shape, jnp.float32)
    ref = _value_and_grads("reference", x, gate, scale, bias, probe, probe_x, True)
    out = _value_and_grads("mosaic", x, gate, scale, bias, probe, probe_x, True, interpret=True)
    _check(ref, out, 2e-5)


def test_several_blocks_per_cta_around_the_ring():
    """The kernels themselves with 2 CTAs of 2 stages over 11 blocks of 8 rows (6 and 5 blocks each: every
    ring slot refilled), 384 wide (two chunks of 192)."""
    x, gate, scale, bias, probe, probe_x = _inputs(4, (88, 384), jnp.float32)
    dy, d_res = probe, probe_x
    params = NormParams(
        rows=8, eps=1e-6, has_gate=True, has_residual=True, out_dtype="float32", interpret=True,
        family="mosaic", stages=2, num_ctas=2,
    )  # fmt: skip
    with api._interpreter(params):
        y = jax.jit(gpu_sm90.forward, static_argnums=4)(x, scale, bias, gate, params)
        grads = jax.jit(gpu_sm90.backward, static_argnums=6)(x, scale, bias, gate, dy, d_res, params)
    y_ref, pull = jax.vjp(lambda *a: layer_norm_reference(*a), x, scale, bias, gate)
    want = list(pull(dy))
    want[0] = want[0] + d_res
    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-5)
    for name, got, w in zip(["dx", "dscale", "dbias", "dgate"], grads, want):
        np.testing.assert_allclose(
            got, w, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(w).max())), err_msg=name
        )


def test_under_vmap_as_the_model_runs_it():
    """The model vmaps its packs: the kernels' grid gains the batch axis. Three packs of 40 rows, forward and
    backward under jit."""
    x, gate, scale, bias, probe, probe_x = _inputs(5, (3, 40, 128), jnp.float32)

    def run(implementation):
        def loss(x, scale, bias, gate):
            def pack(x, gate, probe):
                out = layer_norm(
                    x,
                    scale,
                    bias,
                    gate,
                    implementation=implementation,
                    interpret=implementation != "reference",
                )
                return jnp.sum(out * probe)

            return jnp.sum(jax.vmap(pack)(x, gate, probe))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, scale, bias, gate)

    _check(run("reference"), run("mosaic"), 2e-5)


def test_rows_per_block_must_be_a_multiple_of_4_that_divides_the_rows():
    x = jnp.zeros((24, 128))
    for rows in (6, 16):
        with pytest.raises(ValueError, match="rows_per_block"):
            layer_norm(
                x, jnp.ones(128), jnp.zeros(128), implementation="mosaic", interpret=True, rows_per_block=rows
            )


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_wide_rows_many_blocks(dtype, tol):
    """hstu_nvidia's width, 1024 (four chunks), 520 rows with the api's default tiles, gate and residual."""
    x, gate, scale, bias, probe, probe_x = _inputs(6, (520, 1024), dtype)
    ref = _value_and_grads("reference", x, gate, scale, bias, probe, probe_x, True)
    out = _value_and_grads("mosaic", x, gate, scale, bias, probe, probe_x, True, interpret=True)
    _check(ref, out, tol)


@pytest.mark.slow
def test_the_hstu_model_runs_the_mosaic_kernels_with_the_same_function():
    """The HSTU layers' norms (128 and 64 wide, float32) through the Mosaic GPU kernels in the interpreter
    (model.norm_implementation = "mosaic", as a Hopper run names them): the logits and the gradients of every
    parameter are the reference norms'."""
    from flax import nnx

    from tests.helpers import model_logits_and_grads, small_config

    wide = (
        "model.model_dim=128",
        "model.attention_dim=32",
        "model.value_dim=32",
        "precision.compute_dtype=float32",
    )
    results = {}
    for impl in ("reference", "mosaic"):
        c = small_config(*wide, f'model.norm_implementation="{impl}"', "model.interpret_kernels=true")
        model, logits, grads = model_logits_and_grads(c)
        results[impl] = logits, nnx.to_flat_state(grads)
    assert model.tower.layers[0].attn_norm.implementation == "mosaic" and model.tower.final_norm.interpret
    (ref_logits, ref_grads), (logits, grads) = results["reference"], results["mosaic"]
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
    for (path, a), (_, b) in zip(ref_grads, grads):
        a, b = (np.asarray(v.get_value() if hasattr(v, "get_value") else v[...]) for v in (a, b))
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5 * max(1.0, np.abs(a).max()), err_msg=str(path))


def test_no_rows_need_no_kernel():
    """A 0-row x has no kernel grid: it takes the reference, shapes kept."""
    for implementation in ("mosaic", "triton"):
        y = layer_norm(
            jnp.zeros((2, 0, 128)),
            jnp.ones(128),
            jnp.zeros(128),
            implementation=implementation,
            interpret=True,
        )
        assert y.shape == (2, 0, 128)
