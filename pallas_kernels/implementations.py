"""The `implementation=` names every kernel package accepts, and the lazy import of its backends.

  None                             the best for the platform: the GPU kernel on GPU, the TPU kernel on TPU,
                                   the pure-jnp reference elsewhere (CPU)
  "reference"                      the package's reference.py, the spec
  "gpu", "tpu"                     that backend's Pallas kernel
  "gpu_interpret", "tpu_interpret" the same kernel in Pallas interpret mode (runs on CPU)
  "pallas"                         the platform's kernel (needs a GPU or TPU)
  "interpret"                      the platform's kernel in interpret mode; the GPU kernel on CPU

A kernel name is a backend module of the package (`gpu.py`, `tpu.py`) plus an optional "_interpret".
Backends are imported when first asked for, so CPU users never import Triton or Mosaic lowering code and a
backend that fails to import fails there, loudly, naming the implementation.

`run_kernel` is the one place a backend's functions are called (the contract, docs/architecture.md): the
layout conversions as plain differentiable jnp, forward and backward bound into one `jax.custom_vjp`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax

KERNELS = ("gpu", "gpu_interpret", "tpu", "tpu_interpret")
_PLATFORM_KERNEL = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def _pallas(platform: str) -> str:
    if platform not in _PLATFORM_KERNEL:
        raise ValueError(
            f"implementation='pallas' needs a GPU or TPU, the default backend is {platform!r}; "
            "use 'interpret' or 'reference'"
        )
    return _PLATFORM_KERNEL[platform]


def _fixed(name: str) -> Callable[[str], str]:
    return lambda platform: name


# implementation name -> what it runs on a platform (jax.default_backend()): "reference" or one of KERNELS
IMPLEMENTATIONS: dict[str, Callable[[str], str]] = {
    "reference": _fixed("reference"),
    **{kernel: _fixed(kernel) for kernel in KERNELS},
    "pallas": _pallas,
    "interpret": lambda platform: ("tpu" if platform == "tpu" else "gpu") + "_interpret",
}


def default_implementation(platform: str | None = None) -> str:
    """What `implementation=None` runs on a platform (default: jax's default backend)."""
    platform = platform or jax.default_backend()
    return _PLATFORM_KERNEL.get(platform, "reference")


def resolve(implementation: str | None) -> str:
    """The kernel name (one of KERNELS), or "reference", that `implementation` runs on this platform."""
    if implementation is None:
        return default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {tuple(IMPLEMENTATIONS)} or None, got {implementation!r}"
        )
    return IMPLEMENTATIONS[implementation](jax.default_backend())


def interpret(kernel: str) -> bool:
    """Whether a kernel name (one of KERNELS) runs in Pallas interpret mode."""
    return kernel.endswith("_interpret")


def tile_platform(kernel: str) -> str:
    """The platform a kernel's tiles are chosen for (BlockSizes.get_default): "gpu", "tpu", or "cpu"
    (interpret mode: small tiles keep CPU tests fast)."""
    return "cpu" if interpret(kernel) else kernel


def load_module(name: str) -> ModuleType:
    """A backend module by its path, imported when first asked for."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"the backend {name} failed to import: {e}") from e


# module: a backend module's path; params: its package's hashable KernelParams; inputs: the backend's
# to_kernel_layout tuple.
@functools.partial(jax.custom_vjp, nondiff_argnames=("module", "params"))
def _kernel_call(inputs: tuple, module: str, params: Any):
    return load_module(module).forward(inputs, params)[0]


def _kernel_call_fwd(inputs: tuple, module: str, params: Any):
    return load_module(module).forward(inputs, params)


def _kernel_call_bwd(module: str, params: Any, residuals, d_out):
    return (load_module(module).backward(residuals, d_out, params),)


_kernel_call.defvjp(_kernel_call_fwd, _kernel_call_bwd)


def run_kernel(module: str, params: Any, q, k, v, offsets, *extras) -> jax.Array:
    """A backend module's kernels on [T, H, D] q, k, v: to_kernel_layout, the custom VJP, from_kernel_layout.

    `extras` are the package's further array arguments of to_kernel_layout (after offsets, before params).
    """
    backend = load_module(module)
    inputs = backend.to_kernel_layout(q, k, v, offsets, *extras, params)
    out = _kernel_call(inputs, module, params)
    return backend.from_kernel_layout(out, v, offsets, params)
