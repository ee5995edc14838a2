"""Read-ahead: a chunk's records are read before its turn to be decoded, so object-store latency
overlaps the decoding of earlier chunks.

A source that sets ``read_ahead`` (``TFRecordSource`` of ``gs://``/``s3://`` files) gets it: the
reads of every chunk in flight run on a few I/O threads, each chunk in one ``read_many`` call,
and the loader keeps twice the chunks in flight (:func:`blocks_in_flight`). Thread workers start
a chunk's read when the loader hands the chunk out; a process worker starts it the moment the
chunk reaches the worker. What is read ahead is bounded by the chunks in flight.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from estimax.data.sources import RecordSource

__all__ = ["ReadAhead", "blocks_in_flight", "read_ahead_for"]


class ReadAhead:
    """Reads chunks' records on I/O threads: ``start(ids)`` begins ``source.read_many(ids)`` and
    returns what gives the records (or raises the read's error)."""

    def __init__(self, source: RecordSource, threads: int = 4):
        self._read_many = source.read_many  # type: ignore[attr-defined]  # read_ahead sources
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "estimax-read-ahead")

    def start(self, ids: list[int]) -> Callable[[], list]:
        """Begins reading records ``ids``; the returned call waits for them."""
        return self._pool.submit(self._read_many, ids).result

    def close(self) -> None:
        """Drops the reads not yet started; does not wait for those under way."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def read_ahead_for(source: RecordSource) -> ReadAhead | None:
    """A :class:`ReadAhead` for a source that wants one (``source.read_ahead``), else None."""
    return ReadAhead(source) if getattr(source, "read_ahead", False) else None


def blocks_in_flight(source: RecordSource, enough_for_the_workers: int) -> int:
    """How many blocks of batches the loader keeps in flight over ``source``.

    Object stores: twice what keeps the workers busy, so each chunk's read has a whole chunk's
    decoding (and more) to hide behind. Bounded: these blocks' records and slots.
    """
    if getattr(source, "read_ahead", False):
        return 2 * enough_for_the_workers
    return enough_for_the_workers
