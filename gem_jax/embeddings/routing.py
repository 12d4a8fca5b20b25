"""How ids, pooled rows and row gradients move between devices: the code that runs inside
`jax.shard_map`, on one device's local block of a table and its local ids.

Row-sharded tables (`row_wise`, `table_wise` stacks, `two_d`, and `data_parallel` as the case of
zero row axes): a table's rows are split into contiguous blocks over `row_axes`; device i owns
global rows [i * R, (i + 1) * R).

  forward   ids -> owners: one `all_to_all` of [G, S] ids and [G, S] bag ids (S: the local id
            capacity; slot d holds the ids owned by device d, padded with a sentinel)
            owner: gather its rows, pool them per (source, bag): [G, N, D] partial bags
            partial bags -> sources: one `all_to_all` of [G, N, D]; the source sums the G parts
  backward  pooled-bag gradients -> owners: `all_gather` of [N, D] over the row axes
            owner: each received id's gradient is its bag's; duplicates (from any source) are
            summed after one sort of the [G * S] received ids
            replicas (`replica_axes`: two_d's slow axes, every axis for data_parallel): an
            `all_gather` of the combined (row, gradient) pairs, combined again, so every copy
            applies the identical update

Fixed-capacity `all_to_all` rather than `jax.lax.ragged_all_to_all`: XLA:CPU (jax 0.10.2) cannot
run ragged-all-to-all ("UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
ThunkEmitter"), so CI could not test it. Capacity S per destination is the worst case (every local
id owned by one device), so no id is ever dropped; the price is G x the id bytes on the wire, and
[G, N, D] partial bags instead of [N, D]. Owner-side pooling keeps that to bags, not ids.

Column-wise tables: every device holds every row's slice of D / G columns.

  forward   `all_gather` of the [S] ids and bag ids -> [G, S]; each device pools its columns of
            every source's bags -> [G, N, D/G]; `all_to_all` -> each source gets [G, N, D/G], i.e.
            all column slices of its own bags
  backward  `all_to_all` of the [N, D] bag gradients split by columns; each device combines the
            (identical, since every device sorts the same gathered ids) duplicates for its columns;
            row-wise Adagrad's mean of g^2 over the whole row is a `psum` of [G * S] partial sums

No collective carries a table-sized operand: every size above is a multiple of the batch's id or bag
count, never of the table's rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class Routed(NamedTuple):
    """What the backward needs from a lookup (int32, batch-sized): the ids and bags a device
    served as owner, `[G, S]`, with local row indices (== rows_per_shard: nothing)."""

    rows: Int[Array, "Gr S"]
    bags: Int[Array, "Gr S"]


def axis_size(axes: tuple[str, ...]) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes) if axes else 1


def _sorted_segments(keys: Int[Array, " U"], fill: int):
    """One sort of `keys`: (unique keys padded with `fill`, segment of each sorted position, order)."""
    k = keys.shape[0]
    sorted_keys, order = jax.lax.sort((keys, jnp.arange(k, dtype=jnp.int32)), num_keys=1)
    new = jnp.concatenate([jnp.ones((1,), bool), sorted_keys[1:] != sorted_keys[:-1]])
    segment = jnp.cumsum(new.astype(jnp.int32)) - 1
    unique = jnp.full((k,), fill, keys.dtype).at[segment].set(sorted_keys)
    return unique, segment, order


def combine_duplicates(
    keys: Int[Array, " U"], values: Float[Array, "U E"], fill: int
) -> tuple[Int[Array, " U"], Float[Array, "U E"]]:
    """Sums `values` of equal `keys`: returns (unique keys padded with `fill`, their sums).

    `fill` must exceed every real key (padding keys equal it); one sort, one gather, one sorted
    segment_sum. Every device given the same inputs gets the same order.
    """
    unique, segment, order = _sorted_segments(keys, fill)
    sums = jax.ops.segment_sum(values[order], segment, num_segments=keys.shape[0], indices_are_sorted=True)
    return unique, sums


def _combine_routed(
    routed: Routed, per_source: Float[Array, "Gr N E"], block: int
) -> tuple[Int[Array, " U"], Float[Array, "U E"]]:
    """`combine_duplicates` of the routed ids, each id's gradient being its (source, bag)'s: read
    straight in sorted order (one [G S, D] gather, not two); padding ids get zeros."""
    keys = routed.rows.reshape(-1)
    unique, segment, order = _sorted_segments(keys, block)
    source = order // routed.rows.shape[1]
    grads = per_source[source, routed.bags.reshape(-1)[order]]
    grads = jnp.where((keys[order] < block)[:, None], grads, 0.0)
    return unique, jax.ops.segment_sum(grads, segment, num_segments=keys.shape[0], indices_are_sorted=True)


def _my_index(axes: tuple[str, ...]) -> Array:
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)


def row_sharded_lookup(
    table: Float[Array, "V E"],
    rows: Int[Array, " S"],
    bags: Int[Array, " S"],
    num_bags: int,
    row_axes: tuple[str, ...],
    sorted_bags: bool = False,
    spans: tuple[Int[Array, " N"], Int[Array, " N"]] | None = None,
    max_bag: int = 0,
) -> tuple[Float[Array, "N E"], Routed]:
    """Pooled sums of rows per bag. `rows` are global row ids (>= G * R: padding, pooled as zeros),
    `bags` in [0, num_bags); `table` is this device's block of R rows. With `spans` (each bag's
    [start, end) positions) and `max_bag` > 0, a device that owns every row pools by `_pool_bounded`."""
    block = table.shape[0]
    g = axis_size(row_axes)
    if g == 1:
        local = jnp.where(rows < block, rows, block)

        def scatter_add():
            gathered = jnp.take(table, rows, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
            return jax.ops.segment_sum(gathered, bags, num_segments=num_bags, indices_are_sorted=sorted_bags)

        if spans is None or max_bag <= 0:
            return scatter_add(), Routed(local[None], bags[None])
        starts, ends = spans
        # Exact either way: a bag longer than max_bag takes the scatter-add path for the whole call.
        pooled = jax.lax.cond(
            jnp.any(ends - starts > max_bag),
            scatter_add,
            lambda: _pool_bounded(table, local, starts, ends, max_bag),
        )
        return pooled, Routed(local[None], bags[None])
    s = rows.shape[0]
    owner = jnp.where(rows < g * block, rows // block, g)  # g: padding, dropped below
    onehot = owner[:, None] == jnp.arange(g)[None, :]
    slot = jnp.take_along_axis(
        jnp.cumsum(onehot, axis=0, dtype=jnp.int32), jnp.minimum(owner, g - 1)[:, None], 1
    )
    slot = slot[:, 0] - 1
    sentinel = g * block
    send_rows = jnp.full((g, s), sentinel, jnp.int32).at[owner, slot].set(rows, mode="drop")
    send_bags = jnp.zeros((g, s), jnp.int32).at[owner, slot].set(bags, mode="drop")
    recv_rows = jax.lax.all_to_all(send_rows, row_axes, 0, 0, tiled=True)
    recv_bags = jax.lax.all_to_all(send_bags, row_axes, 0, 0, tiled=True)
    local = jnp.where(recv_rows < sentinel, recv_rows - _my_index(row_axes) * block, block)
    routed = Routed(local, recv_bags)
    back = jax.lax.all_to_all(_pool_per_source(table, routed, num_bags), row_axes, 0, 0, tiled=True)
    return back.sum(0), routed


def _pool_bounded(
    table: Float[Array, "V E"],
    rows: Int[Array, " S"],
    starts: Int[Array, " N"],
    ends: Int[Array, " N"],
    max_bag: int,
) -> Float[Array, "N E"]:
    """Bags of at most `max_bag` ids as a [N, max_bag, D] gather under a masked sum: XLA fuses the
    gather into the reduction (no [S, D] intermediate, no scatter-add atomics); the padding slots
    read row 0, which stays in cache. `rows` >= R look up zeros."""
    index = starts[:, None] + jnp.arange(max_bag, dtype=starts.dtype)[None, :]
    valid = index < ends[:, None]
    r = rows[jnp.minimum(index, rows.shape[0] - 1)]
    valid = valid & (r < table.shape[0])
    x = jnp.take(table, jnp.where(valid, r, 0), axis=0).astype(jnp.float32)
    return jnp.sum(jnp.where(valid[..., None], x, 0.0), axis=1)


def _pool_per_source(table: Float[Array, "V E"], routed: Routed, num_bags: int) -> Float[Array, "Gr N E"]:
    """The owner's side of a lookup: its rows of every source's bags, pooled per (source, bag)."""
    g, block = routed.rows.shape[0], table.shape[0]
    gathered = jnp.take(table, routed.rows, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    segment = jnp.where(routed.rows < block, jnp.arange(g)[:, None] * num_bags + routed.bags, g * num_bags)
    partial = jax.ops.segment_sum(
        gathered.reshape(-1, table.shape[1]), segment.reshape(-1), num_segments=g * num_bags
    )
    return partial.reshape(g, num_bags, -1)


def row_sharded_gradients(
    routed: Routed,
    bag_grads: Float[Array, "N E"],
    block: int,
    row_axes: tuple[str, ...],
    replica_axes: tuple[str, ...],
) -> tuple[Int[Array, " U"], Float[Array, "U E"]]:
    """(local rows, summed gradient) of every row this device owns that any device's batch
    touched; padding rows are == block. Replicas get identical results."""
    g = routed.rows.shape[0]
    if g > 1:
        per_source = jax.lax.all_gather(bag_grads, row_axes, axis=0, tiled=False)  # [G, N, D]
    else:
        per_source = bag_grads[None]
    keys, sums = _combine_routed(routed, per_source, block)
    if replica_axes:
        keys = jax.lax.all_gather(keys, replica_axes, axis=0, tiled=True)
        sums = jax.lax.all_gather(sums, replica_axes, axis=0, tiled=True)
        keys, sums = combine_duplicates(keys, sums, block)
    return keys, sums


def column_sharded_lookup(
    table: Float[Array, "V El"],
    rows: Int[Array, " S"],
    bags: Int[Array, " S"],
    num_bags: int,
    column_axes: tuple[str, ...],
) -> tuple[Float[Array, "N E"], Routed]:
    """Pooled sums per bag from a table whose columns are split over `column_axes`."""
    all_rows = jax.lax.all_gather(rows, column_axes, axis=0, tiled=False)  # [G, S]
    all_bags = jax.lax.all_gather(bags, column_axes, axis=0, tiled=False)
    block = table.shape[0]
    routed = Routed(jnp.where(all_rows < block, all_rows, block), all_bags)
    partial = _pool_per_source(table, routed, num_bags)  # [G(source), N, Dl]: my columns
    back = jax.lax.all_to_all(partial, column_axes, 0, 0, tiled=True)  # [G(column owner), N, Dl]
    return back.transpose(1, 0, 2).reshape(num_bags, -1), routed


def column_sharded_gradients(
    routed: Routed, bag_grads: Float[Array, "N E"], block: int, column_axes: tuple[str, ...]
) -> tuple[Int[Array, " U"], Float[Array, "U El"], Float[Array, " U"]]:
    """(rows, this device's columns of their summed gradients, mean over the whole row of g^2)."""
    g, n = routed.rows.shape[0], bag_grads.shape[0]
    dim = bag_grads.shape[-1]
    by_owner = bag_grads.reshape(n, g, dim // g).transpose(1, 0, 2)  # [G(column owner), N, Dl]
    per_source = jax.lax.all_to_all(by_owner, column_axes, 0, 0, tiled=True)  # [G(source), N, Dl]
    keys, sums = _combine_routed(routed, per_source, block)
    sq_mean = jax.lax.psum(jnp.sum(sums * sums, -1), column_axes) / dim
    return keys, sums, sq_mean
