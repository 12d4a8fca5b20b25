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
