"""A test job's processes forked from one that has already imported the program (a zygote).

A process of a test job spends about 2 of its 6-8 CPU-seconds importing Python (JAX, Flax,
Optax, Orbax, estimax) before it does anything the test checks; a pod test starts 16 to 73 of
them on a 2-core machine. Here one process per job imports ``tests/multihost_worker.py`` and
its program once, then forks the job's processes (as Android's zygote and multiprocessing's
forkserver do; neither fits: the children must be whole programs with their own environment,
argv, output files and exit status, and forkserver children cannot be killed by the test as
plain processes). Each child is a real process of its own, joined to the others over loopback
by ``jax.distributed`` as before: what the pod tests check (coordination, lost peers, exit
statuses, resumption) is unchanged; only the interpreter's start-up is shared. Nothing has
started a JAX backend or a thread of Python's in the zygote when it forks (numpy's OpenBLAS
pool is fork-safe).

``start(base_env, procs)`` returns one ``Forked`` per process: ``pid``, ``poll``, ``wait``,
``kill``, ``send_signal``, ``returncode`` (negative for a signal), ``communicate``, as
``subprocess.Popen``'s. ``can_fork`` says whether a job's per-process variables allow it: a
variable JAX reads when it is imported (a ``jax.config`` option) must be the same in every
process, since the zygote imported JAX once with the job's common environment.

Run as a script, this is the zygote: it reads one JSON line of the processes to fork from
stdin, writes their pids as one JSON line, then one ``pid status`` line as each one ends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ZYGOTE = os.path.abspath(__file__)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One process of the job: its argv (``argv[0]`` the script to run as ``__main__``), its
    whole environment, and the files its stdout and stderr go to."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    stdout: str
    stderr: str


def can_fork(base_env: Mapping[str, str], envs: Sequence[Mapping[str, str]]) -> bool:
    """True when no process's environment differs from ``base_env`` in a variable that JAX
    reads at import (its config options: ``JAX_PLATFORMS``, ``JAX_ENABLE_X64``...)."""
    import jax  # noqa: PLC0415 (the test process has it; the names are its config's)

    read_at_import = {name.upper() for name in jax.config.values}
    for env in envs:
        for key in read_at_import:
            if env.get(key) != base_env.get(key):
                return False
    return True


class Forked:
    """A forked process of a job, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, pid: int, spec: Spec):
        self.pid, self._spec = pid, spec
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(list(self._spec.argv), timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Only while the zygote has not reported it ended (reaped): its pid is still its own.
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the end (``TimeoutExpired`` after ``timeout``); the process's output."""
        self.wait(timeout)
        with open(self._spec.stdout) as out, open(self._spec.stderr) as err:
            return out.read(), err.read()


def start(base_env: Mapping[str, str], specs: Sequence[Spec]) -> list[Forked]:
    """Starts a zygote with ``base_env`` (what JAX reads at import comes from it) and forks
    ``specs`` from it; returns once every process is running."""
    log = specs[0].stderr + ".zygote"
    with open(log, "w") as zlog:
        zygote = subprocess.Popen(
            [sys.executable, ZYGOTE],
            env=dict(base_env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=zlog,
            text=True,
        )
    assert zygote.stdin is not None and zygote.stdout is not None
    zygote.stdin.write(json.dumps([dataclasses.asdict(s) | {"env": dict(s.env)} for s in specs]))
    zygote.stdin.write("\n")
    zygote.stdin.close()
    first = zygote.stdout.readline()
    if not first:
        zygote.wait()
        with open(log) as f:
            raise RuntimeError(f"the zygote exited {zygote.returncode}:\n{f.read()[-4000:]}")
    procs = [Forked(pid, spec) for pid, spec in zip(json.loads(first), specs, strict=True)]
    by_pid = {p.pid: p for p in procs}

    def reap() -> None:
        # One "pid status" line per process as it ends; the zygote exits after the last.
        for line in zygote.stdout:
            pid, code = (int(x) for x in line.split())
            by_pid[pid]._end(code)  # noqa: SLF001
        zygote.wait()
        for p in procs:  # the zygote died first (killed): its children were killed with it
            if p.returncode is None:
                p._end(-signal.SIGKILL)  # noqa: SLF001

    threading.Thread(target=reap, daemon=True).start()
    return procs


def _child(spec: dict) -> None:
    """In the forked process: become ``spec``'s program and never return."""
    code: object = 0
    try:
        # The zygote's end is this process's end (as a job runner's would be).
        _set_parent_death_signal()
        os.environ.clear()
        os.environ.update(spec["env"])
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, spec["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, spec["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = list(spec["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        import runpy  # noqa: PLC0415

        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - as the interpreter would: sys.excepthook, status 1
        sys.excepthook(*sys.exc_info())  # the program's own hook, where it installs one
        code = 1
    # What the interpreter does at its end: wait for non-daemon threads, run atexit handlers
    # (jax.distributed's shutdown, logging's flush), then flush the standard streams.
    try:
        threading._shutdown()  # noqa: SLF001
        import atexit  # noqa: PLC0415

        atexit._run_exitfuncs()  # noqa: SLF001
    finally:
        if code is None:
            status = 0
        elif isinstance(code, int):
            status = code
        else:
            print(code, file=sys.stderr)
            status = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110 - a closed stream: nothing left to say
                pass
        os._exit(status & 0xFF)


def _set_parent_death_signal() -> None:
    """SIGKILL this process when the zygote ends (Linux's prctl(PR_SET_PDEATHSIG))."""
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


# What a run of the program imports once it runs (measured: 341 modules, 0.8 CPU-s a process,
# Orbax's and tensorboardX's most of them); none starts a thread or a JAX backend at import.
PRELOAD = (
    "estimax.estimator.estimator",
    "estimax.estimator.training",
    "estimax.estimator.evaluation",
    "estimax.estimator.prediction",
    "estimax.estimator.summaries",
    "estimax.migrate.tf_checkpoint",
    "estimax.parallel.distributed",
    "estimax.parallel.preflight",
    "estimax.parallel.watchdog",
    "estimax.state.goodput",
    "estimax.state.orbax_storage",
    "estimax.state.restoring",
)


def preload() -> None:
    """Imports ``PRELOAD`` and tensorboardX's writer (as the summaries import it)."""
    import importlib  # noqa: PLC0415

    for name in PRELOAD:
        importlib.import_module(name)
    from estimax import storage  # noqa: PLC0415

    storage.register_summary_writers()  # before tensorboardX, as estimator/summaries.py does
    importlib.import_module("tensorboardX.event_file_writer")
    importlib.import_module("tensorboardX.summary")


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w")
    specs = json.loads(sys.stdin.readline())
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    import multihost_worker  # noqa: F401, PLC0415 (the import every child would repeat)

    preload()

    pids = []
    for spec in specs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            protocol.close()
            _child(spec)
        pids.append(pid)
    protocol.write(json.dumps(pids) + "\n")
    protocol.flush()
    left = set(pids)
    while left:
        pid, status = os.wait()
        if pid in left:
            left.discard(pid)
            protocol.write(f"{pid} {os.waitstatus_to_exitcode(status)}\n")
            protocol.flush()


if __name__ == "__main__":
    main()
