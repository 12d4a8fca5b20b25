"""model.uvqk_implementation: the HSTU layer's input norm + uvqk GEMM + SiLU + split through
pallas_kernels.norm_gemm. Who decides (hstu.uvqk_fusion), what train says at start-up, the config's refusals,
and the model's logits and gradients through the fused path against the unfused one."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.config import ConfigError
from gem_jax.kernels import in_use, kernel_lines
from gem_jax.model.hstu import uvqk_fusion
from tests.helpers import model_logits_and_grads, on_platform, small_config

WIDE = ("model.model_dim=128", "model.attention_dim=32", "model.value_dim=32")  # K 128, widths 64: tiles fit


INTERPRET = "model.interpret_kernels=true"


@pytest.mark.parametrize(
    "settings,dtype,fp8,want",
    [
        (("off",), jnp.bfloat16, False, None),
        (("auto",), jnp.bfloat16, False, None),  # CPU: no Hopper kernel, so the unfused path
        (("reference",), jnp.bfloat16, False, ("reference", False)),
        (("mosaic", INTERPRET), jnp.bfloat16, False, ("mosaic", True)),
        (("mosaic", INTERPRET), jnp.bfloat16, True, None),  # an FP8 uvqk GEMM stays unfused
    ],
)
def test_who_runs_the_uvqk_projection(settings, dtype, fp8, want):
    name, *rest = settings
    m = small_config(*WIDE, f"model.uvqk_implementation={name}", *rest).model
    assert uvqk_fusion(m, 256, jnp.float32, dtype, fp8=fp8) == want


def test_auto_takes_the_kernel_on_hopper_where_it_fits_else_the_unfused_path():
    """On Hopper "auto" takes the Mosaic GPU kernel for 256 rows (its tiles: K 256, widths 128); 100 rows (no
    multiple of the kernel's 2 x 64) or a float32 GEMM (the kernel's is 16-bit) run the unfused path."""
    wider = ("model.model_dim=256", "model.attention_dim=64", "model.value_dim=64")
    m = small_config(*wider, "model.uvqk_implementation=auto").model
    with on_platform("hopper"):
        assert uvqk_fusion(m, 256, jnp.float32, jnp.bfloat16, fp8=False) == ("mosaic", False)
        assert uvqk_fusion(m, 100, jnp.float32, jnp.bfloat16, fp8=False) is None
        assert uvqk_fusion(m, 256, jnp.float32, jnp.float32, fp8=False) is None


def test_the_config_refuses_a_named_kernel_that_cannot_run_the_pack():
    """The Mosaic kernel by name on a float32 GEMM, or on a pack its tiles do not divide, is refused when the
    config loads, naming the key and why."""
    with pytest.raises(ConfigError, match=r"`model.uvqk_implementation = 'mosaic'`: .*16-bit w"):
        small_config(*WIDE, "model.uvqk_implementation=mosaic", INTERPRET, "precision.compute_dtype=float32")
    with pytest.raises(ConfigError, match=r"`model.uvqk_implementation = 'mosaic'`: .*M=200"):
        small_config(*WIDE, "model.uvqk_implementation=mosaic", INTERPRET, "data.tokens_per_shard=200")


def test_start_up_line_names_the_choice():
    lines = kernel_lines(small_config())
    assert "  uvqk norm+gemm: unused (model.uvqk_implementation = 'off'" in "\n".join(lines)
    line = in_use(
        small_config(*WIDE, "model.uvqk_implementation=mosaic", INTERPRET, "precision.fp8=true"), "uvqk"
    )
    assert "norm_gemm forward mosaic (interpret), backward mosaic (interpret)" in line and "FP8" in line


def test_the_config_refuses_a_fused_uvqk_without_hstu_layers():
    with pytest.raises(ConfigError, match="uvqk_implementation"):
        small_config("model.uvqk_implementation=reference", 'model.layer="sasrec"')


def _logits_and_grads(*overrides):
    _, logits, grads = model_logits_and_grads(small_config(*overrides))
    return logits, nnx.to_flat_state(grads)


def _value(v):
    return np.asarray(v.get_value() if hasattr(v, "get_value") else v[...], np.float32)


@pytest.mark.slow  # ~30 s each: the model's forward and backward op by op, twice
@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_the_fused_path_is_the_same_function(dtype, rtol):
    """The model through norm_gemm's reference (the fused path's spec) against the unfused layers: the
    logits and every parameter's gradient (float32: to rounding; bf16: the fused path adds the bias before
    its one rounding, the unfused GEMM rounds first)."""
    common = (*WIDE, f"precision.compute_dtype={dtype}")
    ref_logits, ref_grads = _logits_and_grads(*common)
    logits, grads = _logits_and_grads(*common, "model.uvqk_implementation=reference")
    scale = float(np.abs(np.asarray(ref_logits)).max())
    np.testing.assert_allclose(logits, ref_logits, rtol=rtol, atol=rtol * scale)
    checked = 0
    for (path, a), (_, b) in zip(ref_grads, grads):
        a, b = _value(a), _value(b)
        if dtype == "float32":
            np.testing.assert_allclose(
                b, a, rtol=1e-3, atol=1e-5 * max(1.0, np.abs(a).max()), err_msg=str(path)
            )
        else:  # bf16: relative L2 per array
            err = np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-12)
            assert err < rtol, (path, err)
        checked += "uvqk" in str(path) or "input_norm" in str(path)
    assert checked >= 8  # both layers' uvqk kernel and bias, input-norm scale and bias


@pytest.mark.slow
def test_the_kernels_in_the_layer_are_as_accurate_as_the_fused_paths_spec():
    """model.uvqk_implementation = "mosaic", interpreted: both norm_gemm kernels (forward, and the backward's dz / dxn /
    db) in the Mosaic GPU interpreter inside every HSTU layer (256 tokens: several output tiles, two K steps).
    In bf16 every path sits ~2% from the float32 model (the kernel rounds z once, after the bias, and takes SiLU
    in float32; the spec rounds twice): the kernels' logits and gradients must be as close to float32's as the
    spec's, within 25%."""
    truth_logits, truth_grads = _logits_and_grads(*WIDE, "precision.compute_dtype=float32")
    errors = {}
    for setting in ("reference", "mosaic"):
        logits, grads = _logits_and_grads(
            *WIDE, "precision.compute_dtype=bfloat16", f"model.uvqk_implementation={setting}", INTERPRET
        )
        diff = sum(float(np.sum((_value(b) - _value(a)) ** 2)) for (_, a), (_, b) in zip(truth_grads, grads))
        norm = sum(float(np.sum(_value(a) ** 2)) for _, a in truth_grads)
        errors[setting] = (
            float(
                np.linalg.norm(np.asarray(logits) - np.asarray(truth_logits)) / np.linalg.norm(truth_logits)
            ),
            (diff / norm) ** 0.5,
        )
    (ref_logits, ref_grads), (logits, grads) = errors["reference"], errors["mosaic"]
    assert 0 < ref_logits < 0.05 and 0 < ref_grads < 0.1, errors  # bf16's distance from float32
    assert logits <= 1.25 * ref_logits and grads <= 1.25 * ref_grads, errors
