"""TensorFlow's ``TensorProto`` to and from the columns a ``Servable`` takes and gives.

What TF Serving's gRPC Predict sends and answers, and what a version's warm-up records hold
(``estimax.serving.warmup``): below both, so that the warm-up, which ``ServingCore`` runs
when a version loads, does not import the gRPC services, which import ``ServingCore``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from estimax.export.servable import IMAGE_INPUT, Servable
from estimax.serving.options import ServerOptions
from estimax.serving.protocol import MAX_RANK, ApiError, dtype_of, echo, numpy_dtype
from estimax.serving.protos.tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

__all__ = ["Limits", "array_to_tensor", "tensor_to_column"]


class Limits(Protocol):
    """What a request's tensors are checked against: the server's options and its per-request
    instance count (``ServingCore`` is one)."""

    options: ServerOptions

    def count(self, n: int) -> None:
        """Refuses more than ``options.max_instances`` instances in one request (400)."""


# TensorProto's typed field for each dtype (TF's tensor.proto comments; half and bfloat16 are
# their 16-bit patterns in half_val).
_VALUE_FIELD = {
    "DT_FLOAT": "float_val",
    "DT_DOUBLE": "double_val",
    "DT_INT32": "int_val",
    "DT_INT16": "int_val",
    "DT_INT8": "int_val",
    "DT_UINT8": "int_val",
    "DT_UINT16": "int_val",
    "DT_INT64": "int64_val",
    "DT_UINT32": "uint32_val",
    "DT_UINT64": "uint64_val",
    "DT_BOOL": "bool_val",
    "DT_HALF": "half_val",
    "DT_BFLOAT16": "half_val",
    "DT_STRING": "string_val",
}


def tensor_to_column(proto: Any, name: str, servable: Servable, core: Limits) -> Any:
    """A request ``TensorProto`` -> the column ``Servable.prepare`` takes (400 if unfit)."""
    where = f"input {echo(name)}"
    if name not in servable.inputs:
        raise ApiError(
            400, f"{where} is not an input of the model; its inputs are {sorted(servable.inputs)}"
        )
    want = dtype_of(servable.inputs[name]["dtype"])
    got = types_pb2.DataType.Name(proto.dtype) if proto.dtype in types_pb2.DataType.values() else ""
    if got != want.tf:
        raise ApiError(400, f"{where}: expects dtype {want.tf}, got {got or proto.dtype}")
    shape = _shape(proto.tensor_shape, where)
    core.count(shape[0])
    elements = math.prod(shape)
    dtype = numpy_dtype(want)
    if elements * dtype.itemsize > core.options.max_body_bytes:
        # What a request may make the server allocate (one value fills the whole tensor).
        raise ApiError(
            400,
            f"{where}: shape {shape} is larger than this server accepts "
            f"({core.options.max_body_bytes} bytes; see --max_body_bytes)",
        )
    if want.v2 == "BYTES":
        values = list(proto.string_val)
        if len(values) != elements or (name == IMAGE_INPUT and len(shape) != 1):
            raise ApiError(
                400,
                f"{where}: shape {shape} does not match {len(values)} string_val elements"
                + (" (image bytes have shape [batch])" if name == IMAGE_INPUT else ""),
            )
        return values
    if proto.tensor_content:
        if len(proto.tensor_content) != elements * dtype.itemsize:
            raise ApiError(
                400,
                f"{where}: tensor_content has {len(proto.tensor_content)} bytes; shape {shape} "
                f"of {want.tf} needs {elements * dtype.itemsize}",
            )
        return np.frombuffer(proto.tensor_content, dtype).reshape(shape)
    field = getattr(proto, _VALUE_FIELD[want.tf])
    if not len(field):
        flat = np.zeros(0, dtype)
    elif want.tf in ("DT_HALF", "DT_BFLOAT16"):
        bits = np.asarray(field)
        if bits.min() < 0 or bits.max() > 0xFFFF:
            raise ApiError(400, f"{where}: half_val holds 16-bit patterns (0..65535)")
        flat = bits.astype(np.uint16).view(dtype)
    else:
        # In the field's own width (int_val carries int8..uint16): Servable.prepare range-checks
        # and casts, so 300 for a uint8 input is a 400 naming the input, not an overflow.
        flat = np.asarray(field)
    if flat.size == 1 and elements != 1:  # TF fills a tensor from one given value
        flat = np.full(elements, flat[0], flat.dtype)
    if flat.size != elements:
        raise ApiError(400, f"{where}: shape {shape} needs {elements} values, got {flat.size}")
    return flat.reshape(shape)


def _shape(proto: Any, where: str) -> list[int]:
    """A ``TensorShapeProto`` as ``[batch, ...]``: known, 1 to ``MAX_RANK`` sizes >= 0."""
    if proto.unknown_rank:
        raise ApiError(400, f"{where}: the tensor's shape must be known")
    if len(proto.dim) > MAX_RANK:
        raise ApiError(
            400,
            f"{where}: the shape has {len(proto.dim)} dimensions; at most {MAX_RANK} are accepted",
        )
    shape = [int(d.size) for d in proto.dim]
    if not shape or any(d < 0 for d in shape):
        raise ApiError(400, f"{where}: shape {shape} must be [batch, ...] with sizes >= 0")
    return shape


def array_to_tensor(array: np.ndarray) -> Any:
    """An output array -> ``TensorProto`` with its values in the typed field (as TF Serving)."""
    d = dtype_of(array)
    proto = tensor_pb2.TensorProto(
        dtype=types_pb2.DataType.Value(d.tf),
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(s)) for s in array.shape]
        ),
    )
    field = getattr(proto, _VALUE_FIELD[d.tf])
    if d.v2 == "BYTES":
        field.extend(x.encode() if isinstance(x, str) else bytes(x) for x in array.ravel())
    elif d.tf in ("DT_HALF", "DT_BFLOAT16"):
        field.extend(array.ravel().view(np.uint16).tolist())
    else:
        field.extend(array.ravel().tolist())
    return proto
