"""Reads a `jax.profiler` trace and says where a train step's device time goes, by named scope.

Pure functions over plain data, so the grouping is tested exactly on synthetic traces
(tests/test_profile.py); `experiments/profile.py` feeds them the real trace and the compiled step.

Inputs: the Chrome-trace JSON that `jax.profiler.trace` writes beside its xplane protobuf
(`plugins/profile/<run>/<host>.trace.json.gz`; no TensorFlow needed), and the compiled step's
optimised HLO text (`compiled.as_text()`), which maps every HLO instruction name (the `hlo_op` a
device event carries) to its `op_name` metadata, i.e. the `jax.named_scope` path it was traced in.

Where ops come from, per platform:
- GPU: the `/device:GPU:N` process, kernel and memcpy events on its "Stream #..." threads; XLA tags
  each kernel with `hlo_op` / `hlo_module` (from its launch annotation).
- TPU: the `/device:TPU:N` process, its "XLA Ops" thread (event name = HLO instruction name).
- CPU: XLA ops run as host-thread events in `/host:CPU` carrying `hlo_op` (and `device_ordinal`).

Time accounting (exact by construction): the step window runs from the first to the last op of
the traced steps; a moment when no op runs is idle ("host gaps"); a moment when several ops run
(CPU threads, GPU streams) is split equally between them; a moment inside nested events (a while
loop around its body ops) goes to the innermost one. So the groups plus idle add up to the window.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gem_jax.train.flops import FLOP_GROUPS

# Groups, in report order: the analytic FLOP count's groups first, then the ones it does not count.
GROUPS = (
    *FLOP_GROUPS,
    "gemm other",
    "embedding lookup",
    "embedding update",
    "optimizer",
    "collectives",
    "other fusions",
    "other modules",
)
IDLE = "idle (host gaps)"
# Named-scope words (gem_jax/model, gem_jax/tasks, gem_jax/train/step.py) -> the kind of GEMM.
GEMM_KINDS = ("input", "hstu", "cross", "wukong", "heads")
COLLECTIVE_OPCODES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
# Kernel-name fallbacks for ops without an HLO match (custom kernels named by their pallas_call).
_BACKWARD_KERNEL = re.compile(r"bwd|backward|_dq\b|_dkv|_dkdv|grad", re.IGNORECASE)
_GEMM_KERNEL = re.compile(r"gemm|matmul|cublas|xmma|cutlass|\bdot\b", re.IGNORECASE)
# Device lines: GPU streams, else TPU's "XLA Ops"; else every line but the derived ones that repeat
# or span the ops (modules, steps, framework scopes), so nothing is counted twice.
_STREAM_LINE = re.compile(r"^Stream #")
_DERIVED_LINE = re.compile(r"Module|Step|Name Scope|Framework|TensorFlow|Source|TraceMe|Launch")
_DEVICE_PROCESS = re.compile(r"^/device:([A-Z]+):(\d+)")


# ----------------------------------------------------------------------------- HLO


@dataclasses.dataclass(frozen=True)
class HloOp:
    """One instruction of the optimised HLO module, as far as grouping needs it."""

    name: str
    opcode: str
    op_name: str  # metadata op_name: "jit(f)/transpose(jvp(hstu/0/attention))/dot_general"
    gemm: bool  # a dot / convolution, a fusion around one, or a BLAS custom call
    collective: bool
    target: str = ""  # custom_call_target

    @property
    def backward(self) -> bool:
        return "transpose(" in self.op_name

    @property
    def tokens(self) -> set[str]:
        return set(re.split(r"[/(),]", self.op_name)) - {""}

    @property
    def scope(self) -> str:
        return scope_path(self.op_name)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-_]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|called_computations)=\{?([^}\s]*)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_BLAS_TARGET = re.compile(r"cublas|gemm|matmul|cudnn\$conv|onednn", re.IGNORECASE)


def parse_hlo_ops(hlo_text: str) -> dict[str, HloOp]:
    """Every instruction of an optimised HLO module text (all computations), by name.

    An instruction without an op_name takes the most common one of the instructions it calls
    (fusions), else of its operands, else of its users: XLA's CPU library fusions, for one, drop the
    metadata of the dots they wrap.
    """
    raw: dict[str, dict[str, Any]] = {}
    computations: dict[str, list[str]] = collections.defaultdict(list)
    current = None
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            name, rest = m.groups()
            opcode = _OPCODE.search(rest)
            op_name = _OP_NAME.search(rest)
            target = _TARGET.search(rest)
            calls = [c.lstrip("%") for group in _CALLS.findall(rest) for c in group.split(",") if c]
            operands = _OPERAND.findall(rest[opcode.end() : rest.find(")", opcode.end())]) if opcode else []
            raw[name] = {
                "opcode": opcode.group(1) if opcode else "",
                "op_name": op_name.group(1) if op_name else "",
                "target": target.group(1) if target else "",
                "calls": calls,
                "operands": operands,
            }
            computations[current].append(name)
            continue
        c = _COMPUTATION.match(line)
        if c and "=" not in line.split("{")[0]:
            current = c.group(1)

    def inner(name: str, seen: set[str]) -> Iterable[dict[str, Any]]:
        for comp in raw[name]["calls"]:
            if comp in seen:
                continue
            seen.add(comp)
            for inst in computations.get(comp, ()):
                yield raw[inst]
                if raw[inst]["opcode"] == "fusion":
                    yield from inner(inst, seen)

    def most_common(names: Iterable[str]) -> str:
        names = [n for n in names if n]
        return collections.Counter(names).most_common(1)[0][0] if names else ""

    users = collections.defaultdict(list)
    for name, r in raw.items():
        for operand in r["operands"]:
            users[operand].append(name)
    fused = {
        name: list(inner(name, set())) if r["opcode"] in ("fusion", "custom-call") else []
        for name, r in raw.items()
    }
    op_names = {
        name: r["op_name"] or most_common(f["op_name"] for f in fused[name]) for name, r in raw.items()
    }
    for _ in range(3):  # a few hops through operands, then users
        for name, r in raw.items():
            if not op_names[name]:
                op_names[name] = most_common(op_names[o] for o in r["operands"] if o in raw) or most_common(
                    op_names[u] for u in users[name]
                )
    ops = {}
    for name, r in raw.items():
        opcodes = {r["opcode"], *(f["opcode"] for f in fused[name])}
        op_name = op_names[name]
        gemm = bool(opcodes & {"dot", "convolution", "ragged-dot", "scaled-dot"}) or bool(
            r["opcode"] == "custom-call" and _BLAS_TARGET.search(r["target"])
        )
        collective = any(o.startswith(c) for o in opcodes for c in COLLECTIVE_OPCODES)
        ops[name] = HloOp(name, r["opcode"], op_name, gemm, collective, r["target"])
    return ops


def scope_path(op_name: str) -> str:
    """The named-scope path of an op_name, without transforms and the primitive:
    "jit(step)/transpose(jvp())/vmap(hstu/0/uvqk)/dot_general" -> "hstu/0/uvqk"."""
    ends_in_primitive = not op_name.endswith(")")
    s = re.sub(r"jit\([^()]*\)", "", op_name)
    s = re.sub(r"\b[a-z_]+\(", "", s).replace(")", "")
    parts = [p for p in s.split("/") if p and "->" not in p]  # einsum specs are not scopes
    if ends_in_primitive and parts:
        parts = parts[:-1]
    return "/".join(parts)


# ----------------------------------------------------------------------------- grouping


def classify(op: HloOp | None, kernel: str) -> str:
    """The group of one device op: named scopes first, HLO opcodes next, the kernel name last."""
    if op is None or not op.op_name:
        name = kernel.lower()
        if (op is not None and op.collective) or "nccl" in name:
            return "collectives"
        if "attention" in name or "flash" in name or "mha" in name:
            return "attention bwd" if _BACKWARD_KERNEL.search(kernel) else "attention fwd"
        if (op is not None and op.gemm) or _GEMM_KERNEL.search(kernel):
            return "gemm other"
        return "other fusions"
    tokens = op.tokens
    if op.collective:
        return "collectives"
    if "attention" in tokens:
        return "attention bwd" if op.backward else "attention fwd"
    if "embeddings" in tokens:
        return "embedding update" if op.backward else "embedding lookup"
    if "optimizer" in tokens:
        return "optimizer"
    if op.gemm:
        kind = next((k for k in GEMM_KINDS if k in tokens), "other")
        return f"gemm {kind}"
    return "other fusions"


# ----------------------------------------------------------------------------- trace events


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One op (kernel, memcpy, or CPU thunk) on the device timeline, times in microseconds."""

    name: str
    start: float
    duration: float
    lane: Any  # (pid, tid): ops on one lane run one at a time or nested
    hlo_op: str | None = None
    hlo_module: str | None = None

    @property
    def end(self) -> float:
        return self.start + self.duration


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome-trace JSON file (.json or .json.gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def find_trace_file(log_dir: str | Path) -> Path:
    """The newest `*.trace.json.gz` that `jax.profiler.trace(log_dir)` wrote."""
    runs = sorted((Path(log_dir) / "plugins" / "profile").glob("*/*.trace.json.gz"))
    if not runs:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {log_dir}")
    return max(runs, key=lambda p: p.stat().st_mtime)


def _arg(args: dict[str, Any], key: str) -> str | None:
    """`key` from the event's args, or parsed from an annotation string "...key=value,...#"."""
    if key in args:
        return str(args[key])
    pattern = re.compile(rf"\b{key}=([^,#\s]+)")
    for value in args.values():
        if isinstance(value, str) and (m := pattern.search(value)):
            return m.group(1)
    return None


def device_events(trace: dict[str, Any], device: int = 0) -> tuple[list[OpEvent], str]:
    """The ops that ran on one device, and where they were found ("/device:GPU:0", "/host:CPU").

    A GPU/TPU device process wins; without one (CPU) the host's XLA op events of
    `device_ordinal == device` are the device's ops.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]

    device_pids = [
        pid for pid, name in processes.items() if (m := _DEVICE_PROCESS.match(name)) and int(m[2]) == device
    ]
    for pid in device_pids:
        lanes = {key: name for key, name in threads.items() if key[0] == pid}
        streams = {k for k, n in lanes.items() if _STREAM_LINE.match(n)}
        chosen = (
            streams
            or {k for k, n in lanes.items() if n == "XLA Ops"}
            or {k for k, n in lanes.items() if not _DERIVED_LINE.search(n)}
        )
        ops = [
            _op_event(e)
            for e in complete
            if e["pid"] == pid and (not chosen or (e["pid"], e.get("tid")) in chosen)
        ]
        if ops:
            return ops, processes[pid]

    host = {pid for pid, name in processes.items() if name.startswith("/host:CPU")}
    ops = []
    for e in complete:
        args = e.get("args", {})
        if e["pid"] in host and "hlo_op" in args and int(args.get("device_ordinal", device)) == device:
            ops.append(_op_event(e))
    return ops, "/host:CPU"


def _op_event(e: dict[str, Any]) -> OpEvent:
    args = e.get("args", {})
    return OpEvent(
        name=e.get("name", ""),
        start=float(e["ts"]),
        duration=float(e.get("dur", 0.0)),
        lane=(e["pid"], e.get("tid")),
        hlo_op=_arg(args, "hlo_op"),
        hlo_module=_arg(args, "hlo_module"),
    )


def memory_timeline(trace: dict[str, Any]) -> list[tuple[float, float]]:
    """(time us, bytes in use) from the allocator's MemoryAllocation/Deallocation events, where the
    platform's allocator records them (GPU/TPU BFC allocators); [] otherwise (CPU)."""
    out = []
    for e in trace.get("traceEvents", []):
        if isinstance(e, dict) and e.get("name") in ("MemoryAllocation", "MemoryDeallocation"):
            value = e.get("args", {}).get("bytes_allocated")
            if value is not None:
                out.append((float(e["ts"]), float(value)))
    return sorted(out)


# ----------------------------------------------------------------------------- time accounting


def attribute(events: list[OpEvent]) -> tuple[list[float], float]:
    """Exclusive time of each event (same order) and the busy time (union of all events).

    Innermost event per lane, equal split across lanes (module docstring); the times sum to busy.
    """
    share = [0.0] * len(events)
    points = []
    for i, e in enumerate(events):
        if e.duration > 0:
            points.append((e.start, 1, i))
            points.append((e.end, 0, i))
    points.sort()  # at equal times, ends (0) before starts (1)
    active: dict[Any, list[int]] = collections.defaultdict(list)
    busy = 0.0
    previous = None
    for t, kind, i in points:
        if previous is not None and t > previous:
            tops = [
                max(stack, key=lambda j: (events[j].start, -events[j].end, j)) for stack in active.values()
            ]
            if tops:
                part = (t - previous) / len(tops)
                for j in tops:
                    share[j] += part
                busy += t - previous
        previous = t
        lane = events[i].lane
        if kind == 1:
            active[lane].append(i)
        else:
            active[lane].remove(i)
            if not active[lane]:
                del active[lane]
    return share, busy


@dataclasses.dataclass
class GroupRow:
    group: str
    ms: float = 0.0  # attributed (exclusive, split) milliseconds per step
    kernel_ms: float = 0.0  # plain sum of the ops' durations per step
    ops: float = 0.0  # ops per step
    flops: float | None = None  # analytic FLOPs per step per device, where known


@dataclasses.dataclass
class Breakdown:
    """Per-step device time by group (GroupRow), the idle time, and per-op detail."""

    source: str  # where the ops were found, e.g. "/device:GPU:0"
    steps: int
    step_ms: float  # the window / steps
    idle_ms: float
    rows: list[GroupRow]
    ops: list[dict[str, Any]]  # per HLO op: group, scope, kernel names, ms per step, count per step
    named_fraction: float  # share of busy time whose op resolved to a named scope

    @property
    def busy_ms(self) -> float:
        return self.step_ms - self.idle_ms


def breakdown(
    events: list[OpEvent],
    hlo_ops: dict[str, HloOp],
    *,
    steps: int,
    module: str | None = None,
    source: str = "",
) -> Breakdown:
    """Groups the device ops of `steps` traced steps (of HLO module `module`) into per-step times.

    The window spans the module's first to last op (every op when `module` is None or no event names
    its module); ops of other modules inside it count as "other modules".
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if all(e.hlo_module is None for e in events):
        module = None
    in_module = [e for e in events if module is None or e.hlo_module == module]
    if not in_module:
        seen = sorted({str(e.hlo_module) for e in events})
        raise ValueError(f"no device op of module {module!r} in the trace (modules seen: {seen})")
    t0 = min(e.start for e in in_module)
    t1 = max(e.end for e in in_module)
    window = [e for e in events if e.start >= t0 and e.end <= t1]
    share, busy = attribute(window)
    rows = {g: GroupRow(g) for g in GROUPS}
    per_op: dict[tuple[str, str], dict[str, Any]] = {}
    named = 0.0
    for e, s in zip(window, share):
        op = lookup(hlo_ops, e)
        if module is not None and e.hlo_module is not None and e.hlo_module != module:
            group = "other modules"
        else:
            group = classify(op, e.name)
        if op is not None and op.scope:
            named += s
        row = rows[group]
        row.ms += s / 1e3 / steps
        row.kernel_ms += e.duration / 1e3 / steps
        row.ops += 1 / steps
        key = (str(e.hlo_module), e.hlo_op or e.name)
        detail = per_op.setdefault(
            key,
            {
                "hlo_op": e.hlo_op or e.name,
                "module": e.hlo_module or "",
                "group": group,
                "scope": op.scope if op else "",
                "backward": bool(op and op.backward),
                "kernels": set(),
                "ms": 0.0,
                "count": 0.0,
            },
        )
        detail["kernels"].add(e.name)
        detail["ms"] += s / 1e3 / steps
        detail["count"] += 1 / steps
    ops = sorted(per_op.values(), key=lambda d: -d["ms"])
    for d in ops:
        d["kernels"] = " ".join(sorted(d["kernels"]))
    total = (t1 - t0) / 1e3 / steps
    return Breakdown(
        source=source,
        steps=steps,
        step_ms=total,
        idle_ms=total - busy / 1e3 / steps,
        rows=[rows[g] for g in GROUPS],
        ops=ops,
        named_fraction=named / busy if busy else 0.0,
    )


def lookup(hlo_ops: dict[str, HloOp], e: OpEvent) -> HloOp | None:
    """The HLO instruction of an event: its `hlo_op`, else its name as is (TPU) or with XLA:GPU's
    kernel naming undone ("loop_add_fusion_3" -> "loop_add_fusion.3")."""
    if e.hlo_op:
        return hlo_ops.get(e.hlo_op)
    return hlo_ops.get(e.name) or hlo_ops.get(re.sub(r"_(\d+)$", r".\1", e.name))


# ----------------------------------------------------------------------------- tables


def table_rows(b: Breakdown, peak_flops: float | None) -> list[dict[str, Any]]:
    """The report's rows: every group with time or FLOPs, then idle and the step total."""
    out = []
    for r in b.rows:
        if r.ops == 0 and not r.flops:
            continue
        tflops = r.flops / (r.ms / 1e3) / 1e12 if r.flops and r.ms > 0 else None
        out.append(
            {
                "group": r.group,
                "ms_per_step": r.ms,
                "share": r.ms / b.step_ms if b.step_ms else 0.0,
                "kernel_ms_per_step": r.kernel_ms,
                "ops_per_step": r.ops,
                "gflop_per_step": r.flops / 1e9 if r.flops is not None else None,
                "tflops": tflops,
                "mfu": tflops * 1e12 / peak_flops if tflops is not None and peak_flops else None,
            }
        )
    flops = sum(r.flops or 0.0 for r in b.rows)
    step_tflops = flops / (b.step_ms / 1e3) / 1e12 if flops and b.step_ms else None
    out.append(
        {"group": IDLE, "ms_per_step": b.idle_ms, "share": b.idle_ms / b.step_ms if b.step_ms else 0.0}
    )
    out.append(
        {
            "group": "total (step window)",
            "ms_per_step": b.step_ms,
            "share": 1.0,
            "kernel_ms_per_step": sum(r.kernel_ms for r in b.rows),
            "ops_per_step": sum(r.ops for r in b.rows),
            "gflop_per_step": flops / 1e9 if flops else None,
            "tflops": step_tflops,
            "mfu": step_tflops * 1e12 / peak_flops if step_tflops is not None and peak_flops else None,
        }
    )
    return out


COLUMNS = (
    ("group", "group", "{}"),
    ("ms_per_step", "ms/step", "{:.3f}"),
    ("share", "% of step", "{:.1%}"),
    ("kernel_ms_per_step", "op ms/step (raw)", "{:.3f}"),
    ("ops_per_step", "ops/step", "{:.0f}"),
    ("gflop_per_step", "GFLOP/step", "{:.2f}"),
    ("tflops", "TFLOP/s", "{:.3g}"),
    ("mfu", "MFU", "{:.1%}"),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format(r[key]) if r.get(key) is not None else "" for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
