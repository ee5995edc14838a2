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
does in-process (bench/results/input_pipeline.md, ``host``). ``auto`` takes processes when both the
usable cores and the workers number 4 or more, else threads (no worker start-up, no
``__main__`` guard needed).

Where each part lives:

============================= =============================================================
``estimax.data.sources``      record sources (``TFRecordSource``), ``host_shard``, the errors
``estimax.data.order``        the global order: the records of each host's block of a batch
``estimax.data.chunks``       the work of one chunk (read, transform, write rows), its tasks
``estimax.data.workers``      threads or processes, their protocol, ``worker_policy``
``estimax.data.read_ahead``   object-store reads started ahead of decoding
``estimax.data.slots``        batch slots (shared memory for processes)
``estimax.data.produce``      the background thread: blocks into slots, bad records, batches
``estimax.data.loader_state`` the saved position (``get_state``/``set_state``)
``estimax.data.loader_settings`` the Loader's checked settings, which the two above read
============================= =============================================================
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from estimax.data import loader_state, slots
from estimax.data.chunks import ChunkWorker
from estimax.data.loader_settings import LoaderSettings
from estimax.data.produce import End, produce
from estimax.data.sources import (
    BadRecordError,
    RecordSource,
    SourceError,
    TFRecordSource,
    host_shard,
)
from estimax.data.workers import Workers, start_workers, usable_cores, worker_policy

__all__ = [
    "BadRecordError",
    "Loader",
    "LoaderIterator",
    "RecordSource",
    "SourceError",
    "TFRecordSource",
    "host_shard",
    "usable_cores",
    "worker_policy",
]


class Loader(LoaderSettings):
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
        guard, as with ``spawn``) or ``"auto"`` (default: what :func:`worker_policy` says,
        processes from 4 usable cores and 4 workers on, else threads; logged).
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

    def __iter__(self) -> LoaderIterator:
        return LoaderIterator(self)


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
        self._workers: Workers | None = None
        self._pools: list[slots.SlotPool] = []
        self._done = False

    # -- state ----------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The position after the last batch returned by ``next()``; JSON-serialisable."""
        at = loader_state.Position(self._epoch, self._position, self.num_skipped)
        return loader_state.state_of(self._loader, at)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from ``state`` (from ``get_state`` of an iterator over the same data).

        Raises:
          ValueError: the state belongs to a different dataset (record count) or seed/shuffle.
        """
        at = loader_state.restore(self._loader, state)
        self._shutdown()
        self._epoch, self._position, self.num_skipped = at
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
        if isinstance(item, End):
            self.num_skipped = item.num_skipped  # bad records after the last batch count too
        if isinstance(item, (End, BaseException)):
            self._done = True
            # Not waiting for worker processes to exit: that would add their shutdown time
            # (~1 s) to the end of every eval pass.
            self._shutdown(wait=False)
            if isinstance(item, BaseException):
                raise item
            raise StopIteration
        self._epoch, self._position, self.num_skipped = item.epoch, item.position, item.num_skipped
        return item.batch

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
        worker = ChunkWorker(ld.source, ld.transform, ld.seed)
        self._workers = start_workers(ld.num_workers, ld.worker_type, worker)
        # The thread gets the loader, not this iterator, so an iterator dropped without close()
        # can be garbage-collected, and its __del__ stops the thread and the workers.
        self._thread = threading.Thread(
            target=produce,
            args=(
                ld,
                self._epoch,
                self._position,
                self.num_skipped,
                self._stop,
                self._queue,
                self._workers,
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
        if self._workers is not None:
            self._workers.shutdown(wait=wait)
            self._workers = None
        for pool in self._pools:
            pool.close()
        self._pools = []
