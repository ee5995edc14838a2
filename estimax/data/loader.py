"""The loader: records -> (parallel decode/preprocess) -> fixed-shape batches, exactly resumable.

What it does:

* **Order** (``estimax.data.order``): one stream for all hosts. Epoch ``e`` visits all records in
  ``permutation(seed, e)`` (or in file order without shuffling); training repeats forever, with a
  new permutation every epoch, batches running across epoch boundaries as the original's
  ``repeat()`` before ``batch()``. Global batch ``b`` is a fixed slice of the stream and host
  ``h`` of ``H`` reads its block of it: the same training on any number of hosts. Eval is one pass.
* **Randomness**: record ``i`` in epoch ``e`` gets ``np.random.default_rng([seed, e, i])``, so
  crops and flips do not depend on the number or kind of workers or hosts, nor on where a run
  resumed.
* **Parallelism**: ``num_workers`` threads or processes transform chunks of records and write
  the elements straight into the rows of a batch slot (``estimax.data.slots``: shared memory for
  processes); the caller gets views of a filled slot, no pickled pixels, no stacking. Batches
  come back in order; ``prefetch`` of them are kept ready.
* **State**: ``iterator.get_state()`` is ``{"epoch", "position", "num_skipped", ...}``: the
  stream's position after the global batch the caller last *received* (not what is prefetched),
  the same on every host, so an iterator given it by ``set_state``, on any number of hosts,
  yields exactly the batches an uninterrupted one would have yielded.
* **Bad records** (bad CRC, truncated, a ``transform`` error such as an undecodable JPEG or a label
  out of range): an error naming the file and the record's byte offset, or with
  ``skip_bad_records=True`` a logged warning and a count in ``num_skipped``. Training then
  replaces the bad record by the nearest good one before it in this host's block (after it, for
  the first): every host still feeds full batches of the same global slice, deterministically,
  with no host knowing about another's bad records. A one-pass (eval) input drops it: that batch
  is smaller (the Estimator pads and masks it).

Why not Grain (0.2.18, evaluated): its MapDataset/IterDataset would serve for order, state and
workers, but (1) importing ``grain`` imports JAX (``grain/_src/core/profiler.py`` imports
``jax.profiler`` whenever JAX is installed), which the data layer must not do and which every
worker process would pay for; (2) its TFRecord source (``sources/tfrecord_dataset.py``) is
sequential, local-``open()`` only and does not check CRCs, so the random-access, fsspec, CRC-checked
source would be ours anyway; (3) skip-and-count of bad records inside its multiprocess workers
cannot reach the caller without reading its private worker state. What remains is small: a
per-epoch permutation, an ordered parallel map and a position counter, written here.

Threads or processes (``worker_type="auto"``, the default, picks from the host's cores and
the workers' count, and logs it): the decoders (simplejpeg, OpenCV) release the GIL, but what
holds it (tf.Example parsing, RNG set-up, crop sampling) is ~0.1 ms of each ~1.2 ms image, so
threads contend past a few workers, and with threads all the decoding counts in the training
process. Process workers write into shared memory: the training process spends ~0.01 ms of CPU
per image (a host ceiling near 100,000 images/s) and a worker delivers about what the same work
does in-process (bench/results/input_pipeline.host.md). ``auto`` takes processes when both the
usable cores and the workers number 4 or more, else threads (no worker start-up, no
``__main__`` guard needed).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, overload

import numpy as np

from estimax.data import slots, tfrecord
from estimax.data.order import GlobalOrder
from estimax.data.worker_exit import exit_with_parent

__all__ = [
    "BadRecordError",
    "Loader",
    "LoaderIterator",
    "SourceError",
    "TFRecordSource",
    "host_shard",
]

log = logging.getLogger(__name__)

_STATE_VERSION = 2
# worker_type="auto": processes from this many usable cores and workers on (module docstring).
AUTO_PROCESS_WORKERS = 4
_T = TypeVar("_T")


class BadRecordError(ValueError):
    """A record could not be read or preprocessed; names the file and the record's byte offset."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


class SourceError(RuntimeError):
    """The source as a whole cannot be read (e.g. a database that does not answer): not a bad
    record, so it stops the loader even with ``skip_bad_records``."""


class RecordSource(Protocol):
    """Random access to records: what the :class:`Loader` reads from.

    A source may also have ``read_many(ids) -> list[bytes | Exception]``: the records of one
    chunk in one request (a record that cannot be read is its exception). The loader then uses it
    instead of one ``source[i]`` per record (``estimax.data.bigtable``: one request per chunk).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> bytes: ...

    def describe(self, i: int) -> str:
        """Where record ``i`` lives, for error messages: ``"<file>: record at byte offset N"``."""
        ...


@overload
def host_shard(items: np.ndarray, host_index: int, num_hosts: int) -> np.ndarray: ...
@overload
def host_shard(items: Sequence[_T], host_index: int, num_hosts: int) -> list[_T]: ...
def host_shard(
    items: Sequence[Any] | np.ndarray, host_index: int, num_hosts: int
) -> list[Any] | np.ndarray:
    """This host's share of ``items``: ``items[host_index::num_hosts]``, as tf.data's ``shard``.

    Every item goes to exactly one host; hosts get ``len // num_hosts`` or one more. An array
    stays an array (record ids); other sequences become lists.
    """
    if not 0 <= host_index < num_hosts:
        raise ValueError(f"host_index {host_index} out of range for num_hosts {num_hosts}")
    share = items[host_index::num_hosts]
    return share if isinstance(share, np.ndarray) else list(share)


class TFRecordSource:
    """The records of several TFRecord files, addressed by one index ``0..len-1`` in file order.

    Record offsets come from each file's index (``<file>.idx``, see ``tfrecord.write_index``) or,
    without one, from a scan of the file's headers at construction (cheap for local files; for
    ``gs://`` write index files first, or each file is read once to find its records).

    Args:
      files: TFRecord paths, in the order they are addressed.
      verify_crc: check the CRCs of every record read.
      skip_bad_records: a file whose scan hits damage (truncated, bad length CRC) keeps the
        records before the damage and counts one skipped record (``num_skipped_at_open``),
        instead of raising ``CorruptRecordError``.
    """

    def __init__(
        self, files: Sequence[str], verify_crc: bool = True, skip_bad_records: bool = False
    ):
        if not files:
            raise ValueError("TFRecordSource needs at least one file")
        self.files = list(files)
        self.num_skipped_at_open = 0
        self._record_files: list[tfrecord.RecordFile] = []
        for path in self.files:
            try:
                rf = tfrecord.RecordFile(path, verify_crc=verify_crc)
            except tfrecord.CorruptRecordError as e:
                if not skip_bad_records:
                    raise
                rf = _partial_record_file(path, e, verify_crc)
                self.num_skipped_at_open += 1
                log.warning("skipping the damaged rest of %s (skip_bad_records): %s", path, e)
            self._record_files.append(rf)
        counts = np.asarray([len(rf) for rf in self._record_files], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        # On object stores a worker reads the records of the chunks it was given ahead of
        # decoding them, each chunk in one concurrent call (read_many).
        self.read_ahead = any(rf.is_remote for rf in self._record_files)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[tfrecord.RecordFile, int]:
        f = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._record_files[f], i - int(self._starts[f])

    def __getitem__(self, i: int) -> bytes:
        rf, j = self._locate(i)
        return rf[j]

    def describe(self, i: int) -> str:
        rf, j = self._locate(i)
        return f"{rf.path}: record at byte offset {rf.offset(j)}"

    def read_many(self, ids: Sequence[int]) -> list[bytes | Exception]:
        """Records ``ids``, on object stores in one concurrent, coalescing call
        (``tfrecord.read_many``); a record that cannot be read is its exception."""
        if not self.read_ahead:
            return [self._read_one(int(i)) for i in ids]
        return tfrecord.read_many([self._locate(int(i)) for i in ids])

    def _read_one(self, i: int) -> bytes | Exception:
        try:
            return self[i]
        except Exception as e:  # noqa: BLE001 - the caller decides: bad record or error
            return e

    def num_records_per_file(self) -> list[int]:
        return [len(rf) for rf in self._record_files]


def _partial_record_file(
    path: str, error: tfrecord.CorruptRecordError, verify_crc: bool
) -> tfrecord.RecordFile:
    """A RecordFile of the records before the damage ``error`` reported."""
    offsets: list[int] = []
    # Reading stops at the damage ``error`` already reports; keep the records before it.
    with contextlib.suppress(tfrecord.CorruptRecordError):
        for off, _ in tfrecord.read_records_with_offsets(path, verify_crc=False):
            if off >= error.offset:
                break
            offsets.append(off)
    return tfrecord.RecordFile(
        path, verify_crc=verify_crc, offsets=np.asarray(offsets + [error.offset], dtype=np.int64)
    )


class _BadElement:
    """A worker's report that one element failed (picklable; errors may not be)."""

    __slots__ = ("index", "where", "problem")

    def __init__(self, index: int, where: str, problem: str):
        self.index, self.where, self.problem = index, where, problem

    @property
    def message(self) -> str:
        return f"{self.where}: {self.problem}"


# Per-process worker globals, set once by the pool initializer so tasks carry only indices.
_WORKER: dict[str, Any] = {}


def _init_worker(source: RecordSource, transform: Callable, seed: int, owner_pid: int) -> None:
    # A worker ends with the loader's process, even one killed with SIGKILL (worker_exit).
    exit_with_parent(owner_pid)
    _WORKER["source"], _WORKER["transform"], _WORKER["seed"] = source, transform, seed


def _run_chunk(
    epochs: list[int],
    record_ids: list[int],
    source: RecordSource | None = None,
    transform: Callable | None = None,
    seed: int | None = None,
    *,
    read: Callable[[], list] | None = None,
) -> list[Any]:
    """Reads and transforms records; a failure becomes a _BadElement (order is preserved).

    ``read``: the records, already being read ahead (``_ReadAhead``).
    """
    if source is None:
        source, transform, seed = _WORKER["source"], _WORKER["transform"], _WORKER["seed"]
    assert transform is not None and seed is not None, "given, or set by _init_worker"
    out: list[Any] = []
    read_many = getattr(source, "read_many", None)
    # A SourceError from read_many propagates: the whole source is unreadable, not a record.
    records: list | None = None
    if read is not None:
        records = read()
    elif read_many is not None:
        records = read_many(record_ids)
    for k, rid in enumerate(record_ids):
        try:
            if records is None:
                record = source[rid]
            elif isinstance(records[k], Exception):
                raise records[k]
            else:
                record = records[k]
            rng = np.random.default_rng([seed, epochs[k], rid])
            out.append(transform(record, rng))
        except tfrecord.CorruptRecordError as e:
            out.append(_BadElement(rid, f"{e.path}: record at byte offset {e.offset}", e.problem))
        except (SourceError, tfrecord.ShardChangedError):  # not a record: the input stops
            raise
        except BadRecordError as e:
            out.append(_BadElement(rid, e.where, e.problem))
        except Exception as e:  # noqa: BLE001 - any transform failure is a bad record
            out.append(_BadElement(rid, source.describe(rid), f"{type(e).__name__}: {e}"))
    return out


def _fill_chunk(
    epochs: list[int],
    record_ids: list[int],
    row: int,
    slot: str | list[np.ndarray],
    layout: slots.Layout,
    source: RecordSource | None = None,
    transform: Callable | None = None,
    seed: int | None = None,
    *,
    read: Callable[[], list] | None = None,
) -> list[tuple[int, _BadElement]]:
    """Transforms records into rows ``row, row + 1, ...`` of a batch slot.

    ``slot`` is the slot's shared-memory name (in a worker process) or its arrays (threads).
    Returns only the bad records, as ``(row, _BadElement)``: the pixels never travel back.
    """
    dests = slots.attach(slot, layout) if isinstance(slot, str) else slot
    bad: list[tuple[int, _BadElement]] = []
    for k, element in enumerate(_run_chunk(epochs, record_ids, source, transform, seed, read=read)):
        if isinstance(element, _BadElement):
            bad.append((row + k, element))
        else:
            try:
                slots.write_rows(dests, layout, row + k, element)
            except ValueError as e:  # a ragged element: name the record it came from
                described = (source if source is not None else _WORKER["source"]).describe(
                    record_ids[k]
                )
                raise ValueError(f"{described}: {e}") from None
    return bad


class _End:
    """The producer's last item: the input has ended, after ``num_skipped`` bad records."""

    __slots__ = ("num_skipped",)

    def __init__(self, num_skipped: int):
        self.num_skipped = num_skipped


class _ReadAhead:
    """Reads the records of chunks before they are decoded: object-store latency overlaps work.

    ``start(ids)`` begins ``source.read_many(ids)`` on an I/O thread and returns what gives the
    records (or raises the read's error). The loader starts a chunk's read when it hands the
    chunk out (process workers: when the chunk reaches the worker), so every chunk in flight is
    being read while earlier ones decode; what is read ahead is bounded by the chunks in flight.
    """

    def __init__(self, source: RecordSource, threads: int = 4):
        self._read_many = source.read_many  # type: ignore[attr-defined]  # read_ahead sources
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "estimax-read-ahead")

    def start(self, ids: list[int]) -> Callable[[], list]:
        return self._pool.submit(self._read_many, ids).result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _read_ahead_for(source: RecordSource) -> _ReadAhead | None:
    return _ReadAhead(source) if getattr(source, "read_ahead", False) else None


class _Ticket:
    """A task sent to one worker process; ``result()`` receives its reply (FIFO per worker)."""

    __slots__ = ("_workers", "_index")

    def __init__(self, workers: _ProcessWorkers, index: int):
        self._workers, self._index = workers, index

    def result(self) -> Any:
        return self._workers.receive(self._index)

    def cancel(self) -> None:
        """Nothing to cancel: the workers are shut down with the iterator."""


class _ProcessWorkers:
    """Worker processes, each on its own pipe: the training process sends a task and later reads
    its reply, with no thread in between.

    Why not ``concurrent.futures.ProcessPoolExecutor``: each of its tasks passes through a
    management thread, a queue-feeder thread and a future (~0.3-0.5 ms of the training process's
    CPU per task, measured), which capped a host near 16,000 images/s with 8-record chunks. Here
    a task costs one pickled tuple written to a pipe and a few bytes read back.
    """

    def __init__(self, num: int, source: RecordSource, transform: Callable, seed: int):
        ctx = _process_context()
        # Unpickled in the worker only after it has this process's environment: a forkserver
        # keeps the environment it started with, and storage clients (gcsfs, s3fs) read theirs
        # (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL, credentials) when the source is unpickled.
        payload = pickle.dumps((source, transform, seed))
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

    def submit(self, fn: Callable, *args: Any) -> _Ticket:
        """Sends ``fn(*args)`` to the least busy worker."""
        index = min(range(len(self._conns)), key=self._outstanding.__getitem__)
        try:
            self._conns[index].send((fn, args))
        except OSError:  # BrokenPipeError, ConnectionResetError: it is gone
            raise self._died(index) from None
        self._outstanding[index] += 1
        return _Ticket(self, index)

    def receive(self, index: int) -> Any:
        """The oldest reply of worker ``index``; re-raises a task's exception."""
        try:
            ok, value = self._conns[index].recv()
        except (EOFError, OSError):
            raise self._died(index) from None
        self._outstanding[index] -= 1
        if not ok:
            raise value
        return value

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

    def shutdown(self, wait: bool = True, cancel_futures: bool = True) -> None:
        """Stops the workers: closing their pipes ends them (after a task under way)."""
        del cancel_futures  # the executor's signature; nothing is queued but in the pipes
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


def _worker_main(conn: Any, payload: bytes, environ: dict[str, str], owner_pid: int) -> None:
    """A worker process: runs tasks from its pipe until the pipe closes."""
    os.environ.clear()
    os.environ.update(environ)
    source, transform, seed = pickle.loads(payload)
    _init_worker(source, transform, seed, owner_pid)
    ahead = _read_ahead_for(source)
    tasks: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        # Takes each task the moment it arrives and starts its records' reads (object stores),
        # while the worker's main thread decodes earlier ones.
        while True:
            try:
                fn, args = conn.recv()
            except (EOFError, OSError):
                tasks.put(None)
                return
            # args[1]: the chunk's record ids (_run_chunk and _fill_chunk alike).
            tasks.put((fn, args, ahead.start(args[1]) if ahead is not None else None))

    threading.Thread(target=receive, name="estimax-worker-receive", daemon=True).start()
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args, read = task
        try:
            reply: tuple[bool, Any] = (True, fn(*args, read=read))
        except BaseException as e:  # noqa: BLE001 - delivered to the training process
            reply = (False, e)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        except Exception as e:  # noqa: BLE001 - an exception that cannot be pickled
            conn.send((False, RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))
            del e


class Loader:
    """An iterable of batches over a :class:`RecordSource`; ``iter()`` starts from the beginning.

    Args:
      source: records (e.g. :class:`TFRecordSource` of this host's files).
      transform: ``transform(record: bytes, rng: np.random.Generator) -> element``; an element is
        an array or a tuple/dict of arrays of fixed shape, stacked into batches. Must be picklable
        (a module-level function or ``functools.partial``) for ``worker_type="process"``.
      batch_size: elements per batch.
      shuffle: visit records in a new seeded permutation every epoch (else in file order).
      seed: the seed of the permutations and of the per-element RNGs.
      num_epochs: ``None`` repeats forever (training); ``1`` is one pass (eval).
      drop_remainder: drop a final partial batch. Eval keeps it (the Estimator pads and masks it,
        so every example counts once).
      num_workers: parallel transforms; ``0`` runs them in the loader's own background thread.
        Default: the CPUs this process may use.
      worker_type: ``"thread"``, ``"process"`` (forked from a forkserver, which is safe when
        JAX's threads already run; the main script needs the ``if __name__ == "__main__":``
        guard, as with ``spawn``) or ``"auto"`` (default: processes from
        ``AUTO_PROCESS_WORKERS`` usable cores and workers on, else threads; logged).
      prefetch: batches kept ready ahead of the caller.
      skip_bad_records: skip a bad record with a warning and count it (``num_skipped``) instead
        of raising :class:`BadRecordError`.
      record_ids: the records of ``source`` the stream visits; default all. With the global
        order (``num_hosts``) every host gives the same; a per-host subset (the legacy file or
        record sharding) with ``num_hosts=1`` makes each host's order its own.
      num_hosts, host_index: the global order (``estimax.data.order``): one stream over
        ``record_ids`` for all hosts, global batches of ``batch_size * num_hosts``, this host
        reading block ``host_index`` of each. The position is the stream's, the same on every
        host: it resumes on any number of hosts.
      order_is_global: False when ``source``/``record_ids`` are this host's own share (legacy
        sharding): the saved position then does not say ``"order": "global"``, and a job resumed
        on another number of hosts restarts its input.
    """

    def __init__(
        self,
        source: RecordSource,
        transform: Callable[[bytes, np.random.Generator], Any],
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        num_epochs: int | None = None,
        drop_remainder: bool = True,
        num_workers: int | None = None,
        worker_type: str = "auto",
        prefetch: int = 2,
        skip_bad_records: bool = False,
        record_ids: Sequence[int] | np.ndarray | None = None,
        chunk_size: int | None = None,
        num_hosts: int = 1,
        host_index: int = 0,
        order_is_global: bool = True,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if worker_type not in ("thread", "process", "auto"):
            raise ValueError(
                f"worker_type must be 'thread', 'process' or 'auto', got {worker_type!r}"
            )
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
        self.source = source
        self.transform = transform
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_epochs = num_epochs
        self.drop_remainder = drop_remainder
        self.num_workers = _default_workers() if num_workers is None else int(num_workers)
        if worker_type == "auto":
            cores = _default_workers()
            many = min(cores, self.num_workers) >= AUTO_PROCESS_WORKERS
            worker_type = "process" if many else "thread"
            log.info(
                "input: %d %s workers on %d usable cores (worker_type='auto': processes from %d "
                "cores and workers on)",
                self.num_workers,
                worker_type,
                cores,
                AUTO_PROCESS_WORKERS,
            )
        self.worker_type = worker_type
        self.prefetch = max(1, int(prefetch))
        self.skip_bad_records = skip_bad_records
        if chunk_size is None:
            # A task's cost in the training process (submit, result, future) is the same for 8
            # records as for 32: process workers get bigger chunks so that it stays far below
            # the pixels' (bench/results/input_pipeline.host.md).
            chunk_size = 32 if self.num_workers > 0 and worker_type == "process" else 8
        self.chunk_size = max(1, int(chunk_size))
        ids = (
            np.arange(len(source), dtype=np.int64)
            if record_ids is None
            else np.asarray(record_ids, dtype=np.int64)
        )
        if ids.size == 0:
            raise ValueError("the loader has no records to read (empty source or shard)")
        self.record_ids = ids
        self.num_hosts, self.host_index = int(num_hosts), int(host_index)
        self.order_is_global = order_is_global
        self.global_order = GlobalOrder(
            ids,
            batch_size,
            num_hosts=self.num_hosts,
            host_index=self.host_index,
            shuffle=shuffle,
            seed=self.seed,
            num_epochs=num_epochs,
            drop_remainder=drop_remainder,
        )

    @property
    def num_records(self) -> int:
        """Records per epoch."""
        return int(self.record_ids.size)

    def order(self, epoch: int) -> np.ndarray:
        """The source record ids of ``epoch``, in visiting order: [num_records] int64."""
        return self.global_order.order(epoch)

    def __iter__(self) -> LoaderIterator:
        return LoaderIterator(self)

    def __len__(self) -> int:
        """Batches per pass, for a finite loader (an upper bound if records get skipped)."""
        if self.num_epochs is None:
            raise TypeError("an infinite (num_epochs=None) loader has no len()")
        n = self.num_records * self.num_epochs
        g = self.batch_size * self.num_hosts
        if self.drop_remainder:
            return n // g
        # Global batches whose block for this host is not empty.
        return max(0, -(-(n - self.host_index * self.batch_size) // g))


def _process_context() -> multiprocessing.context.BaseContext:
    """Worker processes fork from a forkserver that has imported the loader once.

    Not ``fork``: the parent usually runs JAX, whose threads make forking it unsafe. Not plain
    ``spawn``: every worker of every pool would re-import its modules (1-2 s, more when the
    ``estimax`` package pulls in JAX); the forkserver imports them once and forks clean copies.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["estimax.data.loader"])
    return ctx


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class LoaderIterator(Iterator[Any]):
    """Iterator over a :class:`Loader`'s batches with ``get_state``/``set_state``.

    Attributes:
      num_skipped: bad records skipped so far (with ``skip_bad_records``), including before a
        restore.
    """

    def __init__(self, loader: Loader):
        self._loader = loader
        self._epoch = 0
        self._position = 0
        self.num_skipped = int(getattr(loader.source, "num_skipped_at_open", 0))
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._executor: concurrent.futures.Executor | _ProcessWorkers | None = None
        self._pools: list[slots.SlotPool] = []
        self._done = False

    # -- state ----------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The position after the last batch returned by ``next()``; JSON-serialisable."""
        ld = self._loader
        return {
            "version": _STATE_VERSION,
            **({"order": "global"} if ld.order_is_global else {}),
            "epoch": self._epoch,
            "position": self._position,
            "num_skipped": self.num_skipped,
            "seed": ld.seed,
            "shuffle": ld.shuffle,
            "num_records": ld.num_records,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from ``state`` (from ``get_state`` of an iterator over the same data).

        Raises:
          ValueError: the state belongs to a different dataset (record count) or seed/shuffle.
        """
        ld = self._loader
        version = state.get("version")
        if version == 1 and ld.num_hosts > 1:
            # A per-host position of an older estimax: it counted this host's own records, which
            # the global order does not have. Restart, as a changed host count did then.
            log.warning(
                "the saved input position is per host (loader state version 1); with the global "
                "order of %d hosts the input restarts from its beginning",
                ld.num_hosts,
            )
            self._shutdown()
            self._epoch, self._position, self._done = 0, 0, False
            self.num_skipped = int(state.get("num_skipped", 0))
            return
        if version not in (1, _STATE_VERSION):
            raise ValueError(
                f"unknown loader state version {version!r} (expected {_STATE_VERSION}): {state}"
            )
        for key, mine in (
            ("num_records", ld.num_records),
            ("seed", ld.seed),
            ("shuffle", ld.shuffle),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has {key}={mine!r}; "
                    "the saved input position belongs to other data or settings"
                )
        position = int(state["position"])
        if not 0 <= position <= ld.num_records:
            raise ValueError(f"loader state position {position} outside [0, {ld.num_records}]")
        self._shutdown()
        self._epoch, self._position = int(state["epoch"]), position
        self.num_skipped = int(state["num_skipped"])
        self._done = False

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> LoaderIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, _End):
            self.num_skipped = item.num_skipped  # bad records after the last batch count too
        if isinstance(item, (_End, BaseException)):
            self._done = True
            # Not waiting for worker processes to exit: that would add their shutdown time
            # (~1 s) to the end of every eval pass.
            self._shutdown(wait=False)
            if isinstance(item, BaseException):
                raise item
            raise StopIteration
        batch, (epoch, position, num_skipped) = item
        self._epoch, self._position, self.num_skipped = epoch, position, num_skipped
        return batch

    def close(self) -> None:
        """Stops the background thread and workers."""
        self._shutdown()

    def __del__(self) -> None:
        try:
            self._shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _start(self) -> None:
        ld = self._loader
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=ld.prefetch)
        if ld.num_workers > 0 and ld.worker_type == "thread":
            self._executor = concurrent.futures.ThreadPoolExecutor(ld.num_workers)
        elif ld.num_workers > 0:
            self._executor = _ProcessWorkers(ld.num_workers, ld.source, ld.transform, ld.seed)
        # The thread gets the loader, not this iterator, so an iterator dropped without close()
        # can be garbage-collected, and its __del__ stops the thread and the workers.
        self._thread = threading.Thread(
            target=_produce,
            args=(
                ld,
                self._epoch,
                self._position,
                self.num_skipped,
                self._stop,
                self._queue,
                self._executor,
                self._pools,
            ),
            name="estimax-loader",
            daemon=True,
        )
        self._thread.start()

    def _shutdown(self, wait: bool = True) -> None:
        if self._thread is not None:
            assert self._queue is not None  # made with the thread
            self._stop.set()
            # Unblock a producer waiting on a full queue.
            while self._thread.is_alive():
                try:
                    while True:
                        self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.05)
            self._thread = None
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
            self._executor = None
        for pool in self._pools:
            pool.close()
        self._pools = []


class _Block:
    """One host block of a global batch on its way into a slot."""

    __slots__ = ("slot", "size", "next_start", "bad", "elements")

    def __init__(self, slot: int | None, size: int, next_start: int):
        self.slot, self.size, self.next_start = slot, size, next_start
        self.bad: dict[int, _BadElement] = {}
        # Before the batch layout is known (the first block): the elements themselves.
        self.elements: list[Any] = []


def _produce(
    ld: Loader,
    epoch: int,
    position: int,
    num_skipped: int,
    stop: threading.Event,
    out: queue.Queue,
    executor: concurrent.futures.Executor | _ProcessWorkers | None,
    pools: list[slots.SlotPool],
) -> None:
    """Background thread: schedules this host's blocks in chunks into slots, queues the batches.

    Each block of a global batch (``estimax.data.order``) gets a slot; its chunks go to the
    workers, which write the elements into the slot's rows. The first block, before the
    elements' shapes are known, comes back as elements and sets the layout (``pools[0]``).
    """

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    order = ld.global_order
    start = order.stream_position(epoch, position)
    shared = executor is not None and ld.worker_type == "process"
    chunk = ld.chunk_size
    # Blocks in flight: enough chunks queued to keep every worker busy twice over.
    max_blocks = max(2, -(-2 * max(1, ld.num_workers) * chunk // ld.batch_size) + 1)
    if getattr(ld.source, "read_ahead", False):
        # Object stores: twice the chunks in flight, so each chunk's read has a whole chunk's
        # decoding (and more) to hide behind. Bounded: these blocks' records and slots.
        max_blocks *= 2
    pool: slots.SlotPool | None = None
    # Thread workers: reads start when a chunk is handed out (process workers start their own).
    threads = executor is not None and not isinstance(executor, _ProcessWorkers)
    ahead = _read_ahead_for(ld.source) if threads else None
    pending: collections.deque = collections.deque()  # (block, row, last chunk?, result)
    blocks_in_flight = 0
    k = 0  # next global batch
    skipped = num_skipped
    exhausted = False
    try:
        while not stop.is_set():
            # Start blocks while there are slots (before the layout is known: one block).
            while not exhausted and blocks_in_flight < (max_blocks if pool else 1):
                slot: int | None = None
                if pool is not None:
                    slot = pool.acquire(lambda: out.empty() and not pending)
                    if slot is None:
                        break
                hb = order.host_block(start, k)
                if hb is None:
                    exhausted = True
                    if slot is not None:
                        pool.release(slot)  # type: ignore[union-attr]  # pool is set
                    break
                ids, epochs, nxt = hb
                k += 1
                block = _Block(slot, ids.size, nxt)
                blocks_in_flight += 1
                for c in range(0, ids.size, chunk):
                    id_list = ids[c : c + chunk].tolist()
                    ep_list = epochs[c : c + chunk].tolist()
                    last = c + chunk >= ids.size
                    result: Any
                    if slot is None:
                        args: tuple = (_run_chunk, ep_list, id_list)
                    else:
                        assert pool is not None
                        dest: Any = pool.name(slot) if shared else pool.arrays(slot)
                        args = (_fill_chunk, ep_list, id_list, c, dest, pool.layout)
                    fn: Callable[..., Any] = args[0]
                    fn_args = args[1:]
                    if executor is None:
                        result = fn(*fn_args, ld.source, ld.transform, ld.seed)
                    elif isinstance(executor, _ProcessWorkers):  # it has source and transform
                        result = executor.submit(fn, *fn_args)
                    else:
                        result = executor.submit(
                            fn,
                            *fn_args,
                            ld.source,
                            ld.transform,
                            ld.seed,
                            read=ahead.start(id_list) if ahead is not None else None,
                        )
                    pending.append((block, c, last, result))
            if not pending:
                if exhausted:
                    break
                continue  # waiting for a slot the consumer still holds
            block, row, last, result = pending.popleft()
            got = result if isinstance(result, list) else result.result()
            if block.slot is None:
                block.elements.extend(got)
            else:
                block.bad.update(got)
            if not last:
                continue
            blocks_in_flight -= 1
            if block.slot is None:
                pool = _first_block_into_slot(ld, block, shared, max_blocks)
                if pool is not None:
                    pools.append(pool)
            if block.slot is None:  # nothing good in it: no layout yet
                _, num_bad = _settle_bad(block.elements, ld.skip_bad_records, ld.drop_remainder)
                skipped += num_bad
                continue
            assert pool is not None
            rows, num_bad = _settle_bad_rows(pool, block, ld.skip_bad_records, ld.drop_remainder)
            skipped += num_bad
            if rows == 0:  # a one-pass input's block of nothing but skipped records
                pool.release(block.slot)
                continue
            batch = pool.batch(block.slot, rows)
            e_next, p_next = order.epoch_position(block.next_start)
            if not put((batch, (e_next, p_next, skipped))):
                return
        if stop.is_set():
            return
        put(_End(skipped))
    except BaseException as e:  # noqa: BLE001 - delivered to the consumer's next()
        put(e)
    finally:
        # Work not yet done is dropped (the slots are the iterator's pool's, closed with it).
        for _, _, _, result in pending:
            if not isinstance(result, list):
                result.cancel()
        if ahead is not None:
            ahead.close()


def _first_block_into_slot(
    ld: Loader, block: _Block, shared: bool, max_blocks: int
) -> slots.SlotPool | None:
    """Makes the slot pool from the first good element and moves the block into a slot."""
    good = [el for el in block.elements if not isinstance(el, _BadElement)]
    if not good:
        return None
    layout = slots.Layout(good[0], ld.batch_size)
    pool = slots.SlotPool(layout, shared, limit=max_blocks + ld.prefetch + 1)
    slot = pool.acquire(lambda: True)
    assert slot is not None  # a new pool has room
    dests = pool.arrays(slot)
    for row, el in enumerate(block.elements):
        if isinstance(el, _BadElement):
            block.bad[row] = el
        else:
            try:
                slots.write_rows(dests, layout, row, el)
            except ValueError as e:  # a ragged element: say where it is
                pool.close()
                raise ValueError(f"example {row} of the first batch: {e}") from None
    block.slot, block.elements = slot, []
    return pool


def _settle_bad_rows(
    pool: slots.SlotPool, block: _Block, skip: bool, fixed_size: bool
) -> tuple[int, int]:
    """:func:`_settle_bad` on a slot's rows: returns (rows in the batch, bad records)."""
    if not block.bad:
        return block.size, 0
    assert block.slot is not None
    marks: list[Any] = [
        block.bad.get(row, row) for row in range(block.size)
    ]  # a row's own index where it is good
    settled, num_bad = _settle_bad(marks, skip, fixed_size)
    arrays = pool.arrays(block.slot)
    for leaf in arrays:
        # Rows move only towards the front or copy a good row: gather then write.
        leaf[: len(settled)] = leaf[np.asarray(settled, dtype=np.int64)]
    return len(settled), num_bad


def _settle_bad(elements: list[Any], skip: bool, fixed_size: bool) -> tuple[list[Any], int]:
    """A block's elements with its bad records dealt with; and how many there were.

    Without ``skip`` the first bad record raises. With it, a one-pass input (``fixed_size``
    False: evaluation) drops them, and its batch is smaller. A training input must keep
    ``batch_size`` elements on every host, in the global order, with no host knowing about the
    others' bad records: each bad element is replaced by the nearest good one before it in this
    host's block (after it, for the first), deterministically. A block with no good record at all
    cannot be filled and raises.
    """
    bad = [k for k, el in enumerate(elements) if isinstance(el, _BadElement)]
    if not bad:
        return elements, 0
    if not skip:
        first = elements[bad[0]]
        raise BadRecordError(first.where, first.problem)
    for k in bad:
        log.warning("skipping bad record (skip_bad_records): %s", elements[k].message)
    if not fixed_size:
        return [el for el in elements if not isinstance(el, _BadElement)], len(bad)
    good_at = [k for k, el in enumerate(elements) if not isinstance(el, _BadElement)]
    if not good_at:
        first = elements[bad[0]]
        raise BadRecordError(
            first.where,
            f"{first.problem} (and every other record of this host's block of the global batch "
            "is bad: nothing to fill the batch with)",
        )
    filled = list(elements)
    for k in bad:
        before = [g for g in good_at if g < k]
        filled[k] = elements[before[-1] if before else good_at[0]]
    return filled, len(bad)
