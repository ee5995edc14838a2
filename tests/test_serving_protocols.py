"""The clients people already run, against one `estimax serve` process with both ports.

* NVIDIA's ``tritonclient[http]`` with the binary tensor data extension (its default), inputs
  and outputs;
* ``tritonclient[grpc]`` (v2 ``GRPCInferenceService``, raw contents);
* a TF Serving ``PredictionService``/``ModelService`` client on the same generated protos that
  ``tensorflow-serving-api`` is built from (``estimax.serving.protos``).

Each must give the classes the TF Serving REST JSON route gives for the same JPEG bytes; bad
inputs get their codes, the server stays up, and a new version loaded under gRPC traffic drops
no request. (This process never imports ``estimax.serving.grpc_server``: its v2 messages share
their names with tritonclient's, and one process cannot register both.)
"""

from __future__ import annotations

import base64
import os
import shutil
import struct
import threading

import numpy as np
import pytest

requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
grpc = pytest.importorskip("grpc")
triton_http = pytest.importorskip("tritonclient.http")
triton_grpc = pytest.importorskip("tritonclient.grpc")
triton_utils = pytest.importorskip("tritonclient.utils")

import serving_fixtures as fx  # noqa: E402

from estimax.serving.protos.tensorflow.core.framework import (  # noqa: E402
    tensor_pb2,
    tensor_shape_pb2,
    types_pb2,
)
from estimax.serving.protos.tensorflow_serving.apis import (  # noqa: E402
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

NAME = "tiny"
MAX_BODY = 200_000


@pytest.fixture(scope="module")
def served(tmp_path_factory, dense_export):
    root = tmp_path_factory.mktemp("protocols")
    base = dense_export(str(root))
    grpc_port = fx.free_port()
    args = [
        f"--model_base_path={base}",
        f"--model_name={NAME}",
        f"--grpc_port={grpc_port}",
        "--file_system_poll_wait_seconds=0.2",
        "--enable_batching",
        "--max_batch_size=8",
        "--batch_timeout_micros=2000",
        "--max_instances=8",
        f"--max_body_bytes={MAX_BODY}",
        "--max_image_pixels=20000",
    ]
    with fx.running_server(args) as (url, proc):
        images, _ = fx.make_jpegs(6, seed=11)
        # The reference: TF Serving's REST JSON route on the same JPEG bytes.
        r = requests.post(
            f"{url}/v1/models/{NAME}:predict",
            json={"instances": [{"b64": base64.b64encode(b).decode()} for b in images]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        predictions = r.json()["predictions"]
        expected = {
            "classes": np.asarray([p["classes"] for p in predictions]),
            "probabilities": np.asarray([p["probabilities"] for p in predictions], np.float32),
        }
        assert len(set(expected["classes"].tolist())) > 1  # the check can tell classes apart
        yield {
            "url": url,
            "http": url.removeprefix("http://"),
            "grpc": f"127.0.0.1:{grpc_port}",
            "proc": proc,
            "base": base,
            "images": images,
            "expected": expected,
        }


def assert_same(classes, probabilities, expected):
    np.testing.assert_array_equal(np.asarray(classes), expected["classes"])
    np.testing.assert_allclose(
        np.asarray(probabilities), expected["probabilities"], rtol=1e-5, atol=1e-6
    )


def image_tensor(images):
    return np.array(images, dtype=np.object_)


def tf_request(images, name=NAME, dtype=types_pb2.DT_STRING, shape=None):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    request.model_spec.signature_name = "serving_default"
    tensor = tensor_pb2.TensorProto(
        dtype=dtype,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[
                tensor_shape_pb2.TensorShapeProto.Dim(size=s)
                for s in (shape if shape is not None else [len(images)])
            ]
        ),
        string_val=images,
    )
    request.inputs["image_bytes"].CopyFrom(tensor)
    return request


# ----------------------------------------------------------------------------- HTTP binary
def test_tritonclient_http_binary_inputs_and_outputs_equal_the_rest_json_route(served):
    client = triton_http.InferenceServerClient(served["http"])
    assert client.is_server_live() and client.is_model_ready(NAME)
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    images, expected = served["images"], served["expected"]
    inputs = [triton_http.InferInput("image_bytes", [len(images)], "BYTES")]
    inputs[0].set_data_from_numpy(image_tensor(images), binary_data=True)
    # Binary outputs, asked per output.
    result = client.infer(
        NAME,
        inputs,
        outputs=[
            triton_http.InferRequestedOutput("classes", binary_data=True),
            triton_http.InferRequestedOutput("probabilities", binary_data=True),
        ],
    )
    outs = {o["name"]: o for o in result.get_response()["outputs"]}
    assert outs["probabilities"]["parameters"]["binary_data_size"] == len(images) * 3 * 4
    assert "data" not in outs["probabilities"]
    assert_same(result.as_numpy("classes"), result.as_numpy("probabilities"), expected)
    # No outputs named: tritonclient asks for all of them in binary (binary_data_output).
    result = client.infer(NAME, inputs, request_id="r-7")
    assert result.get_response()["id"] == "r-7"
    assert_same(result.as_numpy("classes"), result.as_numpy("probabilities"), expected)
    # Binary input, one JSON output and one binary output in the same answer.
    result = client.infer(
        NAME,
        inputs,
        outputs=[
            triton_http.InferRequestedOutput("classes", binary_data=False),
            triton_http.InferRequestedOutput("probabilities", binary_data=True),
        ],
    )
    outs = {o["name"]: o for o in result.get_response()["outputs"]}
    assert outs["classes"]["data"] == expected["classes"].tolist()
    assert_same(result.as_numpy("classes"), result.as_numpy("probabilities"), expected)


def test_bad_binary_requests_get_their_codes_and_the_server_keeps_serving(served):
    url, images = served["url"], served["images"]
    infer = f"{url}/v2/models/{NAME}/infer"
    framed = b"".join(struct.pack("<I", len(b)) + b for b in images[:2])

    def post(head, binary, header=None, **headers):
        text = head if isinstance(head, bytes) else __import__("json").dumps(head).encode()
        length = str(len(text)) if header is None else header
        return requests.post(
            infer,
            data=text + binary,
            headers={"Inference-Header-Content-Length": length, **headers},
            timeout=60,
        )

    def tensor(size, shape=2, **extra):
        return {
            "inputs": [
                {
                    "name": "image_bytes",
                    "shape": [shape],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": size},
                }
            ],
            **extra,
        }

    cases = [
        (post(tensor(len(framed)), framed, header="99999"), 400, "Inference-Header-Content-Length"),
        (post(tensor(len(framed)), framed, header="x"), 400, "Inference-Header-Content-Length"),
        (post(tensor(len(framed) + 5), framed), 400, "runs past"),
        (post(tensor(len(framed) - 5), framed), 400, "belong to no input"),
        (post(tensor(len(framed)), framed[:-3]), 400, "runs past"),
        (post(tensor(6), b"\xff\xff\x00\x00ab"), 400, "runs past"),
        (post(tensor(2), b"\x01\x00"), 400, "4-byte length"),
        (post(tensor(len(framed), shape=3), framed), 400, "does not match"),
        (post(tensor(-1), b""), 400, "non-negative integer"),
        (post(tensor(len(framed), parameters={"binary_data_output": "yes"}), framed), 400, ""),
        (post(b'{"inputs": [', framed), 400, "JSON Parse error"),
        (post(tensor(4, shape=1), struct.pack("<I", 0)), 400, "instance 0"),
        (post(tensor(len(framed)), framed, **{"Content-Encoding": "gzip"}), 400, "uncompressed"),
        (post(tensor(MAX_BODY), b"\0" * MAX_BODY), 413, "--max_body_bytes"),
        (
            requests.post(infer, json=tensor(len(framed)), timeout=60),
            400,
            "no Inference-Header-Content-Length",
        ),
    ]
    many = [b"x"] * 9
    frame9 = b"".join(struct.pack("<I", 1) + b for b in many)
    cases.append((post(tensor(len(frame9), shape=9), frame9), 400, "--max_instances"))
    for response, status, message in cases:
        assert response.status_code == status, (status, message, response.text[:300])
        assert message in response.json()["error"], (message, response.text[:300])
    assert served["proc"].poll() is None
    good = post(tensor(len(framed)), framed)
    assert good.status_code == 200, good.text
    assert [o["data"] for o in good.json()["outputs"] if o["name"] == "classes"] == [
        served["expected"]["classes"][:2].tolist()
    ]


# ----------------------------------------------------------------------------- gRPC
def test_tritonclient_grpc_equals_the_rest_json_route(served):
    client = triton_grpc.InferenceServerClient(served["grpc"])
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(NAME) and client.is_model_ready(NAME, "1")
        meta = client.get_model_metadata(NAME, as_json=True)
        assert meta["inputs"] == [{"name": "image_bytes", "datatype": "BYTES", "shape": ["-1"]}]
        assert {"name": "probabilities", "datatype": "FP32", "shape": ["-1", "3"]} in meta[
            "outputs"
        ]
        images, expected = served["images"], served["expected"]
        inputs = [triton_grpc.InferInput("image_bytes", [len(images)], "BYTES")]
        inputs[0].set_data_from_numpy(image_tensor(images))
        result = client.infer(NAME, inputs, request_id="g-1")
        assert result.get_response().id == "g-1" and result.get_response().model_version == "1"
        assert_same(result.as_numpy("classes"), result.as_numpy("probabilities"), expected)
        result = client.infer(
            NAME, inputs, model_version="1", outputs=[triton_grpc.InferRequestedOutput("classes")]
        )
        assert [o.name for o in result.get_response().outputs] == ["classes"]
        np.testing.assert_array_equal(result.as_numpy("classes"), expected["classes"])

        bad = triton_grpc.InferInput("image_bytes", [2], "BYTES")
        bad.set_data_from_numpy(image_tensor([b"not a jpeg", images[0]]))
        wrong_type = triton_grpc.InferInput("image_bytes", [1], "FP32")
        wrong_type.set_data_from_numpy(np.zeros(1, np.float32))
        for call, code, message in (
            (lambda: client.infer(NAME, [bad]), "INVALID_ARGUMENT", "instance 0"),
            (lambda: client.infer(NAME, [wrong_type]), "INVALID_ARGUMENT", "datatype"),
            (lambda: client.infer("other", inputs), "NOT_FOUND", "Latest(other)"),
            (lambda: client.infer(NAME, inputs, model_version="7"), "NOT_FOUND", "tiny, 7"),
            (lambda: client.is_model_ready("other"), "NOT_FOUND", "not served"),
            (
                lambda: client.infer(
                    NAME, inputs, outputs=[triton_grpc.InferRequestedOutput("logits")]
                ),
                "INVALID_ARGUMENT",
                "unknown outputs",
            ),
        ):
            with pytest.raises(triton_utils.InferenceServerException) as e:
                call()
            assert e.value.status() == f"StatusCode.{code}", (code, str(e.value))
            assert message in e.value.message(), (message, e.value.message())
        assert client.is_server_live()
    finally:
        client.close()


def test_tf_serving_prediction_service_client_equals_the_rest_json_route(served):
    images, expected = served["images"], served["expected"]
    with grpc.insecure_channel(served["grpc"]) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(tf_request(images), timeout=60)
        assert response.model_spec.name == NAME and response.model_spec.version.value == 1
        classes = response.outputs["classes"]
        assert classes.dtype == types_pb2.DT_INT32
        assert [d.size for d in classes.tensor_shape.dim] == [len(images)]
        probabilities = response.outputs["probabilities"]
        assert [d.size for d in probabilities.tensor_shape.dim] == [len(images), 3]
        assert_same(
            list(classes.int_val),
            np.reshape(probabilities.float_val, (len(images), 3)),
            expected,
        )
        # output_filter and an explicit version.
        request = tf_request(images[:1])
        request.model_spec.version.value = 1
        request.output_filter.append("classes")
        response = stub.Predict(request, timeout=60)
        assert list(response.outputs) == ["classes"]
        assert list(response.outputs["classes"].int_val) == expected["classes"][:1].tolist()

        meta = stub.GetModelMetadata(
            get_model_metadata_pb2.GetModelMetadataRequest(
                model_spec=request.model_spec, metadata_field=["signature_def"]
            ),
            timeout=60,
        )
        signatures = get_model_metadata_pb2.SignatureDefMap()
        assert meta.metadata["signature_def"].Unpack(signatures)
        signature = signatures.signature_def["serving_default"]
        assert signature.method_name == "tensorflow/serving/predict"
        assert signature.inputs["image_bytes"].dtype == types_pb2.DT_STRING
        assert [d.size for d in signature.inputs["image_bytes"].tensor_shape.dim] == [-1]
        assert signature.outputs["probabilities"].dtype == types_pb2.DT_FLOAT

        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": NAME}), timeout=60
        )
        (version,) = status.model_version_status
        state = get_model_status_pb2.ModelVersionStatus.State
        assert version.version == 1 and version.state == state.Value("AVAILABLE")

        labelled = tf_request(images[:1])
        labelled.model_spec.version_label = "stable"
        other_signature = tf_request(images[:1])
        other_signature.model_spec.signature_name = "nope"
        unknown = tf_request(images[:1], name="other")
        wrong_dtype = tf_request(images[:1], dtype=types_pb2.DT_FLOAT)
        wrong_shape = tf_request(images[:2], shape=[3])
        too_many = tf_request([images[0]] * 9)
        too_big = tf_request([b"\xff" * (MAX_BODY + 1)])
        not_jpeg = tf_request([b"GIF89a...."])
        for call, code, message in (
            (lambda: stub.Predict(unknown), grpc.StatusCode.NOT_FOUND, "Latest(other)"),
            (lambda: stub.Predict(labelled), grpc.StatusCode.INVALID_ARGUMENT, "label"),
            (lambda: stub.Predict(other_signature), grpc.StatusCode.INVALID_ARGUMENT, "nope"),
            (lambda: stub.Predict(wrong_dtype), grpc.StatusCode.INVALID_ARGUMENT, "DT_STRING"),
            (lambda: stub.Predict(wrong_shape), grpc.StatusCode.INVALID_ARGUMENT, "[3]"),
            (lambda: stub.Predict(too_many), grpc.StatusCode.INVALID_ARGUMENT, "--max_instances"),
            (lambda: stub.Predict(too_big), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
            (lambda: stub.Predict(not_jpeg), grpc.StatusCode.INVALID_ARGUMENT, "instance 0"),
            (
                lambda: stub.GetModelMetadata(
                    get_model_metadata_pb2.GetModelMetadataRequest(
                        model_spec={"name": NAME}, metadata_field=["nope"]
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "not supported",
            ),
            (
                lambda: model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
                    get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "other"})
                ),
                grpc.StatusCode.NOT_FOUND,
                "other",
            ),
            (
                lambda: stub.Classify(classification_pb2.ClassificationRequest()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "Input is empty",
            ),
            (
                lambda: stub.Regress(regression_pb2.RegressionRequest()),
                grpc.StatusCode.UNIMPLEMENTED,
                "call Predict",
            ),
            (
                lambda: channel.unary_unary("/tensorflow.serving.PredictionService/Predict")(
                    b"\x0a\xff\xff"
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "not a valid message",
            ),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == code, (code, e.value.details())
            assert message in (e.value.details() or ""), (message, e.value.details())
        assert served["proc"].poll() is None
        response = stub.Predict(tf_request(images[:1]), timeout=60)
        assert list(response.outputs["classes"].int_val) == expected["classes"][:1].tolist()


def test_port_mistakes_get_one_line_and_exit_2(served, capsys, tmp_path):
    from estimax import command

    busy = served["grpc"].rsplit(":", 1)[1]
    for args, message in (
        ([f"--grpc_port={busy}"], f"--grpc_port={busy}: cannot listen"),
        (["--port=18123", "--grpc_port=18123"], "is also --port"),
        (["--grpc_port=70000"], "is not a TCP port"),
    ):
        capsys.readouterr()
        assert command.main(["serve", f"--model_base_path={tmp_path}", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- hot reload
def test_new_version_under_grpc_traffic_drops_no_request(served, tmp_path):
    # Its own server and base path: the other tests' server keeps serving version 1 only.
    images, base = served["images"], str(tmp_path / "models")
    shutil.copytree(os.path.join(served["base"], "1"), os.path.join(base, "1"))
    grpc_port = fx.free_port()
    args = [
        f"--model_base_path={base}",
        f"--model_name={NAME}",
        f"--grpc_port={grpc_port}",
        "--file_system_poll_wait_seconds=0.2",
        "--enable_batching",
        "--max_batch_size=8",
        "--batch_timeout_micros=2000",
    ]
    with fx.running_server(args):
        reload_under_traffic({"grpc": f"127.0.0.1:{grpc_port}"}, images, base)


def reload_under_traffic(served, images, base):
    results, stop = [], threading.Event()

    def me():  # each client thread's results carry its name
        return threading.current_thread().name

    def tf_client():
        with grpc.insecure_channel(served["grpc"]) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            while not stop.is_set():
                try:
                    response = stub.Predict(tf_request(images[:1]), timeout=60)
                    results.append((me(), "ok", str(response.model_spec.version.value)))
                except grpc.RpcError as e:
                    results.append((me(), e.code().name, e.details()))

    def v2_client():
        client = triton_grpc.InferenceServerClient(served["grpc"])
        inputs = [triton_grpc.InferInput("image_bytes", [1], "BYTES")]
        inputs[0].set_data_from_numpy(image_tensor(images[:1]))
        try:
            while not stop.is_set():
                try:
                    response = client.infer(NAME, inputs).get_response()
                    results.append((me(), "ok", response.model_version))
                except triton_utils.InferenceServerException as e:
                    results.append((me(), e.status(), e.message()))
        finally:
            client.close()

    clients = {"tf-1": tf_client, "tf-2": tf_client, "v2": v2_client}
    threads = [threading.Thread(target=f, name=name) for name, f in clients.items()]
    for t in threads:
        t.start()
    try:
        fx_wait(lambda: {r[0] for r in results} == set(clients))  # each has had version 1
        # Publish version 2 as an export does: complete in a hidden folder, then renamed.
        shutil.copytree(os.path.join(base, "1"), os.path.join(base, ".tmp-2"))
        os.rename(os.path.join(base, ".tmp-2"), os.path.join(base, "2"))
        fx_wait(lambda: any(r[2] == "2" for r in results))
        fx_wait(lambda: version_states(served) == {1: "END", 2: "AVAILABLE"})
        seen = len(results)
        # ... and each client is answered again after the old one is gone (by 2, or an error
        # the assertions below show; a 1 answered before the unload may still be appended).
        fx_wait(lambda: {r[0] for r in results[seen:] if r[2] != "1"} == set(clients))
    finally:
        stop.set()
        for t in threads:
            t.join()
    failed = [r for r in results if r[1] != "ok"]
    assert not failed, failed[:3]
    # Per client, not across them: two clients' requests in flight at the switch may answer
    # (and append) in either order, but one client's next request never goes back to 1.
    for name in clients:
        versions = [r[2] for r in results if r[0] == name]
        assert versions[0] == "1" and versions[-1] == "2", (name, versions[:3], versions[-3:])
        assert versions == sorted(versions), name  # never back to the unloaded version


def version_states(served):
    with grpc.insecure_channel(served["grpc"]) as channel:
        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": NAME}), timeout=60
        )
    names = get_model_status_pb2.ModelVersionStatus.State
    return {s.version: names.Name(s.state) for s in status.model_version_status}


def fx_wait(condition, timeout=120.0):
    """Polls a condition of another process (not a timed assertion)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- numbers
def test_an_array_model_answers_the_same_on_every_route_and_encoding(tmp_path):
    # Raw little-endian FP32 (HTTP binary, gRPC raw contents, TensorProto tensor_content) and
    # typed values (JSON, gRPC fp32_contents, TensorProto float_val) all reach the same model.
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

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=str(tmp_path / "model")),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(x, (x[:, 0] > 0).astype(np.int32)), max_steps=2)
    base = tmp_path / "serving"
    export.export_version(est, str(base), serving_input=ex.TensorSpec((None, 4), np.float32))
    rows = x[:5]
    grpc_port = fx.free_port()
    with fx.running_server(
        [f"--model_base_path={base}", "--model_name=arr", f"--grpc_port={grpc_port}"]
    ) as (url, _):
        r = requests.post(f"{url}/v1/models/arr:predict", json={"instances": rows.tolist()})
        assert r.status_code == 200, r.text
        expected = {
            "classes": np.asarray([p["classes"] for p in r.json()["predictions"]]),
            "probabilities": np.asarray(
                [p["probabilities"] for p in r.json()["predictions"]], np.float32
            ),
        }
        answers = []
        client = triton_http.InferenceServerClient(url.removeprefix("http://"))
        for binary in (True, False):
            inputs = [triton_http.InferInput("input", list(rows.shape), "FP32")]
            inputs[0].set_data_from_numpy(rows, binary_data=binary)
            result = client.infer("arr", inputs)
            answers.append((f"http binary={binary}", result))
        gclient = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            inputs = [triton_grpc.InferInput("input", list(rows.shape), "FP32")]
            inputs[0].set_data_from_numpy(rows)  # raw_input_contents
            answers.append(("grpc raw", gclient.infer("arr", inputs)))
        finally:
            gclient.close()
        for name, result in answers:
            assert result.as_numpy("probabilities").dtype == np.float32, name
            assert_same(result.as_numpy("classes"), result.as_numpy("probabilities"), expected)
        shape = tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in rows.shape]
        )
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            for tensor in (
                tensor_pb2.TensorProto(
                    dtype=types_pb2.DT_FLOAT, tensor_shape=shape, tensor_content=rows.tobytes()
                ),
                tensor_pb2.TensorProto(
                    dtype=types_pb2.DT_FLOAT, tensor_shape=shape, float_val=rows.ravel().tolist()
                ),
            ):
                request = predict_pb2.PredictRequest()
                request.model_spec.name = "arr"
                request.inputs["input"].CopyFrom(tensor)
                response = stub.Predict(request, timeout=60)
                assert_same(
                    list(response.outputs["classes"].int_val),
                    np.reshape(response.outputs["probabilities"].float_val, (len(rows), 3)),
                    expected,
                )
            short = tensor_pb2.TensorProto(
                dtype=types_pb2.DT_FLOAT, tensor_shape=shape, tensor_content=rows.tobytes()[:-4]
            )
            request.inputs["input"].CopyFrom(short)
            with pytest.raises(grpc.RpcError) as e:
                stub.Predict(request, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "tensor_content" in e.value.details()
        # A raw FP32 tensor whose byte size does not fit its shape.
        text = (
            b'{"inputs":[{"name":"input","shape":[5,4],"datatype":"FP32",'
            b'"parameters":{"binary_data_size":76}}]}'
        )
        r = requests.post(
            f"{url}/v2/models/arr/infer",
            data=text + rows.tobytes()[:76],
            headers={"Inference-Header-Content-Length": str(len(text))},
        )
        assert r.status_code == 400 and "needs 80 bytes, got 76" in r.json()["error"], r.text


def test_checked_in_protos_are_what_the_proto_files_generate():
    # grpcio-tools is the `protos` extra (regenerating them), not needed to serve or test.
    pytest.importorskip("grpc_tools")
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "match the .proto files" in proc.stdout
