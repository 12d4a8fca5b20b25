"""What every Pallas Mosaic GPU (Hopper) kernel shares: the wgmma register layouts, the shared-memory budget,
the persistent walk over a work list, the SM count read from the device, and the switch into Mosaic GPU's CPU
interpreter.

The layout helpers take `interpret` and swap in plain jnp for what the interpreter lacks (register layouts).
Only the Mosaic GPU kernel modules import this module (it imports Mosaic GPU): choosing a kernel does not.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv_dyn

# The SMs of an H100 SXM or H200: the persistent grid of a kernel called directly (tests, benchmarks) and of
# one lowered where no GPU says how many it has (CPU tests). The backends pass num_sms().
NUM_SMS = 132
SMEM_BYTES = 232448  # the H100/H200's shared memory per block (227 KiB)
SMEM_SLACK = 8192  # barriers and the swizzled buffers' alignment, not counted by a kernel's smem_bytes
ROW = plgpu.Layout.WGMMA.reduce(1)  # a vector laid out like the rows of a wgmma tile
COL = plgpu.Layout.WGMMA.reduce(0)  # a vector laid out like its columns


def compiler_params(warpgroup_semantics: bool = False) -> plgpu.CompilerParams:
    """Approximate math, and the lowering semantics set explicitly: jax 0.10's default is Lane, 0.11's
    Warpgroup, and the kernels here are written for Lane (explicit wgmma register layouts, inline Mosaic GPU
    code): left to the default, the same kernel lowered differently on the two versions."""
    semantics = plgpu.LoweringSemantics.Warpgroup if warpgroup_semantics else plgpu.LoweringSemantics.Lane
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics)


def num_sms() -> int:
    """The SMs of jax's default device (132 on an H100 SXM or H200, 114 on an H100 PCIe): the persistent
    grids' CTAs. NUM_SMS where the device does not say (a kernel lowered on CPU)."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else NUM_SMS


def cast_layout(interpret: bool, x, layout):
    """plgpu.layout_cast, skipped in the GPU interpreter (which has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(interpret: bool, shape, dim: int):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def load_vector(interpret: bool, ref, layout):
    """A 1-D shared-memory ref as a vector in a wgmma row or column layout."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout)


def persistent(num_ctas, num_items: int, heads: int):
    """(iterations of this CTA, item_of(i) -> (head, item)): one (head, item) per CTA (num_ctas None: a grid
    named ("heads", "items")), or (persistent: a grid named ("sm",)) items cta, cta + num_ctas, ... of the flat
    list with heads fastest."""
    if num_ctas is None:
        return 1, lambda i: (lax.axis_index("heads"), lax.axis_index("items"))
    cta = lax.axis_index("sm")
    num_iters = cdiv_dyn(jnp.maximum(num_items * heads - cta, 0), num_ctas)

    def item_of(i):
        idx = cta + i * num_ctas
        return idx % heads, idx // heads

    return num_iters, item_of


def xla_cpu_pool_threads() -> int:
    """The threads of XLA:CPU's intra-op pool in this process, as XLA sizes it: PJRT_NPROC, else NPROC, else
    the schedulable cores, at least the number of CPU devices (xla_force_host_platform_device_count)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for name in ("PJRT_NPROC", "NPROC"):  # xla/pjrt/utils.cc DefaultThreadPoolSize
        try:
            cores = max(0, int(os.environ[name]))
            break
        except (KeyError, ValueError):
            continue
    try:
        devices = len(jax.devices("cpu"))
    except RuntimeError:  # no CPU backend in this process
        devices = 0
    return max(cores, devices)


def pool_threads_needed(warpgroups: int) -> int:
    """XLA:CPU pool threads the interpreter needs for a kernel of this many warpgroups per CTA. It runs each
    warpgroup as an XLA program whose callbacks (a barrier wait among them) XLA may run on its intra-op pool,
    and a waiting callback holds its thread: warpgroups that wait on each other need one thread each, one for
    the interpreter's own waiting callback around them and one for work that does not wait. One warpgroup
    waits on nobody."""
    return 1 if warpgroups == 1 else warpgroups + 2


def interpreter(interpret: bool, *, warpgroups: int = 1, detect_races: bool = False):
    """Mosaic GPU's CPU interpreter around a kernel's call in interpret mode (a private jax module, only
    reachable this way), else nothing. Refuses an XLA:CPU pool too small for the kernel's warpgroups, where
    the interpreter would wait forever. `detect_races`: its shared-memory race detector (tests)."""
    if not interpret:
        return contextlib.nullcontext()
    threads, needed = xla_cpu_pool_threads(), pool_threads_needed(warpgroups)
    if threads < needed:
        raise RuntimeError(
            f"Mosaic GPU interpret mode: XLA:CPU's thread pool has {threads} threads, the interpreter needs "
            f"{needed} for a kernel of {warpgroups} warpgroups (else they wait on each other forever); set "
            "NPROC=8 or XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts"
        )
    # platform-only: the Mosaic GPU interpreter (CPU runs), a private jax module
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

    return interpret_params.force_gpu_interpret_mode(
        interpret_params.InterpretGPUParams(out_of_bounds_reads="raise", detect_races=detect_races)
    )
