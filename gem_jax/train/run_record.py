"""The run record: what a run directory's checkpoints mean, written once and checked on every re-run.

Files (all written atomically):

* `config.toml`: the resolved config of the run, written once when the run starts, with what the run
  decided then (`precision.fp8_auto_choice`: the layers `precision.fp8 = "auto"` put in FP8).
* `run.json`: written once beside it: the data fingerprint (synthetic data: its generator settings;
  an interactions file: its path, size and sha256; records: every shard's name, size and sha256 as its
  schema.json lists them), the code version (package version, git commit
  and whether the tree had uncommitted changes, jax version), the creation time and host.
* `resumes.jsonl`: one line per later invocation: time, host, code version, the checkpoint step it
  resumed from, and the settings in `MAY_CHANGE` that differ from `config.toml` (its effective
  overrides; `eval --workdir` applies the last line's); for a supervisor's relaunch (`--restarts`),
  `restart`: the attempt, of how many, and the line that reported the end before it.

A re-run first takes those decisions from the record where its own config leaves them open
(`with_run_choices`: the stored choice wins over what this machine would choose), then compares its config
and data with the record before anything in the workdir is written.
Any difference outside `MAY_CHANGE`, or data whose content changed, is refused with one line naming
the differing keys (`RecordMismatch`, exit code 2): a changed model would fail to restore, changed
data or a changed optimizer would silently continue a different run. A workdir with no checkpoint
yet holds no state to protect: a re-run there starts the run over and writes a new record.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import importlib.metadata
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import jax

from gem_jax.config import Config, ConfigError, DataConfig, config_to_toml, load_recorded_config, schema_keys
from gem_jax.data.records.dataset import records_fingerprint
from gem_jax.data.synthetic import stream_version
from gem_jax.paths import in_repository
from gem_jax.train import files
from gem_jax.train.workdir_lock import WorkdirError

CONFIG_FILE = "config.toml"
RECORD_FILE = "run.json"
RESUMES_FILE = "resumes.jsonl"
FORMAT = 1

# The keys that may differ between invocations of one run (`setting(..., may_change=True)` in
# gem_jax/config.py says why): how long, how often or how verbosely it trains, where it reads identical
# data, on which devices. Every other key must equal the record. docs/running.md ("Starting fresh, resuming")
# lists them; a test checks the list.
MAY_CHANGE = tuple(key for key, _, f in schema_keys() if f.metadata.get("may_change"))
# Not `data.num_workers`: grain's worker processes each pack their own slice of the example stream, so
# the worker count decides which examples a batch holds, and the saved data position is per worker (a
# resume with another count failed inside grain's set_state).


def may_change(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_CHANGE)


# data.* keys that do not change which examples the synthetic generator produces.
_NOT_DATA_IDENTITY = tuple(
    f.name for f in dataclasses.fields(DataConfig) if not f.metadata.get("fingerprint", True)
)


class RecordMismatch(WorkdirError):
    """The workdir holds a run whose config or data differ from this invocation's."""


# ----------------------------------------------------------------------------- fingerprints


def data_fingerprint(config: Config) -> dict[str, Any]:
    """What identifies the training data: the file's path, size and hash, or the generator settings.

    Hashing takes about 0.1 s for the 20-30 MB interaction files, so it is done on every start, not cached.
    Returned in its JSON form (tuples as lists), so it compares equal to the copy read back from run.json.
    """
    return json.loads(json.dumps(_fingerprint(config)))


def _fingerprint(config: Config) -> dict[str, Any]:
    d = config.data
    if d.kind == "interactions":
        path = in_repository(d.path).resolve()
        return {"kind": d.kind, "path": str(path), "size": path.stat().st_size, "sha256": files.sha256(path)}
    if d.kind == "records":
        return {"kind": d.kind, **records_fingerprint(d)}

    settings = {k: v for k, v in dataclasses.asdict(d).items() if k not in _NOT_DATA_IDENTITY}
    return {"kind": d.kind, "generator": settings, "stream": stream_version(d)}


def code_version() -> dict[str, Any]:
    """Package version, git commit (and whether the tree had uncommitted changes), jax version."""
    try:
        package = importlib.metadata.version("gem-jax")
    except importlib.metadata.PackageNotFoundError:
        package = None
    out: dict[str, Any] = {"package": package, "jax": jax.__version__, "git": None, "dirty": None}
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            git = ["git", "-C", str(root)]
            out["git"] = subprocess.run(
                [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            status = subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            out["dirty"] = bool(status.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    return out


# ----------------------------------------------------------------------------- comparing


def _flat(config: Config) -> dict[str, Any]:
    """{"model.model_dim": 64, ...}; named tables one level deeper ("embeddings.tables.items.rows"),
    other nested tables compare as whole values."""
    out = {}
    for section, values in config.to_dict().items():
        for key, value in values.items():
            named = isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values())
            if named:
                for name, fields in value.items():
                    out.update({f"{section}.{key}.{name}.{f}": v for f, v in fields.items()})
            else:
                out[f"{section}.{key}"] = value
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def differences(recorded: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ: key -> (recorded value, new value)."""
    a, b = _flat(recorded), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _same_data(recorded: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    if recorded is None:  # a run that predates run records: nothing to compare
        return True
    if new.get("kind") == "interactions" and recorded.get("kind") == "interactions":
        return (recorded.get("size"), recorded.get("sha256")) == (new["size"], new["sha256"])
    return recorded == new


def _fingerprint_difference(was: dict[str, Any], now: dict[str, Any], prefix: str = "") -> str:
    """The keys whose values differ between two fingerprints, e.g. `generator.num_items 500 -> 600`."""
    out = []
    for key in sorted(set(was) | set(now)):
        a, b = was.get(key), now.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out.append(_fingerprint_difference(a, b, f"{prefix}{key}."))
        else:
            out.append(f"{prefix}{key} {_short(a)} -> {_short(b)}")
    return "; ".join(out)


# ----------------------------------------------------------------------------- the record


@dataclasses.dataclass
class Plan:
    """What `RunRecord.check` found: a new run, or a resume with these allowed changes."""

    new: bool
    changed: dict[str, tuple[Any, Any]]  # allowed keys that differ from config.toml
    record: dict[str, Any] | None  # run.json as found (None: new run, or a run from before run records)


class RunRecord:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.config_path = self.workdir / CONFIG_FILE
        self.record_path = self.workdir / RECORD_FILE
        self.resumes_path = self.workdir / RESUMES_FILE

    def has_run(self) -> bool:
        """Whether the workdir holds a run to protect: a record and at least one checkpoint step."""
        if not self.config_path.exists():
            return False
        return any(
            p.name.isdigit()
            for sub in ("checkpoints", "best")
            if (self.workdir / sub).is_dir()
            for p in (self.workdir / sub).iterdir()
        )

    def recorded_config(self, overrides: tuple[str, ...] | list[str] = ()) -> Config:
        """config.toml with the last resume's changes, then `overrides` (`--set key=value`)."""
        if not self.config_path.exists():
            raise ConfigError(f"{self.config_path} not found: is {self.workdir} a run directory?")
        changes = []
        if self.resumes_path.exists():
            lines = [line for line in self.resumes_path.read_text().splitlines() if line.strip()]
            for line in reversed(lines):
                try:
                    last = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a crash: the one before it holds
                    continue
                changes = [f"{k}={json.dumps(v[1])}" for k, v in last.get("changed", {}).items()]
                break
        return load_recorded_config(self.config_path, changes, overrides)

    def with_run_choices(self, config: Config) -> Config:
        """`config` with the FP8 layers the recorded run chose, where `config` asks for "auto" and leaves the
        choice open: a resumed run keeps its layers whatever GPU it resumes on. Anything else as is (a
        changed key is `check`'s to refuse)."""
        p = config.precision
        if p.fp8 != "auto" or p.fp8_auto_choice is not None or not self.has_run():
            return config
        try:
            recorded = load_recorded_config(self.config_path).precision
        except ConfigError:  # `check` says why the record does not load
            return config
        if recorded.fp8 != "auto":
            return config
        return dataclasses.replace(
            config, precision=dataclasses.replace(p, fp8_auto_choice=recorded.fp8_auto_choice)
        )

    def check(self, config: Config, fingerprint: dict[str, Any]) -> Plan:
        """Compares with the record (reads only); raises RecordMismatch naming every refused key."""
        if not self.has_run():
            return Plan(new=True, changed={}, record=None)
        try:
            recorded = load_recorded_config(self.config_path)
        except ConfigError as e:
            raise RecordMismatch(
                f"the recorded config of {self.workdir} does not load with this code ({e}); "
                "evaluate it with the code that wrote it, or start a fresh run in another --workdir"
            ) from None
        record = files.read_json(self.record_path)
        same_data = _same_data(None if record is None else record.get("data"), fingerprint)
        diff = differences(recorded, config)
        refused = [k for k in diff if not may_change(k) or (k == "data.path" and not same_data)]
        parts = [f"{k} {_short(diff[k][0])} -> {_short(diff[k][1])}" for k in refused]
        if not same_data:
            was, now = record["data"], fingerprint
            if was.get("kind") == "interactions" and now.get("kind") == "interactions":
                parts.append(
                    f"data file content (size {was.get('size')} sha256 {str(was.get('sha256'))[:12]} -> "
                    f"size {now['size']} sha256 {now['sha256'][:12]}, {now['path']})"
                )
            elif "data.kind" not in refused:
                parts.append(f"data fingerprint ({_fingerprint_difference(was, now)})")
        if parts:
            raise RecordMismatch(
                f"{self.workdir} holds a run with other settings, which would not resume correctly: "
                f"{'; '.join(parts)}. Resume with the recorded settings ({self.config_path}), or start a "
                "fresh run in another --workdir"
            )
        return Plan(new=False, changed={k: diff[k] for k in diff}, record=record)

    def write(
        self,
        plan: Plan,
        config: Config,
        fingerprint: dict[str, Any],
        resumed_from: int | None,
        restart: dict[str, Any] | None = None,
    ) -> None:
        """Writes the record of a new run, or appends this resume (call with the workdir lock held).

        `restart`: this invocation is a supervisor's relaunch (its attempt, of how many, after what);
        a line is appended for it even when the run starts over (no checkpoint was saved before)."""
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        code = code_version()
        if plan.new or plan.record is None:
            if plan.new:
                files.write_text(self.config_path, config_to_toml(config))
                if self.resumes_path.exists():
                    self.resumes_path.unlink()  # resumes of an earlier attempt that never saved a step
            files.write_json(
                self.record_path,
                {
                    "format": FORMAT,
                    "created": now,
                    "host": socket.gethostname(),
                    "data": fingerprint,
                    "code": code,
                    **({} if plan.new else {"note": "recorded at a resume: the run predates run records"}),
                },
            )
            if plan.new and restart is None:
                return
        line = {
            "time": now,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "resumed_from_step": resumed_from,
            "code": code,
            "changed": {k: [a, b] for k, (a, b) in plan.changed.items()},
            **({"restart": restart} if restart else {}),
        }
        with files.writing(self.resumes_path), open(self.resumes_path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
