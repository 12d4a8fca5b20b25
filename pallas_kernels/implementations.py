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
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

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


def load_backend(package: str, kernel: str) -> tuple[ModuleType, bool]:
    """(backend module of `package`, interpret mode) for a kernel name, e.g. "gpu_interpret"."""
    name = f"{package}.{kernel.removesuffix('_interpret')}"
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"implementation {kernel!r} needs {name}, which failed to import: {e}") from e
    return module, kernel.endswith("_interpret")
