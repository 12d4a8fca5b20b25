"""The fused norm-GEMM-SiLU (pallas_kernels/norm_gemm): the Hopper kernel's lowering at the shipped configs'
shapes; the kernel in the Mosaic GPU interpreter against the reference (one output tile; several in M and in
N over two pieces; two persistent CTAs each looping over tiles, with more K steps than ring stages; the api
under jax.jit, forward and gradient through the custom_vjp); the hand-written backward against autodiff of
the reference.

Why the interpreter runs need tests/conftest.py's 8 fake CPU devices: the interpreter runs each of the
kernel's three warpgroups as an XLA program whose callbacks XLA:CPU may run on its intra-op thread pool, and
a callback waiting at a barrier holds its pool thread. The pool has max(NPROC or the cores, CPU devices)
threads; with the 2 of a 2-core machine two waiting warpgroups leave none for the third, and the run stops
for good (what was earlier taken for a multi-tile stall of the kernel: one tile only passed when the
producer happened to get a thread first). conftest's devices make it 8; mosaic_common.interpreter() refuses
fewer than pool_threads_needed(api.WARPGROUPS) instead of hanging.

The interpreter runs TMA loads eagerly and wgmma synchronously, so it cannot see an asynchronous wgmma still
reading a ring slot that a TMA load overwrites (gpu_sm90.py's last-k-step wait is argued there, not
tested here).
"""

import contextlib
import faulthandler
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic_common
from pallas_kernels.norm_gemm import api, norm_silu_gemm
from pallas_kernels.norm_gemm.gpu_sm90 import norm_silu_gemm_sm90
from pallas_kernels.norm_gemm.reference import norm_silu_gemm_reference, row_stats
from pallas_kernels.norm_gemm.tiles import Tiles


def _inputs(m, k, widths, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    n = sum(widths)
    x = jax.random.normal(ks[0], (m, k)) * 3 + 1  # an offset mean: the normalisation must remove it
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (k,))
    beta = 0.1 * jax.random.normal(ks[2], (k,))
    w = (jax.random.normal(ks[3], (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    b = 0.1 * jax.random.normal(ks[4], (n,))
    return x, gamma, beta, w, b


@contextlib.contextmanager
def _fail_rather_than_hang(seconds: float = 240):
    """Ends the process, printing every thread's stack, if the block runs longer than `seconds`: a barrier
    misuse raises in one interpreted warpgroup and leaves the others waiting forever (the interpreter does
    not wake them), so a kernel synchronisation bug would otherwise hang the run, not fail it."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _interpreter(detect_races: bool = False):
    return mosaic_common.interpreter(True, warpgroups=api.WARPGROUPS, detect_races=detect_races)


def _close_to_reference(pieces, z, x, gamma, beta, w, b, widths):
    want_pieces, want_z = norm_silu_gemm_reference(x, gamma, beta, w, b, widths)
    assert len(pieces) == len(widths)
    for got, want in zip((*pieces, z), (*want_pieces, want_z)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert got.shape == want.shape
        # one bf16 rounding of z apart (the kernel adds b before rounding, the reference after)
        np.testing.assert_allclose(got, want, atol=0.05, rtol=0.02)


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
    with _fail_rather_than_hang(), _interpreter():
        pieces, z = norm_silu_gemm_sm90(
            x, row_stats(x), jnp.stack([gamma, beta]), w, b, (64,), Tiles(64, 64, 64, 2, 1), interpret=True
        )
        jax.block_until_ready(z)
    _close_to_reference(pieces, z, x, gamma, beta, w, b, (64,))


@pytest.mark.slow
def test_tiles_in_m_and_n_over_two_pieces_in_the_interpreter():
    """Four output tiles (2 in M x 2 in N, one per piece) walked by one persistent CTA: the tile-to-tile
    hand-over of the K ring, the per-tile statistics/bias loads and the epilogue's staging buffer, with the
    interpreter's shared-memory race detector on."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    widths = (64, 64)
    x, gamma, beta, w, b = _inputs(256, 128, widths, seed=2)
    with _fail_rather_than_hang(), _interpreter(detect_races=True):
        pieces, z = norm_silu_gemm_sm90(
            x, row_stats(x), jnp.stack([gamma, beta]), w, b, widths, Tiles(64, 64, 64, 2, 1), interpret=True
        )
        jax.block_until_ready(z)
    assert not gpu_callbacks.get_races().races_found
    _close_to_reference(pieces, z, x, gamma, beta, w, b, widths)


@pytest.mark.slow
def test_two_ctas_loop_over_tiles_with_more_k_steps_than_stages_in_the_interpreter():
    """Nine output tiles (3 in M x 3 in N, the second piece two tiles wide) over two persistent CTAs (5 and
    4 tiles each), 5 K steps through a ring of 3 (slots 0 and 1 serve two steps a tile, slot 2 one: their
    barriers' phases move differently from tile to tile)."""
    widths = (64, 128)
    x, gamma, beta, w, b = _inputs(384, 320, widths, seed=3)
    with _fail_rather_than_hang(), _interpreter():
        pieces, z = norm_silu_gemm_sm90(
            x, row_stats(x), jnp.stack([gamma, beta]), w, b, widths, Tiles(64, 64, 64, 3, 2), interpret=True
        )
        jax.block_until_ready(z)
    _close_to_reference(pieces, z, x, gamma, beta, w, b, widths)


@pytest.mark.slow
def test_api_under_jit_forward_and_gradient_in_the_interpreter():
    """norm_silu_gemm(implementation="mosaic", interpret=True) under jax.jit (4 tiles, 3 K steps through 2 stages):
    its pieces against the reference, and jax.grad through its custom_vjp against autodiff of the
    reference, for every input."""
    widths = (64, 64)
    x, gamma, beta, w, b = _inputs(256, 192, widths, seed=4)
    assert api.kernels_for(x, w, widths, "mosaic", interpret=True) == ("mosaic", "mosaic")
    weights = [jax.random.normal(jax.random.key(11 + i), (256, wd)) for i, wd in enumerate(widths)]

    def loss(fn):
        def f(*args):
            return sum((p.astype(jnp.float32) * c).sum() for p, c in zip(fn(*args, widths), weights))

        return f

    kernel = functools.partial(norm_silu_gemm, implementation="mosaic", interpret=True)
    args = (x, gamma, beta, w, b)
    with _fail_rather_than_hang():
        got = jax.jit(lambda *a: kernel(*a, widths))(*args)
        grads = jax.jit(jax.grad(loss(kernel), argnums=range(5)))(*args)
        got, grads = jax.block_until_ready((got, grads))
    want = norm_silu_gemm_reference(x, gamma, beta, w, b, widths)[0]
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=0.05, rtol=0.02)

    reference = jax.grad(loss(lambda *a: norm_silu_gemm_reference(*a)[0]), argnums=range(5))(*args)
    for name, g, r, a in zip(("x", "gamma", "beta", "w", "b"), grads, reference, args):
        assert g.shape == r.shape and g.dtype == a.dtype, name
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r), name


def test_interpreter_refuses_a_thread_pool_it_would_hang_in(monkeypatch):
    """The run's pool (conftest's 8 fake devices) is large enough; a smaller one is refused, naming the fix,
    rather than left to wait forever."""
    assert mosaic_common.xla_cpu_pool_threads() >= mosaic_common.pool_threads_needed(api.WARPGROUPS)
    monkeypatch.setattr(mosaic_common, "xla_cpu_pool_threads", lambda: 2)
    with pytest.raises(RuntimeError, match="NPROC=8"):
        _interpreter()
    assert mosaic_common.pool_threads_needed(1) == 1  # one warpgroup waits on nobody


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
    saved = (x, row_stats(x), gamma, beta, w, z)
    got = api._fused_bwd(
        api._Plan(widths, "reference", False, api.INTERPRET_TILES, b.dtype), saved, cotangents
    )
    for name, g, r in zip(("x", "gamma", "beta", "w", "b"), got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == r.shape, name
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r), name


def test_off_hopper_runs_the_reference_and_checks_its_arguments():
    """On CPU (None: no Hopper GPU) the call is the reference, differentiable by autodiff; shapes that do not
    fit are refused naming the argument, and so is the Mosaic kernel by name where its tiles do not fit."""
    widths = (64, 64)
    x, gamma, beta, w, b = _inputs(32, 64, widths)
    assert api.kernels_for(x, w, widths, None) == ("reference", "reference")
    assert api.kernels_for(x, w, widths, None, platform="hopper") == ("reference", "reference")
    with pytest.raises(ValueError, match="implementation='mosaic' does not take this call: .*tiles"):
        norm_silu_gemm(x, gamma, beta, w, b, widths, implementation="mosaic", interpret=True)
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
    """The kernel runs only where its tiles divide the shape (else the default order goes on to the reference):
    M by 2 * block_m, K by block_k, each width by block_n."""
    tiles = Tiles(64, 64, 64, 2, 1)
    assert tiles.applies(128, 128, (64, 128))
    assert not tiles.applies(96, 128, (64,))
    assert not tiles.applies(128, 96, (64,))
    assert not tiles.applies(128, 128, (32, 96))
    sd = jax.ShapeDtypeStruct
    w = sd((128, 128), jnp.bfloat16)
    hopper = dict(interpret=True, platform="hopper")
    assert api.kernels_for(sd((256, 128), jnp.float32), w, (64, 64), None, **hopper) == ("mosaic", "mosaic")
    assert api.kernels_for(sd((200, 128), jnp.float32), w, (64, 64), None, **hopper)[0] == "reference"
    assert api.kernels_for(sd((256, 128), jnp.bfloat16), w, (64, 64), None, **hopper)[0] == "reference"  # x
    assert api.kernels_in_use(sd((256, 128), jnp.float32), w, (64, 64), "mosaic", interpret=True) == (
        "mosaic (interpret)",
        "mosaic (interpret)",
    )
