"""The one public entry point: validates shapes, picks the kernels, builds their parameters once.

Which kernels run: `kernels_for`, one decision per call and direction (forward, backward). Names as every kernel
op (pallas_kernels/implementations.py): "mosaic" (gpu_sm90.py forward, gpu_sm90_backward.py backward: Hopper),
"triton" (gpu.py), "tpu" (tpu.py), "reference". implementation=None takes the first of DEFAULTS[platform]
whose kernel takes the call, for each direction on its own: on Hopper Mosaic GPU wherever its supports() takes
the call, else Triton; Triton on other GPUs; the TPU kernel on TPU; the reference on CPU.

Backends (gpu_layout.py for both GPU families, tpu.py) follow the kernel-package contract
(docs/architecture.md): `to_kernel_layout` and `from_kernel_layout` (layout conversions in jnp, differentiated
by JAX as usual), `forward(inputs, params)` -> (out, residuals) and `backward(residuals, d_out, params)` -> the
inputs' cotangents, which implementations.run_kernel binds into one `jax.custom_vjp`. Every decision a backend
obeys (the kernels of each direction, tiles, whether the bias_rows array is used) is made here, in KernelParams.
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
NAMES = ("mosaic", "triton", "tpu", "reference")
# implementation=None, per platform (implementations.PLATFORMS) and direction: the first whose kernel takes the
# call. Triton stays for pre-Hopper GPUs (jax deprecates it on Hopper).
DEFAULTS = {"hopper": ("mosaic", "triton"), "gpu": ("triton",), "tpu": ("tpu",), "cpu": ("reference",)}
GPU_KERNELS = (
    "mosaic",
    "triton",
)  # the GPU backend's families: one layout, so each direction may take either
_PACKAGE = "pallas_kernels.jagged_attention"


def _tiles_and_bias_rows(
    kernel: str,
    interpret: bool,
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

    wanted = has_bias and kernel in GPU_KERNELS  # only the GPU kernels read a bias_rows array
    if block_sizes is not None:
        return block_sizes, wanted and fits(block_sizes)
    default = functools.partial(
        BlockSizes.get_default,
        implementations.tile_platform(kernel, interpret),
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
        "interpret",
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
    interpret: bool = False,
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
      implementation: None (DEFAULTS for the platform, per direction), "mosaic", "triton", "tpu" or
        "reference" (both directions; one that does not take the call is a ValueError): kernels_for.
      interpret: the kernels run in Pallas's interpreter (CPU tests).
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
    call = _call_params(
        q,
        max_seq_len=max_seq_len,
        activation=activation,
        alpha=alpha,
        has_targets=num_targets is not None,
        max_attn_len=max_attn_len,
        num_pos=None if pos_bias is None else pos_bias.shape[1],
        num_time=None if time_bias is None else time_bias.shape[1],
        interpret=interpret,
        options=options,
    )
    params = _plan(call, q, v, implementation=implementation, block_sizes=block_sizes)
    if params is None:
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
    module = f"{_PACKAGE}.{'tpu' if params.forward_kernel == 'tpu' else 'gpu_layout'}"
    return implementations.run_kernel(module, params, q, k, v, offsets, *extras)


def _call_params(
    q,
    *,
    max_seq_len: int,
    activation: str,
    alpha: float | None,
    has_targets: bool,
    max_attn_len: int,
    num_pos: int | None,
    num_time: int | None,
    interpret: bool,
    options: KernelOptions | None,
) -> KernelParams:
    """The call's KernelParams before the kernels are chosen (GPU tiles, no bias_rows array): what the
    backends' supports() read. options None: KernelOptions(), the shipped kernel."""
    return KernelParams.build(
        max_seq_len,
        activation,
        q.shape[-1],
        alpha=alpha,
        max_attn_len=max_attn_len,
        has_targets=has_targets,
        num_pos=num_pos,
        num_time=num_time,
        interpret=interpret,
        options=options,
    )


def _why_not(name: str, direction: str, params: KernelParams, q, v) -> str | None:
    """None if backend `name` takes this call in `direction` ("forward", "backward"), else why not: only the
    Mosaic GPU kernels take some calls only (gpu_sm90.supports, gpu_sm90_backward.supports)."""
    if name != "mosaic":
        return None
    # platform-only: the Mosaic GPU modules, imported where a call may run them or names them
    from pallas_kernels.jagged_attention import gpu_sm90, gpu_sm90_backward

    module = gpu_sm90 if direction == "forward" else gpu_sm90_backward
    if module.supports(params, q, v):
        return None
    if params.interpret:
        return f"the Mosaic GPU {direction} has no interpret mode here (tests call its kernels directly)"
    return (
        f"the Mosaic GPU {direction} ({module.__name__}.supports) does not take q {q.dtype} {tuple(q.shape)}, "
        f"v {v.dtype} {tuple(v.shape)}, activation={params.activation!r}, bias tables of "
        f"{params.num_pos if params.has_pos else None} / {params.num_time if params.has_time else None} buckets"
    )


def kernels_for(
    params: KernelParams, q, v, implementation: str | None, *, platform: str | None = None
) -> tuple[str, str]:
    """(forward, backward): which kernels run a call, the one decision. Both directions run `implementation`
    when named (a ValueError where one does not take the call); for None each takes the first of DEFAULTS
    that takes the call (platform None: this process's), the backward among the forward's family: on an H100
    Mosaic GPU where gpu_sm90.supports / gpu_sm90_backward.supports take the call, else Triton."""
    choose = functools.partial(
        implementations.choose,
        "jagged_attention",
        implementation,
        names=NAMES,
        defaults=DEFAULTS,
        interpret=params.interpret,
        platform=platform,
    )
    forward = choose(why_not=lambda name: _why_not(name, "forward", params, q, v))
    if forward not in GPU_KERNELS:
        return forward, forward
    backward = choose(
        why_not=lambda name: (
            _why_not(name, "backward", params, q, v) if name in GPU_KERNELS else "not the forward's layout"
        )
    )
    return forward, backward


def _plan(
    params: KernelParams, q, v, *, implementation: str | None, block_sizes: BlockSizes | None
) -> KernelParams | None:
    """Every decision about how a call runs, made once (q, v: arrays or shapes): the call's _call_params with
    the kernels of each direction (kernels_for), the tiles and whether a bias_rows array is built; None where
    the reference runs."""
    forward, backward = kernels_for(params, q, v, implementation)
    if forward == "reference":
        return None
    blocks, bias_rows = _tiles_and_bias_rows(
        forward,
        params.interpret,
        q,
        v,
        max_seq_len=params.max_seq_len,
        has_bias=params.has_pos or params.has_time,
        block_sizes=block_sizes,
        options=params.options,
    )
    # both Mosaic GPU directions compute the bias from the tables: no bias_rows array
    return dataclasses.replace(
        params,
        blocks=blocks,
        bias_rows=bias_rows and not (forward == backward == "mosaic"),
        forward_kernel=forward,
        backward_kernel=backward,
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
    interpret: bool = False,
    options: KernelOptions | None = None,
    platform: str | None = None,
) -> tuple[str, str]:
    """(forward, backward) kernels a jagged_attention call with these shapes (arrays or jax.ShapeDtypeStruct)
    and settings runs: "mosaic", "triton", "tpu", "reference", with " (interpret)" where interpreted.
    kernels_for's decision; train prints it at start-up. platform: one of implementations.PLATFORMS (None:
    this process's)."""
    params = _call_params(
        q,
        max_seq_len=max_seq_len,
        activation=activation,
        alpha=None,
        has_targets=has_targets,
        max_attn_len=max_attn_len,
        num_pos=num_pos,
        num_time=num_time,
        interpret=interpret,
        options=options,
    )
    forward, backward = kernels_for(params, q, v, implementation, platform=platform)
    return implementations.describe(forward, interpret), implementations.describe(backward, interpret)
