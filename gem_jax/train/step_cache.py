"""The compiled train step kept on disk and found by what it is built from, without tracing it.

JAX's persistent cache (compile_cache.py) is keyed by the lowered program, so a run must trace and lower its
step before it can look it up. On a GPU that is most of a second run's start: the Mosaic GPU kernels are
traced and lowered in Python (gem_h200 on one H100: 25 s of lowering and a trace for the memory plan, in a
40 s start whose compile came from that cache in 0.6 s). So the train step's executable is also kept here,
keyed by what its program is made of:

- the config (all of it but the cache folder), the "auto" FP8 choices, and the data's identity;
- the source of the packages that build the step (gem_jax, pallas_kernels);
- the state's and the batch's tree, shapes, dtypes and shardings;
- jax's and jaxlib's versions and settings, the devices (kind, id, process), XLA's flags and the memory the
  device reports.

A hit skips the memory plan's trace, the lowering and the compile: the plan and the tables' budget are the
ones recorded with the executable (the same inputs plan the same way). An entry that fails to load, or whose
arguments do not match the state's, is ignored with one line: the step compiles as usual and is written
again. Entries are files in `<train.compilation_cache>/steps`, off with that cache or with the environment
variable GEM_JAX_STEP_CACHE=0 (the test suite sets it: its tests patch the step at times, which no key can
see); they are trusted input (pickled executables), like the cache itself.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from gem_jax.train import files, memory

FORMAT = 1
PACKAGES = ("gem_jax", "pallas_kernels")  # their source builds the step
_ENV = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "LIBTPU_INIT_ARGS")


@functools.cache
def source_digest() -> str:
    """sha256 of every Python file of PACKAGES (path and content), read once per process."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _signature(tree: Any) -> list[Any]:
    """The tree's structure and each leaf's shape, dtype and sharding, as text."""
    leaves, treedef = jax.tree.flatten(tree)
    rows = [
        [list(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)), str(getattr(x, "sharding", ""))]
        for x in leaves
    ]
    return [str(treedef), rows]


def step_key(task: Any, trainer: Any, stack: Any, data: dict[str, Any], capacity: tuple[int, str]) -> str:
    """The key of `trainer`'s train step on batches shaped like `stack` (the module docstring's list)."""
    config = task.config.to_dict()
    config["train"].pop("compilation_cache", None)
    jax_settings = {
        k: repr(v) for k, v in sorted(jax.config.values.items()) if "cache" not in k and "log" not in k
    }
    devices = [[d.platform, d.device_kind, d.id, d.process_index] for d in jax.devices()]
    parts = {
        "format": FORMAT,
        "config": config,
        "fp8": repr(getattr(trainer, "fp8_decisions", None)),
        "data": data,
        "source": source_digest(),
        "state": _signature(trainer.abstract_sharded_state),
        "batch": _signature(stack),
        "jax": [jax.__version__, jaxlib.__version__, jax_settings],
        "devices": [
            devices,
            jax.process_count(),
            jax.process_index(),
            jax.devices()[0].client.platform_version,
        ],
        "env": {k: os.environ.get(k) for k in _ENV},
        "capacity": list(capacity),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass
class Entry:
    """A loaded step: the executable, the memory plan it was compiled under, and the tables' budget that
    plan used (None: the tables kept their configured plan)."""

    compiled: jax.stages.Compiled
    planned: memory.StepMemory
    table_budget: int | None
    seconds: float  # to read and load it
    path: Path


def folder_of(cache_folder: Path | None) -> Path | None:
    """The entries' folder inside the compilation cache's (None: either cache is off)."""
    if cache_folder is None or os.environ.get("GEM_JAX_STEP_CACHE", "1") == "0":
        return None
    return cache_folder / "steps"


def load(folder: Path | None, key: str, say: Any = print) -> Entry | None:
    """The entry for `key`, or None (no folder, no entry, or one that fails to load: said in one line)."""
    if folder is None:
        return None
    path = folder / f"{key}.pkl"
    if not path.exists():
        return None
    t0 = time.perf_counter()
    try:
        with path.open("rb") as f:
            saved = pickle.load(f)
        by_id = {d.id: d for d in jax.devices()}
        compiled = serialize_executable.deserialize_and_load(
            saved["executable"],
            saved["in_tree"],
            saved["out_tree"],
            execution_devices=[by_id[i] for i in saved["devices"]],
        )
        planned = memory.StepMemory(**saved["planned"])
    except Exception as e:  # noqa: BLE001 (any failure means: compile instead)
        say(f"train step: the cached executable {path} did not load ({type(e).__name__}: {e}); compiling it")
        return None
    return Entry(compiled, planned, saved["table_budget"], time.perf_counter() - t0, path)


def matches(entry: Entry, state: Any) -> bool:
    """Whether the executable's state argument has the state's structure, shapes, dtypes and shardings."""
    try:
        (args, _), (shardings, _) = entry.compiled.args_info, entry.compiled.input_shardings
        want, have = jax.tree.leaves(args[0]), jax.tree.leaves(state)
        return (
            jax.tree.structure(args[0]) == jax.tree.structure(state)
            and len(want) == len(have) == len(jax.tree.leaves(shardings[0]))
            and all(
                w.shape == h.shape and w.dtype == h.dtype and s.is_equivalent_to(h.sharding, len(h.shape))
                for w, h, s in zip(want, have, jax.tree.leaves(shardings[0]), strict=True)
            )
        )
    except (ValueError, TypeError, AttributeError, NotImplementedError):
        return False


def save(
    folder: Path | None,
    key: str,
    compiled: jax.stages.Compiled,
    planned: memory.StepMemory,
    table_budget: int | None,
    say: Any = print,
) -> bool:
    """Writes the step's entry (atomically: a reader sees the whole file or none). Returns whether it did: an
    executable that cannot be serialized, or a disk that refuses the write (said in one line), leaves
    training as it was."""
    if folder is None:
        return False
    try:
        executable, in_tree, out_tree = serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError, TypeError):
        return False
    # the devices it runs on, in its device assignment's order (jax loads it on every device otherwise)
    sharding = jax.tree.leaves(compiled.input_shardings)[0]
    payload = {
        "devices": [d.id for d in sharding._device_assignment],  # noqa: SLF001 (no public accessor)
        "executable": executable,
        "in_tree": in_tree,
        "out_tree": out_tree,
        "planned": dataclasses.asdict(planned),
        "table_budget": table_budget,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files.write_bytes(folder / f"{key}.pkl", pickle.dumps(payload))
    except (OSError, files.WriteFailed) as e:
        say(f"train step: not kept in {folder} ({e})")
        return False
    return True
