"""BlockAttention: reference against a brute-force spec, kernels (Pallas interpret mode)
against the reference, forward and gradients, on fresh random inputs."""

from __future__ import annotations

import inspect

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import shapes
from pallas_kernels.block_attention import block_attention, kernels_in_use, reference
from pallas_kernels.block_attention import block_table as table_lib


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _inputs(seed, num_tokens, heads, dqk, dv, dtype, spare_fill=None):
    """Random q, k, v; rows from ``spare_fill[0]`` on are set to ``spare_fill[1]``."""
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (num_tokens, heads, dqk), jnp.float32)
    k = jax.random.normal(keys[1], (num_tokens, heads, dqk), jnp.float32)
    v = jax.random.normal(keys[2], (num_tokens, heads, dv), jnp.float32)
    if spare_fill is not None:
        first, value = spare_fill
        q, k, v = (x.at[first:].set(value) for x in (q, k, v))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _rel_err(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)


def _brute_force(q, k, v, offsets, block_size, causal, alpha):
    """The semantics written as loops over tokens, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape[:2] + v.shape[2:])
    for b in range(len(offsets) - 1):
        lo, hi = offsets[b], offsets[b + 1]
        for i in range(lo, hi):
            blk = (i - lo) // block_size
            js = [j for j in range(lo, hi) if (j - lo) // block_size == blk and (not causal or j <= i)]
            s = np.einsum("hd,jhd->hj", q[i], k[js]) * alpha
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[i] = np.einsum("hj,jhd->hd", p, v[js])
    return out


# --- the reference is the spec: check it against loops ---------------------------


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_brute_force(block_size, causal):
    lengths = [7, 0, 13, 16, 3]
    offsets = _offsets(lengths)
    q, k, v = _inputs(block_size, int(offsets[-1]) + 5, 2, 5, 3, jnp.float32)
    out = reference.block_attention_reference(
        q, k, v, jnp.asarray(offsets), block_size=block_size, causal=causal, alpha=0.4
    )
    expected = _brute_force(q, k, v, offsets, block_size, causal, 0.4)
    assert _rel_err(out, expected) < 1e-5


def test_block_table_covers_every_row_once():
    lengths = [5, 0, 16, 19, 64, 1]
    offsets = _offsets(lengths)
    num_tokens, block_size = int(offsets[-1]) + 23, 8
    start, length, live = (
        np.asarray(x) for x in table_lib.block_table(jnp.asarray(offsets), num_tokens, block_size)
    )
    owner = np.zeros(num_tokens, int)
    for s, n in zip(start, length):
        owner[s : s + n] += 1
    np.testing.assert_array_equal(owner, 1)
    assert np.all(length <= block_size)
    assert np.all(np.diff(start) >= 0)  # sorted: the TPU kernel relies on it
    np.testing.assert_array_equal(live[length > 0], start[length > 0] < offsets[-1])
    expected_blocks = sum(-(-n // block_size) for n in lengths)
    assert int(live.sum()) == expected_blocks


# --- kernels against the reference --------------------------------------------------


def _lengths_for(block_size):
    """Shorter than a block, empty, exact multiple, ragged tail, single token."""
    return [block_size // 2 + 1, 0, 2 * block_size, block_size + 3, 1]


class _KernelTest:
    IMPLEMENTATION: str = ""  # run in Pallas's interpreter
    BLOCK_SIZES = (16, 64, 128)

    def _check(
        self,
        lengths,
        block_size,
        causal,
        dtype,
        *,
        heads=shapes.BLOCK_SMOKE.heads,
        dqk=shapes.BLOCK_SMOKE.head_dim,
        dv=16,
        spare=7,
        spare_value=None,
        alpha=None,
        seed=0,
    ):
        offsets = _offsets(lengths)
        num_real = int(offsets[-1])
        num_tokens = num_real + spare
        fill = None if spare_value is None else (num_real, spare_value)
        q, k, v = _inputs(seed, num_tokens, heads, dqk, dv, dtype, fill)
        offsets = jnp.asarray(offsets)

        def run(impl):
            return lambda q, k, v: block_attention(
                q,
                k,
                v,
                offsets,
                block_size=block_size,
                causal=causal,
                alpha=alpha,
                implementation=impl,
                interpret=impl != "reference",
            )

        out, vjp = jax.vjp(run(self.IMPLEMENTATION), q, k, v)
        ref_out, ref_vjp = jax.vjp(run("reference"), q, k, v)
        assert out.shape == (num_tokens, heads, dv) and out.dtype == dtype
        tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
        assert _rel_err(out, ref_out) < tol
        np.testing.assert_array_equal(np.asarray(out[num_real:], np.float32), 0.0)

        do = jax.random.normal(jax.random.key(seed + 1), out.shape, jnp.float32)
        grads, ref_grads = vjp(do.astype(dtype)), ref_vjp(do.astype(dtype))
        for name, g, rg in zip("qkv", grads, ref_grads):
            assert g.shape == rg.shape and g.dtype == rg.dtype, name
            assert np.all(np.isfinite(np.asarray(g, np.float32))), name
            assert _rel_err(g, rg) < tol, (name, _rel_err(g, rg))
            np.testing.assert_array_equal(np.asarray(g[num_real:], np.float32), 0.0)

    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("block_size", [16, 64, 128])
    def test_forward_and_grads(self, block_size, causal):
        self._check(_lengths_for(block_size), block_size, causal, jnp.float32, seed=block_size + causal)

    def test_bfloat16(self):
        self._check([40, 64, 3], 64, True, jnp.bfloat16, heads=4, dqk=64, dv=64)

    def test_odd_block_size_and_alpha(self):
        self._check([30, 12, 0, 25], 12, False, jnp.float32, alpha=0.7, dv=24)

    def test_nan_in_spare_capacity_does_not_leak(self):
        self._check([20, 9], 16, False, jnp.float32, spare=21, spare_value=jnp.nan)

    def test_all_empty_and_no_spare(self):
        self._check([0, 0], 16, False, jnp.float32, spare=9)
        self._check([16, 32], 16, True, jnp.float32, spare=0)


class TestGpuInterpret(_KernelTest):
    IMPLEMENTATION = "triton"


class TestTpuInterpret(_KernelTest):
    IMPLEMENTATION = "tpu"


@pytest.mark.parametrize("implementation", ["triton", pytest.param("tpu", marks=pytest.mark.slow)])
@hypothesis.settings(max_examples=3, deadline=None)
@hypothesis.given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    spare=st.integers(0, 20),
    causal=st.booleans(),
)
def test_random_lengths(implementation, lengths, spare, causal):
    hypothesis.assume(sum(lengths) + spare > 0)
    test = TestGpuInterpret() if implementation == "triton" else TestTpuInterpret()
    test._check(
        lengths, 16, causal, jnp.float32, spare=spare, heads=1, dqk=16, dv=16, seed=sum(lengths) + spare
    )


def test_interpret_is_a_kernel_on_cpu():
    # interpret=True with the default order must run a kernel (the GPU's, Triton), not silently the reference:
    # jaxprs differ.
    q = jnp.ones((8, 1, 16))
    off = jnp.array([0, 8], jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda q: block_attention(q, q, q, off, block_size=16, interpret=True))(q))
    assert "pallas_call" in jaxpr
    assert kernels_in_use(16, None, interpret=True) == "triton (interpret)"
    assert kernels_in_use(16, None) == "reference"


# --- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(k=jnp.zeros((8, 2, 4))), "k must have q's shape"),
        (dict(v=jnp.zeros((9, 2, 8))), "v must be"),
        (dict(offsets=jnp.zeros((2, 2), jnp.int32)), "offsets must be"),
        (dict(offsets=jnp.zeros((3,), jnp.float32)), "integer"),
        (dict(block_size=0), "block_size must be a positive int, got 0"),
        (dict(implementation="cuda"), "implementation must be None or one of"),
        (dict(implementation="mosaic"), "implementation must be None or one of"),
        (dict(block_size=256, implementation="triton", interpret=True), "block_size=256"),
        (dict(block_size=256, interpret=True), "no backend of the gpu default order"),
    ],
)
def test_validation_names_the_bad_value(bad, message):
    args = dict(
        q=jnp.zeros((8, 2, 8)),
        k=jnp.zeros((8, 2, 8)),
        v=jnp.zeros((8, 2, 8)),
        offsets=jnp.array([0, 8], jnp.int32),
    )
    kwargs = {}
    for key, value in bad.items():
        (args if key in args else kwargs)[key] = value
    # The function's own checks (what callers get without GEM_JAX_TYPECHECK; the suite's runtime
    # shape checker would reject the bad shapes first, with a TypeCheckError naming the argument).
    unchecked = inspect.unwrap(block_attention)
    with pytest.raises(ValueError, match=message):
        unchecked(args["q"], args["k"], args["v"], args["offsets"], **kwargs)


def test_the_old_aliases_are_clear_errors():
    q = jnp.zeros((8, 1, 16))
    for old in ("pallas", "gpu", "interpret", "gpu_interpret"):
        with pytest.raises(ValueError, match=r"must be None or one of \('triton', 'tpu', 'reference'\)"):
            block_attention(q, q, q, jnp.array([0, 8], jnp.int32), implementation=old)
