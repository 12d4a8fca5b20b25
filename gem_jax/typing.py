"""Shape annotations: the one dimension vocabulary, and runtime checking of it.

Array arguments at module boundaries carry jaxtyping annotations such as
`Float[Array, "T H Dqk"]`. A dimension name means the same thing in every file:

| name | meaning |
| --- | --- |
| T | token capacity of a jagged pack (the flat token axis) |
| B | example (sequence) capacity of a pack; a jagged array of B segments has `B1` = B + 1 offsets |
| H, Dqk, Dv | attention heads, query/key width per head, value width per head |
| D | model width (the sequence tower's token vectors) |
| d, E | embedding width (item / feature vectors) |
| C, K | candidates per example, tasks (labels and logits are [B, C, K]) |
| S, BF1 | capacity of a pack's flattened sparse ids; offsets of its B x F bags (B*F + 1) |
| Fd | dense features per example |
| N, N1 | rows of a batch of vectors (users, items); N1 = number of items + 1 (row 0 = padding) |
| P, NT | relative position buckets, relative time buckets |
| R, G | rows of a gathered sub-layout (long history), blocks of a block table |
| V, U | rows of an embedding table (or of one device's block of it); capacity of its touched (unique) rows |
| Gr, El | devices a table's rows (or columns) are split over; one device's columns of a column-wise table |
| M, L | sampled negatives per user, history length of an exclusion list |
| din, dout, rows | a Dense layer's input and output widths; rows of its flattened input (FP8 GEMM) |
| hist | steps kept in an FP8 amax history |
| Lw | positions of a sequence window (one sequence per row: frequency, wavelet, time-variant filters) |
| Kt, Mb | taps of a time-variant filter, filters of the basis its taps are made from |
| J1 | bands of a wavelet decomposition (levels + 1) |
| *rest | trailing axes an operation carries through unchanged |
| ... | leading batch axes (a stack of packs has one: the shard axis) |

Why "B1" and not "B+1": jaxtyping evaluates "B+1" only once B is bound by an earlier argument,
and offsets usually come first. A one-token dimension string gets a leading space (" T"): ruff
would read a bare "T" as a name.

Runtime checking: `GEM_JAX_TYPECHECK=1` in the environment (the test suite sets it, for its
subprocesses too) makes every annotated function in gem_jax and pallas_kernels check its array
shapes and dtypes when called (jaxtyping's import hook with beartype), so a wrong shape at a module
boundary fails where it enters, naming the argument. Jitted code is checked once, at trace time.
The jagged batch dataclasses are exempt (`typing.no_type_check`): JAX rebuilds pytrees with
placeholders (shardings, specs) that are not arrays; their users' annotations are checked instead.
"""

from __future__ import annotations

import importlib
import os

from jaxtyping import install_import_hook

PACKAGES = ("gem_jax", "pallas_kernels")
ENV_VAR = "GEM_JAX_TYPECHECK"
PRELOADED = (  # the training path's heavy imports (see install_shape_checking); Pallas loads lazily
    "numpy",
    "jax",
    "jax.numpy",
    "jax.experimental.multihost_utils",
    "jax.experimental.mesh_utils",
    "flax.nnx",
    "flax.struct",
    "optax",
    "orbax.checkpoint",
    "grain",
)


def shape_checking_requested() -> bool:
    return os.environ.get(ENV_VAR, "") not in ("", "0", "false")


def install_shape_checking() -> None:
    """Checks every annotated function of PACKAGES' modules imported from now on (jaxtyping +
    beartype). Modules already imported stay unchecked, so call this before importing them."""

    # The hook renames the bytecode cache (importlib's cache_from_source, patched process-wide) while a
    # checked module runs, so every package first imported from inside one would be compiled from
    # source, in every process (~5 s each): import the heavy ones first, from their cached bytecode.
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra that is not installed
            pass
    install_import_hook(list(PACKAGES), "beartype.beartype")
