"""Basic layers that carry logical axis names and take their dtypes from the precision policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, ArrayLike, Float

from gem_jax.model.fp8 import FP8Matmul
from gem_jax.model.fp8_silu import dense_silu_split, split_widths
from gem_jax.parallel import param
from gem_jax.precision import FP8Decision, PrecisionPolicy
from pallas_kernels.layer_norm import layer_norm


class Dense(nnx.Module):
    """y = x @ W + b with W stored in the policy's param dtype and the GEMM in the layer's dtype.

    Our own module rather than `nnx.Linear` so that the layer's name selects its precision and FP8
    recipe from the policy, and its weights carry logical axis names. Where the policy says FP8,
    the GEMM is `self.fp8` (e4m3/e5m2 with per-tensor scales, f32 accumulation) and the output is
    still cast to the compute dtype. `self.fp8_decision` keeps what the policy decided for the layer
    (None: `precision.fp8_layers` does not name it, or FP8 is off).
    """

    def __init__(
        self,
        name: str,
        d_in: int,
        d_out: int,
        policy: PrecisionPolicy,
        *,
        rngs: nnx.Rngs,
        axes: tuple[str, str] = ("embed", "mlp"),
        sensitive: bool = False,
        use_bias: bool = True,
    ):
        self.name = name
        self.compute_dtype = policy.compute_dtype(name, sensitive=sensitive)
        self.kernel = param(rngs, nnx.initializers.lecun_normal(), (d_in, d_out), axes, policy.param_dtype)
        self.bias = (
            param(rngs, nnx.initializers.zeros, (d_out,), (axes[1],), policy.param_dtype)
            if use_bias
            else None
        )
        self.fp8_decision = policy.fp8_decision(name, d_in, d_out, sensitive=sensitive)
        recipe = None if self.fp8_decision is None else self.fp8_decision.recipe
        self.fp8 = FP8Matmul(recipe) if recipe is not None else None

    def __call__(self, x: Float[ArrayLike, "... din"]) -> Float[ArrayLike, "... dout"]:
        if self.fp8 is not None:
            y = self.fp8(x.reshape(-1, x.shape[-1]), self.kernel[...], self.compute_dtype)
            y = y.reshape(*x.shape[:-1], -1)
        else:
            # The GEMM's result in the compute dtype (accumulated in float32 by the hardware/XLA): its
            # cotangent then arrives in the compute dtype too, so both backward GEMMs run in bf16.
            # A float32 result (preferred_element_type) made them float32/TF32 GEMMs on the H200.
            y = jnp.dot(x.astype(self.compute_dtype), self.kernel[...].astype(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(self.compute_dtype)

    def silu_split(
        self,
        x: Float[ArrayLike, "*rows din"],
        widths: tuple[int, ...],
        *,
        implementation: str | None = None,
        interpret: bool = False,
    ) -> tuple[Float[Array, "*rows _"], ...]:
        """split(SiLU(self(x)), widths) along the last axis. With `precision.fp8_gemms = "backward"` and the
        delayed recipe, the backward GEMMs run in FP8 with the gradient quantised inside SiLU's backward
        kernel (gem_jax/model/fp8_silu.py; `implementation` and `interpret` pick that kernel)."""
        recipe = None if self.fp8 is None else self.fp8.recipe
        if recipe is None or recipe.gemms != "backward" or recipe.kind != "delayed" or x.ndim != 2:
            return split_widths(jax.nn.silu(self(x)), widths)
        f = self.fp8
        return dense_silu_split(
            x,
            self.kernel[...],
            None if self.bias is None else self.bias[...],
            (f.x_scale.get_value(), f.w_scale.get_value(), f.g_scale.get_value()),
            f.amax_probe[...],
            widths,
            compute_dtype=self.compute_dtype,
            implementation=implementation,
            interpret=interpret,
        )


def fp8_decisions(model: nnx.Module) -> list[FP8Decision]:
    """What the policy decided for each of `model`'s Dense layers that `precision.fp8_layers` names, in
    graph order (an abstract model from nnx.eval_shape will do): the FP8 layers are those with a recipe."""
    return [
        node.fp8_decision
        for _, node in nnx.iter_graph(model)
        if isinstance(node, Dense) and node.fp8_decision is not None
    ]


class LayerNorm(nnx.Module):
    """LayerNorm with float32 statistics (a "sensitive" op in any precision policy).

    `implementation` (a pallas_kernels name; None: the op's default order for the platform) runs it as the
    fused layer-norm kernel of pallas_kernels.layer_norm (in Pallas's interpreter with `interpret`), which can
    also multiply by a gate and pass its input through for a residual (`with_input`) in the same pass;
    "reference" is plain jnp, which XLA fuses as it can.
    """

    def __init__(
        self,
        dim: int,
        policy: PrecisionPolicy,
        *,
        rngs: nnx.Rngs,
        use_scale: bool = True,
        implementation: str | None = "reference",
        interpret: bool = False,
    ):
        self.scale = (
            param(rngs, nnx.initializers.ones, (dim,), ("embed",), policy.param_dtype) if use_scale else None
        )
        self.bias = param(rngs, nnx.initializers.zeros, (dim,), ("embed",), policy.param_dtype)
        self.implementation = implementation
        self.interpret = interpret

    def __call__(
        self,
        x: Float[ArrayLike, "... d"],
        gate: Float[ArrayLike, "... d"] | None = None,
        *,
        with_input: bool = False,
        out_dtype=None,
    ):
        """LN(x) (times `gate`) in `out_dtype` (default x's); (x, LN(x)) with `with_input`: use that x as the
        residual stream."""
        return layer_norm(
            x,
            None if self.scale is None else self.scale[...],
            self.bias[...],
            gate,
            with_input=with_input,
            out_dtype=out_dtype,
            implementation=self.implementation,
            interpret=self.interpret,
        )


def dropout(x: Array, rate: float, rng: jax.Array | None) -> Array:
    """Inverted dropout; identity when `rng` is None (evaluation) or rate is 0."""
    if rng is None or rate <= 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
