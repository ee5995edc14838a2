"""TF Serving's SavedModel warm-up: ``assets.extra/tf_serving_warmup_requests``, replayed.

A version folder may hold ``assets.extra/tf_serving_warmup_requests``: a TFRecord file of
``tensorflow.serving.PredictionLog`` records. As TF Serving does, up to ``MAX_RECORDS`` (1,000)
of them are replayed against the version after it loads (and after its stored check), before it
is marked AVAILABLE; each ``--num_request_iterations_for_warmup`` times. A record that fails (a
request the model refuses), a damaged file, or more than 1,000 records fail the load, as in TF
Serving, and the version is not served.

Only ``predict_log`` records are replayed (estimax's exports have the Predict API's signature);
a ``classify_log``, ``regress_log``, ``multi_inference_log`` or ``session_run_log`` record fails
the load, naming its kind. ``PredictionLog`` is read from its wire format here (its .proto pulls
in TensorFlow's session protos, which estimax does not carry): field 6 is ``predict_log``, whose
field 1 is the ``PredictRequest``. An estimax export carries such a file when it is published
with ``export_version(..., warmup_requests=...)`` (``estimax.export.warmup``).
"""

from __future__ import annotations

import posixpath
import struct
from collections.abc import Iterator
from typing import Any

import fsspec

from estimax.export.record import check_regular
from estimax.export.servable import Servable

# TF Serving's names and limit, where the export writes them.
from estimax.export.warmup import MAX_RECORDS, WARMUP_DIR, WARMUP_FILE
from estimax.serving.tensors import Limits, tensor_to_column

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


def read_records(path: str, limit: int = MAX_RECORDS) -> list[bytes]:
    """The records of the TFRecord file at ``path`` (ValueError: damaged, or over ``limit``).

    Each record is ``uint64 length, uint32 crc, data, uint32 crc`` (little-endian); lengths are
    checked, CRCs are not (a truncated or mis-framed file is refused, not a flipped bit).
    """
    with fsspec.open(path, "rb") as f:
        data = f.read()
    records: list[bytes] = []
    at = 0
    while at < len(data):
        if len(data) - at < 12:
            raise ValueError(f"{path}: truncated TFRecord header at byte {at}")
        (length,) = struct.unpack_from("<Q", data, at)
        end = at + 12 + length + 4
        if end > len(data):
            raise ValueError(f"{path}: truncated TFRecord at byte {at} ({length} bytes declared)")
        records.append(data[at + 12 : at + 12 + length])
        at = end
        if len(records) > limit:
            raise ValueError(
                f"{path}: more than {limit} warm-up records (TF Serving's limit); keep at most "
                f"{limit}"
            )
    return records


def write_records(path: str, records: list[bytes]) -> None:
    """Writes ``records`` as a TFRecord file (CRCs zero: readers here do not check them)."""
    with fsspec.open(path, "wb") as f:
        for record in records:
            f.write(struct.pack("<QI", len(record), 0) + record + struct.pack("<I", 0))


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
    records = read_records(path)
    for i, record in enumerate(records):
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
    return len(records)
