"""Pallas Mosaic GPU (Hopper: wgmma + TMA, warp-specialised) backward kernels for jagged attention.

Why: the Triton backward (gpu.py: _dq_kernel, _dkv_kernel) is most of an hstu_nvidia train step; on Hopper its
elementwise work does not overlap its MMAs. This is the backward of the Mosaic GPU forward's design (gpu_sm90.py):

Contract: the same as gpu_layout.backward: gpu_layout.forward's residuals (q, k, v, offsets, targets, ts,
pos_tab, time_tab, o, lse, bias) and the output's cotangent in, the inputs' cotangents out. supports() lists what
it handles: bf16/fp16, Dqk = Dv in (64, 128), T a multiple of 8, SiLU or softmax, targets, window, and (only with
KernelOptions.hopper_backward_bias: correct on the H200, but slower than the Triton backward there) the
relative position and time bias; Dqk = Dv = 256 without a bias unless KernelOptions.hopper_backward_d256 is False
(below, "Head dim 256"); the GPU backend runs the Triton backward for the others.

Layout: this module drives the kernels (tiles, shared memory, the calls); sm90_dkv.py and sm90_dq.py hold
them, sm90_backward_common.py what they share, sm90_common.py what they share with the forward.

Design: two kernels, each one CTA = three warpgroups (two consumers of RES = 64 resident rows each, one TMA
producer streaming tiles of the other side into a ring of shared-memory slots), on a persistent grid of NUM_SMS
CTAs walking a heaviest-first work list of 128-row items (heads fastest), as the forward:
* dK/dV over key tiles: the consumers hold their 64 keys' K and V tiles in shared memory and dK, dV in
  registers; the producer streams the query tiles that see them (Q, dO, and for softmax lse and delta), and per
  query tile a consumer computes, transposed (rows = keys), S^T = K Q^T and dP^T = V dO^T (wgmma), P^T and dS^T
  (float32), then dV += P^T dO and dK += dS^T Q (wgmma, the left operand from registers).
* dQ over query tiles: the consumers hold Q, dO (and lse, delta) and dQ in registers; the producer streams the
  key/value tiles they see; S = Q K^T, dP = dO V^T, dS, dQ += dS K.
Both recompute the scores (7 tile matmuls per score tile where the FLOP count credits 5: the Triton backward's
count too). Softmax delta = rowsum(dO * O) comes from XLA (through an optimization barrier on dO, so that it
reads the very bf16 dO the kernels read; see gpu._delta).
* The two consumers of an item walk the union of their ranges of streamed tiles; each computes the tiles of its
  own range (masked ones only at the ends, gpu.py's split) and only waits on and releases the others ("drain",
  as the forward), so a tile's slot is freed by both consumers.
* Relative bias: computed per cell in both kernels as the forward does (the tables and the resident rows'
  timestamps come into shared memory with the resident rows, the streamed rows' timestamps with each streamed
  tile; buckets gathered from shared memory), O(T) extra memory. The table gradients come from the dQ kernel
  (it visits every cell once): dS into per-consumer, lane-private float32 histograms in shared memory by
  red.shared.add.f32, one per run of a thread's consecutive cells of one bucket, into the thread's own lane's
  column (no two lanes of a warp on one address); summed over the lanes and stored once per work item, the
  items' rows summed by XLA (sm90_dq.py: hist_add, hist_flush, LANES).
* Jagged rows: aligned frames as in the forward (a TMA load's GMEM row start is a multiple of 8: each sequence
  is processed in its frame starting at offsets[b] - offsets[b] % 8, frame rows outside the sequence masked);
  stores are power-of-two row boxes of an unswizzled staging buffer (sm90_common.store_rows), never outside the
  sequence. Rows past offsets[B] are zeroed by tail items, and the rows a streamed tile can read past
  offsets[B] are zeroed in Q, dO and K on input (0 * NaN = NaN in a masked cell's matmul; _zero_past_end).

CPU checks (tests/test_jagged_attention_sm90_backward.py): the Pallas -> Mosaic GPU lowering for several configs,
and Mosaic GPU interpret mode against the reference's gradients, with the wgmmas replaced by plain dots there
(the interpreter has no transposed wgmma operands nor run_state). Numbers only come from the device
(scripts/device/attention_bwd_sm90.sh).

Head dim 256 (D_SPLIT; KernelOptions.hopper_backward_d256, on since its H200 checks, 2026-12-03). The D <= 128 dK/dV
consumer would hold dK and dV of its 64 keys: 2 x 64 x 256 float32 = 256 registers a thread, past the 232 a
consumer gets (setmaxnreg 232/232/40 for the three warpgroups: 64.5K of the SM's 64K registers), and two
consumers' resident K and V (128 KB) leave no room for a ring of 64-row Q and dO slots (64 KB each). So:
* dK/dV, split by role (sm90_dkv.dkv_split_kernel): one item = 64 keys (work list in 64-key tiles), K and V
  resident once (consumer 0 loads K, consumer 1 V), both consumers walk all of the item's query tiles (same
  range, same masks, no drain). Consumer 0 holds dV: S^T = K Q^T (wgmma, both operands in shared memory, N =
  64), P^T and the dS factor g (SiLU: g = silu'(z), dS = dP g; softmax: g = P, dS = g (dP - delta); zero in
  masked cells) in float32, g into a 64 x 64 float16 exchange tile (float16: 4x bf16's precision, and g is in
  [-0.1, 1.1] (SiLU) or [0, 1]), then dV += P^T dO (A from registers, N = 256). Consumer 1 holds dK: dP^T = V
  dO^T, g from the exchange tile, dS^T (no mask: g is zero there), dK += dS^T Q. ex_full / ex_free (one arrival
  each way per tile) hand the tile over and back; every tile-matmul runs once (4 per score tile, as at D <=
  128).
  Why not the alternatives: each consumer holding half of D of dK and dV needs S^T and dP^T twice (+50% MMA) or
  split along the queries (N = 32 wgmmas that re-read the resident K and V per half, both halves of P^T and dS^T
  through shared memory, a two-way barrier per tile: by the model below 368 KiB = 2944 clocks of shared-memory
  traffic per tile against 2048 of MMA); two passes (dV, then dK) cost 25% more MMA and two copies of K and V (128 KB);
  FA3's fused dQ would need a 64 x 256 float32 dQ partial per tile (128 registers no consumer has) and push
  64 KB of float32 reduce-adds to L2 per 64 x 64 tile (~25 B/clock/SM, twice FA3's rate at D = 128).
  Schedule (KernelOptions.split_meet): the consumers meet once per query tile, consumer 0 after its S^T wgmma
  and consumer 1 before its dP^T one, so that the tensor cores run S^T alone (512 clocks: a 64 x 64 x 256
  wgmma at 4096 bf16 FLOP/clock/SM), then dP^T while consumer 0 computes P^T and g (~350 clocks of ALU/MUFU),
  then dV and, after consumer 1's ~100-clock dS^T, dK, then the next S^T: 4 x 512 clocks a tile with no idle
  tensor core while the activation is shorter than one wgmma. Without the meeting both products are issued at
  once and both consumers then wait for consumer 0's activation (~15% of a tile idle); the device script A/Bs
  it (`meet`).
* dQ: the D <= 128 kernel with 32-key streamed tiles (dQ 64 x 256 float32 = 128 registers, S and dP 64 x 32 = 16
  each); a 32-row K tile as a wgmma's K needs the 64-byte swizzle, so the dQ kernel's tiles all take it (the
  128-byte one elsewhere). 64-key tiles would need 128 KB of ring beside the 128 KB of resident Q and dO.
* Outputs are staged and stored in 64-column slices (STAGE_COLS: 8 KB a consumer), as the forward at D = 256.
* Registers a consumer thread (estimates; ptxas decides): dK/dV consumer 0 dV 128 + S^T 32 + P^T (bf16) 16 +
  activation temporaries ~32 = ~210; consumer 1 dK 128 + dP^T 32 + g 32 + dS^T (bf16) 16 = ~208; dQ consumer
  dQ 128 + S 16 + dP 16 + dS 8 = ~170 (D <= 128 dK/dV today: dK 64 + dV 64 + S^T 32 + dP^T 32 + temporaries).
* Shared memory (bf16; smem_bytes, SMEM_BYTES = 227 KiB less 8 KiB for barriers and alignment = 224,256):
  dK/dV 222,208 = resident K, V 65,536 + 2 slots of Q and dO 131,072 + lse, delta 1,024 + exchange 8,192 +
  staging 16,384 (a second exchange slot or a third ring slot does not fit); dQ 214,016 = resident Q, dO of two
  consumers 131,072 + lse, delta 1,024 + 2 slots of 32-row K and V 65,536 + staging 16,384.
* Throughput model (tensor core 4096 bf16 FLOP/clock/SM, shared memory 128 B/clock/SM, per 64 x 64 score tile
  of the dK/dV kernel): MMA 2048 clocks; shared-memory traffic S^T 64 KB + dP^T 64 KB + dV, dK (B only) 64 KB +
  exchange 16 KB + TMA writes of Q, dO 64 KB = 272 KiB = 2176 clocks: balanced. dQ per 32-key tile (both
  consumers): MMA 1536 clocks, shared memory 256 KiB = 2048 clocks: bound there (75%). The peer's 350 TFLOP/s credits 5
  tile-matmuls where both kernels run 7: 490 executed, 50% of the H200's 989. The Mosaic forward at D = 256 (the
  same 64 x 64 x 256 score tiles, a register-A wgmma of N = 256) runs 441-455 TFLOP/s in the bench and 550 in
  the hstu_nvidia profile (45-56%): 350 is in reach if the backward kernels match the forward's efficiency,
  not certain. Not run on a GPU yet: the first device run checks and times it (scripts/device/attention_bwd_sm90.sh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv
from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.sm90_backward_common import (
    COMPUTE_WGS,
    RES,
    TILE,
    bias_copies,
    scoped_kernel,
)
from pallas_kernels.jagged_attention.sm90_common import (
    ALIGN,
    ZERO_TILES,
    table_rows,
    table_width,
)
from pallas_kernels.jagged_attention.sm90_dkv import (
    dkv_kernel,
    dkv_split_kernel,
)
from pallas_kernels.jagged_attention.sm90_dq import (
    LANES,
    dq_kernel,
    hist_rows,
)
from pallas_kernels.mosaic_common import NUM_SMS, compiler_params, num_sms

HEAD_DIMS = (64, 128)  # dK and dV of 64 rows at D = 256 would take 256 registers a thread: see D_SPLIT
D_SPLIT = 256  # KernelOptions.hopper_backward_d256: the role-split dK/dV kernel, 32-key dQ tiles (docstring)
STAGE_COLS = 64  # D_SPLIT: outputs staged and stored 64 columns at a time (shared memory)
SMEM_BYTES = 232448 - 8192  # the H100/H200's 227 KiB, less barriers and alignment


def default_tiles(head_dim: int) -> dict:
    """Streamed tile rows and ring slots of both kernels: 64 query rows x 2 slots (dK/dV), 64 keys x 2 (dQ).

    Registers bound them: a dK/dV consumer holds dK and dV (64 x D float32 each) plus S^T and dP^T (64 x bq);
    a dQ consumer dQ plus S and dP. At D_SPLIT shared memory does: 32 keys x 2 slots in the dQ kernel (its
    resident Q and dO of 2 x 64 rows take 128 KB; the docstring's budget)."""
    if head_dim > max(HEAD_DIMS):
        return dict(block_q=64, stages_dkv=2, block_k=32, stages_dq=2)
    return dict(block_q=64, stages_dkv=2, block_k=64, stages_dq=2)


def is_split(dqk: int, dv: int) -> bool:
    """Whether a call of these head dims runs the D_SPLIT kernels (the role-split dK/dV kernel)."""
    return max(dqk, dv) > max(HEAD_DIMS)


def smem_bytes(params: KernelParams, dqk: int, dv: int, itemsize: int, heads: int, tiles: dict) -> int:
    """Shared memory of the larger of the two kernels with these tiles (the layouts in backward_mosaic_gpu)."""
    bq, bk = tiles["block_q"], tiles["block_k"]
    # lse, delta (4 bytes a row), timestamps (4: relative_timestamps' float32)
    vecs = 2 * (params.activation == "softmax") + params.has_time
    if is_split(dqk, dv):  # (no bias there) resident K, V once; the exchange tile; staging in column slices
        stage = COMPUTE_WGS * RES * STAGE_COLS * itemsize
        dkv = RES * (dqk + dv) * itemsize + stage + RES * bq * 2
        dkv += tiles["stages_dkv"] * bq * ((dqk + dv) * itemsize + 4 * vecs)
        dq = COMPUTE_WGS * RES * ((dqk + dv) * itemsize + 4 * vecs) + stage
        dq += tiles["stages_dq"] * bk * (dqk + dv) * itemsize
        return max(dkv, dq)
    tables = params.has_pos * table_width(params.num_pos) + params.has_time * table_width(params.num_time)
    hists = params.has_pos * hist_rows(params.num_pos) + params.has_time * hist_rows(params.num_time)
    dkv = COMPUTE_WGS * RES * (dqk + dv + max(dqk, dv)) * itemsize + tiles["stages_dkv"] * bq * (
        (dqk + dv) * itemsize + 4 * vecs
    )
    dq = (
        COMPUTE_WGS * RES * ((dqk + dv + dqk) * itemsize + 4 * vecs)
        + tiles["stages_dq"] * bk * ((dqk + dv) * itemsize + 4 * params.has_time)
        + 4
        * COMPUTE_WGS
        * (LANES + 1)
        * hists  # the bias-table gradients' lane-private histograms, lane sums
    )
    if params.has_time and params.options.time_grad_runs:  # the time buckets' thresholds
        dq += 4 * COMPUTE_WGS * table_width(params.num_time)
    return max(dkv, dq) + 4 * COMPUTE_WGS * tables


def supports(params: KernelParams, q, v) -> bool:
    """Whether backward() handles this call (otherwise the GPU backend runs the Triton backward)."""
    return (
        not params.interpret
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and v.dtype == q.dtype
        and (q.shape[-1] in HEAD_DIMS or (q.shape[-1] == D_SPLIT and params.options.hopper_backward_d256))
        and v.shape[-1] == q.shape[-1]
        and params.activation in ("silu", "softmax")
        and (params.options.hopper_backward_bias or not (params.has_pos or params.has_time))
        and not (is_split(q.shape[-1], v.shape[-1]) and (params.has_pos or params.has_time))  # not at D_SPLIT
        and smem_bytes(
            params, q.shape[-1], v.shape[-1], q.dtype.itemsize, q.shape[1], default_tiles(q.shape[-1])
        )
        <= SMEM_BYTES
    )


def _swizzled(cols: int, itemsize: int):
    """Shared-memory transforms of a tile with rows of `cols` elements: (8, 64)-element tiles and the 128-byte
    swizzle, or the narrower swizzle of a 64-byte row (a wgmma's K must be a multiple of its swizzle width)."""
    swizzle = min(128, cols * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _zero_past_end(x, offsets, rows: int):
    """x with rows [offsets[B], offsets[B] + rows) set to zero (those past the array dropped).

    A masked cell still enters the matmuls with P = dS = 0, and 0 x NaN is NaN. The rows a streamed tile of at
    most `rows` rows can read past the last sequence are the only ones that may hold anything (the contract);
    rows before offsets[B] are other sequences' (finite) and resident rows only reach their own, unstored,
    output rows. Streamed are Q and dO (dK/dV kernel) and K (dQ kernel; V there only reaches masked dP
    columns). A scatter of `rows` rows, not a pass over the array: in place when XLA can reuse the buffer.
    """
    return x.at[offsets[-1] + jnp.arange(rows, dtype=jnp.int32)].set(0, mode="drop")


def backward_mosaic_gpu(
    residuals,
    d_out,
    params: KernelParams,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    stages_dkv: int | None = None,
    stages_dq: int | None = None,
    num_ctas: int | None = NUM_SMS,
    interpret: bool = False,
):
    """gpu_layout.backward's cotangents (dq, dk, dv, None x 3, dpos, dtime) from gpu_layout.forward's residuals, for the
    calls supports() takes. The bias tables are gpu_layout.to_kernel_layout's (float32, padded; the time table's extra
    threshold row gets no gradient); the bias is computed in the kernels (the residuals' bias_rows array is not
    read)."""
    q, k, v, offsets, targets, ts, pos_tab, time_tab, o, lse, _ = residuals
    t, heads, dqk = q.shape
    dv = v.shape[-1]
    if t % ALIGN:
        raise ValueError(
            f"the Mosaic GPU backward needs a token capacity T that is a multiple of {ALIGN}, got {t}"
        )
    split = is_split(dqk, dv)
    if split and (dqk != dv or params.has_pos or params.has_time):
        raise ValueError(
            f"the Mosaic GPU backward at head dims past {max(HEAD_DIMS)} takes Dqk = Dv and no relative bias"
        )
    tiles = default_tiles(max(dqk, dv))
    bq = block_q or tiles["block_q"]
    bk = block_k or tiles["block_k"]
    stages_dkv = stages_dkv or tiles["stages_dkv"]
    stages_dq = stages_dq or tiles["stages_dq"]
    softmax = params.activation == "softmax"
    if not params.has_targets:
        targets = jnp.zeros((1,), jnp.int32)
    d_out = lax.optimization_barrier(d_out)  # delta below reads the dO the kernels read (gpu._delta)
    q, k, do = (_zero_past_end(x, offsets, max(bq, bk)) for x in (q, k, d_out))
    if softmax:
        delta = jnp.einsum("thd,thd->ht", do.astype(jnp.float32), o.astype(jnp.float32))
        lse = lse.astype(jnp.float32)
    else:
        delta = lse = jnp.zeros((1, ALIGN), jnp.float32)
    lengths = jnp.minimum(offsets[1:] - offsets[:-1], params.max_seq_len)
    frame = jnp.where(lengths > 0, lengths + offsets[:-1] % ALIGN, 0)
    static_n = params.max_seq_len + ALIGN - 1
    static_t = t + (ALIGN - 1) * frame.shape[0]
    num_zero = cdiv(t, ZERO_TILES * TILE)
    ins = (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), do.reshape(t, -1), lse, delta)
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    per_consumer = lambda shape, dtype: tuple(plgpu.SMEM(shape, dtype) for _ in range(COMPUTE_WGS))
    res_arrivals = 2 + 2 * softmax
    grid = lambda num_work: (heads, num_work + num_zero) if num_ctas is None else (num_ctas,)
    grid_names = ("heads", "items") if num_ctas is None else ("sm",)
    common = dict(
        params=params, num_zero=num_zero, total_rows=t, interpret=interpret, num_ctas=num_ctas, heads=heads
    )
    pos_width, time_width = table_width(params.num_pos), table_width(params.num_time)
    ts_int = ts
    ts = tiling.relative_timestamps(ts, offsets) if params.has_time else jnp.zeros((1, ALIGN), jnp.float32)
    dummy = jnp.zeros((1, 32), jnp.float32)
    pos_rows = table_rows(pos_tab, heads, pos_width) if params.has_pos else dummy
    # with KernelOptions.time_grad_runs the dQ kernel also reads the time buckets' thresholds (time_tab's row
    # `heads`, gpu_layout.time_thresholds) and which sequences' timestamps never decrease
    runs = params.has_time and params.options.time_grad_runs
    time_rows = table_rows(time_tab, heads + runs, time_width) if params.has_time else dummy
    bias_ins = (ts, pos_rows, time_rows)
    bias_arrivals = bias_copies(params)
    sorted_seqs = tiling.sorted_sequences(ts_int, offsets) if runs else jnp.ones((1,), jnp.int32)

    def bias_smem(stages: int, block: int, hist: bool):
        """(resident rows' timestamps, streamed rows' timestamps, pos table, time table[, the time buckets'
        thresholds, lane-private histograms (pos, time), their lane sums (pos, time)])."""
        smem = (
            plgpu.SMEM((COMPUTE_WGS, 1, RES), jnp.float32) if params.has_time else None,
            plgpu.SMEM((stages, 1, block), jnp.float32) if params.has_time else None,
            plgpu.SMEM((COMPUTE_WGS, pos_width), jnp.float32) if params.has_pos else None,
            plgpu.SMEM((COMPUTE_WGS, time_width), jnp.float32) if params.has_time else None,
        )
        if hist:
            smem += (plgpu.SMEM((COMPUTE_WGS, time_width), jnp.float32) if runs else None,)  # thresholds
            pos_rows, time_rows = hist_rows(params.num_pos), hist_rows(params.num_time)
            smem += (
                plgpu.SMEM((COMPUTE_WGS, pos_rows, LANES), jnp.float32) if params.has_pos else None,
                plgpu.SMEM((COMPUTE_WGS, time_rows, LANES), jnp.float32) if params.has_time else None,
                plgpu.SMEM((COMPUTE_WGS, pos_rows), jnp.float32) if params.has_pos else None,
                plgpu.SMEM((COMPUTE_WGS, time_rows), jnp.float32) if params.has_time else None,
            )
        return smem

    # dK / dV over key tiles (items heaviest first by the query tiles that see them)
    wb, wm, wv, num_work = tiling.work_list(frame, RES if split else TILE, static_n, static_t, "key")
    work = jnp.stack([wb, wm, wv]).reshape(-1)
    if split:  # one RES-key item per CTA, its consumers split by role (dkv_split_kernel)
        swz_split = _swizzled(bq, q.dtype.itemsize)  # (bq is the K of the dV and dK wgmmas)
        smem = (
            plgpu.SMEM((RES, dqk), q.dtype, transforms=swz_split),
            plgpu.SMEM((RES, dv), v.dtype, transforms=swz_split),
            per_consumer((RES, STAGE_COLS), q.dtype),
            plgpu.SMEM((stages_dkv, bq, dqk), q.dtype, transforms=swz_split),
            plgpu.SMEM((stages_dkv, bq, dv), v.dtype, transforms=swz_split),
            plgpu.SMEM((stages_dkv, bq), jnp.float32) if softmax else None,
            plgpu.SMEM((stages_dkv, bq), jnp.float32) if softmax else None,
            plgpu.SMEM((RES, bq), jnp.float16, transforms=_swizzled(bq, 2)),  # the exchange tile
        )
        barriers = (
            plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WGS),  # resident K (consumer 0), V (1)
            plgpu.Barrier(num_arrivals=res_arrivals, num_barriers=stages_dkv),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages_dkv),
            plgpu.Barrier(num_arrivals=1),  # the exchange tile is written (consumer 0 arrives)
            plgpu.Barrier(num_arrivals=1),  # ... and read (consumer 1 arrives)
            plgpu.Barrier(
                num_arrivals=COMPUTE_WGS
            ),  # the consumers' meeting per query tile (KernelOptions.split_meet)
        )
        kernel = functools.partial(
            dkv_split_kernel, num_work=num_work, block_q=bq, stages=stages_dkv, **common
        )
        args = ins
    else:
        smem = (
            plgpu.SMEM((COMPUTE_WGS, RES, dqk), q.dtype, transforms=swz),
            plgpu.SMEM((COMPUTE_WGS, RES, dv), v.dtype, transforms=swz),
            per_consumer((RES, max(dqk, dv)), q.dtype),
            plgpu.SMEM((stages_dkv, bq, dqk), q.dtype, transforms=swz),
            plgpu.SMEM((stages_dkv, bq, dv), v.dtype, transforms=swz),
            plgpu.SMEM((stages_dkv, bq), jnp.float32) if softmax else None,
            plgpu.SMEM((stages_dkv, bq), jnp.float32) if softmax else None,
            bias_smem(stages_dkv, bq, hist=False),
        )
        barriers = (
            plgpu.Barrier(num_arrivals=2 + bias_arrivals, num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=res_arrivals + params.has_time, num_barriers=stages_dkv),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages_dkv),
        )
        kernel = functools.partial(dkv_kernel, num_work=num_work, block_q=bq, stages=stages_dkv, **common)
        args = (*ins, *bias_ins)
    dk, dvv = plgpu.kernel(
        scoped_kernel(kernel, smem, barriers),
        out_type=(
            jax.ShapeDtypeStruct((t, heads * dqk), k.dtype),
            jax.ShapeDtypeStruct((t, heads * dv), v.dtype),
        ),
        grid=grid(num_work),
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=compiler_params(params.options.warpgroup_semantics),
    )(work, offsets, targets.astype(jnp.int32), *args)

    # dQ over query tiles (heaviest first by the key tiles they see)
    wb, wm, wv, num_work = tiling.work_list(frame, TILE, static_n, static_t, "query")
    work = jnp.stack([wb, wm, wv]).reshape(-1)
    swz_dq = _swizzled(bk, q.dtype.itemsize)  # (bk: the dQ wgmma's K; at D_SPLIT 32, a 64-byte swizzle)
    smem = (
        plgpu.SMEM((COMPUTE_WGS, RES, dqk), q.dtype, transforms=swz_dq),
        plgpu.SMEM((COMPUTE_WGS, RES, dv), v.dtype, transforms=swz_dq),
        plgpu.SMEM((COMPUTE_WGS, RES), jnp.float32) if softmax else None,
        plgpu.SMEM((COMPUTE_WGS, RES), jnp.float32) if softmax else None,
        per_consumer((RES, STAGE_COLS if split else dqk), q.dtype),
        plgpu.SMEM((stages_dq, bk, dqk), k.dtype, transforms=swz_dq),
        plgpu.SMEM((stages_dq, bk, dv), v.dtype, transforms=swz_dq),
        bias_smem(stages_dq, bk, hist=True),
    )
    barriers = (
        plgpu.Barrier(num_arrivals=res_arrivals + bias_copies(params, runs), num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_arrivals=2 + params.has_time, num_barriers=stages_dq),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages_dq),
    )
    # the bias-table gradients: one row of hist_rows(buckets) per (work item, head, consumer), summed here
    hist_shape = lambda has, n: (num_work * heads * COMPUTE_WGS * hist_rows(n) if has else 64,)
    kernel = functools.partial(dq_kernel, num_work=num_work, block_k=bk, stages=stages_dq, **common)
    dq, dpos_parts, dtime_parts = plgpu.kernel(
        scoped_kernel(kernel, smem, barriers),
        out_type=(
            jax.ShapeDtypeStruct((t, heads * dqk), q.dtype),
            jax.ShapeDtypeStruct(hist_shape(params.has_pos, params.num_pos), jnp.float32),
            jax.ShapeDtypeStruct(hist_shape(params.has_time, params.num_time), jnp.float32),
        ),
        grid=grid(num_work),
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=compiler_params(params.options.warpgroup_semantics),
    )(work, offsets, targets.astype(jnp.int32), *ins, *bias_ins, sorted_seqs)

    dq, dk, dvv = dq.reshape(t, heads, dqk), dk.reshape(t, heads, dqk), dvv.reshape(t, heads, dv)
    scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0

    item_ok = wv[:, None, None, None] > 0  # (rows of padding items are never written)

    def table_grad(parts, table, num: int):
        parts = parts.reshape(num_work, heads, COMPUTE_WGS, hist_rows(num))
        grad = jnp.where(item_ok, parts, 0.0).sum(axis=(0, 2))[:, :num] * scale
        return jnp.zeros(table.shape, jnp.float32).at[:heads, :num].set(grad).astype(table.dtype)

    dpos = jnp.zeros(pos_tab.shape, pos_tab.dtype)
    if params.has_pos:
        dpos = table_grad(dpos_parts, pos_tab, params.num_pos)
    dtime = jnp.zeros(time_tab.shape, time_tab.dtype)  # [H + 1, W]: the threshold row gets no gradient
    if params.has_time:
        dtime = table_grad(dtime_parts, time_tab, params.num_time)
    return dq, dk, dvv, None, None, None, dpos, dtime


def backward(residuals, d_out, params: KernelParams):
    """gpu_layout.backward's contract with the default tiles (see supports())."""
    return backward_mosaic_gpu(residuals, d_out, params, num_ctas=num_sms())
