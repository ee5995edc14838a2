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

import atexit
import contextlib
import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from estimax import storage
from estimax.ops import signals
from estimax.parallel import launch, watchdog

AUTO = launch.AUTO
# Each process's host, from the launch check (``initialize``): for the lost-peer line.
_HOSTS: dict[int, str] = {}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float = 300.0,
    peer_timeout: float | None = 60.0,
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
      peer_timeout: seconds without a peer's heartbeat before every other process exits with
        one line and ``LOST_PEER_EXIT_CODE`` (``watch_peers``); JAX's own heartbeat timeout is
        set past it. 0 or None: no watch, JAX's defaults (a lost peer aborts the others after
        100 s).

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
    _HOSTS.update({int(v["process_id"]): str(v.get("host")) for v in views})
    jax.distributed.initialize(
        coordinator_address=found.coordinator,
        num_processes=found.num_processes,
        process_id=found.process_id,
        initialization_timeout=max(60, math.ceil(timeout)),
        heartbeat_timeout_seconds=jax_heartbeat_timeout(peer_timeout),
    )
    logging.info(
        "Joined a JAX job of %d processes as process %d; %d of its %d devices are local (%s).",
        jax.process_count(),
        jax.process_index(),
        jax.local_device_count(),
        jax.device_count(),
        describe_devices(jax.local_devices()),
    )
    watch_peers(peer_timeout)
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


# ----------------------------------------------------------------------------- lost peers

# The exit status of a process whose job lost a peer: the watchdog's EX_TEMPFAIL (sysexits.h,
# "a temporary failure; the user is invited to retry"), which job runners restart on.
LOST_PEER_EXIT_CODE = watchdog.HANG_EXIT_CODE
# Seconds without a peer's heartbeat before it is lost (``--peer_timeout``).
DEFAULT_PEER_TIMEOUT = 60.0
# Where the heartbeats live in the coordination service's key-value store.
_BEATS = "estimax/peer_watch/"
# Seconds the lost-peer line waits for the last checkpoint's step.
_CHECKPOINT_READ_SECS = 5.0
# Seconds between heartbeats once a process is done (its peers wait to see it).
_SETTLE_INTERVAL = 0.2
# At most how long process 0, having seen a lost peer, waits for the others to say they exit.
_LINGER_SECS = 30.0
# The most lost processes one line names (then how many in all).
_SHOW_LOST = 4


def jax_heartbeat_timeout(peer_timeout: float | None) -> int:
    """JAX's own heartbeat timeout for a peer timeout: JAX's is the fallback and must come after
    ours (on its timeout JAX's client aborts the process with a C++ stack dump)."""
    if not peer_timeout:
        return 100  # jax.distributed.initialize's default
    return max(100, math.ceil(2 * peer_timeout) + 10)


def _client() -> Any:
    # The coordination service's client that jax.distributed.initialize made (jax 0.10.2 keeps it
    # in the private ``jax._src.distributed.global_state``; no public accessor exists).
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


class PeerWatch:
    """Turns a lost peer (killed, hung, unreachable) into one line and ``LOST_PEER_EXIT_CODE``.

    JAX's coordination service notices a dead process only after its heartbeat timeout (100 s)
    and then aborts every other process with a C++ stack dump (its ``missed_heartbeat_callback``,
    the way to get a callback instead, cannot be used from Python in jaxlib 0.10.2: it throws
    ``std::bad_cast`` in a C++ thread). A peer killed mid-step makes the step's collective raise
    at once ("Gloo ... Connection reset by peer"), and the process that raised then waits in
    JAX's shutdown barrier until that abort. So each process runs its own watch:

    * a *beater* thread writes this process's heartbeat (a counter) into the coordination
      service's key-value store every ``interval`` seconds and reads everyone's (one request each
      way); a request that fails or hangs only stops the counters from moving;
    * a *judge* thread, with no I/O, sees a peer whose counter has not moved for ``timeout``
      seconds (or no answer from the coordination service, on process 0, for that long), prints
      one line naming the lost processes (id, host), the last checkpoint step and the exit
      status, and ends the process with ``os._exit(LOST_PEER_EXIT_CODE)``;
    * an uncaught exception (the collective's error) waits for that verdict before Python prints
      it, and so does a normal exit (``atexit``, before JAX's shutdown barrier): a process marks
      itself *done*, and waits until every peer is done or lost. Done peers are never lost.

    So every other process exits within ``timeout + interval`` seconds (plus the time for a
    heartbeat request) of a peer's last heartbeat.
    """

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        timeout: float,
        hosts: dict[int, str] | None = None,
        last_checkpoint: Callable[[], int | None] | None = None,
        exit_fn: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
        interval: float | None = None,
    ):
        self.timeout = timeout
        self.interval = interval or min(5.0, max(0.2, timeout / 5))
        self._client, self._id, self._n = client, process_id, num_processes
        self._hosts = hosts or {}
        self.last_checkpoint = last_checkpoint
        self._exit_fn, self._clock = exit_fn, clock
        self._cond = threading.Condition()
        now = clock()
        # Per peer: its last counter, when it last moved, whether it is done, whether it is
        # exiting (it saw a lost peer too).
        self._seen: dict[int, tuple[str, float, bool, bool]] = {
            p: ("", now, False, False) for p in range(num_processes) if p != process_id
        }
        self._answered = now  # when the coordination service last answered
        self._beat = 0
        self._done = False
        # This process's "done" is in the store: only then may it stop beating (a peer that
        # never read it would take this process for lost).
        self._done_written = False
        self._stopped = False
        self.lost: list[int] | None = None
        self._fired = False  # the judge's exit returned (only a test's exit_fn returns)
        # Called with the lost processes before the exit (the goodput record's last line).
        self.on_lost: list[Callable[[list[int]], None]] = []
        self._threads: list[threading.Thread] = []

    # -- the threads

    def start(self) -> PeerWatch:
        """Starts the beater and the judge (daemon threads)."""
        for name, target in (("beater", self._beat_loop), ("judge", self._judge_loop)):
            thread = threading.Thread(target=target, daemon=True, name=f"estimax-peers-{name}")
            thread.start()
            self._threads.append(thread)
        return self

    def _beat_loop(self) -> None:
        while True:
            with self._cond:
                if self._stopped or self.lost is not None:  # exiting: "exit" is the last word
                    return
                self._beat += 1
                done = self._done
            try:
                self._client.key_value_set(
                    f"{_BEATS}{self._id}",
                    f"{self._beat} {'done' if done else 'run'}",
                    allow_overwrite=True,
                )
                entries = self._client.key_value_dir_get(_BEATS)
            except Exception:  # noqa: BLE001 (any failure of the service: the judge decides)
                entries = None
            if entries is not None:
                self.observe(entries, done_written=done)
            with self._cond:
                if not self._stopped:
                    # Once done, beat fast: the others wait for this "done" to exit.
                    self._cond.wait(
                        min(self.interval, _SETTLE_INTERVAL) if self._done else self.interval
                    )

    def observe(self, entries: list[tuple[str, str]], done_written: bool = False) -> None:
        """Records the heartbeats read from the store (``[(key, "COUNT run|done")]``), after
        writing this process's own (``done_written``: as done)."""
        now = self._clock()
        with self._cond:
            self._answered = now
            self._done_written = self._done_written or done_written
            for key, value in entries:
                peer = key.rsplit("/", 1)[-1]
                if not peer.isdigit() or int(peer) not in self._seen:
                    continue
                last, moved, _, _ = self._seen[int(peer)]
                count, _, state = value.partition(" ")
                self._seen[int(peer)] = (
                    count,
                    now if count != last else moved,
                    state in ("done", "exit"),  # an exiting peer is not lost: it saw the loss
                    state == "exit",
                )
            self._cond.notify_all()

    def _judge_loop(self) -> None:
        with self._cond:
            while not self._stopped:
                lost = self.overdue()
                if lost:
                    break
                self._cond.wait(min(self.interval, 1.0))
            else:
                return
        self._fire(lost)

    def overdue(self) -> list[int]:
        """The processes lost now: peers whose heartbeat has not moved for ``timeout`` s that
        are not done, or process 0 (the coordination service's host) when it has not answered
        for that long."""
        now = self._clock()
        lost = [
            p
            for p, (_, moved, done, _) in sorted(self._seen.items())
            if not done and now - moved > self.timeout
        ]
        if not lost and self._id != 0 and now - self._answered > self.timeout:
            lost = [0]  # the coordination service itself is gone: its process is
        return lost

    def message(self, lost: list[int]) -> str:
        """The one line: who is lost, the last checkpoint step, the exit status."""
        names = ", ".join(
            f"process {p} (host {self._hosts[p]})" if p in self._hosts else f"process {p}"
            for p in lost[:_SHOW_LOST]
        )
        if len(lost) > _SHOW_LOST:
            names += f", ... ({len(lost)} in all)"
        found: list[int | None] = []
        if self.last_checkpoint is not None:
            # In its own thread, bounded: the line and the exit must come whatever the storage
            # (a bucket behind a dead network) does.
            reader = threading.Thread(target=self._read_last_checkpoint, args=(found,), daemon=True)
            reader.start()
            reader.join(_CHECKPOINT_READ_SECS)
        if not found and self.last_checkpoint is None:
            where = "last checkpoint: unknown"
        elif not found:
            where = "last checkpoint: unknown (not read in time)"
        elif found[0] is None:
            where = "no checkpoint yet"
        else:
            where = f"last checkpoint: step {found[0]}"
        return (
            f"estimax: lost {names} of {self._n}: no heartbeat for {self.timeout:g} s "
            f"(--peer_timeout); {where}; process {self._id} exits with status "
            f"{LOST_PEER_EXIT_CODE} so that the job runner restarts the job (the same command "
            "resumes from the last checkpoint)"
        )

    def _read_last_checkpoint(self, found: list[int | None]) -> None:
        assert self.last_checkpoint is not None
        try:
            found.append(self.last_checkpoint())
        except Exception:  # noqa: BLE001 (unknown, said as such)
            return

    def _fire(self, lost: list[int]) -> None:
        self.lost = lost
        print(self.message(lost), file=sys.stderr, flush=True)
        if self.on_lost:
            # Bounded, in its own thread: the exit must come whatever a callback's storage does.
            def run() -> None:
                for callback in self.on_lost:
                    with contextlib.suppress(Exception):
                        callback(lost)

            note = threading.Thread(target=run, daemon=True)
            note.start()
            note.join(_CHECKPOINT_READ_SECS)
        if self._id == 0:
            # Process 0 hosts the coordination service: when it ends, JAX's client in every
            # other process aborts at once (a C++ dump). So it waits until the others have
            # said they are exiting (or the linger passes), and ends last.
            self._linger(lost)
        else:
            self._say_exiting()
        self._exit_fn(LOST_PEER_EXIT_CODE)
        with self._cond:
            self._fired = True
            self._cond.notify_all()

    def _say_exiting(self) -> None:
        """Writes "exiting" as this process's heartbeat (bounded: the service may be gone)."""

        def write() -> None:
            try:
                self._client.key_value_set(
                    f"{_BEATS}{self._id}", f"{self._beat + 1} exit", allow_overwrite=True
                )
            except Exception:  # noqa: BLE001 (the service is gone: nobody waits for this)
                return

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        writer.join(_CHECKPOINT_READ_SECS)

    def _linger(self, lost: list[int]) -> None:
        deadline = self._clock() + min(self.timeout, _LINGER_SECS) + 2 * self.interval
        with self._cond:
            while self._clock() < deadline:
                waiting = [p for p, seen in self._seen.items() if p not in lost and not seen[3]]
                if not waiting:
                    return
                self._cond.wait(min(self.interval, max(0.0, deadline - self._clock())))

    # -- the way out

    def settle(self, limit: float | None = None) -> bool:
        """Marks this process done and waits (at most ``limit`` s, default the timeout plus two
        intervals) until every peer is done (True) or one is lost (the judge ends the process;
        with a test's ``exit_fn``, False)."""
        limit = self.timeout + 2 * self.interval if limit is None else limit
        deadline = self._clock() + limit
        with self._cond:
            self._done = True
            self._cond.notify_all()
            while not self._stopped and self.lost is None:
                if self._done_written and all(seen[2] for seen in self._seen.values()):
                    return True
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self.interval))
            # The judge has printed the line and is ending the process (process 0 lingers
            # first, up to the linger bound): wait for it, or a caller's traceback would follow
            # the one line.
            linger = min(self.timeout, _LINGER_SECS) + 4 * self.interval + _CHECKPOINT_READ_SECS
            end = self._clock() + linger
            while self.lost is not None and not self._fired and self._clock() < end:
                self._cond.wait(self.interval)
        return False

    def stop(self) -> None:
        """Stops both threads (they are daemons: a hung request does not hold the process)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.interval + 1.0)
        self._threads = []


_WATCH: PeerWatch | None = None


def watch_peers(timeout: float | None, checkpoint_dir: str | None = None) -> PeerWatch | None:
    """Starts this process's ``PeerWatch`` in a multi-process job; None with one process or a
    ``timeout`` of 0/None and no watch yet. ``initialize`` starts it; a later call (the training
    loop's, with ``RunConfig.peer_timeout_secs``) changes its timeout when given one and names
    the checkpoints the line reports, if none are named yet.

    Args:
      timeout: seconds without a peer's heartbeat before it is lost (``--peer_timeout``); keep
        it under JAX's heartbeat timeout (``jax_heartbeat_timeout``, set at ``initialize``).
      checkpoint_dir: where the job's step checkpoints are (for the line's last step).
    """
    global _WATCH
    last_checkpoint = (
        None if checkpoint_dir is None else functools.partial(last_checkpoint_step, checkpoint_dir)
    )
    if _WATCH is not None:
        if timeout:
            _WATCH.timeout = timeout
        if _WATCH.last_checkpoint is None:
            _WATCH.last_checkpoint = last_checkpoint
        return _WATCH
    if not timeout or jax.process_count() == 1:
        return None
    client = _client()
    if client is None:
        return None
    watch = PeerWatch(
        client,
        jax.process_index(),
        jax.process_count(),
        timeout,
        hosts=dict(_HOSTS),
        last_checkpoint=last_checkpoint,
    )
    _WATCH = watch.start()
    previous_hook = sys.excepthook

    def excepthook(*exc: Any) -> None:
        # The step's collective raised: a lost peer's doing, or this process's own error.
        # Either the watch ends the process (one line, 75) or every peer is done: then the
        # traceback, as without the watch.
        watch.settle()
        watch.stop()
        previous_hook(*exc)

    sys.excepthook = excepthook
    # Runs before JAX's own atexit shutdown (registered at JAX's import: atexit is last in,
    # first out), whose barrier would otherwise wait for a lost peer until JAX's abort.
    atexit.register(_settle_at_exit, watch)
    return watch


def last_checkpoint_step(checkpoint_dir: str) -> int | None:
    """The newest complete step checkpoint's step in ``checkpoint_dir``, by a listing.

    Not Orbax's manager (seconds to open, while the lost-peer line waits): Orbax names a step's
    directory by its step once the step is complete (locally by a rename; on an object store
    with ``commit_success.txt`` inside it).
    """
    fs, path = storage.filesystem(checkpoint_dir)
    names = (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, False))
    for step in sorted((int(n) for n in names if n.isdigit()), reverse=True):
        if not storage.is_remote(checkpoint_dir) or fs.exists(f"{path}/{step}/commit_success.txt"):
            return step
    return None


def _settle_at_exit(watch: PeerWatch) -> None:
    watch.settle()
    watch.stop()
