"""The single-pass GPU backward (gpu_fused_bwd, Pallas interpret mode) against the jnp reference.

Gradients of q, k, v through gpu_fused_bwd.attention (the GPU forward with backward_fused as its VJP) vs
jax.vjp of the reference on fresh random inputs: relative L2 < 1e-4 in float32, < 1e-2 for bf16 inputs
(vs a float32 reference on the same rounded inputs); NaN never passes; rows past offsets[B] are zero.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.jagged_attention import jagged_attention
from pallas_kernels.jagged_attention import gpu_fused_bwd
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.tiling import Static

H, D = 2, 16
N = 64  # max_seq_len: 4 tiles of 16 rows, so interior (mask-free) tiles are exercised
CAPACITY = 160  # token capacity, beyond offsets[B]
LENGTHS = [0, 1, 17, 64, 33, 2]  # empty, length 1, not multiples of the tile, full
CPU_TILES = BlockSizes.get_default("cpu", D, N)


def _static(activation, targets, window, blocks=CPU_TILES, has_pos=False):
  return Static(max_seq_len=N, activation=activation, alpha=1.0 / np.sqrt(D), max_attn_len=window,
                has_targets=targets, has_pos=has_pos, has_time=False, num_pos=1, num_time=1, interpret=True,
                blocks=blocks)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.isfinite(a).all(), "NaN/inf in kernel gradient"
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _check(seed, activation, dtype, targets, window, blocks=CPU_TILES, lengths=LENGTHS):
  rng = np.random.default_rng(seed)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
  q, k, v, do = (jnp.asarray(rng.standard_normal((CAPACITY, H, D)), dtype) for _ in range(4))
  num_targets = jnp.asarray(rng.integers(0, 4, size=len(lengths)), jnp.int32)
  s = _static(activation, targets, window, blocks)
  tgt = num_targets if targets else jnp.zeros((len(lengths),), jnp.int32)
  tables = (jnp.zeros((1,), jnp.int32), jnp.zeros((H, 16), jnp.float32), jnp.zeros((H, 16), jnp.float32))
  fused = lambda q, k, v: gpu_fused_bwd.attention(q, k, v, offsets, tgt, *tables, s=s)
  got_o, vjp = jax.vjp(fused, q, k, v)
  got = vjp(do)

  def reference(q, k, v):
    return jagged_attention(q, k, v, offsets, max_seq_len=N, activation=activation, max_attn_len=window,
                            num_targets=num_targets if targets else None, implementation="reference")

  f32 = lambda x: x.astype(jnp.float32)
  want_o, vjp = jax.vjp(reference, f32(q), f32(k), f32(v))
  want = vjp(f32(do))
  tol = 1e-4 if dtype == jnp.float32 else 1e-2
  assert _rel(got_o, want_o) < tol  # the forward is gpu.py's, checked here only as a sanity guard
  tail = int(offsets[-1])
  for name, a, b in zip(("dq", "dk", "dv"), got, want):
    assert a.dtype == dtype and a.shape == b.shape
    assert not np.asarray(a[tail:]).any(), f"{name}: rows past offsets[B] must be zero"
    err = _rel(a, b)
    assert err < tol, f"fused {activation} {name}: rel err {err:.2e} >= {tol}"


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_plain_float32(activation):
  _check(1, activation, jnp.float32, targets=False, window=0)


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_targets_window_float32(activation):
  _check(2, activation, jnp.float32, targets=True, window=20)


@pytest.mark.parametrize("activation", ["silu", "softmax"])
def test_bf16_targets(activation):
  _check(3, activation, jnp.bfloat16, targets=True, window=0)


@pytest.mark.parametrize("bq, bk", [(32, 16), (16, 32)])
def test_unequal_tiles(bq, bk):
  # query and key tiles of different sizes: the mask-free range (_full_q) and the q-tile loop bounds move
  blocks = BlockSizes(block_q=16, block_k=16, block_q_dkv=bq, block_k_dkv=bk, num_warps=4, num_warps_bwd=4)
  _check(4, "silu", jnp.float32, targets=True, window=20, blocks=blocks, lengths=[5, 64, 0, 47])


def test_supports_rejects_bias():
  s = _static("silu", False, 0, has_pos=True)
  assert not gpu_fused_bwd.supports(s) and gpu_fused_bwd.supports(_static("softmax", True, 8))
  with pytest.raises(ValueError, match="has_pos=True"):
    gpu_fused_bwd.backward_fused(s, (None,) * 10, None)
