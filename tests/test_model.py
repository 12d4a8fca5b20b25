"""The model on real packs: shapes, padding isolation, target invariance, per-layer precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.embeddings import HashedEmbedding, hash_ids, segment_ids
from gem_jax.model.gem import GEMModel
from gem_jax.precision import PrecisionPolicy
from tests.helpers import dense_embeddings, first_pack, small_config, stacks


def _model_and_pack(*overrides):
    """The config, the model as a function of the pack (embeddings from dense stand-in tables), a pack."""
    c = small_config(*overrides)
    model = GEMModel(c, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda model, pack, embedded: model(pack, embedded))  # compiled: eagerly it took ~30 s
    return c, (lambda pack: call(model, pack, dense_embeddings(c, pack))), first_pack(next(stacks(c, 1)))


def test_logits_shape_and_finite():
    c, model, pack = _model_and_pack()
    logits = model(pack)
    assert logits.shape == (c.data.examples_per_shard, c.data.num_candidates, len(c.model.tasks))
    assert np.isfinite(np.asarray(logits)).all()


def test_padding_does_not_change_real_examples():
    """Garbage in the unused token tail must not leak into real examples' logits."""
    _, model, pack = _model_and_pack()
    base = np.asarray(model(pack))
    end = int(pack.offsets[-1])
    noisy = pack.replace(
        item_ids=pack.item_ids.at[end:].set(777)
        if hasattr(pack.item_ids, "at")
        else np.where(np.arange(pack.item_ids.shape[0]) >= end, 777, pack.item_ids)
    )
    out = np.asarray(model(noisy))
    valid = np.asarray(pack.num_targets) > 0
    np.testing.assert_allclose(out[valid], base[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_candidates_do_not_see_each_other():
    """Target invariance: changing one candidate must not change another candidate's score."""
    c, model, pack = _model_and_pack("data.num_candidates=3", "data.tokens_per_shard=320")
    base = np.asarray(model(pack))
    b = int(np.argmax(np.asarray(pack.num_targets) > 0))
    last = int(pack.offsets[b + 1]) - 1  # the last candidate of example b
    changed = pack.replace(item_ids=np.asarray(pack.item_ids).copy())
    changed.item_ids[last] = 424242
    out = np.asarray(model(changed))
    np.testing.assert_allclose(out[b, :2], base[b, :2], rtol=1e-5, atol=1e-6)
    assert not np.allclose(out[b, 2], base[b, 2])


def test_precision_policy_per_layer():
    c = small_config("precision.compute_dtype=bfloat16", "precision.overrides={'hstu/1'='float32'}")
    policy = PrecisionPolicy.from_config(c.precision)
    assert policy.compute_dtype("hstu/0/uvqk") == jnp.bfloat16
    assert policy.compute_dtype("hstu/1/uvqk") == jnp.float32
    assert policy.compute_dtype("head/click/out", sensitive=True) == jnp.float32
    model = GEMModel(c, rngs=nnx.Rngs(0))
    assert model.tower.layers[0].uvqk.compute_dtype == jnp.bfloat16
    assert model.tower.layers[1].uvqk.compute_dtype == jnp.float32
    assert model.heads[0].out.compute_dtype == jnp.float32


def test_pooled_bags_and_hashing():
    policy = PrecisionPolicy.from_config(small_config().precision)
    emb = HashedEmbedding(64, 4, policy, rngs=nnx.Rngs(0))
    values = jnp.array([5, 7, 9, 0, 0], jnp.int32)
    offsets = jnp.array([0, 2, 2, 3], jnp.int32)  # bags: [5, 7], [], [9]; two spare slots
    bags = segment_ids(offsets, values.shape[0])
    np.testing.assert_array_equal(bags, [0, 0, 2, 3, 3])
    pooled = emb.pooled(values, bags, jnp.diff(offsets), mode="mean")
    table = emb.table[...]
    rows = hash_ids(values, 64)
    np.testing.assert_allclose(pooled[0], (table[rows[0]] + table[rows[1]]) / 2, rtol=1e-6)
    np.testing.assert_allclose(pooled[1], 0)
    np.testing.assert_allclose(pooled[2], table[rows[2]], rtol=1e-6)
    assert (hash_ids(jnp.arange(1000), 64) < 64).all() and (hash_ids(jnp.arange(1000), 64) >= 0).all()


def test_attention_function_is_the_kernel_package():
    """The model's one attention entry point forwards to pallas_kernels.jagged_attention."""
    from gem_jax.model import attention as attn_module
    from pallas_kernels.jagged_attention import jagged_attention

    assert attn_module.jagged_attention is jagged_attention
    key = jax.random.key(0)
    q, k, v = (jax.random.normal(kk, (10, 2, 4)) for kk in jax.random.split(key, 3))
    offsets = jnp.array([0, 4, 9], jnp.int32)
    out = attn_module.attention(
        q, k, v, offsets, spec=attn_module.AttentionSpec(activation="silu"), max_seq_len=8
    )
    ref = jagged_attention(q, k, v, offsets, max_seq_len=8, implementation="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-6)


@pytest.mark.slow  # ~25 s: the model's forward and backward op by op, twice
def test_a_bf16_residual_stream_keeps_its_dtype_between_layers(monkeypatch):
    """precision.residual_dtype = "bfloat16": every HSTU layer takes and returns the stream in bf16, the tower's
    output stays float32, and the logits and gradients are float32's within bf16's rounding of the stream."""
    from gem_jax.model.hstu import HSTULayer
    from tests.helpers import model_logits_and_grads

    seen = []
    call = HSTULayer.__call__

    def recording(self, x, *args, **kwargs):
        y = call(self, x, *args, **kwargs)
        seen.append((x.dtype, y.dtype))
        return y

    monkeypatch.setattr(HSTULayer, "__call__", recording)
    _, ref_logits, ref_grads = model_logits_and_grads(small_config())
    assert seen and all(d == (jnp.float32, jnp.float32) for d in seen)
    seen.clear()
    _, logits, grads = model_logits_and_grads(small_config("precision.residual_dtype=bfloat16"))
    assert seen and all(d == (jnp.bfloat16, jnp.bfloat16) for d in seen)
    assert logits.dtype == jnp.float32
    err = float(jnp.linalg.norm(logits - ref_logits) / jnp.linalg.norm(ref_logits))
    assert 0 < err < 0.02, err  # different (the stream is rounded), and close
    for (path, a), (_, b) in zip(nnx.to_flat_state(ref_grads), nnx.to_flat_state(grads)):
        a, b = np.asarray(a.get_value(), np.float32), np.asarray(b.get_value(), np.float32)
        assert np.all(np.isfinite(b)), path
        assert np.linalg.norm(b - a) <= 0.1 * np.linalg.norm(a) + 1e-6, path
