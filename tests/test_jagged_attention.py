"""Every jagged-attention kernel (in Pallas interpret mode) against the jnp reference.

One base class, subclassed per backend. Relative L2 error on fresh random inputs: float32 < 1e-4,
bf16 inputs < 1e-2 (vs a float32 reference on the same rounded inputs); NaN never passes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend import core as jcore

from experiments.benchmarks import shapes
from pallas_kernels.jagged_attention import jagged_attention, reference
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.options import KernelOptions

H, D = shapes.SMALL.heads, shapes.SMALL.head_dim
N = shapes.SMALL.max_seq_len  # 4 tiles of 16 rows, so interior (mask-free) tiles are exercised
CAPACITY = shapes.SMALL_CAPACITY  # token capacity; > offsets[B] in every case below
LENGTHS = list(shapes.SMALL_LENGTHS)  # empty, length 1, not multiples of the tile, full


REFERENCE = ("reference", False)


def _kernel(kernel: tuple[str, bool]) -> dict:
    """jagged_attention's keywords for a test's (implementation, interpret)."""
    return dict(implementation=kernel[0], interpret=kernel[1])


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _bias_array_widths(jaxpr, heads: int, rows: int) -> set[int]:
    """Widths W of the [H, T, W] arrays (W a multiple of 128: bias_rows) in a jaxpr and its nested jaxprs."""
    widths = set()
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            shape = getattr(out.aval, "shape", ())
            if len(shape) == 3 and shape[:2] == (heads, rows) and shape[2] % 128 == 0:
                widths.add(shape[2])
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                widths |= _bias_array_widths(inner, heads, rows)
    return widths


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), "NaN/inf in kernel output"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


class _Base:
    KERNEL: tuple[str, bool]  # (implementation, interpret)
    BIAS = True  # backend supports pos_bias/time_bias

    def _case(
        self,
        seed,
        activation,
        dtype,
        targets,
        window,
        bias,
        lengths=LENGTHS,
        grads=True,
        num_pos=24,
        sorted_ts=True,
        options=None,
    ):
        rng = np.random.default_rng(seed)
        offsets = jnp.asarray(_offsets(lengths))
        q, k, v, do = (jnp.asarray(rng.standard_normal((CAPACITY, H, D)), dtype) for _ in range(4))
        kw = dict(max_seq_len=N, activation=activation, max_attn_len=window, options=options)
        if targets:
            kw["num_targets"] = jnp.asarray(rng.integers(0, 4, size=len(lengths)), jnp.int32)
        tables = ()
        if bias and self.BIAS:
            ts = rng.integers(0, 10**6, size=CAPACITY)
            kw["timestamps"] = jnp.asarray(np.sort(ts) if sorted_ts else ts, jnp.int32)
            tables = (
                jnp.asarray(rng.standard_normal((H, num_pos)), jnp.float32),
                jnp.asarray(rng.standard_normal((H, 30)), jnp.float32),
            )

        def loss(impl, q, k, v, *tabs):
            extra = dict(zip(("pos_bias", "time_bias"), tabs))
            o = jagged_attention(q, k, v, offsets, **_kernel(impl), **kw, **extra)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

        argnums = tuple(range(1, 4 + len(tables)))
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        if grads:
            (got_g, got), (want_g, want) = (
                jax.grad(loss, argnums=argnums, has_aux=True)(impl, *xs, *tables)
                for impl, xs in ((self.KERNEL, (q, k, v)), (REFERENCE, f32))
            )
        else:
            got, want, got_g, want_g = (
                loss(self.KERNEL, q, k, v, *tables)[1],
                loss(REFERENCE, *f32, *tables)[1],
                (),
                (),
            )
        tol = 1e-4 if dtype == jnp.float32 else 1e-2
        assert got.dtype == dtype and got.shape == (CAPACITY, H, D)
        assert not np.asarray(got[int(offsets[-1]) :]).any(), "rows past offsets[B] must be zero"
        for name, a, b in zip(["out", "dq", "dk", "dv", "dpos", "dtime"], (got, *got_g), (want, *want_g)):
            err = _rel(a, b)
            assert err < tol, f"{self.KERNEL} {activation} {name}: rel err {err:.2e} >= {tol}"

    @pytest.mark.parametrize("activation", ["silu", pytest.param("softmax", marks=pytest.mark.slow)])
    def test_plain_float32(self, activation):
        self._case(1, activation, jnp.float32, targets=False, window=0, bias=False)

    @pytest.mark.parametrize("activation", ["silu", pytest.param("softmax", marks=pytest.mark.slow)])
    def test_targets_window_bias_float32(self, activation):
        self._case(2, activation, jnp.float32, targets=True, window=20, bias=True)

    def test_bf16_targets(self):
        self._case(3, "silu", jnp.bfloat16, targets=True, window=0, bias=True)

    def test_targets_do_not_see_each_other(self):
        # changing one target's k/v must leave every other row's output unchanged (bit for bit)
        rng = np.random.default_rng(5)
        lengths = [40, 25]
        offsets = jnp.asarray(_offsets(lengths))
        q, k, v = (jnp.asarray(rng.standard_normal((CAPACITY, H, D)), jnp.float32) for _ in range(3))
        kw = dict(max_seq_len=N, num_targets=jnp.array([3, 2], jnp.int32), **_kernel(self.KERNEL))
        changed = 38  # a target of sequence 0 (targets are rows 37, 38, 39)
        k2 = k.at[changed].add(1.0)
        v2 = v.at[changed].add(1.0)
        for activation in ("silu", "softmax"):
            a = np.asarray(jagged_attention(q, k, v, offsets, activation=activation, **kw))
            b = np.asarray(jagged_attention(q, k2, v2, offsets, activation=activation, **kw))
            others = np.arange(CAPACITY) != changed
            np.testing.assert_array_equal(a[others], b[others])
            assert not np.allclose(a[changed], b[changed])

    @pytest.mark.parametrize(
        "num_pos, sorted_ts, window, activation",
        [(5, False, 0, "silu"), (80, True, 20, "silu"), (5, False, 20, "softmax")],
    )
    def test_bias_grad_paths(self, num_pos, sorted_ts, window, activation):
        # 5 buckets < one 16-row tile: most tiles lie wholly in the clipped bucket, others straddle it;
        # 80 > max_seq_len: no tile is clipped. Unsorted timestamps: time buckets change anywhere along a row
        # (and a tile's time-bucket range is wide).
        self._case(
            6,
            activation,
            jnp.float32,
            targets=True,
            window=window,
            bias=True,
            num_pos=num_pos,
            sorted_ts=sorted_ts,
        )


def _with_excess_precision(fn):
    """fn evaluated as XLA on GPU may compile it: a float32 -> bf16 -> float32 round trip is dropped.

    XLA's SimplifyFPConversions (on with xla_allow_excess_precision, the GPU default) replaces convert(convert(x,
    bf16), float32) by x, while a Pallas call still reads the rounded bf16 array. The CPU compiler does not, so
    this replays the rewrite on fn's jaxpr (nested jits included) to test kernels against it.
    """

    def run(jaxpr, args, wide):
        env, unrounded = {}, {}
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
        for var, val in zip(jaxpr.jaxpr.constvars, jaxpr.consts):
            env[var] = val
        for var, val, w in zip(jaxpr.jaxpr.invars, args, wide):
            env[var], unrounded[var] = val, w
        for eqn in jaxpr.jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            ws = [None if isinstance(v, jcore.Literal) else unrounded.get(v) for v in eqn.invars]
            if eqn.primitive.name in ("jit", "pjit"):
                outs, out_ws = run(eqn.params["jaxpr"], ins, ws)
            elif eqn.primitive.name == "convert_element_type":
                new = jnp.dtype(eqn.params["new_dtype"])
                src = eqn.invars[0].aval.dtype
                if ws[0] is not None and new == jnp.float32:
                    outs, out_ws = [ws[0]], [None]  # the round trip, dropped
                else:
                    outs = [eqn.primitive.bind(*ins, **eqn.params)]
                    out_ws = [ins[0] if (src, new) == (jnp.float32, jnp.bfloat16) else None]
            else:
                out = eqn.primitive.bind(*ins, **eqn.params)
                outs = out if eqn.primitive.multiple_results else [out]
                out_ws = [None] * len(outs)
            for var, val, w in zip(eqn.outvars, outs, out_ws):
                env[var], unrounded[var] = val, w
        outvars = jaxpr.jaxpr.outvars
        return [read(v) for v in outvars], [
            None if isinstance(v, jcore.Literal) else unrounded[v] for v in outvars
        ]

    def wrapped(*args):
        return run(jax.make_jaxpr(fn)(*args), args, [None] * len(args))[0]

    return wrapped


class TestInterpretGPU(_Base):
    KERNEL = ("triton", True)

    def test_position_gather_variant(self):
        # KernelOptions(pos_expanded=False), a benchmark variant: a per-cell gather of the position table
        # instead of block loads of the expanded one, forward and gradients still match the reference
        self._case(
            8,
            "silu",
            jnp.float32,
            targets=True,
            window=0,
            bias=True,
            options=KernelOptions(pos_expanded=False),
        )

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "options, num_pos, sorted_ts",
        [
            (KernelOptions(bias_rows=False), 5, False),
            (KernelOptions(bias_rows=False), 80, True),
            (KernelOptions(bias_rows_max_bytes=0), 24, True),  # over the size limit: the same fallback
            (KernelOptions(pos_grad_stores=False), 5, False),  # position gradient by atomics (bias_rows on)
            (KernelOptions(pos_grad_max_bytes=0), 80, True),  # over its size limit: atomics too
        ],
    )
    def test_bias_computed_in_kernel(self, options, num_pos, sorted_ts):
        # without the bias_rows array each kernel computes the bias itself (clipped tiles, expanded position
        # tiles, time-bucket range loops): the path taken when the array would be too large. Also the
        # position gradient's atomic variant.
        self._case(
            9,
            "silu",
            jnp.float32,
            targets=True,
            window=20,
            bias=True,
            num_pos=num_pos,
            sorted_ts=sorted_ts,
            options=options,
        )

    @pytest.mark.parametrize(
        "block_k, cap_columns, want_width",
        [(16, 128, 128), (256, 128, None), (256, 256, 256)],
    )
    def test_bias_rows_fits_with_the_key_tiles_that_read_it(self, block_k, cap_columns, want_width):
        # the bias_rows array is [H, T, W] with W = max_seq_len rounded up to the widest key tile (>= 128); whether
        # it fits under bias_rows_max_bytes is decided with that W, and forward builds it exactly then
        blocks = BlockSizes(block_k=block_k, block_k_dkv=16)
        options = KernelOptions(bias_rows_max_bytes=H * CAPACITY * cap_columns * 4)  # float32 inputs
        q = jnp.zeros((CAPACITY, H, D), jnp.float32)
        offsets = jnp.asarray(_offsets(LENGTHS))
        ts = jnp.zeros((CAPACITY,), jnp.int32)
        tables = (jnp.zeros((H, 24), jnp.float32), jnp.zeros((H, 30), jnp.float32))
        kw = dict(max_seq_len=N, **_kernel(self.KERNEL), block_sizes=blocks, options=options)

        def loss(q, pos, time):
            return jnp.sum(
                jagged_attention(q, q, q, offsets, timestamps=ts, pos_bias=pos, time_bias=time, **kw)
            )

        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, *tables).jaxpr
        assert _bias_array_widths(jaxpr, H, CAPACITY) == ({want_width} if want_width else set())

    def test_bias_rows_is_the_reference_bias(self):
        # bias_rows[h, i, j] for row i of sequence b and column j < len_b: the reference's bias of (i, j)
        from pallas_kernels.jagged_attention import gpu_layout
        from pallas_kernels.jagged_attention.params import KernelParams

        rng = np.random.default_rng(12)
        lengths = [0, 1, 37, 64, 20]
        offsets = _offsets(lengths)
        ts = rng.integers(0, 10**6, size=CAPACITY).astype(np.int32)  # unsorted: any bucket anywhere
        pos, tim = (
            rng.standard_normal((H, 24)).astype(np.float32),
            rng.standard_normal((H, 30)).astype(np.float32),
        )
        params = KernelParams.build(
            N,
            "silu",
            alpha=1.0,
            num_pos=24,
            num_time=30,
            interpret=True,
            blocks=BlockSizes(block_k=16, block_k_dkv=32),
            bias_rows=True,
        )
        zeros = jnp.zeros((CAPACITY, H, D))
        inputs = gpu_layout.to_kernel_layout(
            zeros,
            zeros,
            zeros,
            jnp.asarray(offsets),
            None,
            jnp.asarray(ts),
            jnp.asarray(pos),
            jnp.asarray(tim),
            params,
        )
        offsets_in, ts_in, pos_in, time_in = inputs[3], inputs[5], inputs[6], inputs[7]
        got = gpu_layout.bias_rows(
            offsets_in, ts_in, pos_in, time_in, params, total_rows=CAPACITY, heads=H, dtype=jnp.float32
        )
        got = np.asarray(got)
        assert got.shape == (H, CAPACITY, 128)  # max_seq_len rounded up to 128 (and to the key tiles)
        for b, length in enumerate(lengths):
            i, j = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
            row, col = offsets[b] + i, offsets[b] + j
            tb = np.asarray(reference.time_buckets(jnp.asarray(ts[row] - ts[col]), 30))
            want = pos[:, np.clip(i - j, 0, 23)] + tim[:, tb]
            np.testing.assert_allclose(got[:, row, j], want, rtol=1e-6, err_msg=f"sequence {b}")

    def test_bf16_softmax_delta_matches_kernel_do(self):
        # bf16 softmax, targets, window, time bias. In sequences that are all targets each row sees only itself,
        # so P = 1 and dScore = dP - delta = 0: the reference's dq/dk/dtime are exactly 0. A delta = rowsum(dO *
        # O) taken from XLA reads, on GPU, the unrounded float32 cotangent (_with_excess_precision) while dP
        # uses the kernel's bf16 dO, which gives dq/dk/dtime of ~1 there; the kernel's own delta does not.
        rng = np.random.default_rng(11)
        lengths = [0, 1, 60, 41, 2]
        offsets = jnp.asarray(_offsets(lengths))
        q, k, v = (jnp.asarray(rng.standard_normal((CAPACITY, H, D)) * s, jnp.bfloat16) for s in (3, 1, 1))
        do = jnp.asarray(rng.standard_normal((CAPACITY, H, D)), jnp.float32)
        ts = jnp.asarray(np.sort(rng.integers(0, 10**6, size=CAPACITY)), jnp.int32)
        time_bias = jnp.asarray(rng.standard_normal((H, 30)) * 0.3, jnp.float32)

        def grads(impl, targets, q, k, v):
            def loss(q, k, v, tb):
                o = jagged_attention(
                    q, k, v, offsets, max_seq_len=N, activation="softmax", num_targets=targets,
                    max_attn_len=20, timestamps=ts, time_bias=tb, **_kernel(impl),
                )  # fmt: skip
                return jnp.sum(o.astype(jnp.float32) * do)

            return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, time_bias)

        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        # every sequence all targets (more targets than rows too): the reference's dq, dk, dtime are exactly 0
        all_targets = jnp.asarray([0, 1, 60, 44, 2], jnp.int32)
        got = _with_excess_precision(functools.partial(grads, self.KERNEL, all_targets))(q, k, v)
        want = grads(REFERENCE, all_targets, *f32)
        scale = np.linalg.norm(np.asarray(want[2]))  # dv: the size of a gradient here
        for name, a, b in zip(("dq", "dk", "dtime"), (got[0], got[1], got[3]), (want[0], want[1], want[3])):
            assert not np.asarray(b).any()
            err = np.linalg.norm(np.asarray(a, np.float32))
            assert err < 1e-4 * scale, (
                f"{name}: |{name}| {err:.2e} where the reference is 0 (|dv| {scale:.2e})"
            )
        assert _rel(got[2], want[2]) < 1e-2
        # and a mix of histories and targets, against the reference at the bf16 tolerance
        mixed = jnp.asarray([0, 0, 3, 41, 1], jnp.int32)
        got = _with_excess_precision(functools.partial(grads, self.KERNEL, mixed))(q, k, v)
        want = grads(REFERENCE, mixed, *f32)
        for name, a, b in zip(("dq", "dk", "dv", "dtime"), got, want):
            assert _rel(a, b) < 1e-2, f"{name}: rel err {_rel(a, b):.2e}"


@pytest.mark.slow
class TestInterpretTPU(_Base):
    KERNEL = ("tpu", True)

    # XLA's excess-precision rewrite is not GPU-only. The TPU backward widens dO after tiling it (a gather
    # between the two converts), so the rewrite finds no round trip there and this passes with the delta
    # still computed in XLA; it guards against a change that puts the two converts next to each other.
    test_bf16_softmax_delta_matches_kernel_do = TestInterpretGPU.test_bf16_softmax_delta_matches_kernel_do

    def test_single_bias_table(self):
        # each table alone (the kernels' ref lists change with it); one position bucket (every cell clipped).
        # SiLU: under softmax a one-bucket position table only shifts each row, so its gradient is zero.
        rng = np.random.default_rng(7)
        offsets = jnp.asarray(_offsets([0, 1, 17, 33]))
        q, k, v = (jnp.asarray(rng.standard_normal((CAPACITY, H, D)), jnp.float32) for _ in range(3))
        ts = jnp.asarray(rng.integers(0, 10**5, size=CAPACITY), jnp.int32)
        for extra in (
            dict(pos_bias=jnp.asarray(rng.standard_normal((H, 1)), jnp.float32)),
            dict(time_bias=jnp.asarray(rng.standard_normal((H, 12)), jnp.float32), timestamps=ts),
        ):
            table = next(key for key in extra if key.endswith("bias"))

            def loss(impl, q, tab):
                o = jagged_attention(
                    q,
                    k,
                    v,
                    offsets,
                    max_seq_len=N,
                    activation="silu",
                    **_kernel(impl),
                    **{**extra, table: tab},
                )
                return jnp.sum(o * v), o

            (got_g, got), (want_g, want) = (
                jax.grad(loss, argnums=(1, 2), has_aux=True)(impl, q, extra[table])
                for impl in (self.KERNEL, REFERENCE)
            )
            for name, a, b in zip(("out", "dq", "d" + table), (got, *got_g), (want, *want_g)):
                assert _rel(a, b) < 1e-4, f"{table} {name}: rel err {_rel(a, b):.2e}"

    def test_mosaic_lowering_with_bias(self):
        # no TPU here: check that forward and backward with both tables lower to Mosaic (every primitive has a
        # Pallas TPU lowering rule, block shapes accepted); Mosaic's own compile passes still need a TPU
        q = jnp.zeros((512, H, 128), jnp.bfloat16)
        kw = dict(
            max_seq_len=256,
            implementation="tpu",
            timestamps=jnp.zeros((512,), jnp.int32),
            num_targets=jnp.array([1, 2], jnp.int32),
            max_attn_len=100,
        )

        def loss(q, pos, time):
            o = jagged_attention(
                q, q, q, jnp.array([0, 200, 456], jnp.int32), pos_bias=pos, time_bias=time, **kw
            )
            return jnp.sum(o.astype(jnp.float32))

        text = (
            jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            .trace(q, jnp.zeros((H, 200)), jnp.zeros((H, 40)))
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
        assert text.count("tpu_custom_call") == 3  # forward, dQ, dK/dV


@pytest.mark.parametrize("backend", [TestInterpretGPU, TestInterpretTPU])
@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(st.integers(0, N), min_size=6, max_size=6).filter(lambda ls: sum(ls) <= CAPACITY))
def test_random_lengths_forward(backend, lengths):
    # fixed B and capacity: offsets are traced values, so every example reuses one compilation
    backend()._case(4, "silu", jnp.float32, targets=True, window=0, bias=False, lengths=lengths, grads=False)


@pytest.mark.parametrize("num_time", [1, 5, 40, 64])
def test_time_thresholds_reproduce_reference_buckets(num_time):
    # the GPU kernels find a cell's time bucket by comparing float32(max(dt, 1)) against these thresholds (no
    # per-cell log): it must equal the reference's bucket for every delta, at and beside each threshold too
    from pallas_kernels.jagged_attention.gpu_layout import time_thresholds
    from pallas_kernels.jagged_attention.reference import time_buckets

    width = max(16, 1 << (num_time - 1).bit_length())
    thr = np.asarray(time_thresholds(num_time, width))
    assert thr[0] == -np.inf and np.all(thr[:-1] <= thr[1:]) and np.all(np.isinf(thr[num_time:]))
    finite = thr[np.isfinite(thr)].astype(np.int64)
    rng = np.random.default_rng(0)
    dt = np.concatenate(
        [
            finite - 1,
            finite,
            finite + 1,
            rng.integers(-10, 10**4, 2000),
            rng.integers(0, 2**31 - 1, 2000),
            [0, 1, 2, 2**31 - 1],
        ]
    )
    dt = np.clip(dt, -(2**31), 2**31 - 1).astype(np.int32)
    x = np.maximum(dt, 1).astype(np.float32)
    got = np.sum(x[:, None] >= thr[None, 1:], axis=1)
    want = np.asarray(time_buckets(jnp.asarray(dt), num_time))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bias_rows", [False, True])
def test_gpu_forward_default_tiles_fit_shared_memory(dtype, head_dim, bias_rows):
    """The Triton forward's shared memory (the q tile, `num_stages` K and V tiles, one bias_rows tile) fits the
    H200's 227 KiB. The estimate is fitted to one measurement: the 288 KiB that Triton asked for in the fuzz's
    float32 D=128 crash with the bf16 tiles (128 x 128 q, 3 stages of 64-key tiles, bias_rows)."""
    itemsize = jnp.dtype(dtype).itemsize
    b = BlockSizes.get_default(
        "gpu", head_dim=head_dim, max_seq_len=1024, has_bias=True, bias_rows=bias_rows, itemsize=itemsize
    )
    tiles = b.block_q * head_dim + b.num_stages * b.block_k * 2 * head_dim
    tiles += b.block_q * b.block_k * bias_rows
    assert tiles * itemsize <= 232448, (b, tiles * itemsize)
    old = BlockSizes(block_q=128, block_k=64, num_stages=3)  # the bf16 tiles float32 had before
    assert (old.block_q * 128 + old.num_stages * old.block_k * 256 + 128 * 64) * 4 == 294912
