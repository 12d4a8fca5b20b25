"""The one typed config schema: frozen dataclasses, TOML loading and `--set` overrides.

Every default lives here once. A TOML file names only what it changes; an unknown key or a value of
the wrong type is a `ConfigError` naming the key and the file, which the CLI turns into exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and its source."""


@dataclass(frozen=True)
class DataConfig:
    """Input data: the synthetic ads task (`kind="synthetic"`), ranking records from shards
    (`kind="records"`, docs/data.md) or next-item data from a file (`kind="interactions"`)."""

    kind: str = "synthetic"  # "synthetic" | "records" | "interactions"
    path: str = ""  # kind="interactions": the file; "records": the training shard set (a directory or a glob)
    seed: int = 0
    # Synthetic ads task.
    num_items: int = 20_000  # raw item id space (Zipf-distributed)
    zipf_exponent: float = 1.1
    num_actions: int = 4  # action types of history events
    latent_dim: int = 8  # dimension of the planted user/item factors
    history_len_mean: float = 30.0  # log-normal history lengths: median
    history_len_sigma: float = 1.0
    max_history_len: int = 128  # histories are cut to their most recent events
    empty_history_fraction: float = 0.05
    num_candidates: int = 1  # candidate ads per example, appended as target tokens
    num_sparse_features: int = 3  # non-sequence bags of ids
    sparse_vocab: int = 1000
    max_bag_size: int = 4
    num_dense_features: int = 8
    # Batching: fixed capacities keep shapes static under jit.
    examples_per_shard: int = 64  # example capacity of one data-parallel shard's pack
    tokens_per_shard: int = 2048  # token capacity of one shard's pack
    eval_examples: int = 4096
    num_workers: int = 0  # grain worker processes generating train examples (0: in the main process)
    # Records (kind="records"). The shards' own schema.json says what a record holds; these pick from it.
    eval_path: str = ""  # validation shard set ("" = none)
    test_path: str = ""  # test shard set, scored once for the chosen checkpoint ("" = none)
    # Record sparse feature -> the embedding feature (`embeddings.features`) that pools it, in the order of
    # the model's feature tokens; {} = every sparse feature of the shards, in their order, into "sparse".
    sparse_features: dict[str, str] = field(default_factory=dict)
    dense_features: tuple[str, ...] = ()  # record dense features read, in order; () = all of the shards'
    bad_records: str = "stop"  # a record that breaks the schema: "stop" (one line naming it) | "skip"
    max_bad_records: int = 1000  # "skip": the most a run may skip; past it the run stops


SHARDING_TYPES = ("auto", "data_parallel", "table_wise", "row_wise", "column_wise", "two_d")
POOLING_TYPES = ("sum", "mean", "none")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table (`[embeddings.tables.NAME]`); the name is its key."""

    rows: int = 4096
    dim: int = 32
    dtype: str = "float32"  # storage: "float32" | "bfloat16" (updates are computed in fp32)
    initializer: str = "normal"  # "normal" (std = init_scale) | "uniform" (+-init_scale) | "zeros"
    init_scale: float = 0.05
    hashed: bool = True  # raw ids are hashed into [0, rows); false: ids outside [0, rows) look up nothing
    sharding: str = "auto"  # one of SHARDING_TYPES; "auto" lets the planner choose


@dataclass(frozen=True)
class FeatureConfig:
    """One sparse feature (`[embeddings.features.NAME]`): which table it reads and how bags pool."""

    table: str = ""
    pooling: str = "sum"  # "sum" | "mean" | "none" (sequences: one row per id, unpooled)
    # Longest bag the data should have (0: unknown). Where a device owns every row it looks up, bags
    # are then pooled by a fused gather + masked sum; a longer bag falls back to scatter-add (exact).
    max_bag_size: int = 0


@dataclass(frozen=True)
class EmbeddingConfig:
    """Embedding tables, features, their sharding and the sparse optimizer (gem_jax/embeddings/).

    With `tables` empty, the five keys below describe today's three tables (`items`, `actions`,
    `sparse`, all `dim` wide) and their features; naming `tables` (and `features`) replaces them.
    """

    dim: int = 32
    item_rows: int = 8192
    action_rows: int = 16
    sparse_rows: int = 4096
    pooling: str = "mean"  # "mean" | "sum" for non-sequence bags
    tables: dict[str, TableConfig] = field(default_factory=dict)
    features: dict[str, FeatureConfig] = field(default_factory=dict)
    optimizer: str = "row_wise_adagrad"  # "row_wise_adagrad" | "sgd" (sparse: only touched rows change)
    learning_rate: float = 0.05
    adagrad_eps: float = 1e-8
    adagrad_initial_accumulator: float = 0.0
    # Planner: the fast mesh axes (inside a host); empty = the data-parallel axes that `parallel` does
    # not list in `slow_axes` (when it lists some), else the last data-parallel axis. two_d tables are
    # row-sharded over them and replicated over the others (the slow axes).
    fast_axes: tuple[str, ...] = ()
    device_memory_gib: float = 0.0  # per-device budget; 0: the device's own limit (16 GiB where unknown)
    memory_fraction: float = 0.5  # share of that budget the tables and accumulators may use

    def resolved_tables(self) -> dict[str, TableConfig]:
        """`tables`, or today's three tables when it is empty."""
        if self.tables:
            return dict(self.tables)
        return {
            "items": TableConfig(rows=self.item_rows, dim=self.dim),
            "actions": TableConfig(rows=self.action_rows, dim=self.dim),
            "sparse": TableConfig(rows=self.sparse_rows, dim=self.dim),
        }

    def resolved_features(self) -> dict[str, FeatureConfig]:
        """`features`; else one feature per table, named after it (today's: `items` and `actions`
        unpooled sequences, `sparse` the salted bags of every sparse feature, pooled by `pooling`)."""
        if self.features:
            return dict(self.features)
        if self.tables:
            return {name: FeatureConfig(table=name, pooling=self.pooling) for name in self.tables}
        return {
            "items": FeatureConfig(table="items", pooling="none"),
            "actions": FeatureConfig(table="actions", pooling="none"),
            "sparse": FeatureConfig(table="sparse", pooling=self.pooling),
        }


@dataclass(frozen=True)
class ModelConfig:
    """The GEM-like model: HSTU sequence tower, Wukong interaction stack, per-task heads."""

    tasks: tuple[str, ...] = ("click", "conversion")
    model_dim: int = 64
    num_heads: int = 2
    attention_dim: int = 32  # per head, for Q and K
    value_dim: int = 32  # per head, for V and U
    num_layers: int = 2
    activation: str = "silu"  # "silu" (HSTU) | "softmax"
    layer: str = "hstu"  # "hstu" | "sasrec" (SASRec's block: softmax attention + ReLU feed-forward)
    attention_implementation: str = "auto"  # "auto" | "reference" | "pallas" | "interpret"
    # GPU kernels: the largest precomputed relative-bias array (H x T x max_seq_len, per layer, kept for the
    # backward) in GiB; 0: the kernels compute the bias (slower backward, no extra memory).
    attention_bias_rows_gib: float = 8.0
    max_attn_len: int = 0
    num_position_buckets: int = 64  # 0 disables the relative position bias
    num_time_buckets: int = 32  # 0 disables the relative time bias
    dropout: float = 0.0
    # Dropout on the attention weights (SASRec and HSTU drop them). The kernels have no weight dropout,
    # so a training step with it > 0 runs the padded jnp attention (O(B N^2) memory: short sequences).
    attention_dropout: float = 0.0
    num_context_tokens: int = 2  # non-sequence summaries prepended to the sequence (cross)
    num_summary_tokens: int = 2  # sequence summaries fed to the interaction stack (cross)
    wukong_layers: int = 2
    wukong_tokens: int = 8  # features carried between Wukong layers
    wukong_fm_rank: int = 8  # optimised FM: project tokens to this many before the pairwise dot
    head_hidden: int = 64
    # Long-history tower (gem_jax/model/long_history.py): BlockAttention over the whole history, full
    # jagged attention (targets, relative bias) over the context slots + the `recent_len` most recent
    # events + the candidates; optionally fewer tokens in deeper layers (pyramid).
    long_history: bool = False
    recent_len: int = 256  # most recent events per sequence that get full jagged attention
    block_size: int = 64  # BlockAttention block (tokens); <= 128 for the Pallas kernel
    pyramid: tuple[float, ...] = ()  # per layer: fraction of the most recent history kept; () = all


@dataclass(frozen=True)
class ParallelConfig:
    """Device mesh (following the network) and the logical-axis -> mesh-axis rules table.

    `mesh_axes` lists the axes slow to fast with their sizes in `mesh_shape` (-1: all remaining
    devices). The leading `slow_axes` of them cross hosts or slices (DCN, InfiniBand): their sizes
    multiply to the number of hosts. The others are fast (NVLink, ICI, inside one host or slice):
    their sizes multiply to the devices of one host. On a single host every axis lives inside it
    (a slow axis is then emulated by contiguous groups of devices). See `gem_jax/parallel.py`.
    """

    mesh_axes: tuple[str, ...] = ("data",)
    mesh_shape: tuple[int, ...] = (-1,)
    slow_axes: tuple[str, ...] = ()  # a prefix of mesh_axes, e.g. ("dcn",); empty: one host or slice
    # Logical axis name -> mesh axes (empty = replicated). Unlisted names are replicated.
    # "shard" is the leading axis of a batch (one jagged pack per data-parallel shard).
    rules: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"shard": ("data",)})


@dataclass(frozen=True)
class PrecisionConfig:
    """Per-layer dtypes. `overrides` maps a layer-name prefix to a compute dtype."""

    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    sensitive_dtype: str = "float32"  # heads, losses, LayerNorm statistics
    overrides: dict[str, str] = field(default_factory=dict)
    # FP8 GEMMs (gem_jax/model/fp8.py, docs/fp8.md): e4m3 inputs and weights, e5m2 output gradients, one
    # scale per tensor, on the Dense layers whose names start with a prefix in `fp8_layers` (never on
    # sensitive layers: task heads, logit layers; LayerNorms and embeddings are not Dense). Their output
    # dtype stays the layer's compute dtype.
    fp8: bool = False
    fp8_layers: tuple[str, ...] = ("hstu/", "wukong/")  # HSTU U/V/Q/K and output projections, Wukong MLPs
    fp8_recipe: str = "delayed"  # "delayed" (amax history) | "current" (this step's amax)
    fp8_amax_history: int = 1024  # steps of amax history (delayed recipe)
    fp8_margin: int = 0  # binades of headroom: scale = amax * 2^margin / fp8_max


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule, logging and checkpointing."""

    steps: int = 300
    seed: int = 0
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    end_learning_rate_fraction: float = 0.1
    weight_decay: float = 1e-4
    clip_norm: float = 1.0
    adam_b2: float = 0.999  # SASRec uses 0.98
    log_every: int = 10
    eval_every: int = 0  # ranking: validation every N steps (0: once, at the end); next-item: retrieval.*
    eval_batches: int = 0  # 0: all of data.eval_examples
    # The validation metric that picks the checkpoint kept in best/ (and scored on test where the task
    # has a test split): "" = the task's default (next-item: "sampled/NDCG@10"; ranking: none kept).
    select_metric: str = ""
    patience: int = 0  # evaluations without a better select_metric before stopping; 0: never
    max_minutes: float = 0.0  # time budget: stop at the first task boundary past it (0: none)
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    progress: bool = True


@dataclass(frozen=True)
class RetrievalConfig:
    """Next-item (retrieval) training on an interactions file (`data.kind = "interactions"`).

    One step takes `data.examples_per_shard` users per shard (fewer if `data.tokens_per_shard`
    fills first); every position of a user's training sequence predicts the next item.
    """

    format: str = "auto"  # "auto" | "pairs" (SASRec files) | "user_lines" (ICLRec files)
    max_len: int = 50  # each user's most recent items kept as model input
    position_embedding: bool = True  # learned absolute (distance-from-last) positions, as SASRec
    # "bce" (SASRec: one sampled negative per position) | "sampled_softmax" | "full_softmax" (every item)
    loss: str = "sampled_softmax"
    label_smoothing: float = 0.0  # full softmax: weight spread uniformly over all items
    negatives: str = "uniform"  # sampled softmax negatives: "uniform" | "in_batch" (the pack's targets)
    num_negatives: int = 128  # uniform negatives per pack, shared by its positions (sampled softmax)
    temperature: float = 0.05  # sampled softmax logits are score / temperature
    normalize: bool = True  # L2-normalise user vectors and item embeddings (sampled softmax, eval)
    epochs: int = 200  # a run's length; an epoch ends a task boundary (evaluation, time budget)
    eval_every_epochs: int = 1
    eval_protocol: str = "both"  # "sampled" (100 negatives) | "full" (all items) | "both"
    eval_negatives: int = 100
    eval_users: int = 0  # 0: all evaluated users; else a fixed random subset (quick runs)
    exclude_history: bool = False  # full ranking: drop the user's own items from the candidates
    # (ICLRec's evaluation code does); the "full_incl_history/" metrics then report the other setting


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- validation


def _check_value(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Returns `value` converted to `annotation`'s type, or raises ConfigError naming key and source."""
    origin = typing.get_origin(annotation)

    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{source}: `{key}` must be {expected}, got {type(value).__name__} {value!r}")

    if annotation is bool:
        if not isinstance(value, bool):
            raise fail("a boolean")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise fail("a string")
        return value
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise fail("a list")
        return tuple(_check_value(v, item_type, f"{key}[{i}]", source) for i, v in enumerate(value))
    if origin is dict:
        _, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise fail("a table")
        return {str(k): _check_value(v, value_type, f"{key}.{k}", source) for k, v in value.items()}
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise fail("a table")
        return _build(annotation, value, f"{key}.", source)
    raise TypeError(f"unsupported config annotation {annotation!r} for {key}")


def _build(cls: type, values: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{source}: unknown key `{key}` (known: {known})")
        kwargs[name] = _check_value(value, hints[name], key, source)
    return cls(**kwargs)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if (
            isinstance(v, dict)
            and isinstance(out.get(k), dict)
            and k not in ("rules", "overrides", "sparse_features")
        ):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parses `a.b=value`; the value is read as TOML (so 3, 1e-3, true, [1, 2], "x"), else a bare string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: `{part}` is not a table")
    node[path[-1]] = value


def _check_choices(choices: dict[str, tuple[Any, tuple]], source: str) -> None:
    """`{key: (value, allowed values)}`: a ConfigError naming the first key whose value is not allowed."""
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{source}: `{key}` must be one of {allowed}, got {value!r}")


def _check_positive(values: dict[str, int | float], source: str) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{source}: `{key}` must be positive, got {value}")


def validate(config: Config, source: str) -> Config:
    """Cross-field checks that types alone cannot express."""
    m, d = config.model, config.data
    choices = {
        "model.activation": (m.activation, ("silu", "softmax")),
        "model.layer": (m.layer, ("hstu", "sasrec")),
        "model.attention_implementation": (
            m.attention_implementation,
            ("auto", "reference", "pallas", "interpret"),
        ),
        "embeddings.pooling": (config.embeddings.pooling, ("mean", "sum")),
        "data.kind": (d.kind, ("synthetic", "records", "interactions")),
    }
    _check_choices(choices, source)
    _validate_ranges(config, source)
    longest = d.max_history_len + d.num_candidates + m.num_context_tokens
    if d.tokens_per_shard < longest:
        raise ConfigError(
            f"{source}: `data.tokens_per_shard` ({d.tokens_per_shard}) is smaller than one example's "
            f"longest sequence ({longest} = max_history_len + num_candidates + num_context_tokens)"
        )
    p = config.parallel
    if len(p.mesh_axes) != len(p.mesh_shape):
        raise ConfigError(
            f"{source}: `parallel.mesh_axes` {p.mesh_axes} and `parallel.mesh_shape` {p.mesh_shape} "
            "differ in length"
        )
    for name, axes in p.rules.items():
        for axis in axes:
            if axis not in p.mesh_axes:
                raise ConfigError(
                    f"{source}: `parallel.rules.{name}` maps to mesh axis {axis!r}, not in {p.mesh_axes}"
                )
    if p.slow_axes != p.mesh_axes[: len(p.slow_axes)]:
        raise ConfigError(
            f"{source}: `parallel.slow_axes` {p.slow_axes} must be the leading axes of "
            f"`parallel.mesh_axes` {p.mesh_axes} (axes are listed slow to fast)"
        )
    if p.mesh_shape.count(-1) > 1 or any(n == 0 or n < -1 for n in p.mesh_shape):
        raise ConfigError(
            f"{source}: `parallel.mesh_shape` {p.mesh_shape} must hold positive sizes and at most one -1"
        )
    if not m.tasks:
        raise ConfigError(f"{source}: `model.tasks` must name at least one task")
    _validate_long_history(config, source)
    _validate_embeddings(config, source)
    _validate_selection(config, source)
    _validate_precision(config, source)
    if d.kind == "interactions":
        _validate_retrieval(config, source)
    _validate_records(config, source)
    return config


def _validate_records(config: Config, source: str) -> None:
    """The `data` keys of ranking records (`data.kind = "records"`); what the shards hold is checked
    against them when the task opens the shards (gem_jax/data/records/dataset.py)."""
    d = config.data
    _check_choices({"data.bad_records": (d.bad_records, ("stop", "skip"))}, source)
    if d.kind != "records":
        named = [k for k in ("eval_path", "test_path", "sparse_features", "dense_features") if getattr(d, k)]
        if named:
            raise ConfigError(f'{source}: `data.{named[0]}` is read only with data.kind = "records"')
        if d.max_history_len < 1:
            raise ConfigError(f"{source}: `data.max_history_len` must be >= 1, got {d.max_history_len}")
        return
    if not d.path:
        raise ConfigError(f'{source}: `data.path` must name the training shards for data.kind = "records"')
    if d.sparse_features and len(d.sparse_features) != d.num_sparse_features:
        raise ConfigError(
            f"{source}: `data.sparse_features` names {len(d.sparse_features)} features, "
            f"`data.num_sparse_features` is {d.num_sparse_features}: they must agree"
        )
    if d.dense_features and len(d.dense_features) != d.num_dense_features:
        raise ConfigError(
            f"{source}: `data.dense_features` names {len(d.dense_features)} features, "
            f"`data.num_dense_features` is {d.num_dense_features}: they must agree"
        )
    if config.train.select_metric and not d.eval_path:
        raise ConfigError(f"{source}: `train.select_metric` needs `data.eval_path` (the validation shards)")


RANKING_METRICS = ("auc", "ne")


def _validate_selection(config: Config, source: str) -> None:
    """`train.select_metric`, `train.patience` and `train.max_minutes` (the loop's stopping rules)."""
    t = config.train
    metric = t.select_metric
    if config.data.kind == "interactions":
        r = config.retrieval
        metric = metric or "sampled/NDCG@10"
        if metric not in SELECT_METRICS:
            raise ConfigError(
                f"{source}: `train.select_metric` must be one of {SELECT_METRICS}, got {metric!r}"
            )
        protocol = metric.split("/")[0]
        if r.eval_protocol not in ("both", protocol):
            raise ConfigError(
                f"{source}: `train.select_metric` {metric!r} needs "
                f'`retrieval.eval_protocol` "{protocol}" or "both", got {r.eval_protocol!r}'
            )
        return
    allowed = tuple(f"{task}/{m}" for task in config.model.tasks for m in RANKING_METRICS)
    if metric and metric not in allowed:
        raise ConfigError(f'{source}: `train.select_metric` must be "" or one of {allowed}, got {metric!r}')
    if t.patience and not metric:
        raise ConfigError(f"{source}: `train.patience` needs `train.select_metric` (the metric to watch)")


def _validate_long_history(config: Config, source: str) -> None:
    """Checks of the long-history tower options (`model.long_history` and friends)."""
    m = config.model
    if not m.long_history:
        if m.pyramid:
            raise ConfigError(f"{source}: `model.pyramid` {m.pyramid} needs `model.long_history = true`")
        return
    if m.attention_dropout > 0:
        raise ConfigError(
            f"{source}: `model.attention_dropout` ({m.attention_dropout}) is not implemented for "
            "`model.long_history = true` (it needs the padded attention; histories there are long)"
        )
    if m.block_size > 128 and m.attention_implementation != "reference":
        raise ConfigError(
            f"{source}: `model.block_size` ({m.block_size}) must be <= 128 for the Pallas BlockAttention "
            f'kernel (attention_implementation={m.attention_implementation!r}); use "reference" for more'
        )
    if m.pyramid:
        if len(m.pyramid) != m.num_layers:
            raise ConfigError(
                f"{source}: `model.pyramid` has {len(m.pyramid)} fractions, expected one per "
                f"layer (model.num_layers = {m.num_layers})"
            )
        if any(b > a for a, b in zip(m.pyramid, m.pyramid[1:])):
            raise ConfigError(
                f"{source}: `model.pyramid` must be non-increasing (deeper layers keep "
                f"fewer tokens), got {m.pyramid}"
            )


def _validate_embeddings(config: Config, source: str) -> None:
    """Checks of the `[embeddings]` section: tables, features, optimizer and planner keys."""
    e = config.embeddings
    choices = {
        "embeddings.optimizer": (e.optimizer, ("row_wise_adagrad", "sgd")),
    }
    for name, t in e.tables.items():
        choices[f"embeddings.tables.{name}.dtype"] = (t.dtype, ("float32", "bfloat16"))
        choices[f"embeddings.tables.{name}.initializer"] = (t.initializer, ("normal", "uniform", "zeros"))
        choices[f"embeddings.tables.{name}.sharding"] = (t.sharding, SHARDING_TYPES)
    for name, f in e.features.items():
        choices[f"embeddings.features.{name}.pooling"] = (f.pooling, POOLING_TYPES)
    _check_choices(choices, source)
    positive = {}  # the top-level numeric keys are in RANGES; the per-table ones are checked here
    for name, t in e.tables.items():
        positive[f"embeddings.tables.{name}.rows"] = t.rows
        positive[f"embeddings.tables.{name}.dim"] = t.dim
    _check_positive(positive, source)
    for n, f in e.features.items():
        if f.max_bag_size < 0:
            raise ConfigError(
                f"{source}: `embeddings.features.{n}.max_bag_size` must be >= 0, got {f.max_bag_size}"
            )
    if e.features and not e.tables:
        raise ConfigError(f"{source}: `embeddings.features` needs `embeddings.tables` to name their tables")
    tables = e.resolved_tables()
    for name, f in e.features.items():
        if f.table not in tables:
            raise ConfigError(
                f"{source}: `embeddings.features.{name}.table` is {f.table!r}, not one of the tables "
                f"{tuple(tables)}"
            )
    for axis in e.fast_axes:
        if axis not in config.parallel.mesh_axes:
            raise ConfigError(
                f"{source}: `embeddings.fast_axes` names {axis!r}, not in `parallel.mesh_axes` "
                f"{config.parallel.mesh_axes}"
            )


def _validate_precision(config: Config, source: str) -> None:
    """Checks of the FP8 options in `[precision]` (dtype names are checked by `PrecisionPolicy`)."""
    p = config.precision
    if p.fp8_recipe not in ("delayed", "current"):
        raise ConfigError(
            f"{source}: `precision.fp8_recipe` must be one of ('delayed', 'current'), got {p.fp8_recipe!r}"
        )
    for i, prefix in enumerate(p.fp8_layers):
        if not prefix:
            raise ConfigError(f"{source}: `precision.fp8_layers[{i}]` is empty (it would name every layer)")


SELECT_METRICS = tuple(
    f"{protocol}/{name}@{k}"
    for protocol, ks in (("sampled", (10,)), ("full", (5, 10, 20)))
    for k in ks
    for name in ("HR", "NDCG")
)


def _validate_retrieval(config: Config, source: str) -> None:
    """Checks of the `[retrieval]` section, only when the data is an interactions file."""
    r, d = config.retrieval, config.data
    choices = {
        "retrieval.format": (r.format, ("auto", "pairs", "user_lines")),
        "retrieval.loss": (r.loss, ("bce", "sampled_softmax", "full_softmax")),
        "retrieval.negatives": (r.negatives, ("uniform", "in_batch")),
        "retrieval.eval_protocol": (r.eval_protocol, ("sampled", "full", "both")),
    }
    _check_choices(choices, source)
    if r.label_smoothing > 0 and r.loss != "full_softmax":
        raise ConfigError(
            f'{source}: `retrieval.label_smoothing` ({r.label_smoothing}) needs `retrieval.loss = "full_softmax"`'
        )
    if not d.path:
        raise ConfigError(
            f'{source}: `data.path` must name the interactions file for data.kind = "interactions"'
        )
    if d.tokens_per_shard < r.max_len:
        raise ConfigError(
            f"{source}: `data.tokens_per_shard` ({d.tokens_per_shard}) is smaller than "
            f"`retrieval.max_len` ({r.max_len})"
        )


# ----------------------------------------------------------------------------- numeric ranges


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric setting: low <= x (low < x if low_open), and likewise for high."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x: int | float) -> bool:
        if self.low is not None and not (x > self.low if self.low_open else x >= self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (
            f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        )


AT_LEAST_0 = Range(0.0)
AT_LEAST_1 = Range(1.0)
POSITIVE = Range(0.0, low_open=True)
FRACTION = Range(0.0, 1.0)
BELOW_1 = Range(0.0, 1.0, high_open=True)

# Every int and float setting (and each element of a tuple of them) with its valid range; a test checks
# that no numeric field of the schema is missing here. 0 means "off" where the schema's comment says so.
RANGES: dict[str, Range] = {
    "data.seed": AT_LEAST_0,
    "data.num_items": AT_LEAST_1,
    "data.zipf_exponent": POSITIVE,
    "data.num_actions": AT_LEAST_1,
    "data.latent_dim": AT_LEAST_1,
    "data.history_len_mean": POSITIVE,
    "data.history_len_sigma": AT_LEAST_0,
    "data.max_history_len": AT_LEAST_0,  # 0 (records only): the history removed
    "data.empty_history_fraction": FRACTION,
    "data.num_candidates": AT_LEAST_1,
    "data.num_sparse_features": AT_LEAST_0,
    "data.sparse_vocab": AT_LEAST_1,
    "data.max_bag_size": AT_LEAST_1,
    "data.num_dense_features": AT_LEAST_0,
    "data.examples_per_shard": AT_LEAST_1,
    "data.tokens_per_shard": AT_LEAST_1,
    "data.eval_examples": AT_LEAST_1,
    "data.num_workers": AT_LEAST_0,
    "data.max_bad_records": AT_LEAST_0,
    "embeddings.dim": AT_LEAST_1,
    "embeddings.item_rows": AT_LEAST_1,
    "embeddings.action_rows": AT_LEAST_1,
    "embeddings.sparse_rows": AT_LEAST_1,
    "embeddings.learning_rate": POSITIVE,
    "embeddings.adagrad_eps": POSITIVE,
    "embeddings.adagrad_initial_accumulator": AT_LEAST_0,
    "embeddings.device_memory_gib": AT_LEAST_0,  # 0: the device's own limit
    "embeddings.memory_fraction": Range(0.0, 1.0, low_open=True),
    "model.model_dim": AT_LEAST_1,
    "model.num_heads": AT_LEAST_1,
    "model.attention_dim": AT_LEAST_1,
    "model.value_dim": AT_LEAST_1,
    "model.num_layers": AT_LEAST_1,
    "model.max_attn_len": AT_LEAST_0,
    "model.attention_bias_rows_gib": AT_LEAST_0,  # 0: off
    "model.num_position_buckets": AT_LEAST_0,
    "model.num_time_buckets": AT_LEAST_0,
    "model.dropout": BELOW_1,
    "model.attention_dropout": BELOW_1,
    "model.num_context_tokens": AT_LEAST_0,
    "model.num_summary_tokens": AT_LEAST_1,
    "model.wukong_layers": AT_LEAST_0,
    "model.wukong_tokens": AT_LEAST_1,
    "model.wukong_fm_rank": AT_LEAST_1,
    "model.head_hidden": AT_LEAST_1,
    "model.recent_len": AT_LEAST_1,
    "model.block_size": AT_LEAST_1,
    "model.pyramid": Range(0.0, 1.0, low_open=True),
    "parallel.mesh_shape": Range(-1.0),  # -1: all remaining devices; 0 is refused below
    "precision.fp8_amax_history": AT_LEAST_1,
    "precision.fp8_margin": AT_LEAST_0,
    "train.steps": AT_LEAST_1,
    "train.seed": AT_LEAST_0,
    "train.learning_rate": AT_LEAST_0,  # 0: a frozen model (tests use it); negative trains uphill
    "train.warmup_steps": AT_LEAST_0,
    "train.end_learning_rate_fraction": FRACTION,
    "train.weight_decay": AT_LEAST_0,
    "train.clip_norm": POSITIVE,
    "train.adam_b2": BELOW_1,
    "train.log_every": AT_LEAST_1,
    "train.eval_every": AT_LEAST_0,
    "train.eval_batches": AT_LEAST_0,
    "train.patience": AT_LEAST_0,
    "train.max_minutes": AT_LEAST_0,
    "train.checkpoint_every": AT_LEAST_0,
    "train.keep_checkpoints": AT_LEAST_1,
    "retrieval.max_len": AT_LEAST_1,
    "retrieval.num_negatives": AT_LEAST_1,
    "retrieval.temperature": POSITIVE,
    "retrieval.label_smoothing": BELOW_1,
    "retrieval.epochs": AT_LEAST_1,
    "retrieval.eval_every_epochs": AT_LEAST_1,
    "retrieval.eval_negatives": AT_LEAST_1,
    "retrieval.eval_users": AT_LEAST_0,
}


def _validate_ranges(config: Config, source: str) -> None:
    """Every numeric setting in its `RANGES` entry, floats finite (TOML allows nan and inf)."""
    for section, values in config.to_dict().items():
        for name, value in values.items():
            key = f"{section}.{name}"
            items = list(enumerate(value)) if isinstance(value, tuple) else [(None, value)]
            for i, x in items:
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    continue
                where = key if i is None else f"{key}[{i}]"
                if isinstance(x, float) and not math.isfinite(x):
                    raise ConfigError(f"{source}: `{where}` must be a finite number, got {x}")
                valid = RANGES.get(key)
                if valid is not None and x not in valid:
                    raise ConfigError(f"{source}: `{where}` must be {valid}, got {x}")
    if 0 in config.parallel.mesh_shape:
        shape = config.parallel.mesh_shape
        raise ConfigError(f"{source}: `parallel.mesh_shape` entries must be >= 1 or -1, got {shape}")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Loads a TOML file (or the defaults when `path` is None) and applies `key.sub=value` overrides."""
    values: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    config = _build(Config, values, "", source)
    if overrides:
        update: dict[str, Any] = {}
        for text in overrides:
            key_path, value = parse_override(text)
            _set_path(update, key_path, value)
        merged = _merge(config.to_dict(), update)
        config = _build(Config, merged, "", f"{source} with --set overrides")
        source = f"{source} with --set overrides"
    return validate(config, source)


def toml_value(v: Any) -> str:
    """One value as TOML (inline tables for dicts), as `--set key=VALUE` and config files read it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return (
            "{ " + ", ".join(f"{toml_value(str(k))} = {toml_value(x)}" for k, x in v.items()) + " }"
            if v
            else "{}"
        )
    if isinstance(v, float):
        return repr(v)
    return str(v)


def config_to_toml(config: Config) -> str:
    """Writes the resolved config as TOML (the run directory keeps it beside the checkpoints)."""
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        tables = {}
        for k, v in values.items():
            if isinstance(v, dict):
                tables[k] = v
            else:
                lines.append(f"{k} = {toml_value(v)}")
        for k, table in tables.items():
            lines.append(f"{k} = {toml_value(table)}")
        lines.append("")
    return "\n".join(lines)
