"""What the jagged attention kernels are specialised on: one hashable object, built once per call by api.py."""

from __future__ import annotations

import dataclasses

from pallas_kernels.jagged_attention.block_sizes import BlockSizes
from pallas_kernels.jagged_attention.options import KernelOptions


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """The static arguments of every backend function (hashable: a nondiff argument of the custom VJP).

    bias_rows: the GPU kernels load the relative bias from the [H, T, W] bias_rows array (KernelOptions) that
    forward builds. api.py decides it once, with the key tiles that will read the array; backends obey it. No
    default: whoever builds a KernelParams decides it.
    hopper_forward: the GPU backend's forward is the Mosaic GPU kernel (gpu_sm90.py), decided by api.py from
    KernelOptions.hopper_forward, the device and gpu_sm90.supports.
    hopper_backward: the GPU backend's backward is the Mosaic GPU kernels (gpu_sm90_backward.py), decided by
    api.py from KernelOptions.hopper_backward, the device and gpu_sm90_backward.supports.
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
    hopper_forward: bool = False
    hopper_backward: bool = False
