"""Record sources: random access to the records the :class:`~estimax.data.loader.Loader` reads.

A source is anything with ``len``, ``source[i] -> bytes`` and ``describe(i)`` (where record ``i``
lives, for error messages); :class:`TFRecordSource` is the TFRecord one, ``estimax.data.bigtable``
another. The errors here are what a worker reports: :class:`BadRecordError` for one record that
cannot be read or transformed (skippable), :class:`SourceError` for a source that cannot be read
at all (never skipped).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, overload

import numpy as np

from estimax import storage
from estimax.data import shard_index, tfrecord

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


def _common_pattern(paths: Sequence[str]) -> str:
    """A glob matching ``paths`` for the command line the log suggests: their common prefix."""
    prefix = os.path.commonprefix(list(paths))
    return prefix if len(paths) == 1 else prefix + "*"


def _say_what_is_indexed(
    missing: Sequence[str],
    stale: int,
    total: int,
    nbytes: int,
    num_hosts: int,
    kept_in: str | None = None,
) -> None:
    """The one line at start: shards without a usable index, what reading them costs, and the
    command that writes their indexes once."""
    remote = any(storage.is_remote(p) for p in missing)
    share = f", split across {num_hosts} hosts" if num_hosts > 1 and remote else ""
    log.log(
        logging.WARNING if remote else logging.INFO,
        "%d of %d shards have no usable %s index file%s: reading them once to index them "
        "(%.1f MB%s%s); `estimax-convert index '%s'` writes their indexes once for every "
        "later start",
        len(missing),
        total,
        tfrecord.INDEX_SUFFIX,
        f" ({stale} stale, named above)" if stale else "",
        nbytes / 1e6,
        share,
        (
            ", kept on local disk for this run's reads, "
            + (f"their indexes written to {kept_in}" if kept_in else "their indexes kept nowhere")
        )
        if remote
        else "",
        _common_pattern(missing),
    )


class TFRecordSource:
    """The records of several TFRecord files, addressed by one index ``0..len-1`` in file order.

    Record offsets come from each file's index (``.estimax-index/<file>.idx`` beside it: the
    converters write them, ``estimax-convert index`` writes them for existing shards; looked up
    as ``shard_index.index_candidates`` lists, an earlier version's ``<file>.idx`` included),
    checked against the file (a stale or cut index is named in one line and rebuilt, never
    trusted: no record is dropped).
    Files without a usable index are indexed at construction, which is logged in one line
    naming how many, the bytes it reads and the command that writes their indexes once: local
    files by a scan of their headers; object-store files (``gs://``, ``s3://``) by reading each
    once, several at a time (``estimax.data.shard_index``), writing its index into ``index_dir``
    (``write_indexes``; never into the data folder it reads unless ``index_beside_data``) and
    keeping its bytes on local disk (``keep_copies``) so that this
    run's reads of its records pull nothing again. With ``num_hosts`` > 1 each host reads its
    share of them and takes the others' indexes as they appear: N hosts read the shards once
    in all.

    Args:
      files: TFRecord paths, in the order they are addressed.
      verify_crc: check the CRCs of every record read.
      skip_bad_records: a file whose scan hits damage (truncated, bad length CRC) keeps the
        records before the damage and counts one skipped record (``num_skipped_at_open``),
        instead of raising ``CorruptRecordError``.
      write_indexes: write the index of an object-store shard that had none (in ``index_dir``,
        or beside it with ``index_beside_data``; with neither, nowhere).
      keep_copies: keep the bytes of object-store shards read to index them on local disk for
        this source's reads (while the disk keeps a tenth, at least 2 GiB, free); removed when
        the source is garbage-collected or the process exits.
      cache_dir: where those copies go (default: the system's temporary directory).
      host_index, num_hosts: this host and how many share the indexing.
      index_dir: a folder every host of the job reads and writes (local or a bucket, the
        programs give ``<model_dir>/shard_indexes``) where the indexes this job builds go, and
        are found again at the next start (``shard_index.index_path_in``).
      index_beside_data: write them into the hidden folder beside the shards
        (``<data_dir>/.estimax-index``, which a TensorFlow job's ``train-*`` never matches;
        ``index_dir`` where that folder cannot be written) instead: a job never writes into a
        folder it was only asked to read unless told so.
    """

    def __init__(
        self,
        files: Sequence[str],
        verify_crc: bool = True,
        skip_bad_records: bool = False,
        *,
        write_indexes: bool = True,
        keep_copies: bool = True,
        cache_dir: str | None = None,
        host_index: int = 0,
        num_hosts: int = 1,
        index_dir: str | None = None,
        index_beside_data: bool = False,
    ):
        if not files:
            raise ValueError("TFRecordSource needs at least one file")
        self.files = list(files)
        self.num_skipped_at_open = 0
        opened = _open_all(self.files, verify_crc, index_dir)
        missing = [p for p, (rf, _, _) in zip(self.files, opened, strict=True) if rf is None]
        stale = [why for rf, _, why in opened if rf is None and why != "missing"]
        for why in stale:
            log.warning("%s", why)
        by_path: dict[str, tfrecord.RecordFile] = {
            p: rf for p, (rf, _, _) in zip(self.files, opened, strict=True) if rf is not None
        }
        if missing:
            sizes = dict(zip(self.files, (size for _, size, _ in opened), strict=True))
            kept_in = None
            if write_indexes and index_beside_data:
                kept_in = f"{tfrecord.INDEX_DIR_NAME} beside them"
            elif write_indexes and index_dir:
                kept_in = index_dir
            _say_what_is_indexed(
                missing,
                len(stale),
                len(self.files),
                sum(sizes[p] for p in missing),
                num_hosts,
                kept_in,
            )
            by_path.update(
                self._index(
                    missing,
                    verify_crc,
                    skip_bad_records,
                    write_indexes,
                    keep_copies,
                    cache_dir,
                    host_index,
                    num_hosts,
                    index_dir,
                    index_beside_data,
                )
            )
        self._record_files = [by_path[p] for p in self.files]
        counts = np.asarray([len(rf) for rf in self._record_files], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        # On object stores a worker reads the records of the chunks it was given ahead of
        # decoding them, each chunk in one concurrent call (read_many).
        self.read_ahead = any(rf.is_remote for rf in self._record_files)

    def _index(
        self,
        missing: list[str],
        verify_crc: bool,
        skip_bad_records: bool,
        write_indexes: bool,
        keep_copies: bool,
        cache_dir: str | None,
        host_index: int,
        num_hosts: int,
        index_dir: str | None = None,
        index_beside_data: bool = False,
    ) -> dict[str, tfrecord.RecordFile]:
        """RecordFiles of the shards without a usable index (see the class docstring)."""
        out: dict[str, tfrecord.RecordFile] = {}
        remote = [p for p in missing if storage.is_remote(p)]
        for path in missing:
            if path in remote:
                continue
            try:  # a local file: its headers, one pread each
                out[path] = tfrecord.RecordFile(path, index_path="", verify_crc=verify_crc)
            except tfrecord.CorruptRecordError as e:
                if not skip_bad_records:
                    raise
                out[path] = _partial_record_file(path, e, verify_crc)
                self.num_skipped_at_open += 1
                log.warning("skipping the damaged rest of %s (skip_bad_records): %s", path, e)
        if not remote:
            return out
        files, results, copy_dir = shard_index.index_for_job(
            remote,
            verify_crc=verify_crc,
            write=write_indexes,
            keep_copies=keep_copies,
            cache_dir=cache_dir,
            host_index=host_index,
            num_hosts=num_hosts,
            keep_partial=True,
            index_dir=index_dir,
            beside=index_beside_data,
        )
        if copy_dir is not None:
            # The copies live as long as this source (worker processes get pickled copies of
            # it, which have no finalizer: the loader stops them before the source goes).
            weakref.finalize(self, shutil.rmtree, copy_dir, True)
        for r in results:
            if r.error is None:
                continue
            if not skip_bad_records:
                raise r.error
            self.num_skipped_at_open += 1
            log.warning("skipping the damaged rest of %s (skip_bad_records): %s", r.path, r.error)
        out.update(files)
        return out

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


def _open_all(
    files: Sequence[str], verify_crc: bool, index_dir: str | None = None
) -> list[tuple[tfrecord.RecordFile | None, int, str]]:
    """``shard_index.open_indexed`` of every file, several at once (on an object store each is
    a few requests: one after another, 1,024 shards at 20 ms would take a minute)."""
    if len(files) == 1 or not any(storage.is_remote(f) for f in files):
        return [shard_index.open_indexed(f, verify_crc, index_dir) for f in files]
    with concurrent.futures.ThreadPoolExecutor(min(16, len(files)), "estimax-open-index") as pool:
        return list(pool.map(lambda f: shard_index.open_indexed(f, verify_crc, index_dir), files))
