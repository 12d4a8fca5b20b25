"""The public BlockAttention entry point: validation, the backend (`kernel_for`), tiles and kernel parameters.

Names as every kernel op (pallas_kernels/implementations.py): "triton" (gpu.py, every GPU, Hopper included),
"tpu" (tpu.py), "reference"; implementation=None takes DEFAULTS[platform]. Backends follow the kernel-package
contract (docs/architecture.md); implementations.run_kernel binds their forward and backward into the custom VJP.
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
NAMES = ("triton", "tpu", "reference")
DEFAULTS = {"hopper": ("triton",), "gpu": ("triton",), "tpu": ("tpu",), "cpu": ("reference",)}
_MODULES = {"triton": "gpu", "tpu": "tpu"}  # each kernel's backend module


def _why_not(name: str, block_size: int) -> str | None:
    """None if backend `name` takes blocks of block_size tokens, else why not (the kernels' tile limit)."""
    if name == "reference":
        return None
    try:
        BlockSizes.get_default(implementations.tile_platform(name, False), block_size=block_size)
    except ValueError as e:
        return str(e)
    return None


def kernel_for(
    block_size: int, implementation: str | None, *, interpret: bool = False, platform: str | None = None
) -> str:
    """The backend ("triton", "tpu", "reference") that runs a block_attention call: the one decision.
    `implementation` if it takes the call (else a ValueError), for None the first of DEFAULTS[platform] that
    does (platform None: this process's): on an H100 Triton."""
    return implementations.choose(
        "block_attention",
        implementation,
        names=NAMES,
        defaults=DEFAULTS,
        why_not=lambda name: _why_not(name, block_size),
        interpret=interpret,
        platform=platform,
    )


def kernels_in_use(
    block_size: int, implementation: str | None, *, interpret: bool = False, platform: str | None = None
) -> str:
    """The backend kernel_for picks, as train prints it (" (interpret)" where interpreted)."""
    name = kernel_for(block_size, implementation, interpret=interpret, platform=platform)
    return implementations.describe(name, interpret)


@functools.partial(jax.jit, static_argnames=("block_size", "causal", "alpha", "implementation", "interpret"))
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
    interpret: bool = False,
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
      implementation: None (DEFAULTS for the platform), "triton", "tpu" or "reference" (kernel_for).
      interpret: the kernel runs in Pallas's interpreter (CPU tests).

    Returns:
      [T, H, Dv] in v.dtype; rows past offsets[B] are zero.
    """
    check_jagged_qkv(q, k, v, offsets)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a Python float or None, got {alpha!r}")
    kernel = kernel_for(block_size, implementation, interpret=interpret)
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
        interpret=interpret,
        blocks=BlockSizes.get_default(
            implementations.tile_platform(kernel, interpret), block_size=block_size
        ),
    )
    module = f"{_PACKAGE}.{_MODULES[kernel]}"
    return implementations.run_kernel(module, params, q, k, v, offsets)
