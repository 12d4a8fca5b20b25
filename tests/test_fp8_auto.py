"""`precision.fp8 = "auto"`: each layer that `precision.fp8_layers` names decides as it is built, from its own
(M, K, N) and the measured table for this GPU kind (gem_jax/precision.py); everything unmeasured stays bf16;
the config is never rewritten; the run record keeps the choice, and a resume builds the same layers whatever
the table on its machine says (gem_jax/model/fp8_auto.py, gem_jax/train/run_record.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from flax import nnx

from experiments.benchmarks.fp8 import GemmShape, model_gemm_shapes
from gem_jax.config import ConfigError, PrecisionConfig, config_to_toml, load_config
from gem_jax.model import fp8_auto
from gem_jax.model.gem import GEMModel
from gem_jax.model.layers import Dense, fp8_decisions
from gem_jax.precision import MIN_SPEEDUP, FP8Speedups, PrecisionPolicy
from gem_jax.tasks import make_task
from gem_jax.train import loop
from gem_jax.train.run_record import RecordMismatch, RunRecord
from tests.helpers import small_config

KIND = "Test GPU"


def _fp8_layers(model) -> list[str]:
    return sorted(d.layer for d in fp8_decisions(model) if d.recipe is not None)


def _row(m, k, n, fp8_s, bf16_s):
    return {"m": m, "k": k, "n": n, "fp8_s": fp8_s, "bf16_s": bf16_s}


def _with_precision(config, **precision):
    return dataclasses.replace(config, precision=dataclasses.replace(config.precision, **precision))


def _gemms(config) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of every FP8-named layer, as the layers record them (every named layer in FP8)."""
    model = _model(_with_precision(config, fp8=True, fp8_auto_choice=None))
    return {d.layer: (d.m, d.k, d.n) for d in fp8_decisions(model)}


def _model(config):
    return nnx.eval_shape(lambda: GEMModel(config, rngs=nnx.Rngs(0)))


@pytest.fixture
def table(monkeypatch, tmp_path):
    """Sets this machine's GPU kind to KIND and the table "auto" reads to the rows given: table({kind: rows})."""
    path = tmp_path / "speedups.json"
    monkeypatch.setattr(fp8_auto, "TABLE", path)
    monkeypatch.setattr(fp8_auto, "device_kind", lambda: KIND)
    return lambda rows: path.write_text(json.dumps(rows))


def _config(*extra):
    return small_config('precision.fp8="auto"', *extra)


def test_each_layer_decides_from_its_own_gemm_and_the_config_is_not_rewritten(table, monkeypatch):
    config = _config()
    shapes = _gemms(config)
    (m, k, n), (mo, ko, no) = shapes["hstu/0/uvqk"], shapes["hstu/0/out"]
    (mw, kw, nw) = shapes["wukong/0/fm_mlp"]
    rows = [
        _row(2 * m, k, n, 1.0, 1.3),  # uvqk pays, measured at twice its tokens (still within 2x)
        _row(mo, ko, no, 1.0, 1.02),  # out: faster, but by less than MIN_SPEEDUP
        _row(4 * mw, kw, nw, 1.0, 2.0),  # wukong/0: pays, but measured 4x away from its rows
    ]
    table({KIND: rows, "Other GPU": [_row(mo, ko, no, 1.0, 3.0)]})
    # The task keeps the config as written: no abstract build rewrites "auto" into layer names.
    assert make_task(config).config == config
    model = _model(config)
    uvqk = sorted(name for name, s in shapes.items() if s == (m, k, n))
    assert _fp8_layers(model) == uvqk
    read = {d.layer: d.speedup for d in fp8_decisions(model)}
    assert read["hstu/0/uvqk"] == pytest.approx(1.3) and read["hstu/0/out"] == pytest.approx(1.02)
    assert read["wukong/0/fm_mlp"] is None  # measured too far from its M: not measured
    # Another GPU kind with no rows of its own, or a CPU: bf16 everywhere.
    for kind in ("Other GPU", "cpu"):
        monkeypatch.setattr(fp8_auto, "device_kind", lambda kind=kind: kind)
        table({KIND: rows, "Other GPU": []})
        assert not _fp8_layers(_model(config))


def test_the_policy_decides_per_layer_from_m_k_n_or_from_the_recorded_choice():
    speedups = FP8Speedups(KIND, ((64, 8, 16, 1.5), (64, 8, 32, 1.05), (200, 16, 16, 2.0)))
    rows = {"t/": 64}

    def fp8_layers(**precision):
        config = PrecisionConfig(fp8="auto", fp8_layers=("t/",), **precision)
        policy = PrecisionPolicy.from_config(config, gemm_rows=rows, fp8_speedups=speedups)
        layers = [Dense(name, k, n, policy, rngs=nnx.Rngs(0)) for name, k, n in LAYERS]
        assert layers[-1].fp8_decision is None  # not named by fp8_layers: never asks
        return [d.name for d in layers if d.fp8 is not None]

    LAYERS = (("t/a", 8, 16), ("t/b", 8, 32), ("t/c", 16, 16), ("u/a", 8, 16))
    # t/b: 1.05x is below MIN_SPEEDUP; t/c: measured at 200 rows, more than 2x from its 64.
    assert MIN_SPEEDUP > 1.05 and fp8_layers() == ["t/a"]
    assert fp8_layers(fp8_auto_choice=("t/b",)) == ["t/b"]  # a run's recorded choice wins
    assert fp8_layers(fp8_auto_choice=()) == []
    with pytest.raises(ConfigError, match="no measured speedups"):
        policy = PrecisionPolicy.from_config(PrecisionConfig(fp8="auto", fp8_layers=("t/",)), gemm_rows=rows)
        Dense("t/a", 8, 16, policy, rngs=nnx.Rngs(0))


def test_the_nearest_measured_token_count_decides(table):
    config = _config()
    m, k, n = _gemms(config)["hstu/0/uvqk"]
    nearer_pays = FP8Speedups(KIND, ((m // 2, k, n, 0.5), (m + m // 4, k, n, 1.5)))
    assert nearer_pays.at(m, k, n) == 1.5
    nearer_slower = FP8Speedups(KIND, ((m - m // 8, k, n, 0.5), (2 * m, k, n, 1.5)))
    assert nearer_slower.at(m, k, n) == 0.5 and nearer_slower.at(m, k + 1, n) is None
    table({KIND: [_row(m - m // 8, k, n, 1.0, 0.5), _row(2 * m, k, n, 1.0, 1.5)]})
    assert "hstu/0/uvqk" not in _fp8_layers(_model(config))


def test_the_choice_is_a_config_key_only_auto_sets_and_toml_keeps():
    assert _config().precision.fp8_auto_choice is None
    assert "fp8_auto_choice" not in config_to_toml(_config())  # unset: left out (TOML has no null)
    chosen = _config("precision.fp8_auto_choice=['hstu/0/uvqk']")
    assert chosen.precision.fp8_auto_choice == ("hstu/0/uvqk",)
    assert "fp8_auto_choice = []" in config_to_toml(_config("precision.fp8_auto_choice=[]"))
    with pytest.raises(ConfigError, match="fp8_auto_choice"):
        small_config("precision.fp8=true", "precision.fp8_auto_choice=['hstu/0/uvqk']")
    with pytest.raises(ConfigError, match="next-item model"):
        load_config(None, ['precision.fp8="auto"', 'data.kind="interactions"', 'data.path="x"'])


@pytest.mark.slow  # two training runs end to end (the slow tier: long end-to-end tests)
def test_a_run_records_its_choice_and_a_resume_keeps_it_whatever_the_table_says(table, tmp_path, capsys):
    config = _config(
        "model.num_layers=1", "model.wukong_layers=1", "train.steps=4", "train.checkpoint_every=2"
    )
    m, k, n = _gemms(config)["hstu/0/uvqk"]
    table({KIND: [_row(m, k, n, 1.0, 2.0)]})  # the machine that starts the run: uvqk pays
    workdir = tmp_path / "run"
    assert loop.train(make_task(config), workdir, stop_after=2)["step"] == 2
    err = capsys.readouterr().err
    assert f'precision.fp8 = "auto" on {KIND}: FP8 on 1 of 3 layers (hstu/0/uvqk); not measured' in err
    recorded = RunRecord(workdir).recorded_config()
    assert recorded.precision.fp8 == "auto" and recorded.precision.fp8_auto_choice == ("hstu/0/uvqk",)

    table({})  # the machine that resumes has no measurements: by the table, nothing would run FP8
    assert not _fp8_layers(_model(config))
    resumed = RunRecord(workdir).with_run_choices(config)
    assert resumed.precision.fp8_auto_choice == ("hstu/0/uvqk",)
    assert _fp8_layers(_model(resumed)) == ["hstu/0/uvqk"]
    assert loop.train(make_task(resumed), workdir)["step"] == 4  # its checkpoint holds uvqk's FP8 state
    assert "FP8 on 1 of 3 layers (hstu/0/uvqk), as the run chose when it started" in capsys.readouterr().err
    # A resume still refuses a changed key: another choice, or the choice left open (no record read).
    for other in (config, _with_precision(config, fp8_auto_choice=("hstu/0/out",))):
        with pytest.raises(RecordMismatch, match="precision.fp8_auto_choice"):
            loop.train(make_task(other), workdir)


def test_bench_reads_the_model_gemm_shapes_from_the_layers():
    shapes = model_gemm_shapes(small_config())
    by_layer = _gemms(small_config())
    assert {g.layers for g in shapes} >= {"hstu/0/uvqk, hstu/1/uvqk", "hstu/0/out, hstu/1/out"}
    for g in shapes:
        assert isinstance(g, GemmShape)
        assert all(by_layer[name] == (g.m, g.k, g.n) for name in g.layers.split(", "))
    assert sum(len(g.layers.split(", ")) for g in shapes) == len(by_layer)


def test_fp8_takes_true_false_or_auto_only():
    assert small_config("precision.fp8=true").precision.fp8 is True
    assert small_config("precision.fp8=auto").precision.fp8 == "auto"
    for bad in ("1", "'on'", "'true'"):
        with pytest.raises(ConfigError, match="precision.fp8"):
            small_config(f"precision.fp8={bad}")


def test_merge_replaces_only_the_rows_measured_again():
    old = {KIND: [_row(1, 2, 3, 1, 1), _row(4, 5, 6, 1, 1)], "Other GPU": [_row(1, 2, 3, 9, 9)]}
    new = fp8_auto.merge_rows(old, KIND, [_row(1, 2, 3, 2, 2)])
    assert new[KIND] == [_row(1, 2, 3, 2, 2), _row(4, 5, 6, 1, 1)]
    assert new["Other GPU"] == old["Other GPU"]
