"""The HTTP server: TensorFlow Serving's REST API and the Open Inference Protocol v2, one port.

Two protocols over one ``ServingCore`` (``core``: the served models, limits, batching):

* TF Serving (its ``http_rest_api_handler.cc`` / ``json_tensor.cc`` and REST documentation),
  ``TFServingRest``: ``GET /v1/models/NAME[/versions/N|/labels/L]`` (status), ``.../metadata``,
  ``POST ...:predict`` with row (``instances``) or columnar (``inputs``) bodies, ``{"b64": ...}``
  binary values (URL-safe base64 accepted too), ``predictions``/``outputs`` responses,
  ``{"error": ...}`` with its status codes.
* Open Inference Protocol v2 (KServe, Triton, MLServer), ``V2Rest``: ``/v2``,
  ``/v2/health/live|ready``, ``/v2/models/NAME[/versions/V][/ready]``, ``POST .../infer`` with
  typed tensors (``BYTES`` elements: base64 strings or ``{"b64": ...}``), and the binary tensor
  data extension both ways (``v2``: a JSON header of ``Inference-Header-Content-Length`` bytes,
  then the raw tensors), as ``tritonclient`` sends by default.

Triton's extensions of v2 are served too: statistics (``GET /v2/models[/NAME[/versions/V]]/stats``),
model configuration (``GET /v2/models/NAME[/versions/V]/config``) and classification (an output
requested with ``parameters: {"classification": k}``); and TF Serving's ``:classify``. With
``--monitoring_config_file``/``--metrics_path`` the port answers Prometheus text
(``estimax.serving.metrics``); under Vertex AI (``AIP_MODE=PREDICTION``) it also answers
``AIP_HEALTH_ROUTE`` and ``AIP_PREDICT_ROUTE`` (TF Serving's row format: ``{"instances": [...]}``
in, ``{"predictions": [...]}`` out). Every request is tracked by one middleware (``_Tracking``:
access log, metrics, statistics); each route names its protocol (its tag) and API (its name).

The gRPC services (``grpc_server``) join the same core on ``--grpc_port``; ``server`` starts and
stops them with this app (one asyncio loop, so one batching queue per model for both ports).

Bodies are parsed by hand rather than by pydantic models because both protocols define their
own error bodies and messages (FastAPI's 422 format would break TF Serving clients); the
OpenAPI description still documents them (``openapi_extra``). Large bodies (over
``bodies.INLINE_BYTES``, unless they hold few values: ``bodies.light``) are parsed in
``estimax.serving.bodies``'s worker processes and walked in a thread, and large answers written
there, so that the event loop keeps answering health checks and other requests meanwhile. The
connections' timeouts, header size limit and cap are the transport's
(``estimax.serving.transport``); a body cut off by its timeout is answered 408.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from estimax.export.servable import Servable
from estimax.serving import admission, bodies, classes, metrics, tracking, transport, v2
from estimax.serving.core import (
    PREDICT_METHOD,
    RETRY_AFTER_SECONDS,
    SIGNATURE_NAME,
    BodyBudget,
    ServingCore,
)
from estimax.serving.options import ServerOptions
from estimax.serving.protocol import (
    BY_V2,
    ECHO_CHARS,
    ApiError,
    ascii_int,
    dtype_of,
    echo,
    echo_names,
    grpc_code_of,
)
from estimax.serving.tracking import RequestRecord
from estimax.version import __version__

# The protocols, as the routes' tags (the access log's ``protocol``).
TF = "tf_serving"
V2 = "v2"
VERTEX = "vertex"

__all__ = ["ApiError", "ServerOptions", "build_app"]


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """An operation's ``openapi_extra``: a required JSON body of ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_PREDICT_SCHEMA = _json_body(
    {
        "type": "object",
        "properties": {
            "signature_name": {"type": "string"},
            "instances": {"type": "array", "items": {}},
            "inputs": {},
        },
    }
)
_CLASSIFY_SCHEMA = _json_body(
    {
        "type": "object",
        "required": ["examples"],
        "properties": {
            "signature_name": {"type": "string"},
            "context": {"type": "object"},
            "examples": {"type": "array", "items": {"type": "object"}},
        },
    }
)
_TENSOR_SCHEMA = {
    "type": "object",
    "required": ["name", "shape", "datatype", "data"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string", "enum": sorted(BY_V2)},
        "parameters": {"type": "object"},
        "data": {},
    },
}
_INFER_SCHEMA = _json_body(
    {
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
)


_E = TypeVar("_E", bound=Exception)


def _on_exception(
    app: FastAPI, cls: type[_E], handler: Callable[[Request, _E], Awaitable[Response]]
) -> None:
    """Registers ``handler`` for ``cls`` (and its subclasses) with the handler's precise type."""
    # Starlette types every handler as taking any Exception, though it calls it only with
    # `cls`'s instances; this one ignore keeps each handler's argument typed as what it gets.
    app.add_exception_handler(cls, handler)  # type: ignore[arg-type]


def _json(body: Any, status: int = 200) -> Response:
    # NaN/Infinity tokens as TF Serving writes them; compact, numpy arrays as lists.
    return Response(bodies.encode(body), status_code=status, media_type="application/json")


# The scope key read_body sets when it refuses a body before its end: the answer closes the
# connection (the rest of the body was not read).
BODY_UNREAD = "estimax.body_unread"


async def read_body(request: Request, limit: int, budget: BodyBudget | None = None) -> bytearray:
    """The whole body, refused with 413 past ``limit`` bytes (declared or streamed).

    Memory grows with the bytes received, never with the length a client declares; each
    chunk is charged to ``budget`` (the bytes of all bodies in flight, released when the
    request is answered: ``ServingCore.track``), and a body that would pass it answers 503
    with Retry-After, as a full queue does.
    """
    declared = request.headers.get("content-length")
    # Any length past the limit is too large, however many digits it has.
    length = None if declared is None else ascii_int(declared.strip(), "Content-Length", 2**63 - 1)
    if length is not None and length > limit:
        raise ApiError(
            413,
            f"Request body of {declared} bytes is larger than this server "
            f"accepts ({limit} bytes; see --max_body_bytes)",
        )
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(
            400, f"Content-Encoding {echo(encoding)} is not supported; send the body uncompressed"
        )
    # One buffer grown as the bytes come (not made at the declared size: a client declaring
    # 64 MiB and sending one byte cost the server 64 MiB): a large body is still one
    # allocation, returned to the system when freed (thousands of 64 KiB chunks held the
    # server's memory after large bodies), and growing it moves pages rather than copies.
    body = bytearray()
    record = tracking.current()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                request.scope[BODY_UNREAD] = True
                raise ApiError(
                    413,
                    f"Request body is larger than this server accepts ({limit} "
                    "bytes; see --max_body_bytes)",
                )
            if budget is not None:
                if not budget.take(len(chunk)):
                    request.scope[BODY_UNREAD] = True
                    raise ApiError(
                        503,
                        f"The server holds {budget.held} bytes of request bodies, its limit "
                        f"(--max_body_bytes_in_flight={budget.limit}); retry",
                    )
                record.body_bytes += len(chunk)
            body += chunk
    except ClientDisconnect:
        # The connection closed before the body ended: the body timeout (transport), or the
        # client left (499, TF Serving's Cancelled). Nobody reads this answer; the record does.
        if request.scope.get(transport.TIMED_OUT):
            raise ApiError(
                408, "The request's body did not all arrive in time (--rest_api_body_timeout_in_ms)"
            ) from None
        raise ApiError(
            499, "The client closed the connection before sending the whole body"
        ) from None
    return body


def _decode_value(value: Any, where: str) -> Any:
    """Replaces {"b64": ...} objects (at any depth) by bytes."""
    if isinstance(value, dict):
        if set(value) == {"b64"}:
            return v2.b64decode(value["b64"], where)
        raise ApiError(
            400,
            f"{where}: unexpected object {_short(value)}; binary values are "
            'written {"b64": "..."}',
        )
    if isinstance(value, list):
        return [_decode_value(v, where) for v in value]
    return value  # a number, a string, or numbers packed into an array (bodies.pack)


def _short(value: Any) -> str:
    text = json.dumps(value, default=lambda a: f"<{np.shape(a)} array>")
    return text if len(text) < 80 else text[:77] + "..."


def _batch(value: Any) -> bool:
    """Whether ``value`` can be a column: a list, or an array packed from one (bodies.pack)."""
    return isinstance(value, list) or (isinstance(value, np.ndarray) and value.ndim >= 1)


def _answer_value(array: np.ndarray, name: str) -> Any:
    """An output in a TF Serving answer: ``{"b64": ...}`` for ``*_bytes``, else the array."""
    if name.endswith("_bytes") and array.dtype.kind in "SO":
        return [{"b64": base64.b64encode(bytes(x)).decode()} for x in array.ravel()]
    return array  # written as lists by bodies.encode


def _predict_answer(outputs: dict[str, np.ndarray], row: bool) -> dict[str, Any]:
    """TF Serving's answer: ``predictions`` (row request) or ``outputs`` (columnar); the name
    dropped when there is one output."""
    names = list(outputs)
    if row:
        if len(names) == 1:
            return {"predictions": _answer_value(outputs[names[0]], names[0])}
        values = {n: _answer_value(outputs[n], n) for n in names}
        count = len(values[names[0]])
        return {"predictions": [{n: values[n][i] for n in names} for i in range(count)]}
    if len(names) == 1:
        return {"outputs": _answer_value(outputs[names[0]], names[0])}
    return {"outputs": {n: _answer_value(outputs[n], n) for n in names}}


def _examples(examples: list, context: dict) -> list[dict[str, list]]:
    """TF Serving's classify ``examples`` with ``context`` merged in: ``{feature: [values]}``."""
    out = []
    for i, example in enumerate(examples):
        if not isinstance(example, dict):
            raise ApiError(400, f"example {i} must be an object of features")
        shared = sorted(set(example) & set(context))
        if shared:
            raise ApiError(400, f"example {i}: features {echo_names(shared)} are also in 'context'")
        merged = {**context, **example}
        out.append({k: _feature_values(v, f"example {i}") for k, v in merged.items()})
    return out


def _json_text(text: bytes) -> Response:
    return Response(text, media_type="application/json")


def signature_json(specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tensor specs as TF Serving's ``SignatureDef`` JSON (``TensorInfo`` per name)."""
    return {
        n: {
            "dtype": dtype_of(s["dtype"]).tf,
            "tensor_shape": {
                "dim": [{"size": str(-1 if d is None else d), "name": ""} for d in s["shape"]],
                "unknown_rank": False,
            },
            "name": n,
        }
        for n, s in specs.items()
    }


class TFServingRest:
    """TensorFlow Serving's REST API (``/v1``) over a ``ServingCore``."""

    def __init__(self, core: ServingCore, json_workers: bodies.JsonWorkers):
        """Routes answer from ``core``; ``json_workers`` parse bodies and write answers."""
        self.core = core
        self.bodies = json_workers

    def status(self, name: str, version: str | None, label: str | None = None) -> dict:
        """``GET /v1/models/NAME[/versions/N|/labels/L]``: ``model_version_status``."""
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
                for s in self.core.states(name, version, label)
            ]
        }

    def metadata(self, name: str, version: str | None, label: str | None = None) -> dict:
        """``GET .../metadata``: the signature in TF Serving's ``SignatureDef`` JSON."""
        with self.core.servable(name, version, label) as servable:
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
                                "inputs": signature_json(servable.inputs),
                                "outputs": signature_json(servable.outputs),
                                "method_name": PREDICT_METHOD,
                            }
                        },
                        "global_step": str(servable.global_step),
                        "preprocessing": (
                            servable.preprocessing.to_json() if servable.preprocessing else None
                        ),
                        "class_names": servable.record.class_names,
                    }
                },
            }

    def _row_columns(self, servable: Servable, instances: Any) -> dict[str, Any]:
        if not _batch(instances) or not len(instances):
            raise ApiError(400, "'instances' must be a non-empty list")
        self.core.count(len(instances))
        names = list(servable.inputs)
        if len(names) == 1 and isinstance(instances, np.ndarray):  # numbers (bodies.pack)
            return {names[0]: instances}
        if len(names) == 1:
            name = names[0]
            values = []
            for i, item in enumerate(instances):
                if isinstance(item, dict) and set(item) != {"b64"}:
                    if set(item) != {name}:
                        raise ApiError(
                            400,
                            f"instance {i}: keys {echo_names(item)} do not match the "
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
                    400, f"'inputs' has keys {echo_names(inputs)}; the model's inputs are {names}"
                )
            columns = {n: _decode_value(inputs[n], f"input {n!r}") for n in names}
        elif len(names) == 1:
            columns = {names[0]: _decode_value(inputs, "inputs")}
        else:
            raise ApiError(400, f"'inputs' must be an object with the keys {names}")
        for n, v in columns.items():
            if not _batch(v):
                raise ApiError(
                    400, f"input {n!r} must be a list (its first dimension is the batch)"
                )
            self.core.count(len(v))
        return columns

    async def predict(
        self, name: str, version: str | None, request: Request, label: str | None = None
    ) -> Response:
        """``POST ...:predict``."""
        raw = await read_body(request, self.core.options.max_body_bytes, self.core.bodies_in_flight)
        large = not bodies.light(raw)
        body = await self.bodies.loads(raw, large=large)
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object")
        self.core.check_signature(body.get("signature_name", SIGNATURE_NAME))
        if ("instances" in body) == ("inputs" in body):
            raise ApiError(
                400,
                "Not both 'inputs' and 'instances' may be given"
                if "inputs" in body
                else "Missing 'inputs' or 'instances' key",
            )
        row = "instances" in body
        with self.core.servable(name, version, label) as servable:
            columns = await self.bodies.walk(
                large,
                self._row_columns if row else self._columnar,
                servable,
                body["instances" if row else "inputs"],
            )
            outputs = await self.core.infer(servable, columns)
        numbers = sum(int(a.size) for a in outputs.values())
        answer = await self.bodies.walk(
            numbers > bodies.INLINE_ELEMENTS, _predict_answer, outputs, row
        )
        return _json_text(await self.bodies.dumps(answer, numbers))

    async def classify(
        self, name: str, version: str | None, request: Request, label: str | None = None
    ) -> dict:
        """``POST ...:classify``: ``examples`` (+ ``context``) -> ``result`` label/score pairs."""
        raw = await read_body(request, self.core.options.max_body_bytes, self.core.bodies_in_flight)
        large = not bodies.light(raw)
        body = await self.bodies.loads(raw, large=large)
        if not isinstance(body, dict) or not isinstance(body.get("examples"), list):
            raise ApiError(400, "The request body must be an object with an 'examples' list")
        self.core.check_signature(body.get("signature_name", SIGNATURE_NAME))
        context = body.get("context", {})
        if not isinstance(context, dict):
            raise ApiError(400, "'context' must be an object of features")
        self.core.count(len(body["examples"]))
        examples = await self.bodies.walk(large, _examples, body["examples"], context)
        with self.core.servable(name, version, label) as servable:
            classes.check_classify(servable)
            columns = await self.bodies.walk(large, classes.example_columns, servable, examples)
            outputs = await self.core.infer(servable, columns)
            return {"result": classes.classify_results(servable, outputs)}

    def add_routes(self, app: FastAPI, errors: dict[int | str, dict[str, Any]]) -> None:
        """Registers the ``/v1`` routes on ``app`` (tag: the protocol; name: the API)."""
        kw: dict[str, Any] = {"responses": errors, "tags": [TF]}

        @app.get("/v1/models/{name}", name="status", **kw)
        async def v1_status(name: str) -> Response:
            return _json(self.status(name, None))

        @app.get("/v1/models/{name}/versions/{version}", name="status", **kw)
        async def v1_status_version(name: str, version: str) -> Response:
            return _json(self.status(name, version))

        @app.get("/v1/models/{name}/labels/{label}", name="status", **kw)
        async def v1_status_label(name: str, label: str) -> Response:
            return _json(self.status(name, None, label))

        @app.get("/v1/models/{name}/metadata", name="metadata", **kw)
        async def v1_metadata(name: str) -> Response:
            return _json(self.metadata(name, None))

        @app.get("/v1/models/{name}/versions/{version}/metadata", name="metadata", **kw)
        async def v1_metadata_version(name: str, version: str) -> Response:
            return _json(self.metadata(name, version))

        @app.get("/v1/models/{name}/labels/{label}/metadata", name="metadata", **kw)
        async def v1_metadata_label(name: str, label: str) -> Response:
            return _json(self.metadata(name, None, label))

        predict = {**kw, "name": "predict", "openapi_extra": _PREDICT_SCHEMA}

        @app.post("/v1/models/{name}/versions/{version}:predict", **predict)
        async def v1_predict_version(name: str, version: str, request: Request) -> Response:
            return await self.predict(name, version, request)

        @app.post("/v1/models/{name}:predict", **predict)
        async def v1_predict(name: str, request: Request) -> Response:
            return await self.predict(name, None, request)

        @app.post("/v1/models/{name}/labels/{label}:predict", **predict)
        async def v1_predict_label(name: str, label: str, request: Request) -> Response:
            return await self.predict(name, None, request, label)

        classify = {**kw, "name": "classify", "openapi_extra": _CLASSIFY_SCHEMA}

        @app.post("/v1/models/{name}/versions/{version}:classify", **classify)
        async def v1_classify_version(name: str, version: str, request: Request) -> Response:
            return _json(await self.classify(name, version, request))

        @app.post("/v1/models/{name}:classify", **classify)
        async def v1_classify(name: str, request: Request) -> Response:
            return _json(await self.classify(name, None, request))

        @app.post("/v1/models/{name}/labels/{label}:classify", **classify)
        async def v1_classify_label(name: str, label: str, request: Request) -> Response:
            return _json(await self.classify(name, None, request, label))

        @app.post("/v1/models/{name}:{method}", name="other", **kw)
        async def v1_other(name: str, method: str) -> Response:
            raise ApiError(
                400 if method == "regress" else 404,
                f"Malformed request: :{method} is not supported by this model; use :predict "
                "or :classify",
            )


class V2Rest:
    """The Open Inference Protocol v2 over HTTP, with the binary tensor data extension."""

    def __init__(self, core: ServingCore, json_workers: bodies.JsonWorkers):
        """Routes answer from ``core``; ``json_workers`` parse bodies and write answers."""
        self.core = core
        self.bodies = json_workers

    def server_metadata(self) -> dict:
        """``GET /v2``."""
        return {"name": "estimax", "version": __version__, "extensions": list(v2.HTTP_EXTENSIONS)}

    def metadata(self, name: str, version: str | None) -> dict:
        """``GET /v2/models/NAME[/versions/V]``."""
        with self.core.servable(name, version) as servable:

            def tensors(specs: dict) -> list:
                return [
                    {
                        "name": n,
                        "datatype": dtype_of(s["dtype"]).v2,
                        "shape": [-1 if d is None else d for d in s["shape"]],
                    }
                    for n, s in specs.items()
                ]

            return {
                "name": name,
                "versions": self.core.available_versions(name),
                "platform": "estimax_jax_export",
                "inputs": tensors(servable.inputs),
                "outputs": tensors(servable.outputs),
            }

    async def infer(self, name: str, version: str | None, request: Request) -> Response:
        """``POST /v2/models/NAME[/versions/V]/infer``: JSON, or JSON + binary tensors."""
        raw = await read_body(request, self.core.options.max_body_bytes, self.core.bodies_in_flight)
        header = request.headers.get(v2.HEADER_LENGTH)
        binary: bytearray | None = None
        if header is not None:
            what = f"{v2.HEADER_LENGTH} (the byte length of the JSON header)"
            length = ascii_int(header.strip(), what, len(raw))
            raw, binary = raw[:length], raw[length:]
        heavy_json = not bodies.light(raw)
        # Binary tensors are walked (split into elements) in a thread past INLINE_BYTES.
        large = heavy_json or len(binary or b"") > bodies.INLINE_BYTES
        body = await self.bodies.loads(raw, v2.check_infer_body, large=heavy_json)
        if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
            raise ApiError(400, "The request body must be an object with an 'inputs' list")
        parameters = _parameters(body, "request")
        binary_default = _flag(parameters, "binary_data_output", "request parameters")
        # Its deadline and priority (estimax.serving.admission), checked before any work.
        ticket = admission.v2_ticket(parameters, self.core.priority_levels(name))
        with admission.use(ticket), self.core.servable(name, version) as servable:
            columns = await self.bodies.walk(large, self._columns, servable, body["inputs"], binary)
            wanted, as_binary, counts = self._wanted(servable, body.get("outputs"), binary_default)
            outputs = await self.core.infer(servable, columns)
        head: dict[str, Any] = {"model_name": name, "model_version": str(servable.version)}
        if "id" in body:
            head["id"] = body["id"]
        numbers = sum(int(outputs[n].size) for n in wanted if not as_binary[n])
        head["outputs"], blobs = await self.bodies.walk(
            numbers > bodies.INLINE_ELEMENTS,
            _v2_outputs,
            servable,
            outputs,
            wanted,
            as_binary,
            counts,
        )
        text = await self.bodies.dumps(head, numbers)
        if not blobs:
            return _json_text(text)
        return Response(
            b"".join([text, *blobs]),
            media_type="application/octet-stream",
            headers={v2.HEADER_LENGTH: str(len(text))},
        )

    def _columns(
        self, servable: Servable, inputs: list, binary: bytearray | None
    ) -> dict[str, Any]:
        # First the binary data's layout (every input's slice, all bytes claimed), then decoding.
        raws = _binary_slices(inputs, binary)
        columns: dict[str, Any] = {}
        for i, (tensor, raw) in enumerate(zip(inputs, raws, strict=True)):
            name, column = v2.decode_input(
                servable,
                f"inputs[{i}]",
                tensor["name"],
                tensor["shape"],
                tensor["datatype"],
                self.core.count,
                data=tensor.get("data"),
                raw=raw,
            )
            if name in columns:
                raise ApiError(400, f"inputs[{i}]: input {echo(name)} is given twice")
            columns[name] = column
        return columns

    def _wanted(
        self, servable: Servable, requested: Any, binary_default: bool
    ) -> tuple[list[str], dict[str, bool], dict[str, int]]:
        """The outputs to answer, which in binary, and which as k classifications."""
        if requested is None:
            wanted = list(servable.outputs)
            return wanted, {n: binary_default for n in wanted}, {}
        if not isinstance(requested, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in requested
        ):
            raise ApiError(400, "'outputs' must be a list of {\"name\": ...} objects")
        wanted = [o["name"] for o in requested]
        self.core.check_outputs(servable, wanted)
        as_binary, counts = {}, {}
        for i, o in enumerate(requested):
            # Per output "binary_data"; without it the request's "binary_data_output".
            parameters = _parameters(o, f"outputs[{i}]")
            as_binary[o["name"]] = (
                _flag(parameters, "binary_data", f"outputs[{i}]")
                if "binary_data" in parameters
                else binary_default
            )
            if "classification" in parameters:
                counts[o["name"]] = classes.classification_k(
                    parameters["classification"], f"outputs[{i}]"
                )
        return wanted, as_binary, counts

    def add_routes(self, app: FastAPI, errors: dict[int | str, dict[str, Any]]) -> None:
        """Registers the ``/v2`` routes on ``app`` (tag: the protocol; name: the API)."""
        kw: dict[str, Any] = {"responses": errors, "tags": [V2]}

        @app.get("/v2", name="server_metadata", tags=[V2])
        async def v2_server() -> Response:
            return _json(self.server_metadata())

        @app.get("/v2/health/live", name="live", tags=[V2])
        async def v2_live() -> Response:
            return _json({"live": True})

        @app.get("/v2/health/ready", name="ready", tags=[V2])
        async def v2_ready() -> Response:
            ready = self.core.ready_all()
            return _json({"ready": ready}, 200 if ready else 503)

        # Before /v2/models/{name}, which would take "stats" for a model's name.
        @app.get("/v2/models/stats", name="stats", **kw)
        async def v2_all_stats() -> Response:
            return _json(self.core.statistics(None, None))

        @app.get("/v2/models/{name}", name="metadata", **kw)
        async def v2_model(name: str) -> Response:
            return _json(self.metadata(name, None))

        @app.get("/v2/models/{name}/versions/{version}", name="metadata", **kw)
        async def v2_model_version(name: str, version: str) -> Response:
            return _json(self.metadata(name, version))

        async def ready(name: str, version: str | None) -> Response:
            ok = self.core.ready(name, version)
            return _json({"name": name, "ready": ok}, 200 if ok else 503)

        @app.get("/v2/models/{name}/ready", name="ready", **kw)
        async def v2_model_ready(name: str) -> Response:
            return await ready(name, None)

        @app.get("/v2/models/{name}/versions/{version}/ready", name="ready", **kw)
        async def v2_model_version_ready(name: str, version: str) -> Response:
            return await ready(name, version)

        infer = {**kw, "name": "infer", "openapi_extra": _INFER_SCHEMA}

        @app.post("/v2/models/{name}/infer", **infer)
        async def v2_infer(name: str, request: Request) -> Response:
            return await self.infer(name, None, request)

        @app.post("/v2/models/{name}/versions/{version}/infer", **infer)
        async def v2_infer_version(name: str, version: str, request: Request) -> Response:
            return await self.infer(name, version, request)

        self._add_extension_routes(app, kw)

    def _add_extension_routes(self, app: FastAPI, kw: dict[str, Any]) -> None:
        """Triton's statistics and model configuration extensions."""

        @app.get("/v2/models/{name}/stats", name="stats", **kw)
        async def v2_stats(name: str) -> Response:
            return _json(self.core.statistics(name, None))

        @app.get("/v2/models/{name}/versions/{version}/stats", name="stats", **kw)
        async def v2_stats_version(name: str, version: str) -> Response:
            return _json(self.core.statistics(name, version))

        @app.get("/v2/models/{name}/config", name="config", **kw)
        async def v2_config(name: str) -> Response:
            return _json(self.core.model_config(name, None))

        @app.get("/v2/models/{name}/versions/{version}/config", name="config", **kw)
        async def v2_config_version(name: str, version: str) -> Response:
            return _json(self.core.model_config(name, version))

        self._add_repository_routes(app, kw)

    def _add_repository_routes(self, app: FastAPI, kw: dict[str, Any]) -> None:
        """Triton's model repository extension (``estimax.serving.control``): each route's
        name is its action in the access log and the metrics."""

        @app.post("/v2/repository/index", name="repository_index", **kw)
        async def v2_repository_index(request: Request) -> Response:
            body = await self._control_body(request)
            ready = _flag(body, "ready", "repository index request")
            return _json(self._control().index(ready))

        async def act(action: str, name: str, request: Request) -> Response:
            control = self._control()
            # The body is read first, whatever the answer: the connection stays usable.
            parameters = _parameters(await self._control_body(request), f"{action} request")
            control.check_allowed(action, name)
            await control.call(action, name, parameters)
            return Response(status_code=200)

        @app.post("/v2/repository/models/{name}/load", name="repository_load", **kw)
        async def v2_repository_load(name: str, request: Request) -> Response:
            return await act("load", name, request)

        @app.post("/v2/repository/models/{name}/unload", name="repository_unload", **kw)
        async def v2_repository_unload(name: str, request: Request) -> Response:
            return await act("unload", name, request)

    def _control(self) -> Any:
        """The server's model control (``estimax.serving.control.ModelControl``)."""
        if self.core.control is None:
            raise ApiError(501, "the model repository extension is not offered by this server")
        return self.core.control

    async def _control_body(self, request: Request) -> dict[str, Any]:
        """A repository call's JSON body (none: ``{}``); 400 unless an object."""
        raw = await read_body(request, self.core.options.max_body_bytes, self.core.bodies_in_flight)
        if not raw.strip():
            return {}
        try:
            body = json.loads(bytes(raw))
        except ValueError as e:
            raise ApiError(400, f"The request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object")
        return body


def _binary_slices(inputs: list, binary: bytearray | None) -> list[bytearray | None]:
    """Each input's raw bytes (binary tensor data extension), None for one given as ``data``."""
    raws: list[bytearray | None] = []
    offset = 0
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict) or not {"name", "shape", "datatype"} <= set(tensor):
            raise ApiError(
                400,
                f"{where} must have 'name', 'shape', 'datatype' and 'data' "
                "(or parameters.binary_data_size)",
            )
        size = _parameters(tensor, where).get("binary_data_size")
        if size is None:
            if "data" not in tensor:
                raise ApiError(
                    400,
                    f"{where} must have 'name', 'shape', 'datatype' and 'data' "
                    "(or parameters.binary_data_size)",
                )
            raws.append(None)
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ApiError(400, f"{where}: binary_data_size must be a non-negative integer")
        if binary is None:
            raise ApiError(
                400,
                f"{where}: binary_data_size is given but the request has no "
                f"{v2.HEADER_LENGTH} header (binary tensor data extension)",
            )
        if offset + size > len(binary):
            raise ApiError(
                400,
                f"{where}: binary_data_size {size} runs past the {len(binary)} bytes of "
                "binary data after the JSON header",
            )
        raws.append(binary[offset : offset + size])
        offset += size
    if binary is not None and offset != len(binary):
        raise ApiError(
            400,
            f"{len(binary) - offset} bytes of binary data after the JSON header belong to "
            "no input (their binary_data_size values add up to less)",
        )
    return raws


def _v2_outputs(
    servable: Servable,
    outputs: dict[str, np.ndarray],
    wanted: list[str],
    as_binary: dict[str, bool],
    counts: dict[str, int],
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The ``outputs`` of a v2 answer, and the raw bytes of those answered in binary."""
    tensors, blobs = [], []
    for n in wanted:
        array = outputs[n]
        if n in counts:
            array = classes.classification(array, counts[n], servable, n)
        tensor: dict[str, Any] = {
            "name": n,
            "datatype": v2.output_type(array).v2,
            "shape": list(array.shape),
        }
        if as_binary[n]:
            blobs.append(v2.encode_raw(array))
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = v2.encode_json(array)
        tensors.append(tensor)
    return tensors, blobs


def _feature_values(value: Any, where: str) -> list:
    """A classify feature (a value or a list of them) -> its values (bytes for strings)."""
    if isinstance(value, np.ndarray):  # numbers packed by bodies.pack
        value = value.tolist()
    values = value if isinstance(value, list) else [value]
    decoded = [_decode_value(v, where) for v in values]
    return [v.encode() if isinstance(v, str) else v for v in decoded]


def _parameters(obj: dict, where: str) -> dict:
    parameters = obj.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{where}: 'parameters' must be an object")
    return parameters


def _flag(parameters: dict, key: str, where: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"{where}: {key} must be true or false")
    return value


def build_app(
    core: ServingCore,
    json_workers: bodies.JsonWorkers,
    lifespan: Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]],
) -> FastAPI:
    """The REST application of both protocols over ``core`` (see module docstring).

    ``lifespan`` starts and stops what runs beside the app (``estimax.serving.server``).
    """
    app = FastAPI(
        title="estimax serving",
        description="TensorFlow Serving REST API and Open Inference Protocol v2 "
        "for an estimax export.",
        version="1",
        lifespan=lifespan,
        # Swagger UI and ReDoc load their scripts from a public CDN: off unless asked for
        # (--api_docs); /openapi.json, the description itself, stays.
        docs_url="/docs" if core.options.api_docs else None,
        redoc_url="/redoc" if core.options.api_docs else None,
        # No redirect to the path with(out) its trailing slash: Starlette builds it from the
        # client's Host header (Host: evil.example got a 307 to http://evil.example/...).
        # Such a path answers 404, as TF Serving's.
        redirect_slashes=False,
    )
    _add_error_handlers(app)
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
            (408, "the request did not all arrive in time"),
            (413, "body too large"),
            (429, "batching queue full"),
            (503, "reloading, or too many connections"),
            (504, "timed out"),
        )
    }
    tf_serving = TFServingRest(core, json_workers)
    _add_vertex_routes(app, errors, core, tf_serving)  # first: they may shadow the others' paths
    tf_serving.add_routes(app, errors)
    V2Rest(core, json_workers).add_routes(app, errors)

    async def prometheus() -> Response:
        return Response(core.metrics.exposition(), media_type=metrics.CONTENT_TYPE)

    for path in core.options.metrics_paths:
        app.add_api_route(path, prometheus, methods=["GET"], include_in_schema=False)
    app.add_middleware(_Tracking, core=core, untracked=frozenset(core.options.metrics_paths))
    return app


def refused_app(core: ServingCore) -> ASGIApp:
    """What a connection past --max_connections is answered when none could make room."""
    return _Tracking(_refused, core=core, untracked=frozenset())


def _add_vertex_routes(
    app: FastAPI, errors: dict[int | str, dict[str, Any]], core: ServingCore, tf: TFServingRest
) -> None:
    """Vertex AI's ``AIP_HEALTH_ROUTE`` and ``AIP_PREDICT_ROUTE`` (when given)."""
    kw: dict[str, Any] = {"responses": errors, "tags": [VERTEX]}
    if core.options.vertex_health_route:

        @app.get(core.options.vertex_health_route, name="health", **kw)
        async def vertex_health() -> Response:
            ready = core.ready_all()
            return _json({"ready": ready}, 200 if ready else 503)

    if core.options.vertex_predict_route:

        @app.post(
            core.options.vertex_predict_route,
            name="predict",
            openapi_extra=_PREDICT_SCHEMA,
            **kw,
        )
        async def vertex_predict(request: Request) -> Response:
            # Vertex's body is TF Serving's row format: {"instances": [...]} ->
            # {"predictions": [...]}, on the latest version of the served model.
            return await tf.predict(core.name, None, request)


async def _refused(scope: Scope, receive: Receive, send: Send) -> None:
    """503 for a request on a connection past --max_connections (every other one is busy)."""
    message = (
        "Too many connections: every one of this server's --max_connections is answering a "
        "request; retry"
    )
    tracking.current().error = message
    await Response(
        bodies.encode({"error": message}),
        status_code=503,
        media_type="application/json",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS), "Connection": "close"},
    )(scope, receive, send)


# Answers after which the connection is closed: the rest of the request was not read.
_CLOSING = (408, 413, 431, 499)


def _failed(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An ``{"error": message}`` answer; the request's record keeps the message."""
    tracking.current().error = message
    if status in _CLOSING:
        headers = {**(headers or {}), "Connection": "close"}
    return Response(
        bodies.encode({"error": message}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: ApiError) -> Response:
        headers = {}
        if exc.status in (429, 503):  # a full queue, a reload, the body budget: passing
            headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        if request.scope.get(BODY_UNREAD):  # the rest of the body was not read
            headers["Connection"] = "close"
        return _failed(exc.status, exc.message, headers or None)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        path = request.url.path
        if len(path) > ECHO_CHARS:  # a path is echoed cut, as every client string
            path = f"{path[:ECHO_CHARS]}... ({len(path)} chars)"
        message = (
            f"Malformed request: {request.method} {path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        return _failed(exc.status_code, message)

    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _failed(400, f"Malformed request: {exc.errors()}")

    async def too_deep(request: Request, exc: RecursionError) -> Response:
        return _failed(400, "The request body is nested too deeply")

    async def internal_error(request: Request, exc: Exception) -> Response:
        # TF Serving's Internal -> 500, still as {"error": ...}; the server keeps serving.
        return _json(
            {"error": ApiError(500, f"Internal: {type(exc).__name__}: {exc}").message}, 500
        )

    _on_exception(app, Exception, internal_error)
    _on_exception(app, ApiError, api_error)
    _on_exception(app, RecursionError, too_deep)
    _on_exception(app, StarletteHTTPException, http_error)
    _on_exception(app, RequestValidationError, validation_error)


class _Tracking:
    """ASGI middleware: one ``RequestRecord`` per HTTP request (``ServingCore.track``).

    The route that answered names the protocol (its tag) and the API (its name); the model comes
    from the core or, for a request refused before it asked, from the path.
    """

    def __init__(self, app: ASGIApp, core: ServingCore, untracked: frozenset[str]):
        self.app = app
        self.core = core
        self.untracked = untracked

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.untracked:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        record = RequestRecord(
            "http",
            scope["path"],
            client=f"{client[0]}:{client[1]}" if client else "",
            method=scope["method"],
        )
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with self.core.track(record):
            try:
                await self.app(scope, receive, sending)
            except Exception as e:
                record.error = record.error or f"Internal: {type(e).__name__}: {e}"
                status = 500
                raise
            finally:
                _describe(record, scope, status)


def _describe(record: RequestRecord, scope: Scope, status: int) -> None:
    """Fills in what the route and the answer tell about the request."""
    route = scope.get("route")
    if route is not None:
        record.protocol = route.tags[0] if getattr(route, "tags", None) else ""
        record.api = getattr(route, "name", "")
    if not record.model:
        record.model = scope.get("path_params", {}).get("name", "")
    record.status, record.code = status, grpc_code_of(status)
