"""The model's one attention entry point: every jagged attention in gem_jax goes through here.

A layer builds one `AttentionSpec` from the model config (the static settings of its attention calls) and
passes it down; `attention` forwards it to `pallas_kernels.jagged_attention` (docs/design.md, Kernels).
Dropout on the attention weights (`weight_dropout` with an rng, training only) exists only in the padded jnp
reference, which then runs whatever the implementation: O(B N^2) memory, fine for the short sequences of
next-item training.
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import ArrayLike, Float, Int

from gem_jax.config import ModelConfig
from gem_jax.kernels import attention_options
from pallas_kernels.jagged_attention import jagged_attention
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.reference import jagged_attention_reference


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static settings of a layer's attention calls (hashable), built once from the model config.

    implementation, interpret: the jagged attention kernels (config `model.attention_implementation`: a
      pallas_kernels name, or None for the op's default order) and whether in Pallas's interpreter.
    block_implementation, block_interpret: the same for the long-history tower's BlockAttention
      (`model.block_attention_implementation`).
    weight_dropout: dropout on the attention weights, applied when a call gets an rng.
    kernel_options: the GPU kernels' variants; the bias_rows array's cap comes from
      `model.attention_bias_rows_gib`, which trades H * T * max_seq_len elements of memory per call for a
      ~2x faster backward with a relative bias (0: the kernels compute the bias).
    """

    activation: str = "silu"
    implementation: str | None = None
    interpret: bool = False
    block_implementation: str | None = None
    block_interpret: bool = False
    max_attn_len: int = 0
    weight_dropout: float = 0.0
    kernel_options: KernelOptions = KernelOptions()

    @classmethod
    def from_config(cls, config: ModelConfig, *, activation: str | None = None) -> AttentionSpec:
        """The spec of `config`'s attention; `activation` overrides model.activation (SASRec: softmax)."""
        implementation, interpret = config.kernel("attention")
        block_implementation, block_interpret = config.kernel("block_attention")
        return cls(
            activation=activation or config.activation,
            implementation=implementation,
            interpret=interpret,
            block_implementation=block_implementation,
            block_interpret=block_interpret,
            max_attn_len=config.max_attn_len,
            weight_dropout=config.attention_dropout,
            kernel_options=attention_options(config),
        )


def attention(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    *,
    spec: AttentionSpec,
    max_seq_len: int,
    num_targets: Int[ArrayLike, " B"] | None = None,
    timestamps: Int[ArrayLike, " T"] | None = None,
    pos_bias: Float[ArrayLike, "H P"] | None = None,
    time_bias: Float[ArrayLike, "H NT"] | None = None,
    rng: jax.Array | None = None,
) -> Float[ArrayLike, "T H Dv"]:
    """Jagged attention of one layer (pallas_kernels.jagged_attention's arguments; the static ones in `spec`).

    max_seq_len is the pack's static length bound, so it is an argument of the call, not of the spec.
    """
    common = dict(
        max_seq_len=max_seq_len,
        activation=spec.activation,
        num_targets=num_targets,
        max_attn_len=spec.max_attn_len,
        timestamps=timestamps,
        pos_bias=pos_bias,
        time_bias=time_bias,
    )
    if spec.weight_dropout > 0 and rng is not None:
        return jagged_attention_reference(
            q, k, v, offsets, **common, weight_dropout=spec.weight_dropout, dropout_rng=rng
        )
    return jagged_attention(
        q,
        k,
        v,
        offsets,
        **common,
        implementation=spec.implementation,
        interpret=spec.interpret,
        options=spec.kernel_options,
    )
