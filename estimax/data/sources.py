"""Record sources: random access to the records the :class:`~estimax.data.loader.Loader` reads.

A source is anything with ``len``, ``source[i] -> bytes`` and ``describe(i)`` (where record ``i``
lives, for error messages); :class:`TFRecordSource` is the TFRecord one, ``estimax.data.bigtable``
another. The errors here are what a worker reports: :class:`BadRecordError` for one record that
cannot be read or transformed (skippable), :class:`SourceError` for a source that cannot be read
at all (never skipped).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, overload

import numpy as np

from estimax.data import tfrecord

__all__ = [
    "BadRecordError",
    "RecordSource",
    "SourceError",
    "TFRecordSource",
    "host_shard",
]

log = logging.getLogger(__name__)

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


def _say_what_was_scanned(record_files: list[tfrecord.RecordFile]) -> None:
    """One line when files had no index file and were read to find their records."""
    scanned = [rf for rf in record_files if rf.index_path is None]
    if not scanned:
        return
    remote = any(rf.is_remote for rf in scanned)
    log.log(
        logging.WARNING if remote else logging.INFO,
        "indexed %d of %d files by reading them (no %s index file beside them, e.g. %s)%s; "
        "estimax-convert writes index files with its shards, estimax.data.write_index(path) "
        "for others",
        len(scanned),
        len(record_files),
        tfrecord.INDEX_SUFFIX,
        tfrecord.default_index_path(scanned[0].path),
        ": every host reads each such file whole before its first batch" if remote else "",
    )


class TFRecordSource:
    """The records of several TFRecord files, addressed by one index ``0..len-1`` in file order.

    Record offsets come from each file's index (``<file>.idx``: the converters write them, see
    ``tfrecord.write_index``) or, without one, from a scan of the file's headers at construction
    (cheap for local files; on ``gs://`` each file is read whole), which is logged once, naming
    how many files had no index.

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
        _say_what_was_scanned(self._record_files)
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
