"""The one typed config schema: frozen dataclasses, TOML loading and `--set` overrides.

Every default lives here once, and every rule of a key lives beside its field:

* its type: `int`, `float`, `bool`, `str`, tuples and tables of them, or a `Literal` of the allowed
  values (a choice);
* `setting(default, RANGE)`: the valid range of a number (of each element of a tuple of numbers);
* `setting(..., may_change=True)`: the key may differ when a run resumes (the run record refuses a
  change of any other key, gem_jax/train/run_record.py);
* `setting(..., fingerprint=False)` (data.* only): the key does not decide which examples the
  synthetic generator produces, so it stays out of the run record's data fingerprint;
* an optional type (`tuple[str, ...] | None`): None is "not decided yet": the run decides when it starts
  and its run record keeps the decision (TOML has no null: an unset key is left out of the file).

`load_config` checks all of them as it reads each value, then the rules between keys (`validate`), so
the Python API refuses what the CLI refuses. A TOML file names only what it changes; an unknown key
or a bad value is a one-line `ConfigError` naming the key, what it must be and the file, which the CLI
turns into exit code 2. Adding a key is one line in its section, with its rules, for example
`feature_map: str = setting("", fingerprint=False)`, or
`kind: Literal["synthetic", "interactions", "records"] = "synthetic"` to add a choice; a rule between
keys is a few lines in `validate`. A numeric key needs a range (a test checks it); a dtype key takes
its type from gem_jax/dtypes.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gem_jax.dtypes import FloatDtype, TableDtype
from gem_jax.kernels import check_kernels
from gem_jax.paths import config_file


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and its source."""


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


AT_LEAST_0 = Range(0.0)  # 0 means "off" or "all" where the field's comment says so
AT_LEAST_1 = Range(1.0)
POSITIVE = Range(0.0, low_open=True)
FRACTION = Range(0.0, 1.0)
BELOW_1 = Range(0.0, 1.0, high_open=True)


def setting(
    default: Any = dataclasses.MISSING,
    valid: Range | None = None,
    *,
    factory: Any = dataclasses.MISSING,
    may_change: bool = False,
    fingerprint: bool = True,
) -> Any:
    """A dataclass field with its rules as metadata (see the module docstring).

    `may_change`: the value may differ between invocations of one run, because it changes how long,
    how often or how verbosely it trains, where it reads identical data, or which devices hold the
    arrays, not what a checkpoint holds or how the next step is computed.
    """
    metadata = {"range": valid, "may_change": may_change, "fingerprint": fingerprint}
    return field(default=default, default_factory=factory, metadata=metadata)


@dataclass(frozen=True)
class DataConfig:
    """Input data: the synthetic ads task (`kind="synthetic"`), ranking records from shards
    (`kind="records"`, docs/data.md) or next-item data from a file (`kind="interactions"`)."""

    kind: Literal["synthetic", "records", "interactions"] = "synthetic"
    # kind="interactions": the file; "records": the training shard set (a directory or a glob). A resume may
    # name another path to the same content (size and sha256; records: every shard's).
    path: str = setting("", may_change=True, fingerprint=False)
    seed: int = setting(0, AT_LEAST_0)
    # Synthetic ads task.
    num_items: int = setting(20_000, AT_LEAST_1)  # raw item id space (Zipf-distributed)
    zipf_exponent: float = setting(1.1, POSITIVE)
    num_actions: int = setting(4, AT_LEAST_1)  # action types of history events
    latent_dim: int = setting(8, AT_LEAST_1)  # dimension of the planted user/item factors
    # History lengths: "lognormal" (median history_len_mean, shape history_len_sigma) or "zipf" (P(n) ~
    # n^-history_len_zipf_alpha for n >= 1, times history_len_unit events: NVIDIA's HSTU benchmark draws
    # Zipf(1.2) items and interleaves an action token with each, so 2 tokens per draw); both cut below.
    history_len_distribution: Literal["lognormal", "zipf"] = "lognormal"
    history_len_mean: float = setting(30.0, POSITIVE)
    history_len_sigma: float = setting(1.0, AT_LEAST_0)
    history_len_zipf_alpha: float = setting(1.2, Range(1.0, low_open=True))
    history_len_unit: int = setting(1, AT_LEAST_1)
    # histories are cut to their most recent events; 0 (records only): the history removed (an ablation)
    max_history_len: int = setting(128, AT_LEAST_0)
    empty_history_fraction: float = setting(0.05, FRACTION)
    num_candidates: int = setting(1, AT_LEAST_1)  # candidate ads per example, appended as target tokens
    num_sparse_features: int = setting(3, AT_LEAST_0)  # non-sequence bags of ids
    sparse_vocab: int = setting(1000, AT_LEAST_1)
    max_bag_size: int = setting(4, AT_LEAST_1)
    num_dense_features: int = setting(8, AT_LEAST_0)
    # Batching: fixed capacities keep shapes static under jit.
    # Example capacity of one data-parallel shard's pack.
    examples_per_shard: int = setting(64, AT_LEAST_1, fingerprint=False)
    # (on Hopper a multiple of 8: otherwise every attention call copies q, k and v into 8-row groups)
    tokens_per_shard: int = setting(2048, AT_LEAST_1, fingerprint=False)  # token capacity of one shard's pack
    eval_examples: int = setting(4096, AT_LEAST_1, fingerprint=False)
    # How a step's packs are grouped (ranking): "off", shard g packs its own examples in order; "attention",
    # the step's examples regrouped over this process's packs so that every device gets about the same
    # attention work (gem_jax/data/balance.py). The same examples per step either way.
    balance: Literal["off", "attention"] = setting("off", fingerprint=False)
    # Grain worker processes generating train examples (0: in the main process). Not `may_change`: each
    # worker packs its own slice of the example stream, so the count decides which examples a batch
    # holds, and the saved data position is one per worker.
    num_workers: int = setting(0, AT_LEAST_0, fingerprint=False)
    # Packs each grain worker may hold ready (grain's per_worker_buffer_size). The synthetic generator draws
    # 64 examples at a time, and with one pack of slack every worker drew its next block in the same step:
    # gem_long (~12 packs per block) stalled ~3 s every ~135 steps. Enough packs to cover a block's draw
    # hide it; memory is workers x this x one pack of host RAM.
    worker_buffer_size: int = setting(8, AT_LEAST_1, may_change=True, fingerprint=False)
    # Records (kind="records"). The shards' own schema.json says what a record holds; these pick from it.
    eval_path: str = setting("", may_change=True, fingerprint=False)  # validation shard set ("" = none)
    # test shard set, scored once for the chosen checkpoint ("" = none)
    test_path: str = setting("", may_change=True, fingerprint=False)
    # Record sparse feature -> the embedding feature (`embeddings.features`) that pools it, in the order of
    # the model's feature tokens; {} = every sparse feature of the shards, in their order, into "sparse".
    sparse_features: dict[str, str] = setting(factory=dict)
    dense_features: tuple[str, ...] = ()  # record dense features read, in order; () = all of the shards'
    # a record that breaks the schema: "stop" (one line naming it) | "skip" (counted, capped)
    bad_records: Literal["stop", "skip"] = "stop"
    max_bad_records: int = setting(1000, AT_LEAST_0)  # "skip": the most a run may skip; past it the run stops


ShardingType = Literal["auto", "data_parallel", "table_wise", "row_wise", "column_wise", "two_d", "offload"]
Pooling = Literal["sum", "mean", "none"]
POOLINGS: tuple[str, ...] = typing.get_args(Pooling)


@dataclass(frozen=True)
class TableConfig:
    """One embedding table (`[embeddings.tables.NAME]`); the name is its key."""

    rows: int = setting(4096, AT_LEAST_1)
    dim: int = setting(32, AT_LEAST_1)
    dtype: TableDtype = "float32"  # storage (updates are computed in fp32)
    # "normal" (std = init_scale) | "uniform" (+-init_scale) | "zeros"
    initializer: Literal["normal", "uniform", "zeros"] = "normal"
    init_scale: float = setting(0.05, AT_LEAST_0)
    hashed: bool = True  # raw ids are hashed into [0, rows); false: ids outside [0, rows) look up nothing
    # "auto" lets the planner choose. Checkpoints hold tables as [rows, dim], whatever the sharding.
    sharding: ShardingType = setting("auto", may_change=True)
    # "offload" (chosen, or picked by the planner when the tables do not fit the budget): the table and
    # its accumulator in host memory, the hot rows in an HBM cache of `cache_rows` rows over all devices
    # (0: `cache_fraction` of the rows), which must hold every distinct row one batch looks up.
    cache_rows: int = setting(0, AT_LEAST_0, may_change=True)
    cache_fraction: float = setting(0.1, Range(0.0, 1.0, low_open=True), may_change=True)


@dataclass(frozen=True)
class FeatureConfig:
    """One sparse feature (`[embeddings.features.NAME]`): which table it reads and how bags pool."""

    table: str = ""
    pooling: Pooling = "sum"  # "none": sequences, one row per id, unpooled
    # Longest bag the data should have (0: unknown). Where a device owns every row it looks up, bags
    # are then pooled by a fused gather + masked sum; a longer bag falls back to scatter-add (exact).
    max_bag_size: int = setting(0, AT_LEAST_0)


@dataclass(frozen=True)
class EmbeddingConfig:
    """Embedding tables, features, their sharding and the sparse optimizer (gem_jax/embeddings/).

    With `tables` empty, the five keys below describe the three default tables (`items`, `actions`,
    `sparse`, all `dim` wide) and their features; naming `tables` (and `features`) replaces them.
    """

    dim: int = setting(32, AT_LEAST_1)
    item_rows: int = setting(8192, AT_LEAST_1)
    action_rows: int = setting(16, AT_LEAST_1)
    sparse_rows: int = setting(4096, AT_LEAST_1)
    pooling: Literal["mean", "sum"] = "mean"  # for non-sequence bags
    tables: dict[str, TableConfig] = field(default_factory=dict)
    features: dict[str, FeatureConfig] = field(default_factory=dict)
    # Sparse: only touched rows change.
    optimizer: Literal["row_wise_adagrad", "sgd"] = "row_wise_adagrad"
    learning_rate: float = setting(0.05, POSITIVE)
    adagrad_eps: float = setting(1e-8, POSITIVE)
    adagrad_initial_accumulator: float = setting(0.0, AT_LEAST_0)
    # Planner: the fast mesh axes (inside a host); empty = the data-parallel axes that `parallel` does
    # not list in `slow_axes` (when it lists some), else the last data-parallel axis. two_d tables are
    # row-sharded over them and replicated over the others (the slow axes).
    fast_axes: tuple[str, ...] = setting((), may_change=True)
    # Device memory per device, in GiB; 0: what the device reports (`bytes_limit` of its memory_stats(): the
    # memory jax's allocator may use, on GPUs XLA_PYTHON_CLIENT_MEM_FRACTION of the card), 16 GiB where it
    # reports none (CPU). The train step must fit it whole (gem_jax/train/memory.py).
    device_memory_gib: float = setting(0.0, AT_LEAST_0, may_change=True)
    # The most of it the tables and accumulators in device memory may use; the planner puts tables in host
    # memory (`offload`) when they need more, or when the rest of the step leaves them less.
    memory_fraction: float = setting(0.5, Range(0.0, 1.0, low_open=True), may_change=True)

    def resolved_tables(self) -> dict[str, TableConfig]:
        """`tables`, or the three default tables when it is empty."""
        if self.tables:
            return dict(self.tables)
        return {
            "items": TableConfig(rows=self.item_rows, dim=self.dim),
            "actions": TableConfig(rows=self.action_rows, dim=self.dim),
            "sparse": TableConfig(rows=self.sparse_rows, dim=self.dim),
        }

    def resolved_features(self) -> dict[str, FeatureConfig]:
        """`features`; else one feature per table, named after it (the default tables: `items` and
        `actions` unpooled sequences, `sparse` the salted bags of every sparse feature, pooled by
        `pooling`)."""
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
    model_dim: int = setting(64, AT_LEAST_1)
    num_heads: int = setting(2, AT_LEAST_1)
    attention_dim: int = setting(32, AT_LEAST_1)  # per head, for Q and K
    value_dim: int = setting(32, AT_LEAST_1)  # per head, for V and U
    num_layers: int = setting(2, AT_LEAST_1)
    activation: Literal["silu", "softmax"] = "silu"  # "silu": HSTU's
    layer: Literal["hstu", "sasrec"] = "hstu"  # "sasrec": SASRec's block (softmax attention + ReLU FFN)
    # Which kernel runs each op, one key per op: "auto", the op's ordered default for the platform (its
    # api.py DEFAULTS: the first backend that takes the call), or a backend by name (pallas_kernels/
    # implementations.py), refused when the config loads where it cannot run the model's calls. The same
    # function whichever runs, so a run may resume on another (e.g. GPU -> CPU). Train, bench and profile print
    # what runs, one line per op (gem_jax/kernels.py).
    # Jagged attention; "auto": Mosaic GPU on Hopper where it takes the call (forward and backward each), else
    # Triton; Triton on other GPUs; the TPU kernel; the reference on CPU.
    attention_implementation: Literal["auto", "mosaic", "triton", "tpu", "reference"] = setting(
        "auto", may_change=True
    )
    # GPU kernels: the largest precomputed relative-bias array (H x T x max_seq_len, per layer, kept for the
    # backward) in GiB; 0: the kernels compute the bias (slower backward, no extra memory). The same
    # function either way.
    attention_bias_rows_gib: float = setting(8.0, AT_LEAST_0, may_change=True)
    # BlockAttention over the older history (model.long_history); "auto": Triton on every GPU, the TPU kernel,
    # the reference on CPU.
    block_attention_implementation: Literal["auto", "triton", "tpu", "reference"] = setting(
        "auto", may_change=True
    )
    # The HSTU layers' norms (input norm with the residual's gradient, attention-output norm with the gate,
    # the final norm) as pallas_kernels.layer_norm's fused kernels or plain jnp ("reference"); "auto": on
    # every GPU the Triton ones where they take the width (Hopper included until the Mosaic GPU ones are
    # measured on the H200), else the reference; the reference on CPU and TPU.
    norm_implementation: Literal["auto", "mosaic", "triton", "reference"] = setting("auto", may_change=True)
    # SiLU's backward writing its gradient in FP8 (pallas_kernels.silu_backward_fp8), where an HSTU layer's
    # uvqk GEMM runs FP8 with precision.fp8_gemms = "backward"; "auto": Triton on every GPU where its tiles
    # fit (Hopper included until the Mosaic GPU kernel is measured), else the reference.
    silu_backward_fp8_implementation: Literal["auto", "mosaic", "triton", "reference"] = setting(
        "auto", may_change=True
    )
    # The HSTU layer's input norm, uvqk GEMM, bias, SiLU and split as one kernel (pallas_kernels.norm_gemm: the
    # norm applied to the GEMM's A tile in shared memory, bias + SiLU + split in its epilogue; its backward's
    # dX GEMM takes SiLU's derivative in). "off", the default (on the H200 both kernels ran slower than XLA,
    # docs/benchmarks.md): the norm kernel, XLA's GEMM, then SiLU. "auto": the Mosaic GPU kernel on Hopper
    # where its tiles fit the pack (a float32 residual stream, a 16-bit GEMM), else "off"; "mosaic" /
    # "reference": that one. Layers whose uvqk GEMM runs FP8, and model.frequency_mix (which reads the
    # normalised rows), keep the unfused path.
    uvqk_implementation: Literal["off", "auto", "mosaic", "reference"] = setting("off", may_change=True)
    # The kernels the keys above name ("mosaic", "triton", "tpu") run in Pallas's interpreter (on CPU: tests);
    # "auto" and "reference" keys are unaffected.
    interpret_kernels: bool = setting(False, may_change=True)
    max_attn_len: int = setting(0, AT_LEAST_0)
    num_position_buckets: int = setting(64, AT_LEAST_0)  # 0 disables the relative position bias
    num_time_buckets: int = setting(32, AT_LEAST_0)  # 0 disables the relative time bias
    dropout: float = setting(0.0, BELOW_1)
    # Dropout on the attention weights (SASRec and HSTU drop them). The kernels have no weight dropout,
    # so a training step with it > 0 runs the padded jnp attention (O(B N^2) memory: short sequences).
    attention_dropout: float = setting(0.0, BELOW_1)
    num_context_tokens: int = setting(2, AT_LEAST_0)  # non-sequence summaries prepended to the sequence
    num_summary_tokens: int = setting(2, AT_LEAST_1)  # sequence summaries fed to the interaction stack
    wukong_layers: int = setting(2, AT_LEAST_0)
    wukong_tokens: int = setting(8, AT_LEAST_1)  # features carried between Wukong layers
    wukong_fm_rank: int = setting(8, AT_LEAST_1)  # optimised FM: project tokens to this many first
    head_hidden: int = setting(64, AT_LEAST_1)
    # Long-history tower (gem_jax/model/long_history.py): BlockAttention over the whole history, full
    # jagged attention (targets, relative bias) over the context slots + the `recent_len` most recent
    # events + the candidates; optionally fewer tokens in deeper layers (pyramid).
    long_history: bool = False
    recent_len: int = setting(256, AT_LEAST_1)  # most recent events per sequence with full jagged attention
    # BlockAttention block (tokens); the Pallas kernels' limit is theirs (pallas_kernels/block_attention/block_sizes.py)
    block_size: int = setting(64, AT_LEAST_1)
    # Per layer: fraction of the most recent history kept; () = all.
    pyramid: tuple[float, ...] = setting((), Range(0.0, 1.0, low_open=True))
    # BSARec's frequency branch beside attention in every HSTU layer (gem_jax/model/frequency_filter.py):
    # the layer adds mix x filter + (1 - mix) x attention (BSARec's alpha; 0: no branch). The filter is not
    # causal: next-item data only, trained with `retrieval.train_targets = "last_of_prefixes"`.
    frequency_mix: float = setting(0.0, FRACTION)
    # Lowest real-FFT bins of the max_len window kept as the low-pass part (BSARec's c maps to c // 2 + 1).
    frequency_bins: int = setting(3, AT_LEAST_1)
    # A multi-level Haar wavelet branch with per-user band weights (after WEARec) beside attention in every HSTU
    # layer (gem_jax/model/wavelet_branch.py): the layer adds mix x wavelet branch (0: no branch), and attention
    # keeps 1 - frequency_mix - wavelet_mix. Not causal, as the frequency branch: next-item data trained with
    # `retrieval.train_targets = "last_of_prefixes"`.
    wavelet_mix: float = setting(0.0, FRACTION)
    wavelet_levels: int = setting(
        3, AT_LEAST_1
    )  # Haar levels: details of 2, 4, ... 2^levels items, block means
    # What mixes the tokens of a sequence in every HSTU layer: "attention" (the jagged attention with its
    # relative bias), or "time_variant": TV-Rec's time-variant causal convolution of V in place of attention (no
    # Q, K or relative bias; next-item data only; gem_jax/model/time_variant_conv.py). A position's filter is
    # chosen by its distance from the newest item and reads that item and the taps - 1 before it.
    sequence_mixer: Literal["attention", "time_variant"] = "attention"
    time_variant_taps: int = setting(0, AT_LEAST_0)  # 0: the whole retrieval.max_len window
    time_variant_basis: int = setting(32, AT_LEAST_1)  # basis filters the per-position filters are made from

    def kernel(self, op: str) -> tuple[str | None, bool]:
        """The (implementation=, interpret=) an op's kernel call takes for its key `model.{op}_implementation`
        ("attention", "block_attention", "norm", "silu_backward_fp8", "uvqk"): "auto" is None, the op's
        default order; a name runs in Pallas's interpreter where model.interpret_kernels says so. Read this,
        never the raw strings."""
        name = getattr(self, f"{op}_implementation")
        return (None, False) if name == "auto" else (name, self.interpret_kernels and name != "reference")

    def uvqk_fusable(self) -> bool:
        """Whether the layers' input norm can run inside their uvqk GEMM (pallas_kernels.norm_gemm): HSTU
        attention layers whose normalised rows nothing else reads (no frequency or wavelet branch)."""
        return (
            self.layer == "hstu"
            and self.sequence_mixer == "attention"
            and self.frequency_mix == 0
            and self.wavelet_mix == 0
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Device mesh (following the network) and the logical-axis -> mesh-axis rules table.

    `mesh_axes` lists the axes slow to fast with their sizes in `mesh_shape` (-1: all remaining
    devices). The leading `slow_axes` of them cross hosts or slices (DCN, InfiniBand): their sizes
    multiply to the number of hosts. The others are fast (NVLink, ICI, inside one host or slice):
    their sizes multiply to the devices of one host. On a single host every axis lives inside it
    (a slow axis is then emulated by contiguous groups of devices). See `gem_jax/parallel.py`.

    Every key may change on resume: checkpoints hold every array in a device-count-free form (tables as
    [rows, dim]), so a run resumes on another mesh (the global batch follows it).
    """

    mesh_axes: tuple[str, ...] = setting(("data",), may_change=True)
    # -1: all remaining devices (0 is refused by `validate`).
    mesh_shape: tuple[int, ...] = setting((-1,), Range(-1.0), may_change=True)
    # A prefix of mesh_axes, e.g. ("dcn",); empty: one host or slice.
    slow_axes: tuple[str, ...] = setting((), may_change=True)
    # Logical axis name -> mesh axes (empty = replicated). Unlisted names are replicated.
    # "shard" is the leading axis of a batch (one jagged pack per data-parallel shard).
    rules: dict[str, tuple[str, ...]] = setting(factory=lambda: {"shard": ("data",)}, may_change=True)


@dataclass(frozen=True)
class PrecisionConfig:
    """Per-layer dtypes (names in gem_jax/dtypes.py). `overrides` maps a layer-name prefix to a compute
    dtype."""

    param_dtype: FloatDtype = "float32"
    compute_dtype: FloatDtype = "bfloat16"
    sensitive_dtype: FloatDtype = "float32"  # heads, losses, LayerNorm statistics
    # The sequence tower's residual stream (the tokens between layers, and each layer's x + branch): float32,
    # or bfloat16 to halve the traffic of its adds and norms (issue: quality over 3 seeds before a default).
    # The norms' statistics stay float32, and the tower's output is float32 either way.
    residual_dtype: FloatDtype = "float32"
    overrides: dict[str, FloatDtype] = field(default_factory=dict)
    # FP8 GEMMs (gem_jax/model/fp8.py, docs/fp8.md): e4m3 inputs and weights, e5m2 output gradients, one
    # scale per tensor, on the Dense layers whose names start with a prefix in `fp8_layers` (never on
    # sensitive layers: task heads, logit layers; LayerNorms and embeddings are not Dense). Their output
    # dtype stays the layer's compute dtype. "auto": only the named layers whose GEMM shapes measured faster
    # in FP8 on this GPU kind; each layer asks the precision policy as it is built (gem_jax/precision.py).
    fp8: Literal[False, True, "auto"] = False
    fp8_layers: tuple[str, ...] = ("hstu/", "wukong/")  # HSTU U/V/Q/K and output projections, Wukong MLPs
    # What "auto" chose: the exact names of the layers it put in FP8. Unset, the measured table decides; the
    # trainer writes the choice into the run record (config.toml) when a run starts, so a resume or `eval`
    # builds the same layers on any GPU (an unset value takes the recorded one; a different one is refused).
    fp8_auto_choice: tuple[str, ...] | None = None
    fp8_recipe: Literal["delayed", "current"] = "delayed"  # amax history, or this step's amax
    fp8_amax_history: int = setting(1024, AT_LEAST_1)  # steps of amax history (delayed recipe)
    # Binades of headroom: scale = amax * 2^margin / fp8_max, rounded up to a power of two. 1 (2x headroom for
    # an amax that outgrows the history): on gem_h200 it kept click and conversion NE and AUC within the seed
    # spread of bf16 over 3 seeds, where 0 lost 0.0012 conversion AUC (docs/fp8.md, "Status on the H200";
    # measured before the scales were powers of two).
    fp8_margin: int = setting(1, AT_LEAST_0)
    # Which GEMMs of an FP8 layer run in FP8: "all" (Y, dX, dW), or "backward" (dX and dW; the forward GEMM
    # stays in the compute dtype). "backward" exists because the H200's FP8 GEMM writes float32, whose cast
    # costs more than FP8 saves on a forward GEMM of width 512; where SiLU follows the layer (HSTU's uvqk) the
    # gradient is quantised inside SiLU's backward kernel (docs/fp8.md).
    fp8_gemms: Literal["all", "backward"] = "all"


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule, logging and checkpointing."""

    # A longer or shorter run (ranking: the learning-rate schedule follows it).
    steps: int = setting(300, AT_LEAST_1, may_change=True)
    seed: int = setting(0, AT_LEAST_0)
    learning_rate: float = setting(3e-3, AT_LEAST_0)  # 0: a frozen model (tests use it)
    warmup_steps: int = setting(30, AT_LEAST_0)
    end_learning_rate_fraction: float = setting(0.1, FRACTION)
    weight_decay: float = setting(1e-4, AT_LEAST_0)
    clip_norm: float = setting(1.0, POSITIVE)
    adam_b2: float = setting(0.999, BELOW_1)  # SASRec uses 0.98
    log_every: int = setting(10, AT_LEAST_1, may_change=True)
    # Ranking: validation every N steps (0: once, at the end); next-item: retrieval.*.
    eval_every: int = setting(0, AT_LEAST_0, may_change=True)
    eval_batches: int = setting(0, AT_LEAST_0)  # 0: all of data.eval_examples
    # The validation metric that picks the checkpoint kept in best/ (and scored on test where the task
    # has a test split): "" = the task's default (next-item: "sampled/NDCG@10"; ranking: none kept).
    select_metric: str = ""
    # Evaluations without a better select_metric before stopping; 0: never.
    patience: int = setting(0, AT_LEAST_0, may_change=True)
    # Time budget: stop at the first task boundary past it (0: none).
    max_minutes: float = setting(0.0, AT_LEAST_0, may_change=True)
    checkpoint_every: int = setting(100, AT_LEAST_0, may_change=True)
    keep_checkpoints: int = setting(3, AT_LEAST_1, may_change=True)
    async_checkpointing: bool = setting(True, may_change=True)
    progress: bool = setting(True, may_change=True)
    # A stalled run ends (exit 76, every thread's stack in WORKDIR/stalled-<process>.txt) when no step
    # finished for this long; evaluations and saves are not counted (gem_jax/train/watchdog.py). 0: off.
    stall_timeout_s: float = setting(900.0, AT_LEAST_0, may_change=True)
    first_step_timeout_s: float = setting(3600.0, AT_LEAST_0, may_change=True)  # it compiles the step
    # JAX's persistent compilation cache (gem_jax/train/compile_cache.py): "auto" ($JAX_COMPILATION_CACHE_DIR
    # when set, else $XDG_CACHE_HOME/gem-jax/xla, i.e. ~/.cache/gem-jax/xla), "off", or a folder. A second
    # run of a config on the same machine loads its compiled programs from it instead of compiling again.
    compilation_cache: str = setting("auto", may_change=True)
    # Refuse a run whose step does not fit the device's memory (gem_jax/train/memory.py): before compiling
    # it (an estimate) and after (XLA's own figure). false: no check; a run that does not fit then fails at
    # its first step.
    check_memory: bool = setting(True, may_change=True)


@dataclass(frozen=True)
class RetrievalConfig:
    """Next-item (retrieval) training on an interactions file (`data.kind = "interactions"`).

    One step takes `data.examples_per_shard` users per shard (fewer if `data.tokens_per_shard`
    fills first); every position of a user's training sequence predicts the next item.
    """

    format: Literal["auto", "pairs", "user_lines"] = "auto"  # pairs: SASRec files; user_lines: ICLRec's
    max_len: int = setting(50, AT_LEAST_1)  # each user's most recent items kept as model input
    position_embedding: bool = True  # learned absolute (distance-from-last) positions, as SASRec
    # "bce" (SASRec: one sampled negative per position) | "sampled_softmax" | "full_softmax" (every item)
    loss: Literal["bce", "sampled_softmax", "full_softmax"] = "sampled_softmax"
    label_smoothing: float = setting(0.0, BELOW_1)  # full softmax: weight spread uniformly over all items
    # Sampled softmax negatives: "in_batch" uses the pack's targets.
    negatives: Literal["uniform", "in_batch"] = "uniform"
    num_negatives: int = setting(128, AT_LEAST_1)  # uniform negatives per pack, shared by its positions
    temperature: float = setting(0.05, POSITIVE)  # sampled softmax logits are score / temperature
    normalize: bool = True  # L2-normalise user vectors and item embeddings (sampled softmax, eval)
    # A run's length; an epoch ends a task boundary (evaluation, time budget).
    epochs: int = setting(200, AT_LEAST_1, may_change=True)
    eval_every_epochs: int = setting(1, AT_LEAST_1, may_change=True)
    # "sampled": 100 negatives; "full": all items.
    eval_protocol: Literal["sampled", "full", "both"] = "both"
    eval_negatives: int = setting(100, AT_LEAST_1)
    eval_users: int = setting(
        0, AT_LEAST_0
    )  # 0: all evaluated users; else a fixed random subset (quick runs)
    exclude_history: bool = False  # full ranking: drop the user's own items from the candidates
    # (ICLRec's evaluation code does); the "full_incl_history/" metrics then report the other setting
    # Which positions train: "all_positions", every token of a user's sequence predicts the next item
    # (causal models); "last_of_prefixes", every prefix of it is an example that predicts only the item
    # after its last token (the same pairs, as BSARec's and FMLP-Rec's loaders; a non-causal model needs it).
    train_targets: Literal["all_positions", "last_of_prefixes"] = "all_positions"
    # Contrastive auxiliary loss (CL4SRec's): two augmented views of each training example, InfoNCE between
    # the user vectors of the views over the pack's examples, added with this weight (0: off).
    contrastive_weight: float = setting(0.0, AT_LEAST_0)
    contrastive_temperature: float = setting(0.1, POSITIVE)  # InfoNCE logits are similarity / temperature
    # The augmentations, one drawn per view (gem_jax/data/augment.py): a crop keeps this fraction of the
    # items (a contiguous run), a mask hides this fraction, a reorder shuffles a run of this fraction.
    augment_crop_keep: float = setting(0.6, Range(0.0, 1.0, low_open=True))
    augment_mask_fraction: float = setting(0.3, FRACTION)
    augment_reorder_fraction: float = setting(0.3, FRACTION)
    # The vector of a view (and, for the intent loss, of a sequence): "last", the user vector at its newest
    # item; "mean", the mean of its per-position user vectors (ICLRec's sequence representation),
    # L2-normalised again when `normalize` is on.
    contrastive_pooling: Literal["last", "mean"] = "last"
    # Whether the views are encoded with the model's dropout (CL4SRec's and ICLRec's training mode); false:
    # without (the gradient still flows). At model.dropout 0.5 the dropout noise hides which view is whose
    # (the InfoNCE stays at chance, docs/results.md); without it the views are told apart.
    contrastive_dropout: bool = True
    # ICLRec's intent contrastive loss (Chen et al. 2022): every `intent_every_epochs` epochs (at the epoch's
    # start) every training example is encoded (no dropout, `contrastive_pooling`) and k-means
    # (`intent_clusters` centroids, `intent_kmeans_iterations` Lloyd iterations) finds the intents; each
    # step assigns every example its nearest centroid (from the training forward, no gradient) and adds, with
    # this weight (0: off), InfoNCE between each augmented view and its example's L2-normalised centroid
    # (logits / contrastive_temperature; the other examples' views and centroids are the negatives).
    intent_weight: float = setting(0.0, AT_LEAST_0)
    intent_clusters: int = setting(256, Range(2.0))
    intent_every_epochs: int = setting(1, AT_LEAST_1)
    intent_kmeans_iterations: int = setting(20, AT_LEAST_1)
    # ICLRec's --de_noise: examples of the same intent are not each other's negatives (its published Beauty
    # and Sports scripts run without it).
    intent_denoise: bool = False
    # Frequency-domain contrastive loss (after FICLRec): two views of each training example made by removing a
    # random band of its embedded sequence's spectrum (gem_jax/model/spectral_views.py), InfoNCE between their
    # vectors (contrastive_pooling, contrastive_temperature, contrastive_dropout) added with this weight (0: off).
    frequency_contrastive_weight: float = setting(0.0, AT_LEAST_0)
    # The fraction of the max_len // 2 non-constant real-FFT bins a view loses (a contiguous band).
    frequency_contrastive_band: float = setting(0.5, Range(0.0, 1.0, low_open=True))


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


def schema_keys(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """Every key of the schema as (key, type, field), in schema order. The sections of a table of named
    sections (`embeddings.tables`) contribute their keys once, as `embeddings.tables.*.rows`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], prefix + f.name
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            yield from schema_keys(hint, f"{key}.")
        elif typing.get_origin(hint) is dict and dataclasses.is_dataclass(args[1]):
            yield from schema_keys(args[1], f"{key}.*.")
        else:
            yield key, hint, f


# ----------------------------------------------------------------------------- reading values

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _subkey(key: str, name: str) -> str:
    """`key.name`, the name quoted as TOML quotes it where it is not a bare key (`overrides."hstu/"`)."""
    return f"{key}.{name}" if _BARE_KEY.fullmatch(name) else f"{key}.{json.dumps(name)}"


def _check_value(value: Any, annotation: Any, key: str, source: str, valid: Range | None = None) -> Any:
    """Returns `value` converted to `annotation`'s type, or raises ConfigError naming key and source.

    A `Literal` annotation allows only its values; `valid` is the range of a number, or of each number
    of a tuple. Floats must be finite (TOML allows nan and inf).
    """
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # `T | None`: None is "not decided yet"
        (decided,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return None if value is None else _check_value(value, decided, key, source, valid)
    # Module-level helpers, not closures: the test suite's shape checker wraps each function definition
    # as it executes, so a closure here would be wrapped again for every value (milliseconds each).
    fail = functools.partial(_must_be, value=value, key=key, source=source)
    in_range = functools.partial(_in_range, valid=valid, key=key, source=source)

    if origin is Literal:
        allowed = typing.get_args(annotation)
        if not any(type(value) is type(a) and value == a for a in allowed):  # true is not 1, "1" not 1
            raise ConfigError(f"{source}: `{key}` must be one of {allowed}, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise fail("a boolean")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
        return in_range(value)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("a number")
        return in_range(float(value))
    if annotation is str:
        if not isinstance(value, str):
            raise fail("a string")
        return value
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise fail("a list")
        return tuple(_check_value(v, item_type, f"{key}[{i}]", source, valid) for i, v in enumerate(value))
    if origin is dict:
        _, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise fail("a table")
        return {str(k): _check_value(v, value_type, _subkey(key, str(k)), source) for k, v in value.items()}
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise fail("a table")
        return _build(annotation, value, f"{key}.", source)
    raise TypeError(f"unsupported config annotation {annotation!r} for {key}")


def _must_be(expected: str, *, value: Any, key: str, source: str) -> ConfigError:
    return ConfigError(f"{source}: `{key}` must be {expected}, got {type(value).__name__} {value!r}")


def _in_range(x: int | float, *, valid: Range | None, key: str, source: str) -> int | float:
    if isinstance(x, float) and not math.isfinite(x):
        raise ConfigError(f"{source}: `{key}` must be a finite number, got {x}")
    if valid is not None and x not in valid:
        raise ConfigError(f"{source}: `{key}` must be {valid}, got {x}")
    return x


def _build(cls: type, values: dict[str, Any], prefix: str, source: str) -> Any:
    """`cls(**values)`, each value checked against its field's type and range."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{source}: unknown key `{key}` (known: {known})")
        kwargs[name] = _check_value(value, hints[name], key, source, fields[name].metadata.get("range"))
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


# ----------------------------------------------------------------------------- rules between keys


def validate(config: Config, source: str) -> Config:
    """The rules between keys (each key's own type, choices and range are checked as it is read)."""
    m, d = config.model, config.data
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
    if p.mesh_shape.count(-1) > 1 or 0 in p.mesh_shape:
        raise ConfigError(
            f"{source}: `parallel.mesh_shape` {p.mesh_shape} must hold positive sizes and at most one -1"
        )
    if not m.tasks:
        raise ConfigError(f"{source}: `model.tasks` must name at least one task")
    if m.uvqk_implementation not in ("off", "auto") and not m.uvqk_fusable():
        raise ConfigError(
            f"{source}: `model.uvqk_implementation = {m.uvqk_implementation!r}` fuses the HSTU layer's input norm "
            f'into its uvqk GEMM: it needs model.layer = "hstu" (got {m.layer!r}), model.sequence_mixer = '
            f'"attention" (got {m.sequence_mixer!r}) and no model.frequency_mix or model.wavelet_mix (got '
            f"{m.frequency_mix}, {m.wavelet_mix}), which read the normalised rows"
        )
    _validate_long_history(config, source)
    _validate_frequency_filter(config, source)
    _validate_wavelet_branch(config, source)
    _validate_sequence_mixer(config, source)
    _validate_embeddings(config, source)
    _validate_selection(config, source)
    _validate_precision(config, source)
    if d.kind == "interactions":
        _validate_retrieval(config, source)
    _validate_records(config, source)
    _validate_kernels(config, source)
    return config


def _validate_kernels(config: Config, source: str) -> None:
    """Every op's kernel setting can run the model's calls: a named backend that does not take them, or an
    "auto" whose default order has none that does on some platform, is refused here, not at the first step."""
    try:
        check_kernels(config)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _validate_records(config: Config, source: str) -> None:
    """The `data` keys of ranking records (`data.kind = "records"`); what the shards hold is checked
    against them when the task opens the shards (gem_jax/data/records/dataset.py)."""
    d = config.data
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


def _validate_frequency_filter(config: Config, source: str) -> None:
    """`model.frequency_mix`: BSARec's filter sees the whole sequence (`_validate_whole_sequence_branch`)."""
    m, r = config.model, config.retrieval
    if m.frequency_mix == 0:
        return
    _validate_whole_sequence_branch(config, "frequency_mix", m.frequency_mix, source)
    if m.frequency_bins > r.max_len // 2 + 1:
        raise ConfigError(
            f"{source}: `model.frequency_bins` ({m.frequency_bins}) exceeds the {r.max_len // 2 + 1} "
            f"real-FFT bins of a window of retrieval.max_len = {r.max_len}"
        )


def _validate_whole_sequence_branch(config: Config, key: str, mix: float, source: str) -> None:
    """A branch beside attention that sees the whole sequence (`model.<key>` = mix > 0): only next-item
    examples whose target follows all of their input may train it."""
    m, r = config.model, config.retrieval
    if config.data.kind != "interactions":
        raise ConfigError(
            f'{source}: `model.{key}` is for next-item data (data.kind = "interactions"): the branch '
            "is not causal, and a ranking sequence holds its candidates"
        )
    if r.train_targets != "last_of_prefixes":
        raise ConfigError(
            f"{source}: `model.{key}` ({mix}) lets every position see later items: it "
            f'needs `retrieval.train_targets = "last_of_prefixes"`, got {r.train_targets!r}'
        )
    if m.layer != "hstu" or m.long_history:
        raise ConfigError(f'{source}: `model.{key}` needs model.layer = "hstu" without model.long_history')


def _validate_wavelet_branch(config: Config, source: str) -> None:
    """`model.wavelet_mix`: not causal either (`_validate_whole_sequence_branch`); with the frequency branch,
    attention keeps 1 - frequency_mix - wavelet_mix."""
    m, r = config.model, config.retrieval
    if m.wavelet_mix == 0:
        _refuse_unused(m, "model", ("wavelet_levels",), "`model.wavelet_mix`", source)
        return
    _validate_whole_sequence_branch(config, "wavelet_mix", m.wavelet_mix, source)
    if m.frequency_mix + m.wavelet_mix > 1:
        raise ConfigError(
            f"{source}: `model.frequency_mix` + `model.wavelet_mix` ({m.frequency_mix} + {m.wavelet_mix}) must "
            "be <= 1: attention keeps the rest"
        )
    if 2 ** (m.wavelet_levels - 1) >= r.max_len:
        raise ConfigError(
            f"{source}: `model.wavelet_levels` ({m.wavelet_levels}) makes Haar blocks of {2**m.wavelet_levels} "
            f"items, twice retrieval.max_len = {r.max_len} or more"
        )


def _validate_sequence_mixer(config: Config, source: str) -> None:
    """`model.sequence_mixer = "time_variant"`: TV-Rec's filters over next-item windows, in HSTU layers."""
    m, r = config.model, config.retrieval
    if m.sequence_mixer == "attention":
        _refuse_unused(
            m, "model", ("time_variant_taps", "time_variant_basis"), "the time-variant mixer", source
        )
        return
    if config.data.kind != "interactions":
        raise ConfigError(
            f'{source}: `model.sequence_mixer = "time_variant"` is for next-item data (data.kind = '
            '"interactions"): its filters are indexed by the distance from a sequence\'s newest item'
        )
    if m.layer != "hstu" or m.long_history:
        raise ConfigError(
            f'{source}: `model.sequence_mixer = "time_variant"` needs model.layer = "hstu" without '
            "model.long_history"
        )
    if m.attention_dropout > 0:
        raise ConfigError(
            f"{source}: `model.attention_dropout` ({m.attention_dropout}) drops attention weights: "
            '`model.sequence_mixer = "time_variant"` has none'
        )
    if m.time_variant_taps > r.max_len:
        raise ConfigError(
            f"{source}: `model.time_variant_taps` ({m.time_variant_taps}) exceeds the window of "
            f"retrieval.max_len = {r.max_len} items"
        )


def _refuse_unused(section: Any, name: str, keys: tuple[str, ...], owner: str, source: str) -> None:
    """Keys that shape an option that is off must keep their defaults."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    for key in keys:
        if getattr(section, key) != fields[key].default:
            raise ConfigError(
                f"{source}: `{name}.{key}` ({getattr(section, key)!r}) shapes {owner}, which is off"
            )


def _validate_embeddings(config: Config, source: str) -> None:
    """The `[embeddings]` rules between keys: features name tables, fast axes name mesh axes."""
    e = config.embeddings
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
    """`precision.fp8_layers`: no empty prefix; "auto" only for the ranking model with every GEMM in FP8, and
    a recorded choice only with "auto"."""
    p = config.precision
    for i, prefix in enumerate(p.fp8_layers):
        if not prefix:
            raise ConfigError(f"{source}: `precision.fp8_layers[{i}]` is empty (it would name every layer)")
    if p.fp8_auto_choice is not None and p.fp8 != "auto":
        raise ConfigError(
            f'{source}: `precision.fp8_auto_choice` is what `precision.fp8 = "auto"` chose; with fp8 = '
            f"{str(p.fp8).lower()} name the layers in `precision.fp8_layers` instead"
        )
    if p.fp8 == "auto" and config.data.kind == "interactions":
        raise ConfigError(
            f'{source}: `precision.fp8 = "auto"` knows the ranking model\'s GEMMs only; the next-item model '
            "takes true or false"
        )
    if p.fp8 == "auto" and p.fp8_gemms != "all":
        raise ConfigError(
            f'{source}: `precision.fp8 = "auto"` reads speedups measured with every GEMM in FP8; '
            f'it cannot pick layers for `precision.fp8_gemms = "{p.fp8_gemms}"` (name the layers instead)'
        )


SELECT_METRICS = tuple(
    f"{protocol}/{name}@{k}"
    for protocol, ks in (("sampled", (10,)), ("full", (5, 10, 20)))
    for k in ks
    for name in ("HR", "NDCG")
)


def _validate_retrieval(config: Config, source: str) -> None:
    """The `[retrieval]` rules between keys, when the data is an interactions file."""
    r, d = config.retrieval, config.data
    if r.label_smoothing > 0 and r.loss != "full_softmax":
        raise ConfigError(
            f'{source}: `retrieval.label_smoothing` ({r.label_smoothing}) needs `retrieval.loss = "full_softmax"`'
        )
    if not d.path:
        raise ConfigError(
            f'{source}: `data.path` must name the interactions file for data.kind = "interactions"'
        )
    if d.balance != "off":
        raise ConfigError(
            f"{source}: `data.balance` {d.balance!r} is for the ranking packs; the next-item packer does not "
            'balance (use "off")'
        )
    contrastive_keys = (
        ("contrastive_pooling", "last"),
        ("contrastive_dropout", True),
        ("intent_denoise", False),
    )
    if r.contrastive_weight == 0 and r.intent_weight == 0 and r.frequency_contrastive_weight == 0:
        for key, default in contrastive_keys:
            if getattr(r, key) != default:
                raise ConfigError(
                    f"{source}: `retrieval.{key}` ({getattr(r, key)!r}) shapes the contrastive and intent "
                    "losses: it needs `retrieval.contrastive_weight`, `retrieval.intent_weight` or "
                    "`retrieval.frequency_contrastive_weight` > 0"
                )
    if r.frequency_contrastive_weight == 0:
        _refuse_unused(
            r,
            "retrieval",
            ("frequency_contrastive_band",),
            "`retrieval.frequency_contrastive_weight`",
            source,
        )
    elif r.max_len < 2:
        raise ConfigError(
            f"{source}: `retrieval.frequency_contrastive_weight` needs `retrieval.max_len` >= 2 (a spectrum "
            f"with a band to remove), got {r.max_len}"
        )
    if r.intent_weight == 0 and r.intent_denoise:
        raise ConfigError(f"{source}: `retrieval.intent_denoise` needs `retrieval.intent_weight` > 0")
    if d.tokens_per_shard < r.max_len:
        raise ConfigError(
            f"{source}: `data.tokens_per_shard` ({d.tokens_per_shard}) is smaller than "
            f"`retrieval.max_len` ({r.max_len})"
        )


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Loads a TOML file (or the defaults when `path` is None) and applies `key.sub=value` overrides."""
    return _load(path, (), overrides, renamed={})


# Values a run may have recorded that the keys no longer take, each with the value that computes the same
# function: "pallas" (the platform's kernel) and "interpret" (a kernel in Pallas's interpreter) before every
# kernel op took its backends' names. These keys may change on resume, so a recorded run reads them as "auto".
RECORDED_RENAMES = {
    f"model.{key}": {"pallas": "auto", "interpret": "auto"}
    for key in ("attention_implementation", "norm_implementation", "uvqk_implementation")
}


def load_recorded_config(
    path: str | Path, changes: Sequence[str] = (), overrides: Sequence[str] = ()
) -> Config:
    """load_config for a run directory's recorded config.toml, then the changes its last resume recorded and
    `overrides` (all `key.sub=value`): in the file and the changes, values of RECORDED_RENAMES read as their
    new names."""
    return _load(path, changes, overrides, renamed=RECORDED_RENAMES)


def _rename(key_path: list[str], value: Any, renamed: dict[str, dict[str, str]]) -> Any:
    return renamed.get(".".join(key_path), {}).get(value, value) if isinstance(value, str) else value


def _load(
    path: str | Path | None,
    changes: Sequence[str],
    overrides: Sequence[str],
    renamed: dict[str, dict[str, str]],
) -> Config:
    """The config of a TOML file (None: the defaults), then `changes` and `overrides` (`key.sub=value`); values
    `renamed` names, in the file and the changes, read as their new ones."""
    values: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            with open(config_file(path), "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            tried = "" if Path(path).is_absolute() else f" (also tried {config_file(path)})"
            raise ConfigError(f"config file not found: {path}{tried}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for key in renamed:
        section, name = key.split(".")
        if isinstance(values.get(section), dict) and name in values[section]:
            values[section][name] = _rename([section, name], values[section][name], renamed)
    config = _build(Config, values, "", source)
    if changes or overrides:
        update: dict[str, Any] = {}
        for i, text in enumerate([*changes, *overrides]):
            key_path, value = parse_override(text)
            _set_path(update, key_path, _rename(key_path, value, renamed) if i < len(changes) else value)
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
            if v is None:  # not decided yet (TOML has no null)
                continue
            if isinstance(v, dict):
                tables[k] = v
            else:
                lines.append(f"{k} = {toml_value(v)}")
        for k, table in tables.items():
            lines.append(f"{k} = {toml_value(table)}")
        lines.append("")
    return "\n".join(lines)
