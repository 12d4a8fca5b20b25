"""Next-item (retrieval) training and evaluation on an interactions file (`data.kind = "interactions"`).

Same spine as the ads task: the HSTU tower, `make_optimizer`, `make_mesh`, one jagged pack per
data-parallel shard under `jax.shard_map`, orbax `Checkpointer`, `MetricsWriter`. What differs:

* Data: `load_interactions` -> `leave_one_out`. A user's training sequence (its most recent
  `max_len + 1` items) becomes `max_len` input tokens, each predicting the next item. Every
  epoch visits every user with at least two training items once, in a fresh order.
* Losses (`retrieval.loss`): SASRec's BCE with one negative per position (drawn on the host,
  uniformly from items the user never had in training, as SASRec's sampler does) or HSTU's
  sampled softmax (uniform negatives drawn on device, one set per pack shared by its positions,
  or the pack's own targets).
* Evaluation every `eval_every_epochs` on the validation targets, both protocols: 100 sampled
  negatives (HR@10, NDCG@10) and full ranking (HR/NDCG@5/10/20). `select_metric` picks the best
  checkpoint (kept in `best/`); `patience` evaluations without improvement stop the run, and so
  does `max_minutes` of training (checked at epoch ends, with one last evaluation). The
  test targets are scored once, at the end, for that checkpoint only, and saved to `test.json`.

Run directory: `config.toml`, `checkpoints/` (latest, for resumption at an evaluation
boundary), `best/` (the chosen checkpoint), `progress.json` (epoch, best so far), `metrics.jsonl`
and `test.json`. A run interrupted mid-epoch resumes from its last evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gem_jax.config import Config, ConfigError, config_to_toml
from gem_jax.data.interactions import (
    Interactions,
    LeaveOneOutSplit,
    leave_one_out,
    load_interactions,
    pad_sequences,
    sample_negatives,
)
from gem_jax.model.retrieval import NextItemModel, NextItemPack, bce_loss, sampled_softmax_loss
from gem_jax.parallel import make_mesh, num_batch_shards
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.retrieval_metrics import (
    RetrievalAccumulator,
    full_ranking_ranks,
    sampled_ranks_from_vectors,
)
from gem_jax.train.step import ShardedTrainer

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLED_KS = (10,)
FULL_KS = (5, 10, 20)
EVAL_CHUNK = 2048  # users per jitted sampled-protocol call (padded, so one compilation)
MIN_LEN = 3  # leave-one-out: 1 training + validation + test item


# ----------------------------------------------------------------------------- data


def resolve_data_path(path: str) -> Path:
    """A relative `data.path` is tried against the working directory, then the repository root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p


def _load(config: Config) -> Interactions:
    path = resolve_data_path(config.data.path)
    try:
        return load_interactions(path, format=config.retrieval.format)
    except FileNotFoundError:
        where = (
            "" if Path(config.data.path).is_absolute() else f" (also tried {REPO_ROOT / config.data.path})"
        )
        raise ConfigError(f"`data.path`: interactions file not found: {config.data.path}{where}") from None
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
class RetrievalData:
    interactions: Interactions
    split: LeaveOneOutSplit
    inputs: list[np.ndarray]  # per training user: input tokens (<= max_len)
    targets: list[np.ndarray]  # per training user: the next item of each input token
    train_owner: np.ndarray  # dense user of each training example
    user_item_keys: np.ndarray  # sorted user * (N + 1) + item of every training interaction
    eval_sets: dict[str, EvalSet]

    @property
    def num_items(self) -> int:
        return self.interactions.num_items


def load_data(config: Config) -> RetrievalData:
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
    return RetrievalData(inter, split, inputs, targets, np.asarray(owners, np.int64), keys, eval_sets)


def sample_train_negatives(data: RetrievalData, rng: np.random.Generator) -> list[np.ndarray]:
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


def pack_groups(lengths: np.ndarray, examples_capacity: int, tokens_capacity: int) -> list[tuple[int, int]]:
    """Greedy in-order grouping: [(start, stop)) runs of examples that fit one pack."""
    groups, start, tokens = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if n > tokens_capacity:
            raise ValueError(f"an example of {n} tokens does not fit a pack of {tokens_capacity} tokens")
        if i - start + 1 > examples_capacity or tokens + n > tokens_capacity:
            groups.append((start, i))
            start, tokens = i, 0
        tokens += n
    if len(lengths) > start:
        groups.append((start, len(lengths)))
    return groups


def make_pack(
    inputs: list[np.ndarray],
    targets: list[np.ndarray] | None,
    negatives: list[np.ndarray] | None,
    examples_capacity: int,
    tokens_capacity: int,
) -> NextItemPack:
    """One numpy pack of the given examples (they must fit)."""
    n = len(inputs)
    lengths = np.fromiter((len(x) for x in inputs), np.int64, n)
    total = int(lengths.sum())
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


def _stack(packs: list[NextItemPack], shards: int, examples_capacity: int, tokens_capacity: int):
    """Stacks packs on a leading shard axis, padding with empty packs."""
    while len(packs) < shards:
        packs.append(make_pack([], None, None, examples_capacity, tokens_capacity))
    return jax.tree.map(lambda *xs: np.stack(xs), *packs)


def epoch_steps(data: RetrievalData, config: Config, epoch: int, shards: int):
    """The epoch's steps: stacks of `shards` packs over all training users in a seeded order."""
    d = config.data
    rng = np.random.default_rng([config.train.seed, epoch])
    order = rng.permutation(len(data.inputs))
    negatives = sample_train_negatives(data, rng) if config.retrieval.loss == "bce" else None
    lengths = np.fromiter((len(data.inputs[i]) for i in order), np.int64, len(order))
    groups = pack_groups(lengths, d.examples_per_shard, d.tokens_per_shard)
    packs = []
    for a, b in groups:
        idx = order[a:b]
        packs.append(
            make_pack(
                [data.inputs[i] for i in idx],
                [data.targets[i] for i in idx],
                None if negatives is None else [negatives[i] for i in idx],
                d.examples_per_shard,
                d.tokens_per_shard,
            )
        )
    for s in range(0, len(packs), shards):
        yield _stack(packs[s : s + shards], shards, d.examples_per_shard, d.tokens_per_shard)


def count_epoch_steps(data: RetrievalData, config: Config, shards: int) -> int:
    d = config.data
    order = np.random.default_rng([config.train.seed, 0]).permutation(len(data.inputs))
    lengths = np.fromiter((len(data.inputs[i]) for i in order), np.int64, len(order))
    return -(-len(pack_groups(lengths, d.examples_per_shard, d.tokens_per_shard)) // shards)


# ----------------------------------------------------------------------------- trainer


class RetrievalTrainer(ShardedTrainer):
    """The next-item model on the shared sharded train state and step (`train.step.ShardedTrainer`)."""

    def __init__(self, config: Config, mesh: Mesh, num_items: int, total_steps: int):
        self.num_items = num_items
        # The schedule spans the real number of steps (epochs x steps per epoch), not train.steps.
        super().__init__(config, mesh, dataclasses.replace(config.train, steps=max(total_steps, 1)))
        replicated = NamedSharding(mesh, P())
        self.user_vectors = jax.jit(  # [shards, B, d] user vectors at each example's newest item
            lambda params, batch: self._per_pack(
                lambda model, pack: model.last_vectors(pack.item_ids, pack.offsets), params, batch
            ),
            out_shardings=replicated,
        )
        self.item_table = jax.jit(
            lambda params: nnx.merge(self.graphdef, params).item_table(), out_shardings=replicated
        )

    def _model(self) -> NextItemModel:
        return NextItemModel(self.config, self.num_items, rngs=nnx.Rngs(self.config.train.seed))

    def _pack_loss(self, params, pack: NextItemPack, rng):
        r = self.config.retrieval
        model = nnx.merge(self.graphdef, params)
        dropout_key, negative_key = jax.random.split(rng)
        user = model(pack.item_ids, pack.offsets, rng=dropout_key)
        table = model.item_table()
        if r.loss == "bce":
            total, count = bce_loss(user, table, pack.targets, pack.negatives)
        else:
            if r.negatives == "in_batch":
                negatives = pack.targets
            else:
                # One draw per pack, shared by its positions: a [T, d] x [d, K] matmul instead of a
                # [T, K, d] gather, so K can be large (HSTU draws per position; same estimator family).
                negatives = jax.random.randint(negative_key, (r.num_negatives,), 1, self.num_items + 1)
            total, count = sampled_softmax_loss(user, table, pack.targets, negatives, r.temperature)
        return {"loss_sum": total, "count": count}

    def _loss(self, params, batch, rng):
        sums = self._sharded(self._pack_loss, params, batch, rng)
        return sums["loss_sum"] / jnp.maximum(sums["count"], 1.0), {"positions": sums["count"]}


# ----------------------------------------------------------------------------- evaluation


def evaluate(trainer: RetrievalTrainer, params, eval_set: EvalSet, shards: int) -> dict[str, float]:
    """HR/NDCG of one split under the configured protocols, keys like "sampled/NDCG@10"."""
    d, r = trainer.config.data, trainer.config.retrieval
    lengths = np.fromiter((len(h) for h in eval_set.histories), np.int64, len(eval_set.histories))
    groups = pack_groups(lengths, d.examples_per_shard, d.tokens_per_shard)
    vectors = []
    for s in range(0, len(groups), shards):
        chunk = groups[s : s + shards]
        packs = [
            make_pack(eval_set.histories[a:b], None, None, d.examples_per_shard, d.tokens_per_shard)
            for a, b in chunk
        ]
        stack = _stack(packs, shards, d.examples_per_shard, d.tokens_per_shard)
        out = np.asarray(trainer.user_vectors(params, jax.device_put(stack, trainer.batch_sharding)))
        vectors.extend(out[i, : b - a] for i, (a, b) in enumerate(chunk))
    users = np.concatenate(vectors)
    table = trainer.item_table(params)
    results: dict[str, float] = {}
    if r.eval_protocol in ("sampled", "both"):
        acc = RetrievalAccumulator(SAMPLED_KS)
        n = len(users)
        for a in range(0, n, EVAL_CHUNK):
            b = min(a + EVAL_CHUNK, n)
            pad = EVAL_CHUNK - (b - a)
            ranks = sampled_ranks_from_vectors(
                jnp.asarray(np.pad(users[a:b], ((0, pad), (0, 0)))),
                table,
                jnp.asarray(np.pad(eval_set.targets[a:b], (0, pad), constant_values=1)),
                jnp.asarray(np.pad(eval_set.negatives[a:b], ((0, pad), (0, 0)), constant_values=1)),
            )
            acc.update(ranks, np.arange(EVAL_CHUNK) < b - a)
        results.update({f"sampled/{k}": v for k, v in acc.compute().items()})
    if r.eval_protocol in ("full", "both"):
        # "full/": as configured; with exclude_history, "full_incl_history/" also keeps the user's items.
        variants = {"full": eval_set.exclude}
        if eval_set.exclude is not None:
            variants["full_incl_history"] = None
        for prefix, exclude in variants.items():
            ranks = full_ranking_ranks(
                jnp.asarray(users),
                table,
                jnp.asarray(eval_set.targets),
                None if exclude is None else jnp.asarray(exclude),
            )
            acc = RetrievalAccumulator(FULL_KS)
            acc.update(ranks)
            results.update({f"{prefix}/{k}": v for k, v in acc.compute().items()})
    results["users"] = len(users)
    return results


# ----------------------------------------------------------------------------- training


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def _setup(config: Config):
    if jax.process_count() != 1:
        raise ValueError(f"retrieval training runs in one process, got {jax.process_count()}")
    data = load_data(config)
    mesh = make_mesh(config.parallel)
    shards = num_batch_shards(mesh, config.parallel)
    steps_per_epoch = count_epoch_steps(data, config, shards)
    trainer = RetrievalTrainer(config, mesh, data.num_items, steps_per_epoch * config.retrieval.epochs)
    return data, mesh, shards, steps_per_epoch, trainer


def train(config: Config, workdir: str | Path, *, stop_after: int | None = None) -> dict[str, Any]:
    """Trains (or resumes) until `retrieval.epochs` or early stopping; scores the test split once.

    `stop_after` ends this invocation after the first evaluation at or past that global step.
    """
    from gem_jax.train.loop import MetricsWriter, TrainingDiverged, _StopRequest  # loop imports us

    t_start = time.perf_counter()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    r, tc = config.retrieval, config.train
    (workdir / "config.toml").write_text(config_to_toml(config))
    data, mesh, shards, steps_per_epoch, trainer = _setup(config)
    print(
        f"{data.interactions.summary()}\n{data.split.summary()}\n{len(data.inputs)} training "
        f"sequences, {steps_per_epoch} steps per epoch on {shards} shard(s)",
        file=sys.stderr,
    )
    latest_ckpt = Checkpointer(workdir / "checkpoints", dataclasses.replace(tc, keep_checkpoints=1))
    best_ckpt = Checkpointer(workdir / "best", dataclasses.replace(tc, keep_checkpoints=1))
    progress = _read_json(workdir / "progress.json") or {
        "epoch": 0,
        "step": 0,
        "best_step": None,
        "best_epoch": None,
        "best_metric": None,
        "bad_evals": 0,
        "stopped_early": False,
        "out_of_time": False,
    }
    latest = latest_ckpt.latest_step()
    if latest is not None and latest == progress["step"]:
        state = latest_ckpt.restore(latest, trainer.abstract_state, trainer.state_shardings, None)
        print(f"resumed at epoch {progress['epoch']} (step {latest}) in {workdir}", file=sys.stderr)
    else:
        state = trainer.init_state()
        progress.update(
            epoch=0,
            step=0,
            best_step=None,
            best_epoch=None,
            best_metric=None,
            bad_evals=0,
            stopped_early=False,
            out_of_time=False,
            train_time_s=0.0,
        )
    writer = MetricsWriter(workdir)
    interrupted = False
    last: dict[str, float] = {}
    test_record = _read_json(workdir / "test.json")
    try:
        with _StopRequest() as stop:
            epoch = progress["epoch"]
            step = progress["step"]
            done = _ended(progress, r.epochs)
            t_train = time.perf_counter() - progress.get("train_time_s", 0.0)  # budget spans resumptions
            t_interval, interval = time.perf_counter(), {"steps": 0, "positions": 0.0, "users": 0}
            while not done and stop.signal is None:
                for stack in epoch_steps(data, config, epoch, shards):
                    interval["users"] += int((np.diff(stack.offsets, axis=-1) > 0).sum())
                    state, metrics = trainer.train_step(state, jax.device_put(stack, trainer.batch_sharding))
                    step += 1
                    interval["steps"] += 1
                    if step % tc.log_every == 0:
                        last = {k: float(v) for k, v in metrics.items()}
                        if not (math.isfinite(last["loss"]) and math.isfinite(last["param_norm"])):
                            raise TrainingDiverged(
                                f"loss = {last['loss']}, param norm = {last['param_norm']} at step {step} "
                                f"(epoch {epoch}); the last evaluated checkpoint is step {progress['step']}"
                            )
                        elapsed = time.perf_counter() - t_interval
                        writer.write(
                            {
                                "step": step,
                                "epoch": epoch,
                                **last,
                                "users_per_s": interval["users"] / elapsed,
                                "step_time_s": elapsed / interval["steps"],
                            }
                        )
                        t_interval, interval = time.perf_counter(), {"steps": 0, "positions": 0.0, "users": 0}
                    if stop.signal is not None:
                        break
                if stop.signal is not None:
                    interrupted = True
                    break
                epoch += 1
                out_of_time = bool(r.max_minutes) and time.perf_counter() - t_train >= 60 * r.max_minutes
                if epoch % r.eval_every_epochs and epoch < r.epochs and not out_of_time:
                    continue
                last = {k: float(v) for k, v in metrics.items()}
                if not math.isfinite(last["loss"]):
                    raise TrainingDiverged(f"loss = {last['loss']} at the end of epoch {epoch - 1}")
                t_eval = time.perf_counter()
                valid = evaluate(trainer, state.params, data.eval_sets["valid"], shards)
                value = valid[r.select_metric]
                improved = progress["best_metric"] is None or value > progress["best_metric"]
                if improved:
                    best_ckpt.save(step, state, None)
                    progress.update(best_step=step, best_epoch=epoch, best_metric=value, bad_evals=0)
                else:
                    progress["bad_evals"] += 1
                latest_ckpt.save(step, state, None)
                latest_ckpt.wait()
                best_ckpt.wait()
                stopped = bool(r.patience and progress["bad_evals"] >= r.patience)
                progress.update(
                    epoch=epoch,
                    step=step,
                    stopped_early=stopped,
                    out_of_time=out_of_time,
                    train_time_s=time.perf_counter() - t_train,
                )
                _write_json(workdir / "progress.json", progress)
                writer.write(
                    {
                        "step": step,
                        "epoch": epoch,
                        "split": "valid",
                        "valid": valid,
                        "best_step": progress["best_step"],
                        "eval_time_s": time.perf_counter() - t_eval,
                        "elapsed_s": time.perf_counter() - t_start,
                    }
                )
                print(
                    f"epoch {epoch} step {step} loss {last['loss']:.4f} valid "
                    + " ".join(f"{k} {v:.4f}" for k, v in valid.items() if k != "users")
                    + (" *" if improved else ""),
                    file=sys.stderr,
                )
                if out_of_time:
                    print(
                        f"stopping: retrieval.max_minutes={r.max_minutes} spent after epoch {epoch}",
                        file=sys.stderr,
                    )
                ended = stopped or out_of_time or epoch >= r.epochs
                done = ended or (stop_after is not None and step >= stop_after)
                if stop_after is not None and step >= stop_after and not ended:
                    interrupted = True
        finished = not interrupted and _ended(progress, r.epochs)
        if finished and test_record is None:
            test_record = _score_test(trainer, best_ckpt, data, shards, progress)
            _write_json(workdir / "test.json", test_record)
            writer.write({"step": test_record["step"], "split": "test", **test_record})
    finally:
        latest_ckpt.wait()
        latest_ckpt.close()
        best_ckpt.wait()
        best_ckpt.close()
        writer.close()
    return {
        "workdir": str(workdir),
        "step": progress["step"],
        "epoch": progress["epoch"],
        "interrupted": interrupted,
        "stopped_early": progress["stopped_early"],
        "out_of_time": progress.get("out_of_time", False),
        "best_step": progress["best_step"],
        "best_epoch": progress["best_epoch"],
        "select_metric": r.select_metric,
        "best_valid": progress["best_metric"],
        "test": None if test_record is None else test_record["test"],
        "wall_time_s": time.perf_counter() - t_start,
        "final": last,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
    }


def _ended(progress: dict[str, Any], epochs: int) -> bool:
    """Training is over: early-stopped, out of time, or all epochs done."""
    return progress["stopped_early"] or progress.get("out_of_time", False) or progress["epoch"] >= epochs


def _score_test(
    trainer: RetrievalTrainer,
    best_ckpt: Checkpointer,
    data: RetrievalData,
    shards: int,
    progress: dict[str, Any],
) -> dict[str, Any]:
    """Restores the checkpoint chosen on validation and scores validation (again) and test."""
    step = progress["best_step"]
    state = best_ckpt.restore(step, trainer.abstract_state, trainer.state_shardings, None)
    valid = evaluate(trainer, state.params, data.eval_sets["valid"], shards)
    test = evaluate(trainer, state.params, data.eval_sets["test"], shards)
    return {"step": step, "epoch": progress["best_epoch"], "valid": valid, "test": test}


def evaluate_checkpoint(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Validation metrics of the chosen checkpoint; the test metrics recorded at the end of training
    (the test split is not scored again here)."""
    workdir = Path(workdir)
    data, mesh, shards, _, trainer = _setup(config)
    for sub in ("best", "checkpoints"):
        ckpt = Checkpointer(workdir / sub, config.train)
        step = ckpt.latest_step()
        if step is not None:
            break
        ckpt.close()
    else:
        raise FileNotFoundError(f"no checkpoint in {workdir / 'best'} or {workdir / 'checkpoints'}")
    state = ckpt.restore(step, trainer.abstract_state, trainer.state_shardings, None)
    ckpt.close()
    valid = evaluate(trainer, state.params, data.eval_sets["valid"], shards)
    recorded = _read_json(workdir / "test.json")
    return {
        "workdir": str(workdir),
        "step": step,
        "checkpoint": sub,
        "valid": valid,
        "test": None if recorded is None else recorded["test"],
    }


# ----------------------------------------------------------------------------- reporting


def plot_validation(
    workdirs: dict[str, str | Path],
    out: str | Path,
    metrics: tuple[str, ...] = ("sampled/NDCG@10", "full/NDCG@10"),
) -> None:
    """One panel per metric: validation value against epoch for each labelled run directory.

    python3 -c "from gem_jax.train.retrieval import plot_validation as p; p({'label': 'runs/x'}, 'docs/x.png')"
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for label, workdir in workdirs.items():
        lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
        valid = [r for r in map(json.loads, lines) if r.get("split") == "valid"]
        test = _read_json(Path(workdir) / "test.json")
        for ax, metric in zip(axes[0], metrics):
            points = [(r["epoch"], r["valid"][metric]) for r in valid if metric in r["valid"]]
            if not points:
                continue
            (line,) = ax.plot(*zip(*points), marker=".", label=label)
            if test is not None:
                ax.axvline(test["epoch"], color=line.get_color(), linestyle=":", linewidth=1)
    for ax, metric in zip(axes[0], metrics):
        ax.set_title(f"validation {metric} (dotted: chosen epoch)")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
