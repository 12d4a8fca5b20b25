"""The one public entry point: validates shapes, picks a backend, calls it.

Backends are named in `_IMPLEMENTATIONS` and imported lazily, so a backend that fails to import fails
loudly only when it is asked for (and CPU users never import Triton/Mosaic lowering code).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.jagged_attention.reference import jagged_attention_reference

ACTIVATIONS = ("silu", "softmax")


def _lazy(module: str, name: str, **fixed) -> Callable:
    def call(*args, **kwargs):
        fn = getattr(importlib.import_module(f"pallas_kernels.jagged_attention.{module}"), name)
        return fn(*args, **kwargs, **fixed)

    return call


# implementation name -> callable(q, k, v, offsets, **options). "pallas"/"interpret" resolve per platform.
_IMPLEMENTATIONS: dict[str, Callable] = {
    "reference": jagged_attention_reference,
    "pallas_gpu": _lazy("gpu", "jagged_attention_gpu", interpret=False),
    "interpret_gpu": _lazy("gpu", "jagged_attention_gpu", interpret=True),
    "pallas_tpu": _lazy("tpu", "jagged_attention_tpu", interpret=False),
    "interpret_tpu": _lazy("tpu", "jagged_attention_tpu", interpret=True),
}
_PALLAS_BY_PLATFORM = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "tpu": "pallas_tpu"}
IMPLEMENTATIONS = tuple(_IMPLEMENTATIONS) + ("pallas", "interpret")


def default_implementation(platform: str | None = None) -> str:
    """Best implementation for a platform (default: jax's default backend).

    Pallas GPU kernel on GPU, Mosaic TPU kernel on TPU, the jnp reference elsewhere (CPU). Both kernels
    fuse the relative bias, so the choice does not depend on it.
    """
    platform = platform or jax.default_backend()
    return _PALLAS_BY_PLATFORM.get(platform, "reference")


# backends without the fused relative bias (implementation=None then falls back to the reference); none
# now: the TPU kernel has it too (compare-select loops over a tile's bucket range, tpu.py)
_NO_BIAS: tuple[str, ...] = ()


def _resolve(implementation: str | None, has_bias: bool = False) -> str:
    if implementation is None:
        name = default_implementation()
        return "reference" if has_bias and name in _NO_BIAS else name
    if implementation == "pallas":
        platform = jax.default_backend()
        if platform not in _PALLAS_BY_PLATFORM:
            raise ValueError(
                f"implementation='pallas' needs a GPU or TPU, but the default backend is {platform!r}"
            )
        return _PALLAS_BY_PLATFORM[platform]
    if implementation == "interpret":
        return "interpret_tpu" if jax.default_backend() == "tpu" else "interpret_gpu"
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation


def _check_shapes(
    q, k, v, offsets, num_targets, timestamps, pos_bias, time_bias, max_seq_len, max_attn_len, activation
):
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, Dqk], got shape {q.shape}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    if v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [T, H, Dv] with T, H = {q.shape[:2]}, got {v.shape}")
    if offsets.ndim != 1 or offsets.shape[0] < 1 or not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise ValueError(f"offsets must be int[B+1], got {offsets.dtype}{list(offsets.shape)}")
    b = offsets.shape[0] - 1
    if num_targets is not None and num_targets.shape != (b,):
        raise ValueError(f"num_targets must be int[B] with B={b}, got shape {num_targets.shape}")
    if timestamps is not None and timestamps.shape != (q.shape[0],):
        raise ValueError(f"timestamps must be int[T] with T={q.shape[0]}, got shape {timestamps.shape}")
    if time_bias is not None and timestamps is None:
        raise ValueError("time_bias needs timestamps, got timestamps=None")
    for name, table in (("pos_bias", pos_bias), ("time_bias", time_bias)):
        if table is not None and (table.ndim != 2 or table.shape[0] != q.shape[1]):
            raise ValueError(f"{name} must be [H, buckets] with H={q.shape[1]}, got shape {table.shape}")
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive python int, got {max_seq_len!r}")
    if not isinstance(max_attn_len, int) or max_attn_len < 0:
        raise ValueError(f"max_attn_len must be a python int >= 0, got {max_attn_len!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def jagged_attention(
    q: Float[Array, "T H Dqk"],
    k: Float[Array, "T H Dqk"],
    v: Float[Array, "T H Dv"],
    offsets: Int[Array, " B1"],
    *,
    max_seq_len: int,
    activation: str = "silu",
    alpha: float | None = None,
    num_targets: Int[Array, " B"] | None = None,
    max_attn_len: int = 0,
    timestamps: Int[Array, " T"] | None = None,
    pos_bias: Float[Array, "H P"] | None = None,
    time_bias: Float[Array, "H NT"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "T H Dv"]:
    """Causal attention over jagged sequences (HSTU SiLU or softmax), differentiable in q, k, v and biases.

    Args:
      q, k: [T, H, Dqk] token-major queries and keys; v: [T, H, Dv].
      offsets: int32[B+1], offsets[0] = 0, sequence b is rows offsets[b]:offsets[b+1]; rows past
        offsets[B] (unused capacity) produce zeros.
      max_seq_len: static upper bound of every sequence length; SiLU output is divided by it.
      activation: "silu" (pointwise, HSTU) or "softmax".
      alpha: score scale, default 1/sqrt(Dqk).
      num_targets: int32[B], the last num_targets[b] positions of sequence b are targets (they see the
        non-targets and themselves; non-targets never see them).
      max_attn_len: if > 0, non-target i sees only j with i - j <= max_attn_len.
      timestamps: int32[T] seconds, needed iff time_bias is given.
      pos_bias: [H, P], adds pos_bias[h, min(i - j, P - 1)] to the score.
      time_bias: [H, NT], adds time_bias[h, min(floor(log(max(ts_i - ts_j, 1)) / 0.301), NT - 1)].
      implementation: None (best for the platform), "reference", "pallas", "interpret", or an explicit
        backend name ("pallas_gpu", "pallas_tpu", "interpret_gpu", "interpret_tpu").

    Returns:
      [T, H, Dv] in v.dtype.
    """
    _check_shapes(
        q, k, v, offsets, num_targets, timestamps, pos_bias, time_bias, max_seq_len, max_attn_len, activation
    )
    fn = _IMPLEMENTATIONS[_resolve(implementation, pos_bias is not None or time_bias is not None)]
    return fn(
        q,
        k,
        v,
        offsets.astype(jnp.int32),
        max_seq_len=max_seq_len,
        activation=activation,
        alpha=alpha,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        timestamps=timestamps,
        pos_bias=pos_bias,
        time_bias=time_bias,
    )
