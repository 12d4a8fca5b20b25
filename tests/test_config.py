import subprocess
import sys
from pathlib import Path

import pytest

from gem_jax.config import Config, ConfigError, config_to_toml, load_config

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
    assert isinstance(c, Config)


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


# ----------------------------------------------------------------------------- numeric ranges


def _numeric_keys() -> list[str]:
    """Every int/float setting of the schema (tuples of them included), as "section.key"."""
    import typing

    keys = []
    for name, section in typing.get_type_hints(Config).items():
        for field, hint in typing.get_type_hints(section).items():
            args = typing.get_args(hint) if typing.get_origin(hint) is tuple else (hint,)
            if args and args[0] in (int, float):
                keys.append(f"{name}.{field}")
    assert len(keys) > 50 and "train.learning_rate" in keys and "model.pyramid" in keys
    return keys


def test_every_numeric_setting_has_a_range():
    from gem_jax.config import RANGES

    missing = [k for k in _numeric_keys() if k not in RANGES]
    assert not missing, f"add these to gem_jax.config.RANGES: {missing}"
    assert not [k for k in RANGES if k not in _numeric_keys()], "RANGES names a key the schema lacks"


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
    ],
)
def test_out_of_range_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_each_range_rejects_the_values_just_outside_it():
    from gem_jax.config import RANGES

    for key, valid in RANGES.items():
        outside = []
        if valid.low is not None:
            outside.append(valid.low if valid.low_open else valid.low - 1)
        if valid.high is not None:
            outside.append(valid.high if valid.high_open else valid.high + 1)
        for value in outside:
            is_tuple = key in ("model.pyramid", "parallel.mesh_shape")
            text = f"[{value}]" if is_tuple else str(value)
            with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
                load_config(None, [f"{key}={text}"])


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
