"""The one public entry point: validates shapes, picks a backend, builds the kernels' parameters once.

Backends (gpu.py, tpu.py) follow the kernel-package contract (docs/architecture.md): `to_kernel_layout` and
`from_kernel_layout` (layout conversions in jnp, differentiated by JAX as usual), `forward(inputs, params)` ->
(out, residuals) and `backward(residuals, d_out, params)` -> the inputs' cotangents, which
implementations.run_kernel binds into one `jax.custom_vjp`. Every decision a backend obeys (tiles, whether the
bias_rows array is used) is made here, in KernelParams. Implementation names: pallas_kernels/implementations.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float, Int

from pallas_kernels import implementations
from pallas_kernels.checks import check_jagged_qkv
from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.options import KernelOptions
from pallas_kernels.jagged_attention.params import KernelParams
from pallas_kernels.jagged_attention.reference import jagged_attention_reference
from pallas_kernels.jagged_attention.tiling import bias_width

ACTIVATIONS = ("silu", "softmax")
# The GPU backend's two kernel families, by name: Mosaic GPU (gpu_sm90*.py: wgmma, TMA; Hopper only) and
# Triton (gpu.py; deprecated by jax on Hopper, kept for pre-Hopper GPUs). implementation=None (or "gpu",
# "pallas") runs Mosaic GPU on Hopper wherever it takes the call, Triton otherwise.
GPU_FAMILIES = ("mosaic", "triton")
_PACKAGE = "pallas_kernels.jagged_attention"


def _tiles_and_bias_rows(
    kernel: str,
    q,
    v,
    *,
    max_seq_len: int,
    has_bias: bool,
    block_sizes: BlockSizes | None,
    options: KernelOptions,
) -> tuple[BlockSizes, bool]:
    """(tiles, whether the GPU kernels load the bias from the bias_rows array): one decision, with the key
    tiles that read the array (they set its width). Without given tiles, the defaults for the array are tried
    first, and the defaults for the bias computed in the kernels are taken if the array does not fit."""

    def fits(blocks: BlockSizes) -> bool:
        width = bias_width(max_seq_len, blocks)
        return options.use_bias_rows(
            rows=q.shape[0], heads=q.shape[1], width=width, itemsize=q.dtype.itemsize
        )

    wanted = has_bias and kernel.startswith("gpu")  # only the GPU kernels read a bias_rows array
    if block_sizes is not None:
        return block_sizes, wanted and fits(block_sizes)
    default = functools.partial(
        BlockSizes.get_default,
        implementations.tile_platform(kernel),
        head_dim=max(q.shape[-1], v.shape[-1]),
        max_seq_len=max_seq_len,
        has_bias=has_bias,
        itemsize=max(q.dtype.itemsize, v.dtype.itemsize),
    )
    if wanted and fits(default(bias_rows=True)):
        return default(bias_rows=True), True
    return default(bias_rows=False), False


@functools.partial(
    jax.jit,
    static_argnames=(
        "max_seq_len",
        "activation",
        "alpha",
        "max_attn_len",
        "implementation",
        "block_sizes",
        "options",
    ),
)
def jagged_attention(
    q: Float[ArrayLike, "T H Dqk"],
    k: Float[ArrayLike, "T H Dqk"],
    v: Float[ArrayLike, "T H Dv"],
    offsets: Int[ArrayLike, " B1"],
    *,
    max_seq_len: int,
    activation: str = "silu",
    alpha: float | None = None,
    num_targets: Int[ArrayLike, " B"] | None = None,
    max_attn_len: int = 0,
    timestamps: Int[ArrayLike, " T"] | None = None,
    pos_bias: Float[ArrayLike, "H P"] | None = None,
    time_bias: Float[ArrayLike, "H NT"] | None = None,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    options: KernelOptions | None = None,
) -> Float[ArrayLike, "T H Dv"]:
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
      implementation: None (best for the platform), "reference", "pallas", "interpret", a backend ("gpu",
        "gpu_interpret", "tpu", "tpu_interpret"; pallas_kernels/implementations.py), or a GPU kernel family,
        "mosaic" or "triton" (GPU_FAMILIES; a call the Mosaic GPU kernels do not take is a ValueError).
      block_sizes: kernel tiles; None: BlockSizes.get_default for the backend.
      options: kernel variants (benchmarks A/B them); None: KernelOptions(), the shipped kernel.

    Returns:
      [T, H, Dv] in v.dtype.
    """
    check_jagged_qkv(q, k, v, offsets)
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
    if alpha is not None and not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha must be a python float or None, got {alpha!r}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes or None, got {block_sizes!r}")
    if options is not None and not isinstance(options, KernelOptions):
        raise ValueError(f"options must be a KernelOptions or None, got {options!r}")
    offsets = offsets.astype(jnp.int32)
    kernel, params = _plan(
        q,
        v,
        max_seq_len=max_seq_len,
        activation=activation,
        alpha=alpha,
        has_targets=num_targets is not None,
        max_attn_len=max_attn_len,
        num_pos=None if pos_bias is None else pos_bias.shape[1],
        num_time=None if time_bias is None else time_bias.shape[1],
        implementation=implementation,
        block_sizes=block_sizes,
        options=options,
    )
    if kernel == "reference":
        return jagged_attention_reference(
            q,
            k,
            v,
            offsets,
            max_seq_len=max_seq_len,
            activation=activation,
            alpha=alpha,
            num_targets=num_targets,
            max_attn_len=max_attn_len,
            timestamps=timestamps,
            pos_bias=pos_bias,
            time_bias=time_bias,
        )
    extras = (num_targets, timestamps, pos_bias, time_bias)
    module = f"{_PACKAGE}.{'tpu' if kernel.startswith('tpu') else 'gpu_layout'}"
    return implementations.run_kernel(module, params, q, k, v, offsets, *extras)


def _plan(
    q,
    v,
    *,
    max_seq_len: int,
    activation: str,
    alpha: float | None,
    has_targets: bool,
    max_attn_len: int,
    num_pos: int | None,
    num_time: int | None,
    implementation: str | None,
    block_sizes: BlockSizes | None,
    options: KernelOptions | None,
) -> tuple[str, KernelParams | None]:
    """(kernel name, KernelParams): every decision about how a call runs, made once (q, v: arrays or shapes).

    The kernel name is "reference" (params None) or one of implementations.KERNELS. For "gpu", the params say
    which family runs each direction (hopper_forward, hopper_backward): the one named by implementation=
    ("mosaic", "triton"), else Mosaic GPU where KernelOptions and the device allow it and it takes the call.
    """
    family = implementation if implementation in GPU_FAMILIES else None
    kernel = implementations.resolve("gpu" if family else implementation)
    if kernel == "reference":
        return kernel, None
    has_bias = num_pos is not None or num_time is not None
    options = options or KernelOptions()
    blocks, bias_rows = _tiles_and_bias_rows(
        kernel, q, v, max_seq_len=max_seq_len, has_bias=has_bias, block_sizes=block_sizes, options=options
    )
    params = KernelParams.build(
        max_seq_len,
        activation,
        q.shape[-1],
        alpha=alpha,
        max_attn_len=max_attn_len,
        has_targets=has_targets,
        num_pos=num_pos,
        num_time=num_time,
        interpret=implementations.interpret(kernel),
        blocks=blocks,
        bias_rows=bias_rows,
        options=options,
    )
    if kernel != "gpu" or family == "triton":
        return kernel, params
    # platform-only: the Mosaic GPU backend is imported only where a GPU kernel may run
    from pallas_kernels.jagged_attention import gpu_sm90, gpu_sm90_backward

    forward = (family == "mosaic" or gpu_sm90.wanted(options.hopper_forward)) and gpu_sm90.supports(
        params, q, v
    )
    backward = (family == "mosaic" or gpu_sm90_backward.wanted(options.hopper_backward)) and (
        gpu_sm90_backward.supports(params, q, v)
    )
    if family == "mosaic" and not (forward and backward):
        raise ValueError(
            f"implementation='mosaic': the Mosaic GPU {'backward' if forward else 'forward'} does not take this "
            f"call (q {q.dtype} {q.shape}, v {v.shape}, activation={activation!r}, bias tables of "
            f"{num_pos} / {num_time} buckets: see gpu_sm90*.supports); use implementation=None or 'triton'"
        )
    # both Mosaic kernels compute the bias from the tables: no bias_rows array
    return kernel, dataclasses.replace(
        params,
        hopper_forward=forward,
        hopper_backward=backward,
        bias_rows=params.bias_rows and not (forward and backward),
    )


def kernels_in_use(
    q,
    v,
    *,
    max_seq_len: int,
    activation: str = "silu",
    has_targets: bool = False,
    max_attn_len: int = 0,
    num_pos: int | None = None,
    num_time: int | None = None,
    implementation: str | None = None,
    options: KernelOptions | None = None,
) -> tuple[str, str]:
    """(forward, backward) kernel family a jagged_attention call with these shapes (arrays or
    jax.ShapeDtypeStruct) and settings runs: "mosaic", "triton", "tpu", "reference", or one of those plus
    " (interpret)". Made by the same decision as the call itself; train prints it at start-up."""
    kernel, params = _plan(
        q,
        v,
        max_seq_len=max_seq_len,
        activation=activation,
        alpha=None,
        has_targets=has_targets,
        max_attn_len=max_attn_len,
        num_pos=num_pos,
        num_time=num_time,
        implementation=implementation,
        block_sizes=None,
        options=options,
    )
    if params is None:
        return "reference", "reference"
    suffix = " (interpret)" if params.interpret else ""
    if kernel.startswith("tpu"):
        return "tpu" + suffix, "tpu" + suffix
    fwd = "mosaic" if params.hopper_forward else "triton"
    bwd = "mosaic" if params.hopper_backward else "triton"
    return fwd + suffix, bwd + suffix
