"""The CLI as a new user meets it: the help names every command, a log file keeps the loop's messages on
lines of their own, and re-running a finished run says so with its metrics and total training time."""

from __future__ import annotations

import contextlib
import importlib
import io
import re

import pytest

from experiments.__main__ import BENCHMARKS, GPU_BENCHMARKS, _format_summary, _parser, main
from gem_jax.config import ConfigError, load_config
from gem_jax.data.records.schema import ShardSet
from gem_jax.tasks import make_task
from gem_jax.tasks.ranking import RankingTask
from gem_jax.train import loop
from gem_jax.train.run_record import RecordMismatch
from tests.helpers import small_config


def test_help_names_every_command_and_what_eval_reads():
    text = _parser().format_help()
    commands = re.search(r"\{([a-z_,]+)\}", text).group(1).split(",")
    assert {"train", "eval", "bench", "profile", "fuzz", "sweep"} <= set(commands)
    first_line = re.search(r"`python -m experiments \{([a-z_,]+)\}`", text).group(1).split(",")
    assert sorted(first_line) == sorted(commands), "the description's first line lists other commands"
    for command in commands:
        assert f"python -m experiments {command}" in text, f"no usage line for {command}"
    eval_help = " ".join(re.search(r"\n    eval\s+(.+?)\n    \S", text, re.S).group(1).split())  # wrapped
    assert "chosen" in eval_help and "latest" in eval_help, eval_help


# One layer: what these tests check (the log, the rerun) does not depend on depth.
_FINISHED = (
    "model.num_layers=1",
    "model.wukong_layers=1",
    "train.steps=6",
    "train.progress=true",
    "train.log_every=3",
    "train.checkpoint_every=3",
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A short ranking run with the progress bar on, its stderr captured as a log file would hold it."""
    workdir = tmp_path_factory.mktemp("finished")
    config = small_config(*_FINISHED)
    log = io.StringIO()  # not a TTY
    with contextlib.redirect_stderr(log):
        summary = loop.train(make_task(config), workdir)
    return config, workdir, summary, log.getvalue()


def test_log_file_keeps_messages_off_the_progress_bars_line(finished_run):
    _, _, summary, log = finished_run
    assert "train:" in log and "\r" in log  # the bar was drawn
    lines = log.split("\n")
    evaluation = [line for line in lines if "valid" in line]
    assert evaluation and all(line.startswith(f"step {summary['step']} ") for line in evaluation), evaluation
    bars = [line for line in lines if "train:" in line]
    assert all(line.split("\r")[-1].startswith("train:") for line in bars), bars  # nothing after a bar
    assert "100%" in bars[-1].split("\r")[-1]  # the closed bar's last state ends its own line


def test_train_names_the_backend_that_runs_each_op(finished_run):
    """One line per op at start-up, each naming its backend and the key that decides it."""
    from gem_jax.kernels import LABELS, OPS

    _, _, _, log = finished_run
    assert "kernels (jax " in log
    for op in OPS:
        assert log.count(f"  {LABELS[op]}: ") == 1, op
    assert (
        "  attention: forward reference, backward reference (model.attention_implementation = 'reference')"
        in log
    )
    assert "  layer norm: reference (model.norm_implementation = 'auto')" in log


def test_rerunning_a_finished_run_says_so_with_its_metrics_and_total_time(finished_run):
    config, workdir, first, _ = finished_run
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        again = loop.train(make_task(config), workdir)
    assert not first["already_finished"] and again["already_finished"]
    assert again["step"] == first["step"] == 6
    assert "train:" not in log.getvalue()  # no progress bar for nothing to train
    assert again["eval"] == first["eval"]  # read back from metrics.jsonl
    assert again["final"]["loss"] == first["final"]["loss"]
    # The first invocation's training time as its last checkpoint recorded it, not this one's 0.
    assert 0 < again["train_time_s"] <= first["train_time_s"]

    text = _format_summary(again, make_task(config).summary_lines(again))
    assert f"already finished at step 6: nothing to train ({again['train_time_s']:.1f} s" in text
    assert f"python -m experiments eval --workdir {workdir}" in text and "another --workdir" in text
    assert f"click      AUC {first['eval']['click']['auc']:.4f}" in text
    assert "done:" not in text


def test_rerunning_a_finished_run_with_a_changed_key_is_refused_naming_it(finished_run):
    """A finished run is held to the resume rules: a key that may not change on resume is refused in one
    line naming it (the CLI's exit 2), and the workdir is left as it was."""
    config, workdir, _, _ = finished_run
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()}
    changed = small_config(*_FINISHED, f"model.model_dim={2 * config.model.model_dim}")
    with pytest.raises(RecordMismatch, match=rf"model\.model_dim {config.model.model_dim} -> "):
        loop.train(make_task(changed), workdir)
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()} == before
    # Keys that may change (how long, how often) still give the finished run's summary.
    again = loop.train(make_task(small_config(*_FINISHED, "train.log_every=1")), workdir)
    assert again["already_finished"]


def test_paths_fall_back_to_the_repository_root_and_missing_inputs_are_one_line(
    tmp_path, monkeypatch, capsys
):
    """From outside the checkout: `--config configs/X.toml` finds the repository's file (as `data.path`
    does), a missing `data convert` source is one line naming it (exit 2), and records without shards say
    how to make them."""
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/ml100k_rank.toml").data.kind == "records"
    with pytest.raises(ConfigError, match=r"config file not found: configs/nope\.toml \(also tried /"):
        load_config("configs/nope.toml")
    assert main(["data", "convert", "nothere/ml-100k", "--out", "out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("data error: nothere/ml-100k: no such file or folder"), err
    with pytest.raises(FileNotFoundError, match="data convert SRC --out DIR"):
        ShardSet.open(str(tmp_path / "missing" / "train"))


def test_bench_and_fuzz_help_say_what_each_does(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name, (_, what) in BENCHMARKS.items():
        assert re.search(rf"^  {name} +{re.escape(what)}$", out, re.M), name
    with pytest.raises(SystemExit):
        main(["fuzz", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m experiments fuzz") and "--seconds" in out and "--replay" in out


def test_train_and_eval_help_describe_every_option_and_the_default_config_resolves_as_named(capsys):
    for command in ("train", "eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        lines = capsys.readouterr().out.splitlines()
        for i, line in enumerate(lines):
            option = re.match(r"^  (--[a-z-]+)(?: [A-Z_:=]+)?(?:  +(\S.*))?$", line)
            if option is None or option.group(1) in ("--num-processes", "--process-id"):
                continue  # those two: the multi-process group's title says what they are
            below = lines[i + 1] if i + 1 < len(lines) else ""
            described = option.group(2) or re.match(r"^ {20,}\S", below)
            assert described, f"{command} --help: {option.group(1)} has no description"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    default = re.search(r"default: configs/(\S+?), the main job", out).group(1)
    assert load_config(default) == load_config(f"configs/{default}")  # the name the help gives works as given
    assert load_config(default.removesuffix(".toml")) == load_config(f"configs/{default}")
    with pytest.raises(ConfigError, match="not found"):
        load_config("nope.toml")


def test_gpu_benchmarks_on_cpu_refuse_in_one_line_unless_asked_for_their_small_run(capsys, monkeypatch):
    ran = []
    for name, flag in GPU_BENCHMARKS.items():
        module = importlib.import_module(BENCHMARKS[name][0])
        monkeypatch.setattr(module, "main", lambda argv, name=name: ran.append((name, argv)) or 0)
        assert main(["bench", name]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"bench {name} times GPU kernels"), err
        assert (flag or "needs a GPU") in err[0]
        if flag is not None:
            assert main(["bench", name, flag]) == 0
            assert f"{flag}: CPU" in BENCHMARKS[name][1]  # `bench --help` names the flag
    assert ran == [(n, [f]) for n, f in GPU_BENCHMARKS.items() if f is not None]
    assert not set(GPU_BENCHMARKS) & {"train_step", "pipeline", "balance"}  # these time the CPU's own work


def test_the_ranking_summary_shows_the_chosen_checkpoint_and_the_test_split():
    m = {"auc": 0.75, "ne": 0.86, "positive_rate": 0.55, "examples": 10000}
    summary = {
        "best": {"step": 400, "metric": "like/auc", "value": 0.7312},
        "eval": {"like": m},
        "test": {"like": m},
    }
    lines = RankingTask.summary_lines(RankingTask.__new__(RankingTask), summary)
    assert lines[0] == "   chosen checkpoint: step 400, like/auc 0.7312 on validation"
    assert [line.split()[:2] for line in lines[1:]] == [["eval", "like"], ["test", "like"]]
    assert RankingTask.summary_lines(RankingTask.__new__(RankingTask), {"eval": {"like": m}})[0].startswith(
        "   eval"
    )
