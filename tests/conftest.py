"""Test setup, before jax or the project is imported: 8 fake CPU devices for sharding tests, and
runtime shape checking of every jaxtyping annotation (gem_jax/typing.py; inherited by the CLI
subprocesses the tests start)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("GEM_JAX_TYPECHECK", "1")

import gem_jax  # noqa: E402,F401  (installs the shape-checking import hook before any project module loads)
