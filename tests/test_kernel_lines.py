"""gem_jax/kernels.py: the start-up lines say what runs each op, and what it costs where the pack's shape
makes a kernel copy its inputs."""

from gem_jax.kernels import in_use, unused
from tests.helpers import small_config

HOPPER_HEADS = ("model.attention_dim=64", "model.value_dim=64", "model.attention_implementation=auto")


def test_attention_line_says_when_the_pack_is_copied_for_the_mosaic_kernels():
    """Mosaic GPU reads a TMA's array in 8-row groups: a pack of 1001 tokens is padded (q, k and v copied) on
    every call, one of 1000 is not; the line names the token count."""
    odd = in_use(small_config(*HOPPER_HEADS, "data.tokens_per_shard=1001"), "attention", "hopper")
    even = in_use(small_config(*HOPPER_HEADS, "data.tokens_per_shard=1000"), "attention", "hopper")
    assert odd.startswith("forward mosaic, backward mosaic") and "1001 tokens" in odd and "copies" in odd
    assert even == "forward mosaic, backward mosaic"
    # Triton (pre-Hopper GPUs) takes any row count as it is
    assert "copies" not in in_use(
        small_config(*HOPPER_HEADS, "data.tokens_per_shard=1001"), "attention", "gpu"
    )


def test_the_time_variant_mixer_runs_no_attention_and_no_fused_uvqk():
    config = small_config(
        'data.kind="interactions"',
        'data.path="x"',
        'model.sequence_mixer="time_variant"',
        'model.uvqk_implementation="auto"',
    )
    assert unused(config, "attention") == "model.sequence_mixer = 'time_variant'"
    assert "only HSTU attention layers" in unused(config, "uvqk")
    assert unused(small_config(), "attention") is None
