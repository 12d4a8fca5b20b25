"""What the jagged attention kernels are specialised on: one hashable object, built once per call by api.py."""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.options import KernelOptions


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """The static arguments of every backend function (hashable: a nondiff argument of the custom VJP).

    bias_rows: the GPU kernels load the relative bias from the [H, T, W] bias_rows array (KernelOptions) that
    forward builds. api.py decides it once, with the key tiles that will read the array; backends obey it. No
    default: whoever builds a KernelParams decides it.
    forward_kernel, backward_kernel: the GPU backend's kernels for each direction, "mosaic" (gpu_sm90.py,
    gpu_sm90_backward.py) or "triton" (gpu.py), decided by api.kernels_for; the TPU backend ignores them.
    """

    max_seq_len: int
    activation: str
    alpha: float
    max_attn_len: int
    has_targets: bool
    has_pos: bool
    has_time: bool
    num_pos: int  # real bucket counts (the tables may be padded wider)
    num_time: int
    interpret: bool
    blocks: BlockSizes
    bias_rows: bool
    options: KernelOptions = KernelOptions()
    forward_kernel: str = "triton"
    backward_kernel: str = "triton"

    @classmethod
    def build(
        cls,
        max_seq_len: int,
        activation: str = "silu",
        head_dim: int = 128,
        *,
        alpha: float | None = None,
        max_attn_len: int = 0,
        has_targets: bool = False,
        num_pos: int | None = None,
        num_time: int | None = None,
        interpret: bool = False,
        blocks: BlockSizes | None = None,
        bias_rows: bool = False,
        options: KernelOptions | None = None,
    ) -> KernelParams:
        """The one way to make a KernelParams (api.py, tests, benchmarks): alpha defaults to 1/sqrt(head_dim),
        a table's presence follows from its bucket count (None: no such table), and the tiles default to the
        GPU backend's for this call (as jagged_attention picks them without a bias_rows array). The kernels
        of each direction start as Triton's: api.py sets them."""
        return cls(
            max_seq_len=max_seq_len,
            activation=activation,
            alpha=float(1.0 / math.sqrt(head_dim) if alpha is None else alpha),
            max_attn_len=max_attn_len,
            has_targets=has_targets,
            has_pos=num_pos is not None,
            has_time=num_time is not None,
            num_pos=num_pos or 1,
            num_time=num_time or 1,
            interpret=interpret,
            blocks=blocks or BlockSizes.get_default("gpu", head_dim=head_dim, max_seq_len=max_seq_len),
            bias_rows=bias_rows,
            options=options or KernelOptions(),
        )
