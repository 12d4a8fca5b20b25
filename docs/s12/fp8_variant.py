"""Session 12 experiment, not product code: `python docs/s12/fp8_variant.py VARIANT <experiments args>` runs
`python -m experiments <args>` with gem_jax.model.fp8.quantize replaced. VARIANT: "barrier" (as shipped),
"nobarrier_g" (the output gradient's quantisation without the optimization_barrier, so XLA may fuse it into
the op that produces the gradient), "nobarrier" (no barrier for any operand), "f32out" (the GEMMs' result in
f32, cast after).
Calls 2-4 ran on the tree with docs/s12/bf16_results.patch applied (FP8 GEMM results in the layer's dtype; the
experiment, reverted): `git apply docs/s12/bf16_results.patch` first to repeat them."""

import runpy
import sys

import jax
import jax.numpy as jnp

from gem_jax.model import fp8

_SHIPPED = fp8.quantize


def _variant(mode):
    def quantize(t, scale, dtype):
        if mode == "nobarrier" or (mode == "nobarrier_g" and dtype == fp8.E5M2):
            m = fp8.fp8_max(dtype)
            return jnp.clip(t.astype(jnp.float32) / scale, -m, m).astype(dtype)
        return _SHIPPED(t, scale, dtype)

    return quantize


def _f32_out_dot(a, b, contract, precision, out_dtype):
    dims = ((contract[:1], contract[1:]), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32).astype(
        out_dtype
    )


if __name__ == "__main__":  # grain's worker processes import this file again
    if sys.argv[1] == "f32out":
        fp8._dot = _f32_out_dot
    else:
        fp8.quantize = _variant(sys.argv[1])
    print(f"fp8 quantize variant: {sys.argv[1]} (jax {jax.__version__})", flush=True)
    sys.argv = ["experiments", *sys.argv[2:]]
    runpy.run_module("experiments", run_name="__main__", alter_sys=True)
