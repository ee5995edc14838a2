"""Index files for TFRecord shards that have none: each shard read once, front to back.

Shards written by TensorFlow's tools have no ``.idx`` beside them. Finding their records needs
every record's 12-byte header, and each header's place is known only from the one before it, so
on an object store the headers alone are a chain of one request per record: ~2,000 records of
~49 KB in a 100 MB shard at 20 ms a request are 41 s, against 13 ranged requests of 8 MiB (a
fraction of a second of latency) to stream the whole shard. Streaming wins unless records are
several MiB each; this module streams (``bench/results/index_shards.md`` has the figures).

What reads a shard whole should not have to read it again: :func:`index_shard` can keep the bytes
it streamed in a local file (``copy_to``) and write its index (``write``), and
:func:`index_for_job` (what :class:`~estimax.data.sources.TFRecordSource` does for shards without
a usable index) does both, splitting the shards across hosts so that N hosts read the data set
once in all, not N times. ``estimax-convert index`` (``estimax.tools.convert``) is the command
that writes the indexes once for every later start.

Where indexes go, so that no glob of the shards' names (TensorFlow's ``train-*``) ever matches
one: the converters and ``estimax-convert index`` write ``<folder>/.estimax-index/<shard>.idx``
(a hidden folder beside the shards), or, given an index folder, ``<index_dir>/<digest>-<shard>.idx``
(:func:`index_path_in`); a job writes only into its own ``<model_dir>/shard_indexes``, never into
a data folder it was asked to read, unless told to (``beside``). A reader looks in this order
(:func:`index_candidates`): an explicit index folder, the hidden folder, the job's index folder,
and ``<shard>.idx`` (written by earlier versions; still read).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from estimax import storage
from estimax.data import tfrecord

__all__ = [
    "Indexed",
    "find_index",
    "index_candidates",
    "index_for_job",
    "index_path_for",
    "index_path_in",
    "index_shard",
    "index_shards",
    "open_indexed",
    "scan_shard",
    "write_index",
]

log = logging.getLogger(__name__)

# One ranged request per 8 MiB of a shard: its latency (~20 ms) is then a few percent of the
# transfer (at ~1 Gbit/s per connection, 8 MiB take ~70 ms), and memory per shard stays small.
BLOCK_SIZE = 8 * 1024 * 1024
# Shards streamed at once: enough connections to fill a host's bandwidth, few enough not to
# exhaust the client's pool (gcsfs/aiohttp keep 100 per host).
CONNECTIONS = 8


@dataclasses.dataclass
class Indexed:
    """What indexing one shard found.

    Attributes:
      path: the shard.
      offsets: [N + 1] int64 record offsets (the records before ``error`` when it stopped).
      identity: the shard's size and version when it was read.
      bytes_read: bytes pulled from the shard (its size, or up to the damage).
      index_path: the index file written, or None.
      local_copy: a local file holding the shard's bytes, or None.
      error: the damage that stopped the scan (truncated record, bad CRC), or None.
      write_error: why the index could not be written, or None.
      beside_error: why it could not be written in the shards' folder when it went to the job's
        ``index_dir`` instead, or None.
    """

    path: str
    offsets: np.ndarray
    identity: dict[str, Any]
    bytes_read: int
    index_path: str | None = None
    local_copy: str | None = None
    error: tfrecord.CorruptRecordError | None = None
    write_error: str | None = None
    beside_error: str | None = None


def scan_shard(
    path: str,
    verify_crc: bool = False,
    sink: Callable[[bytes], Any] | None = None,
    on_bytes: Callable[[int], Any] | None = None,
) -> tuple[np.ndarray, dict[str, Any], int]:
    """Finds every record of one TFRecord file by reading it once, front to back.

    Object stores: ranged requests of ``BLOCK_SIZE`` one after another (one connection). Local
    files without ``verify_crc`` or ``sink``: a pread of each 12-byte header, nothing else.

    Args:
      path: the shard (any fsspec path).
      verify_crc: check every record's data CRC on the way.
      sink: given every block read, in order (e.g. a local file's ``write``).
      on_bytes: given the size of every block read (progress).

    Returns:
      ``(offsets, identity, bytes_read)``: [N + 1] int64 offsets, the shard's size and version
      as it was before the read, and the bytes read.

    Raises:
      CorruptRecordError: a bad length CRC, a truncated record, or (``verify_crc``) a bad data
        CRC; names the shard and the record's offset.
    """
    fs, fs_path = tfrecord._fs_and_path(path)  # noqa: SLF001 - the same package
    local = tfrecord._is_local(fs)  # noqa: SLF001
    identity = tfrecord._identity(fs, fs_path)  # noqa: SLF001
    size = int(identity["size"])
    if local and not verify_crc and sink is None:
        return tfrecord.record_offsets(path, verify_crc=False), identity, size
    fd = os.open(fs_path, os.O_RDONLY) if local else -1
    try:

        def fetch(start: int) -> bytes:
            end = min(start + BLOCK_SIZE, size)
            if local:
                return os.pread(fd, end - start, start)
            return fs.cat_file(fs_path, start=start, end=end)

        offsets, read = _scan(path, size, fetch, verify_crc, sink, on_bytes)
    finally:
        if local:
            os.close(fd)
    return offsets, identity, read


def _scan(
    path: str,
    size: int,
    fetch: Callable[[int], bytes],
    verify_crc: bool,
    sink: Callable[[bytes], Any] | None,
    on_bytes: Callable[[int], Any] | None,
) -> tuple[np.ndarray, int]:
    """The record offsets of a ``size``-byte file read in order by ``fetch(start)``."""
    buf = bytearray()  # the file's bytes from buf_start; buf_start + len(buf) == read_to
    buf_start = read_to = pos = 0  # pos: where the next record's header starts
    offsets: list[int] = []
    header_size, footer_size = tfrecord._HEADER_SIZE, tfrecord._FOOTER_SIZE  # noqa: SLF001

    def more() -> bool:
        nonlocal read_to
        if read_to >= size:
            return False
        block = fetch(read_to)
        if not block:  # the file shrank under us
            raise tfrecord.ShardChangedError(path, f"ends at byte {read_to}, not {size}")
        if sink is not None:
            sink(block)
        if on_bytes is not None:
            on_bytes(len(block))
        buf.extend(block)
        read_to += len(block)
        return True

    def trim() -> None:
        # Only the bytes from the next header on are kept: memory is a block or a record.
        nonlocal buf_start
        drop = min(pos - buf_start, len(buf))
        del buf[:drop]
        buf_start += drop

    try:
        while pos < size:
            while read_to < min(pos + header_size, size) and more():
                pass
            at = pos - buf_start
            header = bytes(buf[at : at + header_size])
            length = tfrecord._check_header(header, path, pos)  # noqa: SLF001
            end = pos + header_size + length + footer_size
            if end > size:
                tfrecord._check_footer(path, pos, length, size - pos - header_size)  # noqa: SLF001
            if verify_crc:
                while read_to < end and more():
                    pass
                frame = bytes(buf[at + header_size : end - buf_start])
                tfrecord._check_footer(  # noqa: SLF001
                    path, pos, length, length + footer_size, frame[:length], frame[length:]
                )
            offsets.append(pos)
            pos = end
            trim()
            while read_to < pos and more():  # data not needed: streamed on (for the sink)
                trim()
        while more():  # nothing past the last record, but a sink gets the whole file
            pass
    except tfrecord.CorruptRecordError as e:
        # The records before the damage, for a caller that keeps them (skip_bad_records).
        e.records_before = np.asarray([*offsets, pos], dtype=np.int64)  # type: ignore[attr-defined]
        raise
    offsets.append(size)
    return np.asarray(offsets, dtype=np.int64), read_to


def index_shard(
    path: str,
    index_path: str | None = None,
    *,
    verify_crc: bool = False,
    write: bool = True,
    copy_to: str | None = None,
    on_bytes: Callable[[int], Any] | None = None,
    keep_partial: bool = False,
    index_dir: str | None = None,
) -> Indexed:
    """Reads one shard once and writes its index (with the shard's size and version).

    Args:
      path: the shard.
      index_path: where the index goes; default :func:`index_path_for` ``(path, index_dir)``.
      index_dir: the index folder: where the index goes (:func:`index_path_in` of it) unless
        ``index_path`` is given; with ``index_path``, where it goes when ``index_path`` cannot be
        written (a read-only bucket).
      verify_crc: check every record's data CRC on the way.
      write: write the index (else only return the offsets). A write that fails is reported in
        ``write_error``, not raised, when ``keep_partial``.
      copy_to: a local file to keep the shard's bytes in (for reading its records without
        pulling them again).
      on_bytes: progress, as in :func:`scan_shard`.
      keep_partial: on damage, return the records before it (``error`` set, no index written)
        instead of raising.

    Raises:
      CorruptRecordError: the shard is damaged (unless ``keep_partial``).
      StorageError/OSError: the index cannot be written (unless ``keep_partial``).
    """
    fallback_dir = index_dir if index_path else None
    index_path = index_path or index_path_for(path, index_dir)
    out = open(copy_to, "wb") if copy_to else None  # noqa: SIM115 - closed below
    error: tfrecord.CorruptRecordError | None = None
    try:
        try:
            offsets, identity, read = scan_shard(
                path, verify_crc, out.write if out else None, on_bytes
            )
        except tfrecord.CorruptRecordError as e:
            if not keep_partial:
                raise
            error = e
            identity = {"size": e.offset}
            offsets = getattr(e, "records_before", np.asarray([0], dtype=np.int64))
            read = e.offset
    finally:
        if out is not None:
            out.close()
    done = Indexed(path, offsets, identity, read, local_copy=copy_to)
    done.error = error
    if write and error is None:
        text = tfrecord._index_text(offsets, identity)  # noqa: SLF001
        try:
            with storage.errors_named(index_path, "write it"):
                tfrecord._put_text(index_path, text)  # noqa: SLF001
            done.index_path = index_path
        except (OSError, storage.StorageError) as e:
            if fallback_dir is None:
                if not keep_partial:
                    raise
                done.write_error = str(e)
                return done
            elsewhere = index_path_in(fallback_dir, path)
            try:
                with storage.errors_named(elsewhere, "write it"):
                    tfrecord._put_text(elsewhere, text)  # noqa: SLF001
                done.index_path = elsewhere
                done.beside_error = str(e)
            except (OSError, storage.StorageError) as e2:
                if not keep_partial:
                    raise
                done.write_error = f"{e}; and {e2}"
    return done


def write_index(path: str, index_path: str | None = None, verify_crc: bool = False) -> str:
    """Writes the index file of a TFRecord file: one ``"<offset> <length>"`` line per record.

    This is the text format of NVIDIA DALI's ``tfrecord2idx`` (offset of the record and its total
    framed size), so the same index files serve DALI readers too, followed by one comment line
    ``# estimax-index size=<bytes> version=<generation, ETag or mtime>`` naming the version of the
    shard it indexes, so that a reader can tell a stale index
    (:func:`~estimax.data.tfrecord.index_problem`). The shard is read once, front to back
    (:func:`index_shard`: large ranged requests on object stores).

    Args:
      path: the TFRecord file.
      index_path: where to write; default :func:`~estimax.data.tfrecord.default_index_path`
        (``<folder>/.estimax-index/<name>.idx``).
      verify_crc: also verify every record's data CRC while indexing.

    Returns:
      The index path written.
    """
    done = index_shard(path, index_path, verify_crc=verify_crc)
    assert done.index_path is not None  # written, or index_shard raised
    return done.index_path


def index_path_for(path: str, index_dir: str | None = None) -> str:
    """Where estimax writes the index of shard ``path``: in ``index_dir`` when given
    (:func:`index_path_in`), else in the hidden folder beside the shard
    (``<folder>/.estimax-index/<name>.idx``). Never a name a glob of the shards matches."""
    if index_dir:
        return index_path_in(index_dir, path)
    return tfrecord.hidden_index_path(path)


def index_candidates(
    path: str, index_dir: str | None = None, explicit_dir: str | None = None
) -> list[str]:
    """Where the index of shard ``path`` may be, in the order a reader looks: ``explicit_dir``
    (a folder the user named, ``estimax-convert index --index_dir``), the hidden folder beside
    the shard, ``index_dir`` (the job's ``<model_dir>/shard_indexes``), and ``<shard>.idx``
    (where earlier versions wrote it)."""
    found = [index_path_in(explicit_dir, path)] if explicit_dir else []
    found.append(tfrecord.hidden_index_path(path))
    if index_dir and index_dir != explicit_dir:
        found.append(index_path_in(index_dir, path))
    found.append(tfrecord.legacy_index_path(path))
    return found


def index_path_in(index_dir: str, path: str) -> str:
    """Where the index of shard ``path`` lies in ``index_dir`` (for shards whose own folder
    cannot be written): the shard's name after a digest of its whole path, so that shards of
    several data sets, or of two folders with the same names, never share one."""
    digest = hashlib.sha1(path.rstrip("/").encode("utf-8", "surrogateescape")).hexdigest()[:16]
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return f"{index_dir.rstrip('/')}/{digest}-{name}{tfrecord.INDEX_SUFFIX}"


def index_shards(
    paths: Sequence[str],
    *,
    connections: int = CONNECTIONS,
    verify_crc: bool = False,
    write: bool = True,
    copy_dir: str | None = None,
    keep_partial: bool = False,
    on_bytes: Callable[[int], Any] | None = None,
    on_done: Callable[[Indexed], Any] | None = None,
    index_dir: str | None = None,
    beside: bool = False,
) -> list[Indexed]:
    """:func:`index_shard` of every path, ``connections`` shards streamed at once.

    Args:
      copy_dir: keep each shard's bytes in a local file here while the disk keeps
        :func:`_room_kept` free (shards that do not fit are not kept).
      index_dir: the index folder the indexes go to (:func:`index_path_for`); with ``beside``,
        where those that cannot be written beside their shards go.
      beside: write each index in the hidden folder beside its shard
        (``.estimax-index/<name>.idx``).
      on_done: called with each shard's result as it finishes (any thread).

    Returns:
      The results, in the order of ``paths``.
    """
    room = _Room(copy_dir) if copy_dir else None

    def one(k: int, path: str) -> Indexed:
        copy_to = None
        if room is not None and storage_is_remote(path):
            copy_to = room.take(path, k)
        try:
            done = index_shard(
                path,
                tfrecord.hidden_index_path(path) if beside else None,
                verify_crc=verify_crc,
                write=write,
                copy_to=copy_to,
                on_bytes=on_bytes,
                keep_partial=keep_partial,
                index_dir=index_dir,
            )
        except BaseException:
            if copy_to:
                with contextlib.suppress(OSError):
                    os.remove(copy_to)
            raise
        if on_done is not None:
            on_done(done)
        return done

    if len(paths) <= 1 or connections <= 1:
        return [one(k, p) for k, p in enumerate(paths)]
    with concurrent.futures.ThreadPoolExecutor(
        min(connections, len(paths)), "estimax-index"
    ) as pool:
        return list(pool.map(one, range(len(paths)), paths))


def storage_is_remote(path: str) -> bool:
    """Whether ``path`` is on an object store (not a local file)."""
    return storage.is_remote(path)


def _room_kept(total: int) -> int:
    """Free disk space the local copies leave: a tenth of the disk, at least 2 GiB."""
    return max(total // 10, 2 * 1024**3)


class _Room:
    """Hands out local file names for shard copies while the disk has room for them."""

    def __init__(self, directory: str):
        self.directory = directory
        self._lock = threading.Lock()
        self._reserved = 0
        self._said = False

    def take(self, path: str, k: int) -> str | None:
        fs, fs_path = tfrecord._fs_and_path(path)  # noqa: SLF001
        size = int(fs.size(fs_path))
        usage = shutil.disk_usage(self.directory)
        with self._lock:
            kept = _room_kept(usage.total)
            if usage.free - self._reserved - size < kept:
                if not self._said:  # once: a job of 1,024 shards must not say it 1,024 times
                    self._said = True
                    log.warning(
                        "the local disk of %s is short (%.1f GiB free, and copies of shards "
                        "leave %.1f GiB: a tenth of the disk, at least 2 GiB): %s, and any "
                        "other shard that does not fit, is not kept here, and its records are "
                        "read from the bucket again (point TMPDIR or cache_dir at a larger "
                        "disk to keep them)",
                        self.directory,
                        usage.free / 1024**3,
                        kept / 1024**3,
                        path,
                    )
                return None
            self._reserved += size
        return os.path.join(self.directory, f"{k:06d}-{os.path.basename(fs_path)}")


def find_index(
    path: str, index_dir: str | None = None, explicit_dir: str | None = None
) -> list[str]:
    """Those of :func:`index_candidates` that exist, in their order."""
    found = []
    for candidate in index_candidates(path, index_dir, explicit_dir):
        fs, fs_index = tfrecord._fs_and_path(candidate)  # noqa: SLF001
        fs.invalidate_cache(fs_index)  # another host (or a run just now) may have written it
        if fs.exists(fs_index):
            found.append(candidate)
    return found


def open_indexed(
    path: str, verify_crc: bool, index_dir: str | None = None, explicit_dir: str | None = None
) -> tuple[tfrecord.RecordFile | None, int, str]:
    """The shard with its index, if it has a usable one, looked up in the order of
    :func:`index_candidates`: ``explicit_dir``, the hidden folder beside it, ``index_dir``
    (where a job keeps the indexes it builds), ``<shard>.idx``. The first that fits the shard
    is used: a stale one in a folder the job may not write (the data's) does not hide the
    fresh one it wrote in ``index_dir``.

    Returns:
      ``(record_file, size, why_not)``: the :class:`~estimax.data.tfrecord.RecordFile` (None
      without a usable index), the shard's size, and ``""``, ``"missing"`` or the line naming
      both files when its index is stale or unreadable (the first such one).

    Raises:
      NotRegularFileError: the shard or its index is a local FIFO, device or socket.
    """
    tfrecord.check_regular(path)  # a FIFO would block its first read for ever (#54)
    why = ""
    for index_path in find_index(path, index_dir, explicit_dir):
        try:
            rf = tfrecord.RecordFile(path, index_path=index_path, verify_crc=verify_crc)
        except tfrecord.StaleIndexError as e:
            why = why or str(e)
            continue
        except ValueError as e:  # malformed: as stale, rebuilt
            why = why or f"{index_path} cannot be read ({e}); it is rebuilt"
            continue
        return rf, int(rf._identity["size"]), ""  # noqa: SLF001
    return None, _size(path), why or "missing"


def _size(path: str) -> int:
    fs, fs_path = tfrecord._fs_and_path(path)  # noqa: SLF001
    return int(fs.size(fs_path))


def index_for_job(
    paths: Sequence[str],
    *,
    verify_crc: bool,
    write: bool = True,
    keep_copies: bool = True,
    cache_dir: str | None = None,
    host_index: int = 0,
    num_hosts: int = 1,
    connections: int = CONNECTIONS,
    keep_partial: bool = False,
    index_dir: str | None = None,
    beside: bool = False,
) -> tuple[dict[str, tfrecord.RecordFile], list[Indexed], str | None]:
    """Indexes the shards ``paths`` (which have no usable index) for a job reading them.

    Each host streams its share, ``paths[host_index::num_hosts]``, once: it writes their indexes
    (``write``) in ``index_dir`` (a folder every host of the job reads and writes: the programs give
    ``<model_dir>/shard_indexes``), never into the data folder it was asked to read, unless
    ``beside`` (then in the hidden folder beside them, ``index_dir`` where that cannot be written: a
    read-only bucket); without either nothing is written. It keeps their bytes in local files
    (``keep_copies``, in a new directory under ``cache_dir`` or the system's temporary directory,
    while the disk has room) so that its reads of their records pull nothing again. It then waits
    for the other hosts' indexes to appear (up to three times as long as its own share took, at
    least two minutes) and indexes whatever did not appear itself. Only when it could write its
    indexes nowhere does it not wait (nor could the others write theirs): then every host indexes
    every shard, and that is logged.

    Returns:
      ``(record_files, results, copy_dir)``: a RecordFile per path, the shards this host read,
      and the directory of the local copies (the caller removes it when done), or None.
    """
    copy_dir = None
    if keep_copies and any(storage_is_remote(p) for p in paths):
        copy_dir = tempfile.mkdtemp(prefix=f"estimax-shards-{os.getpid()}-", dir=cache_dir)
    write = write and (beside or index_dir is not None)  # nowhere to write: a job never writes
    # into a data folder it was only asked to read (TensorFlow jobs glob that folder)
    mine = list(paths[host_index::num_hosts]) if num_hosts > 1 else list(paths)
    t0 = time.monotonic()
    results = index_shards(
        mine,
        connections=connections,
        verify_crc=False,
        write=write,
        copy_dir=copy_dir,
        keep_partial=True,
        index_dir=index_dir,
        beside=beside,
    )
    took = time.monotonic() - t0
    failed = [r for r in results if r.write_error]
    if failed:
        log.warning(
            "could not write the index files of %d shards (%s): "
            "this job reads them whole again at its next start%s",
            len(failed),
            failed[0].write_error,
            ", and every host reads every shard" if num_hosts > 1 else "",
        )
    elsewhere = [r for r in results if r.beside_error]
    if elsewhere:
        log.warning(
            "could not write the index files of %d shards in their folder (%s): they are in %s, "
            "where this job's later starts find them",
            len(elsewhere),
            elsewhere[0].beside_error,
            index_dir,
        )
    others = [p for p in paths if p not in set(mine)]
    if others and write and not failed:
        waited = _wait_for_indexes(others, max(120.0, 3 * took), verify_crc, index_dir)
        others = [p for p in others if p not in waited]
    else:
        waited = {}
    if others:
        if num_hosts > 1:
            log.info("indexing %d shards of other hosts here too", len(others))
        results += index_shards(
            others,
            connections=connections,
            verify_crc=False,
            write=write and not failed,
            copy_dir=copy_dir,
            keep_partial=True,
            index_dir=index_dir,
            beside=beside,
        )
    files: dict[str, tfrecord.RecordFile] = dict(waited)
    for r in results:
        if r.error is not None and not keep_partial:
            raise r.error
        files[r.path] = tfrecord.RecordFile(
            r.path, verify_crc=verify_crc, offsets=r.offsets, local_copy=r.local_copy
        )
    return files, results, copy_dir


def _wait_for_indexes(
    paths: Sequence[str], timeout: float, verify_crc: bool, index_dir: str | None = None
) -> dict[str, tfrecord.RecordFile]:
    """The shards whose (usable) indexes other hosts write within ``timeout`` seconds."""
    found: dict[str, tfrecord.RecordFile] = {}
    deadline = time.monotonic() + timeout
    pause = 0.5
    while True:
        for path in paths:
            if path in found:
                continue
            rf, _, why = open_indexed(path, verify_crc, index_dir)
            if rf is not None:
                found[path] = rf
        if len(found) == len(paths) or time.monotonic() >= deadline:
            return found
        time.sleep(pause)  # polling another host's progress, not timing anything
        pause = min(pause * 2, 5.0)
