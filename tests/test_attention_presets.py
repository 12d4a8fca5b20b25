"""`bench attention --preset`: the preset table on CPU at --quick sizes (the Triton kernels in interpret mode,
the rest n/a), and its correctness check refusing a wrong implementation."""

import contextlib
import io
import pathlib
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import attention, attention_presets, shapes
from experiments.benchmarks.attention_presets import CheckFailed, Impl
from experiments.benchmarks.jagged_calls import inputs, jagged

PRESETS = ("softmax8x4k_h16d128",)  # a dense row that times the backward too (the slow part: kept to one)


def _rows(out: str) -> dict[tuple[str, str], list[str]]:
    """(preset, implementation) -> the table row's cells."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in shapes.ATTENTION_PRESETS:
            rows[cells[0], cells[2]] = cells
    return rows


@pytest.fixture(scope="module")
def quick_table():
    """(exit code, stdout) of one --quick preset run (module scope: it is the slow part)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = attention.main(["--preset", ",".join(PRESETS), "--quick", "--reps", "1"])
    return rc, out.getvalue()


def test_every_preset_and_implementation_has_a_row(quick_table):
    rc, out = quick_table
    assert rc == 0, out
    rows = _rows(out)
    assert len(rows) == len(PRESETS) * len(attention_presets.IMPLEMENTATIONS)
    triton = attention_presets.LABELS["triton"] + " (interpret)"
    for preset in PRESETS:
        assert {label for p, label in rows if p == preset} == {
            triton,
            *(attention_presets.LABELS[name] for name in ("mosaic", "cudnn", "tokamax")),
        }
        assert float(rows[preset, triton][3]) > 0  # fwd ms
        assert rows[preset, attention_presets.LABELS["mosaic"]][3] == "n/a (needs a Hopper GPU)"
    assert float(rows["softmax8x4k_h16d128", triton][5]) > 0  # bwd ms: the row has a backward target
    assert "check softmax8x4k_h16d128" in out and "dq=" in out


def test_a_jagged_row_has_no_dense_anchors():
    impls = attention_presets.implementations(attention_presets.quick(shapes.PEER_N1024), "silu")
    assert [i.name for i in impls] == list(attention_presets.IMPLEMENTATIONS)
    for impl in impls[2:]:
        assert impl.call is None and impl.missing == "dense kernel: equal lengths only"


def _case(activation="silu"):
    """A check case of the u1k preset at --quick sizes, and the reference's outputs on it (with gradients)."""
    shape = attention_presets.quick(shapes.PEER_N1024)
    rng = np.random.default_rng(0)
    case = (*inputs(attention_presets.check_lengths(shape, rng), shape.heads, shape.head_dim, rng), 64)
    return case, attention_presets.reference(case, activation, backward=True)


def test_the_check_refuses_a_wrong_implementation():
    case, want = _case()
    right = jagged("reference", 64, "silu")  # in bf16: within the bar of the float32 reference
    attention_presets.check(Impl("ok", "ok", "silu", right), case, True, want)
    wrong = Impl("wrong", "wrong", "silu", lambda q, k, v, off: right(q, k, v, off) * 1.05)
    with pytest.raises(CheckFailed, match="out="):
        attention_presets.check(wrong, case, True, want)
    nan = Impl("nan", "nan", "silu", lambda q, k, v, off: right(q, k, v, off) * jnp.nan)
    with pytest.raises(CheckFailed, match="NaN"):
        attention_presets.check(nan, case, False, want[:1])


def test_a_failed_check_is_a_fail_row_untimed_and_exit_code_1(monkeypatch, capsys):
    wrong = lambda shape, activation: [
        Impl("triton", "wrong", activation, lambda q, k, v, off: jnp.zeros_like(v)),
        Impl("mosaic", "absent", activation, None, "not here"),
    ]
    monkeypatch.setattr(attention_presets, "implementations", wrong)
    assert attention.main(["--preset", "u1k,b16n16k_d64", "--quick", "--reps", "1"]) == 1
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 4
    for preset in ("u1k", "b16n16k_d64"):
        assert rows[preset, "wrong"][3].startswith("FAIL (wrong: out=") and rows[preset, "wrong"][4] == "-"
        assert rows[preset, "absent"][3] == "n/a (not here)"


def test_unknown_presets_are_refused(capsys):
    with pytest.raises(SystemExit):
        attention.main(["--preset", "u1k,nope"])
    assert "nope" in capsys.readouterr().err


def test_the_device_script_parses_and_runs_every_preset():
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "device" / "attention_presets.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    presets = next(line for line in script.read_text().splitlines() if line.startswith("PRESETS="))
    assert set(presets.split(":-")[1].rstrip("}").split()) == set(shapes.ATTENTION_PRESETS)
