"""gRPC for ``estimax serve --grpc_port``: TF Serving's services and the v2 inference service.

* ``tensorflow.serving.PredictionService``: ``Predict`` (``TensorProto`` in and out; image bytes
  in ``string_val``; numbers in the typed ``*_val`` fields or ``tensor_content``) and
  ``GetModelMetadata`` (the ``signature_def`` as a packed ``SignatureDefMap``), as TF Serving's
  ``tensorflow-serving-api`` clients call them on its port 8500; ``Classify`` (``tf.Example``
  inputs, a label and score per class: ``estimax.serving.classes``). ``Regress`` and
  ``MultiInference`` answer UNIMPLEMENTED.
* ``tensorflow.serving.ModelService``: ``GetModelStatus``, ``HandleReloadConfigRequest``
  (``estimax.serving.registry``: models added, removed, relabelled).

A ``ModelSpec`` names a model of the server and a version, a version label
(``version_label``: the model's ``version_labels``) or neither (the newest).
* ``inference.GRPCInferenceService`` (Triton's ``grpc_service.proto``, a superset of KServe's
  ``grpc_predict_v2.proto``; what ``tritonclient.grpc`` calls): ``ServerLive``, ``ServerReady``,
  ``ModelReady``, ``ServerMetadata``, ``ModelMetadata``, ``ModelInfer`` (typed ``contents`` or
  ``raw_input_contents`` in; ``raw_output_contents`` out; the ``classification`` output
  parameter), and Triton's ``ModelStatistics``, ``ModelConfig`` and model repository
  (``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``:
  ``estimax.serving.control``); the others (shared memory, trace, logging) answer
  UNIMPLEMENTED.

Every call goes through ``ServingCore`` as the HTTP routes do (same versions, batching queue,
limits and errors); errors are answered with the gRPC code of the HTTP status TF Serving gives
them (``ApiError.grpc_code``); a full batching queue's RESOURCE_EXHAUSTED carries
``grpc-retry-pushback-ms`` in its trailing metadata (gRPC's retry pushback, the twin of HTTP's
``Retry-After``). Each call is tracked as the HTTP requests are (``ServingCore.track``). The
server runs on the HTTP server's asyncio loop (``grpc.aio``).
Messages come from the published .proto files (``estimax.serving.protos``); no TensorFlow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, json_format
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from estimax.export.servable import Servable
from estimax.serving import admission, classes, tracking, v2
from estimax.serving.core import PREDICT_METHOD, RETRY_AFTER_SECONDS, SIGNATURE_NAME, ServingCore
from estimax.serving.protocol import (
    HTTP_STATUS,
    ApiError,
    dtype_of,
    echo,
    echo_names,
    refuse_repeated,
)
from estimax.serving.protos.tensorflow.core.framework import tensor_shape_pb2, types_pb2
from estimax.serving.protos.tensorflow.core.protobuf import meta_graph_pb2
from estimax.serving.protos.tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_management_pb2,
    model_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from estimax.serving.protos.triton import grpc_service_pb2 as pb_v2
from estimax.serving.protos.triton import grpc_service_pb2_grpc as grpc_v2
from estimax.serving.tensors import array_to_tensor, tensor_to_column
from estimax.serving.tracking import RequestRecord
from estimax.version import __version__

_T = TypeVar("_T")


def _fail(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Ends the RPC with ``code`` (the handler then returns None).

    Not ``context.abort``: grpcio keeps the ``AbortError`` it raises, and with it every frame
    it passed through and their locals (the request, what was parsed from it) for the life of
    the server: measured, 23 MB per refused request that repeated an output 200,000 times.
    """
    context.set_code(code)
    context.set_details(message)
    if metadata:
        context.set_trailing_metadata(metadata)


async def _answer(context: grpc.aio.ServicerContext, call: Awaitable[_T]) -> _T | None:
    """Awaits ``call``; an ApiError ends the RPC with its gRPC code, anything else INTERNAL."""
    try:
        return await call
    except ApiError as e:
        status, code, message = e.status, e.grpc_code, e.message
    except Exception as e:  # noqa: BLE001 - the server keeps serving; the client learns why
        status, code, message = (
            500,
            "INTERNAL",
            ApiError(500, f"Internal: {type(e).__name__}: {e}").message,
        )
    # Out of the except block: nothing refers to the exception and its frames any more.
    tracking.current().fail(status, code, message)
    pushback = (("grpc-retry-pushback-ms", str(RETRY_AFTER_SECONDS * 1000)),)
    _fail(context, getattr(grpc.StatusCode, code), message, pushback if status == 429 else ())
    return None


def _tensor_info(name: str, spec: dict[str, Any]) -> Any:
    return meta_graph_pb2.TensorInfo(
        name=name,
        dtype=types_pb2.DataType.Value(dtype_of(spec["dtype"]).tf),
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[
                tensor_shape_pb2.TensorShapeProto.Dim(size=-1 if s is None else int(s))
                for s in spec["shape"]
            ]
        ),
    )


def _spec(spec: Any) -> tuple[int | None, str | None]:
    """A ``ModelSpec``'s version choice: ``(version, None)``, ``(None, label)`` or neither."""
    if spec.WhichOneof("version_choice") == "version_label":
        return None, spec.version_label
    return (spec.version.value if spec.HasField("version") else None), None


def _model_spec(name: str, servable: Servable) -> Any:
    spec = model_pb2.ModelSpec(name=name, signature_name=SIGNATURE_NAME)
    spec.version.value = int(servable.version or 0)
    return spec


# ----------------------------------------------------------------------------- TF Serving
class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    """TF Serving's ``PredictionService`` (``Predict``, ``GetModelMetadata``)."""

    def __init__(self, core: ServingCore):
        """Answers from ``core``."""
        self.core = core

    async def Predict(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """``Predict``: ``inputs`` map of TensorProto -> ``outputs`` (``output_filter`` kept)."""
        return await _answer(context, self._predict(request))

    async def _predict(self, request: Any) -> Any:
        spec = request.model_spec
        self.core.check_signature(spec.signature_name)
        with self.core.servable(spec.name, *_spec(spec)) as servable:
            if set(request.inputs) != set(servable.inputs):
                raise ApiError(
                    400,
                    f"inputs {echo_names(request.inputs)} given; the model's inputs are "
                    f"{sorted(servable.inputs)}",
                )
            columns = {
                n: tensor_to_column(t, n, servable, self.core) for n, t in request.inputs.items()
            }
            refuse_repeated(request.output_filter)  # before the field is copied
            wanted = list(request.output_filter) or list(servable.outputs)
            self.core.check_outputs(servable, wanted)
            outputs = await self.core.infer(servable, columns)
            response = predict_pb2.PredictResponse(model_spec=_model_spec(spec.name, servable))
        for n in wanted:
            response.outputs[n].CopyFrom(array_to_tensor(outputs[n]))
        return response

    async def GetModelMetadata(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """``GetModelMetadata``: ``metadata["signature_def"]`` holds a ``SignatureDefMap``."""
        return await _answer(context, self._metadata(request))

    async def _metadata(self, request: Any) -> Any:
        fields = list(request.metadata_field)
        if fields != ["signature_def"]:
            raise ApiError(
                400,
                f"Metadata field(s) {echo_names(fields)} not supported; ask for ['signature_def']",
            )
        spec = request.model_spec
        with self.core.servable(spec.name, *_spec(spec)) as servable:
            signature = meta_graph_pb2.SignatureDef(method_name=PREDICT_METHOD)
            for n, s in servable.inputs.items():
                signature.inputs[n].CopyFrom(_tensor_info(n, s))
            for n, s in servable.outputs.items():
                signature.outputs[n].CopyFrom(_tensor_info(n, s))
            signatures = get_model_metadata_pb2.SignatureDefMap()
            signatures.signature_def[SIGNATURE_NAME].CopyFrom(signature)
            packed = any_pb2.Any()
            packed.Pack(signatures)
            response = get_model_metadata_pb2.GetModelMetadataResponse(
                model_spec=_model_spec(spec.name, servable)
            )
            response.model_spec.signature_name = ""
            response.metadata["signature_def"].CopyFrom(packed)
            return response

    async def Classify(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """``Classify``: ``tf.Example`` inputs -> a ``Class`` (label, score) per class id."""
        return await _answer(context, self._classify(request))

    async def _classify(self, request: Any) -> Any:
        spec = request.model_spec
        self.core.check_signature(spec.signature_name)
        examples = _examples(request.input)
        self.core.count(len(examples))
        with self.core.servable(spec.name, *_spec(spec)) as servable:
            classes.check_classify(servable)
            columns = classes.example_columns(servable, examples)
            outputs = await self.core.infer(servable, columns)
            response = classification_pb2.ClassificationResponse(
                model_spec=_model_spec(spec.name, servable)
            )
            for row in classes.classify_results(servable, outputs):
                response.result.classifications.add().classes.extend(
                    classification_pb2.Class(label=label, score=score) for label, score in row
                )
            return response

    async def Regress(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: exports have no regression signature."""
        await _unimplemented(context, "Regress")

    async def MultiInference(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """UNIMPLEMENTED: exports have a predict signature."""
        await _unimplemented(context, "MultiInference")


async def _unimplemented(context: grpc.aio.ServicerContext, method: str) -> None:
    _fail(
        context,
        grpc.StatusCode.UNIMPLEMENTED,
        f"{method} is not supported: estimax exports have a predict signature; call Predict "
        "(or Classify)",
    )


def _examples(proto: Any) -> list[dict[str, list]]:
    """A ``tensorflow.serving.Input`` -> its examples, ``{feature: [values]}``, context merged."""
    kind = proto.WhichOneof("kind")
    if kind == "example_list":
        examples, context = list(proto.example_list.examples), None
    elif kind == "example_list_with_context":
        examples = list(proto.example_list_with_context.examples)
        context = proto.example_list_with_context.context
    else:
        raise ApiError(400, "Input is empty: give example_list or example_list_with_context")
    shared = _features(context) if context is not None else {}
    out = []
    for i, example in enumerate(examples):
        features = _features(example)
        overlap = sorted(set(features) & set(shared))
        if overlap:
            raise ApiError(
                400, f"example {i}: features {echo_names(overlap)} are also in the context"
            )
        out.append({**shared, **features})
    return out


def _features(example: Any) -> dict[str, list]:
    """A ``tf.Example``'s features -> ``{name: [values]}``."""
    out = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        out[name] = list(getattr(feature, kind).value) if kind else []
    return out


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    """TF Serving's ``ModelService``: ``GetModelStatus`` and ``HandleReloadConfigRequest``."""

    def __init__(self, core: ServingCore):
        """Answers from ``core``."""
        self.core = core

    async def GetModelStatus(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """The state of every version (or of the one asked for)."""
        return await _answer(context, self._status(request))

    async def HandleReloadConfigRequest(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Serves ``request.config`` (a ``ModelServerConfig``), as a new model config file is.

        Answers once the new models are loaded; a config refused answers INVALID_ARGUMENT with
        its reason (the old one is kept). A ``--model_config_file`` polled later wins.
        """
        return await _answer(context, self._reload(request))

    async def _reload(self, request: Any) -> Any:
        reload = self.core.reload_config
        if reload is None:
            raise ApiError(501, "HandleReloadConfigRequest is not offered by this server")
        try:
            # Loading new models blocks: in a thread, not on the loop that answers requests.
            await asyncio.get_running_loop().run_in_executor(None, reload, request.config)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        response = model_management_pb2.ReloadConfigResponse()
        response.status.SetInParent()  # error_code 0: tensorflow.error.Code OK
        return response

    async def _status(self, request: Any) -> Any:
        spec = request.model_spec
        states = self.core.states(spec.name, *_spec(spec))
        state_enum = get_model_status_pb2.ModelVersionStatus.State
        response = get_model_status_pb2.GetModelStatusResponse()
        for s in states:
            status = response.model_version_status.add(
                version=s.version, state=state_enum.Value(s.state)
            )
            status.status.error_code = 2 if s.error else 0  # tensorflow.error.Code UNKNOWN / OK
            status.status.error_message = s.error
        return response


# ----------------------------------------------------------------------------- v2
class InferenceService(grpc_v2.GRPCInferenceServiceServicer):
    """The Open Inference Protocol's ``GRPCInferenceService``."""

    def __init__(self, core: ServingCore):
        """Answers from ``core``."""
        self.core = core

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """Always live while it answers."""
        return pb_v2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """Ready once some version is available."""
        return pb_v2.ServerReadyResponse(ready=self.core.ready_all())

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """Whether the model (or that version) is available; NOT_FOUND for an unknown one."""

        async def ready() -> Any:
            return pb_v2.ModelReadyResponse(
                ready=self.core.ready(request.name, request.version or None)
            )

        return await _answer(context, ready())

    async def ServerMetadata(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Name, version, the extensions served over gRPC."""
        return pb_v2.ServerMetadataResponse(
            name="estimax", version=__version__, extensions=v2.GRPC_EXTENSIONS
        )

    async def ModelMetadata(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Inputs and outputs with v2 datatypes (-1: any size)."""

        async def metadata() -> Any:
            with self.core.servable(request.name, request.version or None) as servable:

                def tensors(specs: dict) -> list:
                    return [
                        pb_v2.ModelMetadataResponse.TensorMetadata(
                            name=n,
                            datatype=dtype_of(s["dtype"]).v2,
                            shape=[-1 if d is None else int(d) for d in s["shape"]],
                        )
                        for n, s in specs.items()
                    ]

                return pb_v2.ModelMetadataResponse(
                    name=request.name,
                    versions=self.core.available_versions(request.name),
                    platform="estimax_jax_export",
                    inputs=tensors(servable.inputs),
                    outputs=tensors(servable.outputs),
                )

        return await _answer(context, metadata())

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """Inference: ``raw_input_contents`` (all inputs) or typed ``contents``."""
        return await _answer(context, self._infer(request))

    async def _infer(self, request: Any) -> Any:
        raw = list(request.raw_input_contents)
        if raw and len(raw) != len(request.inputs):
            raise ApiError(
                400,
                f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: raw contents "
                "must be given for every input or none",
            )
        # Its deadline and priority (estimax.serving.admission), checked before any work.
        parameters = {
            k: _parameter(request.parameters[k])
            for k in ("priority", "timeout")
            if k in request.parameters
        }
        ticket = admission.v2_ticket(parameters, self.core.priority_levels(request.model_name))
        with (
            admission.use(ticket),
            self.core.servable(request.model_name, request.model_version or None) as servable,
        ):
            columns: dict[str, Any] = {}
            for i, tensor in enumerate(request.inputs):
                where = f"inputs[{i}]"
                name, column = v2.decode_input(
                    servable,
                    where,
                    tensor.name,
                    list(tensor.shape),
                    tensor.datatype,
                    self.core.count,
                    data=None if raw else _contents(tensor, where),
                    raw=raw[i] if raw else None,
                )
                if name in columns:
                    raise ApiError(400, f"{where}: input {echo(name)} is given twice")
                columns[name] = column
            refuse_repeated(o.name for o in request.outputs)  # before the field is copied
            wanted = [o.name for o in request.outputs] or list(servable.outputs)
            self.core.check_outputs(servable, wanted)
            counts = {
                o.name: classes.classification_k(
                    _parameter(o.parameters["classification"]), f"outputs[{i}]"
                )
                for i, o in enumerate(request.outputs)
                if "classification" in o.parameters
            }
            outputs = await self.core.infer(servable, columns)
            version = str(servable.version)
        response = pb_v2.ModelInferResponse(
            model_name=request.model_name, model_version=version, id=request.id
        )
        for n in wanted:
            array = outputs[n]
            if n in counts:
                array = classes.classification(array, counts[n], servable, n)
            response.outputs.add(
                name=n, datatype=v2.output_type(array).v2, shape=[int(s) for s in array.shape]
            )
            response.raw_output_contents.append(v2.encode_raw(array))
        return response

    async def ModelStatistics(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Triton's statistics extension (the HTTP route's JSON, as the message)."""

        async def statistics() -> Any:
            stats = self.core.statistics(request.name or None, request.version or None)
            return json_format.ParseDict(stats, pb_v2.ModelStatisticsResponse())

        return await _answer(context, statistics())

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """Triton's model configuration extension (the HTTP route's JSON, as the message)."""

        async def config() -> Any:
            model = self.core.model_config(request.name, request.version or None)
            return json_format.ParseDict({"config": model}, pb_v2.ModelConfigResponse())

        return await _answer(context, config())

    async def RepositoryIndex(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Triton's repository index (``estimax.serving.control``)."""

        async def index() -> Any:
            entries = _control(self.core).index(request.ready)
            return json_format.ParseDict({"models": entries}, pb_v2.RepositoryIndexResponse())

        return await _answer(context, index())

    async def RepositoryModelLoad(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Loads (or reloads) a model, with ``parameters["config"]``'s override."""
        return await _answer(context, self._control_call("load", request))

    async def RepositoryModelUnload(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """Unloads a model (its requests in flight end first, within --unload_drain_secs)."""
        return await _answer(context, self._control_call("unload", request))

    async def _control_call(self, action: str, request: Any) -> Any:
        control = _control(self.core)
        control.check_allowed(action, request.model_name)
        parameters = {}
        for key, p in request.parameters.items():
            kind = p.WhichOneof("parameter_choice")
            if key.startswith("file:") or kind == "bytes_param" and key != "config":
                raise ApiError(400, f"failed to {action}: parameter {echo(key)} is not taken")
            parameters[key] = getattr(p, kind) if kind else None
        await control.call(action, request.model_name, parameters)
        if action == "load":
            return pb_v2.RepositoryModelLoadResponse()
        return pb_v2.RepositoryModelUnloadResponse()


def _control(core: ServingCore) -> Any:
    """The server's model control (``estimax.serving.control.ModelControl``)."""
    if core.control is None:
        raise ApiError(501, "the model repository extension is not offered by this server")
    return core.control


def _parameter(p: Any) -> Any:
    """An ``InferParameter``'s value (whichever field is set)."""
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


# InferTensorContents' field for each v2 datatype (the protocol's table).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _contents(tensor: Any, where: str) -> list:
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        # FP16/BF16 have no typed field: the protocol sends them in raw_input_contents only.
        raise ApiError(400, f"{where}: datatype {echo(tensor.datatype)} needs raw_input_contents")
    return list(getattr(tensor.contents, field))


class _Collect:
    """Takes what a generated ``add_*Servicer_to_server`` registers, to register it changed."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the same handlers come to ``add_registered_method_handlers``."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Keeps ``{method: RpcMethodHandler}`` of ``service``."""
        self.services[service] = handlers


class _Malformed:
    """A request body that is not the method's message (parsed lazily into an answer)."""

    def __init__(self, error: str):
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    # grpcio answers a message that fails to parse with INTERNAL and logs a traceback each
    # time (megabytes under a fuzzer); it is the client's mistake: INVALID_ARGUMENT, no log.
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Malformed(str(e))

    return parse


def _checked(
    core: ServingCore, service: str, method: str, behavior: Callable[[Any, Any], Awaitable[Any]]
) -> Callable[..., Awaitable[Any]]:
    """``behavior`` tracked as one request (``ServingCore.track``), malformed messages refused."""
    protocol = "tf_serving" if service.startswith("tensorflow.serving.") else "v2"
    route = f"/{service}/{method}"

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        record = RequestRecord(
            "grpc", route, client=context.peer() or "", protocol=protocol, api=method
        )
        with core.track(record):
            try:
                record.model = _model_of(request)
                if isinstance(request, _Malformed):
                    message = f"The request is not a valid message: {request.error}"
                    return _fail(context, grpc.StatusCode.INVALID_ARGUMENT, message)
                # The call's deadline bounds its wait and run (estimax.serving.admission).
                with admission.use(admission.grpc_ticket(context.time_remaining())):
                    return await behavior(request, context)
            finally:
                _outcome(record, context)

    return call


def _model_of(request: Any) -> str:
    """The model a request names, whichever service's message it is."""
    if isinstance(request, _Malformed):
        return ""
    for field in ("model_spec", "model_name", "name"):
        value = getattr(request, field, None)
        if value is not None:
            return value if isinstance(value, str) else value.name
    return ""


def _outcome(record: RequestRecord, context: grpc.aio.ServicerContext) -> None:
    """The record's status from the call's code (unless ``_answer`` already set it)."""
    code = context.code()
    name = code.name if isinstance(code, grpc.StatusCode) else "OK"
    if name != "OK" and record.code == "OK":
        record.fail(HTTP_STATUS.get(name, 500), name, context.details() or "")


def _handler(core: ServingCore, service: str, method: str, generated: Any) -> Any:
    """The served handler of one method: tracked, lenient parsing; UNIMPLEMENTED if not ours."""
    behavior = generated.unary_unary
    route = f"/{service}/{method}"

    async def unimplemented(request: Any, context: grpc.aio.ServicerContext) -> None:
        _fail(context, grpc.StatusCode.UNIMPLEMENTED, f"{route} is not served by estimax")

    if behavior is None:  # Triton's streaming ModelStreamInfer
        return grpc.stream_stream_rpc_method_handler(
            unimplemented,
            request_deserializer=generated.request_deserializer,
            response_serializer=generated.response_serializer,
        )
    if behavior.__module__.endswith("_pb2_grpc"):  # the generated servicer's placeholder
        behavior = unimplemented
    return grpc.unary_unary_rpc_method_handler(
        _checked(core, service, method, behavior),
        request_deserializer=_lenient(generated.request_deserializer),
        response_serializer=generated.response_serializer,
    )


async def _refuse_malformed(request: Any, context: grpc.aio.ServicerContext) -> None:
    """Ends a call whose request is no message (``_lenient``) with INVALID_ARGUMENT."""
    if isinstance(request, _Malformed):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"The request is not a valid message: {request.error}",
        )


class HealthService(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` (Kubernetes' gRPC probes, load balancers).

    The service ``""`` (the server) and the names of the services served here are SERVING once
    every model served has a version available: loaded, compiled, its stored check passed and
    its warm-up records replayed (``manager``). A model's name is SERVING once that model has
    one. Any other name: ``Check`` answers NOT_FOUND, ``Watch`` SERVICE_UNKNOWN (the
    protocol's answers for a service the server does not know; a model removed from the
    configuration is one).
    """

    SERVICES = (
        "",
        "tensorflow.serving.PredictionService",
        "tensorflow.serving.ModelService",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
    )
    # How often ``Watch`` looks for a change.
    WATCH_INTERVAL_S = 1.0

    def __init__(self, core: ServingCore):
        """Answers from ``core``'s models."""
        self.core = core

    def _status(self, service: str) -> int | None:
        status = health_pb2.HealthCheckResponse
        model = self.core.models.get(service)
        if model is not None:
            ready = model.manager.ready()
        elif service in self.SERVICES:
            ready = self.core.ready_all()
        else:
            return None
        return status.SERVING if ready else status.NOT_SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """The service's status now; NOT_FOUND for an unknown service."""
        await _refuse_malformed(request, context)
        status = self._status(request.service)
        if status is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown service {echo(request.service)}"
            )
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """The status now, then each change, until the client goes away."""
        await _refuse_malformed(request, context)
        last = -1
        while True:
            status = self._status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await asyncio.sleep(self.WATCH_INTERVAL_S)


async def start(core: ServingCore, host: str, port: int) -> grpc.aio.Server:
    """Starts the services on ``host:port`` in the running loop; returns the server."""
    limit = core.options.max_body_bytes
    limits = core.options.limits
    own: list[tuple[str, int | str]] = [
        # The HTTP body limit bounds a gRPC message too (RESOURCE_EXHAUSTED past it).
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", -1),
        # The HTTP port's header timeout and connection cap, in gRPC's terms: a connection
        # that has not finished its HTTP/2 handshake by then is closed (gRPC's default
        # waits 120 s), and connections past the cap are refused.
        ("grpc.server_handshake_timeout_ms", max(1, round(limits.header_timeout_s * 1000))),
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        # grpcio shares a port with another process by default (SO_REUSEPORT): a second
        # server on the same --grpc_port would silently get half the calls.
        ("grpc.so_reuseport", 0),
    ]
    given = dict(core.options.grpc_arguments)  # --grpc_channel_arguments: the operator's word
    server = grpc.aio.server(
        options=[(k, v) for k, v in own if k not in given] + list(given.items()),
        # --grpc_max_threads: TF Serving's gRPC thread quota answers RESOURCE_EXHAUSTED past
        # it ("Server Threadpool Exhausted"); grpc.aio's bound does the same.
        maximum_concurrent_rpcs=core.options.grpc_max_concurrent_rpcs or None,
    )
    collect = _Collect()
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(core), collect
    )
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(core), collect)
    grpc_v2.add_GRPCInferenceServiceServicer_to_server(InferenceService(core), collect)
    for service, handlers in collect.services.items():
        handlers = {method: _handler(core, service, method, h) for method, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)
    # Probes are not requests: not counted, not in the access log. A probe that is no message
    # (a service name that is no UTF-8) is INVALID_ARGUMENT, as for every other service.
    health = _Collect()
    health_pb2_grpc.add_HealthServicer_to_server(HealthService(core), health)
    for service, handlers in health.services.items():
        handlers = {
            method: h._replace(request_deserializer=_lenient(h.request_deserializer))
            for method, h in handlers.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server


__all__ = [
    "HealthService",
    "InferenceService",
    "ModelService",
    "PredictionService",
    "array_to_tensor",
    "start",
    "tensor_to_column",
]
