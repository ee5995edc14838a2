"""Fuzzing `estimax serve` through its OpenAPI description with schemathesis: every route
(TF Serving REST and Open Inference Protocol v2) gets generated valid and invalid requests.
The entry points OpenAPI cannot describe are fuzzed with hypothesis: v2's binary tensor data
extension (a JSON header of ``Inference-Header-Content-Length`` bytes, then framed tensors) and
every gRPC method (TF Serving's ``PredictionService``/``ModelService``, v2's
``GRPCInferenceService``), with structured messages and with raw garbage bytes. Their numbers
include what ``int()`` and ``str.isdigit`` take but no tensor can: other scripts' digits and
superscripts in versions and headers, numbers past int64 and past 4,300 digits, shapes of 100
dimensions.

Asserted: no 5xx answer (schemathesis' ``not_a_server_error`` check), the server process still
running and serving afterwards, and its memory flat: the RSS after a second full fuzzing pass
within a few MiB of the RSS after the first (the first pass warms caches, compiles the
batch sizes and fills the allocator's pools).

The served model is small and fast to build (a dense layer over 32x32 RGB images) but goes
through the real raw-image path: base64 JPEGs decoded and preprocessed in the server.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest

from .conftest import scale

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import serving_fixtures as fx  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "tiny"
# The RSS may move by allocator noise; a leak of even a few hundred bytes a request over
# thousands of requests shows above this.
RSS_GROWTH_LIMIT_MIB = 24


def _fuzz(url: str, max_examples: int, seed: int, har: str) -> tuple[int, str]:
    """Runs schemathesis once over every operation; returns (requests sent, its output)."""
    # The served model's name and version in the paths: otherwise nearly every request is a
    # 404 for an unknown model and never reaches the request parsing, batching and inference.
    config = os.path.join(os.path.dirname(har), "schemathesis.toml")
    with open(config, "w") as f:
        f.write(f'[parameters]\n"path.name" = "{NAME}"\n"path.version" = "1"\n')
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "schemathesis"),
        f"--config-file={config}",
        "run",
        f"{url}/openapi.json",
        "--checks=not_a_server_error",
        f"--max-examples={max_examples}",
        f"--seed={seed}",
        "--generation-deterministic",
        "--request-timeout=30",
        "--no-color",
        "--report=har",
        f"--report-har-path={har}",
        "--continue-on-failure",
    ]
    # In the test's directory: schemathesis keeps a cache (.schemathesis/) in its cwd.
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(har)
    )
    with open(har) as f:
        entries = json.load(f)["log"]["entries"]
    assert proc.returncode == 0, proc.stdout[-6000:]
    return len(entries), proc.stdout


def test_openapi_describes_both_protocols_with_their_schemas(server):
    url = server[0]
    spec = requests.get(url + "/openapi.json", timeout=30).json()
    paths = spec["paths"]
    for path in ("/v1/models/{name}:predict", "/v2/models/{name}/infer"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body.get("properties") or body.get("oneOf") or body.get("anyOf"), (path, body)
    for path in ("/v1/models/{name}/metadata", "/v2/health/ready", "/v2/models/{name}"):
        assert "get" in paths[path]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Version 1 of the small model, exported once for the module's servers."""
    return fx.export_dense(str(tmp_path_factory.mktemp("server_fuzz")))


def _serve(exported, tmp_path_factory, extra=()):
    import shutil

    base = str(tmp_path_factory.mktemp("models"))
    shutil.copytree(os.path.join(exported, "1"), os.path.join(base, "1"))
    grpc_port = fx.free_port()
    args = [
        f"--grpc_port={grpc_port}",
        f"--model_base_path={base}",
        f"--model_name={NAME}",
        "--enable_batching",
        "--max_batch_size=8",
        "--batch_timeout_micros=2000",
        "--max_body_bytes=200000",
        "--max_image_pixels=20000",
        *extra,
    ]
    return fx.running_server(args), f"127.0.0.1:{grpc_port}", base


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    running, target, _ = _serve(exported, tmp_path_factory)
    with running as (url, proc):
        yield url, proc, target


@pytest.fixture(scope="module")
def reloading_server(exported, tmp_path_factory):
    """A server of its own that polls for versions (the binary/gRPC fuzzer publishes one)."""
    running, target, base = _serve(
        exported, tmp_path_factory, ["--file_system_poll_wait_seconds=0.2"]
    )
    with running as (url, proc):
        yield url, proc, target, base


def test_fuzzed_server_answers_no_5xx_and_memory_stays_flat(server, tmp_path, reliability_record):
    url, proc, _ = server
    examples = scale(25, 400)
    ps = psutil.Process(proc.pid)
    sent = 0
    ok = False
    try:
        first, _ = _fuzz(url, examples, 1, str(tmp_path / "first.har"))
        rss_first = ps.memory_info().rss
        second, out = _fuzz(url, examples, 2, str(tmp_path / "second.har"))
        rss_second = ps.memory_info().rss
        sent = first + second
        assert proc.poll() is None, "the server died"
        assert requests.get(url + "/v2/health/ready", timeout=30).status_code == 200
        growth = (rss_second - rss_first) / 2**20
        assert growth < RSS_GROWTH_LIMIT_MIB, (rss_first, rss_second)
        assert re.search(r"not_a_server_error\s+\d+\s*/\s*\d+ passed|passed", out), out[-3000:]
        ok = True
    finally:
        reliability_record("server", "estimax serve (schemathesis)", sent, ok)
    assert sent > 50 * 2
    # A real request still answers correctly after the storm.
    images, _ = fx.make_jpegs(1, seed=5)
    import base64

    body = {"instances": [{"b64": base64.b64encode(images[0]).decode()}]}
    r = requests.post(f"{url}/v1/models/{NAME}:predict", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert np.isclose(sum(r.json()["predictions"][0]["probabilities"]), 1.0, atol=1e-5)


# ----------------------------------------------------------------------------- binary + gRPC
def _strategies(images: list[bytes]):
    """Hypothesis strategies of near-valid requests (real JPEGs, the right names, often)."""
    from hypothesis import strategies as st

    names = st.sampled_from(["image_bytes", "image_bytes", "input", "", "x" * 300])
    v2_types = st.sampled_from(["BYTES", "BYTES", "FP32", "INT32", "BF16", "BOOL", "NOPE", ""])
    # Sizes past int64 (JSON only: protobuf refuses them) and past numpy's 64 dimensions.
    size = st.integers(-2, 12) | st.sampled_from([2**40, 2**63 - 1, 2**64, 10**30])
    dims = st.lists(size, min_size=0, max_size=3) | st.just([1] * 100)
    element = st.sampled_from(images) | st.binary(max_size=64) | st.just(b"")
    elements = st.lists(element, max_size=4)

    def framed(items: list[bytes]) -> bytes:
        return b"".join(struct.pack("<I", len(b)) + b for b in items)

    payload = elements.map(framed) | st.binary(max_size=200) | st.just(b"\xff\xff\xff\x7f")
    return st, names, v2_types, dims, elements, payload


# Versions as clients may write them: other scripts' digits and superscripts (str.isdigit and
# int() take them), numbers past int64 and past Python's 4,300-digit int() limit.
VERSIONS = ["", "1", "2", "x", "\u0661", "\u00b2", "9" * 5000, str(2**64), "0" * 25 + "1"]
HUGE = "9" * 5000  # a JSON number no int() converts


def _post_binary(url: str, b: dict, version: str) -> tuple:
    """One v2 request over HTTP with the binary tensor data extension, as ``b`` describes it."""
    tensor: dict = {"name": b["name"], "datatype": b["datatype"], "shape": b["shape"]}
    if b["size"] is not None:
        tensor["parameters"] = {"binary_data_size": b["size"]}
    head: dict = {"inputs": [tensor]}
    if b["binary_output"] is not None:
        head["parameters"] = {"binary_data_output": b["binary_output"]}
    text = json.dumps(head).encode()
    if b["huge_number"]:  # json.dumps cannot write it: spliced into the text
        text = text.replace(b'"shape": [', f'"shape": [{HUGE}, '.encode(), 1)
    headers = {
        "exact": {"Inference-Header-Content-Length": str(len(text))},
        "none": {},
        "long": {"Inference-Header-Content-Length": str(len(text) + 10**6)},
        "junk": {"Inference-Header-Content-Length": "-3"},
        "superscript": {"Inference-Header-Content-Length": "\u00b2"},
        "huge": {"Inference-Header-Content-Length": HUGE},
    }[b["header"]]
    path = f"/versions/{urllib.parse.quote(version, safe='')}" if version else ""
    r = requests.post(
        f"{url}/v2/models/{NAME}{path}/infer",
        data=text + b["payload"],
        headers=headers,
        timeout=60,
    )
    return r, head


def _int64(version: str) -> int | None:
    """The version as a ModelSpec's Int64Value can carry it, or None."""
    if version.isascii() and version.isdigit() and len(version) <= 19:
        number = int(version)
        return number if number < 2**63 else None
    return None


def test_fuzzed_binary_extension_and_grpc_answer_no_server_error(
    reloading_server, reliability_record
):
    """No 5xx over HTTP, no INTERNAL/UNKNOWN over gRPC, the server keeps answering and its
    memory stays flat over a second pass.

    Then a new version is published: the old one is unloaded only once every request that
    took it has let go, so its unloading proves that no fuzzed path kept a version acquired.
    """
    import grpc
    from hypothesis import HealthCheck, given, settings

    # The v2 messages as tritonclient ships them (the server's own copy, estimax.serving.protos
    # .kserve, cannot share this process with them); TF Serving's from estimax's protos.
    from tritonclient.grpc import service_pb2 as v2pb

    from estimax.serving.protos.tensorflow.core.framework import (
        tensor_pb2,
        tensor_shape_pb2,
    )
    from estimax.serving.protos.tensorflow_serving.apis import (
        get_model_metadata_pb2,
        get_model_status_pb2,
        model_service_pb2_grpc,
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    url, proc, target, base = reloading_server
    images, _ = fx.make_jpegs(3, seed=9)
    st, names, v2_types, dims, elements, payload = _strategies(images)
    examples = scale(40, 1500)
    sent = [0]
    bad: list = []
    channel = grpc.insecure_channel(target)
    predict = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    status = model_service_pb2_grpc.ModelServiceStub(channel)
    v2_methods = {
        m: channel.unary_unary(
            f"/inference.GRPCInferenceService/{m}",
            request_serializer=lambda x: x.SerializeToString(),
            response_deserializer=lambda b: b,
        )
        for m in ("ModelInfer", "ModelMetadata", "ModelReady")
    }
    raw_methods = [
        channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        for path in (
            "/tensorflow.serving.PredictionService/Predict",
            "/tensorflow.serving.PredictionService/GetModelMetadata",
            "/tensorflow.serving.ModelService/GetModelStatus",
            "/inference.GRPCInferenceService/ModelInfer",
            "/inference.GRPCInferenceService/ModelMetadata",
        )
    ]
    server_errors = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

    def call(what: str, fn, *args) -> None:
        sent[0] += 1
        try:
            fn(*args, timeout=60)
        except grpc.RpcError as e:
            if e.code() in server_errors or e.code() == grpc.StatusCode.UNAVAILABLE:
                bad.append((what, e.code(), e.details(), str(args)[:300]))

    binary_request = st.fixed_dictionaries(
        {
            "name": names,
            "datatype": v2_types,
            "shape": dims,
            "size": st.integers(-1, 400) | st.none() | st.just("9"),
            "payload": payload,
            "header": st.sampled_from(
                ["exact", "exact", "none", "long", "junk", "superscript", "huge"]
            ),
            "huge_number": st.sampled_from([False, False, False, True]),
            "binary_output": st.sampled_from([True, False, None, "yes"]),
        }
    )

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        binary_request,
        names,
        v2_types,
        dims,
        elements,
        st.sampled_from([-1, 0, 1, 5, 7, 14, 19, 99]),
        st.sampled_from(["tensor_content", "float_val", "string_val", "none"]),
        st.binary(max_size=120),
        st.sampled_from([NAME, NAME, "other", ""]),
        st.sampled_from(VERSIONS),
    )
    def fuzz(b, name, datatype, shape, items, tf_dtype, tf_field, garbage, model, version):
        # 1. v2 over HTTP with the binary tensor data extension.
        sent[0] += 1
        r, head = _post_binary(url, b, version)
        if r.status_code >= 500 or (r.status_code >= 400 and "error" not in r.json()):
            bad.append(("http binary", r.status_code, r.text[:300], head))

        # 2. TF Serving Predict with a TensorProto.
        request = predict_pb2.PredictRequest()
        request.model_spec.name = model
        if _int64(version) is not None:
            request.model_spec.version.value = _int64(version)
        elif version:
            request.model_spec.version_label = version
        proto = tensor_pb2.TensorProto(
            dtype=tf_dtype if tf_dtype >= 0 else 0,
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=min(d, 2**63 - 1)) for d in shape]
            ),
        )
        if tf_field == "tensor_content":
            proto.tensor_content = garbage
        elif tf_field == "float_val":
            proto.float_val.extend(float(x) for x in garbage[:16])
        elif tf_field == "string_val":
            proto.string_val.extend(items)
        request.inputs[name or "image_bytes"].CopyFrom(proto)
        call("Predict", predict.Predict, request)
        call(
            "GetModelMetadata",
            predict.GetModelMetadata,
            get_model_metadata_pb2.GetModelMetadataRequest(
                model_spec=request.model_spec,
                metadata_field=["signature_def"] if tf_field != "none" else [name],
            ),
        )
        call(
            "GetModelStatus",
            status.GetModelStatus,
            get_model_status_pb2.GetModelStatusRequest(model_spec=request.model_spec),
        )

        # 3. v2 over gRPC: typed contents or raw contents.
        infer = v2pb.ModelInferRequest(model_name=model, model_version=version)
        tensor_msg = infer.inputs.add(
            name=name, datatype=datatype, shape=[min(max(d, 0), 2**63 - 1) for d in shape]
        )
        if tf_field == "string_val":
            tensor_msg.contents.bytes_contents.extend(items)
        elif tf_field == "float_val":
            tensor_msg.contents.fp32_contents.extend(float(x) for x in garbage[:16])
        else:
            infer.raw_input_contents.append(b["payload"] if tf_field == "none" else garbage)
        call("ModelInfer", v2_methods["ModelInfer"], infer)
        call(
            "ModelMetadata",
            v2_methods["ModelMetadata"],
            v2pb.ModelMetadataRequest(name=model, version=version),
        )
        call(
            "ModelReady",
            v2_methods["ModelReady"],
            v2pb.ModelReadyRequest(name=model, version=version),
        )

        # 4. Bytes that are no message at all, to every method: the server must live on.
        for method in raw_methods:
            sent[0] += 1
            try:
                method(garbage, timeout=60)
            except grpc.RpcError as e:
                # Not a message: INVALID_ARGUMENT (or, parsed as one, whatever it asks for).
                if e.code() in server_errors or e.code() == grpc.StatusCode.UNAVAILABLE:
                    bad.append(("raw bytes", e.code(), e.details(), garbage))

    ok = False
    rss = []
    try:
        # Twice the same (derandomized) inputs: the first pass warms caches and pools, so a
        # leak per request shows as the second pass's growth.
        for _ in range(2):
            fuzz()
            rss.append(psutil.Process(proc.pid).memory_info().rss)
        assert not bad, bad[:5]
        growth = (rss[1] - rss[0]) / 2**20
        assert growth < RSS_GROWTH_LIMIT_MIB, rss
        assert proc.poll() is None, "the server died"
        assert requests.get(url + "/v2/health/ready", timeout=30).status_code == 200
        good = predict_pb2.PredictRequest()
        good.model_spec.name = NAME
        good.inputs["image_bytes"].CopyFrom(
            tensor_pb2.TensorProto(
                dtype=7,  # DT_STRING
                tensor_shape=tensor_shape_pb2.TensorShapeProto(
                    dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]
                ),
                string_val=[images[0]],
            )
        )
        response = predict.Predict(good, timeout=60)
        assert np.isclose(sum(response.outputs["probabilities"].float_val), 1.0, atol=1e-5)
        # Version 2: version 1's retirement waits for every request still holding it.
        import shutil

        shutil.copytree(os.path.join(base, "1"), os.path.join(base, ".tmp-2"))
        os.rename(os.path.join(base, ".tmp-2"), os.path.join(base, "2"))
        state = get_model_status_pb2.ModelVersionStatus.State

        def states():
            reply = status.GetModelStatus(
                get_model_status_pb2.GetModelStatusRequest(model_spec={"name": NAME}), timeout=60
            )
            return {s.version: state.Name(s.state) for s in reply.model_version_status}

        _wait(lambda: states() == {2: "AVAILABLE", 1: "END"})
        assert predict.Predict(good, timeout=60).model_spec.version.value == 2
        ok = True
    finally:
        channel.close()
        reliability_record(
            "server",
            "estimax serve (binary v2 + gRPC, hypothesis)",
            sent[0],
            ok,
            rss_mib=[round(r / 2**20, 1) for r in rss],
        )
    assert sent[0] > examples * 20


def _wait(condition, timeout=120.0):
    """Polls a condition of the server process (not a timed assertion)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)
