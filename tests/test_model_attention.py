"""`model.attention_bias_rows_gib` reaches the GPU kernels (interpret mode) from the HSTU tower."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.model.hstu import HSTUTower
from gem_jax.precision import PrecisionPolicy
from tests.helpers import first_pack, small_config, stacks


def _bias_arrays(jaxpr, heads: int, rows: int) -> int:
    """Equations (in nested jaxprs too: jit, custom_vjp) whose output is an [H, T, W] array: bias_rows."""
    found = 0
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            shape = getattr(out.aval, "shape", ())
            found += len(shape) == 3 and shape[:2] == (heads, rows) and shape[2] % 128 == 0
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                found += _bias_arrays(inner, heads, rows)
    return found


@pytest.mark.parametrize("gib, expect_array", [("8.0", True), ("0", False)])
def test_bias_rows_setting_reaches_the_kernels(gib, expect_array):
    c = small_config(
        "model.attention_implementation=triton",
        "model.interpret_kernels=true",
        "model.num_position_buckets=16",
        "model.num_time_buckets=8",
        f"model.attention_bias_rows_gib={gib}",
    )
    pack = first_pack(next(stacks(c, 1)))
    offsets, nt, ts = (jnp.asarray(a) for a in (pack.offsets, pack.num_targets, pack.timestamps))
    policy = PrecisionPolicy.from_config(c.precision)
    tower = HSTUTower(c.model, policy, rngs=nnx.Rngs(0))
    t = pack.item_ids.shape[0]
    x = jax.random.normal(jax.random.key(1), (t, c.model.model_dim))
    x = jnp.where((jnp.arange(t) < offsets[-1])[:, None], x, 0)
    max_len = int(np.diff(np.asarray(pack.offsets)).max())

    jaxpr = jax.make_jaxpr(lambda x: tower(x, offsets, nt, ts, max_seq_len=max_len))(x).jaxpr
    assert (_bias_arrays(jaxpr, c.model.num_heads, t) > 0) == expect_array
    out = tower(x, offsets, nt, ts, max_seq_len=max_len)  # either way the same function
    c_ref = small_config(
        "model.attention_implementation=reference",
        "model.num_position_buckets=16",
        "model.num_time_buckets=8",
    )
    ref_tower = HSTUTower(c_ref.model, policy, rngs=nnx.Rngs(0))
    ref = ref_tower(x, offsets, nt, ts, max_seq_len=max_len)
    rows = int(offsets[-1])
    got, want = np.asarray(out[:rows], np.float32), np.asarray(ref[:rows], np.float32)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, f"tower output vs the reference attention's: rel. L2 {rel:.2e} (bf16 compute)"
