"""Data workers draw whole blocks of the synthetic generator (gem_jax/data/pipeline.WorkerBlockExamples)."""

import itertools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from gem_jax.data.pipeline import WorkerBlockExamples
from gem_jax.data.synthetic import BLOCK, SyntheticAds
from gem_jax.tasks import make_task
from tests.helpers import small_config, stacks


def test_each_worker_reads_whole_blocks_and_the_workers_read_every_block():
    drawn = []
    examples = WorkerBlockExamples(drawn.append, block=4)
    assert [examples.example_index(i) for i in range(10)] == list(range(10))  # no workers: in order
    seen = []
    for worker in range(3):
        examples.set_slice(slice(worker, None, 3), sequential_slice=True)
        positions = range(2 * 4)  # two blocks' worth of this worker's stream
        indices = [examples.example_index(i) for i in positions]
        assert {i // 4 for i in indices} == {worker, worker + 3}  # its own blocks, whole
        seen += indices
    assert sorted(seen) == list(range(24))  # together: every example of the first six blocks, once
    examples[5]
    assert drawn == [(1 * 3 + 2) * 4 + 1]  # worker 2's sixth: the second example of its second block
    with pytest.raises(ValueError, match="worker's slice"):
        examples.set_slice(slice(3, None, 3))


def test_the_worker_buffer_setting_reaches_grain(monkeypatch):
    # One pack of slack per worker stalled gem_long on the H200 (all workers drew their next block in the same
    # step); data.worker_buffer_size is grain's per_worker_buffer_size.
    import grain

    from gem_jax.tasks import ranking

    seen, options = [], grain.MultiprocessingOptions

    def recording(**kw):
        seen.append(kw)
        return options(**kw)

    monkeypatch.setattr(ranking.grain, "MultiprocessingOptions", recording)
    make_task(small_config("data.num_workers=2", "data.worker_buffer_size=5")).train_data(0, 1)
    make_task(small_config("data.num_workers=2")).train_data(0, 1)
    assert seen == [
        {"num_workers": 2, "per_worker_buffer_size": 5},
        {"num_workers": 2, "per_worker_buffer_size": 8},
    ]


def compare_two_workers_with_their_blocks() -> None:
    """The task's train data with 2 worker processes: stack k is worker k % 2's (k // 2)-th, and each
    worker's stacks are the packs of its own blocks' examples, exactly."""
    config = small_config("data.num_workers=2")
    task = make_task(config)
    got = list(itertools.islice(iter(task.train_data(0, 1)), 6))
    gen = SyntheticAds(config.data, num_tasks=len(config.model.tasks))
    expected = []
    for worker in range(2):
        examples = WorkerBlockExamples(gen.example, BLOCK)
        examples.set_slice(slice(worker, None, 2), sequential_slice=True)
        stream = stacks(config, task.shards, examples=examples)
        expected.append(list(itertools.islice(stream, 3)))
    for k, stack in enumerate(got):
        want = expected[k % 2][k // 2]
        for a, b in zip(jax.tree.leaves(stack), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"stack {k}")
    # Worker 1's first pack starts at block 1's first example, not at example 1 (grain's default).
    assert not np.array_equal(np.asarray(got[0].item_ids), np.asarray(got[1].item_ids))


@pytest.mark.slow
def test_two_grain_workers_hand_out_the_packs_of_their_own_blocks():
    # In a fresh process without runtime shape checking: its wrappers hold weakrefs, which grain cannot
    # pickle for its worker processes.
    env = {k: v for k, v in os.environ.items() if k != "GEM_JAX_TYPECHECK"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_worker_blocks"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


if __name__ == "__main__":  # grain's worker processes import this module
    compare_two_workers_with_their_blocks()
    print("ok")
