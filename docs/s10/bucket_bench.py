"""Session 10 call 3: bench train_step gem_h200 with the backward's bias from "values" or "buckets" rows.

Runs only on the prototype's tree, 1c164fd (gpu.BIAS_ROWS left with its revert, c206191).

usage: python3 docs/s10/bucket_bench.py MODE TILES [experiments args...]
MODE: values | buckets. TILES: default | computed (the tiles the in-kernel bias path uses: 64x128 dK/dV,
2 forward stages) | stages1 (default tiles, one backward pipeline stage).
"""

import dataclasses
import functools
import runpy
import sys

import pallas_kernels.jagged_attention.block_sizes as bs
import pallas_kernels.jagged_attention.gpu as g

original = bs.BlockSizes.get_default.__func__


def patched(cls, platform, *, mode, tiles, **kw):
    if tiles == "computed" and kw.get("bias_rows"):
        kw["bias_rows"] = False
    sizes = original(cls, platform, **kw)
    if tiles == "stages1" and platform == "gpu":
        sizes = dataclasses.replace(sizes, num_stages_bwd=1)
    print(f"bucket_bench: {mode} {tiles} -> {sizes}", flush=True)
    return sizes


if __name__ == "__main__":  # grain's worker processes import this file again: they must not rerun it
    mode, tiles, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    g.BIAS_ROWS = mode
    bs.BlockSizes.get_default = classmethod(functools.partial(patched, mode=mode, tiles=tiles))
    sys.argv = ["experiments", *rest]
    runpy.run_module("experiments", run_name="__main__")
