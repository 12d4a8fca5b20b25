"""The model's one attention entry point: every jagged attention in gem_jax goes through here.

It forwards to `pallas_kernels.jagged_attention` (docs/design.md, Kernels); `implementation="auto"`
picks the Pallas kernel on GPU/TPU and the jnp reference on CPU. Dropout on the attention weights
(`weight_dropout` with an rng, training only) exists only in the padded jnp reference, which then runs
whatever the implementation: O(B N^2) memory, fine for the short sequences of next-item training.
`bias_rows_gib` caps the GPU kernels' precomputed relative-bias array (KernelOptions.bias_rows): it trades
H * T * max_seq_len elements of memory per call for a ~2x faster backward with a relative bias.
"""

from __future__ import annotations

import jax
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels.jagged_attention import jagged_attention
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.reference import jagged_attention_reference


def attention(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    *,
    max_seq_len: int,
    activation: str,
    implementation: str,
    num_targets: Int[ArrayLike, " B"] | None = None,
    max_attn_len: int = 0,
    timestamps: Int[ArrayLike, " T"] | None = None,
    pos_bias: Float[ArrayLike, "H P"] | None = None,
    time_bias: Float[ArrayLike, "H NT"] | None = None,
    weight_dropout: float = 0.0,
    rng: jax.Array | None = None,
    bias_rows_gib: float = 8.0,
) -> Float[ArrayLike, "T H Dv"]:
    common = dict(
        max_seq_len=max_seq_len,
        activation=activation,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        timestamps=timestamps,
        pos_bias=pos_bias,
        time_bias=time_bias,
    )
    if weight_dropout > 0 and rng is not None:
        return jagged_attention_reference(
            q, k, v, offsets, **common, weight_dropout=weight_dropout, dropout_rng=rng
        )
    options = KernelOptions(bias_rows=bias_rows_gib > 0, bias_rows_max_bytes=int(bias_rows_gib * 2**30))
    return jagged_attention(
        q,
        k,
        v,
        offsets,
        **common,
        implementation=None if implementation == "auto" else implementation,
        options=options,
    )
