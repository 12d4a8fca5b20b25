"""Test setup, before jax or the project is imported: 8 fake CPU devices for sharding tests,
runtime shape checking of every jaxtyping annotation (gem_jax/typing.py), and one persistent XLA
compilation cache for the whole run (all inherited by the CLI subprocesses and the pytest-xdist
workers the run starts).

The cache is why the suite fits its time budget: many tests compile the same train steps (a resume
compiles its step again, the CLI tests and the in-process tests share configs), and on 2 cores the
compiles are most of the time. It lives in a fresh temporary folder per run, so nothing carries over
between runs; a cached executable is the very program a fresh compile would produce.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("GEM_JAX_TYPECHECK", "1")
# no executables found by their inputs (gem_jax/train/step_cache.py): tests patch the step at times, which
# its key cannot see; tests/test_step_cache.py turns it on where it is the subject
os.environ["GEM_JAX_STEP_CACHE"] = "0"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the run makes it; workers inherit
    _cache = tempfile.mkdtemp(prefix="gem_jax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import gem_jax  # noqa: E402,F401  (installs the shape-checking import hook before any project module loads)
