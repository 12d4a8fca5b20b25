"""gem-jax: a JAX/Flax trainer for GEM-style ads foundation models (see docs/architecture.md)."""

from gem_jax.typing import install_shape_checking, shape_checking_requested

if shape_checking_requested():  # GEM_JAX_TYPECHECK=1: check annotated shapes at runtime (the tests do)
    install_shape_checking()
