"""The jnp reference against a per-pair numpy loop written straight from docs/design.md's rules."""

import inspect
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.jagged_attention import jagged_attention


def _naive(q, k, v, offsets, n, activation, num_targets, window, ts, pos_bias, time_bias):
    t, h, d = q.shape
    alpha = 1 / math.sqrt(d)
    out = np.zeros((t, h, v.shape[-1]))
    for b in range(len(offsets) - 1):
        s0, length = offsets[b], offsets[b + 1] - offsets[b]
        nt = 0 if num_targets is None else min(num_targets[b], length)
        for hh in range(h):
            for i in range(length):
                allowed = []
                for j in range(length):
                    it, jt = i >= length - nt, j >= length - nt
                    ok = (j <= i and (window == 0 or i - j <= window)) if not it else (not jt or i == j)
                    if ok:
                        allowed.append(j)
                scores = []
                for j in allowed:
                    sc = alpha * q[s0 + i, hh] @ k[s0 + j, hh]
                    if pos_bias is not None:
                        sc += pos_bias[hh, min(i - j, pos_bias.shape[1] - 1)]
                    if time_bias is not None:
                        dt = max(ts[s0 + i] - ts[s0 + j], 1)
                        sc += time_bias[
                            hh, min(int(math.floor(math.log(dt) / 0.301)), time_bias.shape[1] - 1)
                        ]
                    scores.append(sc)
                scores = np.array(scores)
                if activation == "silu":
                    w = scores / (1 + np.exp(-scores)) / n
                else:
                    w = np.exp(scores - scores.max())
                    w /= w.sum()
                out[s0 + i, hh] = sum(wj * v[s0 + j, hh] for wj, j in zip(w, allowed))
    return out


@pytest.mark.parametrize("activation", ["silu", "softmax"])
@pytest.mark.parametrize("targets,window,bias", [(False, 0, False), (True, 3, True), (True, 0, True)])
def test_reference_matches_naive_loop(activation, targets, window, bias):
    rng = np.random.default_rng(hash((activation, targets, window, bias)) % 2**32)
    lengths = [0, 1, 7, 5, 9]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    t, h, d, n = int(offsets[-1]) + 3, 2, 4, 9  # 3 rows of unused capacity
    q, k, v = (rng.normal(size=(t, h, d)) for _ in range(3))
    ts = np.sort(rng.integers(0, 10**6, size=t))
    nts = rng.integers(0, 4, size=len(lengths)) if targets else None
    pos_bias = rng.normal(size=(h, 6)) if bias else None
    time_bias = rng.normal(size=(h, 20)) if bias else None
    want = _naive(q, k, v, offsets, n, activation, nts, window, ts, pos_bias, time_bias)
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    got = jagged_attention(
        f32(q),
        f32(k),
        f32(v),
        jnp.asarray(offsets, jnp.int32),
        max_seq_len=n,
        activation=activation,
        num_targets=None if nts is None else jnp.asarray(nts, jnp.int32),
        max_attn_len=window,
        timestamps=jnp.asarray(ts, jnp.int32),
        pos_bias=f32(pos_bias),
        time_bias=f32(time_bias),
        implementation="reference",
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    assert not np.asarray(got[offsets[-1] :]).any()


def test_bad_arguments_name_the_value():
    # The function's own checks (without GEM_JAX_TYPECHECK; the suite's shape checker comes first).
    unchecked = inspect.unwrap(jagged_attention)
    x = jnp.zeros((4, 2, 8))
    off = jnp.array([0, 4], jnp.int32)
    with pytest.raises(ValueError, match="activation"):
        unchecked(x, x, x, off, max_seq_len=4, activation="relu")
    with pytest.raises(ValueError, match="implementation"):
        unchecked(x, x, x, off, max_seq_len=4, implementation="cuda")
    with pytest.raises(ValueError, match="timestamps"):
        unchecked(x, x, x, off, max_seq_len=4, time_bias=jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        unchecked(x, x, x, off, max_seq_len=4, num_targets=jnp.zeros((3,), jnp.int32))
