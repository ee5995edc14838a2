"""What every protocol of ``estimax serve`` shares: one model manager, one way to take a version.

The HTTP routes (TF Serving REST, Open Inference Protocol v2 with its binary extension) and the
gRPC services (TF Serving's ``PredictionService``/``ModelService``, v2's
``GRPCInferenceService``) all turn their requests into ``{input name: batch}`` columns and call
``ServingCore.infer`` inside ``ServingCore.servable``: the same limits, the same batching queue
(one asyncio loop serves both ports), the same hot reload (a version being unloaded finishes
the requests that hold it), the same errors. ``ApiError`` carries the HTTP status TF Serving
gives an error; ``ApiError.grpc_code`` is the gRPC code of the same error (TF Serving's
``ToHTTPStatusCode`` read backwards).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from estimax.serving.batching import Batcher, BatchingOptions, QueueFullError
from estimax.serving.manager import ModelManager, VersionState
from estimax.serving.servable import InvalidInput, Servable

SIGNATURE_NAME = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"
# Accepted signature names: TF Serving's default key and the names exports are often given.
SIGNATURE_NAMES = (SIGNATURE_NAME, "classify", "predict", "")


@dataclasses.dataclass
class ServerOptions:
    """Limits and behaviour of the server (the ``estimax serve`` flags).

    Attributes:
      enable_batching: merge concurrent requests (``BatchingOptions``).
      batching: the batching knobs (also give the compiled batch sizes without batching).
      rest_api_timeout_in_ms: a request taking longer answers 504 (gRPC: DEADLINE_EXCEEDED).
      max_body_bytes: larger bodies answer 413 (gRPC messages: RESOURCE_EXHAUSTED).
      max_instances: more instances in one request answer 400.
      max_image_pixels: larger images (by their header) answer 400.
      grpc_port: the gRPC port (TF Serving's ``--port``); 0: no gRPC.
      grpc_host: the address the gRPC port binds.
    """

    enable_batching: bool = False
    batching: BatchingOptions = dataclasses.field(default_factory=BatchingOptions)
    rest_api_timeout_in_ms: int = 30_000
    max_body_bytes: int = 64 << 20
    max_instances: int = 1024
    max_image_pixels: int = 1 << 26
    grpc_port: int = 0
    grpc_host: str = "127.0.0.1"


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
}


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with ``status`` (gRPC: ``grpc_code``)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

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


class ServingCore:
    """The model manager, the limits and the batching queue behind every route and service."""

    def __init__(self, manager: ModelManager, options: ServerOptions):
        """``manager`` loads and swaps versions (started by the caller)."""
        options.batching.validate()
        self.manager = manager
        self.options = options
        self._run_pool = ThreadPoolExecutor(
            max_workers=options.batching.num_batch_threads, thread_name_prefix="run"
        )
        self._decode_pool = ThreadPoolExecutor(
            max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="decode"
        )
        self.batcher = (
            Batcher(options.batching, self._run_pool) if options.enable_batching else None
        )

    @property
    def name(self) -> str:
        """The served model's name."""
        return self.manager.name

    @contextlib.contextmanager
    def servable(self, name: str, version: str | int | None) -> Iterator[Servable]:
        """Holds a version for one request (it is not unloaded before the block ends).

        Raises:
          ApiError: 404 for an unknown model or version, 400 for a malformed version, 503 if
            versions keep being retired under the request.
        """
        if name != self.manager.name:
            req = f"Specific({name}, {version})" if version is not None else f"Latest({name})"
            raise ApiError(404, f"Servable not found for request: {req}")
        number = self.parse_version(version)
        for _ in range(3):  # a version may be retired between get() and acquire()
            servable = self.manager.get(number)
            if servable is None:
                req = f"Specific({name}, {number})" if number is not None else f"Latest({name})"
                raise ApiError(404, f"Servable not found for request: {req}")
            if servable.acquire():
                try:
                    yield servable
                finally:
                    servable.release()
                return
        raise ApiError(503, f"Model {name} is being reloaded; retry")

    @staticmethod
    def parse_version(version: str | int | None) -> int | None:
        """A request's version (None: the latest); 400 unless an integer."""
        if version is None or isinstance(version, int):
            return version
        if not version.isdigit():
            raise ApiError(400, f"Invalid version {version!r}: versions are integers")
        return int(version)

    def count(self, n: int) -> None:
        """Refuses more than ``max_instances`` instances in one request (400)."""
        if n > self.options.max_instances:
            raise ApiError(
                400,
                f"{n} instances in one request; this server accepts at most "
                f"{self.options.max_instances} (see --max_instances)",
            )

    def check_signature(self, signature: str) -> None:
        """400 for a signature name the export does not have."""
        if signature not in SIGNATURE_NAMES:
            raise ApiError(400, f'Serving signature name: "{signature}" not found in signature def')

    def states(self, name: str, version: str | int | None = None) -> list[VersionState]:
        """The versions of ``name`` (one if ``version``), newest first; 404 if none."""
        if name != self.manager.name:
            raise ApiError(404, f"Could not find any versions of model {name}")
        states = self.manager.states()
        if version is not None:
            states = [s for s in states if str(s.version) == str(version)]
            if not states:
                raise ApiError(404, f"Could not find version {version} of model {name}")
        if not states:
            raise ApiError(404, f"Could not find any versions of model {name}")
        return states

    def ready(self, name: str, version: str | int | None) -> bool:
        """Whether the model (or that version) is available; 404 for an unknown one."""
        if name != self.manager.name:
            raise ApiError(404, f"Model {name} is not served here")
        number = self.parse_version(version)
        ok = self.manager.get(number) is not None
        if number is not None and not ok:
            if number not in {s.version for s in self.manager.states()}:
                raise ApiError(404, f"Model {name} has no version {version}")
        return ok

    def available_versions(self) -> list[str]:
        """The available versions, newest first."""
        return [str(s.version) for s in self.manager.states() if s.state == "AVAILABLE"]

    def check_outputs(self, servable: Servable, wanted: list[str]) -> None:
        """400 naming the outputs the model does not have."""
        unknown = sorted(set(wanted) - set(servable.outputs))
        if unknown:
            raise ApiError(
                400,
                f"unknown outputs {unknown}; the model's outputs are {sorted(servable.outputs)}",
            )

    async def infer(self, servable: Servable, columns: dict[str, Any]) -> dict[str, np.ndarray]:
        """Prepares (decodes images) in a thread, runs (batched or not); bounded in time."""
        loop = asyncio.get_running_loop()

        async def work() -> dict[str, np.ndarray]:
            try:
                features = await loop.run_in_executor(
                    self._decode_pool, servable.prepare, columns, self.options.max_image_pixels
                )
            except InvalidInput as e:
                raise ApiError(400, str(e)) from None
            if self.batcher is not None:
                try:
                    return await self.batcher.submit(servable, servable.run, features)
                except QueueFullError as e:
                    raise ApiError(429, str(e)) from None
            return await loop.run_in_executor(self._run_pool, servable.run, features)

        try:
            return await asyncio.wait_for(work(), self.options.rest_api_timeout_in_ms / 1000)
        except TimeoutError:
            raise ApiError(
                504,
                "Request timed out after "
                f"{self.options.rest_api_timeout_in_ms} ms (--rest_api_timeout_in_ms)",
            ) from None
