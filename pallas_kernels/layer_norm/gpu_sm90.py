"""Pallas Mosaic GPU (Hopper) layer norm: the same forward and backward as gpu.py (Triton), for sm90.

Why: jax deprecates Pallas's Triton backend, and on Hopper every kernel of this project runs Mosaic GPU
(gpu.py stays for pre-Hopper GPUs). The work is bandwidth-bound: rows of D = 512 or 1024, 65k-200k of them.

Design:
* Grid: persistent CTAs (params.num_ctas, at most one per row block) of one warpgroup each; CTA i takes a
  contiguous range of row blocks of params.rows rows.
* Pipeline: a ring of params.stages shared-memory slots per row array. TMA brings a block of every input
  (x; the gate; dy and the residual's gradient backward) into a slot, the warpgroup computes from the slot
  into the output slots, TMA stores those; the slot is refilled with the block `stages` steps ahead. Written
  by hand rather than with plgpu.emit_pipeline, whose output stores are predicated copies that the Mosaic GPU
  interpreter (the CPU tests) does not run.
* Registers: a warpgroup takes 4 rows at a time, one per warp, each row spread over the warp's 32 lanes in
  vectors of up to 4 contiguous elements (a TILED layout, `_layouts`). Row sums are then lane shuffles inside
  a warp: no shared-memory round trip, no cross-warp barrier. Statistics are float32 and two-pass, as the
  reference: mean, then the mean of squared deviations from the registers.
* Rows travel as [rows, D / chunk, chunk] boxes, chunk <= 256 (a TMA box has at most 256 elements per side),
  and sit in registers as one [4, chunk] array per chunk.
* Backward: the statistics are recomputed (x is read anyway). Each thread adds its rows' contributions to the
  scale and bias gradients into [4, D] float32 accumulators carried through the CTA's loop (no cross-warp
  reduction, no atomics); at the end every CTA stores its accumulators as 8 partial rows, which `backward`
  sums in XLA.

Contract (api.py checks, tiles.py sizes): D a multiple of 32 up to tiles.MAX_WIDTH, rows a multiple of
params.rows (a multiple of 4). Lowered with Lane semantics, set explicitly: jax 0.10.2 lowers Pallas Mosaic
GPU with Lane semantics by default, 0.11.2 with Warpgroup semantics, and the TILED register layout here is a
Lane-semantics construct (version-dependent: both versions take the explicit setting).

CPU checks: tests/test_layer_norm_sm90.py lowers the kernels for the GPU (`lower(lowering_platforms=
("cuda",))`) at the GPU configs' shapes and runs them in the Mosaic GPU interpreter against reference.py.
The interpreter has no register layouts (it runs plain jnp on whole arrays) and runs TMA copies eagerly, so
it checks the arithmetic, the ring's indexing and barrier counts, not the layouts' code or timing. Not yet
run or measured on an H200.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa  # Mosaic GPU's own layout types (Layout.TILED)
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, ArrayLike, Float

from pallas_kernels.layer_norm.params import NormParams
from pallas_kernels.layer_norm.tiles import ROWS_PER_GROUP
from pallas_kernels.mosaic_common import num_sms

MAX_BOX = 256  # elements a TMA copy moves along each dimension at most
LANES = 32
PARTIAL_ROWS = 2 * ROWS_PER_GROUP  # per CTA: the scale gradient's 4 partial rows, then the bias gradient's


def chunk_width(d: int) -> int:
    """Columns per chunk: the widest multiple of 32 that divides D and fits a TMA box."""
    return next(c for c in range(min(d, MAX_BOX), 0, -LANES) if d % c == 0)


def _layouts(chunk: int):
    """(rows, cols): the [4, chunk] register layout (warp w holds row w, lane l holds vectors of v contiguous
    elements at columns 32 v j + v l), and the [chunk] layout of a vector broadcast along its rows."""
    v = 4 if chunk % 128 == 0 else 2 if chunk % 64 == 0 else 1
    rows = fa.TiledLayout(
        fa.Tiling(((ROWS_PER_GROUP, LANES * v), (v,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1
    )
    cols = rows.reduce([0])  # the warps replicated: every warp holds the whole vector
    return tuple(
        plgpu.Layout.TILED(t.tiling, warp_dims=t.warp_dims, lane_dims=t.lane_dims, vector_dim=t.vector_dim)
        for t in (rows, cols)
    )


@dataclasses.dataclass(frozen=True)
class _Regs:
    """Loads and broadcasts in the register layouts of `_layouts` (plain jnp in the interpreter, which has
    no layouts)."""

    interpret: bool
    width: int  # D, for the row means
    chunk: int

    def _cast(self, value, which: int):
        return value if self.interpret else plgpu.layout_cast(value, _layouts(self.chunk)[which])

    def load(self, ref):
        """A [4, chunk] shared-memory ref as float32 registers."""
        return self._cast(ref[...], 0).astype(jnp.float32)

    def store(self, ref, value):
        ref[...] = value.astype(ref.dtype)

    def column(self, ref):
        """A [chunk] float32 shared-memory vector broadcast to [4, chunk]."""
        vec = self._cast(ref[...], 1)
        return self._cast(lax.broadcast_in_dim(vec, (ROWS_PER_GROUP, self.chunk), (1,)), 0)

    def row_mean(self, chunks):
        """The [4] row means of a row group's chunks, broadcast back to [4, chunk]: the chunks added first,
        then one reduction over the lanes (shuffles inside each warp)."""
        mean = jnp.sum(functools.reduce(operator.add, chunks), axis=1) * (1.0 / self.width)
        return self._cast(lax.broadcast_in_dim(mean, (ROWS_PER_GROUP, self.chunk), (0,)), 0)

    def zeros(self):
        return self._cast(jnp.zeros((ROWS_PER_GROUP, self.chunk), jnp.float32), 0)


def _normalise(regs: _Regs, xs, eps: float):
    """(x - mean) * rstd of a row group's float32 chunks, and rstd broadcast to [4, chunk]."""
    mean = regs.row_mean(xs)
    xc = [x - mean for x in xs]
    rstd = lax.rsqrt(regs.row_mean([x * x for x in xc]) + eps)
    return [x * rstd for x in xc], rstd


def _pipeline(step, carry, *, blocks: int, params: NormParams, ins, outs, in_smem, out_smem, loaded):
    """Runs carry = step(slot, carry) over this CTA's row blocks: a ring of params.stages slots per array.

    ins / outs: [R, C, chunk] GMEM refs; in_smem / out_smem: their [stages, rows, C, chunk] rings; loaded: one
    barrier per slot, len(ins) copies arriving on it.
    """
    br, stages = params.rows, params.stages
    cta = lax.axis_index("cta")
    share, extra = divmod(blocks, min(params.num_ctas or num_sms(), blocks))
    first = cta * share + jnp.minimum(cta, extra)  # this CTA's blocks: first, ..., first + count - 1
    count = share + (cta < extra).astype(jnp.int32)

    def fetch(i, slot):
        for src, ring in zip(ins, in_smem):
            plgpu.copy_gmem_to_smem(src.at[pl.ds((first + i) * br, br)], ring.at[slot], loaded.at[slot])

    for s in range(stages):

        @pl.when(s < count)
        def _(s=s):
            fetch(s, s)

    def body(i, carry):
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(loaded.at[slot])
        # the store of step i - stages has read this slot's outputs
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
        carry = step(slot, carry)
        plgpu.commit_smem()  # the outputs are visible to TMA, and every warp is done with the input slot
        for dst, ring in zip(outs, out_smem):
            plgpu.copy_smem_to_gmem(ring.at[slot], dst.at[pl.ds((first + i) * br, br)], commit_group=False)
        plgpu.commit_smem_to_gmem_group()

        @pl.when(i + stages < count)
        def _():
            fetch(i + stages, slot)

        return carry

    carry = lax.fori_loop(0, count, body, carry)
    plgpu.wait_smem_to_gmem(0)
    return carry


def _call(kernel, out_types, rings, params: NormParams, blocks: int, extra_scratch, *args):
    """plgpu.kernel over min(num_ctas, blocks) CTAs of one warpgroup; rings: (shape, dtype) of each row
    array's [rows, C, chunk] block, inputs first."""
    scratch = [plgpu.SMEM((params.stages, *shape), dtype) for shape, dtype in rings]
    return plgpu.kernel(
        kernel,
        out_type=out_types,
        grid=(num_ctas(blocks * params.rows, params),),
        grid_names=("cta",),
        scratch_types=[*scratch, *extra_scratch],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name=kernel.__name__,  # in profiles and jaxprs, as gpu.py's pallas_call names
    )(*args)


def _load_affine(affine_ref, affine_smem, barrier):
    plgpu.copy_gmem_to_smem(affine_ref, affine_smem, barrier)
    plgpu.barrier_wait(barrier)


def num_ctas(rows: int, params: NormParams) -> int:
    """The kernels' grid: one CTA per row block at most."""
    return min(params.num_ctas or num_sms(), rows // params.rows)


def forward(
    x: Float[ArrayLike, "R D"],
    scale: Float[ArrayLike, " D"],
    bias: Float[ArrayLike, " D"],
    gate: Float[ArrayLike, "R D"] | None,
    params: NormParams,
) -> Float[Array, "R D"]:
    r, d = x.shape
    chunk = chunk_width(d)
    c, br, blocks = d // chunk, params.rows, r // params.rows
    regs = _Regs(params.interpret, d, chunk)
    inputs = [x] + ([gate] if params.has_gate else [])
    out_dtype = jnp.dtype(params.out_dtype)
    n_in = len(inputs)

    def layer_norm_fwd(affine_ref, *refs):
        ins, (y_ref,) = refs[:n_in], refs[n_in : n_in + 1]
        in_smem, (y_smem,) = refs[n_in + 1 : 2 * n_in + 1], refs[2 * n_in + 1 : 2 * n_in + 2]
        affine_smem, loaded, affine_loaded = refs[2 * n_in + 2 :]
        _load_affine(affine_ref, affine_smem, affine_loaded.at[0])

        def step(slot, carry):
            for g in range(br // ROWS_PER_GROUP):
                rows = pl.ds(g * ROWS_PER_GROUP, ROWS_PER_GROUP)
                xs = [regs.load(in_smem[0].at[slot, rows, k]) for k in range(c)]
                xhat, _ = _normalise(regs, xs, params.eps)
                for k in range(c):
                    y = xhat[k] * regs.column(affine_smem.at[0, k]) + regs.column(affine_smem.at[1, k])
                    if params.has_gate:
                        y = y * regs.load(in_smem[1].at[slot, rows, k])
                    regs.store(y_smem.at[slot, rows, k], y)
            return carry

        _pipeline(
            step, (), blocks=blocks, params=params, ins=ins, outs=[y_ref], in_smem=in_smem,
            out_smem=[y_smem], loaded=loaded,
        )  # fmt: skip

    block = (br, c, chunk)
    y = _call(
        layer_norm_fwd,
        jax.ShapeDtypeStruct((r, c, chunk), out_dtype),
        [(block, a.dtype) for a in inputs] + [(block, out_dtype)],
        params,
        blocks,
        [
            plgpu.SMEM((2, c, chunk), jnp.float32),
            plgpu.Barrier(num_arrivals=n_in, num_barriers=params.stages),
            plgpu.Barrier(num_barriers=1),
        ],
        _affine(scale, bias, c, chunk),
        *(a.reshape(r, c, chunk) for a in inputs),
    )
    return y.reshape(r, d)


def _affine(scale, bias, c: int, chunk: int):
    return jnp.stack([jnp.asarray(scale, jnp.float32), jnp.asarray(bias, jnp.float32)]).reshape(2, c, chunk)


def backward(
    x: Float[ArrayLike, "R D"],
    scale: Float[ArrayLike, " D"],
    bias: Float[ArrayLike, " D"],
    gate: Float[ArrayLike, "R D"] | None,
    dy: Float[ArrayLike, "R D"],
    d_residual: Float[ArrayLike, "R D"] | None,
    params: NormParams,
) -> tuple[Float[Array, "R D"], Float[Array, " D"], Float[Array, " D"], Float[Array, "R D"] | None]:
    """(dx [+ d_residual], d_scale, d_bias, d_gate or None) of the forward's inputs, as gpu.backward."""
    r, d = x.shape
    chunk = chunk_width(d)
    c, br, blocks = d // chunk, params.rows, r // params.rows
    ctas = num_ctas(r, params)
    regs = _Regs(params.interpret, d, chunk)
    inputs = [x, dy] + ([gate] if params.has_gate else []) + ([d_residual] if params.has_residual else [])
    out_dtypes = [x.dtype] + ([gate.dtype] if params.has_gate else [])
    n_in, n_out = len(inputs), len(out_dtypes)

    def layer_norm_bwd(affine_ref, *refs):
        ins, outs = refs[:n_in], refs[n_in : n_in + n_out]
        (part_ref,) = refs[n_in + n_out : n_in + n_out + 1]
        rest = refs[n_in + n_out + 1 :]
        in_smem, out_smem = rest[:n_in], rest[n_in : n_in + n_out]
        affine_smem, part_smem, loaded, affine_loaded = rest[n_in + n_out :]
        _load_affine(affine_ref, affine_smem, affine_loaded.at[0])

        def step(slot, sums):
            d_scale, d_bias = list(sums[:c]), list(sums[c:])
            for g in range(br // ROWS_PER_GROUP):
                rows = pl.ds(g * ROWS_PER_GROUP, ROWS_PER_GROUP)
                loads = iter(in_smem[2:])
                gate_smem = next(loads) if params.has_gate else None
                dres_smem = next(loads) if params.has_residual else None
                xs = [regs.load(in_smem[0].at[slot, rows, k]) for k in range(c)]
                xhat, rstd = _normalise(regs, xs, params.eps)
                scale_k = [regs.column(affine_smem.at[0, k]) for k in range(c)]
                gs = []  # the gradient of the normalised rows times scale
                for k in range(c):
                    grad = regs.load(in_smem[1].at[slot, rows, k])  # of the norm's output, before the gate
                    if gate_smem is not None:
                        norm = xhat[k] * scale_k[k] + regs.column(affine_smem.at[1, k])
                        regs.store(out_smem[1].at[slot, rows, k], grad * norm)
                        grad = grad * regs.load(gate_smem.at[slot, rows, k])
                    d_scale[k] = d_scale[k] + grad * xhat[k]
                    d_bias[k] = d_bias[k] + grad
                    gs.append(grad * scale_k[k])
                mean_gs = regs.row_mean(gs)
                mean_gsx = regs.row_mean([a * b for a, b in zip(gs, xhat)])
                for k in range(c):
                    dx = rstd * (gs[k] - mean_gs - xhat[k] * mean_gsx)
                    if dres_smem is not None:
                        dx = dx + regs.load(dres_smem.at[slot, rows, k])
                    regs.store(out_smem[0].at[slot, rows, k], dx)
            return (*d_scale, *d_bias)

        sums = _pipeline(
            step, tuple(regs.zeros() for _ in range(2 * c)), blocks=blocks, params=params, ins=ins,
            outs=outs, in_smem=in_smem, out_smem=out_smem, loaded=loaded,
        )  # fmt: skip
        for which in (0, 1):  # the scale's sums, then the bias's
            rows = pl.ds(which * ROWS_PER_GROUP, ROWS_PER_GROUP)
            for k in range(c):
                regs.store(part_smem.at[rows, k], sums[which * c + k])
        plgpu.commit_smem()
        cta = lax.axis_index("cta")
        plgpu.copy_smem_to_gmem(part_smem, part_ref.at[pl.ds(cta * PARTIAL_ROWS, PARTIAL_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    block = (br, c, chunk)
    out_types = [jax.ShapeDtypeStruct((r, c, chunk), dt) for dt in out_dtypes]
    out_types.append(jax.ShapeDtypeStruct((ctas * PARTIAL_ROWS, c, chunk), jnp.float32))
    outs = _call(
        layer_norm_bwd,
        tuple(out_types),
        [(block, a.dtype) for a in inputs] + [(block, dt) for dt in out_dtypes],
        params,
        blocks,
        [
            plgpu.SMEM((2, c, chunk), jnp.float32),
            plgpu.SMEM((PARTIAL_ROWS, c, chunk), jnp.float32),
            plgpu.Barrier(num_arrivals=n_in, num_barriers=params.stages),
            plgpu.Barrier(num_barriers=1),
        ],
        _affine(scale, bias, c, chunk),
        *(a.reshape(r, c, chunk) for a in inputs),
    )
    partials = outs[-1].reshape(ctas, 2, ROWS_PER_GROUP, d).sum(axis=(0, 2))
    dgate = outs[1].reshape(r, d) if params.has_gate else None
    return outs[0].reshape(r, d), partials[0].astype(scale.dtype), partials[1].astype(bias.dtype), dgate
