"""Sparse optimizers: update only the rows a batch touched, after combining duplicate ids.

Written here rather than taken from optax: optax transforms dense pytrees (a table-sized gradient
and a pass over every row), which is exactly what a sparse table must avoid.

Both work on a device's local block of a table: `rows` are local row indices of the touched rows
(each at most once; entries >= the block's row count are padding and change nothing), `grads` the
summed gradient of each, and `grad_sq_mean` the mean over the WHOLE row of grad^2 (for
column-sharded tables the caller sums the squares over the column shards first).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad:
    """FBGEMM's exact row-wise Adagrad: acc += mean_j g_j^2; row -= lr * g / (sqrt(acc) + eps).

    One fp32 accumulator per row (state O(rows)); rows stored in bf16 are updated in fp32 and
    rounded to nearest (FBGEMM rounds stochastically).
    """

    eps: float = 1e-8
    initial_accumulator: float = 0.0

    has_accumulator = True

    def init_accumulator(self, rows: int) -> Float[Array, " V"]:
        return jnp.full((rows,), self.initial_accumulator, jnp.float32)

    def update(
        self,
        table: Float[Array, "V E"],
        accumulator: Float[Array, " V"] | None,
        rows: Int[Array, " U"],
        grads: Float[Array, "U E"],
        grad_sq_mean: Float[Array, " U"],
        learning_rate: Float[Array, ""] | float,
    ) -> tuple[Array, Array | None]:
        acc = accumulator.at[rows].get(mode="fill", fill_value=0.0) + grad_sq_mean
        current = table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
        new = current - learning_rate * grads / (jnp.sqrt(acc)[:, None] + self.eps)
        table = table.at[rows].set(new.astype(table.dtype), mode="drop", unique_indices=True)
        accumulator = accumulator.at[rows].set(acc, mode="drop", unique_indices=True)
        return table, accumulator


@dataclasses.dataclass(frozen=True)
class SparseSGD:
    """row -= lr * g on the touched rows; no state."""

    has_accumulator = False

    def init_accumulator(self, rows: int) -> None:
        return None

    def update(self, table, accumulator, rows, grads, grad_sq_mean, learning_rate):
        current = table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
        new = current - learning_rate * grads
        return table.at[rows].set(new.astype(table.dtype), mode="drop", unique_indices=True), accumulator


SparseOptimizer = RowWiseAdagrad | SparseSGD


def from_config(name: str, eps: float = 1e-8, initial_accumulator: float = 0.0) -> SparseOptimizer:
    """`embeddings.optimizer` -> the optimizer."""
    if name == "row_wise_adagrad":
        return RowWiseAdagrad(eps=eps, initial_accumulator=initial_accumulator)
    if name == "sgd":
        return SparseSGD()
    raise ValueError(f"unknown sparse optimizer {name!r}: expected 'row_wise_adagrad' or 'sgd'")
