"""Next-item data: leave-one-out users of an interactions file -> epochs of jagged packs.

* `load_next_item_data`: `load_interactions` -> `leave_one_out`. A user's training sequence (its
  most recent `max_len + 1` items) becomes `max_len` input tokens, each predicting the next item;
  with `retrieval.train_targets = "last_of_prefixes"` each prefix of those tokens is an example of
  its own that predicts only the item after its last token (`prefix_examples`).
  The validation and test users' histories, targets and 100 sampled negatives are prepared once.
* `NextItemEpochs`: the training stream. Epoch e visits every training example once, in an order
  drawn from (seed, e); with the BCE loss it also draws one negative per position (as SASRec's
  sampler does), with the contrastive or intent loss two augmented views of every example (`views`, packed
  beside the pack's examples). Examples are packed with the one packer (`packing.greedy_groups`), so
  an epoch ends with a short stack padded with empty packs. Its iterator is a grain `DatasetIterator`
  whose state is `{"epoch", "step"}`: a run resumes at any step, mid-epoch included.
* `eval_stacks`: an evaluation split's users as stacks of packs (this process's share).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import grain
import numpy as np
from flax import struct
from jaxtyping import ArrayLike, Int

from gem_jax.config import Config, ConfigError
from gem_jax.data.augment import Augmentation
from gem_jax.data.interactions import (
    Interactions,
    LeaveOneOutSplit,
    leave_one_out,
    load_interactions,
    pad_sequences,
    sample_negatives,
)
from gem_jax.data.packing import greedy_groups, stack_packs
from gem_jax.paths import REPO_ROOT, in_repository

MIN_LEN = 3  # leave-one-out: 1 training + validation + test item


@typing.no_type_check  # pytrees are rebuilt with non-array leaves (see gem_jax/typing.py)
@struct.dataclass
class NextItemPack:
    """One jagged pack of users (the layout of `data.batch.JaggedBatch`, next-item fields only).

    Example b owns tokens `offsets[b]:offsets[b+1]`; the tail past `offsets[B]` is padding.
    For training, `targets[t]` is the item that follows token t (0: no target) and `negatives[t]`
    one sampled negative for the BCE loss (0 when unused). Evaluation packs carry zeros there.
    `views` (contrastive training only): a pack of twice the capacities whose example b is the first
    augmented view of example b and whose example B + b is its second.
    """

    item_ids: Int[ArrayLike, "... T"]
    targets: Int[ArrayLike, "... T"]
    negatives: Int[ArrayLike, "... T"]
    offsets: Int[ArrayLike, "... B1"]
    views: NextItemPack | None = None

    @property
    def num_examples_capacity(self) -> int:
        return self.offsets.shape[-1] - 1


def pack_next_item(
    inputs: list[np.ndarray],
    targets: list[np.ndarray] | None,
    negatives: list[np.ndarray] | None,
    *,
    examples_capacity: int,
    tokens_capacity: int,
) -> NextItemPack:
    """One numpy pack of the given users (they must fit, see `packing.fits`)."""
    n = len(inputs)
    lengths = np.fromiter((len(x) for x in inputs), np.int64, n)
    total = int(lengths.sum())
    if n > examples_capacity or total > tokens_capacity:
        raise ValueError(
            f"{n} users of {total} tokens exceed a pack of {examples_capacity} x {tokens_capacity}"
        )
    offsets = np.full(examples_capacity + 1, total, np.int32)
    offsets[0] = 0
    offsets[1 : n + 1] = np.cumsum(lengths)

    def flat(parts):
        out = np.zeros(tokens_capacity, np.int32)
        if parts is not None and n:
            out[:total] = np.concatenate(parts)
        return out

    return NextItemPack(
        item_ids=flat(inputs), targets=flat(targets), negatives=flat(negatives), offsets=offsets
    )


# ----------------------------------------------------------------------------- loading


# The public files the next-item configs read, by their place under the local data/ folder (README,
# "Public data"): where each comes from, for the error that reports one missing.
PUBLIC_DATA = {
    "sasrec/Games.txt": "the SASRec authors' repository, github.com/kang205/SASRec, file data/Video.txt",
    "iclrec/Beauty.txt": "the ICLRec authors' repository, github.com/salesforce/ICLRec, file data/Beauty.txt",
    "iclrec/Sports_and_Outdoors.txt": (
        "the ICLRec authors' repository, github.com/salesforce/ICLRec, file data/Sports_and_Outdoors.txt"
    ),
}


def missing_file_hint(path: str) -> str:
    """Where to get a missing interactions file, and how to point a run at a copy elsewhere."""
    place = "/".join(Path(path).parts[-2:])
    if place in PUBLIC_DATA:
        get = f"get it from {PUBLIC_DATA[place]}, saved as data/{place}"
    else:
        get = 'the public sets and where they come from are in the README, "Public data"'
    return f"{get}; or pass --set data.path=FILE"


def _load(config: Config) -> Interactions:
    path = in_repository(config.data.path)
    try:
        return load_interactions(path, format=config.retrieval.format)
    except FileNotFoundError:
        where = (
            "" if Path(config.data.path).is_absolute() else f" (also tried {REPO_ROOT / config.data.path})"
        )
        raise ConfigError(
            f"`data.path`: interactions file not found: {config.data.path}{where}; "
            f"{missing_file_hint(config.data.path)}"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:  # the loader's message names the file and line
        raise ConfigError(f"`data.path`: {e}") from None


@dataclasses.dataclass
class EvalSet:
    """One split's evaluation users: model inputs, targets, 100 negatives, exclusion lists."""

    histories: list[np.ndarray]
    targets: np.ndarray
    negatives: np.ndarray
    exclude: np.ndarray | None


@dataclasses.dataclass
class NextItemData:
    interactions: Interactions
    split: LeaveOneOutSplit
    inputs: list[np.ndarray]  # per training example: input tokens (<= max_len)
    targets: list[np.ndarray]  # per training example: the next item of each input token (0: none)
    train_owner: np.ndarray  # dense user of each training example
    user_item_keys: np.ndarray  # sorted user * (N + 1) + item of every training interaction
    eval_sets: dict[str, EvalSet]

    @property
    def num_items(self) -> int:
        return self.interactions.num_items


def load_next_item_data(config: Config) -> NextItemData:
    r = config.retrieval
    inter = _load(config)
    split = leave_one_out(inter, min_len=MIN_LEN)
    if split.num_evaluated == 0:
        raise ConfigError(f"`data.path` {inter.path}: no user has {MIN_LEN} or more interactions")
    inputs, targets, owners = [], [], []
    for u, seq in enumerate(split.train):
        seq = seq[-(r.max_len + 1) :]
        if len(seq) >= 2:
            inputs.append(seq[:-1])
            targets.append(seq[1:])
            owners.append(u)
    if r.train_targets == "last_of_prefixes":
        inputs, targets, owners = prefix_examples(inputs, targets, owners)
    stride = inter.num_items + 1
    lengths = np.fromiter((len(s) for s in split.train), np.int64, split.num_users)
    flat = np.concatenate(split.train).astype(np.int64)
    keys = np.unique(np.repeat(np.arange(split.num_users, dtype=np.int64), lengths) * stride + flat)
    # Evaluated users: all, or a fixed random subset (quick runs); the same users for both splits.
    pick = np.arange(split.num_evaluated)
    if r.eval_users and r.eval_users < split.num_evaluated:
        pick = np.sort(
            np.random.default_rng(config.data.seed).choice(split.num_evaluated, r.eval_users, replace=False)
        )
    all_items = split.all_items()
    users = split.eval_users[pick]
    eval_sets = {}
    for i, name in enumerate(("valid", "test")):
        history = split.history(name)
        full_hist = [history[j] for j in pick]
        hist = [h[-r.max_len :] for h in full_hist]
        negatives = sample_negatives(
            [all_items[u] for u in users], inter.num_items, r.eval_negatives, seed=config.data.seed * 2 + i
        )
        exclude = pad_sequences(full_hist) if r.exclude_history else None
        eval_sets[name] = EvalSet(hist, split.targets(name)[pick], negatives, exclude)
    return NextItemData(inter, split, inputs, targets, np.asarray(owners, np.int64), keys, eval_sets)


def prefix_examples(
    inputs: list[np.ndarray], targets: list[np.ndarray], owners: list[int]
) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """Every prefix of every sequence as an example whose only target is the item after its last token:
    the (input, target) pairs of the all-positions examples, one per example, so a model that sees the
    whole input (a non-causal filter) never sees its target."""
    out_inputs, out_targets, out_owners = [], [], []
    for seq, nxt, owner in zip(inputs, targets, owners, strict=True):
        for t in range(1, len(seq) + 1):
            target = np.zeros(t, nxt.dtype)
            target[-1] = nxt[t - 1]
            out_inputs.append(seq[:t])
            out_targets.append(target)
            out_owners.append(owner)
    return out_inputs, out_targets, out_owners


def sample_train_negatives(data: NextItemData, rng: np.random.Generator) -> list[np.ndarray]:
    """Per training example, one negative per target, uniform over items absent from the user's
    training sequence (SASRec's `random_neq`), by redrawing collisions."""
    stride = data.num_items + 1
    lengths = np.fromiter((len(t) for t in data.targets), np.int64, len(data.targets))
    owner = np.repeat(data.train_owner, lengths)
    neg = rng.integers(1, data.num_items + 1, size=owner.shape[0])
    todo = np.arange(owner.shape[0])
    for _ in range(100):
        keys = owner[todo] * stride + neg[todo]
        pos = np.minimum(np.searchsorted(data.user_item_keys, keys), len(data.user_item_keys) - 1)
        todo = todo[data.user_item_keys[pos] == keys]
        if not len(todo):
            break
        neg[todo] = rng.integers(1, data.num_items + 1, size=len(todo))
    return np.split(neg.astype(np.int32), np.cumsum(lengths)[:-1])


# ----------------------------------------------------------------------------- training stream


@dataclasses.dataclass(frozen=True)
class _Layout:
    examples_capacity: int
    tokens_capacity: int
    shards: int  # packs per global step (all processes)
    process_index: int
    process_count: int
    views: bool = False  # packs carry two augmented views of their examples

    @property
    def local_shards(self) -> int:
        return self.shards // self.process_count


class NextItemEpochs(grain.IterDataset):
    """Epochs of training users, `shards` packs per global step; yields this process's share."""

    def __init__(
        self,
        data: NextItemData,
        config: Config,
        *,
        shards: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        super().__init__()
        if shards % process_count:
            raise ValueError(f"{shards} batch shards do not split over {process_count} processes")
        self.data = data
        self.seed = config.train.seed
        r = config.retrieval
        self.bce_negatives = r.loss == "bce"
        views = r.contrastive_weight > 0 or r.intent_weight > 0
        self.augmentation = Augmentation.from_config(r) if views else None
        self.epochs = r.epochs
        d = config.data
        self.layout = _Layout(
            d.examples_per_shard,
            d.tokens_per_shard,
            shards,
            process_index,
            process_count,
            views=self.augmentation is not None,
        )
        self._steps_cache: dict[int, int] = {}

    def _order(self, epoch: int) -> tuple[np.random.Generator, np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        return rng, rng.permutation(len(self.data.inputs))

    def _groups(self, order: np.ndarray) -> list[tuple[int, int]]:
        lengths = [len(self.data.inputs[i]) for i in order]
        lay = self.layout
        return greedy_groups(
            lengths, examples_capacity=lay.examples_capacity, tokens_capacity=lay.tokens_capacity
        )

    def steps_in_epoch(self, epoch: int) -> int:
        """Global steps of one epoch (its packs, `shards` per step)."""
        if epoch not in self._steps_cache:
            _, order = self._order(epoch)
            self._steps_cache[epoch] = -(-len(self._groups(order)) // self.layout.shards)
        return self._steps_cache[epoch]

    def epoch_packs(self, epoch: int) -> list[NextItemPack]:
        """All packs of one epoch (every process's), in step order."""
        rng, order = self._order(epoch)
        negatives = sample_train_negatives(self.data, rng) if self.bce_negatives else None
        lay = self.layout
        packs = []
        for a, b in self._groups(order):
            idx = order[a:b]
            inputs = [self.data.inputs[i] for i in idx]
            pack = pack_next_item(
                inputs,
                [self.data.targets[i] for i in idx],
                None if negatives is None else [negatives[i] for i in idx],
                examples_capacity=lay.examples_capacity,
                tokens_capacity=lay.tokens_capacity,
            )
            if self.augmentation is not None:
                pack = pack.replace(views=_views_pack(*self.augmentation.views(inputs, rng), lay))
            packs.append(pack)
        return packs

    def __iter__(self) -> _EpochIterator:
        return _EpochIterator(self)


class _EpochIterator(grain.DatasetIterator):
    """State `{"epoch", "step"}`: the next stack is step `step` of epoch `epoch`."""

    def __init__(self, dataset: NextItemEpochs):
        super().__init__()
        self._ds = dataset
        self._epoch = 0
        self._step = 0
        self._packs: list[NextItemPack] | None = None  # the current epoch's packs (built lazily)

    def __next__(self) -> NextItemPack:
        ds, lay = self._ds, self._ds.layout
        if self._epoch >= ds.epochs:
            raise StopIteration
        if self._packs is None:
            self._packs = ds.epoch_packs(self._epoch)
        first = self._step * lay.shards + lay.process_index * lay.local_shards
        local = self._packs[first : first + lay.local_shards]
        stack = stack_packs(local or [_empty(lay)], lay.local_shards)
        self._step += 1
        if self._step * lay.shards >= len(self._packs):
            self._epoch, self._step, self._packs = self._epoch + 1, 0, None
        return stack

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "step": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._step, self._packs = int(state["epoch"]), int(state["step"]), None


def _empty(lay: _Layout) -> NextItemPack:
    pack = pack_next_item(
        [], None, None, examples_capacity=lay.examples_capacity, tokens_capacity=lay.tokens_capacity
    )
    return pack.replace(views=_views_pack([], [], lay)) if lay.views else pack


def _views_pack(first: list[np.ndarray], second: list[np.ndarray], lay: _Layout) -> NextItemPack:
    """Example b: first[b]; example B + b: second[b] (B = the pack's example capacity). No augmentation
    lengthens a sequence, so twice the pack's capacities hold them."""
    empty = [np.zeros(0, np.int32)] * (lay.examples_capacity - len(first))
    return pack_next_item(
        [*first, *empty, *second],
        None,
        None,
        examples_capacity=2 * lay.examples_capacity,
        tokens_capacity=2 * lay.tokens_capacity,
    )


# ----------------------------------------------------------------------------- evaluation


def eval_stacks(
    eval_set: EvalSet, config: Config, *, shards: int, process_index: int = 0, process_count: int = 1
) -> list[tuple[NextItemPack, list[tuple[int, int]]]]:
    """An evaluation split as stacks of this process's packs, each with the global user ranges of
    all its `shards` packs, so every process can put the replicated outputs back in user order."""
    d = config.data
    lengths = [len(h) for h in eval_set.histories]
    groups = greedy_groups(
        lengths, examples_capacity=d.examples_per_shard, tokens_capacity=d.tokens_per_shard
    )
    local = shards // process_count
    out = []
    for s in range(0, len(groups), shards):
        chunk = groups[s : s + shards]
        mine = chunk[process_index * local : (process_index + 1) * local]
        packs = [
            pack_next_item(
                eval_set.histories[a:b],
                None,
                None,
                examples_capacity=d.examples_per_shard,
                tokens_capacity=d.tokens_per_shard,
            )
            for a, b in mine
        ]
        empty = pack_next_item(
            [], None, None, examples_capacity=d.examples_per_shard, tokens_capacity=d.tokens_per_shard
        )
        out.append((stack_packs(packs or [empty], local), chunk))
    return out
