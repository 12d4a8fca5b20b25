"""The Hopper (Mosaic GPU) jagged attention backward (pallas_kernels/jagged_attention/gpu_sm90_backward.py): the
backward the GPU backend runs by default and by name, lowering for several configs, and GPU interpret mode vs
the reference's gradients.

Lowering (`lower(lowering_platforms=("cuda",))` on CPU) runs the whole Pallas -> Mosaic GPU lowering, so a
primitive or layout Mosaic GPU rejects fails here; ptxas and the hardware only run on the device
(scripts/device/attention_bwd_sm90.sh checks numbers there). The interpret-mode tests run the same kernels
(producer/consumer warpgroups, barriers, TMA copies, jagged stores, tail zeroing) on CPU with the wgmma calls
swapped for plain dots.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.jagged_attention import gpu_layout, jagged_attention, kernels_in_use
from pallas_kernels.jagged_attention import gpu_sm90_backward as mosaic_bwd
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.reference import jagged_attention_reference
from tests.helpers import on_platform

sd = jax.ShapeDtypeStruct


def _static(n, activation, d=128, **kw):
    return KernelParams.build(n, activation, d, **kw)


def _residual_specs(t, h, b, d, dtype=jnp.bfloat16, num_pos=16, num_time=8):
    """Shapes of gpu_layout.forward's residuals (q, k, v, offsets, targets, ts, pos_tab, time_tab, o, lse, bias)."""
    return (
        (sd((t, h, d), dtype),) * 3
        + (sd((b + 1,), jnp.int32), sd((b,), jnp.int32), sd((t,), jnp.int32))
        + (sd((h, num_pos), jnp.float32), sd((h + 1, num_time), jnp.float32))
        + (sd((t, h, d), dtype), sd((h, t), jnp.float32), sd((1, 16, 16), dtype))
    )


def _lowered(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "activation,d,n,num_ctas,window,targets,block_q,block_k,stages",
    [
        ("silu", 128, 1024, 132, 0, False, None, None, None),
        ("silu", 128, 4096, None, 100, True, 64, 64, 3),
        ("softmax", 128, 4096, 132, 0, False, None, None, None),
        ("softmax", 64, 200, None, 40, True, None, None, None),
        ("silu", 64, 16384, 132, 300, True, 128, 128, 2),
        # head dim 256 (KernelOptions.hopper_backward_d256): the role-split dK/dV kernel, 32-key dQ tiles with
        # the 64-byte swizzle, outputs in 64-column slices; the lowering also checks that their shared memory
        # fits (Mosaic GPU refuses a kernel past the H100/H200's 227 KB)
        ("silu", 256, 4096, 132, 0, False, None, None, None),
        ("softmax", 256, 1024, None, 100, True, None, None, None),
        ("silu", 256, 300, 132, 40, True, None, None, None),
    ],
)
def test_lowers_to_mosaic_gpu(activation, d, n, num_ctas, window, targets, block_q, block_k, stages):
    """The whole Pallas -> Mosaic GPU lowering of both kernels (layouts, shared-memory plan) succeeds."""
    t, h, b = 3000, 4, 7
    params = _static(n, activation, d, max_attn_len=window, has_targets=targets)

    def f(res, do):
        return mosaic_bwd.backward_mosaic_gpu(
            res, do, params, block_q=block_q, block_k=block_k, stages_dkv=stages, stages_dq=stages,
            num_ctas=num_ctas,
        )[:3]  # fmt: skip

    text = _lowered(f, _residual_specs(t, h, b, d), sd((t, h, d), jnp.bfloat16))
    assert text.count("mosaic_gpu") >= 2  # the dK/dV and the dQ kernel
    if d == 256:  # shared memory by the docstring's budget (the lowering's own check is against 227 KB)
        tiles = mosaic_bwd.default_tiles(d)
        assert mosaic_bwd.smem_bytes(params, d, d, 2, h, tiles) <= mosaic_bwd.SMEM_BYTES


def test_d256_shared_memory_budget():
    """The docstring's D = 256 budget: dK/dV 222,208 bytes (resident K, V 64 KB, two slots of Q and dO 128 KB,
    lse and delta 1 KB, the exchange tile 8 KB, two 64-column staging buffers 16 KB), dQ 214,016 bytes; both under
    SMEM_BYTES, and one more ring slot would not be."""
    params = _static(4096, "softmax", 256)
    tiles = mosaic_bwd.default_tiles(256)
    assert tiles == dict(block_q=64, stages_dkv=2, block_k=32, stages_dq=2)
    assert mosaic_bwd.smem_bytes(params, 256, 256, 2, 4, tiles) == 222208
    assert mosaic_bwd.smem_bytes(params, 256, 256, 2, 4, {**tiles, "stages_dq": 1}) == 222208  # the dK/dV one
    assert mosaic_bwd.smem_bytes(params, 256, 256, 2, 4, {**tiles, "stages_dkv": 1}) == 214016  # the dQ one
    for more in ({"stages_dkv": 3}, {"stages_dq": 3}, {"block_k": 64}):
        assert mosaic_bwd.smem_bytes(params, 256, 256, 2, 4, {**tiles, **more}) > mosaic_bwd.SMEM_BYTES, more


@pytest.mark.parametrize(
    "implementation",
    [pytest.param(None, marks=pytest.mark.slow), "triton"],  # (None: ~23 s, every kernel)
)
def test_gpu_backend_runs_each_direction_by_default_or_by_name(implementation):
    """On Hopper the default (None) takes the Mosaic GPU kernels for each direction on its own: both for a call
    they take; the Mosaic forward and the Triton backward for one only the forward takes (a relative bias with
    hopper_backward_bias off); Triton for both at head dim 32. "triton" lowers the Triton kernels only."""
    t, h = 1024, 2
    options = KernelOptions(hopper_backward_bias=False)

    def loss(q, k, v, offsets, *bias):
        extra = dict(zip(("timestamps", "pos_bias", "time_bias"), bias))
        out = jagged_attention(
            q, k, v, offsets, max_seq_len=256, implementation=implementation, options=options, **extra
        )
        return out.astype(jnp.float32).sum()

    bias = (sd((t,), jnp.int32), sd((h, 16), jnp.float32), sd((h, 8), jnp.float32))
    default = implementation is None
    for d, with_bias, forward, backward in (
        (128, False, default, default),
        (32, False, False, False),
        (128, True, default, False),
    ):
        args = (sd((t, h, d), jnp.bfloat16),) * 3 + (sd((5,), jnp.int32),) + (bias if with_bias else ())
        with on_platform("hopper"):
            text = _lowered(jax.grad(loss, argnums=(0, 1, 2)), *args)
        assert ("jagged_attention_fwd" in text) == (not forward), (d, with_bias, implementation)
        triton = "jagged_attention_bwd_dq" in text and "jagged_attention_bwd_dkv" in text
        assert triton == (not backward), (d, with_bias, implementation)
        assert ("mosaic_gpu" in text) == (forward or backward), (d, with_bias, implementation)
    if default:  # the bias by default; with both Mosaic directions no bias_rows array is built
        options = KernelOptions()
        args = (sd((t, h, 128), jnp.bfloat16),) * 3 + (sd((5,), jnp.int32),) + bias
        with on_platform("hopper"):
            text = _lowered(jax.grad(loss, argnums=(0, 1, 2, 5, 6)), *args)
        assert "jagged_attention_bwd_dq" not in text and "red.shared.add.f32" in text
        assert f"tensor<{h}x{t}x256xbf16>" not in text  # the [H, T, W] bias_rows array


# (True lowers the role-split d256 backward: ~27 s on 2 cores, the slow tier; test_lowers_to_mosaic_gpu's d256
# cases lower it in the fast one)
@pytest.mark.parametrize("d256", [pytest.param(True, marks=pytest.mark.slow), False])
def test_gpu_backend_picks_the_d256_backward(d256):
    """At head dim 256 the default on Hopper lowers the Mosaic backward only with
    KernelOptions.hopper_backward_d256 (the Triton one after the Mosaic forward otherwise)."""
    t, h, d = 1024, 2, 256
    options = KernelOptions(hopper_backward_d256=d256)

    def loss(q, k, v, offsets):
        out = jagged_attention(q, k, v, offsets, max_seq_len=512, options=options)
        return out.astype(jnp.float32).sum()

    args = (sd((t, h, d), jnp.bfloat16),) * 3 + (sd((5,), jnp.int32),)
    with on_platform("hopper"):
        text = _lowered(jax.grad(loss, argnums=(0, 1, 2)), *args)
    assert "mosaic_gpu" in text and "jagged_attention_fwd" not in text
    assert ("jagged_attention_bwd_dq" in text and "jagged_attention_bwd_dkv" in text) == (not d256)


def test_supports():
    q = jnp.zeros((8, 2, 128), jnp.bfloat16)
    assert mosaic_bwd.supports(_static(256, "silu"), q, q)
    assert mosaic_bwd.supports(_static(256, "softmax"), q, q)
    assert mosaic_bwd.supports(_static(256, "silu", has_targets=True, max_attn_len=8), q, q)
    assert mosaic_bwd.supports(_static(256, "silu"), q.astype(jnp.float16), q.astype(jnp.float16))
    assert not mosaic_bwd.supports(_static(256, "silu", interpret=True), q, q)
    assert mosaic_bwd.supports(
        _static(256, "silu"), q[:7], q[:7]
    )  # any T: gpu_layout.to_kernel_layout pads rows
    assert not mosaic_bwd.supports(_static(256, "silu"), q.astype(jnp.float32), q.astype(jnp.float32))
    assert not mosaic_bwd.supports(_static(256, "silu"), q, q[..., :64])  # Dqk != Dv
    bias = dict(num_pos=5, num_time=3)
    assert mosaic_bwd.supports(_static(256, "silu", **bias), q, q)  # the bias, unless turned off
    no_bias = KernelOptions(hopper_backward_bias=False)
    assert not mosaic_bwd.supports(_static(256, "silu", options=no_bias, **bias), q, q)
    with_bias = KernelOptions()
    # bias tables (and their per-head gradient histograms) past the shared memory the tiles leave
    wide = dict(num_pos=4100, num_time=64)
    assert not mosaic_bwd.supports(_static(8192, "silu", options=with_bias, **wide), q, q)
    for d, ok in ((64, True), (128, True), (256, True), (32, False), (96, False)):
        qd = jnp.zeros((8, 2, d), jnp.bfloat16)
        assert mosaic_bwd.supports(_static(256, "silu", d), qd, qd) == ok, d
    # head dim 256 unless KernelOptions.hopper_backward_d256 is False, and without a bias
    q256 = jnp.zeros((8, 2, 256), jnp.bfloat16)
    assert not mosaic_bwd.supports(
        _static(256, "silu", 256, options=KernelOptions(hopper_backward_d256=False)), q256, q256
    )
    d256 = KernelOptions()
    for activation in ("silu", "softmax"):
        assert mosaic_bwd.supports(_static(4096, activation, 256, options=d256), q256, q256)
    assert mosaic_bwd.supports(
        _static(256, "silu", 256, options=d256, has_targets=True, max_attn_len=8), q256, q256
    )
    assert not mosaic_bwd.supports(
        _static(256, "silu", 256, options=d256), q256, q256[..., :128]
    )  # Dqk != Dv
    assert mosaic_bwd.supports(_static(256, "silu", 256, options=d256), q256[:7], q256[:7])  # any T
    both = KernelOptions(hopper_backward_d256=True, hopper_backward_bias=True)
    assert not mosaic_bwd.supports(_static(256, "silu", 256, options=both, **bias), q256, q256)
    with pytest.raises(ValueError, match="no relative bias"):
        mosaic_bwd.backward_mosaic_gpu(_residual_specs(8, 2, 1, 256), q256, _static(256, "silu", 256, **bias))


def test_the_default_picks_the_mosaic_backward_on_hopper_only():
    """The default order takes the Mosaic backward on Hopper where it takes the call, Triton's on other GPUs, the
    reference on this CPU (the platform of this process)."""
    q = sd((1024, 2, 128), jnp.bfloat16)
    assert kernels_in_use(q, q, max_seq_len=256, platform="hopper")[1] == "mosaic"
    assert kernels_in_use(q, q, max_seq_len=256, platform="gpu")[1] == "triton"
    assert kernels_in_use(q, q, max_seq_len=256)[1] == "reference"


def _sessions(offsets, t, rng):
    """Timestamps that never decrease within a sequence: steps of 1-100 inside each block of 64 rows from the
    sequence's start and a jump of 2-5 x 10**4 between blocks, so that a mask-free 64 x 64 tile's cells span one
    to three time buckets (the time gradient's sorted path, KernelOptions.time_grad_runs) and a diagonal tile's
    many."""
    ts = np.zeros(t, np.int64)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        rows = np.arange(hi - lo)
        jumps = np.where(rows % 64 == 0, rng.integers(2 * 10**4, 5 * 10**4, size=hi - lo), 0)
        ts[lo:hi] = rng.integers(0, 10**6) + np.cumsum(rng.integers(1, 101, size=hi - lo) + jumps)
    return ts.astype(np.int32)


def _interpret_case(activation, d, window, targets, lengths, n, seed, bias=None, heads=1, runs=None, **knobs):
    """(kernel's (dq, dk, dv[, dpos, dtime]), reference's, offsets): the Mosaic backward in GPU interpret mode,
    fed the reference's output and lse as the forward's residuals, on inputs whose rows past offsets[B] hold
    NaN; bias: (position buckets, time buckets), unsorted timestamps. runs: KernelOptions.time_grad_runs on,
    with "sorted" timestamps (_sessions) or "unsorted" ones."""
    from jax._src.pallas.mosaic_gpu.interpret import params as gp

    h = heads  # the interpreter runs one head at a time: one by default
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = (int(offsets[-1]) + 20 + 7) // 8 * 8  # capacity past offsets[B], a multiple of ALIGN
    rng = np.random.default_rng(seed)

    def poisoned():  # rows past offsets[B] are unused and hold NaN: nothing of them may reach a result
        x = rng.standard_normal((t, h, d)).astype(np.float32)
        x[offsets[-1] :] = np.nan
        return jnp.asarray(x, jnp.bfloat16)

    q, k, v, do = poisoned(), poisoned(), poisoned(), poisoned()
    off = jnp.asarray(offsets)
    tg = jnp.asarray(rng.integers(0, 40, size=len(lengths)), jnp.int32) if targets else None

    ts = tables = None
    fields = {}
    if bias is not None:
        ts = jnp.asarray(rng.integers(0, 10**7, size=t), jnp.int32)
        if runs == "sorted":
            ts = jnp.asarray(_sessions(offsets, t, rng))
        tables = tuple(jnp.asarray(rng.standard_normal((h, nb)), jnp.float32) for nb in bias)
        fields = dict(num_pos=bias[0], num_time=bias[1])
        fields["options"] = KernelOptions(hopper_backward_bias=True, time_grad_runs=runs is not None)

    def ref(q, k, v, *tables):
        extra = dict(timestamps=ts, pos_bias=tables[0], time_bias=tables[1]) if tables else {}
        return jagged_attention_reference(
            q, k, v, off, max_seq_len=n, activation=activation, num_targets=tg, max_attn_len=window, **extra
        )

    o, vjp = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)), *(tables or ()))
    live = (jnp.arange(t) < offsets[-1])[:, None, None]
    want = vjp(jnp.where(live, do.astype(jnp.float32), 0.0))
    params = _static(n, activation, d, max_attn_len=window, has_targets=targets, **fields)
    pos, tim = tables or (None, None)
    inputs = gpu_layout.to_kernel_layout(q, k, v, off, tg, ts, pos, tim, params)
    lse = jnp.zeros((h, t), jnp.float32)
    if activation == "softmax":  # the Triton forward's lse (interpret mode), with the bias where there is one
        lse = gpu_layout.forward(inputs, dataclasses.replace(params, interpret=True))[1][-2]
    # o in float32: softmax delta = rowsum(dO * O) from a bf16 O is off by O's rounding in every cell of a row,
    # which the time-table gradient (a sum of dS whose rows sum to zero) amplifies past the bar; the kernels
    # take the residual O as it comes (the Triton backward has the same sensitivity to a bf16 O)
    res = (*inputs, o, lse, jnp.zeros((1, 16, 16), jnp.bfloat16))
    # TMA zero-fills boxes past the array: the interpreter's "uninitialized" reads with zero fill do the same
    interpret = gp.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    # eagerly, not under jax.jit: inside an outer jit the interpreter's warpgroup threads were seen to starve the
    # CPU client's threads on the 2-core dev box and hang (no kernel barrier involved)
    with gp.force_gpu_interpret_mode(interpret):
        full = mosaic_bwd.backward_mosaic_gpu(res, do, params, interpret=True, **{"num_ctas": 1, **knobs})
    got = list(full[:3])
    if bias is not None:  # the kernel layout's tables are padded (and the time table has a thresholds row)
        got += [full[6][:h, : bias[0]], full[7][:h, : bias[1]]]
    return got, want, offsets


@pytest.mark.slow
@pytest.mark.parametrize(
    "activation,d,window,targets,lengths,bias,knobs",
    [
        # both consumers of an item, an empty sequence, length 1, one ending mid-tile, unaligned starts
        ("silu", 64, 0, True, [150, 0, 1, 37], None, {}),
        ("softmax", 128, 40, True, [130, 0, 1, 70], None, {}),
        ("silu", 64, 30, False, [200, 3, 61], None, dict(block_q=128, block_k=128, stages_dkv=3)),
        # the bias: 5 position buckets (tiles wholly past the last bucket, and straddling it), 8 time buckets
        # of unsorted timestamps (buckets change anywhere along a row)
        # (and two heads on three persistent CTAs: per-head tables and histograms, per-CTA histogram rows)
        ("silu", 64, 40, True, [150, 0, 1, 37], (5, 8), dict(heads=2, num_ctas=3)),
        ("softmax", 64, 0, True, [130, 0, 1, 70], (80, 8), {}),
        # the time gradient's sorted path (KernelOptions.time_grad_runs): mask-free tiles of sorted sequences
        # through their buckets' thresholds, diagonal tiles cell by cell; unsorted sequences cell by cell
        ("silu", 64, 0, True, [200, 0, 1, 37], (5, 64), dict(runs="sorted")),
        ("silu", 64, 0, False, [200, 0, 1, 37], (5, 64), dict(runs="unsorted")),
        # head dim 256: the role-split dK/dV kernel (items of 64 keys; the exchange tile and the meeting per
        # query tile), 32-key dQ tiles, stores in 64-column slices; two heads on two persistent CTAs
        ("silu", 256, 0, True, [150, 0, 1, 37], None, {}),
        ("softmax", 256, 40, True, [130, 0, 1, 70], None, dict(heads=2, num_ctas=2)),
    ],
)
def test_interpret_matches_reference(activation, d, window, targets, lengths, bias, knobs):
    """One persistent CTA (num_ctas=1, unless a case says otherwise) walks every item of both kernels (the rings
    and barrier phases run on across items); dq, dk, dv (and the bias tables' gradients) against the float32
    reference's vjp; rows past offsets[B] are zero."""
    got, want, offsets = _interpret_case(activation, d, window, targets, lengths, 256, 0, bias, **knobs)
    tail = offsets[-1]
    for name, g, w in zip(("dq", "dk", "dv", "dpos", "dtime"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        if name in ("dq", "dk", "dv"):
            assert not g[tail:].any(), name
            g, w = g[:tail], w[:tail]
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert err < 1e-2, (name, err)


def _attention_loss(implementation, t, h, d, bias: bool):
    """(grad of sum(out) in q, k, v (and the tables), argument shapes) of a jagged_attention call."""
    extras = ("timestamps", "pos_bias", "time_bias") if bias else ()

    def loss(q, k, v, offsets, *tables):
        out = jagged_attention(
            q, k, v, offsets, max_seq_len=512, implementation=implementation, **dict(zip(extras, tables))
        )
        return out.astype(jnp.float32).sum()

    args = (sd((t, h, d), jnp.bfloat16),) * 3 + (sd((4,), jnp.int32),)
    if bias:
        args += (sd((t,), jnp.int32), sd((h, 128), jnp.float32), sd((h, 64), jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 5, 6) if bias else (0, 1, 2)), args


def test_any_token_count_runs_mosaic():
    """implementation="mosaic" lowers both Mosaic GPU kernels, the relative bias's table gradients included, for
    a token count that is not a multiple of 8 (gpu_layout.to_kernel_layout pads the rows; no Triton kernel in the
    graph); "triton" lowers the Triton ones. (T % 8 == 0 is every other lowering test's case.)"""
    t = 1001
    grad, args = _attention_loss("mosaic", t, 2, 128, bias=True)
    text = _lowered(grad, *args)
    assert (
        "mosaic_gpu" in text and "jagged_attention_bwd_dq" not in text and "jagged_attention_fwd" not in text
    )
    grad, args = _attention_loss("triton", t, 2, 128, bias=False)
    text = _lowered(grad, *args)
    assert "mosaic_gpu" not in text and "jagged_attention_bwd_dq" in text


def test_kernels_in_use_names_the_families():
    """kernels_in_use reports what the call's own decision picks: Mosaic GPU for both directions by name (any T),
    Triton by name, the reference on this CPU by default, Triton interpreted as on a pre-Hopper GPU; a call the
    Mosaic kernels do not take, asked for by name, is a ValueError naming the way out."""
    q = sd((1001, 2, 128), jnp.bfloat16)
    bias = dict(num_pos=128, num_time=64)
    assert kernels_in_use(q, q, max_seq_len=512, implementation="mosaic", **bias) == ("mosaic", "mosaic")
    assert kernels_in_use(q, q, max_seq_len=512, implementation="triton") == ("triton", "triton")
    assert kernels_in_use(q, q, max_seq_len=512) == ("reference", "reference")
    assert kernels_in_use(q, q, max_seq_len=512, interpret=True) == (
        "triton (interpret)",
        "triton (interpret)",
    )
    assert kernels_in_use(q, q, max_seq_len=512, platform="hopper") == ("mosaic", "mosaic")
    q32 = sd((1001, 2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='mosaic'.*'triton'"):
        kernels_in_use(q32, q32, max_seq_len=512, implementation="mosaic")


@pytest.mark.slow  # ~23 s: four lowerings of the biased backward (a benchmark-only switch)
def test_bias_probe_skips_its_part():
    """KernelOptions.bias_probe (benchmark-only) drops what it names from the lowered kernels: the table
    gradients' shared-memory adds, the time bucket's log2 (lg2.approx in the serialized kernel); an unknown
    name is refused."""
    t, h, b = 1024, 2, 3
    residuals = _residual_specs(t, h, b, 128, num_pos=128, num_time=64)

    def lowered(probe):
        options = KernelOptions(hopper_backward_bias=True, bias_probe=probe)
        params = _static(512, "silu", 128, num_pos=128, num_time=64, options=options)
        f = lambda res, do: mosaic_bwd.backward_mosaic_gpu(res, do, params, num_ctas=132)[:3]
        return _lowered(f, residuals, sd((t, h, 128), jnp.bfloat16))

    shipped = lowered(())
    assert "red.shared.add.f32" in shipped and "lg2.approx" in shipped
    assert "red.shared.add.f32" not in lowered(("pos_grad", "time_grad"))
    assert "lg2.approx" not in lowered(("time_bucket",))
    plain = lowered(("hist_plain",))
    assert "red.shared.add.f32" not in plain and "st.shared.f32" in plain
    with pytest.raises(ValueError, match="bias_probe.*'pos_grads'"):
        KernelOptions(bias_probe=("pos_grads",))


def test_time_grad_runs_lowers():
    """KernelOptions.time_grad_runs (the time gradient's sorted path: scalar bucket ranges per tile, a uniform
    branch, thresholds compared in inline Mosaic GPU code) lowers for the GPU, with the thresholds row and the
    sequences' sortedness as inputs of the dQ kernel."""
    t, h, b = 1024, 2, 3
    residuals = _residual_specs(t, h, b, 128, num_pos=128, num_time=64)
    options = KernelOptions(hopper_backward_bias=True, time_grad_runs=True)
    params = _static(512, "silu", 128, num_pos=128, num_time=64, options=options)
    f = lambda res, do: mosaic_bwd.backward_mosaic_gpu(res, do, params, num_ctas=132)[:3]
    text = _lowered(f, residuals, sd((t, h, 128), jnp.bfloat16))
    assert text.count("mosaic_gpu_v2") == 2 and "red.shared.add.f32" in text
