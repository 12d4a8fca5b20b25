"""FP8 matmuls (gem_jax/model/fp8.py): scaling math, numerics against bf16, the per-layer policy, the
GEMM pattern XLA needs for cuBLASLt FP8, and the global-max amax rule under vmap + shard_map.

On CPU XLA upcasts FP8 to f32, so the values are exactly what the GPU computes up to summation order.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from experiments.fp8_gemms import fp8_dots
from gem_jax.config import ConfigError, PrecisionConfig, load_config
from gem_jax.model import fp8
from gem_jax.model.gem import GEMModel
from gem_jax.model.layers import Dense
from gem_jax.precision import RECIPES, FP8Recipe, PrecisionPolicy
from tests.helpers import ROOT, dense_embeddings, first_pack, small_config, stacks

# ----------------------------------------------------------------------------- scaling math


def test_history_rolls_newest_first_and_keeps_the_window():
    h = jnp.zeros((3,), jnp.float32)
    for a in (1.0, 2.0, 3.0, 4.0, 5.0):
        h = fp8.roll_history(h, jnp.float32(a))
    np.testing.assert_array_equal(h, [5.0, 4.0, 3.0])  # steps 1 and 2 fell out of a 3-step window
    rows = fp8.roll_history(jnp.array([[1.0, 2.0], [7.0, 8.0]]), jnp.array([3.0, 9.0]))
    np.testing.assert_array_equal(rows, [[3.0, 1.0], [9.0, 7.0]])


def test_scales_by_hand():
    h = jnp.array([5.0, 4.0, 3.0])
    # s = amax * 2^margin / fp8_max rounded up to a power of two, with amax the history's max:
    # 5/448 = 0.0112 -> 2^-6; 20/448 = 0.0446 -> 2^-4; 5/57344 = 8.7e-5 -> 2^-13.
    assert float(fp8.scale_from_history(h, fp8.E4M3, 0)) == 2.0**-6
    assert float(fp8.scale_from_history(h, fp8.E4M3, 2)) == 2.0**-4
    assert float(fp8.scale_from_history(h, fp8.E5M2, 0)) == 2.0**-13
    # An amax that lands exactly on fp8_max x 2^e keeps that scale (no binade lost), a hair above goes up.
    assert float(fp8.scale_from_amax(jnp.float32(56.0), fp8.E4M3, 0)) == 2.0**-3
    assert float(fp8.scale_from_amax(jnp.float32(56.01), fp8.E4M3, 0)) == 2.0**-2
    # First step (all zeros) -> 1; non-finite amaxes (a diverged step) are left out of the max.
    assert float(fp8.scale_from_history(jnp.zeros(4), fp8.E4M3, 0)) == 1.0
    assert float(fp8.scale_from_history(jnp.array([jnp.inf, 2.0, 0.0]), fp8.E4M3, 0)) == 2.0**-7
    assert float(fp8.scale_from_history(jnp.array([jnp.nan, 0.0]), fp8.E4M3, 0)) == 1.0
    # Tiny and huge amaxes stay exact powers of two (gradients reach 1e-10).
    for a in (1e-10, 3e-30, 7e5):
        s = float(fp8.scale_from_amax(jnp.float32(a), fp8.E5M2, 0))
        assert np.log2(s) == round(np.log2(s)) and a / 57344 <= s < 2 * a / 57344, (a, s)
    # Current scaling: the tensor's own amax lands in the format's top binade, 3 / 2^-7 = 384 (<= 448).
    x = jnp.array([0.5, -3.0, 2.0])
    s = fp8.scale_from_amax(fp8.amax(x), fp8.E4M3, 0)
    assert float(s) == 2.0**-7
    assert float(fp8.quantize(x, s, fp8.E4M3)[1].astype(jnp.float32)) == -384.0


def test_saturation_counts_the_tensors_clipped_by_more_than_half_an_ulp():
    """fp8_saturated / fp8_overshoot by hand: a tensor counts when amax > scale x fp8_max x (1 + eps/2)
    (e4m3: 1 + 1/16, e5m2: 1 + 1/8); less than that, rounding would have moved its largest value as far."""
    ones = {k: jnp.float32(1.0) for k in fp8.SCALES}
    meta = {
        "a": {"amax_history": jnp.zeros((3, 4)), **ones},  # scale 1: ranges 448, 448, 57344
        "b": {
            0: {
                "amax_history": jnp.zeros((3, 4)),
                "x_scale": jnp.float32(0.5),
                "w_scale": jnp.float32(2.0),
                "g_scale": jnp.float32(1e-3),
            }
        },
    }
    amaxes = {
        # x at the edge, w 1.06x (under 1 + 1/16 = 1.0625), g 1.22x (over 1 + 1/8)
        "a": {"amax_probe": jnp.array([448.0, 475.0, 70000.0])},
        # x 2x (clipped), w 900/896 (a weight that grew a little: not counted), g far inside
        "b": {0: {"amax_probe": jnp.array([448.0, 900.0, 1.0])}},
    }
    out = fp8.saturation(meta, amaxes)
    assert float(out["fp8_saturated"]) == 2.0
    np.testing.assert_allclose(float(out["fp8_overshoot"]), 448.0 / (0.5 * 448.0), rtol=1e-6)
    over = jax.tree.map(lambda a: a * 1.1, amaxes)  # now every tensor but b's gradient is clipped
    assert float(fp8.saturation(meta, over)["fp8_saturated"]) == 5.0
    calm = jax.tree.map(lambda a: a / 4, amaxes)
    out = fp8.saturation(meta, calm)
    assert float(out["fp8_saturated"]) == 0.0 and float(out["fp8_overshoot"]) <= 1.0
    assert fp8.saturation({}, {}) == {}  # no FP8 layer: no metrics
    with pytest.raises(KeyError, match="b/0"):
        fp8.saturation(meta, {"a": amaxes["a"], "b": {0: {}}})


def test_quantize_saturates_instead_of_nan_or_inf():
    x = jnp.array([1000.0, -1000.0, 3.0, jnp.inf, -1e30])
    q4 = fp8.quantize(x, jnp.float32(1.0), fp8.E4M3).astype(jnp.float32)
    np.testing.assert_array_equal(q4, [448.0, -448.0, 3.0, 448.0, -448.0])
    q5 = fp8.quantize(x * 100, jnp.float32(1.0), fp8.E5M2).astype(jnp.float32)
    # 300 in e5m2: the grid between 256 and 512 has step 64, so 300 rounds to 320.
    np.testing.assert_array_equal(q5, [57344.0, -57344.0, 320.0, 57344.0, -57344.0])
    # Without the clip the casts would give NaN (e4m3fn has no Inf) and Inf: that is what we avoid.
    assert np.isnan(np.asarray(jnp.float32(1000.0).astype(fp8.E4M3), np.float32))


def test_stale_delayed_scale_saturates_the_layer_without_nan():
    """A delayed scale from small amaxes meets a 1000x larger input: outputs clip, never NaN/Inf."""
    layer = fp8.FP8Matmul(FP8Recipe("delayed", 2))
    layer.amax_history[...] = jnp.full((3, 2), 1.0)
    for name, scale in fp8.scales_from_history(layer.amax_history[...], 0).items():
        getattr(layer, name).set_value(scale)  # as the trainer's update_meta keeps them
    x = jnp.full((16, 16), 1000.0)
    w = jnp.full((16, 16), 0.5)
    y, vjp = jax.vjp(lambda x, w: layer(x, w), x, w)
    dx, dw = vjp(jnp.full((16, 16), 1e6))
    for t in (y, dx, dw):
        assert np.isfinite(np.asarray(t)).all()
    # The scale of amax 1 is 2^-8 (1/448 rounded up to a power of two): x saturates at 448 * 2^-8 = 1.75
    # per element, y = 16 * 1.75 * 0.5.
    np.testing.assert_allclose(y, 14.0)


def _split(layer: nnx.Module):
    """(graphdef, params, meta, probes) as the trainer splits a model (meta: the FP8Meta state, amax
    histories and scales); the last three as pure dicts."""
    graphdef, *states = nnx.split(layer, nnx.Param, fp8.FP8Meta, fp8.AmaxProbe)
    return graphdef, *(nnx.to_pure_dict(s) for s in states)


def test_delayed_steps_use_the_previous_history():
    """Three steps by hand: step t quantises with scales from the amaxes of steps < t, and its own
    amaxes (the probe's cotangent) are rolled in after it, with the scales of step t + 1."""
    layer = fp8.FP8Matmul(FP8Recipe("delayed", 2))
    graphdef, _, histories, probes = _split(layer)
    key = jax.random.key(0)
    w = jax.random.normal(key, (8, 4))
    seen = []
    for step, mag in enumerate((1.0, 5.0, 0.25)):
        x = mag * jax.random.normal(jax.random.fold_in(key, step), (32, 8))
        g = jax.random.normal(jax.random.fold_in(key, 100 + step), (32, 4))
        run = lambda probes, x, w: nnx.merge(graphdef, histories, probes)(x, w)  # noqa: B023
        y, vjp = jax.vjp(run, probes, x, w)
        probe_grads, _, _ = vjp(g)
        h = np.asarray(histories["amax_history"])
        sx, sw, sg = (
            2.0 ** np.ceil(np.log2(h[i].max() / m)) if h[i].max() > 0 else 1.0
            for i, m in enumerate((448.0, 448.0, 57344.0))
        )
        # The stored scales are those of the history (computed at the end of the step before).
        np.testing.assert_allclose([histories[k] for k in fp8.SCALES], [sx, sw, sg], rtol=1e-7)
        xq = fp8.quantize(x, jnp.float32(sx), fp8.E4M3).astype(jnp.float32) * sx
        wq = fp8.quantize(w, jnp.float32(sw), fp8.E4M3).astype(jnp.float32) * sw
        np.testing.assert_allclose(y, xq @ wq, rtol=1e-6, atol=1e-6)
        seen.append([np.abs(x).max(), np.abs(w).max(), np.abs(g).max()])
        np.testing.assert_allclose(probe_grads["amax_probe"], seen[-1], rtol=1e-7)
        histories = fp8.update_meta(histories, probe_grads)
    # A 2-step window after 3 steps: steps 3 and 2, newest first.
    np.testing.assert_allclose(histories["amax_history"], np.array(seen[::-1][:2]).T, rtol=1e-7)


# ----------------------------------------------------------------------------- numerics vs bf16


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_dense_matches_bf16_within_format_precision(recipe):
    """Forward and both gradients of an FP8 Dense against float32 and against a bf16 Dense, within
    the formats' error bounds (`fp8.dot_error_bound`: forward e4m3 x e4m3 0.051, dX e5m2 x e4m3 and
    dW e4m3 x e5m2 0.081, bf16 0.0039; measured 0.037, 0.059, 0.058 and 0.0029). The FP8 error must
    also be well above bf16's, or the layer did not quantise.
    """
    cfg = PrecisionConfig(compute_dtype="bfloat16", fp8=True, fp8_layers=("t/",), fp8_recipe=recipe)
    policy = PrecisionPolicy.from_config(cfg)
    layer = Dense("t/0", 256, 128, policy, rngs=nnx.Rngs(0))
    ref_layer = Dense("r/0", 256, 128, policy, rngs=nnx.Rngs(0))  # same init, bf16 GEMM
    assert layer.fp8 is not None and ref_layer.fp8 is None
    key = jax.random.key(1)
    x = jax.random.normal(key, (2, 512, 256), jnp.float32)
    c = jax.random.normal(jax.random.fold_in(key, 1), (2, 512, 128), jnp.float32)
    kernel = layer.kernel[...]

    def run(layer):
        """y, dx, dW of sum(layer(x) * c); a delayed layer is calibrated by one step first."""
        graphdef, params, histories, probes = _split(layer)

        def loss(params, probes, x):
            return jnp.sum(nnx.merge(graphdef, params, histories, probes)(x).astype(jnp.float32) * c)

        if histories:
            histories = fp8.update_meta(histories, jax.grad(loss, argnums=1)(params, probes, x))
        y = nnx.merge(graphdef, params, histories, probes)(x).astype(jnp.float32)
        dparams, dx = jax.grad(loss, argnums=(0, 2))(params, probes, x)
        return y, dx, dparams["kernel"]

    (y, dx, dw), (y_bf16, dx_bf16, dw_bf16) = run(layer), run(ref_layer)
    hi = jax.lax.Precision.HIGHEST
    y_ref = jnp.einsum("bmk,kn->bmn", x, kernel, precision=hi)
    dx_ref = jnp.einsum("bmn,kn->bmk", c, kernel, precision=hi)
    dw_ref = jnp.einsum("bmk,bmn->kn", x, c, precision=hi)
    e4, e5, bf16_dtype = fp8.E4M3, fp8.E5M2, jnp.bfloat16
    bounds = {
        "y": fp8.dot_error_bound(e4, e4),
        "dx": fp8.dot_error_bound(e5, e4),
        "dw": fp8.dot_error_bound(e4, e5),
    }
    bf16_bound = fp8.dot_error_bound(bf16_dtype, bf16_dtype, bf16_dtype)
    for name, got, bf16, ref in (
        ("y", y, y_bf16, y_ref),
        ("dx", dx, dx_bf16, dx_ref),
        ("dw", dw, dw_bf16, dw_ref),
    ):
        err, err_bf16 = _rel(got, ref), _rel(bf16, ref)
        assert 3 * bf16_bound < err < bounds[name], (name, err)
        assert err_bf16 < bf16_bound, (name, err_bf16)
        assert _rel(got, bf16) < bounds[name] + bf16_bound, name


# ----------------------------------------------------------------------------- only the backward in FP8

_WIDTHS = (32, 32, 32, 32)  # SiLU's output split as HSTU splits U, V, Q, K


def _silu_split(layer, x, implementation=None, interpret=False):
    return layer.silu_split(x, _WIDTHS, implementation=implementation, interpret=interpret)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda layer, x: (layer(x),), id="dense"),
        pytest.param(lambda layer, x: _silu_split(layer, x, "reference"), id="silu-reference"),
        pytest.param(lambda layer, x: _silu_split(layer, x, "triton", interpret=True), id="silu-kernel"),
    ],
)
def test_backward_only_fp8_matches_within_format_precision(call):
    """`precision.fp8_gemms = "backward"`: the forward is exactly the layer without FP8 (bf16 GEMM), the
    input, weight and bias gradients are within the FP8 formats' bounds of float32 (and well above bf16's,
    so they were quantised), and the probe's cotangent is the three amaxes. For a Dense followed by SiLU
    (HSTU's uvqk) the gradient is quantised inside the SiLU-backward kernel (interpret mode here) or its
    reference: both give the same gradients."""
    cfg = PrecisionConfig(fp8=True, fp8_layers=("t/",), fp8_gemms="backward")
    policy = PrecisionPolicy.from_config(cfg)
    layer = Dense("t/0", 256, 128, policy, rngs=nnx.Rngs(0))
    ref_layer = Dense("r/0", 256, 128, policy, rngs=nnx.Rngs(0))  # same init, no FP8
    assert layer.fp8.recipe.gemms == "backward" and ref_layer.fp8 is None
    layer.bias.set_value(0.1 * jax.random.normal(jax.random.key(3), (128,)))
    ref_layer.bias.set_value(layer.bias[...])
    key = jax.random.key(1)
    x = jax.random.normal(key, (1024, 256), jnp.float32)
    cts = [jax.random.normal(jax.random.fold_in(key, i), (1024, w)) for i, w in enumerate(_WIDTHS)]

    def run(layer):
        graphdef, params, histories, probes = _split(layer)

        def loss(params, probes, x):
            outs = call(nnx.merge(graphdef, params, histories, probes), x)
            ct = cts if len(outs) == len(cts) else [jnp.concatenate(cts, 1)]
            return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, ct))

        if histories:  # one delayed step calibrates the scales
            histories = fp8.update_meta(histories, jax.grad(loss, argnums=1)(params, probes, x), 1)
        outs = call(nnx.merge(graphdef, params, histories, probes), x)
        (dparams, amaxes, dx) = jax.grad(loss, argnums=(0, 1, 2))(params, probes, x)
        return outs, dparams, dx, amaxes

    outs, dparams, dx, amaxes = run(layer)
    ref_outs, _, _, _ = run(ref_layer)
    for a, b in zip(outs, ref_outs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    w, b = layer.kernel[...], layer.bias[...]
    hi = jax.lax.Precision.HIGHEST
    silu = len(outs) > 1

    def truth(w, b, x):  # float32
        z = jnp.dot(x, w, precision=hi) + b
        y = jax.nn.silu(z) if silu else z
        return jnp.sum(y * jnp.concatenate(cts, 1)), z

    (_, z), (dw_ref, db_ref, dx_ref) = truth(w, b, x), jax.grad(lambda *a: truth(*a)[0], (0, 1, 2))(w, b, x)
    bound, bf16_bound = (
        fp8.dot_error_bound(fp8.E5M2, fp8.E4M3),
        fp8.dot_error_bound(jnp.bfloat16, jnp.bfloat16),
    )
    for name, got, ref in (("dx", dx, dx_ref), ("dw", dparams["kernel"], dw_ref)):
        assert 3 * bf16_bound < _rel(got, ref) < bound, (name, _rel(got, ref))
    assert _rel(dparams["bias"], db_ref) < (0.01 if silu else bound)  # silu: summed before quantising
    g = jnp.concatenate(cts, 1) * (jax.grad(lambda z: jnp.sum(jax.nn.silu(z)))(z) if silu else 1.0)
    want = [float(fp8.amax(x)), float(fp8.amax(w)), float(fp8.amax(g))]
    np.testing.assert_allclose(np.asarray(jax.tree.leaves(amaxes)[0]), want, rtol=0.02)  # g from bf16 z


# ----------------------------------------------------------------------------- policy by layer name


def _fp8_layers(model: nnx.Module) -> list[str]:
    return sorted(n.name for _, n in nnx.iter_graph(model) if isinstance(n, Dense) and n.fp8 is not None)


def _dense_layers(model: nnx.Module) -> list[str]:
    return sorted(n.name for _, n in nnx.iter_graph(model) if isinstance(n, Dense))


def test_policy_puts_exactly_the_named_layers_in_fp8():
    model = GEMModel(small_config("precision.fp8=true"), rngs=nnx.Rngs(0))
    tolerant = [
        "hstu/0/out",
        "hstu/0/uvqk",
        "hstu/1/out",
        "hstu/1/uvqk",
        "wukong/0/fm_mlp",
        "wukong/1/fm_mlp",
    ]
    assert _fp8_layers(model) == tolerant
    # Everything else stays out: inputs, cross, and the sensitive heads.
    assert set(_dense_layers(model)) - set(tolerant) == {
        "cross/context",
        "cross/summary",
        "head/click/hidden",
        "head/click/out",
        "head/conversion/hidden",
        "head/conversion/out",
        "input/dense",
        "input/token",
    }
    assert not _fp8_layers(GEMModel(small_config(), rngs=nnx.Rngs(0)))  # off by default
    custom = GEMModel(
        small_config("precision.fp8=true", "precision.fp8_layers=['hstu/1/', 'cross/']"), rngs=nnx.Rngs(0)
    )
    assert _fp8_layers(custom) == ["cross/context", "cross/summary", "hstu/1/out", "hstu/1/uvqk"]
    # The FP8 layers keep their compute dtype for the output; the heads stay float32.
    assert model.tower.layers[0].uvqk.compute_dtype == jnp.bfloat16
    assert model.heads[0].out.compute_dtype == jnp.float32


def test_sensitive_layers_and_bad_fp8_options_are_config_errors():
    with pytest.raises(ConfigError, match="fp8_gemms"):
        small_config("precision.fp8=auto", "precision.fp8_gemms=backward")
    with pytest.raises(ConfigError, match="sensitive layer 'head/click/hidden'"):
        GEMModel(small_config("precision.fp8=true", "precision.fp8_layers=['head/']"), rngs=nnx.Rngs(0))
    for override, key in (
        ("precision.fp8_recipe=late", "precision.fp8_recipe"),
        ("precision.fp8_amax_history=0", "precision.fp8_amax_history"),
        ("precision.fp8_margin=-1", "precision.fp8_margin"),
        ("precision.fp8_layers=['']", "precision.fp8_layers"),
        ("precision.fp8_gemms=forward", "precision.fp8_gemms"),
    ):
        with pytest.raises(ConfigError, match=re.escape(key)):
            small_config(override)


# ----------------------------------------------------------------------------- the GEMM pattern


def fp8_gemms(lowered) -> tuple[list[tuple[str, str]], int]:
    """The (lhs, rhs) FP8 formats of every dot of a lowered program in the form XLA compiles to a cuBLASLt
    FP8 GEMM (`experiments.fp8_gemms`: the dot of the FP8 arrays, its result scaled after), and the number
    of dots in all."""
    dots, total = fp8_dots(lowered)
    return [(d.lhs.format, d.rhs.format) for d in dots if d.has_pattern], total


_ONE_LAYER = sorted([("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")])  # Y, dX, dW


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_fp8_gemm_has_the_cublaslt_fp8_pattern(recipe):
    policy = PrecisionPolicy.from_config(PrecisionConfig(fp8=True, fp8_layers=("t/",), fp8_recipe=recipe))
    graphdef, params, histories, probes = _split(Dense("t/0", 64, 32, policy, rngs=nnx.Rngs(0)))

    def loss(params, probes, x):
        return jnp.sum(nnx.merge(graphdef, params, histories, probes)(x).astype(jnp.float32))

    x = jnp.ones((4, 16, 64), jnp.bfloat16)
    found, dots = fp8_gemms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(params, probes, x))
    assert sorted(found) == _ONE_LAYER and dots == 3, (found, dots)
    # And the checker can fail: the bf16 dequantisation XLA does not rewrite is not counted.
    bf16 = jax.jit(lambda a, b: jnp.dot(a.astype(jnp.bfloat16) * 2, b.astype(jnp.bfloat16) * 2))
    a8 = jnp.ones((16, 16), fp8.E4M3)
    assert fp8_gemms(bf16.lower(a8, a8)) == ([], 1)


@pytest.mark.slow
@pytest.mark.parametrize("gemms", ["all", "backward"])
def test_gem_model_gemms_with_fp8_on(gemms):
    """Forward + backward of the whole model: three FP8 GEMMs per FP8 layer, in the pattern (with
    `precision.fp8_gemms = "backward"` two, dX and dW: the forward is a plain GEMM); and the model runs
    (finite logits, gradients and amaxes)."""
    config = small_config("precision.fp8=true", f"precision.fp8_gemms={gemms}")
    model = GEMModel(config, rngs=nnx.Rngs(0))
    graphdef, params, histories, probes = _split(model)
    pack = first_pack(next(stacks(config, 1)))

    embedded = dense_embeddings(config, pack)

    def loss(params, probes, pack):
        return nnx.merge(graphdef, params, histories, probes)(pack, embedded).sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    found, _ = fp8_gemms(step.lower(params, probes, pack))
    per_layer = [f for f in _ONE_LAYER if gemms == "all" or f != ("f8E4M3FN", "f8E4M3FN")]
    assert sorted(found) == sorted(per_layer * len(_fp8_layers(model)))
    value, (grads, amaxes) = step(params, probes, pack)
    assert np.isfinite(float(value))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert all((np.asarray(a) > 0).all() for a in jax.tree.leaves(amaxes))
    new = fp8.update_meta(histories, amaxes)  # nnx.List indices as keys, nested layers
    leaves = jax.tree.leaves(new)  # per layer: amax_history and the three scales
    assert len(leaves) == 4 * len(_fp8_layers(model))
    assert all((np.asarray(h)[:, 0] > 0).all() if h.ndim == 2 else np.asarray(h) > 0 for h in leaves)


# ----------------------------------------------------------------------------- the global-max rule


@pytest.mark.slow
def test_amax_history_gets_the_global_max_over_packs_and_shards():
    """The trainer's step shape: a loss vmapped over 2 packs per device, shard_mapped over 8 devices,
    gradients psum'ed. With per-pack probes reduced by max, every history gets the exact amax over
    the global batch (a sum over packs and shards would be 16x too large here)."""
    devices, packs_per_device = 8, 2
    packs = devices * packs_per_device
    policy = PrecisionPolicy.from_config(
        PrecisionConfig(compute_dtype="float32", fp8=True, fp8_layers=("a/", "b/"), fp8_amax_history=3)
    )

    class Two(nnx.Module):
        def __init__(self):
            self.a = Dense("a/0", 16, 32, policy, rngs=nnx.Rngs(0))
            self.b = Dense("b/0", 32, 8, policy, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(jax.nn.silu(self.a(x)))

    graphdef, params, histories, probes = _split(Two())
    ones = {layer: {"fp8": {"amax_probe": jnp.ones(3)}} for layer in ("a", "b")}
    histories = fp8.update_meta(histories, ones)  # a previous step's amaxes, and its scales
    key = jax.random.key(0)
    mags = jnp.exp(jax.random.normal(key, (packs, 1, 1)))  # every pack its own magnitude
    xs = mags * jax.random.normal(jax.random.fold_in(key, 1), (packs, 24, 16))
    cs = mags[::-1] * jax.random.normal(jax.random.fold_in(key, 2), (packs, 24, 8))
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def pack_loss(params, probes, histories, x, c):
        return jnp.sum(nnx.merge(graphdef, params, histories, probes)(x) * c)

    def loss(params, pack_probes, histories, xs, cs):
        def local(params, pack_probes, histories, xs, cs):
            per_pack = jax.vmap(pack_loss, in_axes=(None, 0, None, 0, 0))
            return jax.lax.psum(per_pack(params, pack_probes, histories, xs, cs).sum(), "data")

        spec = P("data")
        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), spec, P(), spec, spec), out_specs=P(), check_vma=False
        )(params, pack_probes, histories, xs, cs)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    args = (params, fp8.pack_probes(probes, packs), histories, xs, cs)
    # Under vmap the delayed scales stay rank-0 (histories are not vmapped): still the FP8 pattern.
    # Five GEMMs, not six: nothing asks for the gradient of the input of layer a.
    found, dots = fp8_gemms(step.lower(*args))
    expected = sorted(_ONE_LAYER * 2)
    expected.remove(("f8E5M2", "f8E4M3FN"))  # layer a's dX
    assert sorted(found) == expected and dots == 5, found
    _, (_, probe_grads) = step(*args)
    assert probe_grads["a"]["fp8"]["amax_probe"].shape == (packs, 3)
    amaxes = fp8.combine_meta_grads(probe_grads)
    new = fp8.update_meta(histories, amaxes)

    # Reference 1: one pack at a time, no vmap, no shard_map; the max over those runs.
    single = jax.jit(jax.grad(pack_loss, argnums=1))
    per_pack = [single(params, probes, histories, xs[i], cs[i]) for i in range(packs)]
    expected = jax.tree.map(lambda *g: jnp.max(jnp.stack(g), axis=0), *per_pack)
    # Reference 2, independent of the FP8 code: what the amaxes must be where we know the tensors.
    a, b = expected["a"]["fp8"]["amax_probe"], expected["b"]["fp8"]["amax_probe"]
    np.testing.assert_allclose(a[:2], [jnp.abs(xs).max(), jnp.abs(params["a"]["kernel"]).max()], rtol=1e-7)
    np.testing.assert_allclose(b[1:], [jnp.abs(params["b"]["kernel"]).max(), jnp.abs(cs).max()], rtol=1e-7)
    for layer in ("a", "b"):
        got = new[layer]["fp8"]["amax_history"]
        np.testing.assert_array_equal(got[:, 0], expected[layer]["fp8"]["amax_probe"])
        np.testing.assert_array_equal(got[:, 1:], histories[layer]["fp8"]["amax_history"][:, :-1])
        summed = probe_grads[layer]["fp8"]["amax_probe"].sum(0)
        assert (summed > 1.5 * got[:, 0]).all()  # the sum rule would be wrong


# ----------------------------------------------------------------------------- the benchmark


@pytest.mark.slow
def test_bench_fp8_small_runs_its_checks_and_writes_the_auto_table(capsys, tmp_path):
    from experiments.benchmarks.fp8 import main
    from gem_jax.model import fp8_auto

    table = tmp_path / "speedups.json"
    assert main(["--small", "--widths", "16", "--write-table", str(table)]) == 0
    out = capsys.readouterr().out
    # The largest GEMM of configs/tiny.toml: the HSTU input projection, model_dim wide.
    config = load_config(ROOT / "configs" / "tiny.toml")
    dim, m = config.model.model_dim, config.data.tokens_per_shard
    assert re.search(rf"\| tiny: hstu/0/uvqk[^|]* \| {m} x {dim} x \d+ \| delayed \|", out), out
    assert f"| width 16 | {m} x 16 x 64 | current |" in out
    assert "| square | 128 x 128 x 128 | current |" in out
    assert "CHECK FAILED" not in out
    # The first recipe's rows (delayed), one per shape, under this device's kind, for "auto" to read.
    rows = fp8_auto.load_table(table)[jax.devices()[0].device_kind]
    shapes = {(r["m"], r["k"], r["n"]) for r in rows}
    assert len(shapes) == len(rows) == 4 and {(m, 16, 16), (m, 16, 64), (128, 128, 128)} < shapes
    assert all(r["recipe"] == "delayed" and r["fp8_s"] > 0 and r["bf16_s"] > 0 for r in rows)
