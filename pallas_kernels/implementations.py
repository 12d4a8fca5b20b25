"""The one way to name a kernel backend: the `implementation=` names every kernel op takes, the platforms an
op orders its default for, how one call's backend is chosen, and the backends' lazy import and custom VJP.

  None          the op's ordered default for the platform: the first backend of its order that takes the call
  "mosaic"      Pallas Mosaic GPU kernels (Hopper: wgmma, TMA; a package's gpu_sm90*.py)
  "triton"      Pallas's Triton lowering (any NVIDIA GPU; a package's gpu.py)
  "tpu"         Pallas Mosaic TPU kernels (a package's tpu.py)
  "reference"   the op's reference.py in plain jnp, the spec

Each op takes the names it has backends for, plus `interpret=True`: its kernel runs in Pallas's interpreter
(on CPU; the reference ignores it). Each op decides in one function of its api.py (`kernels_for` or
`kernel_for`), through `choose` below: its `DEFAULTS` hold one order per platform of PLATFORMS, and each
backend's supports() (a why_not(name) there: None, or why not) says which calls it takes. A named backend that
does not take a call is a ValueError naming why and what takes it: nothing falls back silently. Each op's
`kernels_in_use` reports the same decision (train, bench and profile print it).

The platform is jax's default backend, a GPU of compute capability 9.x (H100, H200) being "hopper". With
interpret=True the interpreter stands in for a GPU without Hopper's features (on a TPU host, for the TPU):
None then picks as there.

Backend modules are imported when a call runs them, or when a decision asks a supports() that lives in one
(the jagged attention Mosaic GPU kernels'), and a backend that fails to import fails there, loudly, naming it.
`run_kernel` is the one place a backend module's functions are called (the contract, docs/architecture.md): the
layout conversions as plain differentiable jnp, forward and backward bound into one `jax.custom_vjp`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import jax

NAMES = ("mosaic", "triton", "tpu", "reference")
PLATFORMS = ("hopper", "gpu", "tpu", "cpu")  # the keys of every op's DEFAULTS


def is_hopper() -> bool:
    """Whether jax's default device is a Hopper GPU (compute capability 9.x: H100, H200)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def this_platform(interpret: bool = False) -> str:
    """The platform (one of PLATFORMS) whose default order implementation=None follows in this process."""
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if interpret:
        return "gpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "hopper" if is_hopper() else "gpu"
    return "cpu"


def choose(
    op: str,
    implementation: str | None,
    *,
    names: tuple[str, ...],
    defaults: Mapping[str, tuple[str, ...]],
    why_not: Callable[[str], str | None],
    interpret: bool = False,
    platform: str | None = None,
) -> str:
    """The backend (one of `names`) that runs a call of `op`: `implementation` if it takes the call, else a
    ValueError naming why and what takes it; for None, the first of `defaults[platform]` that takes it
    (platform None: this process's, this_platform). why_not(name): None if that backend takes the call, else
    why not, in words."""
    if implementation is not None and implementation not in names:
        raise ValueError(f"{op}: implementation must be None or one of {names}, got {implementation!r}")
    if implementation is not None:
        reason = why_not(implementation)
        if reason is None:
            return implementation
        takers = [name for name in names if name != implementation and why_not(name) is None]
        raise ValueError(
            f"{op}: implementation={implementation!r} does not take this call: {reason}; use implementation=None "
            f"(the platform's default order)" + (f" or one that takes it: {takers}" if takers else "")
        )
    platform = platform or this_platform(interpret)
    reasons = []
    for name in defaults[platform]:
        reason = why_not(name)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    raise ValueError(
        f"{op}: no backend of the {platform} default order {defaults[platform]} takes this call "
        f"({'; '.join(reasons)}); name one of {names} that does with implementation="
    )


def describe(name: str, interpret: bool) -> str:
    """A backend's name as kernels_in_use reports it: with " (interpret)" where its kernel runs interpreted."""
    return f"{name} (interpret)" if interpret and name != "reference" else name


def tile_platform(name: str, interpret: bool) -> str:
    """The platform a backend's tiles are chosen for (a package's BlockSizes.get_default): "gpu", "tpu", or
    "cpu" (interpret mode: small tiles keep CPU tests fast)."""
    return "cpu" if interpret else "tpu" if name == "tpu" else "gpu"


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
