"""The SiLU-backward FP8 kernels against their jnp reference: the Triton kernel (gpu.py) in Pallas interpret
mode, and the Mosaic GPU kernel (gpu_sm90.py) in the Mosaic GPU interpreter (8 CPU devices from conftest.py:
its XLA:CPU thread pool) and lowered for the GPU (`lower(lowering_platforms=("cuda",))` on CPU runs the whole
Pallas -> Mosaic GPU lowering: register layouts, the transposed store, TMA boxes; ptxas and the hardware only on
the GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from pallas_kernels.silu_backward_fp8 import api, silu_backward_fp8
from pallas_kernels.silu_backward_fp8.reference import E5M2, silu_backward_fp8_reference, silu_grad


def _inputs(seed, rows, widths, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(seed), len(widths) + 1)
    dys = tuple(jax.random.normal(k[i], (rows, w)).astype(dtype) for i, w in enumerate(widths))
    z = (3 * jax.random.normal(k[-1], (rows, sum(widths)))).astype(dtype)
    return dys, z


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


@pytest.mark.parametrize("clip", [False, True])
def test_kernel_matches_reference(clip):
    """q, q^T, amax and column sums of the interpret-mode kernel equal the reference's. With `clip` the
    scale is 4x too small, so the largest quarter of the range saturates at e5m2's max (never inf)."""
    dys, z = _inputs(0, 48, (32, 32, 32, 32))
    amax = float(jnp.max(jnp.abs(silu_grad(jnp.concatenate(dys, 1), z))))
    scale = jnp.float32(amax / float(jnp.finfo(E5M2).max) / (4 if clip else 1))
    want = silu_backward_fp8_reference(dys, z, scale)
    got = silu_backward_fp8(dys, z, scale, implementation="triton", interpret=True)
    np.testing.assert_array_equal(_f32(got[0]), _f32(want[0]))
    np.testing.assert_array_equal(_f32(got[1]), _f32(got[0]).T)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)
    np.testing.assert_allclose(_f32(got[3]), _f32(want[3]), rtol=1e-5, atol=1e-5)
    q = _f32(got[0])
    assert np.isfinite(q).all()
    at_max = int(np.sum(np.abs(q) == float(jnp.finfo(E5M2).max)))
    assert at_max > 20 if clip else at_max <= 2, at_max
    # And the reference is the math: q * scale is g to e5m2's precision where nothing clipped.
    g = _f32(silu_grad(jnp.concatenate(dys, 1), z))
    if not clip:
        assert np.abs(q * float(scale) - g).max() <= 0.125 * np.abs(g).max()
    np.testing.assert_allclose(_f32(want[3]), g.sum(0), rtol=1e-5, atol=1e-4)


def test_shapes_the_kernel_does_not_take_run_the_reference():
    """Pieces of different widths, or rows its tile does not divide: the default order runs the reference (same
    answer); Triton by name refuses them, naming why."""
    for rows, widths in ((48, (16, 32, 16)), (36, (16, 16))):
        dys, z = _inputs(1, rows, widths)
        got = silu_backward_fp8(dys, z, jnp.float32(1e-3), interpret=True)
        want = silu_backward_fp8_reference(dys, z, jnp.float32(1e-3))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_f32(a), _f32(b))
        with pytest.raises(
            ValueError, match="implementation='triton' does not take this call: (pieces|Triton)"
        ):
            silu_backward_fp8(dys, z, jnp.float32(1e-3), implementation="triton", interpret=True)


def test_bad_shapes_are_errors():
    dys, z = _inputs(2, 16, (16, 16))
    with pytest.raises(ValueError, match="must add up"):
        silu_backward_fp8(dys[:1], z, 1.0)
    with pytest.raises((ValueError, TypeCheckError), match=r"M"):  # jaxtyping's hook (tests) or ours
        silu_backward_fp8((dys[0][:8], dys[1]), z, 1.0)


def test_which_kernel_runs():
    """The Triton kernel is the default on every GPU, Hopper included (the Mosaic one is not measured yet), the
    reference on CPU and TPU; the Mosaic kernel runs when named; the old aliases are refused."""
    rows, widths = 192, (128,) * 4
    assert api.kernel_for(rows, widths, None)[0] == "reference"
    assert api.kernel_for(rows, widths, None, interpret=True)[0] == "triton"
    assert api.kernel_for(rows, widths, "mosaic", interpret=True)[0] == "mosaic"
    assert api.kernel_for(rows, widths, "mosaic")[0] == "mosaic"
    for platform, name in (
        ("hopper", "triton"),
        ("gpu", "triton"),
        ("tpu", "reference"),
        ("cpu", "reference"),
    ):
        assert api.kernel_for(rows, widths, None, platform=platform)[0] == name, platform
    assert api.kernels_in_use(rows, widths, "triton", interpret=True) == "triton (interpret)"
    for old in ("pallas", "gpu", "interpret", "mosaic_interpret"):
        with pytest.raises(ValueError, match="must be None or one of"):
            api.kernel_for(rows, widths, old)


@pytest.mark.parametrize(
    "rows,widths,tiles,clip",
    [
        ((192, (64, 64, 64, 64), {}, False)),  # 3 row blocks, 2 column blocks (of 32) a piece
        ((192, (64, 64, 64, 64), {}, True)),  # the largest quarter saturates
        ((256, (128, 128), {"block_rows": 128, "block_cols": 64}, False)),
    ],
)
def test_mosaic_kernel_matches_reference(rows, widths, tiles, clip):
    """The Mosaic GPU kernel in its interpreter: q bit for bit (the same float32 math and rounding), q^T its
    transpose, amax and the column sums to float32 rounding."""
    dys, z = _inputs(3, rows, widths)
    amax = float(jnp.max(jnp.abs(silu_grad(jnp.concatenate(dys, 1), z))))
    scale = jnp.float32(amax / float(jnp.finfo(E5M2).max) / (4 if clip else 1))
    want = silu_backward_fp8_reference(dys, z, scale)
    got = silu_backward_fp8(dys, z, scale, implementation="mosaic", interpret=True, **tiles)
    assert [a.shape for a in got] == [a.shape for a in want]
    assert got[0].dtype == got[1].dtype == E5M2
    np.testing.assert_array_equal(_f32(got[0]), _f32(want[0]))
    np.testing.assert_array_equal(_f32(got[1]), _f32(want[1]))
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)
    np.testing.assert_allclose(_f32(got[3]), _f32(want[3]), rtol=1e-5, atol=1e-5)
    at_max = int(np.sum(np.abs(_f32(got[0])) == float(jnp.finfo(E5M2).max)))
    assert at_max > 20 if clip else at_max <= 2, at_max


def test_mosaic_refuses_what_it_does_not_take():
    """Named explicitly, the Mosaic kernel does not fall back: pieces of different widths, rows no multiple of
    its 64-row blocks, and num_warps (it has one warpgroup) are errors."""
    for rows, widths, kw in ((128, (32, 64), {}), (96, (64, 64), {}), (128, (64, 64), {"num_warps": 4})):
        dys, z = _inputs(4, rows, widths)
        with pytest.raises(ValueError, match="Mosaic GPU"):
            silu_backward_fp8(dys, z, jnp.float32(1e-3), implementation="mosaic", interpret=True, **kw)


@pytest.mark.parametrize("tiles", [{}, {"block_rows": 128, "block_cols": 64}, {"block_cols": 256}])
def test_mosaic_lowers_for_the_gpu(tiles):
    """gem_h200's uvqk SiLU backward (196,608 rows, 4 pieces of 512, bf16) through the api, lowered for the
    GPU: a layout, transposed store, TMA box or shared-memory size Mosaic GPU rejects raises here."""
    sd = jax.ShapeDtypeStruct
    rows, width = 196_608, 512
    dys = tuple(sd((rows, width), jnp.bfloat16) for _ in range(4))

    def f(dys, z, scale):
        return silu_backward_fp8(dys, z, scale, implementation="mosaic", **tiles)

    lowered = jax.jit(f).trace(dys, sd((rows, 4 * width), jnp.bfloat16), sd((), jnp.float32))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    q, qt, amax, sums = lowered.out_info
    assert (q.shape, qt.shape, amax.shape, sums.shape) == (
        (rows, 4 * width),
        (4 * width, rows),
        (),
        (4 * width,),
    )
