#!/usr/bin/env bash
# Session 11 call 3 (issue 27): quality with the fused layer-norm kernels: gem_h200 300 steps, seeds 0 1 2,
# bf16 with the kernels (the default, "bf16") against the norms in plain jnp ("refnorm"), three at a time.
RECIPES="bf16 refnorm" SEEDS="0 1 2" PARALLEL=3 LIMIT=500 bash scripts/device/fp8_quality.sh
