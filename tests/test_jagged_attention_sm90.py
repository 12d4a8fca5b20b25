"""The Hopper (Mosaic GPU) jagged attention forward (pallas_kernels/jagged_attention/gpu_sm90.py): the forward
the GPU backend runs by default and by name, lowering for several configs, and GPU interpret mode vs reference.

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
from pallas_kernels.jagged_attention import gpu_layout, jagged_attention
from pallas_kernels.jagged_attention import gpu_sm90 as mosaic_gpu
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.reference import jagged_attention_reference, softmax_lse_reference
from tests.helpers import on_platform


def _static(n, activation, d=128, **kw):
    return KernelParams.build(n, activation, d, **kw)


def _tables(b, h, t, num_pos=16, num_time=8):
    """gpu_layout.to_kernel_layout's (targets, ts, pos_tab, time_tab) inputs: random timestamps and tables."""
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.integers(0, 40, size=b), jnp.int32),
        jnp.asarray(rng.integers(0, 10**7, size=t), jnp.int32),
        jnp.asarray(rng.standard_normal((h, num_pos)), jnp.float32),
        jnp.asarray(
            rng.standard_normal((h + 1, num_time)), jnp.float32
        ),  # + the thresholds row (unused here)
    )


def _lowered(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "activation,d,block_k,stages,n,num_ctas,window,targets,bias",
    [
        ("silu", 128, 128, 2, 1024, 132, 0, False, False),
        ("silu", 128, 64, 3, 4096, None, 100, True, True),
        ("softmax", 128, 128, 2, 4096, 132, 0, False, True),
        ("softmax", 64, 64, 2, 200, None, 0, True, False),
        ("silu", 256, None, None, 1024, 132, 300, True, True),
    ],
)
def test_lowers_to_mosaic_gpu(activation, d, block_k, stages, n, num_ctas, window, targets, bias):
    """The whole Pallas -> Mosaic GPU lowering (layouts, shared-memory plan, the inline gathers) succeeds: a
    construct Mosaic GPU rejects raises here."""
    t, h, b = 3000, 4, 7
    sd = jax.ShapeDtypeStruct
    tables = tuple(sd(x.shape, x.dtype) for x in _tables(b, h, t))
    args = (sd((t, h, d), jnp.bfloat16),) * 3 + (sd((b + 1,), jnp.int32),) + tables
    bias_fields = dict(num_pos=16, num_time=8) if bias else {}
    params = _static(n, activation, d, max_attn_len=window, has_targets=targets, **bias_fields)
    text = _lowered(
        lambda *a: mosaic_gpu.forward_mosaic_gpu(
            *a, params=params, block_k=block_k, stages=stages, num_ctas=num_ctas
        ),
        *args,
    )
    assert text.count("mosaic_gpu") >= 1


def test_kernels_set_their_lowering_semantics():
    """The kernels ask for Lane semantics themselves (jax 0.10's default; 0.11 defaults to Warpgroup, under
    which the dQ kernel's sorted time-gradient path does not lower: a scalar comes back as a 0-d vector),
    and KernelOptions.warpgroup_semantics reaches them: the two lower to different kernels."""
    t, h, b = 1024, 2, 3
    sd = jax.ShapeDtypeStruct
    tables = tuple(sd(x.shape, x.dtype) for x in _tables(b, h, t))
    args = (sd((t, h, 128), jnp.bfloat16),) * 3 + (sd((b + 1,), jnp.int32),) + tables

    def lowered(**switches):
        params = _static(512, "silu", 128, num_pos=16, num_time=8, options=KernelOptions(**switches))
        return _lowered(lambda *a: mosaic_gpu.forward_mosaic_gpu(*a, params=params, num_ctas=132), *args)

    assert lowered() != lowered(warpgroup_semantics=True)


@pytest.mark.parametrize("implementation", [None, "triton"])
def test_gpu_backend_runs_the_named_forward(implementation):
    """On Hopper the default (None) lowers the Mosaic GPU forward and backward wherever they take the call, and
    the Triton kernels where not (head dim 32); "triton" lowers the Triton kernels only."""
    t, h = 1024, 2
    sd = jax.ShapeDtypeStruct

    def loss(q, k, v, offsets, ts, pos, tim):
        out = jagged_attention(
            q, k, v, offsets, max_seq_len=256, implementation=implementation,
            timestamps=ts, pos_bias=pos, time_bias=tim,
        )  # fmt: skip
        return out.astype(jnp.float32).sum()

    for d, mosaic in ((128, implementation is None), (32, False)):
        args = (sd((t, h, d), jnp.bfloat16),) * 3 + (
            sd((5,), jnp.int32), sd((t,), jnp.int32), sd((h, 16), jnp.float32), sd((h, 8), jnp.float32)
        )  # fmt: skip
        with on_platform("hopper"):
            text = _lowered(jax.grad(loss, argnums=(0, 1, 2, 5, 6)), *args)
        assert ("mosaic_gpu" in text) == mosaic, (d, implementation)
        assert ("jagged_attention_fwd" in text) == (not mosaic), (d, implementation)
        triton_backward = "jagged_attention_bwd_dq" in text and "jagged_attention_bwd_dkv" in text
        assert triton_backward == (not mosaic), (d, implementation)


def test_lowers_bias_tables_wider_than_one_tma_box():
    """A TMA copy moves at most 256 elements per dimension: wider bias tables (position buckets up to the
    sequence length) come in chunks, each arriving on the query barrier (the fuzz found the one-copy version
    failing to lower at 1041 and 273 buckets)."""
    t, h, b = 3000, 2, 7
    sd = jax.ShapeDtypeStruct
    tables = tuple(sd(x.shape, x.dtype) for x in _tables(b, h, t, num_pos=1041, num_time=300))
    args = (sd((t, h, 64), jnp.bfloat16),) * 3 + (sd((b + 1,), jnp.int32),) + tables
    params = _static(1024, "silu", 64, has_targets=True, num_pos=1041, num_time=300)
    assert mosaic_gpu.table_chunks(1041) == 5 and mosaic_gpu.table_chunks(300) == 2
    text = _lowered(lambda *a: mosaic_gpu.forward_mosaic_gpu(*a, params=params), *args)
    assert text.count("mosaic_gpu") >= 1


def test_supports():
    q = jnp.zeros((8, 2, 128), jnp.bfloat16)
    assert mosaic_gpu.supports(_static(256, "silu"), q, q)
    assert mosaic_gpu.supports(_static(256, "softmax"), q, q)
    assert mosaic_gpu.supports(_static(256, "silu", has_targets=True, max_attn_len=8), q, q)
    assert mosaic_gpu.supports(_static(256, "silu", num_pos=5, num_time=3), q, q)
    assert not mosaic_gpu.supports(_static(256, "silu", interpret=True), q, q)
    # a position table larger than the shared memory the tiles leave (D = 256: about 16 KiB) falls back
    q256 = jnp.zeros((8, 2, 256), jnp.bfloat16)
    assert mosaic_gpu.supports(_static(4096, "silu", 256, num_pos=1041), q256, q256)
    assert not mosaic_gpu.supports(_static(8192, "silu", 256, num_pos=4113), q256, q256)
    assert mosaic_gpu.supports(
        _static(256, "silu"), q[:7], q[:7]
    )  # any T: gpu_layout.to_kernel_layout pads rows
    assert not mosaic_gpu.supports(_static(256, "silu"), q.astype(jnp.float32), q.astype(jnp.float32))
    for d, ok in ((64, True), (256, True), (32, False), (96, False)):
        qd = jnp.zeros((8, 2, d), jnp.bfloat16)
        assert mosaic_gpu.supports(_static(256, "silu", d), qd, qd) == ok, d


@pytest.mark.slow
@pytest.mark.parametrize(
    "activation,d,block_k,pingpong,window,bias",
    [("silu", 64, 64, False, 40, True), ("softmax", 128, 128, True, 0, False)],
)
def test_interpret_matches_reference(activation, d, block_k, pingpong, window, bias):
    """One persistent CTA (num_ctas=1) walks every item (the K/V ring and barrier phases run on across items).

    The one-CTA-per-item grid (num_ctas=None) is only lowered here: the interpreter runs its many mostly idle
    CTAs one after another, which takes minutes.
    """
    from jax._src.pallas.mosaic_gpu.interpret import params as gp

    # softmax: a 2-tile sequence whose second consumer holds 2 rows, an empty one, length 1, one ending mid-tile;
    # silu with the bias (64-key tiles, slower to interpret): window edges, unaligned starts, unsorted timestamps,
    # and 5 position buckets, so rows past 128 see a key tile wholly past the last bucket (the scalar path)
    lengths = [130, 0, 1, 70] if activation == "softmax" else [150, 0, 1, 37]
    n, h = shapes.MOSAIC_SMALL.max_seq_len, 1  # the interpreter runs one head at a time
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = (int(offsets[-1]) + 20 + 7) // 8 * 8  # capacity past offsets[B], a multiple of mosaic_gpu.ALIGN
    rng = np.random.default_rng(0)

    def poisoned():  # rows past offsets[B] are unused and hold NaN: nothing of them may reach a result
        x = rng.standard_normal((t, h, d)).astype(np.float32)
        x[offsets[-1] :] = np.nan
        return jnp.asarray(x, jnp.bfloat16)

    q, k, v = poisoned(), poisoned(), poisoned()
    targets, ts, pos, tim = _tables(len(lengths), h, t, num_pos=5, num_time=8)
    extra = dict(timestamps=ts, pos_bias=pos, time_bias=tim[:h]) if bias else {}
    bias_fields = dict(num_pos=5, num_time=8) if bias else {}
    params = _static(n, activation, d, max_attn_len=window, has_targets=True, **bias_fields)
    inputs = gpu_layout.to_kernel_layout(
        q, k, v, jnp.asarray(offsets), targets, extra.get("timestamps"), extra.get("pos_bias"),
        extra.get("time_bias"), params,
    )  # fmt: skip
    # TMA zero-fills boxes past the array: the interpreter's "uninitialized" reads with zero fill do the same
    interpret = gp.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    with gp.force_gpu_interpret_mode(interpret):
        o, lse = mosaic_gpu.forward_mosaic_gpu(
            *inputs, params=params, block_k=block_k, stages=2, num_ctas=1, pingpong=pingpong,
            interpret=True,
        )  # fmt: skip
    want = jagged_attention_reference(
        q, k, v, jnp.asarray(offsets), max_seq_len=n, activation=activation, num_targets=targets,
        max_attn_len=window, **extra,
    )  # fmt: skip
    o, want = np.asarray(o, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(o).all()
    assert np.linalg.norm(o - want) / np.linalg.norm(want) < 1e-2
    assert not o[offsets[-1] :].any()
    if activation == "softmax":
        lse_want = softmax_lse_reference(q, k, offsets, n, params.alpha, targets, window)
        np.testing.assert_allclose(np.asarray(lse)[:, : offsets[-1]], lse_want[:, : offsets[-1]], atol=1e-2)


def test_time_buckets_match_the_reference_formula():
    """sm90_common.time_buckets (log2, then the floor through a float's bits, no float -> int conversion) gives
    the reference's bucket for every gap from -5 to 5,000 and for 200,000 gaps spread log-uniformly to 2e9,
    bucket edges included, and clips to the table."""
    from pallas_kernels.jagged_attention.sm90_common import time_buckets
    from pallas_kernels.jagged_attention.tiling import time_bucket

    spread = np.unique(np.logspace(0, 9.3, 200_000).astype(np.int64))
    gaps = np.concatenate([np.arange(-5, 5000), spread]).astype(np.int32)
    for num_time in (64, 8):
        got = np.asarray(time_buckets(jnp.asarray(gaps, jnp.float32), num_time))
        want = np.asarray(time_bucket(jnp.asarray(gaps), num_time))
        np.testing.assert_array_equal(got, want, err_msg=f"num_time={num_time}")


def test_relative_timestamps():
    """tiling.relative_timestamps: each token's timestamp minus its sequence's first (empty sequences skipped),
    0 past offsets[B]; gaps within a sequence are exact in float32 below 2**24 and within 2**-24 of the gap
    past it."""
    from pallas_kernels.jagged_attention.tiling import relative_timestamps

    rng = np.random.default_rng(3)
    lengths = np.array([5, 0, 1, 300, 0, 40])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(offsets[-1]) + 11
    ts = rng.integers(-(2**30), 2**30, size=t).astype(np.int32)
    ts[offsets[3] : offsets[4]] = 2**30 + np.sort(rng.integers(0, 3 * 2**24, size=300))  # a span past 2**24
    got = np.asarray(relative_timestamps(jnp.asarray(ts), jnp.asarray(offsets)))
    assert got.shape == (1, t)
    assert not got[0, offsets[-1] :].any()
    for b in range(len(lengths)):
        lo, hi = offsets[b], offsets[b + 1]
        want = ts[lo:hi].astype(np.int64) - ts[lo]
        np.testing.assert_allclose(got[0, lo:hi], want, rtol=2**-24)
        gaps = got[0, lo:hi, None].astype(np.float64) - got[0, None, lo:hi]  # what the kernels subtract
        exact = want[:, None] - want[None, :]
        small = np.abs(want) < 2**24
        np.testing.assert_array_equal(gaps[np.ix_(small, small)], exact[np.ix_(small, small)])
        assert np.all(
            np.abs(gaps - exact) <= 2 * 2**-24 * np.maximum(np.abs(want)[:, None], np.abs(want)[None])
        )
