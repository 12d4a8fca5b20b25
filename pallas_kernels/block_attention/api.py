"""The public BlockAttention entry point: validation, tiles and kernel parameters, backend dispatch.

Backends (gpu.py, tpu.py) follow the kernel-package contract (docs/architecture.md); implementations.run_kernel
binds their forward and backward into the custom VJP. Implementation names: pallas_kernels/implementations.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels import implementations
from pallas_kernels.block_attention import reference
from pallas_kernels.block_attention.block_sizes import BlockSizes
from pallas_kernels.block_attention.params import KernelParams
from pallas_kernels.checks import check_jagged_qkv

_PACKAGE = "pallas_kernels.block_attention"


@functools.partial(jax.jit, static_argnames=("block_size", "causal", "alpha", "implementation"))
def block_attention(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    *,
    block_size: int = 64,
    causal: bool = False,
    alpha: float | None = None,
    implementation: str | None = None,
) -> Float[ArrayLike, "T H Dv"]:
    """Softmax attention inside consecutive blocks of each jagged sequence.

    Each sequence (tokens offsets[b]:offsets[b+1] of the flat arrays) is cut into
    blocks of ``block_size`` tokens from its own start; a token attends to the tokens
    of its own block only (earlier-or-equal ones if ``causal``), so cost is linear in T.

    Args:
      q: queries, [T, H, Dqk].
      k: keys, [T, H, Dqk].
      v: values, [T, H, Dv].
      offsets: int32[B+1], non-decreasing, offsets[0] = 0, offsets[B] <= T.
      block_size: tokens per block (default 64).
      causal: restrict each token to earlier-or-equal tokens of its block.
      alpha: score scale, default 1/sqrt(Dqk).
      implementation: None (the Pallas kernel on GPU/TPU, else "reference"),
        "reference", "pallas" (the GPU or TPU kernel), "interpret" (the platform's
        kernel in Pallas interpret mode; the GPU kernel on CPU), or a backend
        ("gpu", "gpu_interpret", "tpu", "tpu_interpret"); see pallas_kernels/implementations.py.

    Returns:
      [T, H, Dv] in v.dtype; rows past offsets[B] are zero.
    """
    check_jagged_qkv(q, k, v, offsets)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a Python float or None, got {alpha!r}")
    kernel = implementations.resolve(implementation)
    if alpha is None:
        alpha = 1.0 / float(q.shape[-1]) ** 0.5
    offsets = offsets.astype(jnp.int32)
    if kernel == "reference":
        return reference.block_attention_reference(
            q, k, v, offsets, block_size=block_size, causal=causal, alpha=float(alpha)
        )
    params = KernelParams(
        block_size=block_size,
        causal=causal,
        alpha=float(alpha),
        interpret=implementations.interpret(kernel),
        blocks=BlockSizes.get_default(implementations.tile_platform(kernel), block_size=block_size),
    )
    module = f"{_PACKAGE}.{kernel.removesuffix('_interpret')}"
    return implementations.run_kernel(module, params, q, k, v, offsets)
