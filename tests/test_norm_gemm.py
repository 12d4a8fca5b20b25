"""The fused norm-GEMM-SiLU (pallas_kernels/norm_gemm): the Hopper kernel's lowering at the shipped configs'
shapes, one output tile in the Mosaic GPU interpreter against the reference, and the hand-written backward
against autodiff of the reference.

Not covered on CPU (a finding, not a choice): with more than one output tile the Mosaic GPU interpreter of
jax 0.10.2 stops making progress (all threads wait; jax's own hopper_matmul_mgpu runs 32 tiles there), so
the persistent loop's tile-to-tile hand-over is checked only on the device (`bench norm_gemm` checks
against the reference before timing).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norm_gemm import api, norm_silu_gemm
from pallas_kernels.norm_gemm.gpu_sm90 import Tiles, norm_silu_gemm_sm90
from pallas_kernels.norm_gemm.reference import norm_silu_gemm_reference, row_stats


def _inputs(m, k, widths, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    n = sum(widths)
    x = jax.random.normal(ks[0], (m, k)) * 3 + 1  # an offset mean: the normalisation must remove it
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (k,))
    beta = 0.1 * jax.random.normal(ks[2], (k,))
    w = (jax.random.normal(ks[3], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    b = 0.1 * jax.random.normal(ks[4], (n,))
    return x, gamma, beta, w, b


@pytest.mark.parametrize("m,k,widths", [(196608, 512, (512,) * 4), (65536, 1024, (1024,) * 4)])
def test_lowers_to_mosaic_gpu(m, k, widths):
    """gem_h200's and hstu_nvidia's uvqk GEMMs: the whole Pallas -> Mosaic GPU lowering with the default
    tiles, shared-memory budget included (a layout, transfer or size Mosaic GPU rejects raises here)."""
    sd = jax.ShapeDtypeStruct
    n = sum(widths)
    args = (sd((m, k), jnp.float32), sd((2, m), jnp.float32), sd((2, k), jnp.float32))
    args += (sd((k, n), jnp.bfloat16), sd((n,), jnp.float32))
    lowered = (
        jax.jit(lambda *a: norm_silu_gemm_sm90(*a, widths)).trace(*args).lower(lowering_platforms=("cuda",))
    )
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.slow
def test_one_tile_in_the_interpreter_matches_the_reference():
    """One output tile (both consumers, the producer's K ring, the prologue, bias, SiLU and the stores of z
    and of the piece) against the reference, on rows whose mean is far from 0."""
    x, gamma, beta, w, b = _inputs(128, 128, (64,))
    with api._interpreter():
        pieces, z = norm_silu_gemm_sm90(
            x, row_stats(x), jnp.stack([gamma, beta]), w, b, (64,), Tiles(64, 64, 64, 2, 1), interpret=True
        )
    want_pieces, want_z = norm_silu_gemm_reference(x, gamma, beta, w, b, (64,))
    for got, want in zip((*pieces, z), (*want_pieces, want_z)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # one bf16 rounding of z apart (the kernel adds b before rounding, the reference after)
        np.testing.assert_allclose(got, want, atol=0.05, rtol=0.02)


def test_backward_matches_autodiff_of_the_reference():
    """The kernel path's backward (api._fused_bwd, from the saved z and row statistics) against jax.vjp of
    the reference, for every input."""
    widths = (32, 32, 64, 64)
    x, gamma, beta, w, b = _inputs(64, 96, widths, seed=1)
    want_pieces, z = norm_silu_gemm_reference(x, gamma, beta, w, b, widths)
    cotangents = tuple(
        jax.random.normal(jax.random.key(7 + i), p.shape, p.dtype) for i, p in enumerate(want_pieces)
    )
    _, vjp = jax.vjp(lambda *a: norm_silu_gemm_reference(*a, widths)[0], x, gamma, beta, w, b)
    want = vjp(cotangents)
    saved = ((x, row_stats(x), gamma, beta, w, z), b.dtype)
    got = api._fused_bwd(widths, "gpu", None, saved, cotangents)
    for name, g, r in zip(("x", "gamma", "beta", "w", "b"), got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == r.shape, name
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r), name


def test_off_hopper_runs_the_reference_and_checks_its_arguments():
    """On CPU (None or "gpu" without a Hopper GPU) the call is the reference, differentiable by autodiff;
    shapes that do not fit are refused naming the argument."""
    widths = (64, 64)
    x, gamma, beta, w, b = _inputs(32, 64, widths)
    assert api.kernel_for(None, x.shape, widths)[0] == "reference"
    got = norm_silu_gemm(x, gamma, beta, w, b, widths)
    want = norm_silu_gemm_reference(x, gamma, beta, w, b, widths)[0]
    for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))

    def loss(x):
        return sum(p.astype(jnp.float32).sum() for p in norm_silu_gemm(x, gamma, beta, w, b, widths))

    grads = jax.grad(loss)(x)
    assert np.isfinite(np.asarray(grads)).all()
    with pytest.raises(ValueError, match="widths"):
        norm_silu_gemm(x, gamma, beta, w, b, (64, 32))
    with pytest.raises((ValueError, TypeError)):  # jaxtyping refuses it at the boundary first
        norm_silu_gemm(x[0], gamma, beta, w, b, widths)


def test_interpret_tiles_fit_only_whole_tiles():
    """The kernel runs only where its tiles divide the shape (else the reference): M by 2 * block_m, K by
    block_k, each width by block_n."""
    tiles = Tiles(64, 64, 64, 2, 1)
    assert tiles.applies(128, 128, (64, 128))
    assert not tiles.applies(96, 128, (64,))
    assert not tiles.applies(128, 96, (64,))
    assert not tiles.applies(128, 128, (32, 96))
    assert api.kernel_for("interpret", (256, 128), (64, 64))[0] == "gpu_interpret"
    assert api.kernel_for("interpret", (200, 128), (64, 64))[0] == "reference"
