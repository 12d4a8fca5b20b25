"""The experimental Mosaic GPU jagged attention forward (pallas_kernels/experimental/): lowering for several
configs, and GPU interpret mode vs reference.

Lowering (`lower(lowering_platforms=("cuda",))` on CPU) runs the whole Pallas -> Mosaic GPU lowering, so a
primitive or layout Mosaic GPU rejects fails here; ptxas and the hardware only run on the device
(`python -m experiments bench mosaic_attention` checks numbers there). The interpret-mode test runs the same kernel
(producer/consumer warpgroups, barriers, TMA copies, jagged stores) on CPU with the two wgmma calls swapped for
plain dots (the interpreter has neither transposed wgmma operands nor run_state).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import shapes
from pallas_kernels.experimental import mosaic_gpu_jagged_attention as mosaic_gpu
from pallas_kernels.jagged_attention.reference import jagged_attention_reference, softmax_lse_reference


def _static(n, activation, d=128, **kw):
    return mosaic_gpu.static(n, activation, d, **kw)


def _unused(b, h):
    return (
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.zeros((h, 16), jnp.float32),
        jnp.zeros((h, 16), jnp.float32),
    )


@pytest.mark.parametrize(
    "activation,block_k,stages,n,num_ctas,pingpong,half_diag,window,targets",
    [
        ("silu", 128, 2, 1024, 132, True, True, 0, False),
        ("silu", 64, 3, 4096, None, False, False, 100, True),
        ("softmax", 128, 2, 4096, 132, True, False, 0, False),
        ("softmax", 64, 2, 200, None, True, True, 0, True),
        ("softmax", 128, 2, 1024, 132, True, True, 300, True),
    ],
)
def test_lowers_to_mosaic_gpu(activation, block_k, stages, n, num_ctas, pingpong, half_diag, window, targets):
    t, h, d, b = 3000, 4, 128, 7
    sd = jax.ShapeDtypeStruct
    args = (
        (sd((t, h, d), jnp.bfloat16),) * 3
        + (sd((b + 1,), jnp.int32),)
        + tuple(sd(x.shape, x.dtype) for x in _unused(b, h))
    )
    s = _static(n, activation, max_attn_len=window, has_targets=targets)
    f = jax.jit(
        lambda *a: mosaic_gpu.forward_mosaic_gpu(
            *a, s=s, block_k=block_k, stages=stages, num_ctas=num_ctas, pingpong=pingpong, half_diag=half_diag
        )
    )
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_supports():
    q = jnp.zeros((8, 2, 128), jnp.bfloat16)
    assert mosaic_gpu.supports(_static(256, "silu"), q, q)
    assert mosaic_gpu.supports(_static(256, "softmax"), q, q)
    assert mosaic_gpu.supports(_static(256, "silu", has_targets=True, max_attn_len=8), q, q)
    assert not mosaic_gpu.supports(_static(256, "silu", has_pos=True), q, q)
    assert not mosaic_gpu.supports(_static(256, "silu", interpret=True), q, q)
    assert not mosaic_gpu.supports(_static(256, "silu"), q[:7], q[:7])  # T % 8 != 0
    assert not mosaic_gpu.supports(_static(256, "silu"), q.astype(jnp.float32), q.astype(jnp.float32))
    q64 = jnp.zeros((8, 2, 64), jnp.bfloat16)
    assert not mosaic_gpu.supports(_static(256, "silu", alpha=0.125), q64, q64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "activation,block_k,num_ctas,pingpong,half_diag,window",
    [("silu", 64, 1, False, False, 40), ("softmax", 128, 1, True, True, 0)],
)
def test_interpret_matches_reference(activation, block_k, num_ctas, pingpong, half_diag, window):
    """num_ctas=1: one persistent CTA walks every item (the K/V ring and barrier phases run on across items).

    The one-CTA-per-item grid (num_ctas=None) is only lowered here: the interpreter runs its many mostly idle
    CTAs one after another, which takes minutes.
    """
    from jax._src.pallas.mosaic_gpu.interpret import params as gp

    # softmax: a 2-tile sequence whose second consumer holds 2 rows, an empty one, length 1, one ending mid-tile;
    # silu (64-key tiles, slower to interpret): shorter, still both consumers, window edges and unaligned starts
    lengths = [130, 0, 1, 70] if activation == "softmax" else [100, 0, 1, 37]
    n, d = shapes.MOSAIC_SMALL.max_seq_len, shapes.MOSAIC_SMALL.head_dim
    h = 1  # the interpreter runs one head at a time
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = (int(offsets[-1]) + 20 + 7) // 8 * 8  # capacity past offsets[B], a multiple of mosaic_gpu.ALIGN
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16) for _ in range(3))
    targets = jnp.asarray(rng.integers(0, 40, size=len(lengths)), jnp.int32)
    s = _static(n, activation, max_attn_len=window, has_targets=True)
    # TMA zero-fills boxes past the array: the interpreter's "uninitialized" reads with zero fill do the same
    params = gp.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    with gp.force_gpu_interpret_mode(params):
        o, lse = mosaic_gpu.forward_mosaic_gpu(
            q,
            k,
            v,
            jnp.asarray(offsets),
            targets,
            *_unused(len(lengths), h)[1:],
            s=s,
            block_k=block_k,
            stages=3 if block_k == 64 else 2,
            num_ctas=num_ctas,
            pingpong=pingpong,
            half_diag=half_diag,
            interpret=True,
        )
    want = jagged_attention_reference(
        q,
        k,
        v,
        jnp.asarray(offsets),
        max_seq_len=n,
        activation=activation,
        num_targets=targets,
        max_attn_len=window,
    )
    o, want = np.asarray(o, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(o).all()
    assert np.linalg.norm(o - want) / np.linalg.norm(want) < 1e-2
    assert not o[offsets[-1] :].any()
    if activation == "softmax":
        lse_want = softmax_lse_reference(q, k, offsets, n, s.alpha, targets, window)
        np.testing.assert_allclose(np.asarray(lse)[:, : offsets[-1]], lse_want[:, : offsets[-1]], atol=1e-2)
