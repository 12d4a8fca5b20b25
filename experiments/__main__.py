"""`python -m experiments {train,eval,bench,profile,fuzz,sweep,data}`: the user-facing entry point.

  python -m experiments train [--config configs/tiny.toml] [--workdir runs/tiny] [--set key.sub=value ...]
  python -m experiments eval --workdir runs/tiny   (validation metrics of the chosen, else the latest, checkpoint)
  python -m experiments bench NAME [args...]   (NAME: see `python -m experiments bench --help`)
  python -m experiments profile [--config C] [--set ...] [--steps N] [--out DIR]   (docs/profiling.md)
  python -m experiments fuzz attention --seconds S   (randomized kernel-vs-reference sweep)
  python -m experiments sweep --config C --grid GRID.toml [--out DIR]   (see experiments/sweep.py)
  python -m experiments data {convert,synth,inspect,validate} ...   (ranking records on disk, docs/data.md)

Multi-process runs (several hosts, or CPU processes with gloo): give train/eval `--coordinator
HOST:PORT --num-processes N --process-id I` (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID), or `--distributed` to let jax detect the cluster (SLURM, Open MPI, TPU...).

Config errors (unknown keys, wrong types, bad values, unreadable data) and workdir errors (a file, not
writable, locked by another trainer, holding a run with other settings, no intact checkpoint, a write
the disk refused) print one line and exit with code 2; a diverged run (NaN/Inf) exits with code 3.
SIGINT/SIGTERM save a checkpoint and exit 0 once training has started; before that (start-up,
compilation) they exit at once with 128 + the signal number (gem_jax/train/interrupt.py). In a
multi-process run, a process lost for `--peer-timeout` seconds stops the others with exit code 75
(gem_jax/train/peers.py); `train --restarts K` relaunches the trainer after a lost process or a crash
(gem_jax/train/supervisor.py, which also runs every multi-process `train`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

import jax

from experiments import data, fuzz, sweep
from experiments.profile import main as profile_main
from gem_jax import distributed
from gem_jax.config import ConfigError, load_config
from gem_jax.data.records.errors import DataError
from gem_jax.paths import DEFAULT_CONFIG
from gem_jax.tasks import make_task
from gem_jax.train import interrupt, peers, supervisor
from gem_jax.train.files import WriteFailed
from gem_jax.train.interrupt import INTERRUPTS
from gem_jax.train.loop import TrainingDiverged, evaluate_run, train
from gem_jax.train.run_record import RunRecord
from gem_jax.train.run_status import STATUS
from gem_jax.train.workdir_lock import WorkdirError

# `bench NAME`: its module (whose main(argv) runs it) and what it measures; "GPU" ones need one to time.
BENCHMARKS = {
    "attention": (
        "experiments.benchmarks.attention",
        "jagged attention kernels, forward and backward (GPU; --quick: CPU)",
    ),
    "bias_rows": (
        "experiments.benchmarks.bias_rows",
        "building the attention's relative-bias array (GPU; --quick: CPU)",
    ),
    "block_attention": ("experiments.benchmarks.block_attention", "the block attention kernel (GPU)"),
    "mosaic_attention": ("experiments.benchmarks.mosaic_attention", "the Hopper forward's tiles (H100/H200)"),
    "train_step": (
        "experiments.benchmarks.train_step",
        "device step vs input pipeline, TFLOP/s, MFU (--config C)",
    ),
    "pipeline": ("experiments.benchmarks.pipeline", "the input pipeline alone, and its memory (--config C)"),
    "balance": ("experiments.benchmarks.balance", "attention work per device with and without data.balance"),
    "fp8": ("experiments.benchmarks.fp8", "FP8 Dense vs bf16 Dense (GPU; --small: CPU)"),
    "fp8_out": (
        "experiments.benchmarks.fp8_out",
        "FP8 GEMM with a bf16 result: the forms XLA's cuBLASLt rewrite takes (GPU; --small: CPU)",
    ),
    "embeddings": (
        "experiments.benchmarks.embeddings",
        "sparse lookup + row-wise update (GPU; --small: CPU)",
    ),
    "norm": ("experiments.benchmarks.norm", "the fused layer-norm kernels vs XLA's (GPU; --quick: CPU)"),
    "norm_gemm": (
        "experiments.benchmarks.norm_gemm",
        "LN + GEMM + SiLU in one Hopper kernel vs XLA's route (H100/H200; --quick: CPU)",
    ),
    "silu_fp8": (
        "experiments.benchmarks.silu_fp8",
        "SiLU's backward with FP8 output vs XLA (GPU; --quick: CPU)",
    ),
}


# The benchmarks that time GPU kernels, and each one's flag for a run on CPU at small sizes (None: it has
# none and needs a GPU). Without the flag on a CPU they would run the kernels in Pallas's interpreter at
# full size, for tens of minutes: `bench` refuses instead (`_bench`).
GPU_BENCHMARKS = {
    "attention": "--quick",
    "bias_rows": "--quick",
    "block_attention": None,
    "mosaic_attention": None,
    "fp8": "--small",
    "fp8_out": "--small",
    "embeddings": "--small",
    "norm": "--quick",
    "norm_gemm": "--quick",
    "silu_fp8": "--quick",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train (or resume) a run",
        description="Trains a run, or resumes it from its newest intact checkpoint. Without options: the main "
        f"job, configs/{DEFAULT_CONFIG.name} into runs/{DEFAULT_CONFIG.stem}. docs/running.md has the run "
        "directory, the resume rules and every failure's line and exit code.",
    )
    train.add_argument(
        "--config",
        default=None,
        help=f"TOML config: a path, or a name in configs/ such as {DEFAULT_CONFIG.name} (default: "
        f"configs/{DEFAULT_CONFIG.name}, the main job)",
    )
    train.add_argument("--workdir", default=None, help="run directory (default: runs/<config name>)")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=100 (repeatable)",
    )
    train.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (with a checkpoint) after this step, as a preemption would",
    )
    train.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="K",
        help="relaunch after a lost peer or a crash, from the last intact checkpoint, at most K times "
        "(gem_jax/train/supervisor.py)",
    )
    train.add_argument(
        "--profile-steps",
        type=_step_window,
        default=None,
        metavar="A:B",
        help="trace global steps A..B-1 with jax.profiler into <workdir>/profile (docs/profiling.md)",
    )
    ev = sub.add_parser(
        "eval",
        help="validation metrics of a run's chosen checkpoint (best/), else its latest; reads only",
        description="Validation metrics of a run's chosen checkpoint (best/), else its newest intact one, with "
        "the run's recorded config; and the test metrics the run recorded (the test split is never scored "
        "again). Reads only: it may run beside the trainer.",
    )
    ev.add_argument(
        "--workdir",
        required=True,
        help="the run directory a `train` wrote: its recorded config.toml, best/ and checkpoints/ are read",
    )
    ev.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the recorded config for this evaluation only, e.g. --set train.eval_batches=2 "
        "or --set data.eval_path=DIR (repeatable; nothing is written)",
    )
    for p in (train, ev):
        group = p.add_argument_group("multi-process (see gem_jax/distributed.py)")
        group.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
        group.add_argument("--num-processes", type=int, default=None)
        group.add_argument("--process-id", type=int, default=None)
        group.add_argument("--distributed", action="store_true", help="detect the cluster (SLURM, MPI, TPU)")
        group.add_argument("--cluster-detection", default=None, help='a jax detection method, e.g. "mpi4py"')
        group.add_argument(
            "--peer-timeout",
            type=float,
            default=30.0,
            metavar="S",
            help="stop every process when one has shown no sign of life for S seconds (exit 75)",
        )
    sweep.add_arguments(sub.add_parser("sweep", help="run a grid of configs, one subprocess per point"))
    bench = sub.add_parser(
        "bench",
        help="benchmarks (most need a GPU; each: bench NAME --help)",
        description="Benchmarks; `bench NAME --help` gives each one's options. Those marked GPU or H100/H200 time GPU "
        "kernels: without a GPU they refuse to run unless given the flag named beside them (a run at small sizes "
        "that checks they work, not a timing).\n\n"
        + "\n".join(f"  {name:17s} {what}" for name, (_, what) in sorted(BENCHMARKS.items())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", choices=sorted(BENCHMARKS), metavar="NAME")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    profile = sub.add_parser("profile", help="where a train step's time goes (jax.profiler)", add_help=False)
    profile.add_argument("args", nargs=argparse.REMAINDER)
    data = sub.add_parser("data", help="ranking records: convert, synth, inspect, validate", add_help=False)
    data.add_argument("args", nargs=argparse.REMAINDER, help="see `python -m experiments data --help`")
    fuzz = sub.add_parser(
        "fuzz", help="randomized correctness sweep of a kernel against its reference", add_help=False
    )
    fuzz.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _step_window(text: str) -> tuple[int, int]:
    """ "A:B" -> (A, B) with 0 <= A < B: the global steps A..B-1."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (two step numbers), got {text!r}") from None
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"need 0 <= A < B, got {text!r}")
    return start, stop


def main(argv: list[str] | None = None) -> int:
    if not INTERRUPTS.installed:  # first: no KeyboardInterrupt from here on
        INTERRUPTS.install()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:  # its options are experiments/profile.py's own (argparse's REMAINDER
        return _profile(argv[1:])  # does not take leading options)
    if argv[:1] == ["data"]:  # data and fuzz parse their own options too (and answer their own --help)
        return data.main(argv[1:])
    if argv[:1] == ["fuzz"]:
        return fuzz.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args.name, args.args)
    if args.command == "sweep":
        return sweep.run(args)

    joining = (args.coordinator, args.num_processes, args.process_id)
    multi = distributed.requested(*joining, auto=args.distributed, cluster_detection=args.cluster_detection)
    if args.command == "train" and not supervisor.supervised() and (multi or args.restarts > 0):
        settle_s = args.peer_timeout + 5 if multi else 1.0  # every old process gone, the port free
        return supervisor.run(argv, restarts=args.restarts, settle_s=settle_s)
    if supervisor.supervised():
        interrupt.exit_with_parent()
    try:
        joined = distributed.initialize(
            *joining,
            auto=args.distributed,
            cluster_detection=args.cluster_detection,
            heartbeat_timeout_s=peers.jax_heartbeat_timeout_s(args.peer_timeout),
        )
    except distributed.DistributedError as e:
        print(f"distributed: {e}", file=sys.stderr)
        return 2
    if joined:
        peers.watch(args.peer_timeout)

    try:
        if args.command == "train":
            config_path = Path(args.config) if args.config else DEFAULT_CONFIG
            config = load_config(config_path, args.overrides)
            workdir = Path(args.workdir) if args.workdir else Path("runs") / config_path.stem
            task = make_task(RunRecord(workdir).with_run_choices(config))
            summary = train(
                task,
                workdir,
                stop_after=args.stop_after,
                profile_steps=args.profile_steps,
                restart=supervisor.restart_record(),
            )
        else:
            config = RunRecord(Path(args.workdir)).recorded_config(args.overrides)
            task = make_task(config)
            summary = evaluate_run(task, args.workdir)
    except ConfigError as e:
        return _stop(2, f"config error: {e}")
    except WriteFailed as e:  # at once: orbax's and TensorBoard's threads would print on a full disk
        return _stop(2, f"{e}: stopping; {STATUS.last_intact()}", at_once=True)
    except WorkdirError as e:
        return _stop(2, f"workdir error: {e}")
    except DataError as e:
        return _stop(2, f"data error: {e}")
    except TrainingDiverged as e:
        return _stop(3, f"training diverged: {e}")
    except Exception as e:
        if peers.WATCH is None:
            raise
        if isinstance(e, RuntimeError):  # a collective with a lost process fails at once (CPU, gloo)
            peers.WATCH.await_verdict()
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        who = f"process {peers.WATCH.me}"
        interrupt.exit_now(1, f"failed with {type(e).__name__}: {first} (the traceback is in {who}'s output)")
    print(_format_summary(summary, task.summary_lines(summary)))
    return 0


def _bench(name: str, argv: list[str]) -> int:
    """Runs `bench NAME`; a GPU benchmark on a machine without a GPU is refused in one line (exit 2) unless
    it is asked for its small CPU run (or its help)."""
    if name in GPU_BENCHMARKS and jax.default_backend() == "cpu" and not {"-h", "--help"} & set(argv):
        flag = GPU_BENCHMARKS[name]
        if flag is None:
            print(f"bench {name} times GPU kernels and needs a GPU (jax found only the CPU)", file=sys.stderr)
            return 2
        if flag not in argv:
            print(
                f"bench {name} times GPU kernels: jax found only the CPU, where the kernels would run in "
                f"Pallas's interpreter at full size for tens of minutes; add {flag} for a run at small sizes "
                "(a check that it works, not a timing), or run it on a GPU",
                file=sys.stderr,
            )
            return 2
    return importlib.import_module(BENCHMARKS[name][0]).main(argv)


def _stop(code: int, line: str, *, at_once: bool = False) -> int:
    """Ends with a one-line error: returns its exit code, or ends the process at once (and, in a
    multi-process run, every other one with it: gem_jax/train/peers.py)."""
    if at_once or peers.WATCH is not None:
        interrupt.exit_now(code, line)
    print(line, file=sys.stderr)
    return code


def _profile(argv: list[str]) -> int:
    try:
        return profile_main(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


def _format_summary(summary: dict, task_lines: list[str]) -> str:
    lines = [f"== {summary.get('workdir')} at step {summary.get('step')}"]
    if summary.get("already_finished"):
        lines += [
            f"   already finished at step {summary['step']}: nothing to train "
            f"({summary['train_time_s']:.1f} s of training over all its invocations)",
            f"   evaluate it again: python -m experiments eval --workdir {summary['workdir']}; "
            "to train again, give another --workdir",
        ]
        if summary.get("final") or summary.get("eval"):
            lines.append("   its last recorded metrics (metrics.jsonl):")
    elif "wall_time_s" in summary:
        if summary.get("interrupted"):
            state = "interrupted (checkpoint saved)"
        elif summary.get("stopped_early"):
            state = "stopped early (no better validation metric)"
        elif summary.get("out_of_time"):
            state = "stopped at the time budget"
        else:
            state = "done"
        lines.append(
            f"   {state}: {summary['wall_time_s']:.1f} s on {summary['devices']} x {summary['device_kind']}"
            f" ({summary['train_time_s']:.1f} s of training over all invocations)"
        )
    final = summary.get("final") or {}
    if final:
        lines.append(f"   final train loss {final.get('loss', float('nan')):.4f}")
    lines += task_lines
    lines.append(json.dumps(summary, default=str))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
