"""What every protocol of ``estimax serve`` spells the same: errors and their codes, echoes.

``ApiError`` carries the HTTP status TF Serving gives an error; ``ApiError.grpc_code`` is the
gRPC code of the same error (TF Serving's ``ToHTTPStatusCode`` read backwards). The helpers quote
what a client sent, bounded; the dtype table spells each element type as numpy, the Open
Inference Protocol and TensorFlow do. Below every module of the server: it imports none of them.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

# Dimensions a request's tensor may have (numpy's own limit is 64; a model's inputs have few).
MAX_RANK = 32

# HTTP status -> gRPC status code name, from TF Serving's ToHTTPStatusCode (its inverse; 413 and
# 429 are what gRPC itself answers for a too-large message and a full queue).
_GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
    # Last: DEADLINE_EXCEEDED stands for 504 (HTTP_STATUS takes each code's first status).
    408: "DEADLINE_EXCEEDED",
}


_ASCII_DIGITS = re.compile(r"[0-9]+")


# What an error message echoes of one string a client sent, at most (TF Serving echoes a
# signature name or an input name whole: a 20 MiB name made a 20 MiB answer and log line).
ECHO_CHARS = 200
# Names echoed from a client's list (keys of an instance, features, inputs), at most.
ECHO_NAMES = 10
# A whole error message, at most: what no single echo bounds (a message made of many).
MESSAGE_CHARS = 4096


def clip(text: str, limit: int = 40) -> str:
    """``repr(text)``, cut to about ``limit`` characters (error messages echo what was sent)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def cut(text: Any) -> str:
    """A client's string as TF Serving's messages write it (unquoted), cut to ``ECHO_CHARS``
    with its length stated (a JSON value that is not a string, such as null, as Python writes
    it: the message is still an answer, never a 500)."""
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} chars)"


def echo(text: Any) -> str:
    """A client's string as an error message quotes it: ``repr``, cut to ``ECHO_CHARS`` with
    its length stated."""
    return clip(text if isinstance(text, str) else repr(text), ECHO_CHARS)


def echo_names(names: Iterable[Any]) -> str:
    """A client's list of names as an error message quotes it: sorted, each ``echo``-ed, the
    first ``ECHO_NAMES`` of them (how many more there are stated)."""
    shown = sorted(str(n) for n in names)
    text = ", ".join(echo(n) for n in shown[:ECHO_NAMES])
    more = f", and {len(shown) - ECHO_NAMES} more" if len(shown) > ECHO_NAMES else ""
    return f"[{text}{more}]"


def ascii_int(text: str, what: str, limit: int) -> int:
    """``text`` as a decimal integer from 0 to ``limit`` in ASCII digits; 400 otherwise.

    ``int()`` and ``str.isdigit`` also take other scripts' digits and superscripts, and ``int()``
    refuses numbers of over 4,300 digits with a ValueError: a request's numbers go through here.
    """
    if not _ASCII_DIGITS.fullmatch(text) or len(text) > len(str(limit)) or int(text) > limit:
        raise ApiError(400, f"{what} must be an integer from 0 to {limit}, got {clip(text)}")
    return int(text)


def refuse_repeated(names: Iterable[Any]) -> None:
    """400 if an output is asked for more than once.

    Each output is answered once: a request repeating one 200,000 times would make the server
    write it 200,000 times (measured: the event loop blocked for 18 s). Counted as ``names``
    come, so a repeated field is checked before anything holds it whole.
    """
    counts = collections.Counter(n for n in names if isinstance(n, str))
    repeated = sorted(n for n, k in counts.items() if k > 1)
    if repeated:
        raise ApiError(
            400, f"outputs {echo_names(repeated)} are asked for more than once; ask for each once"
        )


def grpc_code_of(status: int) -> str:
    """The canonical (gRPC) code name of an HTTP status (``OK`` for 2xx)."""
    return "OK" if 200 <= status < 300 else _GRPC_CODES.get(status, "UNKNOWN")


# gRPC code name -> the HTTP status it stands for (the first of _GRPC_CODES with that code).
HTTP_STATUS = {"OK": 200, "UNKNOWN": 500, **{c: s for s, c in reversed(_GRPC_CODES.items())}}


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with ``status`` (gRPC: ``grpc_code``)."""

    def __init__(self, status: int, message: str):
        if len(message) > MESSAGE_CHARS:  # whatever it echoes, an answer stays small
            message = f"{message[:MESSAGE_CHARS]}... ({len(message)} chars)"
        super().__init__(message)
        self.status = status
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in the JSON workers too (estimax.serving.bodies): it crosses a process.
        return (ApiError, (self.status, self.message))

    @property
    def grpc_code(self) -> str:
        """The name of the ``grpc.StatusCode`` this error is answered with over gRPC."""
        return _GRPC_CODES.get(self.status, "UNKNOWN")


@dataclasses.dataclass(frozen=True)
class DType:
    """One element type in each protocol's spelling.

    Attributes:
      numpy: the numpy dtype name (``string``: encoded bytes, numpy ``object``).
      v2: the Open Inference Protocol datatype.
      tf: TensorFlow's ``DataType`` enum name (TF Serving metadata and ``TensorProto``).
    """

    numpy: str
    v2: str
    tf: str


# The one dtype table of the server.
DTYPES = (
    DType("bool", "BOOL", "DT_BOOL"),
    DType("uint8", "UINT8", "DT_UINT8"),
    DType("uint16", "UINT16", "DT_UINT16"),
    DType("uint32", "UINT32", "DT_UINT32"),
    DType("uint64", "UINT64", "DT_UINT64"),
    DType("int8", "INT8", "DT_INT8"),
    DType("int16", "INT16", "DT_INT16"),
    DType("int32", "INT32", "DT_INT32"),
    DType("int64", "INT64", "DT_INT64"),
    DType("float16", "FP16", "DT_HALF"),
    DType("float32", "FP32", "DT_FLOAT"),
    DType("float64", "FP64", "DT_DOUBLE"),
    DType("bfloat16", "BF16", "DT_BFLOAT16"),
    DType("string", "BYTES", "DT_STRING"),
)
BY_NUMPY = {d.numpy: d for d in DTYPES}
BY_V2 = {d.v2: d for d in DTYPES}
BY_TF = {d.tf: d for d in DTYPES}


def dtype_of(name_or_array: Any) -> DType:
    """The table entry of a spec's dtype name or of an array's dtype (bytes/object: string)."""
    if isinstance(name_or_array, np.ndarray):
        kind = name_or_array.dtype.kind
        name = "string" if kind in "SOU" else name_or_array.dtype.name
    else:
        name = str(name_or_array)
    try:
        return BY_NUMPY[name]
    except KeyError:
        raise ApiError(500, f"Internal: dtype {name} has no protocol spelling") from None


def numpy_dtype(d: DType) -> np.dtype:
    """The numpy dtype of a numeric entry (little-endian, as every wire format here)."""
    if d.numpy == "string":
        return np.dtype(object)
    return np.dtype(d.numpy).newbyteorder("<")
