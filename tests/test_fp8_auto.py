"""`precision.fp8 = "auto"` (gem_jax/model/fp8_auto.py): FP8 on exactly the layers whose GEMM shapes a
measured table says pay on this GPU kind; everything unmeasured stays bf16; the task resolves it."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from gem_jax.config import ConfigError
from gem_jax.model import fp8_auto
from gem_jax.model.gem import GEMModel
from gem_jax.model.layers import Dense
from gem_jax.tasks import make_task
from tests.helpers import small_config

KIND = "Test GPU"


def _fp8_layers(model) -> list[str]:
    return sorted(n.name for _, n in nnx.iter_graph(model) if isinstance(n, Dense) and n.fp8 is not None)


def _row(m, k, n, fp8_s, bf16_s):
    return {"m": m, "k": k, "n": n, "fp8_s": fp8_s, "bf16_s": bf16_s}


def _config():
    return small_config('precision.fp8="auto"')


def test_auto_picks_the_layers_measured_faster_and_leaves_the_rest_in_bf16():
    config = _config()
    shapes = fp8_auto.layer_gemm_shapes(config)
    (m, k, n) = shapes["hstu/0/uvqk"]
    (mo, ko, no) = shapes["hstu/0/out"]
    (mw, kw, nw) = shapes["wukong/0/fm_mlp"]
    table = {
        KIND: [
            _row(2 * m, k, n, 1.0, 1.3),  # uvqk pays, measured at twice its tokens (still within 2x)
            _row(mo, ko, no, 1.0, 1.02),  # out: faster, but by less than MIN_SPEEDUP
            _row(4 * mw, kw, nw, 1.0, 2.0),  # wukong/0: pays, but measured 4x away from its rows
        ],
        "Other GPU": [_row(mo, ko, no, 1.0, 3.0)],
    }
    resolved = fp8_auto.resolve(config, KIND, table)
    uvqk = sorted(name for name, s in shapes.items() if s == (m, k, n))
    assert resolved.precision.fp8 is True
    assert resolved.precision.fp8_layers == tuple(uvqk)
    assert _fp8_layers(GEMModel(resolved, rngs=nnx.Rngs(0))) == uvqk
    # Nothing pays (or nothing measured on this kind): no FP8 at all.
    for kind in ("Other GPU", "cpu"):
        off = fp8_auto.resolve(config, kind, {KIND: table[KIND][1:], "Other GPU": []})
        assert off.precision.fp8 is False and not _fp8_layers(GEMModel(off, rngs=nnx.Rngs(0)))


def test_the_nearest_measured_token_count_decides():
    config = _config()
    m, k, n = fp8_auto.layer_gemm_shapes(config)["hstu/0/uvqk"]
    table = {KIND: [_row(m // 2, k, n, 1.0, 0.5), _row(m + m // 4, k, n, 1.0, 1.5)]}  # nearer: pays
    assert fp8_auto.speedup(table, KIND, m, k, n) == 1.5
    table = {KIND: [_row(m - m // 8, k, n, 1.0, 0.5), _row(2 * m, k, n, 1.0, 1.5)]}  # nearer: slower
    assert fp8_auto.speedup(table, KIND, m, k, n) == 0.5
    assert "hstu/0/uvqk" not in fp8_auto.resolve(config, KIND, table).precision.fp8_layers
    assert fp8_auto.speedup(table, KIND, m, k + 1, n) is None


def test_the_task_resolves_auto_and_an_unresolved_auto_is_refused(monkeypatch, tmp_path, capsys):
    config = _config()
    with pytest.raises(ConfigError, match="must be resolved"):
        GEMModel(config, rngs=nnx.Rngs(0))
    task = make_task(config)  # the CPU is in no table: bf16, said on stderr
    assert task.config.precision.fp8 is False
    assert 'precision.fp8 = "auto" on cpu: FP8 on 0 of' in capsys.readouterr().err
    # A table that has this machine's kind: the task's model gets exactly those layers.
    import jax

    m, k, n = fp8_auto.layer_gemm_shapes(config)["hstu/1/out"]
    path = tmp_path / "t.json"
    path.write_text(
        __import__("json").dumps(fp8_auto.merge_rows({}, jax.devices()[0].device_kind, [_row(m, k, n, 1, 2)]))
    )
    monkeypatch.setattr(fp8_auto, "TABLE", path)
    task = make_task(config)
    assert task.config.precision.fp8 is True
    assert "hstu/1/out" in task.config.precision.fp8_layers
    assert all(
        fp8_auto.layer_gemm_shapes(config)[name] == (m, k, n) for name in task.config.precision.fp8_layers
    )


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
    assert dataclasses.is_dataclass(fp8_auto.GemmShape)
