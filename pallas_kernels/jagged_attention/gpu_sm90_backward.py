"""Pallas Mosaic GPU (Hopper: wgmma + TMA, warp-specialised) backward kernels for jagged attention.

Why: the Triton backward (gpu.py: _dq_kernel, _dkv_kernel) is most of an hstu_nvidia train step; on Hopper its
elementwise work does not overlap its MMAs. This is the backward of the Mosaic GPU forward's design (gpu_sm90.py):

Contract: the same as gpu.backward: gpu.forward's residuals (q, k, v, offsets, targets, ts, pos_tab, time_tab,
o, lse, bias) and the output's cotangent in, the inputs' cotangents out. supports() lists what it handles:
bf16/fp16, Dqk = Dv in (64, 128), T a multiple of 8, SiLU or softmax, targets, window, and (only with
KernelOptions.hopper_backward_bias: correct on the H200, but slower than the Triton backward there) the
relative position and time bias; Dqk = Dv = 256 without a bias unless KernelOptions.hopper_backward_d256 is False
(below, "Head dim 256"); the GPU backend runs the Triton backward for the others.

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
  items' rows summed by XLA (_hist_add, _hist_flush, LANES).
* Jagged rows: aligned frames as in the forward (a TMA load's GMEM row start is a multiple of 8: each sequence
  is processed in its frame starting at offsets[b] - offsets[b] % 8, frame rows outside the sequence masked);
  stores are power-of-two row boxes of an unswizzled staging buffer (gpu_sm90._store_rows), never outside the
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
* dK/dV, split by role (_dkv_split_kernel): one item = 64 keys (work list in 64-key tiles), K and V resident once
  (consumer 0 loads K, consumer 1 V), both consumers walk all of the item's query tiles (same range, same masks,
  no drain). Consumer 0 holds dV: S^T = K Q^T (wgmma, both operands in shared memory, N = 64), P^T and the dS
  factor g (SiLU: g = silu'(z), dS = dP g; softmax: g = P, dS = g (dP - delta); zero in masked cells) in float32,
  g into a 64 x 64 float16 exchange tile (float16: 4x bf16's precision, and g is in [-0.1, 1.1] (SiLU) or [0, 1]),
  then dV += P^T dO (A from registers, N = 256). Consumer 1 holds dK: dP^T = V dO^T, g from the exchange tile,
  dS^T (no mask: g is zero there), dK += dS^T Q. ex_full / ex_free (one arrival each way per tile) hand the tile
  over and back; every tile-matmul runs once (4 per score tile, as at D <= 128).
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv, cdiv_dyn
from pallas_kernels.jagged_attention import tiling
from pallas_kernels.jagged_attention.gpu_sm90 import (
    _COL,
    _LOG2_TO_BUCKET,
    _ROW,
    ALIGN,
    NUM_SMS,
    TMA_BOX,
    ZERO_TILES,
    _cast,
    _copy_table,
    _gather,
    _iota,
    _load_vector,
    _store_rows,
    _table_rows,
    is_hopper,
    table_chunks,
    table_width,
)
from pallas_kernels.jagged_attention.params import KernelParams

RES = 64  # resident rows per consumer warpgroup
COMPUTE_WGS = 2
TILE = COMPUTE_WGS * RES  # rows of one work item
LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)  # dK and dV of 64 rows at D = 256 would take 256 registers a thread: see D_SPLIT
D_SPLIT = 256  # KernelOptions.hopper_backward_d256: the role-split dK/dV kernel, 32-key dQ tiles (docstring)
STAGE_COLS = 64  # D_SPLIT: outputs staged and stored 64 columns at a time (shared memory)
SMEM_BYTES = 232448 - 8192  # the H100/H200's 227 KiB, less barriers and alignment


def wanted(hopper_backward: bool | None) -> bool:
    """KernelOptions.hopper_backward resolved on this device: None means "on Hopper GPUs"."""
    return is_hopper() if hopper_backward is None else hopper_backward


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
    # lse, delta (4 bytes a row), timestamps (8: split_timestamps' two float32 halves)
    vecs = 2 * (params.activation == "softmax") + 2 * params.has_time
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
        + tiles["stages_dq"] * bk * ((dqk + dv) * itemsize + 8 * params.has_time)
        + 4
        * COMPUTE_WGS
        * (LANES + 1)
        * hists  # the bias-table gradients' lane-private histograms, lane sums
    )
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


def _mm(a, b, trans_b: bool):
    """float32 a @ b (b^T with trans_b) of two arrays: the interpreter's wgmma."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _two_products(interpret: bool, a1, b1, a2, b2, shape):
    """(a1 b1^T, a2 b2^T) in float32 [shape]: two wgmmas of shared-memory operands, one wait."""
    if interpret:
        return _mm(a1[...], b1[...], True), _mm(a2[...], b2[...], True)

    def scope(r1, r2):
        plgpu.wgmma(r1, a1, plgpu.transpose_ref(b1, (1, 0)))
        plgpu.wgmma(r2, a2, plgpu.transpose_ref(b2, (1, 0)))
        return r1[...], r2[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _accumulate(interpret: bool, accs, lhs, rhs):
    """accs[i] + lhs[i] @ rhs[i] (lhs: registers, rhs: shared-memory refs), wgmmas with one wait."""
    if interpret:
        return tuple(acc + _mm(a, b[...], False) for acc, a, b in zip(accs, lhs, rhs))

    def scope(refs):
        for r, a, b in zip(refs, lhs, rhs):
            plgpu.wgmma(r, a, b)

    return pl.run_state(scope)(tuple(plgpu.ACC.init(acc) for acc in accs))


def _bias(interpret: bool, params: KernelParams, pos_tab, time_tab, rel, ts_q, ts_k, clipped: bool = False):
    """(float32 bias, position bucket, time bucket) of a tile's cells (None where a table is absent): rel is
    i - j (int32, the tile's shape), ts_q and ts_k the query and key timestamps broadcast to it, each a pair
    (high, low) of float32 tiles (tiling.split_timestamps). As the forward: the tables' rows are in shared memory,
    gathered per cell; the time bucket is log2(max(dt, 1)) times a constant (the reference's log(dt) / 0.301 up
    to float rounding at bucket edges). A `clipped` tile lies wholly past the last position bucket (i - j >=
    num_pos - 1 in every cell): its position bias is that bucket's scalar, and no position bucket comes back."""
    bias = pb = tb = None
    if params.has_pos and clipped:
        bias = pos_tab[params.num_pos - 1]
    elif params.has_pos:
        pb = jnp.clip(rel, 0, params.num_pos - 1)
        bias = _gather(interpret, pos_tab, pb)
    if params.has_time:
        # the gap in float32 from the halves: (hi_q - hi_k) * 2**16 is exact, and so is the low halves'
        # difference, so the sum is the integer gap rounded once, as int -> float would (without that
        # conversion, which runs at a quarter of the FP32 rate, per cell)
        (hi_q, lo_q), (hi_k, lo_k) = ts_q, ts_k
        x = jnp.maximum((hi_q - hi_k) * 65536.0 + (lo_q - lo_k), 1.0)
        tb = jnp.clip((jnp.log2(x) * _LOG2_TO_BUCKET).astype(jnp.int32), 0, params.num_time - 1)
        time_bias = _gather(interpret, time_tab, tb)
        bias = time_bias if bias is None else time_bias + bias
    return bias, pb, tb


def _ts_pair(interpret: bool, ref, layout, shape, dim: int):
    """(high, low) float32 tiles of `shape`: a [2, n] shared-memory ref of split timestamps as vectors in
    `layout`, broadcast along the tile's other dimension (dim: the one they vary along)."""
    return tuple(
        lax.broadcast_in_dim(_load_vector(interpret, ref.at[i], layout), shape, [dim]) for i in range(2)
    )


# The bias tables' gradients (dQ kernel): each consumer owns a lane-private histogram per table in shared memory,
# float32 [rows, LANES] (bucket b of lane l at b * LANES + l), so a warp's adds never meet on one address: a
# lane's own column sits in its own bank whatever bucket it adds to. A thread sums its consecutive cells of one
# bucket in registers (a run) and adds the run with one red.shared.add.f32 into its lane's column; only the
# four warps of a consumer share a column, and they rarely add at the same instant. At the end of each work
# item the consumer sums its histogram over the lanes, stores that item's [buckets] row to HBM (one slot per
# (item, head, consumer): plain stores, no accumulation across CTAs) and zeroes the histogram; XLA sums the
# slots. The earlier design (one histogram row per head, every lane adding to it) serialised a warp's atomics on
# one or two addresses: 28.5 ms of table gradients where the rest of the backward took 10.8 (docs/benchmarks.md).
LANES = 32

# red.shared.add.f32 of $1 at [$0], skipped for 0 (masked cells and a run's inner elements; NaN adds)
_RED = "{ .reg .pred p; setp.neu.f32 p, $1, 0f00000000; @p red.shared.add.f32 [$0], $1; }"


def hist_rows(num_buckets: int) -> int:
    """Rows of a lane-private histogram of `num_buckets` buckets: a multiple of 64, so that the flush reads it
    as one wgmma-layout tile."""
    return cdiv(num_buckets, 64) * 64


def _hist_add(interpret: bool, hist_ref, idx, vals, diagonals: bool = False):
    """hist_ref[idx, lane] += vals for an int32 bucket tile and a float32 tile in the wgmma layout; hist_ref is
    a consumer's float32 [rows, LANES] lane-private histogram (the comment above LANES).

    A thread visits its cells in an order where neighbours often share a bucket, sums each run of one bucket
    in registers, and adds it with one red.shared.add.f32 into its own lane's column (inline Mosaic GPU code:
    Pallas has no scatter). Zeros issue no add; NaN does (setp.neu). The order: row by row (a row's time
    bucket changes only as the time gap grows), or with `diagonals` (position buckets, i - j) the thread's
    cells (r, c) and (r + 8, c + 8) next to each other: the wgmma layout gives a thread rows r and r + 8 at
    the same columns, so near the diagonal 18 runs of a 64 x 64 tile's 32 cells instead of 32. Any order is
    correct (a run ends wherever the bucket changes); the order only saves adds."""
    if interpret:  # (the GPU interpreter has no scatter: a one-hot sum, into lane column 0)
        onehot = idx.reshape(-1, 1) == lax.broadcasted_iota(jnp.int32, (1, hist_ref.shape[0]), 1)
        sums = jnp.sum(jnp.where(onehot, vals.reshape(-1, 1), 0.0), axis=0)
        hist_ref[:, 0] = hist_ref[:, 0] + sums
        return
    import numpy as np  # noqa: PLC0415  (inline Mosaic GPU code: only where the kernel lowers for a GPU)
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA, plgpu.Layout.WGMMA))
    def scatter(ctx, hist, cells, values):
        del ctx
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        base = mgpu_utils.memref_ptr(hist)
        lane = llvm.inline_asm(i32, [], "mov.u32 $0, %laneid;", "=r")
        lanes = arith.constant(i32, LANES)

        def elements(reg):
            if not isinstance(reg.type, ir.VectorType):
                return [reg]
            [n] = ir.VectorType(reg.type).shape
            at = lambda e: ir.DenseI64ArrayAttr.get([e])
            return [vector.extract(reg, dynamic_position=[], static_position=at(e)) for e in range(n)]

        def red(i, v):
            slot = arith.addi(arith.muli(i, lanes), lane)
            address = mgpu_utils.getelementptr(base, [slot], f32)
            llvm.inline_asm(ir.Type.parse("!llvm.void"), [address, v], _RED, "r,f", has_side_effects=True)

        # a thread's rows one after the other: the register axes that remain at 8 columns come first (in the
        # wgmma layout one axis of 2: rows r and r + 8; then the column groups of 8, each a vector of 2)
        rows = [a for a, n in enumerate(cells.layout.registers_shape((RES, 8))) if n > 1]
        regs_i, regs_v = (
            np.moveaxis(r, rows, list(range(len(rows)))) for r in (cells.registers, values.registers)
        )
        pairs = [
            (i, v)
            for ireg, vreg in zip(regs_i.flat, regs_v.flat, strict=True)
            for i, v in zip(elements(ireg), elements(vreg), strict=True)
        ]
        if diagonals and len(rows) == 1 and regs_i.shape[0] == 2:
            # row r's element k (column 8 (k // 2) + 2 q + k % 2) shares i - j with row r + 8's element k + 2
            n = len(pairs) // 2
            upper, lower = pairs[:n], pairs[n:]
            pairs = lower[:2] + [p for k in range(n - 2) for p in (upper[k], lower[k + 2])] + upper[n - 2 :]
        zero = arith.constant(f32, 0.0)
        run_i, run_v = pairs[0]
        for i, v in pairs[1:]:  # a run ends where the bucket changes: its sum goes out (0: no add)
            same = arith.cmpi(arith.CmpIPredicate.eq, i, run_i)
            red(run_i, arith.select(same, zero, run_v))
            run_v = arith.select(same, arith.addf(run_v, v), v)
            run_i = i
        red(run_i, run_v)

    scatter(hist_ref, idx, vals)


def _hist_flush(interpret: bool, hist_ref, row_ref, dst):
    """Sums a consumer's lane-private histogram over its lanes into row_ref (float32 [rows]), zeroes the
    histogram, and TMA-stores the row's first dst.shape[0] buckets to dst (GMEM). Every thread of the consumer
    must have finished its adds (a warpgroup barrier first); the caller waits for the store before row_ref is
    written again."""
    plgpu.commit_smem()  # (a warpgroup barrier: every lane's adds are in)
    if interpret:
        row = jnp.sum(hist_ref[...], axis=1)
    else:
        # (unoptimized: Mosaic GPU finds no bank-conflict-free plan for a 32-column float32 tile; a flush per item)
        row = jnp.sum(plgpu.load(hist_ref, (), layout=plgpu.Layout.WGMMA, optimized=False), axis=1)
    hist_ref[...] = jnp.zeros(hist_ref.shape, jnp.float32)
    row_ref[...] = row
    plgpu.commit_smem()  # the row is visible to the TMA unit, and the zeros to every lane's next adds
    width = dst.shape[0]
    for start in range(0, width, TMA_BOX):
        size = min(TMA_BOX, width - start)
        plgpu.copy_smem_to_gmem(row_ref.at[pl.ds(start, size)], dst.at[pl.ds(start, size)])


class _Frame:
    """The work item's sequence in its aligned frame (scalars read from GMEM at run time)."""

    def __init__(
        self, work_ref, offsets_ref, targets_ref, params: KernelParams, num_work: int, h, w, tile: int = TILE
    ):
        def work(k, wc):
            return work_ref[k * num_work + wc]

        wc = jnp.minimum(w, num_work - 1)
        self.h, self.w = h, w
        self.valid = (w < num_work) & (work(2, wc) > 0)
        b = work(0, wc)
        start = offsets_ref[b]
        self.d = lax.rem(start, jnp.int32(ALIGN))  # the sequence's offset in its frame
        self.base = start - self.d  # global row of frame row 0
        self.length = jnp.minimum(offsets_ref[b + 1] - start, params.max_seq_len)
        self.first_target = self.length
        if params.has_targets:
            self.first_target = self.length - jnp.clip(targets_ref[b], 0, self.length)
        self.tile_lo = work(1, wc) * tile  # frame row of the item's first resident row (items of `tile` rows)
        self.end = self.d + self.length  # frame row past the sequence


def _cta_range(f, tiles, block: int, params: KernelParams):
    """[lo, hi) of the streamed tiles an item's two consumers see between them: the union of their
    ranges (`tiles(f, first row, rows, block, params)`), empty for a padding item."""
    lo0, hi0 = tiles(f, f.tile_lo, RES, block, params)
    lo1, hi1 = tiles(f, f.tile_lo + RES, RES, block, params)
    lo = jnp.where(hi1 > lo1, jnp.minimum(lo0, lo1), lo0)
    return lo, jnp.where(f.valid, jnp.maximum(hi0, hi1), lo)


def _q_tiles(f: _Frame, k_lo, nk: int, bq: int, params: KernelParams):
    """[lo, hi) query tiles (bq frame rows) that can see frame key rows [k_lo, k_lo + nk); lo = hi: none."""
    has = (k_lo < f.end) & (k_lo + nk > f.d)
    hi_row = f.end
    if params.max_attn_len > 0 and not params.has_targets:
        hi_row = jnp.minimum(hi_row, k_lo + nk + params.max_attn_len)
    if params.has_targets:  # a key range wholly inside the targets is seen by its own rows only
        hi_row = jnp.where(k_lo >= f.d + f.first_target, jnp.minimum(hi_row, k_lo + nk), hi_row)
    lo = k_lo // bq
    hi = jnp.maximum(cdiv_dyn(hi_row, bq), lo)
    return jnp.where(has, lo, 0), jnp.where(has, hi, 0)


def _q_free(f: _Frame, k_lo, nk: int, bq: int, lo, hi, params: KernelParams):
    """[f_lo, f_hi) within [lo, hi): query tiles whose every row sees every key of [k_lo, k_lo + nk)."""
    f_lo = cdiv_dyn(k_lo + nk - 1, bq)  # causal: the tile's first query row is at or past the last key
    f_hi = f.end // bq  # the whole tile inside the sequence
    if params.max_attn_len > 0:  # q_lo + bq - 1 - k_lo <= window (also for targets: conservative)
        f_hi = jnp.minimum(f_hi, (k_lo + params.max_attn_len - bq + 1) // bq + 1)
        f_hi = jnp.where(k_lo + params.max_attn_len - bq + 1 >= 0, f_hi, 0)
    if params.has_targets:  # keys all in the history: history rows see them causally, targets see all
        f_hi = jnp.where(k_lo + nk <= f.d + f.first_target, f_hi, 0)
    f_hi = jnp.where(k_lo >= f.d, f_hi, 0)  # frame rows before the sequence are masked
    f_lo = jnp.clip(f_lo, lo, hi)
    return f_lo, jnp.clip(f_hi, f_lo, hi)


def _k_tiles(f: _Frame, q_lo, nq: int, bk: int, params: KernelParams):
    """[lo, hi) key tiles (bk frame rows) that frame query rows [q_lo, q_lo + nq) see (gpu_sm90 kv_range)."""
    has = (q_lo < f.end) & (q_lo + nq > f.d)
    hi = cdiv_dyn(jnp.minimum(q_lo + nq, f.end), bk)
    lo = jnp.int32(0)
    if params.max_attn_len > 0:
        lo_col = jnp.maximum(jnp.maximum(q_lo, f.d) - params.max_attn_len, f.d)
        if params.has_targets:  # a tile holding targets sees the whole history
            lo_col = jnp.where(q_lo + nq > f.d + f.first_target, f.d, lo_col)
        lo = lo_col // bk
    hi = jnp.where(has, hi, 0)
    return jnp.minimum(jnp.where(has, lo, 0), hi), hi


def _k_free(f: _Frame, q_lo, nq: int, bk: int, lo, hi, params: KernelParams):
    """[f_lo, f_hi) within [lo, hi): key tiles every row of [q_lo, q_lo + nq) sees whole (gpu_sm90 mask_free)."""
    f_hi = jnp.minimum(q_lo + 1, f.d + f.first_target) // bk
    f_lo = cdiv_dyn(f.d, bk)
    if params.max_attn_len > 0:
        f_lo = jnp.maximum(f_lo, cdiv_dyn(jnp.maximum(q_lo + nq - 1 - params.max_attn_len, 0), bk))
    f_lo = jnp.clip(f_lo, lo, hi)
    return f_lo, jnp.clip(f_hi, f_lo, hi)


def _k_clipped_end(q_lo, bk: int, f_lo, f_hi, params: KernelParams):
    """Key tiles [f_lo, end) of the mask-free range [f_lo, f_hi) wholly past the last position bucket for the
    query rows from q_lo (min(i - j) = q_lo - (n + 1) bk + 1 >= num_pos - 1; gpu_sm90's pos_far_end)."""
    if not params.has_pos:
        return f_lo
    return jnp.clip((q_lo - params.num_pos + 2) // bk, f_lo, f_hi)  # floor division: < 0 when none is


def _q_clipped_start(k_lo, nk: int, bq: int, f_lo, f_hi, params: KernelParams):
    """Query tiles [start, f_hi) of the mask-free range [f_lo, f_hi) wholly past the last position bucket for
    the key rows [k_lo, k_lo + nk) (min(i - j) = n bq - k_lo - nk + 1 >= num_pos - 1)."""
    if not params.has_pos:
        return f_hi
    return jnp.clip(cdiv_dyn(k_lo + nk + params.num_pos - 2, bq), f_lo, f_hi)


def _ds(z, dp, mask, lse, delta, params: KernelParams, lse_dim: int):
    """(p, dScore) in float32 from the scores z (alpha q.k), dP and the mask (None: all allowed); for softmax lse
    and delta are vectors broadcast along dimension lse_dim of the tile. SiLU: without 1/max_seq_len."""
    if params.activation == "silu":
        half = z * 0.5
        th = jnp.tanh(half)
        sig = 0.5 + 0.5 * th
        p = half + half * th  # z * sig
        ds = dp * (sig + p * (1.0 - sig))  # silu'(z) = sig + z sig (1 - sig)
    else:
        lse2 = lax.broadcast_in_dim(lse * LOG2E, z.shape, [lse_dim])
        p = jnp.exp2(z * LOG2E - lse2)
        ds = p * (dp - lax.broadcast_in_dim(delta, z.shape, [lse_dim]))
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
        ds = jnp.where(mask, ds, 0.0)
    return p, ds


def _persistent(num_ctas, num_items: int, heads: int):
    """(iterations of this CTA, item_of(i) -> (head, item)): one (head, item) per CTA, or (persistent) items
    cta, cta + num_ctas, ... of the flat list with heads fastest."""
    if num_ctas is None:
        return 1, lambda i: (lax.axis_index("heads"), lax.axis_index("items"))
    cta = lax.axis_index("sm")
    num_iters = cdiv_dyn(jnp.maximum(num_items * heads - cta, 0), num_ctas)

    def item_of(i):
        idx = cta + i * num_ctas
        return idx % heads, idx // heads

    return num_iters, item_of


def _rows_of(ref, row, size, h, d, col: int = 0, cols: int | None = None):
    """[size, d] GMEM window of head h at `row` (ref is [T, H * d]); [size, cols] from its column `col`."""
    if cols is None or cols == d:
        return ref.at[pl.ds(row, size), pl.ds(h * d, d)]
    return ref.at[pl.ds(row, size), pl.ds(h * d + col, cols)]


def _zero_tail(stage, outs, offsets_ref, z, *, num_seqs: int, total_rows: int, interpret: bool):
    """Tail item z zeroes rows [z, z + 1) * ZERO_TILES * TILE past offsets[B] of each (ref, head, d) of outs."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = _cast(interpret, jnp.zeros(stage.shape, stage.dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    tail = offsets_ref[num_seqs]
    for i in range(ZERO_TILES * COMPUTE_WGS):
        lo = (z * ZERO_TILES * COMPUTE_WGS + i) * RES
        first = jnp.clip(tail - lo, 0, RES)  # rows [lo, lo + first) are real tokens
        count = jnp.where(lo < total_rows, RES - first, 0)
        for ref, h, d in outs:
            cols = min(d, stage.shape[1])  # a stage narrower than d (D_SPLIT): d in slices of its width
            for col in range(0, d, cols):
                _store_rows(
                    stage.at[:, pl.ds(0, d)] if d < stage.shape[1] else stage,
                    lambda off, size, lo=lo, first=first, ref=ref, h=h, d=d, col=col, cols=cols: _rows_of(
                        ref, lo + first + off, size, h, d, col, cols
                    ),
                    count,
                    RES,
                )


def _load_bias_res(ts_ref, pos_ref, time_ref, row, h, ts_res2, pos_tabs, time_tabs, wg, barrier):
    """Starts the TMAs of a consumer's resident rows' timestamps and its head's bias tables (each arriving once
    on barrier.at[wg]: bias_arrivals of them)."""
    if ts_res2 is not None:
        plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, RES)], ts_res2.at[wg], barrier.at[wg])
    if time_tabs is not None:
        _copy_table(time_ref.at[h], time_tabs.at[wg], barrier.at[wg])
    if pos_tabs is not None:
        _copy_table(pos_ref.at[h], pos_tabs.at[wg], barrier.at[wg])


def _bias_arrivals(params: KernelParams) -> int:
    """TMA copies _load_bias_res starts."""
    return params.has_time * (1 + table_chunks(params.num_time)) + params.has_pos * table_chunks(
        params.num_pos
    )


def _cta_index(heads: int):
    """The CTA's linear index in the one-CTA-per-(head, item) grid."""
    return lax.axis_index("heads") + heads * lax.axis_index("items")


def _scoped_kernel(body, smem, barriers):
    """plgpu.kernel entry: runs body(*refs, scoped) inside the scoped shared memory and barriers."""

    def entry(*refs):
        pl.run_scoped(lambda *sc: body(*refs, sc), smem, barriers, collective_axes="wg")

    return entry


# ------------------------------------------------------------------------------------------------ dK / dV


def _dkv_kernel(
    work_ref,
    offsets_ref,
    targets_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    ts_ref,
    pos_ref,
    time_ref,
    dk_ref,
    dv_ref,
    scoped,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    num_zero: int,
    block_q: int,
    stages: int,
    total_rows: int,
    interpret: bool,
    num_ctas: int | None,
):
    wg = lax.axis_index("wg")
    buffers, (res_bar, s_bar, s_free) = scoped
    k_res2, v_res2, stage_bufs, q_smem, do_smem, lse_smem, delta_smem, bias_bufs = buffers
    tsk_res2, tsq_smem, pos_tabs, time_tabs = bias_bufs  # (None where the call has no such bias)
    has_bias = params.has_pos or params.has_time
    dqk, dv = k_res2.shape[-1], v_res2.shape[-1]
    bq = block_q
    dtype = q_ref.dtype
    num_seqs = offsets_ref.shape[0] - 1
    softmax = params.activation == "softmax"
    num_iters, item_of = _persistent(num_ctas, num_work + num_zero, heads)

    def info(i):
        h, w = item_of(i)
        f = _Frame(work_ref, offsets_ref, targets_ref, params, num_work, h, w)
        return (f, *_cta_range(f, _q_tiles, bq, params))

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def load_res(i):
        """Starts the TMAs of this consumer's resident K and V rows of the CTA's i-th item (if it is real)."""
        f, _, _ = info(i)

        @pl.when(f.valid & (i < num_iters))
        def _():
            row = pl.multiple_of(f.base + f.tile_lo + wg * RES, ALIGN)
            plgpu.copy_gmem_to_smem(_rows_of(k_ref, row, RES, f.h, dqk), k_res2.at[wg], res_bar.at[wg])
            plgpu.copy_gmem_to_smem(_rows_of(v_ref, row, RES, f.h, dv), v_res2.at[wg], res_bar.at[wg])
            _load_bias_res(ts_ref, pos_ref, time_ref, row, f.h, tsk_res2, pos_tabs, time_tabs, wg, res_bar)

    def consumer_item(i, f: _Frame, cta_lo, cta_hi, g0):
        k_res, v_res = k_res2.at[wg], v_res2.at[wg]
        k_lo = f.tile_lo + wg * RES  # frame row of this consumer's first key
        first_row = jnp.clip(
            f.d - k_lo, 0, RES
        )  # this consumer's keys of the sequence: [first_row, last_row)
        last_row = jnp.clip(f.end - k_lo, 0, RES)
        lo, hi = _q_tiles(f, k_lo, RES, bq, params)
        empty = hi <= lo  # (the second consumer past the sequence's end)
        lo, hi = jnp.where(empty, cta_lo, lo), jnp.where(empty, cta_lo, hi)
        f_lo, f_hi = _q_free(f, k_lo, RES, bq, lo, hi, params)

        def slot_at(n):
            return slot_of(g0 + n - cta_lo)

        def drain(n):  # a tile only the other consumer needs: release it once it is in its slot
            slot = slot_at(n)
            plgpu.barrier_wait(s_bar.at[slot])
            plgpu.barrier_arrive(s_free.at[slot])

        plgpu.barrier_wait(res_bar.at[wg])  # started by load_res(i) at the end of the previous item
        pl.loop(cta_lo, lo)(drain)

        def body(n, carry, masked: bool, clipped: bool = False):
            dk_acc, dv_acc = carry
            slot = slot_at(n)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            plgpu.barrier_wait(s_bar.at[slot])
            st, dpt = _two_products(interpret, k_res, q_tile, v_res, do_tile, (RES, bq))
            lse = delta = None
            if softmax:
                lse = _load_vector(interpret, lse_smem.at[slot], _COL)
                delta = _load_vector(interpret, delta_smem.at[slot], _COL)
            mask = None
            if masked:  # rows: keys, columns: queries (sequence positions)
                keys = (k_lo - f.d) + _iota(interpret, (RES, bq), 0)
                queries = (n * bq - f.d) + _iota(interpret, (RES, bq), 1)
                mask = tiling.allowed_2d(queries, keys, f.length, f.first_target, params) & (keys >= 0)
            z = st * params.alpha
            if has_bias:  # rows: keys, columns: queries
                rel = (n * bq - k_lo) + _iota(interpret, (RES, bq), 1) - _iota(interpret, (RES, bq), 0)
                ts_q = ts_k = None
                if params.has_time:  # (rows: keys, columns: queries)
                    ts_q = _ts_pair(interpret, tsq_smem.at[slot], _COL, (RES, bq), 1)
                    ts_k = _ts_pair(interpret, tsk_res2.at[wg], _ROW, (RES, bq), 0)
                pos_tab = pos_tabs.at[wg] if params.has_pos else None
                time_tab = time_tabs.at[wg] if params.has_time else None
                z = z + _bias(interpret, params, pos_tab, time_tab, rel, ts_q, ts_k, clipped)[0]
            pt, dst = _ds(z, dpt, mask, lse, delta, params, 1)
            dv_acc, dk_acc = _accumulate(
                interpret, (dv_acc, dk_acc), (pt.astype(dtype), dst.astype(dtype)), (do_tile, q_tile)
            )
            plgpu.barrier_arrive(s_free.at[slot])
            return dk_acc, dv_acc

        zeros = lambda d: _cast(interpret, jnp.zeros((RES, d), jnp.float32), plgpu.Layout.WGMMA)
        carry = (zeros(dqk), zeros(dv))
        c_lo = _q_clipped_start(
            k_lo, RES, bq, f_lo, f_hi, params
        )  # far below the diagonal: a scalar pos bias
        carry = lax.fori_loop(lo, f_lo, functools.partial(body, masked=True), carry)
        carry = lax.fori_loop(f_lo, c_lo, functools.partial(body, masked=False), carry)
        if params.has_pos:
            carry = lax.fori_loop(c_lo, f_hi, functools.partial(body, masked=False, clipped=True), carry)
        carry = lax.fori_loop(f_hi, hi, functools.partial(body, masked=True), carry)
        pl.loop(hi, cta_hi)(drain)
        load_res(i + 1)  # the last wgmmas have read K and V: fetch the next item's rows during the epilogue
        scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
        dk = (carry[0] * (params.alpha * scale)).astype(dtype)
        dvv = (carry[1] * scale).astype(dtype)

        def epilogue(c):
            stage = stage_bufs[c]
            for val, ref, d in ((dk, dk_ref, dqk), (dvv, dv_ref, dv)):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores have read the buffer
                buf = stage if d == stage.shape[1] else stage.at[:, pl.ds(0, d)]
                buf[...] = val
                plgpu.commit_smem()
                _store_rows(
                    buf,
                    lambda off, size, ref=ref, d=d: _rows_of(
                        ref, f.base + k_lo + first_row + off, size, f.h, d
                    ),
                    jnp.maximum(last_row - first_row, 0),
                    RES,
                    first=first_row,
                )

        for c in range(COMPUTE_WGS):  # static buffers: one branch per consumer
            pl.when(wg == c)(functools.partial(epilogue, c))

    @pl.when(wg < COMPUTE_WGS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")

        def one(i, g):
            f, cta_lo, cta_hi = info(i)
            pl.when(f.valid)(lambda: consumer_item(i, f, cta_lo, cta_hi, g))

            @pl.when((f.w >= num_work) & (wg == 0))
            def _():
                outs = ((dk_ref, f.h, dqk), (dv_ref, f.h, dv))
                _zero_tail(
                    stage_bufs[0], outs, offsets_ref, f.w - num_work,
                    num_seqs=num_seqs, total_rows=total_rows, interpret=interpret,
                )  # fmt: skip

            return g + cta_hi - cta_lo

        load_res(0)
        lax.fori_loop(0, num_iters, one, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        ins = (q_ref, do_ref, lse_ref, delta_ref, ts_ref)
        bufs = (q_smem, do_smem, lse_smem, delta_smem, tsq_smem)
        _stream_queries(info, num_iters, ins, bufs, s_bar, s_free, bq, stages, params)


def _stream_queries(info, num_iters, ins, bufs, s_bar, s_free, bq: int, stages: int, params: KernelParams):
    """The dK/dV kernels' producer: the query tiles [cta_lo, cta_hi) of each item (info(i) -> (frame, cta_lo,
    cta_hi)) into the ring: Q, dO (and lse, delta for softmax; the timestamps with a time bias)."""
    q_ref, do_ref, lse_ref, delta_ref, ts_ref = ins
    q_smem, do_smem, lse_smem, delta_smem, tsq_smem = bufs
    dqk, dv = q_smem.shape[-1], do_smem.shape[-1]
    softmax = params.activation == "softmax"

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def one(i, g):
        f, cta_lo, cta_hi = info(i)

        @pl.loop(cta_lo, cta_hi)
        def _(n):
            j = g + n - cta_lo  # the CTA's running streamed-tile count
            slot = slot_of(j)
            row = pl.multiple_of(f.base + n * bq, ALIGN)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(s_free.at[slot])

            plgpu.copy_gmem_to_smem(_rows_of(q_ref, row, bq, f.h, dqk), q_smem.at[slot], s_bar.at[slot])
            plgpu.copy_gmem_to_smem(_rows_of(do_ref, row, bq, f.h, dv), do_smem.at[slot], s_bar.at[slot])
            if softmax:
                vec = pl.ds(row, bq)
                plgpu.copy_gmem_to_smem(lse_ref.at[f.h, vec], lse_smem.at[slot], s_bar.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[f.h, vec], delta_smem.at[slot], s_bar.at[slot])
            if params.has_time:
                plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, bq)], tsq_smem.at[slot], s_bar.at[slot])

        return g + cta_hi - cta_lo

    g = lax.fori_loop(0, num_iters, one, jnp.int32(0))

    @pl.loop(jnp.maximum(g - stages, 0), g)
    def _(step):  # observe the last releases too: the barriers then end in a consistent phase
        plgpu.barrier_wait(s_free.at[slot_of(step)])


# ---------------------------------------------------------------------------------------- dK / dV, D_SPLIT


def _one_product(interpret: bool, a, b, shape):
    """a b^T in float32 [shape]: one wgmma of shared-memory operands."""
    if interpret:
        return _mm(a[...], b[...], True)

    def scope(r):
        plgpu.wgmma(r, a, plgpu.transpose_ref(b, (1, 0)))
        return r[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _p_and_factor(z, mask, lse, params: KernelParams, lse_dim: int):
    """(p, g) in float32 from the scores z (alpha q.k; the mask None: all allowed), g the factor that makes dS
    from dP: SiLU dS = dP g with g = silu'(z) (without 1/max_seq_len), softmax dS = g (dP - delta) with g = p.
    Zero in masked cells (where, not a product: a masked cell's z may be NaN)."""
    if params.activation == "silu":
        half = z * 0.5
        th = jnp.tanh(half)
        sig = 0.5 + 0.5 * th
        p = half + half * th  # z * sig
        g = sig + p * (1.0 - sig)  # silu'(z) = sig + z sig (1 - sig)
    else:
        lse2 = lax.broadcast_in_dim(lse * LOG2E, z.shape, [lse_dim])
        p = g = jnp.exp2(z * LOG2E - lse2)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
        g = p if params.activation == "softmax" else jnp.where(mask, g, 0.0)
    return p, g


def _store_slices(stage, val, dst, first_row, last_row):
    """TMA-stores rows [first_row, last_row) of the [RES, d] value val through the staging buffer, its width of
    columns at a time (dst(row offset, size, col, cols): the GMEM window)."""
    cols = stage.shape[1]
    for col in range(0, val.shape[1], cols):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores have read the buffer
        stage[...] = val[:, col : col + cols]
        plgpu.commit_smem()
        _store_rows(
            stage,
            lambda off, size, col=col: dst(off, size, col, cols),
            jnp.maximum(last_row - first_row, 0),
            RES,
            first=first_row,
        )


def _dkv_split_kernel(
    work_ref,
    offsets_ref,
    targets_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    scoped,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    num_zero: int,
    block_q: int,
    stages: int,
    total_rows: int,
    interpret: bool,
    num_ctas: int | None,
):
    """dK/dV at D_SPLIT (module docstring, "Head dim 256"): one item = RES keys, both consumers walk all its
    query tiles. Consumer 0 holds dV: S^T = K Q^T, P^T and g (the dS factor: _p_and_factor, masked) into the
    exchange tile, dV += P^T dO. Consumer 1 holds dK: dP^T = V dO^T, g from the exchange tile, dS^T, dK +=
    dS^T Q. ex_full / ex_free hand the exchange tile over and back once per query tile."""
    wg = lax.axis_index("wg")
    buffers, (res_bar, s_bar, s_free, ex_full, ex_free, meet) = scoped
    k_res, v_res, stage_bufs, q_smem, do_smem, lse_smem, delta_smem, ex_smem = buffers
    d = k_res.shape[-1]
    bq = block_q
    dtype = q_ref.dtype
    num_seqs = offsets_ref.shape[0] - 1
    softmax = params.activation == "softmax"
    scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
    num_iters, item_of = _persistent(num_ctas, num_work + num_zero, heads)

    def info(i):
        h, w = item_of(i)
        f = _Frame(work_ref, offsets_ref, targets_ref, params, num_work, h, w, tile=RES)
        lo, hi = _q_tiles(f, f.tile_lo, RES, bq, params)
        return f, lo, jnp.where(f.valid, hi, lo)

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def load_res(i, c: int):
        """Starts the TMA of consumer c's resident rows of the CTA's i-th item: K (0) or V (1)."""
        f, _, _ = info(i)

        @pl.when(f.valid & (i < num_iters))
        def _():
            row = pl.multiple_of(f.base + f.tile_lo, ALIGN)
            src, dst = (k_ref, k_res) if c == 0 else (v_ref, v_res)
            plgpu.copy_gmem_to_smem(_rows_of(src, row, RES, f.h, d), dst, res_bar.at[c])

    def item(c: int, i, f: _Frame, lo, hi, g0):
        """Consumer c's share of an item: query tiles [lo, hi), the ring's tile g0 first."""
        k_lo = f.tile_lo  # frame row of the item's first key
        first_row = jnp.clip(f.d - k_lo, 0, RES)  # the item's keys of the sequence: [first_row, last_row)
        last_row = jnp.clip(f.end - k_lo, 0, RES)
        f_lo, f_hi = _q_free(f, k_lo, RES, bq, lo, hi, params)
        plgpu.barrier_wait(res_bar.at[c])  # started by load_res(i, c) at the end of the previous item

        def scores(n, dv_acc, masked: bool):
            j = g0 + n - lo  # the CTA's running query-tile count
            slot = slot_of(j)
            plgpu.barrier_wait(s_bar.at[slot])
            st = _one_product(interpret, k_res, q_smem.at[slot], (RES, bq))
            if params.options.split_meet:  # S^T is done: consumer 1 may issue dP^T
                plgpu.barrier_arrive(meet)
                plgpu.barrier_wait(meet)
            lse = _load_vector(interpret, lse_smem.at[slot], _COL) if softmax else None
            mask = None
            if masked:  # rows: keys, columns: queries (sequence positions)
                keys = (k_lo - f.d) + _iota(interpret, (RES, bq), 0)
                queries = (n * bq - f.d) + _iota(interpret, (RES, bq), 1)
                mask = tiling.allowed_2d(queries, keys, f.length, f.first_target, params) & (keys >= 0)
            pt, factor = _p_and_factor(st * params.alpha, mask, lse, params, 1)

            @pl.when(j > 0)
            def _():
                plgpu.barrier_wait(ex_free)  # consumer 1 has read the previous tile's g

            ex_smem[...] = factor.astype(ex_smem.dtype)
            plgpu.barrier_arrive(ex_full)
            (dv_acc,) = _accumulate(interpret, (dv_acc,), (pt.astype(dtype),), (do_smem.at[slot],))
            plgpu.barrier_arrive(s_free.at[slot])
            return dv_acc

        def grads(n, dk_acc):
            slot = slot_of(g0 + n - lo)
            if params.options.split_meet:  # after consumer 0's S^T wgmma
                plgpu.barrier_arrive(meet)
                plgpu.barrier_wait(meet)
            plgpu.barrier_wait(s_bar.at[slot])
            dpt = _one_product(interpret, v_res, do_smem.at[slot], (RES, bq))
            plgpu.barrier_wait(ex_full)
            factor = _load_vector(interpret, ex_smem, plgpu.Layout.WGMMA).astype(jnp.float32)
            plgpu.barrier_arrive(ex_free)
            # No mask: g is zero in masked cells, and their dP^T is finite (dO is zero past offsets[B]) except in
            # the rows of keys past offsets[B] (V may hold NaN there), which reach only their own, unstored, dK rows
            if softmax:
                delta = _load_vector(interpret, delta_smem.at[slot], _COL)
                dst = factor * (dpt - lax.broadcast_in_dim(delta, (RES, bq), [1]))
            else:
                dst = dpt * factor
            (dk_acc,) = _accumulate(interpret, (dk_acc,), (dst.astype(dtype),), (q_smem.at[slot],))
            plgpu.barrier_arrive(s_free.at[slot])
            return dk_acc

        acc = _cast(interpret, jnp.zeros((RES, d), jnp.float32), plgpu.Layout.WGMMA)
        if c == 0:
            acc = lax.fori_loop(lo, f_lo, functools.partial(scores, masked=True), acc)
            acc = lax.fori_loop(f_lo, f_hi, functools.partial(scores, masked=False), acc)
            acc = lax.fori_loop(f_hi, hi, functools.partial(scores, masked=True), acc)
            out, ref = (acc * scale).astype(dtype), dv_ref
        else:
            acc = lax.fori_loop(lo, hi, grads, acc)
            out, ref = (acc * (params.alpha * scale)).astype(dtype), dk_ref
        load_res(i + 1, c)  # the last wgmma has read K (V): fetch the next item's rows during the epilogue
        _store_slices(
            stage_bufs[c],
            out,
            lambda off, size, col, cols: _rows_of(
                ref, f.base + k_lo + first_row + off, size, f.h, d, col, cols
            ),
            first_row,
            last_row,
        )

    def consumer(c: int):
        plgpu.set_max_registers(232, action="increase")

        def one(i, g):
            f, lo, hi = info(i)
            pl.when(f.valid)(lambda: item(c, i, f, lo, hi, g))

            @pl.when(f.w >= num_work)
            def _():  # each consumer zeroes its own output's rows past offsets[B]
                _zero_tail(
                    stage_bufs[c], ((dv_ref if c == 0 else dk_ref, f.h, d),), offsets_ref, f.w - num_work,
                    num_seqs=num_seqs, total_rows=total_rows, interpret=interpret,
                )  # fmt: skip

            return g + hi - lo

        load_res(0, c)
        g = lax.fori_loop(0, num_iters, one, jnp.int32(0))
        if c == 0:  # observe the last tile's release too: the barrier then ends in a consistent phase

            @pl.when(g > 0)
            def _():
                plgpu.barrier_wait(ex_free)

        plgpu.wait_smem_to_gmem(0)

    for c in range(COMPUTE_WGS):  # static roles: one branch per consumer
        pl.when(wg == c)(functools.partial(consumer, c))

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        ins = (q_ref, do_ref, lse_ref, delta_ref, None)
        bufs = (q_smem, do_smem, lse_smem, delta_smem, None)
        _stream_queries(info, num_iters, ins, bufs, s_bar, s_free, bq, stages, params)


# ---------------------------------------------------------------------------------------------------- dQ


def _dq_kernel(
    work_ref,
    offsets_ref,
    targets_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    ts_ref,
    pos_ref,
    time_ref,
    dq_ref,
    dpos_ref,
    dtime_ref,
    scoped,
    *,
    params: KernelParams,
    heads: int,
    num_work: int,
    num_zero: int,
    block_k: int,
    stages: int,
    total_rows: int,
    interpret: bool,
    num_ctas: int | None,
):
    wg = lax.axis_index("wg")
    buffers, (res_bar, s_bar, s_free) = scoped
    q_res2, do_res2, lse_res2, delta_res2, stage_bufs, k_smem, v_smem, bias_bufs = buffers
    # (None: no such bias) hists: per consumer, lane-private [rows, LANES]; rows: per consumer, [rows]
    tsq_res2, tsk_smem, pos_tabs, time_tabs, pos_hist, time_hist, pos_row, time_row = bias_bufs
    has_bias = params.has_pos or params.has_time
    dqk, dv = q_res2.shape[-1], do_res2.shape[-1]
    bk = block_k
    dtype = q_ref.dtype
    num_seqs = offsets_ref.shape[0] - 1
    softmax = params.activation == "softmax"
    num_iters, item_of = _persistent(num_ctas, num_work + num_zero, heads)

    def info(i):
        h, w = item_of(i)
        f = _Frame(work_ref, offsets_ref, targets_ref, params, num_work, h, w)
        return (f, *_cta_range(f, _k_tiles, bk, params))

    def slot_of(g):
        return lax.rem(g, jnp.int32(stages))

    def load_res(i):
        """Starts the TMAs of this consumer's resident Q and dO rows (and lse, delta) of the CTA's i-th item."""
        f, _, _ = info(i)

        @pl.when(f.valid & (i < num_iters))
        def _():
            row = pl.multiple_of(f.base + f.tile_lo + wg * RES, ALIGN)
            plgpu.copy_gmem_to_smem(_rows_of(q_ref, row, RES, f.h, dqk), q_res2.at[wg], res_bar.at[wg])
            plgpu.copy_gmem_to_smem(_rows_of(do_ref, row, RES, f.h, dv), do_res2.at[wg], res_bar.at[wg])
            if softmax:
                vec = pl.ds(row, RES)
                plgpu.copy_gmem_to_smem(lse_ref.at[f.h, vec], lse_res2.at[wg], res_bar.at[wg])
                plgpu.copy_gmem_to_smem(delta_ref.at[f.h, vec], delta_res2.at[wg], res_bar.at[wg])
            _load_bias_res(ts_ref, pos_ref, time_ref, row, f.h, tsq_res2, pos_tabs, time_tabs, wg, res_bar)

    def consumer_item(i, f: _Frame, cta_lo, cta_hi, g0):
        q_res, do_res = q_res2.at[wg], do_res2.at[wg]
        q_lo = f.tile_lo + wg * RES
        first_row = jnp.clip(f.d - q_lo, 0, RES)
        last_row = jnp.clip(f.end - q_lo, 0, RES)
        lo, hi = _k_tiles(f, q_lo, RES, bk, params)
        empty = hi <= lo
        lo, hi = jnp.where(empty, cta_lo, lo), jnp.where(empty, cta_lo, hi)
        f_lo, f_hi = _k_free(f, q_lo, RES, bk, lo, hi, params)
        if (
            has_bias
        ):  # the table gradients sum dS over the cells: rows outside the sequence must be masked too
            f_hi = jnp.where((q_lo >= f.d) & (q_lo + RES <= f.end), f_hi, f_lo)

        def slot_at(n):
            return slot_of(g0 + n - cta_lo)

        def drain(n):
            slot = slot_at(n)
            plgpu.barrier_wait(s_bar.at[slot])
            plgpu.barrier_arrive(s_free.at[slot])

        plgpu.barrier_wait(res_bar.at[wg])
        lse = delta = None
        if softmax:
            lse = _load_vector(interpret, lse_res2.at[wg], _ROW)
            delta = _load_vector(interpret, delta_res2.at[wg], _ROW)
        pl.loop(cta_lo, lo)(drain)

        def body(n, carry, masked: bool, clipped: bool = False):
            dq_acc, far = carry
            slot = slot_at(n)
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            plgpu.barrier_wait(s_bar.at[slot])
            s, dp = _two_products(interpret, q_res, k_tile, do_res, v_tile, (RES, bk))
            mask = None
            if masked:
                rows = (q_lo - f.d) + _iota(interpret, (RES, bk), 0)
                cols = (n * bk - f.d) + _iota(interpret, (RES, bk), 1)
                mask = tiling.allowed_2d(rows, cols, f.length, f.first_target, params) & (cols >= 0)
            z = s * params.alpha
            if has_bias:
                rel = (q_lo - n * bk) + _iota(interpret, (RES, bk), 0) - _iota(interpret, (RES, bk), 1)
                ts_q = ts_k = None
                if params.has_time:
                    ts_q = _ts_pair(interpret, tsq_res2.at[wg], _ROW, (RES, bk), 0)
                    ts_k = _ts_pair(interpret, tsk_smem.at[slot], _COL, (RES, bk), 1)
                pos_tab = pos_tabs.at[wg] if params.has_pos else None
                time_tab = time_tabs.at[wg] if params.has_time else None
                bias, pb, tb = _bias(interpret, params, pos_tab, time_tab, rel, ts_q, ts_k, clipped)
                z = z + bias
            _, ds = _ds(z, dp, mask, lse, delta, params, 0)
            if params.has_pos and clipped:  # every cell in the last bucket: row sums, added once per item
                far = far + ds.sum(axis=1)
            elif params.has_pos:  # dS into this consumer's histograms (masked cells add 0)
                _hist_add(interpret, pos_hist.at[wg], pb, ds, diagonals=True)
            if params.has_time:
                _hist_add(interpret, time_hist.at[wg], tb, ds)
            (dq_acc,) = _accumulate(interpret, (dq_acc,), (ds.astype(dtype),), (k_tile,))
            plgpu.barrier_arrive(s_free.at[slot])
            return dq_acc, far

        dq = _cast(interpret, jnp.zeros((RES, dqk), jnp.float32), plgpu.Layout.WGMMA)
        far = _cast(interpret, jnp.zeros((RES,), jnp.float32), _ROW) if params.has_pos else None
        c_hi = _k_clipped_end(q_lo, bk, f_lo, f_hi, params)  # far below the diagonal: a scalar pos bias
        carry = lax.fori_loop(lo, f_lo, functools.partial(body, masked=True), (dq, far))
        if params.has_pos:
            carry = lax.fori_loop(f_lo, c_hi, functools.partial(body, masked=False, clipped=True), carry)
        carry = lax.fori_loop(c_hi, f_hi, functools.partial(body, masked=False), carry)
        dq, far = lax.fori_loop(f_hi, hi, functools.partial(body, masked=True), carry)
        if params.has_pos:  # the clipped tiles' dS, into the last position bucket
            col0 = _iota(interpret, (RES, bk), 1) == 0
            sums = jnp.where(col0, lax.broadcast_in_dim(far, (RES, bk), [0]), 0.0)
            last = jnp.full((RES, bk), params.num_pos - 1, jnp.int32)
            _hist_add(interpret, pos_hist.at[wg], _cast(interpret, last, plgpu.Layout.WGMMA), sums)
        # this item's table gradients: one [buckets] row per (item, head, consumer), plain TMA stores
        slot = (f.w * heads + f.h) * COMPUTE_WGS + wg
        for hist, row, out in ((pos_hist, pos_row, dpos_ref), (time_hist, time_row, dtime_ref)):
            if hist is not None:
                width = row.shape[1]
                dst = out.at[pl.ds(pl.multiple_of(slot * width, 64), width)]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's row has been read
                _hist_flush(interpret, hist.at[wg], row.at[wg], dst)
        pl.loop(hi, cta_hi)(drain)
        load_res(i + 1)  # the last wgmmas have read Q and dO (and lse, delta are in registers)
        scale = 1.0 / params.max_seq_len if params.activation == "silu" else 1.0
        dq = (dq * (params.alpha * scale)).astype(dtype)

        def epilogue(c):
            stage = stage_bufs[c]
            cols = stage.shape[1]  # dqk, or (D_SPLIT) a slice of it at a time
            for col in range(0, dqk, cols):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                stage[...] = dq if cols == dqk else dq[:, col : col + cols]
                plgpu.commit_smem()
                _store_rows(
                    stage,
                    lambda off, size, col=col: _rows_of(
                        dq_ref, f.base + q_lo + first_row + off, size, f.h, dqk, col, cols
                    ),
                    jnp.maximum(last_row - first_row, 0),
                    RES,
                    first=first_row,
                )

        for c in range(COMPUTE_WGS):
            pl.when(wg == c)(functools.partial(epilogue, c))

    @pl.when(wg < COMPUTE_WGS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")

        def one(i, g):
            f, cta_lo, cta_hi = info(i)
            pl.when(f.valid)(lambda: consumer_item(i, f, cta_lo, cta_hi, g))

            @pl.when((f.w >= num_work) & (wg == 0))
            def _():
                _zero_tail(
                    stage_bufs[0], ((dq_ref, f.h, dqk),), offsets_ref, f.w - num_work,
                    num_seqs=num_seqs, total_rows=total_rows, interpret=interpret,
                )  # fmt: skip

            return g + cta_hi - cta_lo

        for hist in (pos_hist, time_hist):  # zero this consumer's histograms (the flushes keep them zero)
            if hist is not None:
                hist.at[wg][...] = jnp.zeros(hist.shape[1:], jnp.float32)
        plgpu.commit_smem()
        load_res(0)
        lax.fori_loop(0, num_iters, one, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def one(i, g):
            f, cta_lo, cta_hi = info(i)

            @pl.loop(cta_lo, cta_hi)
            def _(n):
                j = g + n - cta_lo
                slot = slot_of(j)
                row = pl.multiple_of(f.base + n * bk, ALIGN)

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(s_free.at[slot])

                plgpu.copy_gmem_to_smem(_rows_of(k_ref, row, bk, f.h, dqk), k_smem.at[slot], s_bar.at[slot])
                plgpu.copy_gmem_to_smem(_rows_of(v_ref, row, bk, f.h, dv), v_smem.at[slot], s_bar.at[slot])
                if params.has_time:
                    plgpu.copy_gmem_to_smem(ts_ref.at[:, pl.ds(row, bk)], tsk_smem.at[slot], s_bar.at[slot])

            return g + cta_hi - cta_lo

        g = lax.fori_loop(0, num_iters, one, jnp.int32(0))

        @pl.loop(jnp.maximum(g - stages, 0), g)
        def _(step):
            plgpu.barrier_wait(s_free.at[slot_of(step)])


# ------------------------------------------------------------------------------------------------ driver


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
    """gpu.backward's cotangents (dq, dk, dv, None x 3, dpos, dtime) from gpu.forward's residuals, for the
    calls supports() takes. The bias tables are gpu.to_kernel_layout's (float32, padded; the time table's extra
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
    ts = tiling.split_timestamps(ts) if params.has_time else jnp.zeros((2, ALIGN), jnp.float32)
    dummy = jnp.zeros((1, 32), jnp.float32)
    pos_rows = _table_rows(pos_tab, heads, pos_width) if params.has_pos else dummy
    time_rows = _table_rows(time_tab, heads, time_width) if params.has_time else dummy
    bias_ins = (ts, pos_rows, time_rows)
    bias_arrivals = _bias_arrivals(params)

    def bias_smem(stages: int, block: int, hist: bool):
        """(resident rows' timestamps, streamed rows' timestamps, pos table, time table[, lane-private
        histograms (pos, time), their lane sums (pos, time)])."""
        smem = (
            plgpu.SMEM((COMPUTE_WGS, 2, RES), jnp.float32) if params.has_time else None,
            plgpu.SMEM((stages, 2, block), jnp.float32) if params.has_time else None,
            plgpu.SMEM((COMPUTE_WGS, pos_width), jnp.float32) if params.has_pos else None,
            plgpu.SMEM((COMPUTE_WGS, time_width), jnp.float32) if params.has_time else None,
        )
        if hist:
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
    if split:  # one RES-key item per CTA, its consumers split by role (_dkv_split_kernel)
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
            _dkv_split_kernel, num_work=num_work, block_q=bq, stages=stages_dkv, **common
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
        kernel = functools.partial(_dkv_kernel, num_work=num_work, block_q=bq, stages=stages_dkv, **common)
        args = (*ins, *bias_ins)
    dk, dvv = plgpu.kernel(
        _scoped_kernel(kernel, smem, barriers),
        out_type=(
            jax.ShapeDtypeStruct((t, heads * dqk), k.dtype),
            jax.ShapeDtypeStruct((t, heads * dv), v.dtype),
        ),
        grid=grid(num_work),
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
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
        plgpu.Barrier(num_arrivals=res_arrivals + bias_arrivals, num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_arrivals=2 + params.has_time, num_barriers=stages_dq),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages_dq),
    )
    # the bias-table gradients: one row of hist_rows(buckets) per (work item, head, consumer), summed here
    hist_shape = lambda has, n: (num_work * heads * COMPUTE_WGS * hist_rows(n) if has else 64,)
    kernel = functools.partial(_dq_kernel, num_work=num_work, block_k=bk, stages=stages_dq, **common)
    dq, dpos_parts, dtime_parts = plgpu.kernel(
        _scoped_kernel(kernel, smem, barriers),
        out_type=(
            jax.ShapeDtypeStruct((t, heads * dqk), q.dtype),
            jax.ShapeDtypeStruct(hist_shape(params.has_pos, params.num_pos), jnp.float32),
            jax.ShapeDtypeStruct(hist_shape(params.has_time, params.num_time), jnp.float32),
        ),
        grid=grid(num_work),
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(work, offsets, targets.astype(jnp.int32), *ins, *bias_ins)

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
    """gpu.backward's contract with the default tiles (see supports())."""
    return backward_mosaic_gpu(residuals, d_out, params)
