"""The single-device dense reference (the spec the sharded code is tested against).

Plain `jnp` gather + segment_sum per feature; the update takes the table's dense gradient by
autodiff and applies row-wise Adagrad (or SGD) to the rows the batch touched. Table-sized work on
purpose: it is the simple, obviously right formulation, never used for training.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array

from gem_jax.config import FeatureConfig, TableConfig
from gem_jax.embeddings.hashing import hash_ids, segment_ids


def _rows_and_bags(t: TableConfig, f: FeatureConfig, values, offsets):
    """One pack of one feature -> (rows, valid, bags, num_bags)."""
    s = values.shape[0]
    if f.pooling == "none":
        bags = jnp.arange(s)
        valid = jnp.ones((s,), bool) if offsets is None else bags < offsets[-1]
        n = s
    else:
        n = offsets.shape[0] - 1
        bags = segment_ids(offsets, s)
        valid = bags < n
    if t.hashed:
        rows = hash_ids(values, t.rows)
    else:
        valid = valid & (values >= 0) & (values < t.rows)
        rows = jnp.clip(values, 0, t.rows - 1)
    return rows, valid, bags, n


def _per_pack(t: TableConfig, f: FeatureConfig, values, offsets):
    """(rows, valid, bags, num_bags) of every pack: leading dims flattened into one pack axis."""
    flat_v = values.reshape(-1, values.shape[-1])
    if offsets is None:
        rows, valid, bags, n = jax.vmap(lambda v: _rows_and_bags(t, f, v, None)[:3] + (0,))(flat_v)
        return rows, valid, bags, values.shape[-1]
    flat_o = offsets.reshape(-1, offsets.shape[-1])
    rows, valid, bags, _ = jax.vmap(lambda v, o: _rows_and_bags(t, f, v, o)[:3] + (0,))(flat_v, flat_o)
    n = values.shape[-1] if f.pooling == "none" else offsets.shape[-1] - 1
    return rows, valid, bags, n


def lookup(
    tables: Mapping[str, Array],
    table_specs: Mapping[str, TableConfig],
    features: Mapping[str, FeatureConfig],
    batch: Mapping[str, tuple[Array, Array | None]],
) -> dict[str, Array]:
    """Activations of every feature in `batch` ((values, offsets) with any leading dims)."""
    out = {}
    for name, (values, offsets) in batch.items():
        f = features[name]
        t = table_specs[f.table]
        rows, valid, bags, n = _per_pack(t, f, values, offsets)
        x = jnp.where(valid[..., None], jnp.asarray(tables[f.table]).astype(jnp.float32)[rows], 0.0)
        pooled = jax.vmap(lambda x, b, n=n: jax.ops.segment_sum(x, b, num_segments=n))(x, bags)
        if f.pooling == "mean":
            lengths = jnp.diff(offsets.reshape(-1, offsets.shape[-1]), axis=-1)
            pooled = pooled / jnp.maximum(lengths, 1)[..., None].astype(pooled.dtype)
        out[name] = pooled.reshape(*values.shape[:-1], *pooled.shape[1:])
    return out


def touched_rows(table_specs, features, batch) -> dict[str, Array]:
    """Per table, a [rows] bool mask of the rows some valid id of the batch looks up."""
    masks = {name: jnp.zeros((t.rows,), bool) for name, t in table_specs.items()}
    for name, (values, offsets) in batch.items():
        f = features[name]
        rows, valid, _, _ = _per_pack(table_specs[f.table], f, values, offsets)
        masks[f.table] = masks[f.table].at[rows.reshape(-1)].max(valid.reshape(-1))
    return masks


def update(
    tables: Mapping[str, Array],
    accumulators: Mapping[str, Array] | None,
    table_specs: Mapping[str, TableConfig],
    features: Mapping[str, FeatureConfig],
    batch,
    activation_grads: Mapping[str, Array],
    learning_rate: float,
    *,
    optimizer: str = "row_wise_adagrad",
    eps: float = 1e-8,
):
    """Dense row-wise Adagrad / SGD on the touched rows, from the activations' gradients."""

    def pullback(tables32):
        acts = lookup(tables32, table_specs, features, batch)
        return sum(jnp.sum(acts[n] * activation_grads[n]) for n in acts)

    tables32 = {n: x.astype(jnp.float32) for n, x in tables.items()}
    grads = jax.grad(pullback)(tables32)
    touched = touched_rows(table_specs, features, batch)
    new_tables, new_accs = {}, {}
    for name, table in tables32.items():
        g, m = grads[name], touched[name][:, None]
        if optimizer == "row_wise_adagrad":
            acc = accumulators[name] + jnp.where(touched[name], jnp.mean(g * g, axis=1), 0.0)
            step = learning_rate * g / (jnp.sqrt(acc)[:, None] + eps)
            new_accs[name] = acc
        else:
            step = learning_rate * g
        new_tables[name] = jnp.where(m, table - step, table).astype(tables[name].dtype)
    return new_tables, (new_accs if optimizer == "row_wise_adagrad" else None)
