"""`python -m experiments bench balance --config C --shards S [--steps N] [--set ...]`: how unevenly a step's
attention work falls on its devices, with and without `data.balance = "attention"` (host only, no device).

Packs the config's training examples (the generator, or the shards with `data.kind = "records"`) into
steps of S packs as S data-parallel devices would get them, then regroups each step as
gem_jax/data/balance.py does. Per step, each pack's attention work is its sequences' causal tile pairs
(`attention_work`); a step lasts as long as its busiest device, so the report gives, over the N steps:

- `max_over_mean`: the mean of (largest pack's work / mean pack's work), unbalanced and balanced;
- `attention_speedup`: sum of the largest pack's work unbalanced / balanced (the attention part of the
  step time, if it follows the busiest device's tile pairs);
- `lower_bound`: the mean of max(the heaviest single sequence, the mean pack's work) / mean: no grouping
  does better;
- `balance_ms_per_step`: host time of the regrouping (a data worker's, per step).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gem_jax.config import load_config
from gem_jax.data.balance import ATTENTION_TILE, attention_work, balance_stack, pack_work
from gem_jax.data.pipeline import example_range, packed_dataset
from gem_jax.data.records.dataset import RecordsData
from gem_jax.data.synthetic import SyntheticAds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments bench balance")
    parser.add_argument("--config", default="configs/hstu_nvidia.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--shards", type=int, default=8, help="packs per step (data-parallel devices)")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)

    config = load_config(args.config, args.overrides)
    d, m = config.data, config.model
    if d.kind == "records":
        records = RecordsData(config)
        examples, stream = records.examples("train"), records.stream
    else:
        examples = example_range(SyntheticAds(d, num_tasks=len(m.tasks)).example, 0, None)
        stream = None
    pack = dict(
        num_sparse_features=d.num_sparse_features, max_bag_size=d.max_bag_size, prefix=m.num_context_tokens
    )
    data = packed_dataset(
        examples,
        examples_capacity=d.examples_per_shard,
        tokens_capacity=d.tokens_per_shard,
        shards=args.shards,
        process_index=0,
        process_count=1,
        stream=stream,
        **pack,
    )
    before, after, bound, mean = [], [], [], []
    held_examples = held_tokens = 0.0
    seconds = 0.0
    for _, stack in zip(range(args.steps), data, strict=False):
        t0 = time.perf_counter()
        balanced = balance_stack(stack, **pack)
        seconds += time.perf_counter() - t0
        work, regrouped = pack_work(stack), pack_work(balanced)
        if work.sum() != regrouped.sum():
            raise AssertionError(f"the regrouped step holds other sequences: work {work} -> {regrouped}")
        before.append(float(work.max()))
        after.append(float(regrouped.max()))
        mean.append(float(work.mean()))
        held_examples += float((stack.num_targets > 0).sum()) / args.shards
        held_tokens += float(stack.offsets[:, -1].sum()) / args.shards
        bound.append(max(float(attention_work(np.diff(stack.offsets, axis=-1)).max()), mean[-1]))
    before, after, bound, mean = map(np.array, (before, after, bound, mean))
    steps = max(len(mean), 1)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "shards": args.shards,
        "steps": len(mean),
        "tile": ATTENTION_TILE,
        "max_over_mean": {
            "unbalanced": float(np.mean(before / mean)),
            "balanced": float(np.mean(after / mean)),
        },
        "lower_bound": float(np.mean(bound / mean)),
        "attention_speedup": float(before.sum() / after.sum()),
        "balance_ms_per_step": 1e3 * seconds / steps,
        "capacity": f"{d.examples_per_shard} examples, {d.tokens_per_shard} tokens",
        "per_pack": {"examples": held_examples / steps, "tokens": held_tokens / steps},
    }
    print(json.dumps(result, indent=1))
    return 0
