"""Who runs the loader's chunk tasks: its own thread, a pool of threads, or worker processes; and
which of these ``worker_type="auto"`` picks (:func:`worker_policy`, which ``estimax.doctor``
reports).

Every kind has ``submit(task) -> pending`` (``pending.result()`` gives the task's result or
raises its error) and ``shutdown(wait)``. Worker processes speak a small protocol over one pipe
each: the loader sends a task (``chunks.TransformChunk`` or ``chunks.FillChunk``), the worker
answers :class:`Done` or :class:`Failed`, in order. A worker that dies is one ``SourceError``,
whether sending it a task or waiting for its reply finds it gone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from typing import Any, Protocol

from estimax.data.chunks import ChunkTask, ChunkWorker
from estimax.data.read_ahead import ReadAhead, read_ahead_for
from estimax.data.sources import SourceError
from estimax.data.worker_exit import exit_with_parent

__all__ = [
    "AUTO_PROCESS_WORKERS",
    "Done",
    "Failed",
    "InlineWorkers",
    "ProcessWorkers",
    "ThreadWorkers",
    "Workers",
    "start_workers",
    "usable_cores",
    "worker_policy",
]

# worker_type="auto": processes from this many usable cores and workers on (estimax.data.loader's
# docstring has the measurements behind it).
AUTO_PROCESS_WORKERS = 4


def usable_cores() -> int:
    """The CPUs this process may use: the default number of workers."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_policy(num_workers: int, cores: int) -> tuple[str, str]:
    """What ``worker_type="auto"`` runs ``num_workers`` workers as on ``cores`` usable cores.

    Returns:
      ``("thread" or "process", why)``: ``why`` is the rule, in words, for logs and reports.
    """
    if min(cores, num_workers) >= AUTO_PROCESS_WORKERS:
        return "process", (
            f"processes from {AUTO_PROCESS_WORKERS} usable cores and {AUTO_PROCESS_WORKERS} "
            "workers on, which decode outside the training process"
        )
    return "thread", (
        f"threads below {AUTO_PROCESS_WORKERS} usable cores or {AUTO_PROCESS_WORKERS} workers, "
        "which need no start-up and no __main__ guard"
    )


class Pending(Protocol):
    """A submitted task: ``result()`` waits for its result or raises its error."""

    def result(self) -> Any: ...

    def cancel(self) -> Any: ...


class Workers(Protocol):
    """What runs chunk tasks for the loader."""

    shared_memory: bool  # do batch slots have to be shared memory (``slots.SlotPool(shared=)``)

    def submit(self, task: ChunkTask) -> Pending: ...

    def shutdown(self, wait: bool = True) -> None: ...


def start_workers(num_workers: int, worker_type: str, worker: ChunkWorker) -> Workers:
    """``num_workers`` workers of ``worker_type`` ("thread" or "process") running ``worker``'s
    tasks; with none, the tasks run in the caller's thread."""
    if num_workers <= 0:
        return InlineWorkers(worker)
    if worker_type == "thread":
        return ThreadWorkers(num_workers, worker)
    return ProcessWorkers(num_workers, worker)


class _Ran:
    """A task that already ran."""

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    def result(self) -> Any:
        return self._value

    def cancel(self) -> bool:
        return False


class InlineWorkers:
    """No workers (``num_workers=0``): a task runs when submitted, in the loader's own thread."""

    shared_memory = False

    def __init__(self, worker: ChunkWorker):
        self._worker = worker

    def submit(self, task: ChunkTask) -> Pending:
        return _Ran(self._worker.run(task))

    def shutdown(self, wait: bool = True) -> None:
        """Nothing runs in the background."""


class ThreadWorkers:
    """A pool of threads; on object stores a chunk's records are read ahead from when it is
    submitted, a window of chunks shared by the threads (``estimax.data.read_ahead``)."""

    shared_memory = False

    def __init__(self, num: int, worker: ChunkWorker):
        self._worker = worker
        self._pool = concurrent.futures.ThreadPoolExecutor(num)
        self._ahead = read_ahead_for(worker.source, num)

    def submit(self, task: ChunkTask) -> Pending:
        read = self._ahead.start(task.record_ids) if self._ahead is not None else None
        return self._pool.submit(self._worker.run, task, read)

    def shutdown(self, wait: bool = True) -> None:
        """Drops the tasks not yet started; ``wait`` for those under way."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if self._ahead is not None:
            self._ahead.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """A worker process's reply: its oldest task's result."""

    result: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """A worker process's reply: its oldest task raised ``error``."""

    error: BaseException


class _Ticket:
    """A task sent to one worker process; ``result()`` receives its reply (FIFO per worker)."""

    __slots__ = ("_workers", "_index")

    def __init__(self, workers: ProcessWorkers, index: int):
        self._workers, self._index = workers, index

    def result(self) -> Any:
        return self._workers.receive(self._index)

    def cancel(self) -> bool:
        """Nothing to cancel: the workers are shut down with the iterator."""
        return False


class ProcessWorkers:
    """Worker processes, each on its own pipe: the training process sends a task and later reads
    its reply, with no thread in between.

    Why not ``concurrent.futures.ProcessPoolExecutor``: each of its tasks passes through a
    management thread, a queue-feeder thread and a future (~0.3-0.5 ms of the training process's
    CPU per task, measured), which capped a host near 16,000 images/s with 8-record chunks. Here
    a task costs one pickled message written to a pipe and a few bytes read back.
    """

    shared_memory = True

    def __init__(self, num: int, worker: ChunkWorker):
        ctx = _process_context()
        # Unpickled in the worker only after it has this process's environment: a forkserver
        # keeps the environment it started with, and storage clients (gcsfs, s3fs) read theirs
        # (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL, credentials) when the source is unpickled.
        payload = pickle.dumps(worker)
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._outstanding = [0] * num
        for _ in range(num):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(  # type: ignore[attr-defined]  # forkserver context
                target=_worker_main,
                args=(theirs, payload, dict(os.environ), os.getpid()),
                name="estimax-loader-worker",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)

    def submit(self, task: ChunkTask) -> Pending:
        """Sends ``task`` to the least busy worker."""
        index = min(range(len(self._conns)), key=self._outstanding.__getitem__)
        try:
            self._conns[index].send(task)
        except OSError:  # BrokenPipeError, ConnectionResetError: it is gone
            raise self._died(index) from None
        self._outstanding[index] += 1
        return _Ticket(self, index)

    def receive(self, index: int) -> Any:
        """The oldest reply of worker ``index``; re-raises a task's exception."""
        try:
            reply: Done | Failed = self._conns[index].recv()
        except (EOFError, OSError):
            raise self._died(index) from None
        self._outstanding[index] -= 1
        if isinstance(reply, Failed):
            raise reply.error
        return reply.result

    def _died(self, index: int) -> SourceError:
        """The one error for worker ``index``'s death, whichever pipe operation found it."""
        proc = self._procs[index]
        proc.join(timeout=1)
        how = f"exit code {proc.exitcode}"
        if proc.exitcode is not None and proc.exitcode < 0:
            how = f"killed by {signal.Signals(-proc.exitcode).name}"
            if proc.exitcode == -signal.SIGKILL:
                how += ": out of memory? Fewer or lighter workers need less"
        return SourceError(f"a loader worker process died ({how}); the input cannot go on")

    def shutdown(self, wait: bool = True) -> None:
        """Stops the workers: closing their pipes ends them (after a task under way)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        if wait:
            for proc in self._procs:
                proc.join(timeout=5)
                if proc.is_alive():  # stuck in a read: it is ours to end
                    proc.kill()
                    proc.join()
        self._conns, self._procs = [], []


def _process_context() -> multiprocessing.context.BaseContext:
    """Worker processes fork from a forkserver that has imported this module once.

    Not ``fork``: the parent usually runs JAX, whose threads make forking it unsafe. Not plain
    ``spawn``: every worker of every pool would re-import its modules (1-2 s, more when the
    ``estimax`` package pulls in JAX); the forkserver imports them once and forks clean copies.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _worker_main(conn: Any, payload: bytes, environ: dict[str, str], owner_pid: int) -> None:
    """A worker process: runs the tasks from its pipe until the pipe closes."""
    os.environ.clear()
    os.environ.update(environ)
    worker: ChunkWorker = pickle.loads(payload)
    # A worker ends with the loader's process, even one killed with SIGKILL (worker_exit).
    exit_with_parent(owner_pid)
    tasks: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(
        target=_receive,
        args=(conn, tasks, read_ahead_for(worker.source, 1)),
        name="estimax-worker-receive",
        daemon=True,
    ).start()
    while (received := tasks.get()) is not None:
        task, read = received
        try:
            reply: Done | Failed = Done(worker.run(task, read))
        except BaseException as e:  # noqa: BLE001 - delivered to the training process
            reply = Failed(e)
        if not _send(conn, reply):
            return


def _receive(conn: Any, tasks: queue.SimpleQueue, ahead: ReadAhead | None) -> None:
    """Takes each task the moment it arrives and starts its records' reads (object stores),
    while the worker's main thread decodes earlier ones; None when the pipe closes."""
    while True:
        try:
            task: ChunkTask = conn.recv()
        except (EOFError, OSError):
            tasks.put(None)
            return
        tasks.put((task, ahead.start(task.record_ids) if ahead is not None else None))


def _send(conn: Any, reply: Done | Failed) -> bool:
    """Sends ``reply``; False when the loader is gone."""
    try:
        conn.send(reply)
    except (BrokenPipeError, OSError):
        return False
    except Exception:  # noqa: BLE001 - a result or exception that cannot be pickled
        what = reply.error if isinstance(reply, Failed) else reply.result
        conn.send(Failed(RuntimeError(f"{type(what).__name__}: {what}")))
    return True
