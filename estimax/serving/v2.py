"""Open Inference Protocol v2 tensors: decoding inputs and encoding outputs, for HTTP and gRPC.

An input tensor arrives as ``name``, ``datatype``, ``shape`` and either JSON ``data`` (flat or
nested, row-major; ``BYTES`` elements base64 strings, ``{"b64": ...}``, or raw bytes from
gRPC's typed ``contents``) or raw bytes: the binary tensor data extension's bytes after the JSON
header (``"parameters": {"binary_data_size": N}``) and gRPC's ``raw_input_contents``. Raw
tensors are little-endian, row-major; ``BYTES`` elements are each a 4-byte little-endian
length followed by the bytes (Triton's ``extension_binary_data.md``, what ``tritonclient``
sends). Outputs are encoded the same two ways.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from estimax.export.servable import IMAGE_INPUT, Servable
from estimax.serving.protocol import (
    BY_V2,
    MAX_RANK,
    ApiError,
    DType,
    dtype_of,
    echo,
    numpy_dtype,
    refuse_repeated,
)

BINARY_EXTENSION = "binary_tensor_data"
# The extensions served (Triton's names), listed by server metadata; gRPC has no binary one.
GRPC_EXTENSIONS = ("classification", "statistics", "model_configuration")
HTTP_EXTENSIONS = (BINARY_EXTENSION, *GRPC_EXTENSIONS)
HEADER_LENGTH = "Inference-Header-Content-Length"
_LENGTH = struct.Struct("<I")


def b64decode(text: Any, where: str) -> bytes:
    """Standard or URL-safe base64 (padding optional) -> bytes; 400 otherwise."""
    if not isinstance(text, str):
        raise ApiError(400, f"{where}: 'b64' must be a base64 string")
    padded = text.strip() + "=" * (-len(text.strip()) % 4)
    try:
        if "-" in padded or "_" in padded:  # URL-safe alphabet (a known TF Serving complaint)
            return base64.b64decode(padded, altchars=b"-_", validate=True)
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: Unable to base64 decode") from None


def flatten_list(data: Any) -> list | np.ndarray:
    """Nested lists -> one flat list, iteratively (a deep body must not overflow the stack).

    Numbers packed into an array (``estimax.serving.bodies.pack``) are flattened too: a packed
    body gives a flat array.
    """
    if isinstance(data, np.ndarray):
        return data.ravel()
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            if isinstance(item, np.ndarray):
                out.extend(item.ravel().tolist())
            else:
                out.append(item)
        else:
            stack.pop()
    return out


def split_bytes(raw: bytes | bytearray, where: str) -> list[bytes]:
    """BYTES elements framed as 4-byte little-endian lengths + bytes -> the elements."""
    out, offset, view = [], 0, memoryview(raw)
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ApiError(400, f"{where}: BYTES data ends inside an element's 4-byte length")
        (size,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + size > len(raw):
            raise ApiError(
                400,
                f"{where}: a BYTES element of {size} bytes runs past the tensor's {len(raw)} bytes",
            )
        out.append(bytes(view[offset : offset + size]))
        offset += size
    return out


def join_bytes(elements: Any) -> bytes:
    """The BYTES framing of ``elements`` (bytes-like objects; text as UTF-8)."""
    parts = []
    for element in elements:
        data = element.encode() if isinstance(element, str) else bytes(element)
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


INT64_MAX = 2**63 - 1


def check_infer_body(body: Any) -> None:
    """The checks of an infer body that need no model: run where the body is parsed (in the
    JSON workers for large ones), so a body repeating an output 200,000 times is refused
    before the server holds 200,000 objects for it."""
    outputs = body.get("outputs") if isinstance(body, dict) else None
    if isinstance(outputs, list):
        refuse_repeated(o.get("name") for o in outputs if isinstance(o, dict))


def check_shape(shape: Any, where: str) -> list[int]:
    """A v2 shape: 1 to ``MAX_RANK`` integers from 0 to int64's largest (400 otherwise)."""
    if (
        not isinstance(shape, list)
        or not shape
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= INT64_MAX for d in shape
        )
    ):
        raise ApiError(
            400,
            f"{where}: 'shape' must be a non-empty list of integers from 0 to {INT64_MAX}",
        )
    if len(shape) > MAX_RANK:
        raise ApiError(
            400, f"{where}: 'shape' has {len(shape)} dimensions; at most {MAX_RANK} are accepted"
        )
    return shape


def decode_input(
    servable: Servable,
    where: str,
    name: Any,
    shape: Any,
    datatype: Any,
    count: Callable[[int], None],
    *,
    data: Any = None,
    raw: bytes | bytearray | None = None,
) -> tuple[str, Any]:
    """One input tensor -> ``(input name, column)`` for ``Servable.prepare``.

    Args:
      servable: the version the request runs on (its inputs are checked).
      where: how errors name the tensor (``inputs[0]``).
      count: called with the batch size (``ServingCore.count``).
      data: JSON/typed elements (nested lists allowed); or
      raw: the tensor's raw bytes.

    Raises:
      ApiError: 400 naming what is wrong.
    """
    if not isinstance(name, str) or name not in servable.inputs:
        raise ApiError(
            400,
            f"{where}: unknown input {echo(name)}; the model's inputs are "
            f"{sorted(servable.inputs)}",
        )
    shape = check_shape(shape, where)
    spec_type = dtype_of(servable.inputs[name]["dtype"])
    if datatype != spec_type.v2:
        raise ApiError(400, f"{where}: datatype {echo(datatype)}; input {name!r} is {spec_type.v2}")
    count(shape[0])
    elements = math.prod(shape)
    if spec_type.v2 == "BYTES":
        if raw is not None:
            values: list = split_bytes(raw, where)
        else:
            values = [
                x
                if isinstance(x, (bytes, bytearray))
                else _bytes_element(x, f"{where} element {j}")
                for j, x in enumerate(flatten_list(data))
            ]
        if len(values) != elements or (name == IMAGE_INPUT and len(shape) != 1):
            raise ApiError(
                400,
                f"{where}: shape {shape} does not match {len(values)} elements"
                + (" (BYTES inputs have shape [batch])" if name == IMAGE_INPUT else ""),
            )
        return name, values
    return name, _numbers(where, shape, spec_type, data, raw)


def _numbers(
    where: str, shape: list[int], spec_type: DType, data: Any, raw: bytes | bytearray | None
) -> np.ndarray:
    """A numeric input tensor from its raw bytes or its JSON/typed elements."""
    elements = math.prod(shape)
    dtype = numpy_dtype(spec_type)
    if raw is not None:
        if len(raw) != elements * dtype.itemsize:
            raise ApiError(
                400,
                f"{where}: shape {shape} of {spec_type.v2} needs {elements * dtype.itemsize} "
                f"bytes, got {len(raw)}",
            )
        return np.frombuffer(raw, dtype).reshape(shape)
    flat = flatten_list(data)
    if len(flat) != elements:
        raise ApiError(400, f"{where}: shape {shape} needs {elements} elements, got {len(flat)}")
    if isinstance(flat, np.ndarray):
        numbers = flat.dtype.kind in "biuf"
    else:
        numbers = all(isinstance(x, (int, float)) for x in flat)
    if not numbers:
        raise ApiError(400, f"{where}: data must be numbers for {spec_type.v2}")
    return np.asarray(flat).reshape(shape)


def _bytes_element(x: Any, where: str) -> bytes:
    if isinstance(x, dict) and set(x) == {"b64"}:
        x = x["b64"]
    return b64decode(x, where)


def output_type(array: np.ndarray) -> DType:
    """The v2 datatype of an output array."""
    return dtype_of(array)


def encode_raw(array: np.ndarray) -> bytes:
    """An output's raw bytes (little-endian numbers, or framed BYTES elements)."""
    if dtype_of(array).v2 == "BYTES":
        return join_bytes(array.ravel())
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def encode_json(array: np.ndarray) -> list | np.ndarray:
    """An output's JSON ``data`` (flat, row-major; text as strings, other BYTES as base64).

    Numbers stay an array (flat): ``estimax.serving.bodies.encode`` writes it as a list.
    """
    if array.dtype.kind == "U":  # class names, classification strings
        return array.ravel().tolist()
    if dtype_of(array).v2 == "BYTES":
        return [base64.b64encode(bytes(x)).decode() for x in array.ravel()]
    return array.ravel()


def known_datatype(datatype: Any) -> bool:
    """Whether ``datatype`` is a v2 datatype name."""
    return isinstance(datatype, str) and datatype in BY_V2
