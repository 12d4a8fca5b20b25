"""The public BlockAttention entry point: validation, backend dispatch, custom VJP."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.block_attention import block_sizes, reference

# Kernel backends: name -> (module, interpret argument). Modules are imported when a
# backend is first used, so a broken Triton/Mosaic install fails loudly there and
# nowhere else (the reference never needs them).
_KERNELS: dict[str, tuple[str, object]] = {
    "gpu": ("gpu", False),
    "gpu_interpret": ("gpu", True),
    "tpu": ("tpu", False),
    "tpu_interpret": ("tpu", "tpu_interpret"),
}


def _backend(kernel: str):
    module, interpret = _KERNELS[kernel]
    return importlib.import_module(f"pallas_kernels.block_attention.{module}"), interpret


@functools.partial(jax.custom_vjp, nondiff_argnames=("block_size", "causal", "alpha", "kernel"))
def _kernel_attention(q, k, v, offsets, block_size, causal, alpha, kernel):
    backend, interpret = _backend(kernel)
    return backend.forward(
        q, k, v, offsets, block_size=block_size, causal=causal, alpha=alpha, interpret=interpret
    )


def _kernel_attention_fwd(q, k, v, offsets, block_size, causal, alpha, kernel):
    out = _kernel_attention(q, k, v, offsets, block_size, causal, alpha, kernel)
    return out, (q, k, v, offsets)


def _kernel_attention_bwd(block_size, causal, alpha, kernel, residuals, do):
    q, k, v, offsets = residuals
    backend, interpret = _backend(kernel)
    dq, dk, dv = backend.backward(
        q, k, v, offsets, do, block_size=block_size, causal=causal, alpha=alpha, interpret=interpret
    )
    return dq, dk, dv, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def _platform_kernel(suffix: str = "") -> Callable[..., jax.Array]:
    """The kernel for the default backend's platform, as an implementation."""

    def run(q, k, v, offsets, *, block_size, causal, alpha):
        platform = jax.default_backend()
        if platform in ("gpu", "cuda", "rocm"):
            kernel = "gpu"
        elif platform == "tpu":
            kernel = "tpu"
        elif suffix:
            kernel = "gpu"  # interpret mode runs anywhere; the GPU kernel is fastest there
        else:
            raise ValueError(
                f"implementation='pallas' needs a GPU or TPU, the default backend is "
                f"{platform!r}; use 'interpret' or 'reference'"
            )
        return _kernel_attention(q, k, v, offsets, block_size, causal, alpha, kernel + suffix)

    return run


def _fixed_kernel(kernel: str) -> Callable[..., jax.Array]:
    def run(q, k, v, offsets, *, block_size, causal, alpha):
        return _kernel_attention(q, k, v, offsets, block_size, causal, alpha, kernel)

    return run


# name -> fn(q, k, v, offsets, *, block_size, causal, alpha) -> out.
_IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {
    "reference": reference.block_attention_reference,
    "pallas": _platform_kernel(),
    "interpret": _platform_kernel("_interpret"),
    # Explicit backends (tests and benchmarks; "interpret" on CPU is "gpu_interpret").
    "gpu_interpret": _fixed_kernel("gpu_interpret"),
    "tpu_interpret": _fixed_kernel("tpu_interpret"),
}


def _default_implementation() -> str:
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "reference"


@functools.partial(jax.jit, static_argnames=("block_size", "causal", "alpha", "implementation"))
def block_attention(
    q: Float[Array, "T H Dqk"],
    k: Float[Array, "T H Dqk"],
    v: Float[Array, "T H Dv"],
    offsets: Int[Array, " B1"],
    *,
    block_size: int = 64,
    causal: bool = False,
    alpha: float | None = None,
    implementation: str | None = None,
) -> Float[Array, "T H Dv"]:
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
        kernel in Pallas interpret mode; the GPU kernel on CPU), or explicitly
        "gpu_interpret" / "tpu_interpret".

    Returns:
      [T, H, Dv] in v.dtype; rows past offsets[B] are zero.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, Dqk], got shape {q.shape}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    if v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [T, H, Dv] with [T, H] = {q.shape[:2]}, got {v.shape}")
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be int32[B+1] with B >= 0, got shape {offsets.shape}")
    if not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(f"offsets must be an integer array, got dtype {offsets.dtype}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a Python float or None, got {alpha!r}")
    if implementation is None:
        implementation = _default_implementation()
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {sorted(_IMPLEMENTATIONS)} or None, got {implementation!r}"
        )
    if alpha is None:
        alpha = 1.0 / float(q.shape[-1]) ** 0.5
    if implementation != "reference":
        block_sizes.BlockSizes.get_default(block_size)  # raises for unsupported sizes
    return _IMPLEMENTATIONS[implementation](
        q,
        k,
        v,
        offsets.astype(jnp.int32),
        block_size=block_size,
        causal=causal,
        alpha=float(alpha),
    )
