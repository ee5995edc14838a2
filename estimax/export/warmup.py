"""TF Serving's warm-up records in an export: ``assets.extra/tf_serving_warmup_requests``.

A version folder may carry requests that a server replays after it loads the version and
before it serves it (TF Serving's SavedModel warm-up; ``estimax serve`` does the same,
``estimax.serving.warmup``): a TFRecord file of ``tensorflow.serving.PredictionLog`` records,
each ``predict_log { request: PredictRequest }``, at most ``MAX_RECORDS``. ``export_version(...,
warmup_requests=...)`` writes it into the version before it is published, so the version and
its warm-up appear together.

The records are written from their wire format here: the TF Serving messages
(``estimax.serving.protos``) belong to the server, a layer above the export. A request is
``PredictRequest { inputs: map<string, TensorProto> }`` (no model spec: a server replays it
against the version it is loading, under the default signature); numbers go in
``tensor_content`` (little-endian, as TensorFlow's own), encoded images in ``string_val``.
The CRCs are TFRecord's own, so TensorFlow's reader (TF Serving's, on a SavedModel made from
the export) reads the file too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from estimax.data import tfrecord

# TF Serving's names (servables/tensorflow/saved_model_warmup_util).
WARMUP_DIR = "assets.extra"
WARMUP_FILE = "tf_serving_warmup_requests"
MAX_RECORDS = 1000

# TensorFlow's DataType enum (types.proto) for the dtypes an export takes.
TF_DTYPES = {
    "float32": 1,
    "float64": 2,
    "int32": 3,
    "uint8": 4,
    "int16": 5,
    "int8": 6,
    "string": 7,
    "int64": 9,
    "bool": 10,
    "bfloat16": 14,
    "uint16": 17,
    "float16": 19,
    "uint32": 22,
    "uint64": 23,
}
_PREDICT_LOG = 6  # PredictionLog.predict_log


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _shape(dims: Sequence[int]) -> bytes:
    """``tensor_shape`` (field 2): a ``TensorShapeProto`` of ``dim { size }`` entries."""
    return _field(2, b"".join(_field(2, b"\x08" + _varint(int(d))) for d in dims))


def tensor_proto(value: np.ndarray | Sequence[bytes]) -> bytes:
    """A ``TensorProto``'s bytes: encoded strings (a list of bytes: DT_STRING [N]) or an array
    of one of ``TF_DTYPES``' numeric types."""
    if not isinstance(value, np.ndarray):
        strings = [bytes(v) for v in value]
        head = b"\x08" + _varint(TF_DTYPES["string"]) + _shape([len(strings)])
        return head + b"".join(_field(8, s) for s in strings)
    name = value.dtype.name
    if name not in TF_DTYPES or name == "string":
        raise ValueError(f"an array of {name} has no TensorProto dtype estimax writes")
    content = np.ascontiguousarray(value, value.dtype.newbyteorder("<")).tobytes()
    return b"\x08" + _varint(TF_DTYPES[name]) + _shape(value.shape) + _field(4, content)


def prediction_log(inputs: Mapping[str, np.ndarray | Sequence[bytes]]) -> bytes:
    """One ``PredictionLog`` record: ``predict_log { request { inputs } }``."""
    request = b"".join(
        _field(2, _field(1, name.encode()) + _field(2, tensor_proto(value)))
        for name, value in sorted(inputs.items())
    )
    return _field(_PREDICT_LOG, _field(1, request))


def write(version_dir: str, requests: Sequence[Mapping[str, Any]]) -> str:
    """Writes ``requests`` (each ``{input name: batch}``) as the version's warm-up records;
    returns the file's path. ValueError: none, or more than ``MAX_RECORDS``."""
    if not 0 < len(requests) <= MAX_RECORDS:
        raise ValueError(
            f"warmup_requests: {len(requests)} requests; give 1 to {MAX_RECORDS} "
            "(TF Serving's limit)"
        )
    path = os.path.join(version_dir, WARMUP_DIR, WARMUP_FILE)
    with tfrecord.TFRecordWriter(path) as writer:
        for inputs in requests:
            writer.write(prediction_log(inputs))
    return path
