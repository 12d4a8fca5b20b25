"""`python -m experiments sweep --config C --grid GRID.toml [--out DIR]`: a grid of config points, each
measured in its own subprocess (`experiments/measure.py`), so an OOM, a compile failure or a crash is
a recorded outcome, not the end of the sweep, and points may use different device counts.

A grid file (examples in configs/sweeps/):

    [sweep]                      # how each point runs (every key optional)
    steps = 10                   # train steps per point; the loss after the last one is recorded
    warmup = 2                   # steps left out of the median step time
    batches = 0                  # distinct input batches cycled through (0: one per step)
    cpu_devices = 0              # > 0: run on that many fake CPU devices (XLA_FLAGS); 0: the machine's
    timeout_s = 1800             # a point running longer is killed and recorded as "timeout"

    [base]                       # config overrides every point shares (dotted keys, or nested tables)
    "train.learning_rate" = 1e-3

    [grid]                       # the cartesian product of these alternatives...
    "data.examples_per_shard" = [8, 16]

    [[points]]                   # ...crossed with these named points (default: one empty point)
    name = "dp8"
    "parallel.mesh_shape" = [8]

Any config key can be swept (mesh shapes, `parallel.rules`, an embedding table's `sharding`, batch
sizes...); keys `sweep.<setting>` in [grid] or a point change that point's run settings. Outputs in
the out folder (default runs/sweeps/<grid name>): `results.jsonl` (one record per finished point),
`results.csv`, `results.md` (a markdown table) and `plot.png` (step time and memory per point),
rewritten after every point; `points/<id>/` holds each point's log and record. Re-running the same
command skips the points already recorded (`--retry` re-runs those that crashed, timed out or
failed with an error; "invalid" and "oom" points stay recorded as such); `--budget-s` stops starting
points after a while, so a long sweep can run as several bounded commands.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from gem_jax.config import toml_value

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"steps": 10, "warmup": 2, "batches": 0, "cpu_devices": 0, "timeout_s": 1800}
RETRIED = ("crashed", "timeout", "error")
GIB, MIB = 1 << 30, 1 << 20


class GridError(ValueError):
    """The grid file is malformed; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    overrides: dict[str, Any]  # dotted config key -> value
    settings: dict[str, Any]  # SETTINGS, as this point runs them

    def id(self, config: str) -> str:
        key = json.dumps([config, self.overrides, self.settings], sort_keys=True)
        return hashlib.sha1(key.encode()).hexdigest()[:12]

    def set_args(self) -> list[str]:

        return [f"{k}={toml_value(v)}" for k, v in self.overrides.items()]


# ----------------------------------------------------------------------------- grid files


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c.d": 2} -> {"a.b": 1, "c.d": 2}; empty tables stay values."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _split_settings(values: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    overrides, settings = {}, {}
    for k, v in values.items():
        if k.startswith("sweep."):
            name = k[len("sweep.") :]
            if name not in SETTINGS:
                raise GridError(f"{where}: unknown setting `{k}` (known: {', '.join(SETTINGS)})")
            settings[name] = v
        else:
            overrides[k] = v
    return overrides, settings


def load_grid(path: str | Path) -> list[Point]:
    """The points of a grid file, in order: each [[points]] entry crossed with the [grid] product."""
    path = Path(path)
    try:
        spec = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise GridError(f"grid file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise GridError(f"{path}: not valid TOML: {e}") from None
    unknown = set(spec) - {"sweep", "base", "grid", "points"}
    if unknown:
        raise GridError(f"{path}: unknown table(s) {sorted(unknown)} (known: sweep, base, grid, points)")
    settings = dict(SETTINGS)
    for k, v in spec.get("sweep", {}).items():
        if k not in SETTINGS:
            raise GridError(f"{path}: unknown key `sweep.{k}` (known: {', '.join(SETTINGS)})")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GridError(f"{path}: `sweep.{k}` must be a non-negative integer, got {v!r}")
        settings[k] = v
    base, base_settings = _split_settings(_flatten(spec.get("base", {})), f"{path} [base]")
    settings.update(base_settings)

    axes: list[tuple[str, list[dict[str, Any]]]] = []
    for key, alternatives in _flatten(spec.get("grid", {})).items():
        if not isinstance(alternatives, list) or not alternatives:
            raise GridError(
                f"{path}: `grid.{key}` must be a non-empty list of alternatives, got {alternatives!r}"
            )
        axes.append(
            (key, [_flatten(a, f"{key}.") if isinstance(a, dict) and a else {key: a} for a in alternatives])
        )
    named = spec.get("points", [{}])
    if not isinstance(named, list) or not all(isinstance(p, dict) for p in named):
        raise GridError(f"{path}: `points` must be an array of tables ([[points]])")

    points = []
    for i, entry in enumerate(named):
        entry = dict(entry)
        label = entry.pop("name", None)
        own, own_settings = _split_settings(_flatten(entry), f"{path} points[{i}]")
        for combo in itertools.product(*(alts for _, alts in axes)):
            overrides = {**base, **own}
            point_settings = {**settings, **own_settings}
            parts = [label] if label else []
            for (key, _), choice in zip(axes, combo, strict=True):
                choice_overrides, choice_settings = _split_settings(choice, f"{path} grid.{key}")
                overrides.update(choice_overrides)
                point_settings.update(choice_settings)
                parts.append(
                    ",".join(
                        f"{k.rsplit('.', 1)[-1]}={json.dumps(v, separators=(',', ':'))}"
                        for k, v in choice.items()
                    )
                )
            points.append(Point(" ".join(parts) or "base", overrides, point_settings))
    return points


# ----------------------------------------------------------------------------- running points


def _point_env(settings: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if settings["cpu_devices"]:
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
        ]
        env["XLA_FLAGS"] = " ".join(
            [*flags, f"--xla_force_host_platform_device_count={settings['cpu_devices']}"]
        )
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_point(point: Point, config: str, folder: Path) -> dict[str, Any]:
    """Runs one point in a subprocess (its own process group, killed whole on timeout); the record."""
    folder.mkdir(parents=True, exist_ok=True)
    result = folder / "result.json"
    result.unlink(missing_ok=True)
    s = point.settings
    command = [
        sys.executable,
        "-m",
        "experiments.measure",
        "--config",
        config,
        "--steps",
        str(s["steps"]),
        "--warmup",
        str(s["warmup"]),
        "--batches",
        str(s["batches"]),
        "--out",
        str(result),
    ]
    for arg in point.set_args():
        command += ["--set", arg]
    (folder / "command.txt").write_text(" ".join(command) + "\n")
    t0 = time.perf_counter()
    status = None
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=_point_env(s), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=s["timeout_s"] or None)
        except subprocess.TimeoutExpired:
            status, rc = "timeout", None
        except BaseException:  # Ctrl-C: stop the point's processes too; the point stays unrecorded
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall_s = time.perf_counter() - t0
    if status is None and result.exists():
        record = json.loads(result.read_text())
    else:
        tail = (folder / "log.txt").read_text(errors="replace").strip().splitlines()[-15:]
        record = {
            "status": status or "crashed",
            "error": (f"killed after {s['timeout_s']} s" if status else f"exit code {rc}, no record")
            + ("; log: " + " | ".join(tail) if tail else ""),
        }
    return {
        "name": point.name,
        "overrides": point.overrides,
        "settings": point.settings,
        **record,
        "wall_s": wall_s,
    }


# ----------------------------------------------------------------------------- reports


def _num(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "" if value is None else f"{value / scale:.{digits}f}"


def _row(record: dict[str, Any]) -> dict[str, str]:
    coll = record.get("collectives") or {}
    mesh = record.get("mesh") or {}
    row = {
        "name": record["name"],
        "status": record["status"],
        "devices": str(record.get("devices", "")),
        "mesh": " x ".join(f"{a}={n}" for a, n in mesh.items()),
        "compile_s": _num(record.get("compile_s"), digits=1),
        "step_ms": _num(record.get("step_s_median"), 1e-3),
        "tokens_per_s": _num(record.get("tokens_per_s"), digits=0),
        "examples_per_s": _num(record.get("examples_per_s"), digits=0),
        "mfu": _num(record.get("mfu"), digits=3),
        "loss": _num(record.get("loss"), digits=4),
        "mem_estimate_gib": _num(record.get("memory_estimate_bytes"), GIB, 3),
        "mem_measured_gib": _num(record.get("memory_measured_bytes"), GIB, 3),
    }
    for kind in ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute"):
        row[f"{kind}_mib"] = _num((coll.get(kind) or {}).get("bytes"), MIB, 3)
    row["error"] = (record.get("error") or "").replace("\n", " ")[:300]
    row["overrides"] = json.dumps(record["overrides"], separators=(",", ":"))
    row["id"] = record["id"]
    return row


MD_COLUMNS = {
    "name": "point",
    "status": "status",
    "devices": "devices",
    "compile_s": "compile s",
    "step_ms": "step ms (median)",
    "tokens_per_s": "tokens/s",
    "mfu": "MFU",
    "loss": "loss@K",
    "mem_estimate_gib": "mem GiB (compiled)",
    "mem_measured_gib": "mem GiB (measured)",
    "all-reduce_mib": "all-reduce MiB",
    "all-gather_mib": "all-gather MiB",
    "all-to-all_mib": "all-to-all MiB",
    "reduce-scatter_mib": "reduce-scatter MiB",
    "collective-permute_mib": "permute MiB",
}


def write_reports(out: Path, records: list[dict[str, Any]]) -> None:
    """results.csv, results.md and plot.png from the records (in grid order)."""
    rows = [_row(r) for r in records]
    if not rows:
        return
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| " + " | ".join(MD_COLUMNS.values()) + " |",
        "| " + " | ".join("---" if k in ("name", "status") else "---:" for k in MD_COLUMNS) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(row[k] for k in MD_COLUMNS) + " |")
    failed = [row for row in rows if row["status"] != "ok"]
    if failed:
        lines.append("")
        lines += [f"- {row['name']}: {row['status']}: {row['error']}" for row in failed]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(out / "plot.png", records)


def _plot(path: Path, records: list[dict[str, Any]]) -> None:
    try:
        import matplotlib  # optional dependency: the plots extra
    except ImportError:
        print("matplotlib is not installed: no plot.png (pip install -e '.[plots]')", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: the plots extra

    names = [r["name"] for r in records]
    y = range(len(records))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 0.45 * len(records) + 1.6), sharey=True)
    step_ms = [(r.get("step_s_median") or 0) * 1e3 for r in records]
    ax_t.barh(y, step_ms, color="tab:blue")
    for i, r in enumerate(records):
        if r["status"] != "ok":
            ax_t.text(0, i, f" {r['status']}", va="center", color="tab:red")
    ax_t.set_xlabel("step time, ms (median)")
    estimate = [(r.get("memory_estimate_bytes") or 0) / GIB for r in records]
    measured = [(r.get("memory_measured_bytes") or 0) / GIB for r in records]
    ax_m.barh(
        [i + 0.2 for i in y], estimate, height=0.4, label="compiled (memory analysis)", color="tab:orange"
    )
    ax_m.barh([i - 0.2 for i in y], measured, height=0.4, label="measured (peak in use)", color="tab:green")
    ax_m.set_xlabel("memory per device, GiB")
    ax_m.legend(loc="lower right", fontsize=8)
    ax_t.set_yticks(list(y), names, fontsize=8)
    ax_t.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", required=True, help="the base config (TOML)")
    parser.add_argument("--grid", required=True, help="the grid file (TOML, see configs/sweeps/)")
    parser.add_argument("--out", default=None, help="output folder (default runs/sweeps/<grid name>)")
    parser.add_argument("--retry", action="store_true", help=f"re-run recorded points with status {RETRIED}")
    parser.add_argument("--list", action="store_true", help="print the points and exit")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no new point after this many seconds (0: none); re-run the command to go on",
    )


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """Recorded points by id; a torn last line (a killed sweep) is ignored."""
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records[record["id"]] = record
    return records


def run(args: argparse.Namespace) -> int:
    try:
        points = load_grid(args.grid)
    except GridError as e:
        print(f"grid error: {e}", file=sys.stderr)
        return 2
    config = str(Path(args.config))
    if not Path(config).exists():
        print(f"config error: config file not found: {config}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("runs") / "sweeps" / Path(args.grid).stem
    ids = [p.id(config) for p in points]
    if args.list:
        for i, p in zip(ids, points, strict=True):
            print(f"{i}  {p.name}  {' '.join(p.set_args())}  {p.settings}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    log = out / "results.jsonl"
    records = read_records(log)
    if log.exists() and not log.read_text().endswith("\n"):  # a torn last line: start a new one
        with open(log, "a") as f:
            f.write("\n")
    print(f"sweep: {len(points)} points of {args.grid} on {config} -> {out}", file=sys.stderr)
    # SIGTERM (a scheduler, `timeout`) ends the sweep like Ctrl-C: the running point's processes are
    # killed with it and the point stays unrecorded, so the next run starts it again.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t_start = time.perf_counter()
    left = 0
    for n, (pid, point) in enumerate(zip(ids, points, strict=True), 1):
        old = records.get(pid)
        if old is not None and not (args.retry and old["status"] in RETRIED):
            print(f"[{n}/{len(points)}] {point.name}: recorded ({old['status']}), skipped", file=sys.stderr)
            continue
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            left += 1
            continue
        print(f"[{n}/{len(points)}] {point.name} ...", file=sys.stderr, flush=True)
        record = {"id": pid, **run_point(point, config, out / "points" / pid)}
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        records[pid] = record
        step = record.get("step_s_median")
        shown = f"{step * 1e3:.2f} ms/step" if step else record.get("error", "")[:200]
        print(f"    {record['status']}: {shown} ({record['wall_s']:.0f} s)", file=sys.stderr)
        write_reports(out, [records[i] for i in ids if i in records])
    write_reports(out, [records[i] for i in ids if i in records])
    table = out / "results.md"
    if table.exists():
        print(table.read_text())
    print(f"sweep: {out / 'results.csv'}, {table}, {out / 'plot.png'}", file=sys.stderr)
    if left:
        print(f"sweep: --budget-s spent, {left} point(s) left: run the same command again", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments sweep")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
