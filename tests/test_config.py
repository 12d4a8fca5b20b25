import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest

from gem_jax.config import Config, ConfigError, config_to_toml, load_config, schema_keys

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def test_defaults_and_override_types():
    c = load_config(
        None,
        [
            "train.steps=7",
            "train.learning_rate=1e-3",
            "model.tasks=['click']",
            "train.progress=false",
            "data.path=some/file.txt",
        ],
    )
    assert c.train.steps == 7 and c.train.learning_rate == 1e-3
    assert c.model.tasks == ("click",) and c.train.progress is False
    assert c.data.path == "some/file.txt"


def test_int_is_accepted_for_float():
    assert load_config(None, ["train.learning_rate=1"]).train.learning_rate == 1.0


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.stepz=3", ["unknown key", "train.stepz"]),
        ("train.steps=1.5", ["train.steps", "integer"]),
        ("train.steps='ten'", ["train.steps", "integer"]),
        ("model.activation=relu", ["model.activation", "silu"]),
        ("nosuch.key=1", ["unknown key", "nosuch"]),
        ("train.steps", ["key.sub=value"]),
        ("parallel.rules={shard=['model']}", ["parallel.rules.shard", "model"]),
    ],
)
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value)


def test_bad_file_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = 'many'\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(bad) in str(e.value) and "train.steps" in str(e.value)
    bad.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="unknown key `model.width`"):
        load_config(bad)
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_capacity_check():
    with pytest.raises(ConfigError, match="tokens_per_shard"):
        load_config(None, ["data.tokens_per_shard=10"])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_loads_and_round_trips(path, tmp_path):
    c = load_config(path)
    assert path.read_text().startswith("#"), "each config starts with a comment giving its command"
    out = tmp_path / "resolved.toml"
    out.write_text(config_to_toml(c))
    assert load_config(out) == c


def test_cli_config_error_exit_code_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rat = 0.1\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments",
            "train",
            "--config",
            str(bad),
            "--workdir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "train.learning_rat" in r.stderr and str(bad) in r.stderr
    assert "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- each key's rules


def _override(key: str, value: str) -> str:
    """`--set` text for `key` (a key of a named section, `embeddings.tables.*.rows`, names one `t`)."""
    return f"{key.replace('*', 't')}={value}"


def _numeric_keys() -> list[tuple[str, dataclasses.Field]]:
    """Every int/float setting of the schema (tuples of them included), with its field."""
    keys = []
    for key, hint, f in schema_keys():
        args = typing.get_args(hint) if typing.get_origin(hint) is tuple else (hint,)
        if args and args[0] in (int, float):
            keys.append((key, f))
    names = [k for k, _ in keys]
    assert len(keys) > 50 and "train.learning_rate" in names and "model.pyramid" in names
    assert "embeddings.tables.*.rows" in names
    return keys


def test_every_numeric_setting_has_a_range():
    missing = [k for k, f in _numeric_keys() if f.metadata.get("range") is None]
    assert not missing, f"give these a range: setting(default, RANGE) in gem_jax/config.py: {missing}"
    numeric = {k for k, _ in _numeric_keys()}
    others = [k for k, _, f in schema_keys() if f.metadata.get("range") is not None and k not in numeric]
    assert not others, f"a range on a key that is not numeric: {others}"


def test_defaults_obey_every_rule():
    """The defaults, read back through the value checker (which checks only the values it is given)."""
    assert load_config(None, ["train.steps=300"]) == Config()


@pytest.mark.parametrize(
    "override, key",
    [
        ('precision.compute_dtype="fp16x"', "`precision.compute_dtype`"),
        ('retrieval.loss="bogus"', "`retrieval.loss`"),  # refused for the ranking task too
        ('precision.overrides={"hstu/"="int3"}', '`precision.overrides."hstu/"`'),
    ],
)
def test_bad_choices_are_refused_at_load_in_one_line(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    message = str(e.value)
    assert "\n" not in message and key in message and "one of" in message, message
    assert message.startswith("defaults with --set overrides: "), message


def test_every_choice_is_refused_naming_key_allowed_values_and_file(tmp_path):
    choices = [
        (k, typing.get_args(hint)) for k, hint, _ in schema_keys() if typing.get_origin(hint) is Literal
    ]
    assert len(choices) >= 15 and "embeddings.tables.*.dtype" in [k for k, _ in choices]
    config = tmp_path / "choice.toml"
    for key, allowed in choices:
        section, name = key.replace("*", "t").rsplit(".", 1)
        # A feature must read a named table; an interactions file must be named; the time-variant mixer is for
        # next-item data (rules between keys).
        context = {
            "embeddings.features.t": '\ntable = "t"\n[embeddings.tables.t]',
            "data": '\npath = "x"',
            "model.sequence_mixer": '\n[data]\nkind = "interactions"\npath = "x"',
        }
        # A kernel named for the model's calls must take them (the Mosaic GPU kernels' head dims and tiles).
        context |= {
            ("model.attention_implementation", "mosaic"): "\nattention_dim = 64\nvalue_dim = 64",
            ("model.uvqk_implementation", "mosaic"): "\nmodel_dim = 256\nattention_dim = 64\nvalue_dim = 64",
        }
        for value in ("bogus", *allowed):
            text = json.dumps(value)  # a TOML string, or true / false for a boolean choice
            extra = context.get((key, value), context.get(section, "")) + context.get(key, "")
            config.write_text(f"[{section}]\n{name} = {text}{extra}\n")
            if value in allowed:
                assert getattr(load_config(config), key.split(".")[0]) is not None
                continue
            with pytest.raises(ConfigError) as e:
                load_config(config)
            assert (
                str(e.value) == f"{config}: `{key.replace('*', 't')}` must be one of {allowed}, got 'bogus'"
            )


def test_dtype_names_are_the_dtype_table():
    import jax.numpy as jnp

    from gem_jax.dtypes import DTYPES, FLOAT_DTYPES, TABLE_DTYPES
    from gem_jax.precision import PrecisionPolicy

    assert set(TABLE_DTYPES) <= set(FLOAT_DTYPES) == set(DTYPES)
    assert all(DTYPES[name] == jnp.dtype(name) for name in DTYPES)
    policy = PrecisionPolicy.from_config(
        load_config(None, ['precision.overrides={"hstu/"="float16"}']).precision
    )
    assert policy.compute_dtype("hstu/0") == jnp.float16 and policy.compute_dtype("x") == jnp.bfloat16


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.learning_rate=-0.001", ["train.learning_rate", ">= 0", "-0.001"]),
        ("train.checkpoint_every=-1", ["train.checkpoint_every", ">= 0", "-1"]),
        ("train.learning_rate=nan", ["train.learning_rate", "finite"]),
        ("train.max_minutes=inf", ["train.max_minutes", "finite"]),
        ("train.keep_checkpoints=0", ["train.keep_checkpoints", ">= 1"]),
        ("train.log_every=0", ["train.log_every", ">= 1"]),
        ("train.clip_norm=0", ["train.clip_norm", "> 0"]),
        ("model.dropout=1.0", ["model.dropout", "[0, 1)"]),
        ("data.empty_history_fraction=1.5", ["data.empty_history_fraction", "[0, 1]"]),
        ("parallel.mesh_shape=[0]", ["parallel.mesh_shape", "-1"]),
        ("parallel.mesh_shape=[-2]", ["parallel.mesh_shape", ">= -1"]),
        ("retrieval.temperature=0", ["retrieval.temperature", "> 0"]),
        ("data.num_workers=-1", ["data.num_workers", ">= 0"]),
        ("data.worker_buffer_size=0", ["data.worker_buffer_size", ">= 1"]),
    ],
)
def test_out_of_range_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_each_range_rejects_the_values_just_outside_it():
    for key, f in _numeric_keys():
        valid = f.metadata["range"]
        outside = []
        if valid.low is not None:
            outside.append(valid.low if valid.low_open else valid.low - 1)
        if valid.high is not None:
            outside.append(valid.high if valid.high_open else valid.high + 1)
        is_tuple = isinstance(f.default, tuple)
        for value in outside:
            text = f"[{value:g}]" if is_tuple else f"{value:g}"
            where = key.replace("*", "t") + ("[0]" if is_tuple else "")
            with pytest.raises(ConfigError, match=re.escape(f"`{where}` must be {valid}")):
                load_config(None, [_override(key, text)])


# ----------------------------------------------------------------------------- kernel settings


def test_old_kernel_names_are_refused_naming_the_new_ones():
    for key in ("attention_implementation", "norm_implementation"):
        with pytest.raises(ConfigError, match=rf"`model.{key}` must be one of \('auto', 'mosaic', 'triton'"):
            load_config(None, [f'model.{key}="pallas"'])
    with pytest.raises(ConfigError, match=r"must be one of \('off', 'auto', 'mosaic', 'reference'\)"):
        load_config(None, ['model.uvqk_implementation="interpret"'])


def test_a_kernel_that_cannot_run_the_models_calls_is_refused_at_load():
    """The Mosaic GPU attention takes head dims 64, 128 and 256 (the default config's are 32), the Triton layer
    norm powers of two; "auto" always finds one that runs, and an unused op's setting is not asked."""
    with pytest.raises(
        ConfigError, match=r"`model.attention_implementation = 'mosaic'`: .*Mosaic GPU forward"
    ):
        load_config(None, ["model.attention_implementation=mosaic"])
    load_config(
        None, ["model.attention_implementation=mosaic", "model.attention_dim=64", "model.value_dim=64"]
    )
    with pytest.raises(ConfigError, match=r"`model.norm_implementation = 'triton'`: .*width 96"):
        load_config(None, ["model.norm_implementation=triton", "model.model_dim=96"])
    load_config(None, ["model.norm_implementation=auto", "model.model_dim=96"])
    load_config(None, ["model.silu_backward_fp8_implementation=mosaic"])  # no FP8 backward: not called
    message = str(
        pytest.raises(ConfigError, load_config, None, ["model.attention_implementation=mosaic"]).value
    )
    assert "\n" not in message and message.startswith("defaults with --set overrides: "), message


def test_a_recorded_run_reads_the_old_kernel_names_as_auto(tmp_path):
    """A run recorded before the kernels took their backends' names resumes: its "pallas" and "interpret"
    (config.toml, or a change its last resume recorded) read as "auto", which computes the same function; a new
    config or override with them is refused."""
    from gem_jax.config import load_recorded_config
    from gem_jax.train.run_record import RunRecord

    path = tmp_path / "config.toml"
    path.write_text(
        '[model]\nattention_implementation = "interpret"\nnorm_implementation = "pallas"\n'
        'uvqk_implementation = "pallas"\n'
    )
    m = load_recorded_config(path).model
    assert (m.attention_implementation, m.norm_implementation, m.uvqk_implementation) == ("auto",) * 3
    assert RunRecord(tmp_path).recorded_config().model == m
    changed = load_recorded_config(path, ['model.norm_implementation="interpret"'], ["train.steps=5"])
    assert changed.model.norm_implementation == "auto" and changed.train.steps == 5
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(path)
    with pytest.raises(ConfigError, match="must be one of"):
        load_recorded_config(path, [], ['model.norm_implementation="interpret"'])


# ----------------------------------------------------------------------------- resume rules


def test_resume_rules_come_from_the_fields():
    from gem_jax.train.run_record import MAY_CHANGE, data_fingerprint, may_change

    assert may_change("train.steps") and may_change("embeddings.tables.items.sharding")
    assert may_change("parallel.rules") and may_change("data.path")
    assert not may_change("data.num_workers") and not may_change("embeddings.tables.items.rows")
    assert not may_change("model.model_dim") and not may_change("train.learning_rate")
    # docs/running.md lists exactly these keys.
    doc = (ROOT / "docs" / "running.md").read_text()
    listed = doc[doc.index("It may change only") : doc.index("These keys carry")]
    assert set(re.findall(r"`([a-z_]+\.[a-z0-9_.*]+)`", listed)) == set(MAY_CHANGE)
    # The synthetic data's fingerprint: generator settings in, batching and file settings out.
    base = data_fingerprint(Config())
    for key in ("data.num_workers=2", "data.examples_per_shard=8", "data.eval_examples=7", "data.path=x"):
        assert data_fingerprint(load_config(None, [key])) == base, key
    for key in ("data.seed=1", "data.num_items=10", "data.max_bag_size=2"):
        assert data_fingerprint(load_config(None, [key])) != base, key


def test_cli_out_of_range_exit_code_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "experiments", "train", "--workdir", str(tmp_path / "run")]
        + ["--set", "train.learning_rate=-0.1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "train.learning_rate" in r.stderr and "tiny.toml" in r.stderr
    assert not (tmp_path / "run").exists()
