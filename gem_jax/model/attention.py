"""The model's one attention entry point: every jagged attention in gem_jax goes through here.

It forwards to `pallas_kernels.jagged_attention` (DESIGN.md's signature); `implementation="auto"`
picks the Pallas kernel on GPU/TPU and the jnp reference on CPU.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from pallas_kernels.jagged_attention import jagged_attention


def attention(
    q: Float[Array, "T H Dqk"],
    k: Float[Array, "T H Dqk"],
    v: Float[Array, "T H Dv"],
    offsets: Int[Array, " B1"],
    *,
    max_seq_len: int,
    activation: str,
    implementation: str,
    num_targets: Int[Array, " B"] | None = None,
    max_attn_len: int = 0,
    timestamps: Int[Array, " T"] | None = None,
    pos_bias: Float[Array, "H P"] | None = None,
    time_bias: Float[Array, "H NT"] | None = None,
) -> Float[Array, "T H Dv"]:
    return jagged_attention(
        q,
        k,
        v,
        offsets,
        max_seq_len=max_seq_len,
        activation=activation,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        timestamps=timestamps,
        pos_bias=pos_bias,
        time_bias=time_bias,
        implementation=None if implementation == "auto" else implementation,
    )
