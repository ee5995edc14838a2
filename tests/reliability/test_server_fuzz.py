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
within ``RSS_GROWTH_LIMIT_MIB`` (24 MiB) of the RSS after the first (the first pass warms
caches, compiles the batch sizes and fills the allocator's pools); with
``DECLARED_CONNECTIONS`` (50) bodies of 64 MiB declared and one byte sent, less than
``DECLARED_RSS_BOUND_MIB`` (64 MiB, one such body) of growth. The families of hostile strings
(CR/LF, ESC, C1, bytes that are no UTF-8, very long) in the path, headers (raw-socket too),
JSON keys and values, the binary extension's JSON header and every gRPC string field also
assert one access line per request and every log line a record of its own. `make reliability`'s
report prints each family's RSS beside its bound.

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
def exported(tmp_path_factory, dense_export):
    """Version 1 of the small model, exported once for the module's servers."""
    return dense_export(str(tmp_path_factory.mktemp("server_fuzz")))


def _serve(exported, tmp_path_factory, extra=(), log_path=None):
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
    return fx.running_server(args, log_path=log_path), f"127.0.0.1:{grpc_port}", base


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    """The fuzzed server (one start for the schemathesis and the binary/gRPC fuzzers, in that
    order): it polls for versions (the binary/gRPC fuzzer publishes one at its end), its access
    log (JSON lines) and its log in files to count."""
    root = tmp_path_factory.mktemp("reloading")
    access, log = str(root / "access.jsonl"), str(root / "server.log")
    flags = [
        "--file_system_poll_wait_seconds=0.2",
        f"--access_log_file={access}",
        "--access_log_format=json",
    ]
    running, target, base = _serve(exported, tmp_path_factory, flags, log_path=log)
    with running as (url, proc):
        yield url, proc, target, base, access, log


def test_fuzzed_server_answers_no_5xx_and_memory_stays_flat(server, tmp_path, reliability_record):
    url, proc = server[:2]
    # Each pass's coverage phase sends the same ~700 schema-derived requests whatever this is;
    # the fuzzing phase adds this many examples per operation.
    examples = scale(5, 400)
    ps = psutil.Process(proc.pid)
    sent = 0
    ok = False
    rss: list[int] = []
    try:
        first, _ = _fuzz(url, examples, 1, str(tmp_path / "first.har"))
        rss_first = ps.memory_info().rss
        second, out = _fuzz(url, examples, 2, str(tmp_path / "second.har"))
        rss_second = ps.memory_info().rss
        rss = [rss_first, rss_second]
        sent = first + second
        assert proc.poll() is None, "the server died"
        assert requests.get(url + "/v2/health/ready", timeout=30).status_code == 200
        growth = (rss_second - rss_first) / 2**20
        assert growth < RSS_GROWTH_LIMIT_MIB, (rss_first, rss_second)
        assert re.search(r"not_a_server_error\s+\d+\s*/\s*\d+ passed|passed", out), out[-3000:]
        ok = True
    finally:
        reliability_record(
            "server",
            "estimax serve (schemathesis)",
            sent,
            ok,
            rss_mib=[round(r / 2**20, 1) for r in rss],
            rss_growth_bound_mib=RSS_GROWTH_LIMIT_MIB,
        )
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


# Where a hostile string goes in the binary extension's JSON header, and bytes that are no
# UTF-8 (an overlong '/', an encoded surrogate, a lone continuation byte, Latin-1), spliced
# into the JSON text where RAW_MARK stands (json.dumps cannot write them).
HOSTILE_AT = [None, None, "name", "datatype", "param_key", "param_value", "request_param",
              "output", "id"]  # fmt: skip
RAW_MARK = "\x01RAW\x01"
NOT_UTF8 = [b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80", b"caf\xe9"]


HEADER_KINDS = ["exact", "none", "long", "junk", "superscript", "huge", "esc", "c1", "arabic",
                "not_utf8", "plus", "inner_space", "hex", "digits_60k",
                "past_header_limit"]  # fmt: skip


def _binary_header(b: dict, text: bytes) -> dict:
    """The ``Inference-Header-Content-Length`` header ``b["header"]`` names (values as bytes
    where Latin-1 cannot carry them; requests refuses CR/LF, the raw-socket test sends those)."""
    exact = str(len(text))
    return {
        "exact": exact,
        "none": None,
        "long": str(len(text) + 10**6),
        "junk": "-3",
        "superscript": "\u00b2",
        "huge": HUGE,
        "esc": b"\x1b[2J" + exact.encode(),
        "c1": b"\xc2\x9b" + exact.encode(),
        "arabic": "\u0663".encode(),  # a digit to str.isdigit, none to HTTP
        "not_utf8": b"\xff" + exact.encode(),
        "plus": "+" + exact,
        "inner_space": exact[:1] + " " + exact[1:],
        "hex": "0x10",
        "digits_60k": "1" * 60_000,  # under --max_header_bytes: parsed, refused
        "past_header_limit": "1" * 70_000,  # 431 before any route
    }[b["header"]]


def _post_binary(url: str, b: dict, version: str) -> tuple:
    """One v2 request over HTTP with the binary tensor data extension, as ``b`` describes it."""
    tensor: dict = {"name": b["name"], "datatype": b["datatype"], "shape": b["shape"]}
    if b["size"] is not None:
        tensor["parameters"] = {"binary_data_size": b["size"]}
    head: dict = {"inputs": [tensor]}
    if b["binary_output"] is not None:
        head["parameters"] = {"binary_data_output": b["binary_output"]}
    hostile, at = b["hostile"], b["hostile_at"]
    if at in ("name", "datatype"):
        tensor[at] = hostile
    elif at == "param_key":
        tensor.setdefault("parameters", {})[hostile] = 1
    elif at == "param_value":
        tensor.setdefault("parameters", {})["binary_data_size"] = hostile
    elif at == "request_param":
        head.setdefault("parameters", {})[hostile] = hostile
    elif at == "output":
        head["outputs"] = [{"name": hostile, "parameters": {"binary_data": hostile}}]
    elif at == "id":
        head["id"] = hostile
    text = json.dumps(head).encode().replace(b"\\u0001RAW\\u0001", b["raw"])
    if b["huge_number"]:  # json.dumps cannot write it: spliced into the text
        text = text.replace(b'"shape": [', f'"shape": [{HUGE}, '.encode(), 1)
    value = _binary_header(b, text)
    headers = {} if value is None else {"Inference-Header-Content-Length": value}
    path = f"/versions/{urllib.parse.quote(version, safe='')}" if version else ""
    r = requests.post(
        f"{url}/v2/models/{NAME}{path}/infer",
        data=text + b["payload"],
        headers=headers,
        timeout=60,
    )
    return r, head


def _refused_by_transport(r) -> bool:
    """Answered before any route (no access line): 431 (headers past --max_header_bytes), or
    uvicorn's parser's 400 for bytes HTTP forbids."""
    return r.status_code == 431 or r.text == "Invalid HTTP request received."


def _error_json(r) -> bool:
    """Whether an answer's body is estimax's ``{"error": ...}``."""
    try:
        return "error" in r.json()
    except ValueError:
        return False


def _int64(version: str) -> int | None:
    """The version as a ModelSpec's Int64Value can carry it, or None."""
    if version.isascii() and version.isdigit() and len(version) <= 19:
        number = int(version)
        return number if number < 2**63 else None
    return None


def test_fuzzed_binary_extension_and_grpc_answer_no_server_error(server, reliability_record):
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

    url, proc, target, base, access, log = server
    images, _ = fx.make_jpegs(3, seed=9)
    st, names, v2_types, dims, elements, payload = _strategies(images)
    examples = scale(40, 1500)
    sent, refused = [0], [0]
    bad: list = []
    lines_before = len(_lines(access))
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

    def post_binary(b: dict, version: str) -> None:
        sent[0] += 1
        r, head = _post_binary(url, b, version)
        if _refused_by_transport(r):
            refused[0] += 1
        elif r.status_code >= 500 or (r.status_code >= 400 and not _error_json(r)):
            bad.append(("http binary", r.status_code, r.text[:300], str(head)[:300]))
        elif r.status_code >= 400 and len(r.content) > 16_000:  # an echo is cut
            bad.append(("http binary: echoed whole", len(r.content), str(head)[:300]))

    def sweep() -> None:
        """Every hostile string at every place of the JSON header, and every kind of header
        value, once each in an otherwise valid request (the fuzzer then mixes them)."""
        frame = struct.pack("<I", len(images[0])) + images[0]
        valid = {
            "name": "image_bytes",
            "datatype": "BYTES",
            "shape": [1],
            "size": len(frame),
            "payload": frame,
            "header": "exact",
            "huge_number": False,
            "binary_output": None,
            "hostile_at": None,
            "hostile": "",
            "raw": b"",
        }
        places = [at for at in HOSTILE_AT if at]
        hostile = [h for h in HOSTILE if len(h) < 100_000] + [RAW_MARK]
        for i, (at, text) in enumerate((at, text) for at in places for text in hostile):
            raw = NOT_UTF8[i % len(NOT_UTF8)]
            post_binary({**valid, "hostile_at": at, "hostile": text, "raw": raw}, "")
        for kind in HEADER_KINDS:
            post_binary({**valid, "header": kind}, "")

    binary_request = st.fixed_dictionaries(
        {
            "name": names,
            "datatype": v2_types,
            "shape": dims,
            "size": st.integers(-1, 400) | st.none() | st.just("9"),
            "payload": payload,
            "header": st.sampled_from(["exact", "exact", *HEADER_KINDS]),
            "huge_number": st.sampled_from([False, False, False, True]),
            "binary_output": st.sampled_from([True, False, None, "yes"]),
            # CR/LF, ESC, C1, lone surrogates, 70,000 characters; or bytes no UTF-8.
            "hostile_at": st.sampled_from(HOSTILE_AT),
            "hostile": st.sampled_from([h for h in HOSTILE if len(h) < 100_000] + [RAW_MARK]),
            "raw": st.sampled_from(NOT_UTF8),
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
        post_binary(b, version)

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
            sweep()
            fuzz()
            rss.append(psutil.Process(proc.pid).memory_info().rss)
        assert not bad, bad[:5]
        growth = (rss[1] - rss[0]) / 2**20
        assert growth < RSS_GROWTH_LIMIT_MIB, rss
        assert proc.poll() is None, "the server died"
        # One access line per request that reached a route (each a whole JSON record), and
        # every line of the server's log a record of its own, with no raw control character.
        expected = lines_before + sent[0] - refused[0]
        fx.wait_until(lambda: len(_lines(access)) >= expected, f"{expected} access lines")
        access_lines = _lines(access)
        assert len(access_lines) == expected, (len(access_lines), expected)
        assert all(len(line) < 8000 and json.loads(line) for line in access_lines)
        _assert_log_lines(log)
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
            rss_growth_bound_mib=RSS_GROWTH_LIMIT_MIB,
        )
    assert sent[0] > examples * 20


def _wait(condition, timeout=120.0):
    """Polls a condition of the server process (not a timed assertion)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


# ----------------------------------------------------------------------------- hostile strings
# What a client controls, made hostile: CR/LF (a forged log line), ESC and C1 sequences (a
# terminal tailing the log runs them), Unicode line separators, lone surrogates and bytes that
# are no UTF-8, and very long strings (echoed whole, they made 20 MiB answers and log lines).
FORGED = "2026-01-01 00:00:00,000 INFO estimax.serving.manager: FORGED"
HOSTILE = [
    f"x\r\n{FORGED}",
    "\x1b[2J\x1b]0;owned\x07",
    "\x9b31m\u2028\u2029",
    "\r",
    "\udc80\ud800",
    "caf\u00e9\x00",
    "s" * 70_000,
    "k" * 3_000_000,
]
# The RSS bound of the declared-but-unsent bodies: CONNECTIONS declaring 64 MiB each (3.2 GiB
# declared) may grow the server by less than one such body.
DECLARED_CONNECTIONS = 50
DECLARED_RSS_BOUND_MIB = 64
# Every line of the server's own log: a record's start (the logging format, uvicorn's), or the
# start-up banner. A line forged by a client would be none of these, or start FORGED's way.
_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ |INFO: |WARNING: |Serving ")


@pytest.fixture(scope="module")
def hostile_server(exported, tmp_path_factory):
    """A server of its own, its access log (JSON lines) and its log in files to count."""
    root = tmp_path_factory.mktemp("hostile")
    access, log = str(root / "access.jsonl"), str(root / "server.log")
    import shutil

    base = str(tmp_path_factory.mktemp("hostile_models"))
    shutil.copytree(os.path.join(exported, "1"), os.path.join(base, "1"))
    grpc_port = fx.free_port()
    target = f"127.0.0.1:{grpc_port}"
    args = [
        f"--grpc_port={grpc_port}",
        f"--model_base_path={base}",
        f"--model_name={NAME}",
        f"--access_log_file={access}",
        "--access_log_format=json",
        "--max_image_pixels=20000",
    ]
    with fx.running_server(args, log_path=log) as (url, proc):
        yield url, proc, target, access, log


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return f.read().splitlines()


def _assert_log_lines(path: str) -> None:
    """Every line of a server's log is a record of its own (none forged by a client), bounded,
    and holds no raw control character (a terminal tailing it runs none)."""
    for line in _lines(path):
        assert _LOG_LINE.match(line), f"a line of its own: {line[:300]!r}"
        assert len(line) < 16_000 and not re.search("[\x00-\x1f\x7f\x9b]", line), line[:300]


def _quote(text: str) -> str:
    """``text`` in a URL path: percent-encoded, lone surrogates as the bytes 0x80 0xFF (no
    UTF-8)."""
    raw = text.encode("utf-8", errors="surrogatepass").replace(b"\xed\xb2\x80", b"\x80\xff")
    return urllib.parse.quote(raw[:60_000], safe="")


def _raw_string_messages(raw: bytes) -> list[tuple[str, bytes]]:
    """Each proto string field a client sends (model names, signature, version label, input
    and output names, datatypes, parameters, ids, metadata fields, the health probe's service),
    holding ``raw`` (bytes that are no UTF-8): ``(method path, the message's wire bytes)``.

    A placeholder of ``raw``'s length is set with protobuf's API, then replaced in the wire
    bytes (the lengths before it stay right)."""
    from grpc_health.v1 import health_pb2
    from tritonclient.grpc import service_pb2 as v2pb

    from estimax.serving.protos.tensorflow.core.framework import tensor_pb2
    from estimax.serving.protos.tensorflow_serving.apis import (
        get_model_metadata_pb2,
        get_model_status_pb2,
        predict_pb2,
    )

    raw = raw.ljust(8, b"\xfe")  # a placeholder of 8 bytes or more is found once
    p = "\x01" + "Q" * (len(raw) - 1)

    def spliced(message) -> bytes:
        wire = message.SerializeToString()
        assert wire.count(p.encode()) == 1, type(message)
        return wire.replace(p.encode(), raw)

    tf, v2 = "/tensorflow.serving.PredictionService/", "/inference.GRPCInferenceService/"
    out = []
    for field in ("name", "signature_name", "version_label"):
        m = predict_pb2.PredictRequest()
        m.model_spec.name = NAME
        setattr(m.model_spec, field, p)
        out.append((tf + "Predict", spliced(m)))
    m = predict_pb2.PredictRequest()
    m.model_spec.name = NAME
    m.inputs[p].CopyFrom(tensor_pb2.TensorProto(dtype=7))
    out.append((tf + "Predict", spliced(m)))
    m = predict_pb2.PredictRequest(output_filter=[p])
    m.model_spec.name = NAME
    out.append((tf + "Predict", spliced(m)))
    m = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=[p])
    m.model_spec.name = NAME
    out.append((tf + "GetModelMetadata", spliced(m)))
    m = get_model_status_pb2.GetModelStatusRequest()
    m.model_spec.name = p
    out.append(("/tensorflow.serving.ModelService/GetModelStatus", spliced(m)))
    for field in ("model_name", "model_version", "id"):
        m = v2pb.ModelInferRequest(model_name=NAME)
        setattr(m, field, p)
        out.append((v2 + "ModelInfer", spliced(m)))
    for field in ("name", "datatype"):
        m = v2pb.ModelInferRequest(model_name=NAME)
        m.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
        setattr(m.inputs[0], field, p)
        out.append((v2 + "ModelInfer", spliced(m)))
    m = v2pb.ModelInferRequest(model_name=NAME)
    m.outputs.add(name=p)
    out.append((v2 + "ModelInfer", spliced(m)))
    m = v2pb.ModelInferRequest(model_name=NAME)
    m.parameters[p].string_param = "x"
    out.append((v2 + "ModelInfer", spliced(m)))
    m = v2pb.ModelInferRequest(model_name=NAME)
    m.parameters["x"].string_param = p
    out.append((v2 + "ModelInfer", spliced(m)))
    out.append((v2 + "ModelMetadata", spliced(v2pb.ModelMetadataRequest(name=p))))
    out.append((v2 + "ModelReady", spliced(v2pb.ModelReadyRequest(name=NAME, version=p))))
    out.append(("/grpc.health.v1.Health/Check", spliced(health_pb2.HealthCheckRequest(service=p))))
    return out


def _declared_but_unsent(url: str, n: int, ps) -> float:
    """``n`` connections declare a 64 MiB body and send one byte; the RSS growth (MiB) while
    they are held; then they leave (each request: 499, one access line)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    before = ps.memory_info().rss
    socks = []
    try:
        for i in range(n):
            s = socket.create_connection((host, int(port)), timeout=60)
            path = f"/v1/models/{NAME}:predict" if i % 2 else f"/v2/models/{NAME}/infer"
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {64 << 20}\r\n\r\n{{".encode()
            )
            socks.append(s)
        for _ in range(3):  # answered after the loop has run every stalled body's reader
            assert requests.get(url + "/v2/health/live", timeout=30).status_code == 200
        return (ps.memory_info().rss - before) / 2**20
    finally:
        for s in socks:
            s.close()


def test_hostile_strings_and_declared_bodies_answer_4xx_in_one_log_line_each(
    hostile_server, reliability_record
):
    """Every string a client controls, made hostile (``HOSTILE``, and generated text with
    control characters), in the path, headers, JSON keys and values, version labels, and gRPC
    fields, there also as raw bytes that are no UTF-8 in every string field (protobuf's API
    cannot send them: ``_raw_string_messages`` writes the wire bytes; INVALID_ARGUMENT
    exactly, the health probe's included); and bodies declared but never sent. Asserted: no
    5xx (gRPC: no INTERNAL/UNKNOWN/UNAVAILABLE),
    answers bounded (an echo is cut), exactly one access-log line per request, every line of
    the server's log a record of its own (nothing forged, no raw control character), and the
    RSS: under ``DECLARED_RSS_BOUND_MIB`` of growth with ``DECLARED_CONNECTIONS`` bodies of
    64 MiB declared, and flat (``RSS_GROWTH_LIMIT_MIB``) over a second pass."""
    import grpc
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from tritonclient.grpc import service_pb2 as v2pb

    from estimax.serving.protos.tensorflow.core.framework import tensor_pb2
    from estimax.serving.protos.tensorflow_serving.apis import (
        get_model_status_pb2,
        model_service_pb2_grpc,
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    url, proc, target, access, log = hostile_server
    ps = psutil.Process(proc.pid)
    texts = st.sampled_from(HOSTILE) | st.text(
        st.characters(codec=None, categories=("Cc", "Zl", "Zp", "Cs", "Ll")), max_size=40
    )
    examples = scale(15, 300)
    # Answered by the transport before any route (431: headers past --max_header_bytes; 400:
    # a header value with a control character, which HTTP forbids, refused by uvicorn's parser
    # with a WARNING line of its own): no request reached the app, so no access line.
    http_sent, grpc_sent, refused, bad = [0], [0], [0], []
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    predict = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    status = model_service_pb2_grpc.ModelServiceStub(channel)
    infer = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=lambda x: x.SerializeToString(),
        response_deserializer=lambda b: b,
    )

    def http(method: str, path: str, **kw) -> None:
        http_sent[0] += 1
        r = requests.request(method, url + path, timeout=60, **kw)
        refused[0] += r.status_code == 431 or r.text == "Invalid HTTP request received."
        if r.status_code >= 500 or len(r.content) > 16_000:
            bad.append(("http", method, path[:200], r.status_code, r.content[:300]))

    def rpc(fn, message) -> None:
        grpc_sent[0] += 1
        try:
            fn(message, timeout=60)
        except grpc.RpcError as e:
            server_error = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
            if e.code() in (*server_error, grpc.StatusCode.UNAVAILABLE) or len(e.details()) > 8000:
                bad.append(("grpc", e.code(), e.details()[:300]))

    def utf8(text: str) -> str:  # protobuf strings must be UTF-8: surrogates replaced
        return text.encode("utf-8", errors="replace").decode()

    raw_methods: dict = {}

    def raw_method(path: str):
        if path not in raw_methods:
            raw_methods[path] = channel.unary_unary(
                path, request_serializer=None, response_deserializer=None
            )
        return raw_methods[path]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(texts, texts, st.sampled_from(["predict", "classify", "infer"]))
    def fuzz(a: str, b: str, api: str) -> None:
        # The path (a model name, a version), percent-encoded, bytes that are no UTF-8 too.
        http("GET", f"/v1/models/{_quote(a)}")
        http("GET", f"/v2/models/{NAME}/versions/{_quote(b)}/ready")
        # Headers a route reads, with what latin-1 carries (requests refuses CR/LF in them).
        header = a.encode("latin-1", errors="replace").replace(b"\r", b"").replace(b"\n", b"")
        http(
            "POST",
            f"/v1/models/{NAME}:predict",
            data=b"{}",
            headers={"Content-Encoding": header[:8000], "Inference-Header-Content-Length": "1"},
        )
        # JSON keys and values (lone surrogates travel as JSON's \\udc80 escapes).
        body = {
            "predict": {"signature_name": a, "instances": [{b[:100_000]: a[:1000]}]},
            "classify": {"examples": [{a[:100_000]: [1.0]}], "context": {b[:1000]: [2.0]}},
            "infer": {
                "inputs": [{"name": a, "datatype": b[:1000], "shape": [1], "data": [a[:1000]]}],
                "outputs": [{"name": b}],
            },
        }[api]
        path = f"/v2/models/{NAME}/infer" if api == "infer" else f"/v1/models/{NAME}:{api}"
        http("POST", path, data=json.dumps(body))
        # gRPC fields: the model's name, the signature, input and output names, datatypes.
        request = predict_pb2.PredictRequest()
        request.model_spec.name = utf8(a[:100_000])
        rpc(predict.Predict, request)
        request.model_spec.name = NAME
        request.model_spec.signature_name = utf8(b[:100_000])
        rpc(predict.Predict, request)
        request.model_spec.signature_name = ""
        request.inputs[utf8(a[:100_000])].CopyFrom(tensor_pb2.TensorProto(dtype=7))
        request.output_filter.append(utf8(b[:1000]))
        rpc(predict.Predict, request)
        rpc(
            status.GetModelStatus,
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": utf8(b[:100_000])}),
        )
        message = v2pb.ModelInferRequest(model_name=NAME)
        message.inputs.add(name=utf8(a[:100_000]), datatype=utf8(b[:1000]), shape=[1])
        rpc(infer, message)
        # Version labels (TF Serving's: unknown ones are INVALID_ARGUMENT, echoed cut).
        request = predict_pb2.PredictRequest()
        request.model_spec.name = NAME
        request.model_spec.version_label = utf8(b[:100_000])
        rpc(predict.Predict, request)
        http("GET", f"/v1/models/{NAME}/labels/{_quote(b)}")
        # Bytes that are no UTF-8 in every proto string field (protobuf's API cannot set them:
        # the wire bytes are written here): INVALID_ARGUMENT, never INTERNAL or UNKNOWN.
        raw = b"\xff" + a.encode("utf-8", errors="surrogatepass")[:100_000]
        for method, wire in _raw_string_messages(raw):
            counted = not method.startswith("/grpc.health.")  # probes: no access line
            grpc_sent[0] += counted
            try:
                raw_method(method)(wire, timeout=60)
                bad.append(("grpc raw bytes answered OK", method))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.INVALID_ARGUMENT or len(e.details()) > 8000:
                    bad.append(("grpc raw bytes", method, e.code(), e.details()[:300]))

    ok, rss, growth = False, [], 0.0
    lines_before = len(_lines(access))
    try:
        growth = _declared_but_unsent(url, DECLARED_CONNECTIONS, ps)
        for _ in range(2):
            fuzz()
            rss.append(ps.memory_info().rss)
        expected = lines_before + DECLARED_CONNECTIONS + 3 + http_sent[0] + grpc_sent[0]
        expected -= refused[0]
        fx.wait_until(
            lambda: len(_lines(access)) >= expected,
            f"{expected} access lines (have {len(_lines(access))})",
        )
        assert not bad, bad[:5]
        assert growth < DECLARED_RSS_BOUND_MIB, f"{growth:.0f} MiB for one-byte bodies"
        assert (rss[1] - rss[0]) / 2**20 < RSS_GROWTH_LIMIT_MIB, rss
        access_lines = _lines(access)
        assert len(access_lines) == expected, (
            len(access_lines),
            expected,
            dict(http=http_sent[0], grpc=grpc_sent[0], refused=refused[0], before=lines_before),
            _tally(access_lines[lines_before:]),  # which kind of line is one too many or few
        )
        records = [json.loads(line) for line in access_lines]  # each a whole record
        assert sum(r["status"] == 499 for r in records) >= DECLARED_CONNECTIONS
        assert all(len(line) < 8000 for line in access_lines)
        _assert_log_lines(log)
        assert proc.poll() is None and requests.get(url + "/v2/health/ready").status_code == 200
        ok = True
    finally:
        channel.close()
        reliability_record(
            "server",
            "estimax serve (hostile strings)",
            http_sent[0] + grpc_sent[0],
            ok,
            rss_mib=[round(r / 2**20, 1) for r in rss],
            rss_growth_bound_mib=RSS_GROWTH_LIMIT_MIB,
        )
        reliability_record(
            "attack",
            "declared-but-unsent bodies",
            DECLARED_CONNECTIONS,
            ok and growth < DECLARED_RSS_BOUND_MIB,
            rss_growth_mib=round(growth, 1),
            rss_bound_mib=DECLARED_RSS_BOUND_MIB,
        )


# Header lines only a raw client sends (requests refuses CR/LF and more in headers): each with
# whether HTTP forbids it outright (then a 4xx or a close; else the server may answer it, as
# RFC 9110 lets a recipient keep other control characters and obs-text in a value).
RAW_HEADER_LINES = [
    (b"X-Fold: a\r\n " + FORGED.encode(), False),  # obs-fold: refused or unfolded (RFC 9112)
    (b"X-Forge: a\r\n" + FORGED.encode(), True),  # a forged line: no header name there
    (b"X-Cr: a\rb", True),  # bare CR
    (b"X-Nul: a\x00b", True),
    (b"X-Esc: \x1b[2J\x1b]0;owned\x07", False),
    (b"X-C1: \xc2\x9b31m\xe2\x80\xa8", False),
    (b"X-Bytes: caf\xe9 \xff\xfe \xed\xa0\x80", False),  # obs-text
    (b"X\x1bName: 1", True),  # a control character in a name
    (b"X Name: 1", True),
    (b"X-Name : 1", True),  # whitespace before the colon (RFC 9112 5.1: 400)
    (b"\xff\xfe: 1", True),
    # Headers the app reads, and echoes cut: obs-text the parser lets through (C1 and a line
    # separator as UTF-8, bytes no UTF-8), and 60,000 of them.
    (b"Content-Encoding: \xc2\x9b31mgzip\xff\xe2\x80\xa8", False),
    (b"Content-Encoding: " + b"\xff" * 60_000, False),
    (b"Inference-Header-Content-Length: 1\xc2\x9b\xff", False),
    (b"Content-Type: application/json\xc2\x9b\xff", False),
    (b"X-Long: " + b"a" * 70_000, True),  # past --max_header_bytes: 431
    (b"X-Long-Name" * 7_000 + b": 1", True),
]


def _tally(lines: list[str]) -> dict:
    """Access lines counted by (transport, api, status): what a count that is off names."""
    import collections

    return dict(
        collections.Counter(
            (r.get("transport"), r.get("api"), r.get("status")) for r in map(json.loads, lines)
        )
    )


def _raw_exchange(url: str, head: bytes, body: bytes) -> bytes:
    """Sends ``head`` (request line and headers, no blank line) and ``body`` on a raw socket;
    the whole answer (b"": the server closed without one)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        try:
            s.sendall(head + b"\r\nConnection: close\r\n\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):  # closed while we were sending
            pass
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def test_hostile_header_bytes_answer_4xx_or_close_in_one_log_line_each(
    hostile_server, reliability_record
):
    """Each of ``RAW_HEADER_LINES`` in a health probe, a TF Serving predict and a v2 infer, on a
    raw socket. Asserted: never a 5xx; a 4xx or a close where HTTP forbids the bytes; one
    access line per request that reached a route, and none for those the transport refused
    (431; uvicorn's parser's 400); every access and log line whole, with no raw control
    character; the server serving on."""
    url, proc, _, access, log = hostile_server
    requests_for = [
        (b"GET /v2/health/ready HTTP/1.1", b""),
        (f"POST /v1/models/{NAME}:predict HTTP/1.1".encode(), b'{"instances": [1]}'),
        (f"POST /v2/models/{NAME}/infer HTTP/1.1".encode(), b'{"inputs": []}'),
    ]
    lines_before = len(_lines(access))
    reached, sent, bad = 0, 0, []
    ok = False
    try:
        for line, forbidden in RAW_HEADER_LINES:
            for start, body in requests_for:
                sent += 1
                head = start + b"\r\nHost: x\r\n" + line
                head += f"\r\nContent-Length: {len(body)}".encode()
                answer = _raw_exchange(url, head, body)
                if not answer:
                    continue  # closed without an answer: allowed, nothing logged
                status_line = answer.split(b"\r\n", 1)[0]
                match = re.match(rb"HTTP/1\.[01] (\d{3}) ", status_line)
                if match is None:
                    bad.append(("no status line", line[:60], answer[:200]))
                    continue
                status = int(match.group(1))
                if status >= 500 or (forbidden and status < 400):
                    bad.append((status, line[:60], start, answer[:300]))
                if len(answer) > 16_000:
                    bad.append(("echoed whole", len(answer), line[:60]))
                # The transport's own refusals never reach a route: no access line.
                transport = status == 431 or answer.endswith(b"Invalid HTTP request received.")
                reached += not transport
        assert not bad, bad[:5]
        expected = lines_before + reached
        fx.wait_until(lambda: len(_lines(access)) >= expected, f"{expected} access lines")
        access_lines = _lines(access)
        assert len(access_lines) == expected, (len(access_lines), expected)
        for record_line in access_lines:
            assert len(record_line) < 8000 and json.loads(record_line)
            assert not re.search("[\x00-\x1f\x7f-\x9f]", record_line), record_line[:300]
        _assert_log_lines(log)
        assert proc.poll() is None and requests.get(url + "/v2/health/ready").status_code == 200
        ok = True
    finally:
        reliability_record("server", "estimax serve (hostile header bytes)", sent, ok)
