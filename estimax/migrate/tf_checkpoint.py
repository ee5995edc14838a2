"""Reads TensorFlow checkpoints (``model.ckpt-N.index`` + ``.data-*``) without TensorFlow.

The format (tensorflow/core/util/tensor_bundle, lib/io/table_format.txt; ``docs/migration.md`` §1):
``.index`` is a LevelDB-format table whose key ``""`` holds a ``BundleHeaderProto`` and whose
other keys, in bytewise order, are tensor names with a ``BundleEntryProto`` each (dtype, shape,
shard, offset, size, masked CRC32C); ``.data-SSSSS-of-NNNNN`` shards hold the raw little-endian
bytes. Every block of the table and every tensor is checked against its CRC32C.

Why by hand: no maintained package reads this format without TensorFlow (the one on the index
fails to import with protobuf 7), and TensorFlow is far too large a dependency for reading a
table of ~100 lines' worth of format. The two messages are declared to protobuf at run time
(``_bundle_messages``), so the wire format is protobuf's own parser's job, not ours.

What it does not read, each refused with one error naming the file: snappy-compressed table
blocks (written only by TF 1.0/1.1), partitioned variables (``slices``), string tensors,
big-endian bundles and dtypes other than the numeric ones.

A hostile or damaged file costs work and memory in proportion to its size, never more: keys
may expand (prefix compression) to at most ``_KEY_EXPANSION`` times the file's bytes, each table
block is read once, and a tensor's shape, size, offset and shard are checked against each other
and the data file's size before a byte of it is read. Every malformed field is a
``TFCheckpointError`` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import posixpath
import re
import struct
from collections.abc import Iterator
from typing import IO, Any

import crc32c
import ml_dtypes
import numpy as np

from estimax import storage

__all__ = [
    "CheckpointReader",
    "TFCheckpointError",
    "TensorInfo",
    "list_variables",
    "resolve_checkpoint",
]

# DataType enum numbers (tensorflow/core/framework/types.proto) -> numpy dtypes, little-endian.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),  # DT_FLOAT
    2: np.dtype("<f8"),  # DT_DOUBLE
    3: np.dtype("<i4"),  # DT_INT32
    4: np.dtype("u1"),  # DT_UINT8
    5: np.dtype("<i2"),  # DT_INT16
    6: np.dtype("i1"),  # DT_INT8
    8: np.dtype("<c8"),  # DT_COMPLEX64
    9: np.dtype("<i8"),  # DT_INT64
    10: np.dtype("?"),  # DT_BOOL
    14: np.dtype(ml_dtypes.bfloat16),  # DT_BFLOAT16
    17: np.dtype("<u2"),  # DT_UINT16
    18: np.dtype("<c16"),  # DT_COMPLEX128
    19: np.dtype("<f2"),  # DT_HALF
    22: np.dtype("<u4"),  # DT_UINT32
    23: np.dtype("<u8"),  # DT_UINT64
}
# The names tf.train.list_variables users see (tf.DType.name).
DTYPE_NAMES = {
    1: "float32",
    2: "float64",
    3: "int32",
    4: "uint8",
    5: "int16",
    6: "int8",
    7: "string",
    8: "complex64",
    9: "int64",
    10: "bool",
    14: "bfloat16",
    17: "uint16",
    18: "complex128",
    19: "float16",
    20: "resource",
    21: "variant",
    22: "uint32",
    23: "uint64",
}
_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
_BLOCK_TRAILER_SIZE = 5  # 1 byte compression type + fixed32 masked CRC32C
_MASK_DELTA = 0xA282EAD8
# TensorFlow's table writer restarts prefix compression every 16 keys (block_restart_interval),
# so the keys of a real index, written out in full, come to at most 16 times its size. A
# "prefix-compression bomb" (thousands of keys sharing one long prefix) goes far past that:
# a 4 MB one took 20 s to list, 10 MB about an hour, before this bound.
_KEY_EXPANSION = 32
_MAX_RANK = 254  # TensorFlow's TensorShape::MaxDimensions()
_MAX_BYTES = (1 << 63) - 1  # numpy's bound on an array's bytes (zero-sized ones included)


class TFCheckpointError(ValueError):
    """A TensorFlow checkpoint that cannot be found, is damaged, or holds what we do not read."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a checkpoint, as its ``BundleEntryProto`` describes it."""

    name: str
    dtype: int  # TensorFlow DataType number
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int  # masked, as stored
    sliced: bool

    @property
    def dtype_name(self) -> str:
        """``float32``, ``bfloat16``, ``int64``... (TensorFlow's name for the dtype)."""
        return DTYPE_NAMES.get(self.dtype, f"DataType({self.dtype})")


def unmask_crc(masked: int) -> int:
    """LevelDB/TensorFlow's ``crc32c::Unmask``."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


@functools.cache
def _bundle_messages() -> tuple[Any, Any]:
    """``(BundleHeaderProto, BundleEntryProto)`` classes, declared to protobuf at run time.

    Only the fields we read (tensor_bundle.proto, tensor_shape.proto, versions.proto); protobuf
    keeps the others as unknown fields. Declared here rather than compiled with protoc so the
    package carries no generated code tied to one protobuf runtime.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(
        name="estimax_tensor_bundle.proto", package="estimax.tfbundle", syntax="proto3"
    )
    T = descriptor_pb2.FieldDescriptorProto
    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = f".estimax.tfbundle.{type_name}"

    message(
        "VersionDef",
        ("producer", 1, T.TYPE_INT32, opt, ""),
        ("min_consumer", 2, T.TYPE_INT32, opt, ""),
    )
    message(
        "BundleHeaderProto",
        ("num_shards", 1, T.TYPE_INT32, opt, ""),
        ("endianness", 2, T.TYPE_INT32, opt, ""),  # an enum: LITTLE=0, BIG=1
        ("version", 3, T.TYPE_MESSAGE, opt, "VersionDef"),
    )
    message("Dim", ("size", 1, T.TYPE_INT64, opt, ""), ("name", 2, T.TYPE_STRING, opt, ""))
    message(
        "TensorShapeProto",
        ("dim", 2, T.TYPE_MESSAGE, rep, "Dim"),
        ("unknown_rank", 3, T.TYPE_BOOL, opt, ""),
    )
    message("TensorSliceProto")  # only counted: partitioned variables are refused
    message(
        "BundleEntryProto",
        ("dtype", 1, T.TYPE_INT32, opt, ""),  # an enum (DataType)
        ("shape", 2, T.TYPE_MESSAGE, opt, "TensorShapeProto"),
        ("shard_id", 3, T.TYPE_INT32, opt, ""),
        ("offset", 4, T.TYPE_INT64, opt, ""),
        ("size", 5, T.TYPE_INT64, opt, ""),
        ("crc32c", 6, T.TYPE_FIXED32, opt, ""),
        ("slices", 7, T.TYPE_MESSAGE, rep, "TensorSliceProto"),
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("estimax.tfbundle.BundleHeaderProto")
        ),
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("estimax.tfbundle.BundleEntryProto")
        ),
    )


def _varint(buf: bytes | memoryview, pos: int, where: str) -> tuple[int, int]:
    """Decodes a LevelDB varint at ``pos``; returns ``(value, next position)``."""
    result, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise TFCheckpointError(f"{where}: damaged table (a varint runs off its block)")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _read_block(data: bytes, offset: int, size: int, path: str) -> memoryview:
    """The checked contents of the table block at ``offset`` (``size`` bytes + trailer)."""
    end = offset + size
    if end + _BLOCK_TRAILER_SIZE > len(data):
        raise TFCheckpointError(
            f"{path}: truncated (a block at byte {offset} ends past the file's {len(data)} bytes)"
        )
    kind = data[end]
    (stored,) = struct.unpack_from("<I", data, end + 1)
    if unmask_crc(stored) != crc32c.crc32c(data[offset : end + 1]):
        raise TFCheckpointError(f"{path}: CRC32C mismatch in the table block at byte {offset}")
    if kind == 1:
        raise TFCheckpointError(
            f"{path}: snappy-compressed table blocks (written by TensorFlow 1.0/1.1) are not "
            "read by estimax; re-save the checkpoint with TensorFlow >= 1.2 (tf.train.Saver "
            "restore + save) first"
        )
    if kind != 0:
        raise TFCheckpointError(f"{path}: unknown block compression type {kind}")
    return memoryview(data)[offset:end]


class _KeyBudget:
    """The key bytes an index may expand to (``_KEY_EXPANSION`` times its size)."""

    def __init__(self, path: str, file_size: int):
        self.path, self.file_size = path, file_size
        self.left = _KEY_EXPANSION * file_size + (1 << 16)

    def spend(self, key_bytes: int) -> None:
        self.left -= key_bytes
        if self.left < 0:
            raise TFCheckpointError(
                f"{self.path}: damaged table (its prefix-compressed keys expand to more than "
                f"{_KEY_EXPANSION} times the file's {self.file_size} bytes; TensorFlow's "
                "never do)"
            )


def _block_entries(
    block: memoryview, path: str, budget: _KeyBudget | None = None
) -> Iterator[tuple[bytes, memoryview]]:
    """``(key, value)`` of a table block, in order (restart points not needed sequentially)."""
    if len(block) < 4:
        raise TFCheckpointError(f"{path}: damaged table (a block of {len(block)} bytes)")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 - 4 * num_restarts
    if limit < 0:
        raise TFCheckpointError(f"{path}: damaged table (bad restart count {num_restarts})")
    pos, key = 0, b""
    while pos < limit:
        shared, pos = _varint(block, pos, path)
        non_shared, pos = _varint(block, pos, path)
        value_len, pos = _varint(block, pos, path)
        if shared > len(key) or pos + non_shared + value_len > limit:
            raise TFCheckpointError(f"{path}: damaged table (an entry runs off its block)")
        if budget is not None:
            budget.spend(shared + non_shared)
        key = key[:shared] + bytes(block[pos : pos + non_shared])
        pos += non_shared
        yield key, block[pos : pos + value_len]
        pos += value_len


def _table_entries(data: bytes, path: str) -> Iterator[tuple[bytes, memoryview]]:
    """Every ``(key, value)`` of a LevelDB-format table file, in key order (checked)."""
    if len(data) < _FOOTER_SIZE:
        raise TFCheckpointError(f"{path}: not a TensorFlow checkpoint index ({len(data)} bytes)")
    footer = data[-_FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, 40)
    if magic != _TABLE_MAGIC:
        raise TFCheckpointError(
            f"{path}: not a TensorFlow checkpoint index (no table magic number at its end)"
        )
    _, pos = _varint(footer, 0, path)  # metaindex handle: offset
    _, pos = _varint(footer, pos, path)  # ... size (the metaindex block is empty)
    index_offset, pos = _varint(footer, pos, path)
    index_size, pos = _varint(footer, pos, path)
    budget = _KeyBudget(path, len(data))
    index = _read_block(data, index_offset, index_size, path)
    block_end, last = 0, None
    for _, handle in _block_entries(index, path, budget):
        offset, p = _varint(handle, 0, path)
        size, _ = _varint(handle, p, path)
        if offset < block_end:  # TensorFlow writes its blocks one after the other, once each
            raise TFCheckpointError(
                f"{path}: damaged table (its index names a block at byte {offset}, which "
                "overlaps the one before)"
            )
        block_end = offset + size + _BLOCK_TRAILER_SIZE
        for key, value in _block_entries(_read_block(data, offset, size, path), path, budget):
            if last is not None and key <= last:
                raise TFCheckpointError(
                    f"{path}: damaged table (key {key[:80]!r} is out of order: keys are sorted)"
                )
            last = key
            yield key, value


def _read_text(path: str) -> str:
    with storage.errors_named(path, "read it"), storage.open_file(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _unescape(text: str) -> str:
    """A text-format string's C escapes (``\\"``, ``\\\\``, octal bytes) undone."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def resolve_checkpoint(path: str) -> str:
    """The prefix (``.../model.ckpt-N``) of the checkpoint that ``path`` names.

    Args:
      path: a model_dir (its ``checkpoint`` file names the newest), a prefix, or a prefix's
        ``.index`` file; local, ``gs://`` or ``s3://``.

    A relative ``model_checkpoint_path`` (Estimator's Saver) is taken relative to the
    ``checkpoint`` file; an absolute one (a plain Saver's) that does not exist, e.g. in a
    model_dir copied elsewhere, falls back to its basename next to the ``checkpoint`` file.

    Raises:
      TFCheckpointError: there is no checkpoint there (naming what was looked for).
    """
    path = path.rstrip("/") if path not in ("/",) else path
    if path.endswith(".index"):
        path = path[: -len(".index")]
    elif re.search(r"\.data-\d{5}-of-\d{5}$", path):
        path = path[: path.rindex(".data-")]
    if storage.exists(path + ".index"):
        return path
    state_file = storage.join(path, "checkpoint")
    if not storage.exists(state_file):
        raise TFCheckpointError(
            f"{path}: no TensorFlow checkpoint: neither {path}.index nor {state_file} exists "
            "(give a model_dir with a 'checkpoint' file, or a prefix such as "
            "model_dir/model.ckpt-1000)"
        )
    match = re.search(
        r'^\s*model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', _read_text(state_file), re.M
    )
    if not match:
        raise TFCheckpointError(f"{state_file}: has no model_checkpoint_path")
    named = _unescape(match.group(1))
    candidates = []
    if storage.is_remote(named) or posixpath.isabs(named):
        candidates.append(named)
    else:
        candidates.append(storage.join(path, named))
    candidates.append(storage.join(path, posixpath.basename(named)))
    for prefix in candidates:
        if storage.exists(prefix + ".index"):
            return prefix
    raise TFCheckpointError(
        f"{state_file}: names checkpoint {named!r}, but none of "
        f"{', '.join(c + '.index' for c in dict.fromkeys(candidates))} exists"
    )


class CheckpointReader:
    """The tensors of one TensorFlow checkpoint (``tf.train.load_checkpoint``'s reader, for us).

    Example::

        reader = CheckpointReader("gs://bucket/resnet")      # its newest checkpoint
        reader.variables()                                 # {name: TensorInfo}
        kernel = reader.get_tensor("conv2d/kernel")        # numpy, CRC32C checked
    """

    def __init__(self, path: str):
        """Reads the index of the checkpoint at ``path`` (see ``resolve_checkpoint``).

        Raises:
          TFCheckpointError: not found, damaged, or in a form this reader refuses.
        """
        self.prefix = resolve_checkpoint(path)
        self.index_path = self.prefix + ".index"
        with (
            storage.errors_named(self.index_path, "read it"),
            storage.open_file(self.index_path, "rb") as f,
        ):
            data = f.read()
        self.num_shards = 1
        self._entries: dict[str, TensorInfo] = {}
        self._read_index(data)
        self._files: dict[int, IO[bytes]] = {}

    def _read_index(self, data: bytes) -> None:
        """Fills ``num_shards`` and ``_entries`` from the ``.index`` file's bytes."""
        from google.protobuf.message import DecodeError

        header_cls, entry_cls = _bundle_messages()
        for key, value in _table_entries(data, self.index_path):
            try:
                if key == b"":
                    header = header_cls.FromString(bytes(value))
                    if header.endianness != 0:
                        raise TFCheckpointError(
                            f"{self.index_path}: a big-endian checkpoint; estimax reads "
                            "little-endian ones only (re-save it on a little-endian machine)"
                        )
                    if header.num_shards < 0:
                        raise TFCheckpointError(
                            f"{self.index_path}: damaged header ({header.num_shards} shards)"
                        )
                    self.num_shards = header.num_shards or 1
                    continue
                if key.startswith(b"\x00"):
                    continue  # a slice of a partitioned variable (its full entry says so)
                entry = entry_cls.FromString(bytes(value))
            except DecodeError as e:
                raise TFCheckpointError(f"{self.index_path}: damaged entry {key!r} ({e})") from None
            name = key.decode("utf-8", errors="replace")
            self._entries[name] = self._entry_info(name, entry)

    def _entry_info(self, name: str, entry: Any) -> TensorInfo:
        """A ``BundleEntryProto`` as ``TensorInfo``; a field no tensor can have is an error."""

        def damaged(what: str) -> TFCheckpointError:
            return TFCheckpointError(f"{self.index_path}: damaged entry {name}: {what}")

        if entry.shape.unknown_rank:
            raise damaged("its shape has no rank (a saved tensor always has one)")
        if len(entry.shape.dim) > _MAX_RANK:
            raise damaged(f"a shape of {len(entry.shape.dim)} dimensions (at most {_MAX_RANK})")
        shape = tuple(int(d.size) for d in entry.shape.dim)
        if any(d < 0 for d in shape):
            raise damaged(f"a negative dimension in its shape {list(shape)}")
        itemsize = DTYPES[entry.dtype].itemsize if entry.dtype in DTYPES else 1
        if math.prod(d or 1 for d in shape) * itemsize > _MAX_BYTES:  # numpy refuses those
            raise damaged(f"its shape {list(shape)} is larger than any array")
        if entry.offset < 0 or entry.size < 0:
            raise damaged(f"offset {entry.offset}, size {entry.size} (negative)")
        if not 0 <= entry.shard_id < self.num_shards:
            raise damaged(f"shard {entry.shard_id}, of a checkpoint of {self.num_shards} shards")
        sliced = len(entry.slices) > 0
        return TensorInfo(
            name, entry.dtype, shape, entry.shard_id, entry.offset, entry.size, entry.crc32c, sliced
        )

    def variables(self) -> dict[str, TensorInfo]:
        """``{name: TensorInfo}`` of every tensor, in name order (as the index stores them)."""
        return dict(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def data_path(self, shard: int) -> str:
        """The ``.data-SSSSS-of-NNNNN`` file of ``shard``."""
        return f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}"

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a numpy array (CRC32C checked).

        Raises:
          KeyError: no tensor of that name (the message lists a few close names).
          TFCheckpointError: damaged, or a kind of tensor this reader refuses.
        """
        info = self._entries.get(name)
        if info is None:
            close = [n for n in self._entries if n.split("/")[-1] == name.split("/")[-1]][:5]
            raise KeyError(
                f"{self.index_path} has no tensor {name!r}"
                + (f" (tensors with the same last part: {close})" if close else "")
            )
        if info.sliced:
            raise TFCheckpointError(
                f"{self.index_path}: {name} is a partitioned variable (saved in slices); "
                "estimax does not read those"
            )
        if info.dtype not in DTYPES:
            raise TFCheckpointError(
                f"{self.index_path}: {name} is a {info.dtype_name} tensor; estimax reads "
                f"numeric tensors only ({', '.join(DTYPE_NAMES[d] for d in DTYPES)})"
            )
        dtype = DTYPES[info.dtype]
        count = math.prod(info.shape)  # Python's integers: an absurd shape cannot wrap around
        if info.size != count * dtype.itemsize:
            raise TFCheckpointError(
                f"{self.index_path}: {name} has {info.size} bytes for "
                f"{info.shape} {info.dtype_name}"
            )
        raw = self._read(info)
        if unmask_crc(info.crc32c) != crc32c.crc32c(raw):
            raise TFCheckpointError(
                f"{self.data_path(info.shard_id)}: CRC32C mismatch in tensor {name}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(info.shape).copy()

    def _read(self, info: TensorInfo) -> bytes:
        """The bytes of ``info`` in its data file, after checking that the file holds them."""
        path = self.data_path(info.shard_id)
        f = self._files.get(info.shard_id)
        try:
            with storage.errors_named(path, "read it"):
                if f is None:
                    f = self._files[info.shard_id] = storage.open_file(path, "rb")
                file_size = f.seek(0, 2)
        except FileNotFoundError:
            raise TFCheckpointError(
                f"{path}: missing ({info.name} is in shard {info.shard_id} of {self.num_shards})"
            ) from None
        end = info.offset + info.size
        # Checked before reading: a size the file cannot hold is never allocated.
        if end > file_size:
            raise TFCheckpointError(
                f"{path}: truncated ({info.name} needs bytes {info.offset}..{end}, the file "
                f"has {file_size})"
            )
        with storage.errors_named(path, "read it"):
            f.seek(info.offset)
            raw = f.read(info.size)
        if len(raw) != info.size:
            raise TFCheckpointError(
                f"{path}: truncated ({info.name} needs bytes {info.offset}..{end})"
            )
        return raw

    def global_step(self) -> int | None:
        """The ``global_step`` variable's value, or None if the checkpoint has none."""
        if "global_step" not in self._entries:
            return None
        return int(self.get_tensor("global_step"))

    def close(self) -> None:
        """Closes the data files."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def list_variables(path: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``[(name, dtype name, shape)]`` of a checkpoint, as ``tf.train.list_variables`` (+dtype)."""
    reader = CheckpointReader(path)
    return [(i.name, i.dtype_name, i.shape) for i in reader.variables().values()]
