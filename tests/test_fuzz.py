"""The attention fuzzer (experiments/fuzz.py): a few cases of the kernel in interpret mode pass, and a
deliberately wrong kernel is caught with a replayable case."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import fuzz
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_interpreted_kernel_passes_a_few_cases():
    report = fuzz.fuzz(seconds=600, max_cases=3, max_families=1, log=lambda line: None)
    assert report.failures == [] and report.cases == 3
    family = report.families[0]  # the first family switches everything on
    assert (
        family.dtype == "bfloat16" and family.targets and family.window and family.num_pos and family.num_time
    )
    assert {name for name, _ in report.worst} == set(fuzz.CHECKS)
    for whole, per_seq in report.worst.values():
        assert 0 < whole <= fuzz.TOLERANCE["bfloat16"][0] and 0 < per_seq <= fuzz.TOLERANCE["bfloat16"][1]


def test_cases_cover_empty_single_full_and_unused_rows():
    family = fuzz.make_family(0, 0, "cpu")
    lengths = np.concatenate([np.diff(fuzz.make_case(family, 0, 0, c).offsets) for c in range(40)])
    assert {0, 1, family.max_seq_len} <= set(lengths.tolist())
    case = fuzz.make_case(family, 0, 0, 0)
    assert np.isnan(case.q[case.offsets[-1] :]).all() and np.isfinite(case.q[: case.offsets[-1]]).all()


def _broken(how: str):
    real = fuzz.jagged_attention

    def attention(*args, implementation, **kw):
        if implementation != "broken":
            return real(*args, implementation=implementation, **kw)
        if how == "window":  # forgets the attention window
            return real(*args, implementation="reference", **{**kw, "max_attn_len": 0})
        out = real(*args, implementation="reference", **kw)
        unused = jnp.arange(out.shape[0])[:, None, None] >= args[3][-1]
        return jnp.where(unused, jnp.nan, out).astype(out.dtype)  # leaks NaN into unused capacity rows

    return attention


@pytest.mark.parametrize("how, words", [("window", ["WRONG out", "rel L2"]), ("nan", ["past offsets[B]"])])
def test_a_wrong_kernel_is_caught_with_a_replayable_case(monkeypatch, how, words):
    monkeypatch.setattr(fuzz, "jagged_attention", _broken(how))
    report = fuzz.fuzz(
        seconds=600, max_cases=2, max_families=1, implementation="broken", log=lambda line: None
    )
    assert report.failures, "the broken kernel passed"
    for w in words:
        assert any(w in f for f in report.failures), report.failures
    assert all("--seed 0 --replay 0:" in f for f in report.failures)
    case = int(re.search(r"--replay 0:(\d+)", report.failures[0]).group(1))
    replay = fuzz.fuzz(seconds=600, implementation="broken", replay=(0, case), log=lambda line: None)
    assert replay.cases == 1 and replay.failures[0] == report.failures[0]


@pytest.mark.slow
def test_cli_prints_the_table_and_exit_code():
    r = run_cli(
        "fuzz",
        "attention",
        "--seconds",
        "120",
        "--max-cases",
        "2",
        "--max-families",
        "1",
        "--implementation",
        "reference",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 cases in" in r.stdout and "| out | bfloat16 |" in r.stdout and "failures: 0" in r.stdout


def test_a_crashing_kernel_is_reported_and_ends_the_sweep(monkeypatch):
    def crash(*args, implementation, **kw):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(fuzz, "jagged_attention", crash)
    report = fuzz.fuzz(seconds=600, implementation="broken", log=lambda line: None)
    assert report.cases == 0 and len(report.failures) == fuzz.MAX_CRASHES_IN_A_ROW
    assert all(f.startswith("CRASH RuntimeError: boom (") and "--replay" in f for f in report.failures)
    assert report.crashed == set(range(fuzz.MAX_CRASHES_IN_A_ROW))  # each family skipped after its crash


def test_zero_reference_gradient_is_judged_against_the_case_scale():
    """dq is exactly zero when every row is a target seeing only itself: float32 noise must pass and
    an error of the size a wrongly rounded softmax delta makes (|dq| 0.76 at |dv| 450) must fail."""
    zero = np.zeros((6, 2, 4))
    offsets = np.array([0, 6])
    floor = fuzz.ZERO_REFERENCE_FLOOR * 450.0
    noise = np.full_like(zero, 5e-5 / np.sqrt(zero.size))
    bug = np.full_like(zero, 0.76 / np.sqrt(zero.size))
    assert max(fuzz._errors(noise, zero, offsets, floor)) < 0.01
    assert min(fuzz._errors(bug, zero, offsets, floor)) > 1.0
    assert fuzz._errors(noise, zero, offsets)[0] > 1e20  # without the floor: noise / 1e-30


def test_bias_sums_are_the_reference_gradients_and_judge_cancellation():
    """`_bias_sums` (float64 per-bucket sums of the reference's per-cell dScore) equals the reference's own
    bias-table gradients; rounding small against the summed magnitudes passes even where the sum cancels,
    and one bucket's worth of gradient moved to another bucket fails."""
    import jax
    import jax.numpy as jnp

    family = fuzz.make_family(0, 0, "cpu")  # bf16 silu, targets, window, pos and time tables
    case = fuzz.make_case(family, 0, 0, 1)
    rounded = fuzz.dataclasses.replace(
        case, **{x: np.asarray(jnp.asarray(getattr(case, x), jnp.bfloat16), np.float32) for x in fuzz.ROUNDED}
    )
    with jax.default_matmul_precision("float32"):
        _, grads = fuzz._run(fuzz._gradient_fn(family, "reference"), rounded, jnp.float32)
    for name, got in zip(("dpos", "dtime"), grads[3:]):
        exact, magnitudes = fuzz._bias_sums(family, rounded, name)
        assert exact.shape == got.shape and (magnitudes >= np.abs(exact) - 1e-9).all()
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-6 * np.abs(magnitudes).max())
        tol = fuzz.TOLERANCE["bfloat16"][0]
        noise = 1e-3 * fuzz.CANCELLATION * np.linalg.norm(magnitudes) / np.sqrt(exact.size)
        assert fuzz._bias_error(exact + noise, exact, magnitudes, 0.0) <= tol
        moved = exact.copy()
        b = int(np.argmax(np.abs(exact[0])))
        moved[0, b], moved[0, (b + 1) % exact.shape[1]] = (
            0.0,
            exact[0, (b + 1) % exact.shape[1]] + exact[0, b],
        )
        assert fuzz._bias_error(moved, exact, magnitudes, 0.0) > tol
