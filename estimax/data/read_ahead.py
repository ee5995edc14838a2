"""Read-ahead: a chunk's records are read before its turn to be decoded, so object-store latency
overlaps the decoding of earlier chunks.

A source that sets ``read_ahead`` (``TFRecordSource`` of ``gs://``/``s3://`` files) gets it: each
chunk's records are read in one ``read_many`` call on a few I/O threads. Thread workers queue a
chunk's read when the loader hands the chunk out; a process worker queues it the moment the
chunk reaches the worker. Reads begin in that order, at most ``depth`` of them begun and not yet
taken by their chunk's decoding (:class:`ReadAhead`): the read-ahead is a window of ``depth``
chunks, not every chunk in flight.

Why a window: the loader used to keep twice the chunks in flight on object stores and read every
chunk the moment it was handed out, so a run read all of them whether or not it used them: with
process workers (chunks of 32) 6 batches of 64 ahead, 1.20x the bytes of a 1,920-image epoch at
any latency (``bench/results/input_pipeline.md``, ``gcs``), and each restart of the input
(``set_state``, a new ``train`` call) threw that away and read it again. Now what is read and not
decoded is at most ``depth`` chunks, and what is decoded and not used at most the blocks in
flight (:func:`blocks_in_flight`, no longer doubled), whatever the latency; latency still
overlaps decoding while ``depth`` chunks' reads take no longer than decoding a chunk per worker.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading

from estimax.data.sources import RecordSource

__all__ = ["CHUNKS_PER_WORKER", "ReadAhead", "blocks_in_flight", "read_ahead_for"]


class _Read:
    """One chunk's read: its records' ids, and the future of ``read_many`` once begun."""

    __slots__ = ("ids", "future", "begun", "taken")

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.begun = False
        self.taken = False


class ReadAhead:
    """Reads chunks' records on I/O threads, a window of ``depth`` chunks ahead of decoding.

    ``start(ids)`` queues ``source.read_many(ids)`` and returns what gives the records (or raises
    the read's error); calling it takes the chunk out of the window. Reads begin in the order
    queued while fewer than ``depth`` are begun and not taken; a chunk whose decoding comes
    first begins its own read then.
    """

    def __init__(self, source: RecordSource, depth: int, threads: int = 4):
        self._read_many = source.read_many  # type: ignore[attr-defined]  # read_ahead sources
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "estimax-read-ahead")
        self.depth = max(1, depth)
        self._lock = threading.Lock()
        self._queued: collections.deque[_Read] = collections.deque()
        self._open = 0  # begun and not yet taken
        self._closed = False

    @property
    def in_window(self) -> int:
        """Reads begun and not yet taken by their chunk's decoding (at most ``depth``, plus
        chunks whose decoding came first)."""
        with self._lock:
            return self._open

    def start(self, ids: list[int]) -> functools.partial[list]:
        """Queues reading records ``ids``; the returned call waits for them."""
        read = _Read(list(ids))
        with self._lock:
            self._queued.append(read)
            self._fill()
        return functools.partial(self._take, read)

    def _take(self, read: _Read) -> list:
        with self._lock:
            if not read.begun and not read.future.done():  # its turn came before the window's
                self._queued.remove(read)
                self._begin(read)
        try:
            return read.future.result()
        finally:
            with self._lock:
                if not read.taken:
                    read.taken = True
                    self._open -= 1
                    self._fill()

    def _fill(self) -> None:
        """Begins queued reads while the window has room (the lock is held)."""
        while self._queued and self._open < self.depth:
            self._begin(self._queued.popleft())

    def _begin(self, read: _Read) -> None:
        read.begun = True
        self._open += 1
        if self._closed:
            read.future.set_exception(RuntimeError("the read-ahead is closed"))
            return
        try:
            self._pool.submit(self._run, read)
        except RuntimeError as e:
            # The pool is shut down: at interpreter exit concurrent.futures shuts every pool down
            # while the loader's threads still decode. The read fails, as a closed one does;
            # left unset, its chunk's decoding would wait for it forever and hang the exit.
            read.future.set_exception(e)

    def _run(self, read: _Read) -> None:
        try:
            read.future.set_result(self._read_many(read.ids))
        except BaseException as e:  # noqa: BLE001 - delivered to the chunk's decoding
            read.future.set_exception(e)

    def close(self) -> None:
        """Drops the reads not yet begun; does not wait for those under way."""
        with self._lock:
            self._closed = True
            for read in self._queued:
                read.future.cancel()
            self._queued.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


# The window: per worker it feeds, the chunk it decodes next and one more (measured at 20 ms a
# request: as fast as reading every chunk in flight at once, bench/results/input_pipeline.md).
CHUNKS_PER_WORKER = 2


def read_ahead_for(source: RecordSource, workers: int) -> ReadAhead | None:
    """A :class:`ReadAhead` for ``workers`` workers' chunks (a window of
    ``CHUNKS_PER_WORKER`` chunks each) when ``source.read_ahead``, else None."""
    if not getattr(source, "read_ahead", False):
        return None
    return ReadAhead(source, CHUNKS_PER_WORKER * max(1, workers))


def blocks_in_flight(source: RecordSource, enough_for_the_workers: int) -> int:
    """How many blocks of batches the loader keeps in flight over ``source``: what keeps the
    workers busy, on object stores too (the read-ahead window hides the latency; more blocks
    would only hold more memory and read more that a run may not use)."""
    del source
    return enough_for_the_workers
