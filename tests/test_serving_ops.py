"""Running `estimax serve` in production: metrics, logs, Triton's extensions, Vertex AI, names.

One server process (under Vertex AI's contract: its port, model path and routes come from the
``AIP_*`` variables), with TF Serving's ``--monitoring_config_file``, a JSON access log, gRPC
and a small batching queue, serving an export that carries class names from a converter's
manifest. Real clients talk to it: ``requests`` and ``curl``, NVIDIA's ``tritonclient`` over
HTTP and gRPC, a TF Serving ``PredictionService`` client; the metrics are read with
``prometheus_client``'s own parser. (This process never imports ``estimax.serving.grpc_server``:
its v2 messages share their names with tritonclient's.)
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
grpc = pytest.importorskip("grpc")
triton_http = pytest.importorskip("tritonclient.http")
triton_grpc = pytest.importorskip("tritonclient.grpc")
triton_utils = pytest.importorskip("tritonclient.utils")
parser = pytest.importorskip("prometheus_client.parser")

import serving_fixtures as fx  # noqa: E402

from estimax import command, export  # noqa: E402
from estimax.serving.protos.tensorflow.core.example import example_pb2, feature_pb2  # noqa: E402
from estimax.serving.protos.tensorflow.core.framework import (  # noqa: E402
    tensor_pb2,
    tensor_shape_pb2,
    types_pb2,
)
from estimax.serving.protos.tensorflow_serving.apis import (  # noqa: E402
    classification_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from estimax.tools.convert_shards import Manifest  # noqa: E402

NAME = "tiny"
NAMES = ["red thing", "green thing", "blue thing"]  # the manifest's labels 1, 2, 3
METRICS = "/monitoring/prometheus/metrics"  # TF Serving's default path
PREDICT_ROUTE = "/v1/endpoints/123/deployedModels/456:predict"
HEALTH_ROUTE = "/v1/endpoints/123/deployedModels/456"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The small model, exported with the class names of a converter's manifest."""
    root = tmp_path_factory.mktemp("serving_ops")
    data_dir = root / "tfrecords"
    label_map = {n: i + 1 for i, n in enumerate(NAMES)}  # 1-based, as the converter writes
    Manifest("fingerprint", label_map, {"train": {"num_shards": 1}}).save(str(data_dir))
    est, _ = fx.dense_estimator(str(root))
    base = os.path.join(root, "serving")
    images, _ = fx.make_jpegs(6, seed=3)
    export.export_version(
        est,
        base,
        preprocessing=export.resnet_eval(fx.IMAGE_SIZE),
        check_inputs=images[:2],
        class_names=export.class_names_from_manifest(str(data_dir)),
    )
    return {"est": est, "base": base, "images": images, "root": root}


@pytest.fixture(scope="module")
def served(exported):
    root = exported["root"]
    config = root / "monitoring.config"
    config.write_text("prometheus_config {\n  enable: true\n}\n")
    access = root / "access.jsonl"
    port, grpc_port = fx.free_port(), fx.free_port()
    vertex = {
        "AIP_MODE": "PREDICTION",
        "AIP_HTTP_PORT": str(port),
        "AIP_STORAGE_URI": exported["base"],
        "AIP_PREDICT_ROUTE": PREDICT_ROUTE,
        "AIP_HEALTH_ROUTE": HEALTH_ROUTE,
    }
    args = [
        f"--model_name={NAME}",
        f"--grpc_port={grpc_port}",
        f"--monitoring_config_file={config}",
        f"--access_log_file={access}",
        "--access_log_format=json",
        "--enable_batching",
        "--max_batch_size=2",
        "--max_enqueued_batches=1",  # 2 instances may wait: a request of 3 is refused (429)
        "--batch_timeout_micros=2000",
        "--max_instances=8",
    ]
    with fx.running_server(args, env=vertex, port=port) as (url, proc):
        images = exported["images"]
        r = requests.post(
            f"{url}/v1/models/{NAME}:predict", json={"instances": b64s(images)}, timeout=60
        )
        assert r.status_code == 429  # 6 instances: past the queue, whatever the batch
        reference = [predict(url, [image])[0] for image in images]
        yield {
            "url": url,
            "http": url.removeprefix("http://"),
            "grpc": f"127.0.0.1:{grpc_port}",
            "access": str(access),
            "images": images,
            "classes": [p["classes"] for p in reference],
            "probabilities": np.asarray([p["probabilities"] for p in reference]),
            "base": exported["base"],
        }


def b64s(images):
    return [{"b64": base64.b64encode(b).decode()} for b in images]


def predict(url, images, path=None):
    r = requests.post(
        url + (path or f"/v1/models/{NAME}:predict"), json={"instances": b64s(images)}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["predictions"]


def tf_request(images, name=NAME):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    request.inputs["image_bytes"].CopyFrom(
        tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(images))]
            ),
            string_val=images,
        )
    )
    return request


def scrape(url):
    """{(sample name, labels): value} of the metrics endpoint, read by prometheus_client."""
    r = requests.get(url + METRICS, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(r.text)
        for s in family.samples
    }


def deltas(before, after, name, keys):
    """Per ``keys`` label values, how much the samples named ``name`` grew."""
    out: dict = {}
    for (sample, labels), value in after.items():
        if sample == name:
            grown = value - before.get((sample, labels), 0.0)
            if grown:
                key = tuple(dict(labels)[k] for k in keys)
                out[key] = out.get(key, 0.0) + grown
    return out


def wait_for(condition, what, timeout=60.0):
    """Polls until ``condition()`` (a server's counter or log catching up); not a timing test."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def access_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- metrics, logs
def send_known_outcomes(served):
    """12 requests of known outcomes over REST, v2 (tritonclient) and gRPC (TF Serving's)."""
    url, images = served["url"], served["images"]
    for image in images[:3]:
        predict(url, [image])
    for _ in range(2):
        r = requests.post(f"{url}/v1/models/{NAME}:predict", data=b"{", timeout=30)
        assert r.status_code == 400
    for _ in range(2):
        r = requests.post(f"{url}/v1/models/nope:predict", json={"instances": b64s(images[:1])})
        assert r.status_code == 404
    r = requests.post(f"{url}/v1/models/{NAME}:predict", json={"instances": b64s(images[:3])})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.headers
    client = triton_http.InferenceServerClient(served["http"])
    inputs = [triton_http.InferInput("image_bytes", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array(images[:1], dtype=np.object_))
    client.infer(NAME, inputs)
    with grpc.insecure_channel(served["grpc"]) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        stub.Predict(tf_request(images[:1]), timeout=60)
        with pytest.raises(grpc.RpcError) as missing:
            stub.Predict(tf_request(images[:1], name="nope"), timeout=60)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as full:
            stub.Predict(tf_request(images[:3]), timeout=60)
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("grpc-retry-pushback-ms", "1000") in full.value.trailing_metadata()
    return 12


def test_every_outcome_is_counted_once_in_the_metrics(served):
    url = served["url"]
    before = scrape(url)
    n = send_known_outcomes(served)
    count = ":tensorflow:serving:request_count"
    keys = ("model_name", "API", "entrypoint", "status")
    wait_for(lambda: sum(deltas(before, scrape(url), count, keys).values()) >= n, "all counted")
    after = scrape(url)
    assert deltas(before, after, count, keys) == {
        ("tiny", "predict", "REST", "OK"): 3,
        ("tiny", "predict", "REST", "INVALID_ARGUMENT"): 2,
        ("_unknown", "predict", "REST", "NOT_FOUND"): 2,
        ("tiny", "predict", "REST", "RESOURCE_EXHAUSTED"): 1,
        ("tiny", "infer", "REST", "OK"): 1,
        ("tiny", "Predict", "GRPC", "OK"): 1,
        ("_unknown", "Predict", "GRPC", "NOT_FOUND"): 1,
        ("tiny", "Predict", "GRPC", "RESOURCE_EXHAUSTED"): 1,
    }
    failures = deltas(before, after, "estimax_serving_request_failures_total", ("reason",))
    assert failures == {("bad_request",): 2, ("not_found",): 3, ("rejected",): 2}
    latency = ":tensorflow:serving:request_latency_count"
    assert sum(deltas(before, after, latency, ("API",)).values()) == n
    runtime = deltas(before, after, ":tensorflow:serving:runtime_latency_count", ("API",))
    assert runtime == {("predict",): 3, ("infer",): 1, ("Predict",): 1}  # those that ran
    examples = ":tensorflow:serving:request_example_count_total"
    assert deltas(before, after, examples, ("model",)) == {("tiny",): 5}
    queued = ":tensorflow:serving:batching_session:input_batch_size_count"
    assert sum(deltas(before, after, queued, ()).values()) == 5
    state = ("estimax_serving_model_version_state", (("model_name", NAME), ("state", "AVAILABLE")))
    assert any(k[0] == state[0] and set(state[1]) <= set(k[1]) for k in after)
    assert any(name.startswith("process_resident_memory") for name, _ in after)


def test_every_request_is_one_access_log_line(served):
    logged = len(access_lines(served["access"]))
    n = send_known_outcomes(served)
    wait_for(lambda: len(access_lines(served["access"])) >= logged + n, "the access lines")
    lines = access_lines(served["access"])[logged:]
    assert len(lines) == n
    fields = ["time", "client", "transport", "protocol", "method", "route", "api", "model"]
    fields += ["version", "status", "code", "latency_ms", "instances"]
    assert all(list(line) == fields for line in lines)
    seen = sorted((x["transport"], x["route"], x["status"], x["instances"]) for x in lines)
    predict_route = f"/v1/models/{NAME}:predict"
    grpc_route = "/tensorflow.serving.PredictionService/Predict"
    assert seen == sorted(
        [("http", predict_route, 200, 1)] * 3
        + [("http", predict_route, 400, 0)] * 2
        + [("http", "/v1/models/nope:predict", 404, 0)] * 2
        + [("http", predict_route, 429, 3), ("http", f"/v2/models/{NAME}/infer", 200, 1)]
        + [("grpc", grpc_route, 200, 1), ("grpc", grpc_route, 404, 0), ("grpc", grpc_route, 429, 3)]
    )
    ok = [x for x in lines if x["status"] == 200]
    assert {x["version"] for x in ok} == {"1"} and {x["model"] for x in ok} == {NAME}
    assert {x["model"] for x in lines if x["status"] == 404} == {"nope"}  # the name asked for
    assert all(x["client"].count(":") >= 1 and x["latency_ms"] >= 0 for x in lines)
    assert {x["protocol"] for x in lines} == {"tf_serving", "v2"}
    assert all(x["time"].endswith("Z") for x in lines)


# ----------------------------------------------------------------------------- Triton
def _number(stats):
    """tritonclient.grpc's JSON writes 64-bit integers as strings: numbers again."""
    if isinstance(stats, dict):
        return {k: _number(v) for k, v in stats.items()}
    if isinstance(stats, list):
        return [_number(v) for v in stats]
    return int(stats) if isinstance(stats, str) and stats.isdigit() else stats


def test_triton_statistics_and_model_config_over_http_and_grpc(served):
    http = triton_http.InferenceServerClient(served["http"])
    grpc_client = triton_grpc.InferenceServerClient(served["grpc"])
    images = served["images"]
    (before,) = http.get_inference_statistics(NAME, "1")["model_stats"]
    for image in images[:2]:  # two requests of one instance ...
        inputs = [triton_http.InferInput("image_bytes", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([image], dtype=np.object_))
        http.infer(NAME, inputs)
    inputs = [triton_grpc.InferInput("image_bytes", [2], "BYTES")]  # ... one of two
    inputs[0].set_data_from_numpy(np.array(images[:2], dtype=np.object_))
    grpc_client.infer(NAME, inputs)
    (after,) = http.get_inference_statistics(NAME, "1")["model_stats"]
    (over_grpc,) = _number(grpc_client.get_inference_statistics(NAME, as_json=True))["model_stats"]
    for stat in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert over_grpc["inference_stats"][stat] == after["inference_stats"][stat], stat
    assert (after["name"], after["version"]) == (NAME, "1")
    assert after["inference_count"] - before["inference_count"] == 4
    assert after["execution_count"] - before["execution_count"] == 3
    assert (
        after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
        == 3
    )
    assert after["inference_stats"]["success"]["ns"] > before["inference_stats"]["success"]["ns"]
    assert after["last_inference"] >= before["last_inference"] > 0
    by_size = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    was = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    assert by_size[1] - was.get(1, 0) == 2 and by_size[2] - was.get(2, 0) == 1
    assert [s["name"] for s in http.get_inference_statistics()["model_stats"]] == [NAME]
    with pytest.raises(triton_utils.InferenceServerException, match="Could not find version 7"):
        http.get_inference_statistics(NAME, "7")
    with pytest.raises(triton_utils.InferenceServerException, match="NOT_FOUND"):
        grpc_client.get_inference_statistics("nope")

    config = http.get_model_config(NAME)
    assert _number(grpc_client.get_model_config(NAME, as_json=True)["config"])["input"] == [
        {"name": "image_bytes", "data_type": "TYPE_STRING", "dims": [1], "reshape": {}}
    ]
    assert config["input"] == [
        {"name": "image_bytes", "data_type": "TYPE_STRING", "dims": [1], "reshape": {"shape": []}}
    ]
    outputs = {o["name"]: (o["data_type"], o["dims"]) for o in config["output"]}
    assert outputs["probabilities"] == ("TYPE_FP32", [3])
    assert outputs["class_names"] == ("TYPE_STRING", [1])
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"] == {
        "preferred_batch_size": [1, 2],
        "max_queue_delay_microseconds": 2000,
        "priority_levels": 3,  # the model's effective levels (#53): the server's defaults
        "default_priority_level": 2,
    }
    extensions = http.get_server_metadata()["extensions"]
    assert {"statistics", "model_configuration", "classification"} <= set(extensions)
    grpc_client.close()


# ----------------------------------------------------------------------------- class names
def test_curl_receives_class_names_from_predict_classify_and_metadata(served, tmp_path):
    url, images, classes = served["url"], served["images"], served["classes"]
    assert len(set(classes)) > 1  # the check can tell the names apart
    body = tmp_path / "body.json"

    def curl(path, data):
        out = subprocess.run(
            ["curl", "-sS", "-X", "POST", "-H", "Content-Type: application/json", "-d", data,
             url + path],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return json.loads(out.stdout)

    # Predict in batches of the queue's size (2): names beside the ids.
    for start in range(0, len(images), 2):
        body.write_text(json.dumps({"instances": b64s(images[start : start + 2])}))
        got = curl(f"/v1/models/{NAME}:predict", f"@{body}")["predictions"]
        assert [p["class_names"] for p in got] == [NAMES[c] for c in classes[start : start + 2]]
    # TF Serving's classify: every class's [label, score], in id order.
    example = {"examples": [{"image_bytes": b64s(images[:1])[0]}]}
    (result,) = curl(f"/v1/models/{NAME}:classify", json.dumps(example))["result"]
    assert [label for label, _ in result] == NAMES
    scores = [s for _, s in result]
    np.testing.assert_allclose(scores, served["probabilities"][0], rtol=1e-5, atol=1e-6)
    metadata = requests.get(f"{url}/v1/models/{NAME}/metadata", timeout=30).json()
    assert metadata["metadata"]["signature_def"]["class_names"] == NAMES


def test_tritonclient_receives_class_names_from_the_classification_extension(served):
    images, classes = served["images"], served["classes"]
    for module, address in ((triton_http, served["http"]), (triton_grpc, served["grpc"])):
        client = module.InferenceServerClient(address)
        inputs = [module.InferInput("image_bytes", [2], "BYTES")]
        inputs[0].set_data_from_numpy(np.array(images[:2], dtype=np.object_))
        wanted = [module.InferRequestedOutput("probabilities", class_count=2)]
        top = client.infer(NAME, inputs, outputs=wanted).as_numpy("probabilities")
        assert top.shape == (2, 2)
        for row, c, p in zip(top, classes, served["probabilities"], strict=False):
            value, index, label = row[0].decode().split(":")  # "value:index:label"
            assert (int(index), label) == (c, NAMES[c])
            assert float(value) == pytest.approx(p[c], abs=1e-6)
        client.close()


def test_a_tf_serving_grpc_client_receives_class_names(served):
    images, classes = served["images"][:2], served["classes"][:2]
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = NAME
    for image in images:
        feature = feature_pb2.Feature(bytes_list=feature_pb2.BytesList(value=[image]))
        request.input.example_list.examples.append(
            example_pb2.Example(features=feature_pb2.Features(feature={"image_bytes": feature}))
        )
    with grpc.insecure_channel(served["grpc"]) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(tf_request(images), timeout=60)
        answer = stub.Classify(request, timeout=60)
    names = [s.decode() for s in response.outputs["class_names"].string_val]
    assert names == [NAMES[c] for c in classes]
    for got, p in zip(answer.result.classifications, served["probabilities"], strict=False):
        assert [c.label for c in got.classes] == NAMES
        np.testing.assert_allclose([c.score for c in got.classes], p, rtol=1e-5, atol=1e-6)


def test_estimax_predict_prints_the_class_names(served, tmp_path, capsys):
    images, classes = served["images"][:2], served["classes"][:2]
    paths = []
    for i, image in enumerate(images):
        paths.append(str(tmp_path / f"{i}.jpg"))
        with open(paths[-1], "wb") as f:
            f.write(image)
    capsys.readouterr()
    assert (
        command.main(["predict", f"--model_base_path={served['base']}", "--top_k=2", *paths]) == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["class_names"] for x in lines] == [NAMES[c] for c in classes]
    for line, c in zip(lines, classes, strict=True):
        assert line["top_k"][0][0] == c and line["top_k"][0][2] == NAMES[c]


def test_class_names_that_do_not_fit_the_model_publish_nothing(exported):
    with pytest.raises(ValueError, match="2 class_names for a model of 3 classes"):
        export.export_version(
            exported["est"],
            exported["base"],
            preprocessing=export.resnet_eval(fx.IMAGE_SIZE),
            class_names=["a", "b"],
        )
    assert export.list_versions(exported["base"]) == [1]
    from estimax.export.record import check_class_names

    outputs = {"probabilities": {"shape": [None, 3], "dtype": "float32"}}
    with pytest.raises(ValueError, match=r"here: class_names repeat \['a'\]"):
        check_class_names(["a", "a", "b"], outputs, "here")
    with pytest.raises(ValueError, match="need a 'classes' or 'probabilities' output"):
        check_class_names(["a"], {"logits": {"shape": [None, 3], "dtype": "float32"}}, "here")


def test_class_names_from_a_manifest_map_labels_to_served_ids(tmp_path):
    Manifest("f", {"cat": 1, "dog": 3}, {}).save(str(tmp_path))
    assert export.class_names_from_manifest(str(tmp_path)) == ["cat", "", "dog"]
    # Labels used as written (a model with a background class at id 0).
    assert export.class_names_from_manifest(str(tmp_path / "manifest.json"), 0) == [
        "",
        "cat",
        "",
        "dog",
    ]
    with pytest.raises(ValueError, match="maps to id -1 with label_offset=2"):
        export.class_names_from_manifest(str(tmp_path), label_offset=2)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        export.class_names_from_manifest(str(tmp_path / "elsewhere"))
    (tmp_path / "other.json").write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="not an estimax-convert manifest"):
        export.class_names_from_manifest(str(tmp_path / "other.json"))


# ----------------------------------------------------------------------------- Vertex AI
def test_vertex_ai_routes_port_and_storage_uri(served):
    # The server was started with no --port and no --model_base_path: AIP_HTTP_PORT and
    # AIP_STORAGE_URI gave them; Vertex calls its health and predict routes.
    url, images = served["url"], served["images"]
    r = requests.get(url + HEALTH_ROUTE, timeout=30)
    assert r.status_code == 200, r.text
    body = {"instances": b64s(images[:2]), "parameters": {}}
    r = requests.post(url + PREDICT_ROUTE, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert [p["classes"] for p in r.json()["predictions"]] == served["classes"][:2]
    assert requests.get(url + "/v2/health/ready", timeout=30).status_code == 200  # still there


@pytest.mark.parametrize(
    "env, message",
    [
        ({"AIP_HEALTH_ROUTE": "/h"}, "AIP_PREDICT_ROUTE=''"),
        ({"AIP_PREDICT_ROUTE": "/p"}, "AIP_HEALTH_ROUTE=''"),
        ({"AIP_PREDICT_ROUTE": "/p", "AIP_HEALTH_ROUTE": "/h", "AIP_HTTP_PORT": "80x"}, "80x"),
        (
            {"AIP_PREDICT_ROUTE": "/p", "AIP_HEALTH_ROUTE": "/h"},
            "--model_base_path is required (or AIP_STORAGE_URI",
        ),
    ],
)
def test_vertex_ai_mistakes_are_one_line(env, message, capsys):
    assert command.main(["serve"], env={"AIP_MODE": "PREDICTION", **env}) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_version_folder_given_as_the_model_is_one_line(served, capsys):
    # AIP_STORAGE_URI (or --model_base_path) naming version 1 itself, not the model's folder.
    one = os.path.join(served["base"], "1")
    assert (
        command.main(["serve", f"--model_base_path={one}", f"--port={fx.free_port()}"], env={}) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        f"estimax serve: {one} is one version's export, not a model base path: serve the folder "
        "that holds it as a numbered version (e.g. move it to BASE/1 and give BASE)"
    )


# ----------------------------------------------------------------------------- flags, help
def test_monitoring_config_mistakes_are_one_line(tmp_path, capsys, served):
    bad = tmp_path / "bad.config"
    bad.write_text("prometheus_config { enable: yes please }")
    args = ["serve", f"--model_base_path={served['base']}", f"--port={fx.free_port()}"]
    assert command.main([*args, f"--monitoring_config_file={bad}"], env={}) == 2
    err = capsys.readouterr().err
    assert f"--monitoring_config_file={bad}: not a MonitoringConfig" in err
    assert len(err.strip().splitlines()) == 1
    assert command.main([*args, f"--monitoring_config_file={tmp_path}/none"], env={}) == 2
    assert "No such file" in capsys.readouterr().err
    off = tmp_path / "off.config"
    off.write_text('prometheus_config { enable: false path: "/m" }')
    from estimax.serving import metrics

    assert metrics.parse_monitoring_config(str(off)) is None
    off.write_text('prometheus_config { enable: true path: "/m" }')
    assert metrics.parse_monitoring_config(str(off)) == "/m"


def test_help_lists_every_command_on_one_line_and_every_serve_flag_with_its_default(
    capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        command.main(["--help"], env={})
    out = capsys.readouterr().out.splitlines()
    commands = ["doctor", "serve", "predict", "export-check", "export-savedmodel", "export-onnx"]
    for name in commands:
        (line,) = [x for x in out if x.strip().split(" ")[0] == name]
        assert len(line.split()) > 3, line  # its help is on the same line
    serve = command._parser({})._subparsers._group_actions[0].choices["serve"]
    formatter = serve._get_formatter()
    flags = [a for a in serve._actions if a.dest != "help"]
    assert len(flags) > 20
    for action in flags:
        assert action.help, action.option_strings
        assert "default" in formatter._get_help_string(action), action.option_strings
    with pytest.raises(SystemExit):
        command.main(["serve", "--help"], env={})
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("default") >= len(flags) and "(default: 8501)" in text


def test_a_version_that_fails_to_load_names_the_file(served, tmp_path, caplog):
    from estimax.serving.manager import ModelManager

    base = tmp_path / "models"
    shutil.copytree(os.path.join(served["base"], "1"), base / "3")
    (base / "3" / "variables.msgpack").write_bytes(b"\x00 not msgpack")
    manager = ModelManager(NAME, str(base), [1], poll_wait_seconds=0)
    with caplog.at_level("INFO", logger="estimax.serving.manager"):
        manager.poll()
    (state,) = manager.states()
    assert state.state == "END" and f"{base}/3/variables.msgpack cannot be read" in state.error
    (line,) = [r.getMessage() for r in caplog.records if r.name == "estimax.serving.manager"]
    assert f"version 3 failed to load from {base}/3: ValueError: {base}/3/variables.msgpack" in line


def test_a_version_load_and_unload_each_log_one_line(exported, tmp_path):
    base = tmp_path / "models"
    shutil.copytree(os.path.join(exported["base"], "1"), base / "1")
    log, access = tmp_path / "server.log", tmp_path / "access.log"
    args = [
        f"--model_base_path={base}",
        f"--model_name={NAME}",
        "--file_system_poll_wait_seconds=0.2",
        f"--access_log_file={access}",
    ]
    with fx.running_server(args, log_path=str(log)) as (url, _):
        shutil.copytree(base / "1", tmp_path / "staging")
        os.rename(tmp_path / "staging", base / "2")  # published at once, as export_version
        wait_for(lambda: "unloaded version 1" in log.read_text(), "version 1 unloaded")
        r = requests.get(f"{url}/v1/models/{NAME}/versions/x/metadata", timeout=30)
        assert r.status_code == 400
        wait_for(lambda: "versions/x" in access.read_text(), "the access line")
    text = log.read_text()
    loaded = [x for x in text.splitlines() if "estimax.serving.manager" in x and "loaded" in x]
    assert len(loaded) == 3, loaded  # version 1 loaded, version 2 loaded, version 1 unloaded
    assert f"loaded version 2 from {base}/2 in " in loaded[1]
    assert f"unloaded version 1 ({base}/1) in " in loaded[2]
    assert "INFO" in loaded[0] and " s (compiled for batch sizes" in loaded[0]
    # The failed request: its cause at WARNING, and a text access line of key=value fields.
    assert f"WARNING estimax.serving.core: GET /v1/models/{NAME}/versions/x/metadata -> 400" in text
    assert "versions are integers" in text
    (line,) = [x for x in access.read_text().splitlines() if "versions/x" in x]
    fields = dict(f.split("=", 1) for f in line.split(" ")[1:])
    assert fields["status"] == "400" and fields["code"] == "INVALID_ARGUMENT"
    assert fields["model"] == NAME and fields["api"] == "metadata" and fields["version"] == "x"
