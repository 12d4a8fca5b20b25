"""`python -m experiments.baselines.logreg --data DIR`: logistic regression on ranking records, a baseline.

The same features the GEM model reads, as one-hot (sparse) inputs: the candidate item, every sparse
feature's ids (one weight per feature and id), the dense features, and the history as two bags of items
(all earlier items, and those with a "high" action, e.g. a rating >= 4), each scaled by 1/sqrt(length), so
the model can learn "users who rated X like Y" (`--no-history` leaves the bags out). Trained with Adam on
minibatches (`--seed` shuffles them), L2-regularised, the epoch with the best validation AUC scored on
test. Reads the split shard sets DIR/train, DIR/valid, DIR/test (as `data convert` writes them for
MovieLens); prints one JSON line with valid and test AUC and NE per task.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gem_jax.data.records import codec
from gem_jax.data.records.reader import ShardSource
from gem_jax.data.records.schema import ShardSet
from gem_jax.train.metrics import auc, normalized_entropy


def load_split(directory: Path, history: bool, high_action: int, max_history: int):
    """(feature index rows as CSR: offsets, indices, values; labels [N, K]; field sizes) of one split."""
    shard_set = ShardSet.open(str(directory))
    schema = shard_set.schema
    source = ShardSource(shard_set)
    item_vocab = schema.item_vocab or 1
    fields = [("candidate", item_vocab)]
    fields += [(f.name, f.vocab or 1) for f in schema.sparse_features]
    if history:
        fields += [("history", item_vocab), ("history_high", item_vocab)]
    base = np.cumsum([0] + [size for _, size in fields])
    dense_base = int(base[-1])
    indices, values, offsets, labels = [], [], [0], []
    for i in range(len(source)):
        r = codec.decode(source[i][1], schema)
        idx = [base[0] + int(r.candidates[0])]
        val = [1.0]
        for j, bag in enumerate(r.sparse):
            idx += (base[1 + j] + bag).tolist()
            val += [1.0] * len(bag)
        if history:
            items, actions = r.history_items[-max_history:], r.history_actions[-max_history:]
            high = items[actions >= high_action]
            for k, bag in ((len(fields) - 2, items), (len(fields) - 1, high)):
                if len(bag):
                    idx += (base[k] + bag).tolist()
                    val += [1.0 / np.sqrt(len(bag))] * len(bag)
        idx += list(range(dense_base, dense_base + len(r.dense)))
        val += r.dense.tolist()
        indices += idx
        values += val
        offsets.append(len(indices))
        labels.append(r.labels[0])
    dims = dense_base + len(schema.dense_features)
    return (
        np.array(offsets, np.int64),
        np.array(indices, np.int32),
        np.array(values, np.float32),
        np.array(labels, np.float32),
        dims,
        schema.tasks,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.baselines.logreg", description=__doc__)
    parser.add_argument("--data", required=True, help="directory of train/valid/test shard sets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--l2", type=float, default=1e-5)
    parser.add_argument("--no-history", action="store_true")
    parser.add_argument(
        "--high-action", type=int, default=4, help="history events with action >= this: 'liked'"
    )
    parser.add_argument("--max-history", type=int, default=128, help="most recent events used (as the model)")
    args = parser.parse_args(argv)

    root = Path(args.data)
    splits = {
        s: load_split(root / s, not args.no_history, args.high_action, args.max_history)
        for s in ("train", "valid", "test")
    }
    dims = max(v[4] for v in splits.values())
    tasks = splits["train"][5]
    k = len(tasks)

    def batches(split, order, size):
        """Minibatches of rows as (ids, values, row of each, labels, rows), the nonzeros padded to a multiple
        of 2^14 (value 0) so that jit compiles a few shapes."""
        offsets, indices, values, labels = splits[split][:4]
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            counts = offsets[rows + 1] - offsets[rows]
            pos = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in rows])
            seg = np.repeat(np.arange(len(rows)), counts)
            pad = -len(pos) % (1 << 14)
            yield (
                np.pad(indices[pos], (0, pad)),
                np.pad(values[pos], (0, pad)),
                np.pad(seg, (0, pad)),
                labels[rows],
                len(rows),
            )

    def logits(params, idx, val, seg, n):
        per = params["w"][idx] * val[:, None]
        return jax.ops.segment_sum(per, seg, num_segments=n) + params["b"]

    def loss_fn(params, idx, val, seg, y, n):
        z = logits(params, idx, val, seg, n)
        bce = optax.sigmoid_binary_cross_entropy(z, y).mean()
        return bce + args.l2 * jnp.sum(params["w"] ** 2)

    opt = optax.adam(args.lr)

    @functools.partial(jax.jit, static_argnums=(6,))
    def step(params, state, idx, val, seg, y, n):
        grads = jax.grad(loss_fn)(params, idx, val, seg, y, n)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    predict = jax.jit(
        lambda p, idx, val, seg, n: jax.nn.sigmoid(logits(p, idx, val, seg, n)), static_argnums=(4,)
    )

    def score(params, split):
        n = len(splits[split][3])
        preds = []
        for idx, val, seg, _, rows in batches(split, np.arange(n), 4096):
            preds.append(np.asarray(predict(params, idx, val, seg, 4096))[:rows])  # 4096 rows: one shape
        p, y = np.concatenate(preds), splits[split][3]
        return {
            t: {"auc": auc(y[:, j], p[:, j]), "ne": normalized_entropy(y[:, j], p[:, j])}
            for j, t in enumerate(tasks)
        }

    params = {"w": jnp.zeros((dims, k)), "b": jnp.zeros(k)}
    state = opt.init(params)
    rng = np.random.default_rng(args.seed)
    n_train = len(splits["train"][3])
    best = None
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(n_train)
        order = order[: n_train - n_train % args.batch]  # whole batches: one compiled shape
        for idx, val, seg, y, rows in batches("train", order, args.batch):
            params, state = step(params, state, idx, val, seg, y, rows)
        valid = score(params, "valid")
        first = tasks[0]
        print(
            f"epoch {epoch}: valid {first} AUC {valid[first]['auc']:.4f} NE {valid[first]['ne']:.4f}",
            file=sys.stderr,
        )
        if best is None or valid[first]["auc"] > best[1][first]["auc"]:
            best = (epoch, valid, score(params, "test"))
    epoch, valid, test = best
    print(json.dumps({"model": "logreg", "history": not args.no_history, "seed": args.seed, "epoch": epoch,
                      "valid": valid, "test": test}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
