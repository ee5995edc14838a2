"""Many hosts: JAX's multi-process runtime (``jax.distributed``) and small helpers on it.

One estimax process runs per host (a TPU VM worker, a GPU node); each feeds its own devices from
its own shard of the input (``InputContext``). JAX's runtime connects them: process 0 runs the
coordination service, every process connects to it, and ``jax.devices()`` then lists all hosts'
devices, so the one ``jit`` over the global mesh spans every host. Nothing here re-implements
cluster detection: ``launch.detect`` reads the cluster specs JAX does not (``$TF_CONFIG``,
Vertex AI's ``$CLUSTER_SPEC``) and asks JAX's own detection for the rest (Cloud TPU VMs, SLURM,
Open MPI, Kubernetes); ``launch.rendezvous`` checks the processes agree before JAX joins them.

``allgather_json`` is how hosts compare notes (the pre-flight check) and pool what only each host
knows (its input position) -- a ``process_allgather`` of the JSON's bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jax
import numpy as np
from absl import logging

from estimax.ops import signals
from estimax.parallel import launch

AUTO = launch.AUTO


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float = 300.0,
) -> bool:
    """Joins a multi-process JAX job when one is asked for; must run before JAX's first use.

    Finds the job (``estimax.parallel.launch.detect``: the flags, ``$CLUSTER_SPEC``,
    ``$TF_CONFIG``, ``$JAX_COORDINATOR_ADDRESS``, and with ``"auto"`` JAX's own detection), checks
    with every other process that they see the same job (``launch.rendezvous``, within
    ``timeout``), then calls ``jax.distributed.initialize`` with what was found.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service (the same on every
        process), or ``"auto"``. None: the cluster specs and ``$JAX_COORDINATOR_ADDRESS`` if set,
        else a single-process job.
      num_processes: how many processes the job has (None: detected).
      process_id: this process's index, ``0 .. num_processes - 1`` (None: detected).
      timeout: seconds to wait for every process to reach the coordinator.

    Returns:
      True when this process is now part of a multi-process job, False for a single process or
      the job's evaluator task (``launch.evaluator_task()`` says which).

    Raises:
      ValueError: (``launch.LaunchError``) a malformed spec, numbers given without an address,
        processes that disagree or do not all come within ``timeout``: one line saying which.
    """
    if jax.distributed.is_initialized():
        return True
    found = launch.detect(coordinator_address, num_processes, process_id, timeout=timeout)
    logging.info("Launch: %s.", found.describe())
    if not found.joins:
        return False
    views = launch.rendezvous(found, timeout)
    logging.info(
        "Launch check: the %d processes agree (hosts %s).",
        len(views),
        ", ".join(sorted({str(v.get("host")) for v in views})),
    )
    jax.distributed.initialize(
        coordinator_address=found.coordinator,
        num_processes=found.num_processes,
        process_id=found.process_id,
        initialization_timeout=max(60, math.ceil(timeout)),
    )
    logging.info(
        "Joined a JAX job of %d processes as process %d; %d of its %d devices are local (%s).",
        jax.process_count(),
        jax.process_index(),
        jax.local_device_count(),
        jax.device_count(),
        describe_devices(jax.local_devices()),
    )
    return jax.process_count() > 1


def describe_devices(devices: list[Any]) -> str:
    """``2 x cpu (cpu)``: the devices by platform and kind."""
    counts: dict[str, int] = {}
    for d in devices:
        key = f"{d.platform} ({d.device_kind})"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {key}" for key, n in counts.items())


def allgather_json(value: Any) -> list[Any]:
    """Returns every process's ``value`` (JSON-serialisable), in process order.

    A collective: every process must call it, in the same order as its other collectives. With
    one process it returns ``[value]`` without touching the devices.
    """
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value, sort_keys=True).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    padded = np.zeros([int(lengths.max())], np.uint8)
    padded[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths, strict=True)]


def agree(flag: bool) -> bool:
    """True on every process when ``flag`` is true on process 0 (a collective with many)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def any_process(flag: bool) -> list[bool]:
    """Every process's ``flag``, in process order (a collective with many)."""
    if jax.process_count() == 1:
        return [flag]
    from jax.experimental import multihost_utils

    return [bool(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(flag)))]


class PreemptionNotice:
    """Whether training must stop and save at a step: a preemption notice (SIGTERM) or Ctrl-C.

    With many processes, JAX's preemption service catches SIGTERM on any host and all hosts agree
    on the step to save at (``multihost_utils.reached_preemption_sync_point``, which every host
    must call at every step, as Orbax's ``CheckpointManager.reached_preemption`` does). With one
    process there is no such service (it returns False), so a SIGTERM handler sets a flag that
    the next step's check sees; the handler is installed while the context is open, from the
    main thread only (Python's rule for signal handlers; from another thread SIGTERM keeps its
    default action). Native code may replace whatever handles SIGTERM behind Python's back
    (oneDNN's runtime did; ``estimax.ops.signals``): ``keep_handlers``, at each host loop, puts
    it back.
    """

    def __init__(self) -> None:
        self._many = jax.process_count() > 1
        self._received = False
        self._previous: dict[int, Any] = {}
        self.signal_name: str | None = None  # the signal that asked to stop: SIGTERM or SIGINT
        self._keeper: signals.Keeper | None = None

    def __enter__(self) -> PreemptionNotice:
        import signal
        import threading

        if not self._many and threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
            # Ctrl-C saves as SIGTERM does (TF lost the steps since the last checkpoint); only
            # where Python's own KeyboardInterrupt handler is in place (not a user's handler).
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        # Whatever handles SIGTERM now (ours, or JAX's preemption service with many processes)
        # is what native code must not take away (see keep_handlers).
        self._keeper = signals.Keeper([signal.SIGTERM, signal.SIGINT])
        return self

    def keep_handlers(self) -> None:
        """Call at each host loop: puts back a SIGTERM/SIGINT handler that native code replaced.

        estimax undoes what oneDNN's runtime installs (``estimax.ops.signals``); this catches
        any other native library (a user's custom call) doing the same.
        """
        if self._keeper is not None:
            self._keeper.check()

    def __exit__(self, *exc: object) -> None:
        import signal

        self._keeper = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        import signal

        if signum == signal.SIGINT and self._received:
            raise KeyboardInterrupt  # a second Ctrl-C: stop at once, without saving
        # Only a flag: the step that runs finishes, and the loop saves at it.
        self._received = True
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            logging.warning(
                "Ctrl-C: saving a checkpoint at the end of the current step (Ctrl-C again to "
                "stop at once, without saving)."
            )
        else:
            logging.warning("SIGTERM (preemption notice): saving at the end of the current step.")

    def reached(self, step: int) -> bool:
        """Call after each step (every process, every step): True -> save at ``step`` and stop."""
        if self._many:
            from jax.experimental import multihost_utils

            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # jax_enable_preemption_service is off: no notice can come
                return False
        return self._received
