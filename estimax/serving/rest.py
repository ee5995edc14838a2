"""The HTTP server: TensorFlow Serving's REST API and the Open Inference Protocol v2, one port.

TF Serving (its ``http_rest_api_handler.cc`` / ``json_tensor.cc`` and REST documentation):
``GET /v1/models/NAME[/versions/N]`` (status), ``.../metadata``, ``POST ...:predict`` with row
(``instances``) or columnar (``inputs``) bodies, ``{"b64": ...}`` binary values (URL-safe base64
accepted too), ``predictions``/``outputs`` responses, ``{"error": ...}`` with its status codes.
Open Inference Protocol v2 (KServe, Triton, MLServer): ``/v2``, ``/v2/health/live|ready``,
``/v2/models/NAME[/versions/V][/ready]``, ``POST .../infer`` with typed tensors; ``BYTES``
elements are base64 strings (or ``{"b64": ...}``) of the encoded image.

Bodies are parsed by hand rather than by pydantic models because both protocols define their
own error bodies and messages (FastAPI's 422 format would break TF Serving clients); the
OpenAPI description still documents them (``openapi_extra``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import math
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from estimax.serving.batching import Batcher, BatchingOptions, QueueFullError
from estimax.serving.manager import ModelManager
from estimax.serving.servable import IMAGE_INPUT, InvalidInput, Servable

# Public (README "Public API"); not re-exported by estimax.serving, which loads no FastAPI.
__all__ = ["ApiError", "Server", "ServerOptions"]


@dataclasses.dataclass
class ServerOptions:
    """Limits and behaviour of the server (the ``estimax serve`` flags).

    Attributes:
      enable_batching: merge concurrent requests (``BatchingOptions``).
      batching: the batching knobs (also give the compiled batch sizes without batching).
      rest_api_timeout_in_ms: a request taking longer answers 504.
      max_body_bytes: larger bodies answer 413.
      max_instances: more instances in one request answer 400.
      max_image_pixels: larger images (by their header) answer 400.
    """

    enable_batching: bool = False
    batching: BatchingOptions = dataclasses.field(default_factory=BatchingOptions)
    rest_api_timeout_in_ms: int = 30_000
    max_body_bytes: int = 64 << 20
    max_instances: int = 1024
    max_image_pixels: int = 1 << 26


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


_V2_TYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
    "bfloat16": "BF16",
    "string": "BYTES",
}
_TF_TYPES = {
    "bool": "DT_BOOL",
    "uint8": "DT_UINT8",
    "uint16": "DT_UINT16",
    "uint32": "DT_UINT32",
    "uint64": "DT_UINT64",
    "int8": "DT_INT8",
    "int16": "DT_INT16",
    "int32": "DT_INT32",
    "int64": "DT_INT64",
    "float16": "DT_HALF",
    "float32": "DT_FLOAT",
    "float64": "DT_DOUBLE",
    "bfloat16": "DT_BFLOAT16",
    "string": "DT_STRING",
}
SIGNATURE_NAME = "serving_default"

_PREDICT_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "signature_name": {"type": "string"},
                        "instances": {"type": "array", "items": {}},
                        "inputs": {},
                    },
                }
            }
        },
    },
}
_TENSOR_SCHEMA = {
    "type": "object",
    "required": ["name", "shape", "datatype", "data"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string", "enum": sorted(set(_V2_TYPES.values()))},
        "parameters": {"type": "object"},
        "data": {},
    },
}
_INFER_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "id": {"type": "string"},
                        "parameters": {"type": "object"},
                        "inputs": {"type": "array", "items": _TENSOR_SCHEMA},
                        "outputs": {
                            "type": "array",
                            "items": {"type": "object", "properties": {"name": {"type": "string"}}},
                        },
                    },
                }
            }
        },
    },
}


_E = TypeVar("_E", bound=Exception)


def _on_exception(
    app: FastAPI, cls: type[_E], handler: Callable[[Request, _E], Awaitable[Response]]
) -> None:
    """Registers ``handler`` for ``cls`` (and its subclasses) with the handler's precise type."""
    # Starlette types every handler as taking any Exception, though it calls it only with
    # `cls`'s instances; this one ignore keeps each handler's argument typed as what it gets.
    app.add_exception_handler(cls, handler)  # type: ignore[arg-type]


def _json(body: Any, status: int = 200) -> Response:
    # NaN/Infinity tokens as TF Serving writes them; separators keep big arrays small.
    return Response(
        json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json"
    )


def _b64decode(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise ApiError(400, f"{where}: 'b64' must be a base64 string")
    padded = text.strip() + "=" * (-len(text.strip()) % 4)
    try:
        if "-" in padded or "_" in padded:  # URL-safe alphabet (a known TF Serving complaint)
            return base64.b64decode(padded, altchars=b"-_", validate=True)
        return base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: Unable to base64 decode") from None


def _decode_value(value: Any, where: str) -> Any:
    """Replaces {"b64": ...} objects (at any depth) by bytes."""
    if isinstance(value, dict):
        if set(value) == {"b64"}:
            return _b64decode(value["b64"], where)
        raise ApiError(
            400,
            f"{where}: unexpected object {_short(value)}; binary values are "
            'written {"b64": "..."}',
        )
    if isinstance(value, list):
        return [_decode_value(v, where) for v in value]
    return value


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) < 80 else text[:77] + "..."


def _tolist(array: np.ndarray, name: str) -> Any:
    if name.endswith("_bytes") and array.dtype.kind in "SO":
        return [{"b64": base64.b64encode(bytes(x)).decode()} for x in array.ravel()]
    return array.tolist()


class Server:
    """One model's HTTP front end (see module docstring); ``app`` is the ASGI application."""

    def __init__(self, manager: ModelManager, options: ServerOptions):
        """Builds the FastAPI app; ``manager`` loads and swaps versions (started by the caller)."""
        self.manager = manager
        self.options = options
        options.batching.validate()
        workers = options.batching.num_batch_threads
        self._run_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="run")
        self._decode_pool = ThreadPoolExecutor(
            max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="decode"
        )
        self.batcher = (
            Batcher(options.batching, self._run_pool) if options.enable_batching else None
        )
        self.app = self._build_app()

    # ----------------------------------------------------------------- plumbing
    def _servable(self, name: str, version: str | None) -> Servable:
        if name != self.manager.name:
            req = f"Specific({name}, {version})" if version else f"Latest({name})"
            raise ApiError(404, f"Servable not found for request: {req}")
        number = None
        if version is not None:
            if not version.isdigit():
                raise ApiError(400, f"Invalid version {version!r}: versions are integers")
            number = int(version)
        for _ in range(3):  # a version may be retired between get() and acquire()
            servable = self.manager.get(number)
            if servable is None:
                req = f"Specific({name}, {number})" if number is not None else f"Latest({name})"
                raise ApiError(404, f"Servable not found for request: {req}")
            if servable.acquire():
                return servable
        raise ApiError(503, f"Model {name} is being reloaded; retry")

    async def _body(self, request: Request) -> Any:
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(
                413,
                f"Request body of {declared} bytes is larger than this server "
                f"accepts ({limit} bytes; see --max_body_bytes)",
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413,
                    f"Request body is larger than this server accepts ({limit} "
                    "bytes; see --max_body_bytes)",
                )
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"JSON Parse error: {e}") from None
        except RecursionError:
            raise ApiError(400, "JSON Parse error: nested too deeply") from None

    async def _infer(self, servable: Servable, columns: dict[str, Any]) -> dict[str, np.ndarray]:
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

    def _count(self, n: int) -> None:
        if n > self.options.max_instances:
            raise ApiError(
                400,
                f"{n} instances in one request; this server accepts at most "
                f"{self.options.max_instances} (see --max_instances)",
            )

    # ----------------------------------------------------------------- TF Serving
    def status(self, name: str, version: str | None) -> dict:
        """``GET /v1/models/NAME[/versions/N]``: ``model_version_status``."""
        if name != self.manager.name:
            raise ApiError(404, f"Could not find any versions of model {name}")
        states = self.manager.states()
        if version is not None:
            states = [s for s in states if str(s.version) == version]
            if not states:
                raise ApiError(404, f"Could not find version {version} of model {name}")
        if not states:
            raise ApiError(404, f"Could not find any versions of model {name}")
        return {
            "model_version_status": [
                {
                    "version": str(s.version),
                    "state": s.state,
                    "status": {
                        "error_code": "UNKNOWN" if s.error else "OK",
                        "error_message": s.error,
                    },
                }
                for s in states
            ]
        }

    def metadata(self, name: str, version: str | None) -> dict:
        """``GET .../metadata``: the signature in TF Serving's ``SignatureDef`` JSON."""
        servable = self._servable(name, version)
        try:

            def tensors(specs: dict) -> dict:
                return {
                    n: {
                        "dtype": _TF_TYPES.get(s["dtype"], s["dtype"]),
                        "tensor_shape": {
                            "dim": [
                                {"size": str(-1 if d is None else d), "name": ""}
                                for d in s["shape"]
                            ],
                            "unknown_rank": False,
                        },
                        "name": n,
                    }
                    for n, s in specs.items()
                }

            return {
                "model_spec": {
                    "name": name,
                    "signature_name": "",
                    "version": str(servable.version),
                },
                "metadata": {
                    "signature_def": {
                        "signature_def": {
                            SIGNATURE_NAME: {
                                "inputs": tensors(servable.inputs),
                                "outputs": tensors(servable.outputs),
                                "method_name": "tensorflow/serving/predict",
                            }
                        },
                        "global_step": str(servable.global_step),
                        "preprocessing": (
                            servable.preprocessing.to_json() if servable.preprocessing else None
                        ),
                    }
                },
            }
        finally:
            servable.release()

    def _row_columns(self, servable: Servable, instances: Any) -> dict[str, Any]:
        if not isinstance(instances, list) or not instances:
            raise ApiError(400, "'instances' must be a non-empty list")
        self._count(len(instances))
        names = list(servable.inputs)
        if len(names) == 1:
            name = names[0]
            values = []
            for i, item in enumerate(instances):
                if isinstance(item, dict) and set(item) != {"b64"}:
                    if set(item) != {name}:
                        raise ApiError(
                            400,
                            f"instance {i}: keys {sorted(item)} do not match the "
                            f"model's input {name!r}",
                        )
                    item = item[name]
                values.append(_decode_value(item, f"instance {i}"))
            return {name: values}
        columns: dict[str, list] = {n: [] for n in names}
        for i, item in enumerate(instances):
            if not isinstance(item, dict) or set(item) != set(names):
                raise ApiError(400, f"instance {i}: must be an object with the keys {names}")
            for n in names:
                columns[n].append(_decode_value(item[n], f"instance {i}, input {n!r}"))
        return columns

    def _columnar(self, servable: Servable, inputs: Any) -> dict[str, Any]:
        names = list(servable.inputs)
        if isinstance(inputs, dict) and set(inputs) != {"b64"}:
            if set(inputs) != set(names):
                raise ApiError(
                    400, f"'inputs' has keys {sorted(inputs)}; the model's inputs are {names}"
                )
            columns = {n: _decode_value(inputs[n], f"input {n!r}") for n in names}
        elif len(names) == 1:
            columns = {names[0]: _decode_value(inputs, "inputs")}
        else:
            raise ApiError(400, f"'inputs' must be an object with the keys {names}")
        for n, v in columns.items():
            if not isinstance(v, list):
                raise ApiError(
                    400, f"input {n!r} must be a list (its first dimension is the batch)"
                )
            self._count(len(v))
        return columns

    async def predict(self, name: str, version: str | None, request: Request) -> dict:
        """``POST ...:predict``."""
        body = await self._body(request)
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object")
        signature = body.get("signature_name", SIGNATURE_NAME)
        if signature not in (SIGNATURE_NAME, "classify", "predict", ""):
            raise ApiError(400, f'Serving signature name: "{signature}" not found in signature def')
        if ("instances" in body) == ("inputs" in body):
            raise ApiError(
                400,
                "Not both 'inputs' and 'instances' may be given"
                if "inputs" in body
                else "Missing 'inputs' or 'instances' key",
            )
        servable = self._servable(name, version)
        try:
            row = "instances" in body
            columns = (
                self._row_columns(servable, body["instances"])
                if row
                else self._columnar(servable, body["inputs"])
            )
            outputs = await self._infer(servable, columns)
        finally:
            servable.release()
        names = list(outputs)
        if row:
            if len(names) == 1:
                return {"predictions": _tolist(outputs[names[0]], names[0])}
            lists = {n: _tolist(outputs[n], n) for n in names}
            count = len(lists[names[0]])
            return {"predictions": [{n: lists[n][i] for n in names} for i in range(count)]}
        if len(names) == 1:
            return {"outputs": _tolist(outputs[names[0]], names[0])}
        return {"outputs": {n: _tolist(outputs[n], n) for n in names}}

    # ----------------------------------------------------------------- v2
    def v2_metadata(self, name: str, version: str | None) -> dict:
        """``GET /v2/models/NAME[/versions/V]``."""
        servable = self._servable(name, version)
        try:

            def tensors(specs: dict) -> list:
                return [
                    {
                        "name": n,
                        "datatype": _V2_TYPES.get(s["dtype"], s["dtype"]),
                        "shape": [-1 if d is None else d for d in s["shape"]],
                    }
                    for n, s in specs.items()
                ]

            return {
                "name": name,
                "versions": [
                    str(s.version) for s in self.manager.states() if s.state == "AVAILABLE"
                ],
                "platform": "estimax_jax_export",
                "inputs": tensors(servable.inputs),
                "outputs": tensors(servable.outputs),
            }
        finally:
            servable.release()

    async def v2_infer(self, name: str, version: str | None, request: Request) -> dict:
        """``POST /v2/models/NAME[/versions/V]/infer``."""
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
            raise ApiError(400, "The request body must be an object with an 'inputs' list")
        servable = self._servable(name, version)
        try:
            columns: dict[str, Any] = {}
            for i, tensor in enumerate(body["inputs"]):
                column = self._v2_tensor(servable, tensor, i)
                if set(column) & set(columns):
                    raise ApiError(400, f"inputs[{i}]: input {tensor['name']!r} is given twice")
                columns.update(column)
            requested = body.get("outputs")
            wanted = list(servable.outputs)
            if requested is not None:
                if not isinstance(requested, list) or not all(
                    isinstance(o, dict) and isinstance(o.get("name"), str) for o in requested
                ):
                    raise ApiError(400, "'outputs' must be a list of {\"name\": ...} objects")
                wanted = [o["name"] for o in requested]
                unknown = sorted(set(wanted) - set(servable.outputs))
                if unknown:
                    raise ApiError(
                        400,
                        f"unknown outputs {unknown}; the model's outputs are "
                        f"{sorted(servable.outputs)}",
                    )
            outputs = await self._infer(servable, columns)
        finally:
            servable.release()
        response = {
            "model_name": name,
            "model_version": str(servable.version),
            "outputs": [
                {
                    "name": n,
                    "shape": list(outputs[n].shape),
                    "datatype": _V2_TYPES.get(str(outputs[n].dtype), str(outputs[n].dtype)),
                    "data": outputs[n].ravel().tolist(),
                }
                for n in wanted
            ],
        }
        if "id" in body:
            response["id"] = body["id"]
        return response

    def _v2_tensor(self, servable: Servable, tensor: Any, i: int) -> dict[str, Any]:
        if not isinstance(tensor, dict) or not {"name", "shape", "datatype", "data"} <= set(tensor):
            raise ApiError(400, f"inputs[{i}] must have 'name', 'shape', 'datatype' and 'data'")
        name, shape, datatype = tensor["name"], tensor["shape"], tensor["datatype"]
        if not isinstance(name, str) or name not in servable.inputs:
            raise ApiError(
                400,
                f"inputs[{i}]: unknown input {name!r}; the model's inputs are "
                f"{sorted(servable.inputs)}",
            )
        if (
            not isinstance(shape, list)
            or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ApiError(
                400, f"inputs[{i}]: 'shape' must be a non-empty list of non-negative integers"
            )
        spec = servable.inputs[name]
        want_type = _V2_TYPES.get(spec["dtype"], spec["dtype"])
        if datatype != want_type:
            raise ApiError(
                400, f"inputs[{i}]: datatype {datatype!r}; input {name!r} is {want_type}"
            )
        self._count(shape[0])
        count = math.prod(shape)
        if name == IMAGE_INPUT and servable.preprocessing is not None:
            flat = _flatten_list(tensor["data"])
            if len(shape) != 1 or len(flat) != count:
                raise ApiError(
                    400,
                    f"inputs[{i}]: shape {shape} does not match {len(flat)} "
                    "elements (BYTES inputs have shape [batch])",
                )
            return {
                name: [
                    _b64decode(
                        x["b64"] if isinstance(x, dict) and set(x) == {"b64"} else x,
                        f"inputs[{i}] element {j}",
                    )
                    for j, x in enumerate(flat)
                ]
            }
        flat = _flatten_list(tensor["data"])
        if len(flat) != count:
            raise ApiError(
                400, f"inputs[{i}]: shape {shape} needs {count} elements, got {len(flat)}"
            )
        if not all(isinstance(x, (int, float)) for x in flat):
            raise ApiError(400, f"inputs[{i}]: data must be numbers for {datatype}")
        try:
            array = np.asarray(flat).reshape(shape)
        except ValueError as e:
            raise ApiError(400, f"inputs[{i}]: {e}") from None
        return {name: array}

    # ----------------------------------------------------------------- app
    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="estimax serving",
            description="TensorFlow Serving REST API and Open Inference Protocol v2 "
            "for an estimax export.",
            version="1",
        )

        async def api_error(request: Request, exc: ApiError) -> Response:
            return _json({"error": exc.message}, exc.status)

        async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
            message = (
                f"Malformed request: {request.method} {request.url.path}"
                if exc.status_code in (404, 405)
                else str(exc.detail)
            )
            return _json({"error": message}, exc.status_code)

        async def validation_error(request: Request, exc: RequestValidationError) -> Response:
            return _json({"error": f"Malformed request: {exc.errors()}"}, 400)

        async def too_deep(request: Request, exc: RecursionError) -> Response:
            return _json({"error": "The request body is nested too deeply"}, 400)

        async def internal_error(request: Request, exc: Exception) -> Response:
            # TF Serving's Internal -> 500, still as {"error": ...}; the server keeps serving.
            return _json({"error": f"Internal: {type(exc).__name__}: {exc}"}, 500)

        _on_exception(app, Exception, internal_error)
        _on_exception(app, ApiError, api_error)
        _on_exception(app, RecursionError, too_deep)
        _on_exception(app, StarletteHTTPException, http_error)
        _on_exception(app, RequestValidationError, validation_error)

        errors: dict[int | str, dict[str, Any]] = {
            c: {
                "description": d,
                "content": {
                    "application/json": {
                        "schema": {"type": "object", "properties": {"error": {"type": "string"}}}
                    }
                },
            }
            for c, d in (
                (400, "bad request"),
                (404, "unknown model or version"),
                (413, "body too large"),
                (429, "batching queue full"),
                (504, "timed out"),
            )
        }

        @app.get("/v1/models/{name}", responses=errors)
        async def v1_status(name: str) -> Response:
            return _json(self.status(name, None))

        @app.get("/v1/models/{name}/versions/{version}", responses=errors)
        async def v1_status_version(name: str, version: str) -> Response:
            return _json(self.status(name, version))

        @app.get("/v1/models/{name}/metadata", responses=errors)
        async def v1_metadata(name: str) -> Response:
            return _json(self.metadata(name, None))

        @app.get("/v1/models/{name}/versions/{version}/metadata", responses=errors)
        async def v1_metadata_version(name: str, version: str) -> Response:
            return _json(self.metadata(name, version))

        @app.post(
            "/v1/models/{name}/versions/{version}:predict",
            responses=errors,
            openapi_extra=_PREDICT_SCHEMA,
        )
        async def v1_predict_version(name: str, version: str, request: Request) -> Response:
            return _json(await self.predict(name, version, request))

        @app.post("/v1/models/{name}:predict", responses=errors, openapi_extra=_PREDICT_SCHEMA)
        async def v1_predict(name: str, request: Request) -> Response:
            return _json(await self.predict(name, None, request))

        @app.post("/v1/models/{name}:{method}", responses=errors)
        async def v1_other(name: str, method: str) -> Response:
            raise ApiError(
                400 if method in ("classify", "regress") else 404,
                f"Malformed request: :{method} is not supported by this model; use :predict",
            )

        @app.get("/v2")
        async def v2_server() -> Response:
            return _json({"name": "estimax", "version": "0.1.0", "extensions": []})

        @app.get("/v2/health/live")
        async def v2_live() -> Response:
            return _json({"live": True})

        @app.get("/v2/health/ready")
        async def v2_ready() -> Response:
            ready = self.manager.ready()
            return _json({"ready": ready}, 200 if ready else 503)

        @app.get("/v2/models/{name}", responses=errors)
        async def v2_model(name: str) -> Response:
            return _json(self.v2_metadata(name, None))

        @app.get("/v2/models/{name}/versions/{version}", responses=errors)
        async def v2_model_version(name: str, version: str) -> Response:
            return _json(self.v2_metadata(name, version))

        async def ready(name: str, version: str | None) -> Response:
            if name != self.manager.name:
                raise ApiError(404, f"Model {name} is not served here")
            if version is not None and not version.isdigit():
                raise ApiError(400, f"Invalid version {version!r}: versions are integers")
            ok = self.manager.get(int(version) if version else None) is not None
            if (
                version is not None
                and not ok
                and int(version) not in {s.version for s in self.manager.states()}
            ):
                raise ApiError(404, f"Model {name} has no version {version}")
            return _json({"name": name, "ready": ok}, 200 if ok else 503)

        @app.get("/v2/models/{name}/ready", responses=errors)
        async def v2_model_ready(name: str) -> Response:
            return await ready(name, None)

        @app.get("/v2/models/{name}/versions/{version}/ready", responses=errors)
        async def v2_model_version_ready(name: str, version: str) -> Response:
            return await ready(name, version)

        @app.post("/v2/models/{name}/infer", responses=errors, openapi_extra=_INFER_SCHEMA)
        async def v2_infer(name: str, request: Request) -> Response:
            return _json(await self.v2_infer(name, None, request))

        @app.post(
            "/v2/models/{name}/versions/{version}/infer",
            responses=errors,
            openapi_extra=_INFER_SCHEMA,
        )
        async def v2_infer_version(name: str, version: str, request: Request) -> Response:
            return _json(await self.v2_infer(name, version, request))

        return app


def _flatten_list(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    out: list = []
    stack = [iter(data)]
    while stack:  # iterative: a deeply nested body must not overflow the stack
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out
