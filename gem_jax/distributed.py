"""Joining a multi-process run (several hosts, or several processes on one machine).

`initialize` wraps `jax.distributed.initialize` and must run before anything touches a device. It
is called when asked: an explicit coordinator / process count / process id (flags, or the
environment variables below), or auto-detection of the cluster (SLURM, Open MPI, Cloud TPU,
Kubernetes... as jax implements it; `cluster_detection="mpi4py"` for other MPI launchers).

Environment variables (the flags win): JAX_COORDINATOR_ADDRESS (host:port of process 0),
JAX_NUM_PROCESSES, JAX_PROCESS_ID; JAX_LOCAL_DEVICE_IDS (read by jax) restricts a process to some of
its machine's accelerators. On CPU, processes exchange collectives through gloo and each gets
`XLA_FLAGS=--xla_force_host_platform_device_count=N` fake devices (set before jax is imported).

jax is imported inside the functions: the supervisor of a run (gem_jax/train/supervisor.py) asks
`requested` without loading it.
"""

from __future__ import annotations

import os
import sys
import threading

import jax
import numpy as np
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

ENV = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


class DistributedError(RuntimeError):
    """The multi-process settings are incomplete or inconsistent; the message names the flag."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer") from None


def requested(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    cluster_detection: str | None = None,
) -> bool:
    """Whether these settings (or the environment) ask for a multi-process run (`initialize`'s
    arguments; reads no more than the environment, imports no jax)."""
    from_env = any(os.environ.get(name) for name in ENV.values())
    return bool(auto or cluster_detection or from_env or {coordinator, num_processes, process_id} != {None})


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    cluster_detection: str | None = None,
    heartbeat_timeout_s: int = 100,
) -> bool:
    """Joins the multi-process run if one is asked for; returns whether it did.

    Args:
      coordinator: "host:port" of process 0 (`--coordinator`).
      num_processes, process_id: `--num-processes`, `--process-id`.
      auto: `--distributed`: let jax detect the cluster for whatever is not given.
      cluster_detection: a jax cluster detection method by name (e.g. "mpi4py", "slurm").
      heartbeat_timeout_s: after this long without a heartbeat jax ends every other process (with a
        native stack trace); gem_jax/train/peers.py stops them with one line well before.
    """
    if not requested(coordinator, num_processes, process_id, auto=auto, cluster_detection=cluster_detection):
        return False

    coordinator = coordinator or os.environ.get(ENV["coordinator"]) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV["num_processes"])
    process_id = process_id if process_id is not None else _env_int(ENV["process_id"])
    explicit = (coordinator, num_processes, process_id)
    if not (auto or cluster_detection) and None in explicit:
        missing = [
            f"--{flag.replace('_', '-')} (or {ENV[flag]})"
            for flag, v in zip(ENV, explicit, strict=True)
            if v is None
        ]
        raise DistributedError(
            f"a multi-process run needs {', '.join(missing)} too, or --distributed to detect the cluster"
        )
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id {process_id} is not in [0, --num-processes {num_processes})")
    # gloo carries CPU processes' collectives (already jax 0.10's default; named so that a site-wide
    # setting cannot leave CPU processes without cross-process collectives).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax's preemption service would take SIGTERM for itself (a C++ handler that only records it, for
    # `multihost_utils.reached_preemption_sync_point`): the trainer's own handler must get it, as in
    # a one-process run (gem_jax/train/interrupt.py); the loop then agrees on the step to stop at.
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            cluster_detection_method=cluster_detection,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except ValueError as e:  # jax's message for a cluster it could not detect
        raise DistributedError(
            f"jax.distributed.initialize: {e} (no cluster environment detected? pass --coordinator, "
            "--num-processes and --process-id)"
        ) from None
    print(
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local "
        f"{jax.devices()[0].platform} device(s), {jax.device_count()} in all",
        file=sys.stderr,
    )
    return True


def wait_for_all(name: str, timeout_s: float) -> None:
    """Waits until every process reaches the barrier `name` (unique per run of the coordination service),
    through jax's coordination service rather than a collective. Before the first step: processes that
    start apart (a restart, a slow restore) would otherwise reach their first collective apart, and gloo
    gives up on a peer after 30 s (seen under load in tests). With one process, nothing."""
    if jax.process_count() == 1:
        return
    # jax's own array serialization waits on this client the same way (no public barrier without a collective)
    client = jax_distributed.global_state.client
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    # In a thread, so that the main thread keeps running Python signal handlers (a signal before the first
    # step ends the process at once, gem_jax/train/interrupt.py) while a peer is late.
    waiter = threading.Thread(target=wait, name=f"barrier {name}", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.1)
    if errors:
        raise errors[0]


def process_zero_says(flag: bool) -> bool:
    """Process 0's `flag`, on every process: for decisions all processes must take at the same step
    (stopping at a wall-clock budget: each process's own clock could stop them a step apart, and the
    one still training would wait forever in its collectives). With one process, `flag` itself."""
    if jax.process_count() == 1:
        return flag

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def any_process_says(flag: bool) -> bool:
    """Whether `flag` is set on any process, on every process: for stops that one process alone may
    ask for (a SIGTERM to one process, or to each at a different step) but that all must take at the
    same step. With one process, `flag` itself (no collective, no host sync)."""
    return agree(anyone=flag)[0]


def agree(*, anyone: bool = False, process_zero: bool = False) -> tuple[bool, bool]:
    """`any_process_says(anyone)` and `process_zero_says(process_zero)` in one collective (one
    all-gather of two integers from every process). With one process, the flags themselves."""
    if jax.process_count() == 1:
        return anyone, process_zero

    # Process 0's second flag travels as is and the others' as 0, so that no row order is assumed.
    mine = np.asarray([anyone, process_zero and jax.process_index() == 0], dtype=np.int32)
    flags = np.asarray(multihost_utils.process_allgather(mine))  # (process_count, 2)
    return bool(flags[:, 0].any()), bool(flags[:, 1].any())
