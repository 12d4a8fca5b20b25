"""The norm-GEMM-SiLU's backward kernel (pallas_kernels/norm_gemm/gpu_sm90_backward.py: dz = dy * SiLU'(z) in
the prologue of dxn = dz W^T, dz stored once, the bias gradient's column-sum partials): its lowering at the
shipped configs' shapes, its runs in the Mosaic GPU interpreter against reference.silu_backward_reference
(several output tiles, more tiles than CTAs, several K steps over pieces of two widths), and api's backward with
it against autodiff of the reference. Not run on a GPU here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mosaic_common import interpreter
from pallas_kernels.norm_gemm import api, norm_silu_gemm
from pallas_kernels.norm_gemm.gpu_sm90_backward import silu_gemm_backward_sm90
from pallas_kernels.norm_gemm.reference import norm_silu_gemm_reference, row_stats, silu_backward_reference
from pallas_kernels.norm_gemm.tiles import BackwardTiles


def _backward_inputs(m, d, widths, seed=0):
    ks = jax.random.split(jax.random.key(seed), 2 + len(widths))
    n = sum(widths)
    z = (2 * jax.random.normal(ks[0], (m, n))).astype(jnp.bfloat16)  # SiLU' varies most over |z| < 4
    w = (jax.random.normal(ks[1], (d, n)) / np.sqrt(n)).astype(jnp.bfloat16)
    d_pieces = tuple(jax.random.normal(k, (m, wd)).astype(jnp.bfloat16) for k, wd in zip(ks[2:], widths))
    return d_pieces, z, w


def _layer_inputs(m, k, n, seed):
    """The forward's (x, gamma, beta, w, b): rows with a mean far from 0, W scaled to keep z of order 1."""
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (m, k)) * 3 + 1
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (k,))
    beta = 0.1 * jax.random.normal(ks[2], (k,))
    w = (jax.random.normal(ks[3], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    return x, gamma, beta, w, 0.1 * jax.random.normal(ks[4], (n,))


def _lower(m, d, widths, tiles):
    sd = jax.ShapeDtypeStruct
    n = sum(widths)
    args = (
        tuple(sd((m, wd), jnp.bfloat16) for wd in widths),
        sd((m, n), jnp.bfloat16),
        sd((d, n), jnp.bfloat16),
    )
    fn = jax.jit(lambda dp, z, w: silu_gemm_backward_sm90(dp, z, w, tiles))
    return fn.trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("m,d,widths", [(196608, 512, (512,) * 4), (65536, 1024, (1024,) * 4)])
def test_lowers_to_mosaic_gpu(m, d, widths):
    """gem_h200's and hstu_nvidia's uvqk backward: the whole Pallas -> Mosaic GPU lowering with the default
    tiles (217 KiB of shared memory); a layout, transfer or size Mosaic GPU rejects raises here."""
    assert "mosaic_gpu" in _lower(m, d, widths, BackwardTiles()).as_text()


def test_a_fourth_stage_exceeds_shared_memory():
    """The module docstring's budget: a 64 KiB ring slot more does not fit in the 227 KiB."""
    with pytest.raises(ValueError, match="shared memory"):
        _lower(65536, 1024, (1024,) * 4, BackwardTiles(stages=4))


def _check(got, want):
    """dz within one bf16 rounding (the kernel's sigmoid is tanh.approx's on a GPU); dxn and db relative to
    their norms (they sum such roundings)."""
    (dxn, dz, partials), (want_dz, want_dxn, want_db) = got, want
    f = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f(dz), f(want_dz), atol=2e-2, rtol=1e-2)
    for name, g, r in (("dxn", dxn, want_dxn), ("db", f(partials).sum(0), want_db)):
        assert np.linalg.norm(f(g) - f(r)) <= 1e-2 * np.linalg.norm(f(r)), name


def _check_grads(got, want):
    """The gradients of (x, gamma, beta, w, b), each within 2% of the reference's norm."""
    for name, g, r in zip(("x", "gamma", "beta", "w", "b"), got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == r.shape, name
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r), name


def test_interpreter_matches_the_reference_over_several_tiles():
    """2 row blocks x 2 D tiles on 2 CTAs (each walks two: the ring and its barrier phases run on across
    tiles), 3 K steps over two pieces (64 and 128 wide) through a 2-slot ring; dz and the partials come from
    the first D tile only, so a wrong owner or a missed store shows as NaN (the interpreter's uninitialised
    memory) or a wrong sum."""
    d_pieces, z, w = _backward_inputs(256, 128, (64, 128))
    with interpreter(True, warpgroups=api.WARPGROUPS):
        got = silu_gemm_backward_sm90(d_pieces, z, w, BackwardTiles(64, 64, 64, 2, 2), interpret=True)
    assert got[2].shape == (256 // 64, 192)
    _check(got, silu_backward_reference(d_pieces, z, w))


def test_backward_kernel_choice():
    """By default on Hopper each direction takes the Mosaic kernel where its tiles fit: the backward's jnp
    reference after the forward kernel where only the forward's fit (D = K not a multiple of the backward's
    256-wide tiles); the Mosaic kernels by name need both to fit; the reference off Hopper."""
    sd = jax.ShapeDtypeStruct
    x, w = (lambda k: sd((256, k), jnp.float32)), (lambda k: sd((k, 256), jnp.bfloat16))
    widths = (128, 128)
    assert api.kernels_for(x(256), w(256), widths, None, platform="hopper") == ("mosaic", "mosaic")
    assert api.kernels_for(x(128), w(128), widths, None, platform="hopper") == ("mosaic", "reference")
    assert api.kernels_for(x(256), w(256), widths, None, platform="gpu") == ("reference", "reference")
    assert api.kernels_for(x(256), w(256), widths, None) == ("reference", "reference")  # this CPU
    with pytest.raises(ValueError, match="backward's tiles"):
        api.kernels_for(x(128), w(128), widths, "mosaic")
    tiles = BackwardTiles()
    assert tiles.applies(196608, 512, (512,) * 4) and tiles.applies(65536, 1024, (1024,) * 4)


@pytest.mark.slow
def test_grad_through_both_kernels_matches_autodiff_of_the_reference():
    """jax.grad of norm_silu_gemm in interpret mode (forward kernel: one tile, the interpreter's limit for it,
    two K steps; the backward kernel after it) against autodiff of the reference, for every input."""
    widths = (64,)
    x, gamma, beta, w, b = _layer_inputs(128, 128, 64, seed=3)
    dy = jax.random.normal(jax.random.key(4), (128, 64)).astype(jnp.bfloat16)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * dy.astype(jnp.float32))

    got = jax.grad(
        loss(lambda *a: norm_silu_gemm(*a, widths, implementation="mosaic", interpret=True)), argnums=range(5)
    )(x, gamma, beta, w, b)
    want = jax.grad(loss(lambda *a: norm_silu_gemm_reference(*a, widths)[0]), argnums=range(5))(
        x, gamma, beta, w, b
    )
    _check_grads(got, want)


@pytest.mark.slow  # (5 s; the fast tier's interpreter run is the one above)
def test_api_backward_with_the_kernel_matches_autodiff_of_the_reference():
    """api._fused_bwd in interpret mode (the backward kernel for dz, dxn and db; dW and LayerNorm's backward
    in jnp) from the reference's saved z, against jax.vjp of the reference, for every input."""
    widths = (64, 64)
    x, gamma, beta, w, b = _layer_inputs(128, 64, 128, seed=1)
    want_pieces, z = norm_silu_gemm_reference(x, gamma, beta, w, b, widths)
    cotangents = tuple(
        jax.random.normal(jax.random.key(9 + i), p.shape, p.dtype) for i, p in enumerate(want_pieces)
    )
    _, vjp = jax.vjp(lambda *a: norm_silu_gemm_reference(*a, widths)[0], x, gamma, beta, w, b)
    want = vjp(cotangents)
    plan = api._Plan(widths, "mosaic", True, api.INTERPRET_TILES, b.dtype)
    got = api._fused_bwd(plan, (x, row_stats(x), gamma, beta, w, z), cotangents)
    _check_grads(got, want)
