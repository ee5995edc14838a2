"""TFRecord files without TensorFlow: write, read (CRC-checked), sharded names, index files.

The framing, as TensorFlow's ``core/lib/io/record_writer.cc`` defines it, for each record::

    uint64  length            (little endian)
    uint32  masked_crc32c(length bytes)
    byte    data[length]
    uint32  masked_crc32c(data)

with ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8  (mod 2**32)``. No compression
(the ImageNet shards of the original are uncompressed; gzip/zlib TFRecords are not supported and
are reported as corrupt on their first record).

Why hand-written: the format is four fields, and no maintained non-TensorFlow package offers a
CRC-checked reader + atomic writer + index over fsspec paths; CRC-32C itself comes from the
``crc32c`` package (hardware-accelerated). Measured (docs/performance.md): plain Python framing
reads at ~2 GB/s, faster than tf.data.

Paths are anything fsspec opens: local paths, ``gs://`` (gcsfs), ``s3://`` (s3fs), ``memory://``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import struct
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import crc32c
import fsspec
import numpy as np

from estimax import storage

__all__ = [
    "CorruptRecordError",
    "INDEX_DIR_NAME",
    "INDEX_SUFFIX",
    "NotRegularFileError",
    "IndexInfo",
    "RecordFile",
    "ShardChangedError",
    "StaleIndexError",
    "TFRecordWriter",
    "default_index_path",
    "existing_index_path",
    "hidden_index_path",
    "legacy_index_path",
    "index_problem",
    "list_files",
    "load_index",
    "masked_crc32c",
    "read_index",
    "read_many",
    "read_records",
    "read_records_with_offsets",
    "record_offsets",
    "sharded_name",
]

_MASK_DELTA = 0xA282EAD8
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_HEADER = struct.Struct("<QI")  # length, masked CRC of the length
_HEADER_SIZE = 12
_FOOTER_SIZE = 4
# Index files end with this suffix. estimax writes them in a hidden folder beside the shards
# (INDEX_DIR_NAME), where no glob of the original's ("train-*", "validation-*", a user's
# --file_pattern) matches them: TensorFlow's TFRecordDataset fails on the first one it is given.
# Earlier versions wrote them beside their shard ("<shard>.idx"); those are still read, and
# list_files() leaves them out so that estimax never reads one as a shard.
INDEX_SUFFIX = ".idx"
INDEX_DIR_NAME = ".estimax-index"
# Read-ahead for remote files: records of ~110 KB, 8 MiB like the original's TFRecordDataset
# buffer_size, so a gs:// shard is fetched in few requests.
_REMOTE_BLOCK_SIZE = 8 * 1024 * 1024


class CorruptRecordError(ValueError):
    """A TFRecord file is damaged: bad CRC, truncated length/data/CRC, or not a TFRecord file.

    Attributes:
      path: the file.
      offset: byte offset of the start of the damaged record in the file.
      next_offset: where the next record starts when this one's framing is intact (only its
        data CRC is wrong): reading can go on there. None when the framing itself is damaged.
    """

    def __init__(self, path: str, offset: int, problem: str, next_offset: int | None = None):
        super().__init__(f"{path}: record at byte offset {offset}: {problem}")
        self.path = path
        self.offset = offset
        self.problem = problem
        self.next_offset = next_offset


class ShardChangedError(RuntimeError):
    """A TFRecord file changed (size, modification time, inode or object generation) after its
    records were located: the offsets no longer apply. Not a bad record: skipping records does
    not skip it."""

    def __init__(self, path: str, change: str):
        super().__init__(
            f"{path} changed while it was being read ({change}): the record offsets found when "
            "the input started no longer apply. Put the file back as it was (or let its writer "
            "finish) and run again: training resumes from its last checkpoint."
        )
        self.path = path


class NotRegularFileError(OSError):
    """A local shard or index is not a regular file (a FIFO, a device, a socket): opening it
    could block for ever (a FIFO with no writer) or read without end (``/dev/zero``). The
    message is one line naming it."""

    def __init__(self, path: str, kind: str):
        super().__init__(
            f"{path}: not a regular file (a {kind}); give TFRecord shards and index files only"
        )
        self.path = path


_FILE_KINDS = (
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISDIR, "directory"),
)


def check_regular(path: str) -> os.stat_result | None:
    """``os.stat`` of a local ``path`` (links followed), refusing anything but a regular file
    before it is opened (a FIFO would block the open). Object-store paths are always objects:
    None, nothing asked.

    Raises:
      NotRegularFileError: a FIFO, device, socket or directory; names it.
      FileNotFoundError: it does not exist.
    """
    fs, fs_path = _fs_and_path(path)
    if not _is_local(fs):
        return None
    st = os.stat(fs_path)
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "special file")
        raise NotRegularFileError(path, kind)
    return st


class StaleIndexError(ValueError):
    """An index file does not describe its shard (cut short, or the shard was rewritten): its
    offsets would drop or garble records. The message is one line naming both files."""

    def __init__(self, path: str, index_path: str, problem: str):
        super().__init__(
            f"{index_path} does not index {path}: {problem}; rebuild it with "
            f"`estimax-convert index {path}`"
        )
        self.path = path
        self.index_path = index_path
        self.problem = problem


def masked_crc32c(data: bytes | memoryview) -> int:
    """The masked CRC-32C of ``data`` that TFRecord stores (see module docstring)."""
    crc = crc32c.crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def sharded_name(prefix: str, shard: int, num_shards: int) -> str:
    """``prefix-00003-of-00010``: the original converter's ``'%s-%.5d-of-%.5d'`` shard name."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} out of range for num_shards={num_shards} ({prefix!r})")
    return f"{prefix}-{shard:05d}-of-{num_shards:05d}"


def _fs_and_path(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    # storage.filesystem maps STORAGE_EMULATOR_HOST / AWS_ENDPOINT_URL for every client and
    # names the missing package (gcsfs, s3fs) in one line instead of fsspec's ImportError.
    return storage.filesystem(path)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def list_files(pattern: str) -> list[str]:
    """Files matching a glob ``pattern`` on any fsspec filesystem, sorted, index files excluded.

    Args:
      pattern: e.g. ``gs://bucket/imagenet/train-*`` or ``/data/validation-*``.

    Returns:
      Full paths (with the protocol prefix for remote filesystems), sorted by name so that every
      host sees the same order (the per-host sharding relies on it).

    Raises:
      FileNotFoundError: nothing matches; the message names the pattern.
    """
    fs, fs_pattern = _fs_and_path(pattern)
    matches = sorted(fs.glob(fs_pattern))
    if not pattern.endswith(INDEX_SUFFIX):
        matches = [m for m in matches if not m.endswith(INDEX_SUFFIX)]
    matches = [m for m in matches if not fs.isdir(m)]
    if not matches:
        raise FileNotFoundError(f"no files match the pattern {pattern!r}")
    if _is_local(fs):
        return matches
    return [fs.unstrip_protocol(m) for m in matches]


class TFRecordWriter:
    """Writes records to a TFRecord file; a context manager.

    Local files are written under a temporary name in the same directory and renamed on a
    successful ``close()``, so a crash never leaves a half-written file under the final name
    (and a reader's ``train-*`` pattern cannot catch a partial shard: the temporary name starts
    with ``.``). Object stores (``gs://``, ``s3://``) make an object visible only when its
    upload completes, which is already atomic, so there the file is written directly. If the
    ``with`` block raises, the partial file is deleted (remote: the upload is discarded, never
    completed) and nothing appears under ``path``. A remote upload that still fails after the
    client's retries raises :class:`estimax.storage.StorageError` naming ``path``.

    With ``index=True`` the file's index (:func:`default_index_path`:
    ``.estimax-index/<name>.idx`` beside it, see ``estimax.data.write_index``; or the path
    ``index`` names) is written with it, from the offsets of the records as they are written (no
    second pass), and is in place before the file appears under its final name: a reader that
    sees the file sees its index. If the file cannot be finished, the index is removed again.

    Example::

        with TFRecordWriter("/data/train-00000-of-01024", index=True) as w:
            w.write(encode_example({...}))
    """

    def __init__(self, path: str, index: bool | str = False):
        self.path = path
        self._fs, fs_path = _fs_and_path(path)
        self._final_path = fs_path
        if _is_local(self._fs):
            directory, base = os.path.split(fs_path)
            self._fs.makedirs(directory or ".", exist_ok=True)
            self._write_path = os.path.join(directory, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
        else:
            self._write_path = fs_path
        with storage.errors_named(path, "open it for writing"):
            self._file: IO[bytes] | None = self._fs.open(self._write_path, "wb")
        self.num_records = 0
        self.num_bytes = 0
        self.index_path = (
            index if isinstance(index, str) else default_index_path(path) if index else None
        )
        self._offsets: list[int] | None = [0] if self.index_path else None

    def write(self, record: bytes) -> None:
        """Appends one record (any bytes, e.g. a serialized tf.Example)."""
        if self._file is None:
            raise ValueError(f"{self.path}: write() after close()")
        length = _U64.pack(len(record))
        # Remote files upload a block whenever the buffer fills, so writes can fail too.
        with storage.errors_named(self.path, "write it"):
            self._file.write(length)
            self._file.write(_U32.pack(masked_crc32c(length)))
            self._file.write(record)
            self._file.write(_U32.pack(masked_crc32c(record)))
        self.num_records += 1
        self.num_bytes += _HEADER_SIZE + len(record) + _FOOTER_SIZE
        if self._offsets is not None:
            self._offsets.append(self.num_bytes)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Finishes the file and moves it to its final name. Idempotent."""
        if self._file is None:
            return
        if self.index_path is not None and self._offsets is not None:
            # Before the file takes its name (local rename, or the upload's completion).
            try:
                with storage.errors_named(self.index_path, "write it"):
                    _put_text(self.index_path, _index_text(self._offsets))
            except BaseException:
                self.abort()
                raise
        f, self._file = self._file, None
        try:
            with storage.errors_named(self.path, "finish writing it"):
                f.close()
            if self._write_path != self._final_path:
                os.replace(self._write_path, self._final_path)
        except BaseException:
            # A failed final upload must not leave a partial object for a retry to find.
            if not _is_local(self._fs):
                storage.discard(f)
            elif os.path.exists(self._write_path):
                with contextlib.suppress(OSError):
                    os.remove(self._write_path)
            self._remove_index()
            raise

    def _remove_index(self) -> None:
        if self.index_path is None:
            return
        fs, fs_path = _fs_and_path(self.index_path)
        with contextlib.suppress(OSError):
            fs.rm(fs_path)

    def abort(self) -> None:
        """Discards the file being written (used when the ``with`` block raises)."""
        if self._file is None:
            return
        f, self._file = self._file, None
        if not _is_local(self._fs):
            # close() would complete the upload: a partial shard under its final name.
            storage.discard(f)
            return
        f.close()
        try:
            self._fs.rm(self._write_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _open_read(path: str) -> IO[bytes]:
    fs, fs_path = _fs_and_path(path)
    if _is_local(fs):
        check_regular(path)  # a FIFO would block the open
        return open(fs_path, "rb", buffering=1024 * 1024)
    return fs.open(fs_path, "rb", block_size=_REMOTE_BLOCK_SIZE)


# What a length-CRC mismatch (or a file shorter than one header) most likely means: gzip/zlib
# TFRecords and other files fail here, on their first record (module docstring).
_NOT_TFRECORD_HINT = "not a TFRecord file, compressed, or damaged"
# Data is read in pieces of at most this size: a damaged (or crafted) header whose CRC happens
# to match can claim up to 2**64 bytes, and ``f.read(length)`` allocates ``length`` up front.
_READ_CHUNK = 16 * 1024 * 1024


def _check_header(header: bytes | memoryview, path: str, offset: int) -> int:
    """The record length from a 12-byte header; the one header check of every read path.

    Raises:
      CorruptRecordError: fewer than 12 bytes, or the length's CRC does not match.
    """
    if len(header) < _HEADER_SIZE:
        problem = f"truncated length header ({len(header)} of {_HEADER_SIZE} bytes)"
        if offset == 0:  # the whole file is shorter than one header
            problem += f"; {_NOT_TFRECORD_HINT}"
        raise CorruptRecordError(path, offset, problem)
    length, length_crc = _HEADER.unpack_from(header)
    # The length CRC is checked even without verify_crc: it costs nothing, and a damaged
    # length would otherwise send a scan astray or make a reader read an arbitrary size.
    computed = masked_crc32c(header[:8])
    if computed != length_crc:
        raise CorruptRecordError(
            path,
            offset,
            f"length CRC mismatch (stored {length_crc:#010x}, computed {computed:#010x}); "
            f"{_NOT_TFRECORD_HINT}",
        )
    return int(length)


def _check_footer(
    path: str,
    offset: int,
    length: int,
    available: int,
    data: bytes | memoryview | None = None,
    footer: bytes | memoryview | None = None,
) -> None:
    """The one footer check: ``available`` bytes follow the header of a ``length``-byte record.

    With ``data`` and ``footer`` (the record's bytes and its 4 stored CRC bytes), also checks the
    data CRC; without them (a scan that skips the data) only the sizes.

    Raises:
      CorruptRecordError: the data or its CRC is cut short, or the data CRC does not match.
    """
    if available < length:
        raise CorruptRecordError(path, offset, f"truncated data ({available} of {length} bytes)")
    if available < length + _FOOTER_SIZE:
        raise CorruptRecordError(
            path,
            offset,
            f"truncated data CRC ({available - length} of {_FOOTER_SIZE} bytes)",
        )
    if data is not None and footer is not None:
        (data_crc,) = _U32.unpack_from(footer)
        computed = masked_crc32c(data)
        if computed != data_crc:
            raise CorruptRecordError(
                path,
                offset,
                f"data CRC mismatch (stored {data_crc:#010x}, computed {computed:#010x})",
                next_offset=offset + _HEADER_SIZE + length + _FOOTER_SIZE,
            )


def _read_up_to(f: IO[bytes], n: int) -> bytes:
    """Up to ``n`` bytes from ``f`` (fewer at EOF), never allocating more than the file holds."""
    if n <= _READ_CHUNK:
        return f.read(n)
    parts = []
    while n > 0:
        part = f.read(min(n, _READ_CHUNK))
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _read_one(f: IO[bytes], path: str, offset: int, verify_crc: bool) -> bytes | None:
    """Reads the record starting at ``offset`` (f is positioned there); None at a clean EOF."""
    header = f.read(_HEADER_SIZE)
    if not header:
        return None
    length = _check_header(header, path, offset)
    data = _read_up_to(f, length)
    footer = f.read(_FOOTER_SIZE) if len(data) == length else b""
    _check_footer(
        path,
        offset,
        length,
        len(data) + len(footer),
        data if verify_crc else None,
        footer if verify_crc else None,
    )
    return data


def _parse_frame(blob: bytes, path: str, offset: int, verify_crc: bool) -> bytes:
    """The data of the one framed record ``blob`` (read from ``offset``; sized by an index)."""
    length = _check_header(blob, path, offset)
    end = _HEADER_SIZE + length
    view = memoryview(blob)
    _check_footer(
        path,
        offset,
        length,
        len(blob) - _HEADER_SIZE,
        view[_HEADER_SIZE:end] if verify_crc else None,
        view[end : end + _FOOTER_SIZE] if verify_crc else None,
    )
    if len(blob) != end + _FOOTER_SIZE:
        raise CorruptRecordError(
            path,
            offset,
            f"record of {end + _FOOTER_SIZE} bytes where the index says "
            f"{len(blob)}; the index does not match the file",
        )
    return blob[_HEADER_SIZE:end]


def read_records(
    path: str,
    verify_crc: bool = True,
    on_bad_record: Callable[[CorruptRecordError], Any] | None = None,
) -> Iterator[bytes]:
    """Yields the records of one TFRecord file in order.

    Args:
      path: any fsspec path.
      verify_crc: check the data CRC of every record (cheap: CRC-32C runs at GB/s). The length
        CRC is always checked.
      on_bad_record: called with the error of each record whose data CRC is wrong while its
        framing is intact; that one record is skipped and reading goes on. None: it raises.

    Raises:
      CorruptRecordError: bad CRC or truncated record; names the file and the record's offset.
        Damaged framing (a length CRC, a truncation) always raises: nothing after it can be
        found.
      FileNotFoundError: the file does not exist.
    """
    for _, record in read_records_with_offsets(path, verify_crc, on_bad_record=on_bad_record):
        yield record


def read_records_with_offsets(
    path: str,
    verify_crc: bool = True,
    start_offset: int = 0,
    on_bad_record: Callable[[CorruptRecordError], Any] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Like :func:`read_records`, also yielding each record's byte offset; can start mid-file.

    Args:
      path: any fsspec path.
      verify_crc: check both CRCs.
      start_offset: byte offset of a record boundary to start at (e.g. a saved position).
      on_bad_record: as in :func:`read_records`.

    Yields:
      ``(offset, record)``.
    """
    with _open_read(path) as f:
        if start_offset:
            f.seek(start_offset)
        offset = start_offset
        while True:
            try:
                record = _read_one(f, path, offset, verify_crc)
            except CorruptRecordError as e:
                if on_bad_record is None or e.next_offset is None:
                    raise
                on_bad_record(e)  # the whole frame was read: f is at the next record
                offset = e.next_offset
                continue
            if record is None:
                return
            yield offset, record
            offset += _HEADER_SIZE + len(record) + _FOOTER_SIZE


def record_offsets(path: str, verify_crc: bool = True) -> np.ndarray:
    """Byte offsets of every record in a file, found by scanning the headers.

    Data bytes are skipped with ``seek`` (not read) unless ``verify_crc``, so building an index
    of a local file without verification costs one small read per record.

    Returns:
      offsets: [N + 1] int64; record i spans ``offsets[i]:offsets[i+1]`` (the last entry is the
      file size).

    Raises:
      CorruptRecordError: a truncated record or a bad length CRC.
    """
    if verify_crc:
        offsets = [off for off, _ in read_records_with_offsets(path, verify_crc=True)]
        fs, fs_path = _fs_and_path(path)
        offsets.append(fs.size(fs_path))
        return np.asarray(offsets, dtype=np.int64)
    fs, fs_path = _fs_and_path(path)
    check_regular(path)  # before the open: a FIFO would block it for ever (#54)
    size = fs.size(fs_path)
    offsets = []
    if _is_local(fs):
        # pread of each 12-byte header: a buffered reader would read ahead (i.e. read the whole
        # file) to find offsets that only need the headers.
        fd = os.open(fs_path, os.O_RDONLY)
        read_at = lambda n, off: os.pread(fd, n, off)  # noqa: E731
    else:
        # Object stores: each header would be a request; reading through the file in large
        # blocks is cheaper (a request per 8 MiB, not per record: gcsfs's default adaptive
        # cache made a request of each 12-byte header). Index files (write_index) avoid this.
        f = fs.open(fs_path, "rb", block_size=_REMOTE_BLOCK_SIZE, cache_type="readahead")

        def read_at(n: int, off: int) -> bytes:
            f.seek(off)
            return f.read(n)

    try:
        offset = 0
        while offset < size:
            length = _check_header(read_at(_HEADER_SIZE, offset), path, offset)
            end = offset + _HEADER_SIZE + length + _FOOTER_SIZE
            if end > size:
                _check_footer(path, offset, length, size - offset - _HEADER_SIZE)
            offsets.append(offset)
            offset = end
    finally:
        if _is_local(fs):
            os.close(fd)
        else:
            f.close()
    offsets.append(size)
    return np.asarray(offsets, dtype=np.int64)


def default_index_path(path: str) -> str:
    """Where estimax writes the index of shard ``path`` by default (``estimax.data.write_index``,
    the converters, ``estimax-convert index``): :func:`hidden_index_path`."""
    return hidden_index_path(path)


def hidden_index_path(path: str) -> str:
    """``<folder>/.estimax-index/<name>.idx`` for shard ``<folder>/<name>``: in a hidden folder
    beside the shards, which no glob of shard names (``train-*``) matches, so that TensorFlow
    jobs reading the same folder never see it."""
    folder, slash, name = path.rstrip("/").rpartition("/")
    return f"{folder}{slash}{INDEX_DIR_NAME}/{name}{INDEX_SUFFIX}"


def legacy_index_path(path: str) -> str:
    """``<shard>.idx``: where earlier estimax versions wrote indexes (beside the shard, where a
    TensorFlow glob ``train-*`` matched them). Still read; ``estimax-convert index --move``
    moves them to :func:`hidden_index_path`."""
    return path + INDEX_SUFFIX


def existing_index_path(path: str) -> str | None:
    """The index file of shard ``path`` beside it, if any: :func:`hidden_index_path` first,
    then :func:`legacy_index_path`; None when it has neither."""
    for candidate in (hidden_index_path(path), legacy_index_path(path)):
        fs, fs_path = _fs_and_path(candidate)
        if fs.exists(fs_path):
            return candidate
    return None


def index_trailer(identity: dict[str, Any]) -> str:
    """The comment line an index ends with: what it indexes (size and version of the shard).

    DALI-style readers read pairs of integers and stop at it; :func:`load_index` reads it."""
    line = f"# estimax-index size={int(identity['size'])}"
    version = version_of(identity)
    if version is not None:
        line += f" version={urllib.parse.quote(version, safe='')}"
    return line + "\n"


def version_of(identity: dict[str, Any]) -> str | None:
    """The version part of an identity (``_identity``): object generation/ETag, local mtime."""
    if identity.get("version") not in (None, "None"):
        return str(identity["version"])
    if identity.get("modified") is not None:
        return f"mtime_ns:{identity['modified']}"
    return None


def _index_text(offsets: Sequence[int] | np.ndarray, identity: dict[str, Any] | None = None) -> str:
    """The index file's lines for record ``offsets`` ([N + 1], the last the file's size), and
    the trailer naming what it indexes (``identity``; its size alone when the version is not
    known yet, as for a file still being written)."""
    text = "".join(
        f"{int(a)} {int(b - a)}\n" for a, b in zip(offsets[:-1], offsets[1:], strict=False)
    )
    return text + index_trailer(identity or {"size": int(offsets[-1])})


def _put_text(path: str, text: str) -> None:
    """Writes a small file whole: locally under a temporary name renamed into place, on object
    stores as one upload (atomic there)."""
    fs, fs_path = _fs_and_path(path)
    if _is_local(fs):
        directory, base = os.path.split(fs_path)
        if directory:  # the hidden index folder is made by its first index
            os.makedirs(directory, exist_ok=True)
        # A dot name with ".tmp-": the converters' clean-up of a killed run's files finds it.
        tmp = os.path.join(directory, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, fs_path)
    else:
        with fs.open(fs_path, "w") as f:
            f.write(text)


# An index line is ~20 bytes: 256 MiB is over ten million records, far past any shard's.
_MAX_INDEX_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class IndexInfo:
    """What an index file says it indexes (its trailer); None for old indexes without one."""

    size: int | None = None
    version: str | None = None


def read_index(index_path: str) -> np.ndarray:
    """Reads an index file written by ``estimax.data.write_index`` (or DALI's ``tfrecord2idx``).

    Returns:
      offsets: [N + 1] int64 as :func:`record_offsets` returns.

    Raises:
      ValueError: a malformed line or non-contiguous records; names the file and line.
    """
    return load_index(index_path)[0]


def load_index(index_path: str) -> tuple[np.ndarray, IndexInfo]:
    """Reads an index file: its offsets ([N + 1] int64) and what it says it indexes.

    Raises:
      ValueError: a malformed line or non-contiguous records; names the file and line.
    """
    fs, fs_path = _fs_and_path(index_path)
    check_regular(index_path)  # a FIFO would block the open, /dev/zero read without end
    with fs.open(fs_path, "rb") as f:
        raw = f.read(_MAX_INDEX_BYTES + 1)
    if len(raw) > _MAX_INDEX_BYTES:
        raise ValueError(
            f"{index_path}: over {_MAX_INDEX_BYTES >> 20} MiB, not an index file of one shard"
        )
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{index_path}: not an index file (byte {e.start} is not ASCII); "
            "rewrite it with estimax.data.write_index"
        ) from None
    offsets = [0]
    info = IndexInfo()
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "#":
            if parts[1:2] == ["estimax-index"]:
                info = _parse_trailer(parts[2:])
            continue
        try:
            start, length = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            raise ValueError(
                f"{index_path}: line {lineno}: expected '<offset> <length>', got {line!r}"
            ) from None
        if start != offsets[-1]:
            raise ValueError(
                f"{index_path}: line {lineno}: record offset {start} does not follow the "
                f"previous record's end {offsets[-1]}; the index does not match its file"
            )
        # int64 offsets (np.asarray below); a frame is at least a header and a footer.
        if length < _HEADER_SIZE + _FOOTER_SIZE or start + length >= 2**63:
            raise ValueError(
                f"{index_path}: line {lineno}: record length {length} is not a TFRecord "
                f"frame's; the index does not match its file"
            )
        offsets.append(start + length)
    return np.asarray(offsets, dtype=np.int64), info


def _parse_trailer(fields: list[str]) -> IndexInfo:
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    size = values.get("size")
    version = values.get("version")
    return IndexInfo(
        size=int(size) if size and size.isdigit() else None,
        version=urllib.parse.unquote(version) if version else None,
    )


def index_problem(
    path: str, offsets: np.ndarray, info: IndexInfo, identity: dict[str, Any]
) -> str | None:
    """Why an index (``offsets``, ``info``) does not describe the shard ``path`` as it is now
    (``identity``: ``_identity``), in words; None when it does.

    The records must end at the shard's size (an index cut short, or one of a shard since
    rewritten with another size, fails here: that is how old indexes without a trailer are
    checked). A recorded version that differs (a copied data set has new generations and
    mtimes) is accepted when the first, middle and last records' headers are where the index
    says: one small read of each.
    """
    size = int(identity["size"])
    end = int(offsets[-1])
    if info.size is not None and info.size != size:
        return f"it indexes a shard of {info.size} bytes, the shard has {size}"
    if end != size:
        return f"its {len(offsets) - 1} records end at byte {end}, the shard has {size} bytes"
    version = version_of(identity)
    if info.version is None or version is None or info.version == version:
        return None
    fs, fs_path = _fs_and_path(path)
    n = len(offsets) - 1
    picks = sorted({0, n // 2, n - 1}) if n else []
    starts = [int(offsets[j]) for j in picks]
    if _is_local(fs):
        with open(fs_path, "rb") as f:
            heads = [os.pread(f.fileno(), _HEADER_SIZE, a) for a in starts]
    else:
        heads = fs.cat_ranges([fs_path] * len(starts), starts, [a + _HEADER_SIZE for a in starts])
    for j, head in zip(picks, heads, strict=True):
        try:
            length = _check_header(head, path, int(offsets[j]))
        except CorruptRecordError:
            length = -1
        if int(offsets[j]) + _HEADER_SIZE + length + _FOOTER_SIZE != int(offsets[j + 1]):
            return (
                f"it indexes version {info.version} of the shard, which is now version "
                f"{version}, and record {j} is not where it says"
            )
    return None


# How often a file on an object store is asked whether it is still the one being read (one
# request per file; a local file is checked at every read, for free).
RECHECK_SECS = 30.0


def _local_identity(st: os.stat_result) -> dict[str, Any]:
    return {"size": st.st_size, "modified": st.st_mtime_ns, "file": (st.st_dev, st.st_ino)}


def _identity(fs: fsspec.AbstractFileSystem, fs_path: str) -> dict[str, Any]:
    """What tells this version of a file from another: size, mtime and inode on local disk;
    size and generation (GCS) or ETag (S3) on an object store."""
    if _is_local(fs):
        st = check_regular(fs_path)  # before anything opens it: a FIFO would block (#54)
        assert st is not None
        return _local_identity(st)
    info = fs.info(fs_path)
    version = next(
        (info[k] for k in ("generation", "ETag", "VersionId", "mtime", "created") if k in info),
        None,
    )
    return {"size": info.get("size"), "version": str(version)}


def _change(was: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How a file's identity changed, in words (None if it did not)."""
    if was["size"] != now["size"]:
        return f"{was['size']} bytes then, {now['size']} now"
    if was.get("file") != now.get("file"):
        return "replaced by another file of the same size"
    if was.get("modified") != now.get("modified"):
        return "rewritten: same size, another modification time"
    if was.get("version") != now.get("version"):
        return f"replaced: object version {was['version']} then, {now['version']} now"
    return None


class RecordFile(Sequence[bytes]):
    """Random access to the records of one TFRecord file: ``len(f)``, ``f[i]``.

    Uses the index file (``index_path``, else :func:`existing_index_path`) if present, checked
    against the file (:func:`index_problem`: a stale index raises :class:`StaleIndexError`), else
    scans the file's headers once. Reads are thread-safe and hold no open file, so a ``RecordFile``
    can be shared by threads and pickled to worker processes. A file that changes afterwards (its
    offsets then point anywhere) raises ``ShardChangedError`` naming it: checked at every read of a
    local file (its size, mtime and inode, from the ``fstat`` the read does anyway), and on an
    object store (its size and generation or ETag: one request) when a read finds damage and at most
    every ``RECHECK_SECS`` otherwise.

    Args:
      path: the TFRecord file (any fsspec path).
      index_path: an index written by ``estimax.data.write_index``; default the one beside the
        shard (``.estimax-index/<name>.idx``, or an earlier version's ``<name>.idx``) if any.
      verify_crc: check both CRCs on every read.
      offsets: [N + 1] record offsets, if already known (then no index is read, no scan done).
      local_copy: a local file with the same bytes as ``path``, read instead of it.
    """

    def __init__(
        self,
        path: str,
        index_path: str | None = None,
        verify_crc: bool = True,
        offsets: np.ndarray | None = None,
        local_copy: str | None = None,
    ):
        self.path = path
        self.verify_crc = verify_crc
        self.local_copy = local_copy
        # A local copy of the whole shard (made while indexing it, estimax.data.shard_index)
        # serves every read: messages still name ``path``.
        self._fs, self._fs_path = _fs_and_path(local_copy or path)
        self._is_local = _is_local(self._fs)
        self._identity = _identity(self._fs, self._fs_path)  # before the offsets are found
        self._checked = time.monotonic()
        if offsets is not None:
            self.index_path = index_path
            self.offsets = np.asarray(offsets, dtype=np.int64)
            return
        if index_path is None:
            index_path = existing_index_path(path)
        self.index_path = index_path
        if not index_path:
            self.offsets = record_offsets(path, False)
            return
        self.offsets, info = load_index(index_path)
        problem = index_problem(path, self.offsets, info, self._identity)
        if problem:
            raise StaleIndexError(path, index_path, problem)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def offset(self, i: int) -> int:
        """Byte offset of record ``i``."""
        return int(self.offsets[i])

    def __getitem__(self, i: int) -> bytes:  # type: ignore[override]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.path}: record index {i} out of range for {n} records")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        # One read of exactly the framed record: pread on local files (no read-ahead of data we
        # do not want), one ranged request on object stores. The file is opened per read (a few
        # microseconds against ~1 ms to decode the image) so that a host reading 1,024 shards
        # does not hold 1,024 descriptors (the usual soft limit), and reads are thread-safe.
        if self._is_local:
            fd = os.open(self._fs_path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                change = _change(self._identity, _local_identity(st))
                if change:
                    raise ShardChangedError(self.path, change)
                # pread allocates its size up front: a wrong index must not make it ask for
                # terabytes. Past the file's end there is nothing to read; _parse_frame then
                # reports the truncation.
                blob = os.pread(fd, max(0, min(end, st.st_size) - start), start)
            finally:
                os.close(fd)
            return _parse_frame(blob, self.path, start, self.verify_crc)
        self.check_due()
        blob = self._fs.cat_file(self._fs_path, start=start, end=end)
        try:
            return _parse_frame(blob, self.path, start, self.verify_crc)
        except CorruptRecordError:
            self.check_unchanged()
            raise

    def check_unchanged(self) -> None:
        """Raises ``ShardChangedError`` if the file is no longer the one whose records were
        located (on an object store: one request, past any cached listing)."""
        if not self._is_local:
            self._fs.invalidate_cache(self._fs_path)
        self._checked = time.monotonic()
        change = _change(self._identity, _identity(self._fs, self._fs_path))
        if change:
            raise ShardChangedError(self.path, change)

    def check_due(self) -> None:
        """``check_unchanged`` if ``RECHECK_SECS`` have passed since the last check (object
        stores; local files are checked at every read)."""
        if not self._is_local and time.monotonic() - self._checked >= RECHECK_SECS:
            self.check_unchanged()

    @property
    def is_remote(self) -> bool:
        """Whether the file is on an object store (reads are requests, not preads)."""
        return not self._is_local

    def __repr__(self) -> str:
        return f"RecordFile({self.path!r}, {len(self)} records)"


# One coalesced request reads at most this much: neighbouring records join into one range up to
# it (a request of 8 MiB costs about one latency more than one of 100 KB, not 80).
_MAX_RANGE = 8 * 1024 * 1024


def read_many(items: Sequence[tuple[RecordFile, int]]) -> list[bytes | Exception]:
    """Reads record ``j`` of file ``f`` for every ``(f, j)``: on object stores all at once.

    Remote files: records that are neighbours in a file (one ends where the next starts) are
    coalesced into one ranged request of at most 8 MiB, and all requests of the call are in
    flight together (fsspec's ``cat_ranges``, concurrent on gcsfs/s3fs): the call costs about one
    request's latency, not one per record, and reads exactly the records' bytes. Local files:
    one pread per record.

    Returns:
      per item its data, or the exception reading it raised (a damaged record's
      :class:`CorruptRecordError`, a request's error after the client's retries).

    Raises:
      ShardChangedError: a file was replaced since its records were located.
    """
    out: list[bytes | Exception] = [b""] * len(items)
    remote: list[tuple[RecordFile, int, int]] = []  # (file, start, item)
    for k, (rf, j) in enumerate(items):
        if rf.is_remote:
            remote.append((rf, int(rf.offsets[j]), k))
            continue
        try:
            out[k] = rf[j]
        except Exception as e:  # noqa: BLE001 - the caller decides: bad record or error
            out[k] = e
    if not remote:
        return out
    ranges = _coalesce(items, remote)
    for rf in {id(r[0]): r[0] for r in ranges}.values():
        rf.check_due()  # a replaced file raises here, for the whole call
    checked: dict[RecordFile, ShardChangedError | None] = {}
    by_fs: dict[int, list[int]] = {}
    for r, (rf, _, _, _) in enumerate(ranges):
        by_fs.setdefault(id(rf._fs), []).append(r)  # noqa: SLF001 - same module
    for group in by_fs.values():
        fs = ranges[group[0]][0]._fs  # noqa: SLF001 - same module
        blobs = fs.cat_ranges(
            [ranges[r][0]._fs_path for r in group],  # noqa: SLF001 - same module
            [ranges[r][1] for r in group],
            [ranges[r][2] for r in group],
            on_error="return",
        )
        for r, blob in zip(group, blobs, strict=True):
            rf, start, _, ks = ranges[r]
            for k in ks:
                out[k] = (
                    blob
                    if isinstance(blob, Exception)
                    else _record_in(blob, start, rf, items[k][1], checked)
                )
    return out


def _coalesce(
    items: Sequence[tuple[RecordFile, int]], remote: list[tuple[RecordFile, int, int]]
) -> list[tuple[RecordFile, int, int, list[int]]]:
    """``(file, start, end, items)`` ranges of the ``remote`` reads ``(file, start, item)``:
    sorted by (file, offset), runs where each record starts at the last's end joined, each at
    most ``_MAX_RANGE`` bytes."""
    remote.sort(key=lambda r: (r[0].path, r[1]))
    ranges: list[tuple[RecordFile, int, int, list[int]]] = []
    for rf, start, k in remote:
        j = items[k][1]
        end = int(rf.offsets[j + 1])
        if ranges:
            last_rf, last_start, last_end, last_items = ranges[-1]
            if last_rf is rf and last_end == start and end - last_start <= _MAX_RANGE:
                ranges[-1] = (rf, last_start, end, [*last_items, k])
                continue
        ranges.append((rf, start, end, [k]))
    return ranges


def _record_in(
    blob: bytes,
    start: int,
    rf: RecordFile,
    j: int,
    checked: dict[RecordFile, ShardChangedError | None],
) -> bytes | Exception:
    """Record ``j`` of ``rf`` from ``blob``, the file's bytes from ``start``; or its damage.

    Damage makes it ask once per call whether the file was replaced (``checked``)."""
    lo, hi = int(rf.offsets[j]), int(rf.offsets[j + 1])
    try:
        return _parse_frame(blob[lo - start : hi - start], rf.path, lo, rf.verify_crc)
    except CorruptRecordError as e:
        if rf not in checked:
            try:
                rf.check_unchanged()
                checked[rf] = None
            except ShardChangedError as changed:
                checked[rf] = changed
        return checked[rf] or e
