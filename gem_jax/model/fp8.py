"""FP8 matmuls for NNX: e4m3 inputs and weights, e5m2 output gradients, one scale per tensor.

Why not flax's: `flax.linen.fp8_ops` is written for Linen. Its scales and amax histories live in a
Linen variable collection and are updated by "overwrite with gradient": the custom VJP returns the
new history as the history's gradient, and an extended dtype whose `add` is `max` keeps the sum of
gradients over several uses correct. Our model is NNX, and our step differentiates a loss vmapped
over packs and shard_mapped over batch shards: JAX sums a replicated input's cotangent over both
(and private `jax._src` dtype rules are not something to build on across jax 0.10 and 0.11). The
scaling math below is the same as flax's and Transformer Engine's; the state and its update are ours.

Scaling. A tensor t is stored as q = saturate(t / s) in an FP8 format and read back as q * s, where s
(the dequantisation scale; Transformer Engine calls it scale_inv) is amax * 2^margin / fp8_max rounded
up to a power of two, so that the amax lands within the `margin`-th binade below the format's largest
value. Why powers of two: the GEMM scales its result by the product of two scales in its own output
dtype (below); a power of two is exact in bf16 and multiplying by it rounds nothing, where an arbitrary
product rounded to bf16 would scale every output by the same error of up to 2^-9. Division by a power
of two is exact too, so quantising rounds only once. It costs at most one binade of the format's range
at the small end (as Transformer Engine's power-of-2 scales and DeepSeek-V3's recipe accept). Saturation clips to
+-fp8_max before the cast: e4m3fn has no Inf and would turn an overflow into NaN, e5m2 into Inf.
- "current": amax = max|t| of the tensor itself, now (no state).
- "delayed": amax = the max of the last N steps' amaxes (the amax history, newest first); a step's
  own amax is recorded after the step. As TE's DelayedScaling(amax_compute_algo="max") and flax.
  Non-finite entries (a diverging step) are left out of that max, and an all-zero history (the first
  step) gives s = 1 (TE keeps the previous scale instead). The scale a step uses is computed at the
  end of the step before (from the history after it) and stored in the layer's state.

GEMM form (`scaled_dot`). Each GEMM is the dot of the FP8 arrays themselves, typed in the dtype its
result is used in (bf16 activations and input gradients, f32 weight gradients), times the product of
the two scales after. On the H200 (jax 0.11.2) XLA compiles that to one cuBLASLt FP8 GEMM
(`__cublas$lt$matmul$f8`) writing bf16: 1.26-1.46x a bf16 GEMM at the HSTU layers' uvqk shapes
(docs/benchmarks.md, "FP8 (H200)"). The form XLA's GEMM rewriter documents, a dot of f32 dequantisations
`convert(f8 -> f32) * scale` with an f32 result, writes f32 there (also when the dot is typed bf16), and
casting that result back cost more than FP8 saved (docs/fp8.md). The three GEMMs: Y = X W (e4m3 x e4m3,
cuBLASLt's fast accumulation), dX = dY W^T (e5m2 x e4m3) and dW = X^T dY (e4m3 x e5m2, f32 result).
With `precision.fp8_gemms = "backward"` the forward GEMM runs in the compute dtype instead and X is stored
e4m3 and transposed for dW; gem_jax/model/fp8_silu.py does the same for a Dense followed by SiLU with a
fused gradient.

State and its update (what the trainer does). The delayed recipe keeps, per FP8 layer, an
`AmaxHistory` f32[3, N] (rows: input, weight, output gradient), three `DequantScale` scalars
(`x_scale`, `w_scale`, `g_scale`: the scales this step uses) and an `AmaxProbe` f32[3] of zeros.
The scales are stored, not computed in the step: the GEMMs multiply by the stored scalars directly, one
leaf per operand. (With the earlier dequantised GEMM form, XLA's cuBLASLt FP8 rewrite was seen to fire
on the H200 only when each scale was an entry parameter of the jitted program, docs/fp8.md.) The probe's value
is never read; its cotangent is defined as the three amaxes this call observed (the gradient's amax
is only known in the backward pass). The trainer gives every pack its own copy of the probes
(`pack_probes`, sharded and vmapped like the batch), so no sum over packs or shards ever touches
them; it reduces the per-pack cotangents with max (`combine_meta_grads`: the exact amax over the
global batch), rolls them into the histories and computes the next step's scales from the rolled
histories (`update_meta`). Histories and scales (`FP8Meta`) are ordinary replicated train state
(checkpointed with it); the optimizer never sees them (not `nnx.Param`). A layer must be called once
per forward for its probe to hold its amaxes (two calls would add).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, ArrayLike, Float

from gem_jax.precision import FP8Recipe

E4M3 = jnp.float8_e4m3fn  # inputs and weights: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # output gradients: 2 mantissa bits, max 57344, more range
_ROWS = ("input", "weight", "grad")  # rows of an AmaxHistory / entries of an AmaxProbe
_FORMATS = (E4M3, E4M3, E5M2)
SCALES = ("x_scale", "w_scale", "g_scale")  # the DequantScale attributes of an FP8Matmul, one per row


class FP8Meta(nnx.Variable):
    """FP8 train state of a delayed-scaling layer (histories and scales): replicated, checkpointed,
    never optimised. The trainer splits the model with this filter."""


class AmaxHistory(FP8Meta):
    """The last N amaxes of a layer's input, weight and output gradient, newest first: train state."""


class DequantScale(FP8Meta):
    """A rank-0 f32 dequantisation scale the next step's GEMMs multiply by: train state.

    Always `scale_from_history` of its row of the layer's `AmaxHistory` (1 before the first step);
    `update_meta` keeps them in step. One leaf per operand, so that each reaches the GEMM as a
    parameter of the jitted step (a slice of a stacked array would not)."""


class AmaxProbe(nnx.Variable):
    """Zeros whose cotangent is the amaxes a layer observed; per pack, never stored (see module doc)."""


# ----------------------------------------------------------------------------- scaling math


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def dot_error_bound(*dtypes) -> float:
    """Bound on the normwise relative (RMS) error of a long random dot whose operands (and output)
    are rounded to `dtypes`: sqrt(sum u^2) / sqrt(3), with u = 2^-(mantissa bits + 1) the unit
    roundoff. Rounding to nearest leaves an error uniform over half an ulp, so one rounding has RMS
    relative error at most u / sqrt(3) (about 0.42 u measured on normal data); independent errors add
    in quadrature. e4m3 x e4m3: 0.051; e5m2 x e4m3: 0.081; bf16 x bf16 -> bf16: 0.0039."""
    return sum((float(jnp.finfo(d).eps) / 2) ** 2 for d in dtypes) ** 0.5 / 3**0.5


def amax(t: Array) -> Float[Array, ""]:
    return jnp.max(jnp.abs(t)).astype(jnp.float32)


def scale_from_amax(a: Float[Array, "..."], dtype, margin: int) -> Float[Array, "..."]:
    """Dequantisation scale: the smallest power of two that maps amax `a` to at most fp8_max / 2^margin;
    1 where `a` is 0 or not finite."""
    ok = jnp.isfinite(a) & (a > 0)
    exact = jnp.where(ok, a.astype(jnp.float32) * (2.0**margin / fp8_max(dtype)), 1.0)
    mantissa, exponent = jnp.frexp(exact)  # exact = mantissa * 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.float32(1.0), exponent - (mantissa == 0.5)).astype(jnp.float32)


def scale_from_history(history: Float[Array, " hist"], dtype, margin: int) -> Float[Array, ""]:
    """Delayed scaling: the scale of the history's largest finite amax."""
    return scale_from_amax(jnp.max(jnp.where(jnp.isfinite(history), history, 0.0)), dtype, margin)


def scales_from_history(history: Float[Array, "3 hist"], margin: int) -> dict[str, Float[Array, ""]]:
    """The `DequantScale`s of a layer whose `AmaxHistory` is `history`, by name (`SCALES`)."""
    return {key: scale_from_history(history[i], _FORMATS[i], margin) for i, key in enumerate(SCALES)}


def roll_history(history: Float[Array, "... hist"], new: Float[Array, "..."]) -> Float[Array, "... hist"]:
    """Pushes this step's amax in front (newest first); the oldest falls off."""
    return jnp.concatenate([new[..., None].astype(history.dtype), history[..., :-1]], axis=-1)


def quantize(t: Array, scale: Float[Array, ""], dtype) -> Array:
    """t / scale, clipped to the format's range (saturation: never NaN/Inf from an overflow)."""
    m = fp8_max(dtype)
    q = jnp.clip(t.astype(jnp.float32) / scale, -m, m).astype(dtype)
    # Without the barrier XLA:GPU fused the f32 -> f8 -> f32 round trip into the GEMM's operand fusion
    # and computed in f32 (H200, jax 0.11.2: FP8 error measured below bf16's): the barrier keeps the f8
    # tensor, so the GPU computes what the CPU tests check. It is not enough for a cuBLASLt FP8 GEMM:
    # on the H200 XLA rewrites dot(convert(f8) * s, ...) only when s is an entry parameter of the
    # jitted program, not a scale computed inside it (docs/fp8.md, "Status on the H200").
    return jax.lax.optimization_barrier(q)


def scaled_dot(
    aq: Array,
    bq: Array,
    a_scale: Float[Array, ""],
    b_scale: Float[Array, ""],
    contract: tuple[int, int],
    out_dtype,
    precision,
) -> Array:
    """(aq * a_scale) . (bq * b_scale), contracting axis contract[0] of aq with contract[1] of bq, in
    `out_dtype`: the dot of the FP8 arrays typed `out_dtype`, times the scales' product (a power of two:
    exact) after (module docstring, "GEMM form"). The precision picks cuBLASLt's FP8 accumulation: DEFAULT
    turns on its fast accumulation (not periodically promoted to full f32), HIGHEST turns it off. As
    Transformer Engine and flax do, the forward GEMM accumulates fast and the two gradient GEMMs do not."""
    dims = ((contract[:1], contract[1:]), ((), ()))
    y = jax.lax.dot_general(aq, bq, dims, precision=precision, preferred_element_type=out_dtype)
    return y * (a_scale * b_scale).astype(out_dtype)


# ----------------------------------------------------------------------------- the FP8 GEMM


@dataclasses.dataclass(frozen=True)
class _Static:
    recipe: FP8Recipe
    x_dtype: Any
    w_dtype: Any
    compute_dtype: Any  # the forward GEMM's dtype when only the backward runs in FP8


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(static: _Static, x, w, scales, probe):
    return _fp8_matmul_fwd(static, x, w, scales, probe)[0]


def _fp8_matmul_fwd(static: _Static, x, w, scales, probe):
    r = static.recipe
    x_amax, w_amax = amax(x), amax(w)
    if scales is None:  # current scaling
        x_scale, w_scale = scale_from_amax(x_amax, E4M3, r.margin), scale_from_amax(w_amax, E4M3, r.margin)
        g_scale = None
    else:  # delayed: the stored scales, used as they come in (see DequantScale)
        x_scale, w_scale, g_scale = scales
    wq = quantize(w, w_scale, E4M3)
    if r.gemms == "backward":
        # The forward GEMM in the compute dtype (as a Dense without FP8); dW's FP8 input is stored transposed,
        # [K, M]: cuBLASLt FP8 reads both operands along the contracted axis, and dW contracts over rows.
        y = jnp.dot(x.astype(static.compute_dtype), w.astype(static.compute_dtype))
        xq = quantize(x.T, x_scale, E4M3)
    else:
        xq = quantize(x, x_scale, E4M3)
        y = scaled_dot(xq, wq, x_scale, w_scale, (1, 0), static.compute_dtype, jax.lax.Precision.DEFAULT)
    # Residuals are the FP8 operands (a quarter of f32), their scales and the forward amaxes.
    return y, (xq, wq, x_scale, w_scale, g_scale, x_amax, w_amax)


def _fp8_matmul_bwd(static: _Static, res, g):
    xq, wq, x_scale, w_scale, g_scale, x_amax, w_amax = res
    g_amax = amax(g)
    delayed = g_scale is not None
    if not delayed:
        g_scale = scale_from_amax(g_amax, E5M2, static.recipe.margin)
    gq = quantize(g, g_scale, E5M2)
    hi = jax.lax.Precision.HIGHEST
    dx = scaled_dot(gq, wq, g_scale, w_scale, (1, 1), static.x_dtype, hi)  # dY W^T: [M, K]
    x_contract = 1 if static.recipe.gemms == "backward" else 0  # xq is X^T [K, M] there
    dw = scaled_dot(xq, gq, x_scale, g_scale, (x_contract, 0), static.w_dtype, hi)  # X^T dY: [K, N]
    if not delayed:
        return dx, dw, None, None  # already in x's and w's dtypes (scaled_dot)
    probe_cotangent = jnp.stack([x_amax, w_amax, g_amax])
    no_scale_grads = tuple(jnp.zeros((), jnp.float32) for _ in SCALES)  # scales are state, not parameters
    return dx, dw, no_scale_grads, probe_cotangent


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


class FP8Matmul(nnx.Module):
    """The FP8 GEMM of one Dense layer (x @ w in the compute dtype) and, for delayed scaling, its state:
    `amax_history`, the scales `x_scale`, `w_scale`, `g_scale` and the `amax_probe`."""

    def __init__(self, recipe: FP8Recipe):
        self.recipe = recipe
        if recipe.kind == "delayed":
            self.amax_history = AmaxHistory(jnp.zeros((len(_ROWS), recipe.amax_history), jnp.float32))
            self.x_scale, self.w_scale, self.g_scale = (
                DequantScale(jnp.ones((), jnp.float32)) for _ in SCALES
            )
            self.amax_probe = AmaxProbe(jnp.zeros((len(_ROWS),), jnp.float32))
        else:
            self.amax_history = self.amax_probe = None
            self.x_scale = self.w_scale = self.g_scale = None

    def __call__(
        self, x: Float[ArrayLike, "rows din"], w: Float[ArrayLike, "din dout"], compute_dtype=None
    ) -> Float[Array, "rows dout"]:
        """x @ w in `compute_dtype` (default x's), its GEMMs in FP8 (with `fp8_gemms="backward"` the forward's
        in `compute_dtype`)."""
        x, w = jnp.asarray(x), jnp.asarray(w)
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
            raise ValueError(f"FP8Matmul wants x [rows, din] and w [din, dout], got {x.shape} and {w.shape}")
        static = _Static(self.recipe, x.dtype, w.dtype, jnp.dtype(compute_dtype or x.dtype))
        if self.amax_probe is None:
            return _fp8_matmul(static, x, w, None, None)
        scales = (self.x_scale.get_value(), self.w_scale.get_value(), self.g_scale.get_value())
        return _fp8_matmul(static, x, w, scales, self.amax_probe[...])


# ----------------------------------------------------------------------------- the trainer's part


def pack_probes(probes: dict, num_packs: int) -> dict:
    """One zero copy of every `AmaxProbe` per pack (leading axis), to shard and vmap like the batch.

    `probes` is `nnx.to_pure_dict(nnx.state(model, AmaxProbe))` (empty without delayed FP8 layers).
    """
    return jax.tree.map(lambda p: jnp.zeros((num_packs, *p.shape), p.dtype), probes)


def combine_meta_grads(probe_grads: dict) -> dict:
    """The global amaxes: the max over the pack axis of the per-pack probe cotangents.

    Max, never sum: a pack's cotangent is that pack's amax. Under jit over a batch-sharded pack axis,
    XLA reduces locally and all-reduces with max across shards, so the result is exact.
    """
    return jax.tree.map(lambda g: jnp.max(g, axis=0), probe_grads)


def _layers(meta: dict, amaxes: dict, keys: tuple = ()):
    """(keys, layer meta, layer amaxes) of every FP8 layer, walking `meta` and `amaxes` side by side."""
    if "amax_history" in meta:
        missing = [k for k in ("amax_probe",) if k not in amaxes] + [k for k in SCALES if k not in meta]
        if missing:
            where = "/".join(map(str, keys)) or "."
            raise KeyError(f"FP8 state: no {', '.join(missing)} beside {where}/amax_history")
        yield keys, meta, amaxes
        return
    for key, value in meta.items():
        if key not in amaxes:
            raise KeyError(f"FP8 state: the amaxes have no entry {'/'.join(map(str, (*keys, key)))}")
        yield from _layers(value, amaxes[key], (*keys, key))


def saturation(meta: dict, amaxes: dict) -> dict[str, Float[Array, ""]]:
    """How much a step's delayed scales clipped, for its metrics: `fp8_saturated`, how many FP8 tensors
    (3 per layer: input, weight, output gradient) had their largest values clipped by more than half an
    ulp of the format (amax > scale x fp8_max x (1 + eps/2): less is what rounding would have done
    anyway); `fp8_overshoot`, the largest amax / (scale x fp8_max) (<= 1: nothing clipped). `meta`
    holds the scales the step used, `amaxes` the amaxes it observed (the arguments of `update_meta`).
    Why: the delayed recipe cannot see a tensor outgrow its history (activations jump), and clipping
    costs quality silently.
    """
    ratios = [
        jnp.stack(
            [
                a["amax_probe"][i] / (m[key] * fp8_max(fmt))
                for i, (key, fmt) in enumerate(zip(SCALES, _FORMATS))
            ]
        )
        for _, m, a in _layers(meta, amaxes)
    ]
    if not ratios:
        return {}
    ratios = jnp.stack(ratios).astype(jnp.float32)  # [layers, 3]
    clipped = ratios > jnp.asarray([1.0 + float(jnp.finfo(fmt).eps) / 2 for fmt in _FORMATS], jnp.float32)
    return {"fp8_saturated": jnp.sum(clipped).astype(jnp.float32), "fp8_overshoot": jnp.max(ratios)}


def update_meta(meta: dict, amaxes: dict, margin: int = 0) -> dict:
    """The FP8 state after a step: each layer's global amaxes (from `combine_meta_grads`) rolled into
    its history, and the scales the next step will use computed from the rolled history.

    `meta` is `nnx.to_pure_dict(nnx.state(model, FP8Meta))`: per layer an "amax_history" leaf and the
    `SCALES` leaves beside it; `amaxes` has the same nesting with an "amax_probe" leaf instead.
    `margin` is the layers' recipe's (`FP8Recipe.margin`, from `precision.fp8_margin`).
    """
    new = {}
    for keys, m, a in _layers(meta, amaxes):
        history = roll_history(m["amax_history"], a["amax_probe"])
        new[keys] = dict(m, amax_history=history, **scales_from_history(history, margin))

    def rebuild(m: dict, keys: tuple) -> dict:
        return new[keys] if keys in new else {k: rebuild(v, (*keys, k)) for k, v in m.items()}

    return rebuild(meta, ())
