"""Offloaded tables in a multi-process run: 2 local CPU processes (4 fake devices each, gloo) train the
collection of tests/test_embeddings_offload.py through caches of 24 slots per device (rows are
evicted), each process holding only its own half of the host table. They save the logical form with
orbax after 3 steps (each process its own blocks, from host memory), restore it into fresh collections
(a resume) and train 3 more steps. Both checkpoints, restored in this one process onto the in-HBM
`row_wise` placement (and offloaded), equal the one-process in-HBM run's tables and accumulators bit
for bit. (Slow:) the real training loop in 2 processes, offloaded and resumed, and resumed in HBM, ends
bitwise like in HBM.

The workers run this module (`python -m tests.test_embeddings_offload_multiprocess PID PORT DIR`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVED_AT, CACHE = 6, 3, 24  # cache slots per device


def _batches(devices: int):
    from tests.test_embeddings import _batch

    rng = np.random.default_rng(1)
    return [_batch(rng, devices) for _ in range(STEPS)]


def _restore(path: Path, coll):
    """A saved logical form, restored onto `coll`'s placement."""
    import jax
    import orbax.checkpoint as ocp

    shapes, shardings = coll.logical_shapes(), coll.logical_shardings()
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    with ocp.StandardCheckpointer() as ck:
        return ck.restore(path, target)


def _save(path: Path, logical) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        ck.save(path, logical)
        ck.wait_until_finished()


@pytest.mark.slow
def test_two_processes_train_offloaded_tables_like_one_in_hbm(tmp_path):
    import jax

    from gem_jax.embeddings import RowWiseAdagrad
    from tests.test_embeddings_offload import _collection, _mesh, _run

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    from tests.test_multiprocess import _free_port

    port = _free_port()
    procs, logs = [], []
    for i in range(2):
        log = open(tmp_path / f"worker{i}.log", "w")  # noqa: SIM115  (closed below)
        logs.append(log)
        args = [
            sys.executable,
            "-m",
            "tests.test_embeddings_offload_multiprocess",
            str(i),
            str(port),
            str(tmp_path),
        ]
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=300))
            except subprocess.TimeoutExpired:
                codes.append("still running after 300 s (killed)")
    finally:
        for p, log in zip(procs, logs, strict=True):
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    texts = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n\n".join(
        f"process {i}: {c}\n{t[-4000:]}" for i, (c, t) in enumerate(zip(codes, texts))
    )
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["evicted"] > 0 and stats["hits"] > 0, stats

    mesh = _mesh(8)
    batches = _batches(8)
    for steps, name in ((SAVED_AT, "saved"), (STEPS, "final")):
        _, expected, _ = _run(mesh, False, RowWiseAdagrad(eps=1e-6), CACHE, batches[:steps])
        for offload in (False, True):  # restored in this one process in HBM, and offloaded
            coll = _collection(mesh, offload, RowWiseAdagrad(eps=1e-6), CACHE)
            got = jax.device_get(coll.to_logical(coll.from_logical(_restore(tmp_path / name, coll))))
            for table in expected:
                for slot in expected[table]:
                    np.testing.assert_array_equal(
                        got[table][slot],
                        expected[table][slot],
                        err_msg=f"{name} ({offload=}): {table} {slot}",
                    )


@pytest.mark.slow
def test_two_process_training_loop_with_an_offloaded_table(tmp_path):
    """The real loop (`python -m experiments train`, 2 processes, mesh dcn=2 x data=4) with the item
    table offloaded (48 cache rows per device of its 512), stopped after 2 steps and resumed by both
    processes to 4 (evaluating through a copy of the caches at the end), and its step-2 checkpoint
    resumed with the table in HBM: both final checkpoints and evaluations equal the uninterrupted
    2-process run's with the table in HBM, bit for bit."""
    from gem_jax.config import load_config
    from tests.helpers import SMALL
    from tests.test_embeddings_offload_trainer import _assert_equal, _final
    from tests.test_multiprocess import LEAN, MESH, _records, _start_two_processes, _wait_two_processes

    def config(items: str):
        overrides = [*SMALL, *MESH, *LEAN, "train.steps=4", "train.eval_every=4", "train.checkpoint_every=0"]
        overrides += [
            f"embeddings.tables.items={{rows=4096, dim=16, sharding='{items}', cache_rows=384}}",
            "embeddings.tables.actions={rows=16, dim=16}",
            "embeddings.tables.sparse={rows=256, dim=16}",
            "embeddings.features.items={table='items', pooling='none'}",
            "embeddings.features.actions={table='actions', pooling='none'}",
            "embeddings.features.sparse={table='sparse', pooling='mean'}",
        ]
        return load_config(None, overrides)

    def train(workdir, config, stop_after=None):
        extra = [] if stop_after is None else ["--stop-after", str(stop_after)]
        _wait_two_processes(workdir, _start_two_processes(workdir, config, extra), timeout=600)

    def evals(workdir):
        return [r["valid"] for r in _records(workdir) if r.get("split") == "valid"]

    hbm, off = config("row_wise"), config("offload")
    train(tmp_path / "hbm", hbm)
    train(tmp_path / "off", off, stop_after=2)
    shutil.copytree(tmp_path / "off", tmp_path / "moved")
    train(tmp_path / "off", off)
    train(tmp_path / "moved", hbm)  # an offloaded checkpoint resumed in HBM
    records = _records(tmp_path / "off")
    assert sorted(r["step"] for r in records if "loss" in r and "split" not in r) == [1, 2, 3, 4]
    assert sum(r.get("embeddings/items/device_to_host_bytes", 0) for r in records) > 0, records
    expected = _final(hbm, tmp_path / "hbm")
    for name in ("off", "moved"):
        assert evals(tmp_path / name) == evals(tmp_path / "hbm") != []
        _assert_equal(_final(hbm, tmp_path / name), expected, f"{name} vs hbm, 2 processes")


# ----------------------------------------------------------------------------- the workers


def _worker(process_id: int, port: int, workdir: Path) -> None:
    from gem_jax import distributed

    distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from gem_jax.embeddings import FeatureIds, RowWiseAdagrad
    from tests.test_embeddings import LR, _step
    from tests.test_embeddings_offload import _collection

    mesh = Mesh(np.array(jax.devices()), ("data",))  # process 0's devices hold blocks 0-3
    mine = slice(4 * process_id, 4 * (process_id + 1))
    leading = NamedSharding(mesh, P("data"))

    def to_global(local):
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(leading, x), local)

    batches = [{k: (v[mine], o[mine]) for k, (v, o) in b.items()} for b in _batches(8)]
    rng = np.random.default_rng(0)  # the loss weights of tests/test_embeddings_offload.py's `_run`
    shapes = {"bag_sum": (8, 2, 5, 8), "bag_mean": (8, 2, 5, 8), "seq": (8, 2, 6, 8), "other": (8, 2, 5, 16)}
    weights = {k: rng.normal(size=s).astype(np.float32)[mine] for k, s in shapes.items()}
    weights = to_global(weights)
    optimizer = RowWiseAdagrad(eps=1e-6)
    coll = _collection(mesh, True, optimizer, CACHE)
    host = coll.offload["big"]
    assert host.table.shape == (1024, 8) and host.own.tolist() == list(
        range(4 * process_id, 4 * process_id + 4)
    )
    state = coll.init(jax.random.key(3))
    step = _step(coll, batches[0], weights, LR)
    evicted = hits = 0.0

    def train(coll, state, batches):
        nonlocal evicted, hits
        for batch in batches:
            rows = {
                n: np.asarray(coll.table_rows(n, FeatureIds(*batch[n]))) for n in coll.offloaded_features()
            }
            state, slots, counts = coll.stage(state, rows)
            evicted += counts["embeddings/big/device_to_host_bytes"]
            hits += counts["embeddings/big/cache_hits"]
            ids = to_global({k: (slots.get(k, v), o) for k, (v, o) in batch.items()})
            state, _, _ = step(state, ids, weights)
        return state

    state = train(coll, state, batches[:SAVED_AT])
    _save(workdir / "saved", coll.to_logical(state))
    resumed = _collection(mesh, True, optimizer, CACHE)  # a fresh collection (empty caches) resumes
    state = resumed.from_logical(_restore(workdir / "saved", resumed))
    state = train(resumed, state, batches[SAVED_AT:])
    _save(workdir / "final", resumed.to_logical(state))
    if process_id == 0:
        (workdir / "stats.json").write_text(json.dumps({"evicted": evicted, "hits": hits}))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
