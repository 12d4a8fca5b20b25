"""JAX's persistent compilation cache, and the train step's compile timed at start-up.

Every program a run compiles (the state's init, the train step, evaluation) is written to a cache folder,
so a second run of the same config on the same machine loads it instead of compiling it again. The
folder is `train.compilation_cache`:

- `"auto"` (the default): `$JAX_COMPILATION_CACHE_DIR` when it is set, else `$XDG_CACHE_HOME/gem-jax/xla`
  (`~/.cache/gem-jax/xla` without XDG_CACHE_HOME);
- `"off"`: no persistent cache;
- any other value: that folder (created on first use).

An entry is keyed by the program, the jax and jaxlib versions, the devices and the XLA flags, so a changed
config, kernel or jax version compiles afresh; programs that compile in under a second are not written
(jax's `jax_persistent_cache_min_compile_time_secs`). On GPUs jax also keeps XLA's autotuning results
there. The cache is trusted input: do not point it at a folder others may write to. It grows without
bound; delete the folder to empty it.

`compile_timed` compiles a lowered program and says whether the executable came from the cache (jax's
monitoring events), for the loop's start-up line.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

HIT = "/jax/compilation_cache/cache_hits"
WRITTEN = "/jax/compilation_cache/cache_misses"  # jax records it as it writes a new entry
SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gem-jax" / "xla"


def resolve(setting: str) -> Path | None:
    """The folder `train.compilation_cache` names (None: off)."""
    if setting == "off":
        return None
    if setting == "auto":  # the environment's, else a folder this process set, else ours
        current = os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
        return Path(current) if current else default_dir()
    return Path(setting).expanduser()


def configure(setting: str) -> Path | None:
    """Points jax's persistent cache at the folder `setting` names (see the module docstring); returns it."""
    folder = resolve(setting)
    enabled = folder is not None
    current = jax.config.jax_compilation_cache_dir
    if enabled == jax.config.jax_enable_compilation_cache and (
        not enabled or (current and Path(current) == folder)
    ):
        return folder
    jax.config.update("jax_enable_compilation_cache", enabled)
    if enabled:
        compilation_cache.set_cache_dir(str(folder))
    compilation_cache.reset_cache()  # jax reads the folder once per process: start over with this one
    return folder


class _Events:
    """Counts jax's compilation-cache events per thread while `recording` (listeners cannot be removed,
    so one is registered for the process and records only inside `recording`)."""

    def __init__(self):
        self.local = threading.local()
        self.registered = False
        self.lock = threading.Lock()

    def _counts(self) -> dict[str, float] | None:
        return getattr(self.local, "counts", None)

    def event(self, name: str, **_kwargs) -> None:
        counts = self._counts()
        if counts is not None:
            counts[name] = counts.get(name, 0.0) + 1.0

    def duration(self, name: str, seconds: float, **_kwargs) -> None:
        counts = self._counts()
        if counts is not None:
            counts[name] = counts.get(name, 0.0) + seconds

    def register(self) -> None:
        with self.lock:
            if not self.registered:
                jax.monitoring.register_event_listener(self.event)
                jax.monitoring.register_event_duration_secs_listener(self.duration)
                self.registered = True


EVENTS = _Events()


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """How a program was compiled: seconds to compile (or load), whether the cache held it, where the cache is."""

    seconds: float
    from_cache: bool
    written: bool
    saved_s: float  # the compile time the cache saved (jax's figure: the original compile less the load)
    folder: Path | None
    untraced: Path | None = None  # the executable file found by its inputs (step_cache.py): nothing traced

    def line(self, what: str, lowered_s: float) -> str:
        """e.g. "train step: loaded from the compilation cache in 0.3 s (...)"."""
        traced = f"traced and lowered in {lowered_s:.1f} s"
        if self.untraced is not None:
            return (
                f"{what}: loaded from the compilation cache in {self.seconds:.1f} s (found by its inputs, "
                f"not traced or lowered: {self.untraced})"
            )
        if self.from_cache:
            return (
                f"{what}: loaded from the compilation cache in {self.seconds:.1f} s ({traced}; compiling "
                f"took {self.seconds + self.saved_s:.1f} s when it was written; {self.folder})"
            )
        if self.folder is None:
            where = "the compilation cache is off (train.compilation_cache)"
        elif self.written:
            where = f"written to the compilation cache {self.folder}"
        else:
            where = f"not written to the compilation cache {self.folder}"
        return f"{what}: compiled in {self.seconds:.1f} s ({traced}); {where}"


def compile_timed(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, CompileReport]:
    """`lowered.compile()`, timed, with whether the persistent cache supplied the executable."""
    EVENTS.register()
    EVENTS.local.counts = {}
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    finally:
        counts, EVENTS.local.counts = EVENTS.local.counts, None
    seconds = time.perf_counter() - t0
    enabled = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    folder = Path(jax.config.jax_compilation_cache_dir) if enabled else None
    report = CompileReport(
        seconds=seconds,
        from_cache=counts.get(HIT, 0) > 0,
        written=counts.get(WRITTEN, 0) > 0,
        saved_s=float(counts.get(SAVED, 0.0)),
        folder=folder,
    )
    return compiled, report
