"""Profiling: the trace grouping on synthetic traces (exact), the FLOP split, and (slow) the
`profile` subcommand, `train --profile-steps` and the notebook on the tiny config."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from experiments import trace_analysis as ta
from gem_jax.config import load_config
from gem_jax.train.flops import FLOP_GROUPS, train_step_flops, train_step_flops_by_group
from tests.helpers import cli_env, run_cli

ROOT = Path(__file__).resolve().parent.parent

# A small optimised-HLO text: a GEMM fusion in a named scope, the attention forward and backward
# (a Pallas custom call, scope from op_name), an embedding gather and its gradient scatter, an
# optimizer op, an all-reduce, a fusion without metadata whose operand carries the scope, and an
# op with no scope at all.
HLO = """HloModule jit__train_step, entry_computation_layout={()->()}

%fused_dot (p0: bf16[8,8], p1: bf16[8,8]) -> f32[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0.1: f32[8]) -> f32[8] {
  %p0.1 = f32[8]{0} parameter(0)
  ROOT %add.9 = f32[8]{0} add(%p0.1, %p0.1), metadata={op_name="jit(_train_step)/vmap(wukong/0)/add"}
}

ENTRY %main.1 (a: bf16[8,8], b: bf16[8,8]) -> f32[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %gemm_fusion.1 = f32[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(_train_step)/jvp()/vmap(hstu/0/uvqk)/dot_general"}
  %custom-call.2 = f32[8,8]{1,0} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(_train_step)/jvp()/vmap(hstu/0/attention)/pallas_call"}
  %custom-call.3 = f32[8,8]{1,0} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(_train_step)/transpose(jvp())/vmap(hstu/0/attention)/pallas_call"}
  %gather.4 = f32[8,8]{1,0} gather(%a, %b), metadata={op_name="jit(_train_step)/jvp()/vmap(embeddings)/jit(_take)/gather"}
  %scatter.5 = f32[8,8]{1,0} scatter(%a, %b), metadata={op_name="jit(_train_step)/transpose(jvp())/vmap(embeddings)/jit(_take)/scatter-add"}
  %add.6 = f32[8,8]{1,0} add(%a, %b), metadata={op_name="jit(_train_step)/optimizer/add"}
  %all-reduce.7 = f32[8,8]{1,0} all-reduce(%add.6), to_apply=%fused_add, metadata={op_name="jit(_train_step)/transpose(jvp())/psum"}
  %loop_fusion.8 = f32[8]{0} fusion(%add.6), kind=kLoop, calls=%fused_add
  %ynn_fusion.9 = f32[8,8]{1,0} fusion(%custom-call.2, %custom-call.2), kind=kCustom, calls=%fused_dot
  ROOT %copy.10 = f32[8,8]{1,0} copy(%ynn_fusion.9)
}
"""  # noqa: E501 (HLO lines as XLA prints them)


def _gpu_trace(kernels, *, host_noise=True):
    """A Chrome trace like jax writes for one GPU: metadata, a stream line, a derived "XLA Ops" line
    repeating the kernels (must not count twice), and host events (must be ignored)."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "Stream #8(Collective)"}},
        {"ph": "M", "pid": 1, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    for name, hlo_op, ts, dur, tid, module in kernels:
        args = {"hlo_module": module} if module else {}
        if hlo_op:
            args["hlo_op"] = hlo_op
        events.append({"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args})
        events.append({"ph": "X", "pid": 1, "tid": 99, "ts": ts, "dur": dur, "name": hlo_op or name})
        events.append({"ph": "X", "pid": 2, "tid": 1, "ts": ts, "dur": dur, "name": name, "args": args})
    if host_noise:
        events.append({"ph": "X", "pid": 3, "tid": 1, "ts": 0, "dur": 500, "name": "PjitFunction(step)"})
    return {"traceEvents": events}


def test_hlo_ops_carry_scope_gemm_and_backward():
    ops = ta.parse_hlo_ops(HLO)
    assert ops["gemm_fusion.1"].gemm and ops["gemm_fusion.1"].scope == "hstu/0/uvqk"
    assert not ops["custom-call.2"].backward and ops["custom-call.3"].backward
    assert ops["all-reduce.7"].collective
    assert ops["loop_fusion.8"].op_name == "jit(_train_step)/vmap(wukong/0)/add"  # from the fused add
    # No metadata anywhere inside: the operands' scope (the attention forward) is taken.
    assert ops["ynn_fusion.9"].gemm and "attention" in ops["ynn_fusion.9"].tokens
    assert ops["copy.10"].op_name == ops["ynn_fusion.9"].op_name  # from its operand, in turn
    assert ta.scope_path("jit(s)/transpose(jvp())/vmap(hstu/1/attention)/jit(_where)") == "hstu/1/attention"
    assert ta.scope_path("jit(s)/jvp()/vmap(wukong/0)/bnd,nm->bmd/dot_general") == "wukong/0"


def test_classify_by_scope_then_kernel_name():
    ops = ta.parse_hlo_ops(HLO)
    expected = {
        "gemm_fusion.1": "gemm hstu",
        "custom-call.2": "attention fwd",
        "custom-call.3": "attention bwd",
        "gather.4": "embedding lookup",
        "scatter.5": "embedding update",
        "add.6": "optimizer",
        "all-reduce.7": "collectives",
        "loop_fusion.8": "other fusions",
        "ynn_fusion.9": "attention fwd",
    }
    assert {name: ta.classify(ops[name], name) for name in expected} == expected
    # Without HLO: the kernel name (Pallas kernels are named by their pallas_call).
    assert ta.classify(None, "jagged_attention_bwd_dkv") == "attention bwd"
    assert ta.classify(None, "jagged_attention_fwd") == "attention fwd"
    assert ta.classify(None, "ncclDevKernel_AllReduce_Sum_f32") == "collectives"
    assert ta.classify(None, "sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm other"
    assert ta.classify(None, "loop_multiply_fusion") == "other fusions"


def test_attribute_splits_overlaps_and_nesting_exactly():
    lane_a, lane_b = ("p", 1), ("p", 2)
    events = [
        ta.OpEvent("parent", 0, 10, lane_a),
        ta.OpEvent("child", 2, 3, lane_a),  # nested in parent: innermost wins on lane a
        ta.OpEvent("other lane", 4, 4, lane_b),  # overlaps: split equally across lanes
        ta.OpEvent("late", 12, 2, lane_a),  # after an idle gap of 2
        ta.OpEvent("empty", 13, 0, lane_b),
    ]
    share, busy = ta.attribute(events)
    assert share == pytest.approx([2 + 1.5 + 2, 2 + 0.5, 0.5 + 1.5, 2, 0])
    assert busy == pytest.approx(12) and sum(share) == pytest.approx(busy)


def test_breakdown_of_a_synthetic_gpu_trace():
    m = "jit__train_step"
    kernels = [  # (kernel name, hlo_op, ts, dur, stream, module), two steps
        ("gemm_kernel", "gemm_fusion.1", 0, 10, 7, m),
        ("jagged_attention_fwd", "custom-call.2", 10, 30, 7, m),
        ("jagged_attention_bwd_dkv", "custom-call.3", 45, 50, 7, m),  # 5 us gap before
        ("ncclAllReduce", "all-reduce.7", 80, 20, 8, m),  # overlaps the backward for 15 us
        ("gather_kernel", "gather.4", 100, 4, 7, m),
        ("h2d", None, 104, 6, 7, "jit_other"),  # another module inside the window
        ("gemm_kernel", "gemm_fusion.1", 120, 10, 7, m),  # step 2 (10 us gap before)
        ("mystery_kernel", None, 130, 10, 7, m),  # no hlo_op, unknown name
    ]
    trace = _gpu_trace(kernels)
    events, source = ta.device_events(trace, device=0)
    assert source == "/device:GPU:0" and len(events) == len(kernels)
    b = ta.breakdown(events, ta.parse_hlo_ops(HLO), steps=2, module=m, source=source)
    rows = {r.group: r for r in b.rows}
    ms = 1e-3 / 2  # microseconds of two steps -> milliseconds per step
    assert b.step_ms == pytest.approx(140 * ms)
    assert b.idle_ms == pytest.approx((5 + 10) * ms)
    assert rows["gemm hstu"].ms == pytest.approx(20 * ms) and rows["gemm hstu"].ops == 1
    assert rows["attention fwd"].ms == pytest.approx(30 * ms)
    assert rows["attention bwd"].ms == pytest.approx((35 + 7.5) * ms)
    assert rows["attention bwd"].kernel_ms == pytest.approx(50 * ms)  # raw, overlap counted twice
    assert rows["collectives"].ms == pytest.approx((7.5 + 5) * ms)
    assert rows["embedding lookup"].ms == pytest.approx(4 * ms)
    assert rows["other modules"].ms == pytest.approx(6 * ms)
    assert rows["other fusions"].ms == pytest.approx(10 * ms)
    assert sum(r.ms for r in b.rows) + b.idle_ms == pytest.approx(b.step_ms)
    # Named: all but the unmatched kernels (16 us) and the all-reduce (a psum outside any scope).
    assert b.named_fraction == pytest.approx((125 - 16 - 12.5) / 125)
    assert b.ops[0]["hlo_op"] == "custom-call.3" and b.ops[0]["scope"] == "hstu/0/attention"

    # FLOPs -> TFLOP/s and MFU per group; idle and total rows close the table.
    rows["gemm hstu"].flops = 2e9
    table = ta.table_rows(b, peak_flops=1e15)
    by_group = {r["group"]: r for r in table}
    assert by_group["gemm hstu"]["tflops"] == pytest.approx(2e9 / (20 * ms / 1e3) / 1e12)
    assert by_group["gemm hstu"]["mfu"] == pytest.approx(by_group["gemm hstu"]["tflops"] / 1e3)
    assert table[-1]["group"] == "total (step window)" and table[-2]["group"] == ta.IDLE
    assert "| gemm hstu |" in ta.markdown_table(table)

    with pytest.raises(ValueError, match="no device op of module 'jit_missing'"):
        ta.breakdown(events, {}, steps=2, module="jit_missing")

    # Events that name no module and no hlo_op: every op counts, matched by kernel name.
    bare = [ta.OpEvent(name, e.start, e.duration, e.lane) for e, name in zip(events, ["gemm_fusion_1"] * 8)]
    b = ta.breakdown(bare, ta.parse_hlo_ops(HLO), steps=1, module=m)
    assert {r.group for r in b.rows if r.ops} == {"gemm hstu"} and b.step_ms == pytest.approx(0.14)


def test_cpu_trace_uses_host_op_events_of_one_device():
    trace = {
        "traceEvents": [
            {"ph": "M", "pid": 5, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 5, "tid": 1, "ts": 0, "dur": 9, "name": "PjitFunction(f)", "args": {}},
            {
                "ph": "X",
                "pid": 5,
                "tid": 2,
                "ts": 1,
                "dur": 3,
                "name": "dot",
                "args": {"hlo_op": "dot", "device_ordinal": "0"},
            },
            {
                "ph": "X",
                "pid": 5,
                "tid": 3,
                "ts": 1,
                "dur": 3,
                "name": "dot",
                "args": {"hlo_op": "dot", "device_ordinal": "1"},
            },
        ]
    }
    events, source = ta.device_events(trace, device=0)
    assert source == "/host:CPU" and [(e.name, e.start) for e in events] == [("dot", 1.0)]


def test_flop_groups_sum_to_the_step_count():
    offsets = np.array([[0, 10, 300, 305], [0, 500, 501, 900]], np.int32)
    targets = np.array([[1, 4, 0], [4, 0, 4]], np.int32)
    for name in ("gem_h200", "gem_long", "tiny"):
        config = load_config(ROOT / "configs" / f"{name}.toml")
        parts = train_step_flops_by_group(config, offsets, targets)
        assert tuple(parts) == FLOP_GROUPS and set(FLOP_GROUPS) <= set(ta.GROUPS)
        assert all(v > 0 for v in parts.values()), (name, parts)
        assert sum(parts.values()) == pytest.approx(train_step_flops(config, offsets, targets), rel=1e-12)
        assert parts["attention bwd"] == pytest.approx(2.5 * parts["attention fwd"])


# ----------------------------------------------------------------------------- end to end (CPU)


@pytest.mark.slow
def test_profile_command_on_tiny(tmp_path):
    out = tmp_path / "profile"
    args = ["profile", "--config", "configs/tiny.toml", "--steps", "2", "--batches", "2"]
    proc = run_cli(*args, "--pipeline-batches", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| attention fwd |" in proc.stdout and "perfetto" in proc.stdout

    run = next((out / "trace" / "plugins" / "profile").iterdir())
    assert list(run.glob("*.xplane.pb")) and list(run.glob("*.trace.json.gz"))
    assert (run / "perfetto_trace.json.gz").stat().st_size > 0
    assert (out / "memory.prof").stat().st_size > 0
    assert (out / "breakdown.md").read_text().count("|") > 20

    with open(out / "breakdown.csv") as f:
        rows = {r["group"]: r for r in csv.DictReader(f)}
    total = rows.pop("total (step window)")
    groups_ms = sum(float(r["ms_per_step"]) for r in rows.values())  # the groups and idle
    assert groups_ms == pytest.approx(float(total["ms_per_step"]), rel=1e-9)
    for group in ("attention fwd", "attention bwd", "gemm hstu", "embedding lookup", "optimizer"):
        assert float(rows[group]["ms_per_step"]) > 0, group

    # FLOPs per group: the analytic split of the very batches the traced steps ran.
    summary = json.loads((out / "summary.json").read_text())
    from gem_jax.tasks import make_task

    config = load_config(ROOT / "configs" / "tiny.toml", ["parallel.mesh_shape=[1]"])
    it = iter(make_task(config).train_data(0, 1))
    stacks = [next(it) for _ in range(2)]
    expected = np.mean([train_step_flops(config, s.offsets, s.num_targets) for s in stacks])
    per_group = sum(float(r["gflop_per_step"]) * 1e9 for r in rows.values() if r["gflop_per_step"])
    assert per_group == pytest.approx(expected, rel=1e-9)
    assert summary["train_step_flops_per_device"] == pytest.approx(expected, rel=1e-9)
    assert summary["named_fraction"] > 0.9
    assert summary["compiled_peak_bytes"] > 0 and summary["pipeline_ms_per_batch"] > 0


@pytest.mark.slow
def test_train_profile_steps_writes_a_trace(tmp_path):
    from gem_jax.tasks import make_task
    from gem_jax.train import loop
    from tests.helpers import small_config

    c = small_config("train.steps=4", "train.checkpoint_every=0", "train.eval_every=0")
    loop.train(make_task(c), tmp_path / "run", profile_steps=(1, 3))
    runs = list((tmp_path / "run" / "profile" / "plugins" / "profile").glob("*/*.trace.json.gz"))
    assert len(runs) == 1
    trace = ta.load_trace(runs[0])
    steps = [e for e in trace["traceEvents"] if e.get("name") == "train" and e.get("ph") == "X"]
    assert sorted(int(e["args"]["step_num"]) for e in steps) == [1, 2]
    assert any(e.get("name") == "data" for e in trace["traceEvents"])


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    import nbclient  # the test extra installs them (and ipykernel, matplotlib): no skip
    import nbformat

    for key, value in cli_env().items():  # one CPU device, as a user's notebook kernel
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("GEM_PROFILE_OUT", str(tmp_path / "nb"))
    monkeypatch.setenv("GEM_PROFILE_STEPS", "2")
    notebook = nbformat.read(ROOT / "notebooks" / "profile.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(ROOT)}}).execute()
    assert (tmp_path / "nb" / "breakdown.png").stat().st_size > 0
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs)
