"""TF Serving's SavedModel warm-up: ``assets.extra/tf_serving_warmup_requests``, replayed.

A version folder may hold ``assets.extra/tf_serving_warmup_requests``: a TFRecord file of
``tensorflow.serving.PredictionLog`` records. As TF Serving does, up to ``MAX_RECORDS`` (1,000)
of them are replayed against the version after it loads (and after its stored check), before it
is marked AVAILABLE; each ``--num_request_iterations_for_warmup`` times. A record that fails (a
request the model refuses), a damaged file (a record cut short, or whose length or data CRC is
wrong, as TensorFlow's ``RecordReader`` checks), or more than 1,000 records fail the load, as in
TF Serving, and the version is not served. The file is read one record at a time, and a file
over ``MAX_BYTES`` (1 GiB) or a record over ``--max_body_bytes`` fails the load before it is
read: a huge (or sparse) file never fills the server's memory.

Only ``predict_log`` records are replayed (estimax's exports have the Predict API's signature);
a ``classify_log``, ``regress_log``, ``multi_inference_log`` or ``session_run_log`` record fails
the load, naming its kind. ``PredictionLog`` is read from its wire format here (its .proto pulls
in TensorFlow's session protos, which estimax does not carry): field 6 is ``predict_log``, whose
field 1 is the ``PredictRequest``. An estimax export carries such a file when it is published
with ``export_version(..., warmup_requests=...)`` (``estimax.export.warmup``).
"""

from __future__ import annotations

import itertools
import posixpath
import struct
from collections.abc import Iterator
from typing import Any

import fsspec

from estimax.data.tfrecord import masked_crc32c
from estimax.export.record import check_regular
from estimax.export.servable import Servable

# TF Serving's names and limit, where the export writes them.
from estimax.export.warmup import MAX_RECORDS, WARMUP_DIR, WARMUP_FILE
from estimax.serving.tensors import Limits, tensor_to_column

# The bytes of a warm-up file read, at most (TF Serving bounds the records, 1,000, not the
# bytes): 1,000 requests of up to 1 MiB each. A record is also at most ``--max_body_bytes``, the
# largest request the server would take. A larger file fails the load unread.
MAX_BYTES = 1 << 30

# PredictionLog's fields (tensorflow_serving/apis/prediction_log.proto).
_KINDS = {
    1: "classify_log",
    2: "regress_log",
    3: "log_metadata",
    4: "multi_inference_log",
    5: "session_run_log",
    6: "predict_log",
}
_PREDICT_LOG = 6


def warmup_path(version_path: str) -> str:
    """Where a version's warm-up records are (TF Serving's path)."""
    return posixpath.join(version_path.rstrip("/"), WARMUP_DIR, WARMUP_FILE)


def iter_records(
    path: str,
    limit: int = MAX_RECORDS,
    max_bytes: int = MAX_BYTES,
    max_record_bytes: int | None = None,
) -> Iterator[bytes]:
    """The records of the TFRecord file at ``path``, one at a time, checked as TensorFlow does.

    Each record is ``uint64 length, uint32 masked crc32c(length), data, uint32 masked
    crc32c(data)`` (little-endian). As TF Serving's reader (``tensorflow::io::RecordReader``),
    both CRCs are checked: a record whose length or data CRC is wrong raises ValueError naming
    the file and the record's number, and so does a truncated record, a file over ``max_bytes``
    (checked by its size before it is read), a record over ``max_record_bytes`` (checked by its
    declared length before its data is read) and more than ``limit`` records. The file is read
    record by record, so at most one record (``max_record_bytes``) is in memory, never the file.
    """
    fs, root = fsspec.core.url_to_fs(path)
    size = fs.size(root)
    if size is not None and size > max_bytes:
        raise ValueError(
            f"{path}: {size} bytes of warm-up records; at most {max_bytes} are read (keep "
            f"at most {limit} small requests)"
        )
    per_record = max_bytes if max_record_bytes is None else min(max_bytes, max_record_bytes)
    with fs.open(root, "rb") as f:
        at = 0
        for number in itertools.count():
            header = f.read(12)
            if not header:
                return
            if number >= limit:
                raise ValueError(
                    f"{path}: more than {limit} warm-up records (TF Serving's limit); keep at "
                    f"most {limit}"
                )
            if len(header) < 12:
                raise ValueError(f"{path}: record {number}: truncated header at byte {at}")
            length, length_crc = struct.unpack("<QI", header)
            if masked_crc32c(header[:8]) != length_crc:
                raise ValueError(f"{path}: record {number}: corrupted record (length CRC)")
            if length > per_record or at + 16 + length > max_bytes:
                raise ValueError(
                    f"{path}: record {number}: {length} bytes declared; a warm-up record is at "
                    f"most {per_record} bytes and the file at most {max_bytes}"
                )
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4:
                raise ValueError(
                    f"{path}: record {number}: truncated at byte {at} ({length} bytes declared)"
                )
            if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
                raise ValueError(f"{path}: record {number}: corrupted record (data CRC)")
            at += 16 + length
            yield data


def read_records(path: str, limit: int = MAX_RECORDS) -> list[bytes]:
    """Every record of the TFRecord file at ``path`` (``iter_records``' checks; for tests)."""
    return list(iter_records(path, limit))


def write_records(path: str, records: list[bytes]) -> None:
    """Writes ``records`` as a TFRecord file, with TFRecord's CRCs (TensorFlow reads it too)."""
    with fsspec.open(path, "wb") as f:
        for record in records:
            length = struct.pack("<Q", len(record))
            f.write(length + struct.pack("<I", masked_crc32c(length)) + record)
            f.write(struct.pack("<I", masked_crc32c(record)))


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("malformed varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, bytes | None]]:
    """``(field number, bytes)`` of a message's length-delimited fields (None: other types)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, at = _varint(data, at)
            yield number, None
        elif wire == 1:
            at += 8
            yield number, None
        elif wire == 5:
            at += 4
            yield number, None
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > len(data):
                raise ValueError("truncated field")
            yield number, data[at : at + length]
            at += length
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if at != len(data):
        raise ValueError("truncated field")


def predict_request(record: bytes) -> Any:
    """The ``PredictRequest`` of one ``PredictionLog`` record (ValueError: another kind)."""
    from estimax.serving.protos.tensorflow_serving.apis import predict_pb2

    request = None
    for number, value in _fields(record):
        if number == _PREDICT_LOG and value is not None:
            for inner, body in _fields(value):
                if inner == 1 and body is not None:
                    request = predict_pb2.PredictRequest.FromString(body)
        elif number in _KINDS and number != 3:
            raise ValueError(f"a {_KINDS[number]} record: estimax replays predict_log records only")
    if request is None:
        raise ValueError("no predict_log.request in the record")
    return request


def prediction_log(request: Any) -> bytes:
    """One ``PredictionLog`` record holding ``predict_log { request }`` (for exports and tests)."""
    body = request.SerializeToString()
    inner = b"\x0a" + _encode_varint(len(body)) + body
    return bytes([(_PREDICT_LOG << 3) | 2]) + _encode_varint(len(inner)) + inner


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def replay(servable: Servable, version_path: str, core: Limits, iterations: int = 1) -> int:
    """Replays the version's warm-up records; returns how many (0: it has none).

    Raises ValueError naming the record that failed (and why): the version is then not served.
    """
    path = warmup_path(version_path)
    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(root):
        return 0
    check_regular(fs, root, path)  # a FIFO there would block the load: refused unopened
    count = 0
    records = iter_records(path, max_record_bytes=core.options.max_body_bytes)
    for i, record in enumerate(records):  # a damaged record raises here, naming itself
        count += 1
        try:
            request = predict_request(record)
            if set(request.inputs) != set(servable.inputs):
                raise ValueError(
                    f"inputs {sorted(request.inputs)}; the model's inputs are "
                    f"{sorted(servable.inputs)}"
                )
            columns = {n: tensor_to_column(t, n, servable, core) for n, t in request.inputs.items()}
            for _ in range(iterations):
                servable.run(servable.prepare(columns, core.options.max_image_pixels))
        except Exception as e:  # noqa: BLE001 - any failure refuses the version, named
            raise ValueError(f"{path}: warm-up record {i} failed: {e}") from None
    return count
