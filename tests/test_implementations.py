"""The one way to name a kernel backend (pallas_kernels/implementations.py): every op's names, its ordered default
on each platform for the calls the shipped configs make, what a named backend that cannot take a call says, and
that the old aliases are gone. CPU only: each op's decision is asked for a platform, not run there."""

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import implementations
from pallas_kernels.block_attention import api as block_attention
from pallas_kernels.jagged_attention import api as jagged_attention
from pallas_kernels.layer_norm import api as layer_norm
from pallas_kernels.norm_gemm import api as norm_gemm
from pallas_kernels.silu_backward_fp8 import api as silu_backward_fp8

sd = jax.ShapeDtypeStruct
OPS = (jagged_attention, block_attention, layer_norm, silu_backward_fp8, norm_gemm)
OLD_NAMES = ("gpu", "pallas", "interpret", "gpu_interpret", "tpu_interpret", "mosaic_interpret")


def test_every_op_takes_the_shared_names_and_orders_its_default_for_every_platform():
    for op in OPS:
        assert set(op.NAMES) <= set(implementations.NAMES) and "reference" in op.NAMES, op.__name__
        assert set(op.DEFAULTS) == set(implementations.PLATFORMS), op.__name__
        for platform, order in op.DEFAULTS.items():
            assert order and set(order) <= set(op.NAMES), (op.__name__, platform)


def _attention(platform, d=128, dtype=jnp.bfloat16, **kw):
    q = sd((196_608, 4, d), dtype)  # gem_h200's pack
    return jagged_attention.kernels_in_use(q, q, max_seq_len=2056, has_targets=True, platform=platform, **kw)


def test_jagged_attention_default_order():
    """Mosaic GPU on Hopper for each direction it takes (bf16; the bias by default, gem_h200's tables), Triton
    on other GPUs and for what Mosaic does not take (float32, head dim 32, the backward's histograms of a
    1024-bucket table), the TPU kernel on TPU, the reference on CPU."""
    bias = dict(num_pos=128, num_time=64)
    assert _attention("hopper", **bias) == ("mosaic", "mosaic")
    assert _attention("hopper", num_pos=1024, num_time=64) == ("mosaic", "triton")
    assert _attention("hopper", d=256) == ("mosaic", "mosaic")
    assert _attention("hopper", d=256, **bias) == ("mosaic", "triton")  # the backward's D = 256 has no bias
    assert _attention("hopper", dtype=jnp.float32) == ("triton", "triton")
    assert _attention("hopper", d=32) == ("triton", "triton")
    assert _attention("gpu", **bias) == ("triton", "triton")
    assert _attention("tpu", **bias) == ("tpu", "tpu")
    assert _attention("cpu", **bias) == ("reference", "reference")
    assert _attention(None) == ("reference", "reference")  # this process: CPU
    assert _attention(None, interpret=True) == ("triton (interpret)", "triton (interpret)")


def test_block_attention_default_order():
    for platform, name in (("hopper", "triton"), ("gpu", "triton"), ("tpu", "tpu"), ("cpu", "reference")):
        assert block_attention.kernel_for(64, None, platform=platform) == name, platform
    with pytest.raises(ValueError, match=r"no backend of the hopper default order \('triton',\).*<= 128"):
        block_attention.kernel_for(256, None, platform="hopper")
    assert block_attention.kernel_for(256, None, platform="cpu") == "reference"


def test_layer_norm_default_order():
    """Triton on every GPU, Hopper included, where it takes the width, else the reference."""
    for platform in ("hopper", "gpu"):
        assert layer_norm.kernel_for(None, 512, platform=platform) == "triton"
        assert layer_norm.kernel_for(None, 96, platform=platform) == "reference"
    for platform in ("tpu", "cpu"):
        assert layer_norm.kernel_for(None, 512, platform=platform) == "reference"


def test_silu_backward_fp8_default_order():
    """Triton on every GPU, Hopper included, where its tiles fit (gem_h200's uvqk), else the reference."""
    for platform in ("hopper", "gpu"):
        assert silu_backward_fp8.kernel_for(196_608, (512,) * 4, None, platform=platform)[0] == "triton"
        assert silu_backward_fp8.kernel_for(196_608, (512, 256), None, platform=platform)[0] == "reference"
    for platform in ("tpu", "cpu"):
        assert silu_backward_fp8.kernel_for(196_608, (512,) * 4, None, platform=platform)[0] == "reference"


def test_norm_gemm_default_order():
    """The Mosaic GPU kernels on Hopper for each direction whose tiles fit (gem_h200's uvqk: both), the
    reference elsewhere."""
    x, w = sd((196_608, 512), jnp.float32), sd((512, 2048), jnp.bfloat16)
    assert norm_gemm.kernels_for(x, w, (512,) * 4, None, platform="hopper") == ("mosaic", "mosaic")
    for platform in ("gpu", "tpu", "cpu"):
        assert norm_gemm.kernels_for(x, w, (512,) * 4, None, platform=platform) == ("reference", "reference")


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__.split(".")[1])
def test_the_old_aliases_are_refused_naming_the_names(op):
    calls = {
        jagged_attention: lambda name: _attention(None, implementation=name),
        block_attention: lambda name: block_attention.kernel_for(64, name),
        layer_norm: lambda name: layer_norm.kernel_for(name, 512),
        silu_backward_fp8: lambda name: silu_backward_fp8.kernel_for(256, (64,), name),
        norm_gemm: lambda name: norm_gemm.kernels_for(
            sd((256, 128), jnp.float32), sd((128, 64), jnp.bfloat16), (64,), name
        ),
    }
    for name in OLD_NAMES:
        with pytest.raises(ValueError, match=re.escape(f"implementation must be None or one of {op.NAMES}")):
            calls[op](name)


def test_a_named_backend_that_cannot_take_a_call_says_why_and_what_takes_it():
    with pytest.raises(ValueError) as e:
        _attention(None, d=32, implementation="mosaic")
    message = str(e.value)
    assert message.startswith("jagged_attention: implementation='mosaic' does not take this call: ")
    assert "Mosaic GPU forward" in message and "use implementation=None" in message and "'triton'" in message
    with pytest.raises(ValueError, match="Mosaic GPU backward.*one that takes it: \\['triton'\\]"):
        _attention(None, d=256, implementation="mosaic", num_pos=64)
    with pytest.raises(
        ValueError, match="layer_norm: implementation='triton' does not take this call: rows of width 96"
    ):
        layer_norm.kernel_for("triton", 96)


def test_choose_tries_the_order_and_names_every_refusal():
    why = {"a": "too wide", "b": None, "c": "too narrow"}
    choose = lambda implementation, platform: implementations.choose(  # noqa: E731
        "op", implementation, names=("a", "b", "c"), defaults={"x": ("a", "b"), "y": ("a", "c")},
        why_not=why.get, platform=platform,
    )  # fmt: skip
    assert choose(None, "x") == "b"
    with pytest.raises(
        ValueError, match=r"no backend of the y default order \('a', 'c'\).*a: too wide; c: too narrow"
    ):
        choose(None, "y")
    assert choose("b", "y") == "b"  # a name needs no platform
    with pytest.raises(
        ValueError, match=r"implementation='c' does not take this call: too narrow; .* \['b'\]"
    ):
        choose("c", None)


def test_this_platform_on_cpu():
    assert implementations.this_platform() == "cpu" and not implementations.is_hopper()
    assert implementations.this_platform(interpret=True) == "gpu"  # the interpreter stands in for a GPU
