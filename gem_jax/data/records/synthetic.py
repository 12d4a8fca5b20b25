"""The synthetic ads task written out as records (`python -m experiments data synth`).

Example i of the generator becomes request i (its own user): the history, the candidates with their
labels, the F sparse bags (named f0, f1, ...) and the dense features (d0, d1, ...). Read back in order
(an eval split) the records pack into exactly the generator's packs; training shuffles them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gem_jax.config import Config
from gem_jax.data.records.codec import Record
from gem_jax.data.records.schema import RecordSchema, SparseFeature
from gem_jax.data.synthetic import SyntheticAds


def synthetic_schema(config: Config) -> RecordSchema:
    d = config.data
    return RecordSchema(
        tasks=tuple(config.model.tasks),
        num_candidates=d.num_candidates,
        item_vocab=d.num_items + 1,
        action_vocab=d.num_actions + 1,
        sparse_features=tuple(SparseFeature(f"f{j}") for j in range(d.num_sparse_features)),
        dense_features=tuple(f"d{j}" for j in range(d.num_dense_features)),
    )


def record_from_example(example: dict[str, Any], request_id: int) -> Record:
    """A generator example (gem_jax/data/synthetic.py) as a record."""
    c = example["num_targets"]
    n = len(example["item_ids"]) - c
    return Record(
        request_id=request_id,
        user_id=request_id,
        timestamp=int(example["timestamps"][-1]),
        candidates=example["item_ids"][n:],
        labels=example["labels"],
        sparse=list(example["sparse_ids"]),
        dense=example["dense"],
        history_items=example["item_ids"][:n],
        history_actions=example["action_ids"][:n],
        history_timestamps=example["timestamps"][:n],
    )


_generators: dict[int, Any] = {}
_examples: dict[tuple[int, int], dict[str, Any]] = {}


def synthetic_records(
    context: tuple[Config, int | None], index_range: tuple[int, int]
) -> Iterator[tuple[str, Record]]:
    """`writer.write_shards` records function: requests `start..stop-1` of the config's generator.

    `context` is (config, distinct): with `distinct` K, request i holds the generator's example i mod K
    (a volume test's shards, e.g. tens of GB of long histories, without generating every example)."""
    config, distinct = context
    key = id(config)
    if key not in _generators:  # one generator per worker process (building it draws the item factors)
        _generators[key] = SyntheticAds(config.data, num_tasks=len(config.model.tasks))
    gen = _generators[key]
    for i in range(*index_range):
        if distinct is None:
            example = gen.example(i)
        else:
            j = i % distinct
            if (key, j) not in _examples:
                _examples[(key, j)] = gen.example(j)
            example = _examples[(key, j)]
        yield f"synthetic example {i}", record_from_example(example, i)
