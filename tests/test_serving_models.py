"""Several models in one server (``--model_config_file``): two models of different inputs,
addressed by name, version and label over REST, v2 (tritonclient) and TF Serving's gRPC; each
model's metrics; the config file re-read (a model added, a label moved, a bad file kept out) and
gRPC's HandleReloadConfigRequest.

One server serves the whole module; the tests run in order (the last changes its config).
(This process never imports ``estimax.serving.grpc_server``: its v2 messages share names with
tritonclient's.)"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile

import numpy as np
import pytest

requests = pytest.importorskip("requests")
grpc = pytest.importorskip("grpc")
triton_http = pytest.importorskip("tritonclient.http")

import serving_fixtures as fx  # noqa: E402

from estimax.serving import registry, tf_serving  # noqa: E402
from estimax.serving.manager import VersionPolicy  # noqa: E402

POLL = "--model_config_file_poll_wait_seconds=1"
METRICS = "/metrics"


def _config(img: str, arr: str, stable: int, more: str = "") -> str:
    """A ModelServerConfig: ``img`` (JPEG bytes in), ``arr`` (float [B, 4] in, versions 1 and 2
    labelled), and ``more``."""
    return (
        "model_config_list {\n"
        f'  config {{ name: "img" base_path: "{img}" model_platform: "tensorflow" }}\n'
        f'  config {{ name: "arr" base_path: "{arr}"\n'
        "    model_version_policy { specific { versions: 1 versions: 2 } }\n"
        f'    version_labels {{ key: "stable" value: {stable} }}\n'
        '    version_labels { key: "canary" value: 2 } }\n'
        f"{more}}}\n"
    )


def _export_array_model(root: str) -> str:
    """A dense model over float [B, 4] inputs, exported twice (versions 1 and 2)."""
    import flax.linen as nn
    import jax
    import optax

    import estimax as ex
    from estimax import export

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3)(features)
        predictions = {"classes": logits.argmax(-1), "probabilities": jax.nn.softmax(logits)}
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(mode=mode, predictions=predictions)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.5),
            predictions=predictions,
        )

    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=os.path.join(root, "arr_model")),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(x, (x[:, 0] > 0).astype(np.int32)), max_steps=2)
    base = os.path.join(root, "arr")
    for _ in range(2):
        export.export_version(est, base, serving_input=ex.TensorSpec((None, 4), np.float32))
    return base


@pytest.fixture(scope="module")
def server(dense_export):
    root = tempfile.mkdtemp()
    img = dense_export(os.path.join(root, "img"))
    arr = _export_array_model(root)
    config = os.path.join(root, "models.config")
    with open(config, "w") as f:
        f.write(_config(img, arr, stable=1))
    grpc_port = fx.free_port()
    log_path = os.path.join(root, "server.log")
    args = [
        f"--model_config_file={config}",
        POLL,
        f"--grpc_port={grpc_port}",
        f"--metrics_path={METRICS}",
        "--enable_batching",
    ]
    try:
        with fx.running_server(args, log_path=log_path) as (url, _):
            yield {
                "url": url,
                "grpc": f"127.0.0.1:{grpc_port}",
                "config": config,
                "img": img,
                "arr": arr,
                "log": log_path,
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)


ROWS = np.asarray([[0.5, -1.0, 2.0, 0.0], [-0.3, 0.2, 0.1, 1.5]], np.float32)


def _tf_array_request(name: str, version: int | None = None, label: str | None = None):
    from estimax.serving.protos.tensorflow.core.framework import (
        tensor_pb2,
        tensor_shape_pb2,
        types_pb2,
    )
    from estimax.serving.protos.tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    if version is not None:
        request.model_spec.version.value = version
    if label is not None:
        request.model_spec.version_label = label
    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in ROWS.shape]
    )
    request.inputs["input"].CopyFrom(
        tensor_pb2.TensorProto(
            dtype=types_pb2.DT_FLOAT, tensor_shape=shape, tensor_content=ROWS.tobytes()
        )
    )
    return request


def test_two_models_by_name_version_and_label(server):
    url = server["url"]
    images, _ = fx.make_jpegs(2, seed=4)
    # REST: each model by name, with its own inputs.
    body = {"instances": [{"b64": base64.b64encode(b).decode()} for b in images]}
    r = requests.post(f"{url}/v1/models/img:predict", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["predictions"]) == 2
    answers = {}
    for route in ("arr", "arr/versions/1", "arr/versions/2", "arr/labels/stable"):
        r = requests.post(f"{url}/v1/models/{route}:predict", json={"instances": ROWS.tolist()})
        assert r.status_code == 200, (route, r.text)
        answers[route] = r.json()["predictions"]
    assert answers["arr/labels/stable"] == answers["arr/versions/1"]
    # A label's status and metadata are its version's.
    status = requests.get(f"{url}/v1/models/arr/labels/canary", timeout=10).json()
    assert [s["version"] for s in status["model_version_status"]] == ["2"]
    meta = requests.get(f"{url}/v1/models/arr/labels/stable/metadata", timeout=10).json()
    assert meta["model_spec"]["version"] == "1"
    # Every version of the policy is loaded.
    versions = requests.get(f"{url}/v1/models/arr", timeout=10).json()["model_version_status"]
    assert {(s["version"], s["state"]) for s in versions} == {
        ("1", "AVAILABLE"),
        ("2", "AVAILABLE"),
    }
    # TF Serving's errors: an unknown model is 404, an unknown label 400.
    r = requests.post(f"{url}/v1/models/nope:predict", json={"instances": ROWS.tolist()})
    assert (r.status_code, r.json()["error"]) == (
        404,
        "Servable not found for request: Latest(nope)",
    )
    r = requests.post(f"{url}/v1/models/arr/labels/nope:predict", json={"instances": [[0] * 4]})
    assert r.status_code == 400
    assert r.json()["error"] == "Unrecognized servable version label: nope"

    # v2 (tritonclient): by name and version; readiness per model.
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))
    inputs = [triton_http.InferInput("input", list(ROWS.shape), "FP32")]
    inputs[0].set_data_from_numpy(ROWS)
    result = client.infer("arr", inputs, model_version="1")
    assert result.as_numpy("classes").tolist() == [p["classes"] for p in answers["arr/versions/1"]]
    image = triton_http.InferInput("image_bytes", [1], "BYTES")
    image.set_data_from_numpy(np.array([images[0]], dtype=object))
    assert client.infer("img", [image]).as_numpy("classes").shape == (1,)
    assert client.is_model_ready("img") and client.is_model_ready("arr", "2")
    assert requests.get(f"{url}/v2/models/nope/ready", timeout=10).status_code == 404

    # TF Serving's gRPC: ModelSpec by version and by version_label.
    response = fx.grpc_predict(server["grpc"], _tf_array_request("arr", label="canary"))
    assert response.model_spec.version.value == 2
    by_version = fx.grpc_predict(server["grpc"], _tf_array_request("arr", version=2))
    assert by_version.outputs["classes"] == response.outputs["classes"]
    with pytest.raises(grpc.RpcError) as e:
        fx.grpc_predict(server["grpc"], _tf_array_request("arr", label="nope"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    response = fx.grpc_predict(server["grpc"], fx.tf_predict_request("img", images))
    assert len(response.outputs["classes"].int_val) == 2


def test_grpc_health_per_model(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "img", "arr"):
            check = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert check.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_carry_each_model(server):
    text = requests.get(server["url"] + METRICS, timeout=10).text
    for model in ("img", "arr"):
        assert f'model_name="{model}"' in text
        assert f'estimax_serving_batch_queue_instances{{model_name="{model}"}}' in text
    assert 'version_state{model_name="arr",state="AVAILABLE",version="2"} 1.0' in text
    stats = requests.get(server["url"] + "/v2/models/stats", timeout=10).json()["model_stats"]
    assert {(s["name"], s["version"]) for s in stats} >= {("img", "1"), ("arr", "1"), ("arr", "2")}
    arr1 = next(s for s in stats if (s["name"], s["version"]) == ("arr", "1"))
    assert arr1["inference_count"] >= 4  # version 1 asked by number and by label "stable"


def test_grpc_reload_config_refuses_a_label_on_a_version_not_loaded(server):
    from google.protobuf import text_format

    from estimax.serving.protos.tensorflow_serving.apis import (
        model_management_pb2,
        model_service_pb2_grpc,
    )

    request = model_management_pb2.ReloadConfigRequest()
    text_format.Parse(_config(server["img"], server["arr"], stable=9), request.config)
    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.HandleReloadConfigRequest(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "assign label to version 9 of model arr" in e.value.details()
        # The labels served are still the old ones.
        r = requests.get(f"{server['url']}/v1/models/arr/labels/stable", timeout=10)
        assert r.json()["model_version_status"][0]["version"] == "1"
        request.config.Clear()
        text_format.Parse(_config(server["img"], server["arr"], stable=1), request.config)
        assert stub.HandleReloadConfigRequest(request, timeout=60).status.error_code == 0


def test_config_poll_adds_a_model_moves_a_label_and_keeps_the_old_on_a_bad_file(server):
    url, path = server["url"], server["config"]

    def log() -> str:
        with open(server["log"]) as f:
            return f.read()

    with open(path, "w") as f:  # a bad file: logged, the old config still served
        f.write('model_config_list { config { name: "img" base_pth: "/x" } }')
    fx.wait_until(lambda: "still serving the previous model config" in log(), "the bad file")
    (line,) = [x for x in log().splitlines() if "still serving the previous" in x]
    assert "base_pth" in line
    assert requests.get(f"{url}/v1/models/arr/labels/stable", timeout=10).status_code == 200

    more = f'  config {{ name: "img2" base_path: "{server["img"]}" }}\n'
    with open(path, "w") as f:
        f.write(_config(server["img"], server["arr"], stable=2, more=more))

    def relabelled() -> bool:
        r = requests.get(f"{url}/v1/models/arr/labels/stable", timeout=10)
        return r.json()["model_version_status"][0]["version"] == "2"

    fx.wait_until(relabelled, "the label moved")
    fx.wait_until(
        lambda: requests.get(f"{url}/v2/models/img2/ready", timeout=10).status_code == 200,
        "the model added",
    )
    images, _ = fx.make_jpegs(1, seed=6)
    body = {"instances": [{"b64": base64.b64encode(images[0]).decode()}]}
    r = requests.post(f"{url}/v1/models/img2:predict", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert requests.get(f"{url}/v2/health/ready", timeout=10).status_code == 200

    with open(path, "w") as f:  # removed again: unknown, as any name never served
        f.write(_config(server["img"], server["arr"], stable=2))
    fx.wait_until(
        lambda: requests.get(f"{url}/v2/models/img2/ready", timeout=10).status_code == 404,
        "the model removed",
    )
    r = requests.post(f"{url}/v1/models/img2:predict", json=body, timeout=60)
    assert r.status_code == 404 and "Latest(img2)" in r.json()["error"]


# ---------------------------------------------------------------------------- no server
def test_config_file_parsed_and_bad_ones_are_one_line(tmp_path, capsys):
    configs = registry.parse_config(_config("/m/img", "/m/arr", stable=1), "here")
    assert [(c.name, c.base_path) for c in configs] == [("img", "/m/img"), ("arr", "/m/arr")]
    assert configs[0].policy == VersionPolicy("latest", 1)
    assert configs[1].policy == VersionPolicy("specific", versions=(1, 2))
    assert configs[1].labels == (("canary", 2), ("stable", 1))
    for text, words in (
        (
            'model_config_list { config { name: "a" base_path: "/a" } '
            'config { name: "a" base_path: "/b" } }',
            "Illegal to list model a multiple times",
        ),
        (
            'model_config_list { config { name: "a" base_path: "/a" model_platform: "onnx" } }',
            "model_platform 'onnx'",
        ),
        (
            'model_config_list { config { name: "a" base_path: "/a" '
            "model_version_policy { specific { } } } }",
            "lists no versions",
        ),
        ('model_config_list { config { name: "a" } }', "needs a name and a base_path"),
    ):
        with pytest.raises(registry.ConfigError, match=words):
            registry.parse_config(text, "here")
    bad = tmp_path / "bad.config"
    bad.write_text('model_config_list { config { name: "a" base_path: "/a" } ')
    assert tf_serving.main([f"--model_config_file={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0], err


def test_version_policies():
    on_disk = [1, 2, 5, 7]
    assert VersionPolicy("latest", 2).wanted(on_disk) == [5, 7]
    assert VersionPolicy("all").wanted(on_disk) == on_disk
    assert VersionPolicy("specific", versions=(2, 3, 7)).wanted(on_disk) == [2, 7]
