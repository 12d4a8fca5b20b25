"""Single-pass GPU backward of jagged attention: dQ by float32 atomics inside the dK/dV kernel.

gpu._backward runs two kernels (dQ over query tiles, dK/dV over key tiles), each recomputing the scores:
7 tile matmuls per score tile. Here one kernel walks the key tiles as gpu._dkv_kernel does and also adds
each (query tile, key tile)'s dQ share, dScore @ K, into a zeroed float32 [T, H, Dqk] buffer with atomics:
5 matmuls per score tile, plus one [bq, Dqk] atomic add. The buffer is scaled and cast to q.dtype in XLA.
Relative-bias tables are not supported here (their gradients live in gpu._dq_kernel); see supports().
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.jagged_attention import gpu, tiling
from pallas_kernels.jagged_attention.tiling import Static, cdiv


def supports(s: Static) -> bool:
  """Whether backward_fused handles this configuration (no relative bias; SiLU/softmax, targets, window)."""
  return not (s.has_pos or s.has_time) and s.activation in ("silu", "softmax")


def _add_rows(ref, start, lo, size, ok, h, val, s: Static):
  """ref[start + lo + i, h, :] += val[i] for the rows i with ok[i] (float32 atomics on GPU)."""
  if s.interpret:  # the interpreter has no masked atomics; its programs run one at a time anyway
    blk = ref.at[pl.ds(start + lo, size), h, :]
    plgpu.store(blk, plgpu.load(blk, mask=ok[:, None], other=0.0) + val, mask=ok[:, None])
  else:
    # the atomic's mask must have the value's full shape (Triton verifies it; loads and stores broadcast)
    plgpu.atomic_add(ref, (pl.ds(start + lo, size), h, pl.ds(0, ref.shape[-1])), val,
                     mask=jnp.broadcast_to(ok[:, None], val.shape))


DQ_PROBES = ("atomic", "store", "carry")  # "atomic" is the kernel; the others compute a wrong dQ (cost probes)


def _fused_kernel(wb_ref, wm_ref, wv_ref, offsets_ref, targets_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                  delta_ref, dq_in_ref, dq_ref, dk_ref, dv_ref, *, s: Static, heads: int, num_work: int,
                  total_rows: int, dq_probe: str):
  del dq_in_ref  # zeros, aliased to dq_ref
  pid = pl.program_id(0)
  h = pid % heads
  w = pid // heads
  bq, bk = s.blocks.block_q_dkv, s.blocks.block_k_dkv
  num_seqs = offsets_ref.shape[0] - 1

  @pl.when((w < num_work) & (wv_ref[jnp.minimum(w, num_work - 1)] > 0))
  def _():
    b, n = wb_ref[w], wm_ref[w]
    start, length, first_target = gpu._seq(offsets_ref, targets_ref, b, s)
    k_lo = n * bk
    cols, col_ok, k, v, _ = gpu._kv_side(k_ref, v_ref, None, start, k_lo, bk, length, h, s)
    lo, hi = gpu._q_range(k_lo, bk, length, first_target, s)
    exact = q_ref.dtype == jnp.float32

    def body(m, carry, masked, clipped):
      del clipped  # no position bias
      dk, dv, dq_sum = carry
      q_lo = m * bq
      rows, row_ok, q, do, _, lse, delta = gpu._q_side(q_ref, do_ref, None, lse_ref, delta_ref, start, q_lo, bq,
                                                       length, h, s)
      sc, _ = gpu._scores(q, k, rows, cols, h, None, None, None, None, s)
      mask = tiling.allowed(rows, cols, length, first_target, s) if masked else None
      dp = gpu._dot(do, v, trans_b=True)
      p, ds = gpu._ds(sc, mask, dp, lse, delta, s, exact)
      ds = ds.astype(q.dtype)
      dv = dv + gpu._dot(p.astype(do.dtype), do, trans_a=True)
      dk = dk + gpu._dot(ds, q, trans_a=True)
      dq = gpu._dot(ds, k)  # unscaled: scaled once in XLA
      if dq_probe == "atomic":
        _add_rows(dq_ref, start, q_lo, bq, row_ok, h, dq, s)
      elif dq_probe == "store":  # cost probe: the same rows written without atomics (races: wrong dQ)
        plgpu.store(dq_ref.at[pl.ds(start + q_lo, bq), h, :], dq, mask=row_ok[:, None])
      else:  # cost probe "carry": the dQ matmul kept, no memory traffic per tile (wrong dQ)
        dq_sum = dq_sum + dq
      return dk, dv, dq_sum

    init = (jnp.zeros((bk, k_ref.shape[-1]), jnp.float32), jnp.zeros((bk, v_ref.shape[-1]), jnp.float32),
            jnp.zeros((bq, q_ref.shape[-1]) if dq_probe == "carry" else (), jnp.float32))
    m_hi = gpu.cdiv_dyn(hi, bq)
    f_lo, f_hi = gpu._full_q(k_lo, bq, bk, first_target, m_hi, s)
    dk, dv, dq_sum = gpu._split_loop(lo // bq, m_hi, f_lo, f_hi, body, init)
    if dq_probe == "carry":
      plgpu.store(dq_ref.at[pl.ds(start + k_lo, bq), h, :], dq_sum, mask=(k_lo + jnp.arange(bq) < length)[:, None])
    scale = 1.0 / s.max_seq_len if s.activation == "silu" else 1.0
    plgpu.store(dk_ref.at[pl.ds(start + k_lo, bk), h, :], (dk * (s.alpha * scale)).astype(dk_ref.dtype),
                mask=col_ok[:, None])
    plgpu.store(dv_ref.at[pl.ds(start + k_lo, bk), h, :], (dv * scale).astype(dv_ref.dtype),
                mask=col_ok[:, None])

  @pl.when(w >= num_work)
  def _():
    gpu._zero_tail([(dk_ref, h), (dv_ref, h)], offsets_ref, w - num_work, num_seqs, total_rows, bk)


def backward_fused(s: Static, res, do, *, dq_probe: str = "atomic"):
  """Drop-in for gpu._backward (same residuals, same cotangent tuple) when supports(s); one kernel.

  dq_probe other than "atomic" is for benchmarks only: it times the kernel without the dQ atomics (the dQ
  it returns is wrong), see DQ_PROBES.
  """
  if dq_probe not in DQ_PROBES:
    raise ValueError(f"dq_probe must be one of {DQ_PROBES}, got {dq_probe!r}")
  if not supports(s):
    raise ValueError(f"backward_fused needs no relative bias, got has_pos={s.has_pos} has_time={s.has_time}")
  q, k, v, offsets, targets, _, pos_tab, time_tab, o, lse = res
  t, heads, _ = q.shape
  lengths = jnp.minimum(offsets[1:] - offsets[:-1], s.max_seq_len)
  if s.activation == "softmax":
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).T  # [H, T]
  else:
    delta = jnp.zeros((1, 1), jnp.float32)
  bk = s.blocks.block_k_dkv
  wb, wm, wv, num_work = tiling.work_list(lengths, bk, s.max_seq_len, t, "key")
  num_zero = cdiv(t, gpu.ZERO_TILES * bk)
  kernel = functools.partial(_fused_kernel, s=s, heads=heads, num_work=num_work, total_rows=t, dq_probe=dq_probe)
  # Grid: one program per (key-tile work item, head), heaviest first, then programs that zero dK/dV rows
  # past offsets[B]. Blocks: whole arrays (masked row loads); dQ rows are only ever atomically added to
  # the zeroed buffer, so its rows past offsets[B] stay zero.
  dq_acc, dk, dv = pl.pallas_call(
      kernel,
      grid=((num_work + num_zero) * heads,),
      out_shape=(jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)),
      input_output_aliases={11: 0},
      compiler_params=plgpu.CompilerParams(num_warps=s.blocks.num_warps_bwd, num_stages=s.blocks.num_stages_bwd),
      interpret=s.interpret,
      name="jagged_attention_bwd_fused",
  )(wb, wm, wv, offsets, targets, q, k, v, do, lse, delta, jnp.zeros(q.shape, jnp.float32))
  scale = 1.0 / s.max_seq_len if s.activation == "silu" else 1.0
  dq = (dq_acc * (s.alpha * scale)).astype(q.dtype)
  return (dq, dk, dv, None, None, None, jnp.zeros(pos_tab.shape, pos_tab.dtype),
          jnp.zeros(time_tab.shape, time_tab.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnames=("s",))
def attention(q, k, v, offsets, targets, ts, pos_tab, time_tab, s: Static):
  """gpu._attention (same arguments, padded as jagged_attention_gpu pads them) with backward_fused."""
  return gpu._forward(q, k, v, offsets, targets, ts, pos_tab, time_tab, s)[0]


attention.defvjp(gpu._attention_fwd, backward_fused)
