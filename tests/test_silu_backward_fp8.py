"""The SiLU-backward FP8 kernel (Pallas interpret mode) against its jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from pallas_kernels.silu_backward_fp8 import silu_backward_fp8
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
    got = silu_backward_fp8(dys, z, scale, implementation="interpret")
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
    """Pieces of different widths, or rows its tile does not divide: same answer from the reference."""
    for rows, widths in ((48, (16, 32, 16)), (36, (16, 16))):
        dys, z = _inputs(1, rows, widths)
        got = silu_backward_fp8(dys, z, jnp.float32(1e-3), implementation="interpret")
        want = silu_backward_fp8_reference(dys, z, jnp.float32(1e-3))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_f32(a), _f32(b))


def test_bad_shapes_are_errors():
    dys, z = _inputs(2, 16, (16, 16))
    with pytest.raises(ValueError, match="must add up"):
        silu_backward_fp8(dys[:1], z, 1.0)
    with pytest.raises((ValueError, TypeCheckError), match=r"M"):  # jaxtyping's hook (tests) or ours
        silu_backward_fp8((dys[0][:8], dys[1]), z, 1.0)
