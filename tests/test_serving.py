"""Serving end to end: export_version -> `estimax serve` (a real process) -> real HTTP requests.

One tiny bfloat16 ResNet with an EMA of its weights is trained on small real JPEGs once per
module; every server test talks to real server processes over loopback.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import serving_fixtures as fx  # noqa: E402

from estimax import export  # noqa: E402
from estimax.serving.batching import Batcher, BatchingOptions, QueueFullError  # noqa: E402
from estimax.serving.manager import ModelManager  # noqa: E402

NAME = "tiny"


def b64(data: bytes, urlsafe: bool = False) -> str:
    return (base64.urlsafe_b64encode(data) if urlsafe else base64.b64encode(data)).decode()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The estimator, its held-out images and Estimator.predict on them, and version 1."""
    root = tmp_path_factory.mktemp("serving")
    images, labels = fx.make_jpegs(24)
    est = fx.build_estimator(str(root / "model"))
    est.train(ex_input(images[:16], labels[:16]), max_steps=2)
    held_out = images[16:]
    expected = fx.predict(est, held_out)
    base = root / "models"
    path = export.export_version(
        est, str(base), preprocessing=export.resnet_eval(fx.IMAGE_SIZE), check_inputs=held_out[:3]
    )
    assert path == str(base / "1")
    return {"est": est, "images": held_out, "expected": expected, "base": base, "root": root}


def ex_input(images, labels):
    import estimax as ex

    return ex.numpy_input_fn(fx.preprocess_all(images), labels)


@pytest.fixture(scope="module")
def server(trained):
    args = [
        f"--model_base_path={trained['base']}",
        f"--model_name={NAME}",
        "--file_system_poll_wait_seconds=0.2",
        "--enable_batching",
        "--max_batch_size=8",
        "--batch_timeout_micros=2000",
        "--max_instances=8",
        "--max_body_bytes=200000",
        "--max_image_pixels=20000",
    ]
    with fx.running_server(args) as (url, proc):
        yield url, proc


def assert_matches(predictions, expected):
    classes = np.asarray([p["classes"] for p in predictions])
    probabilities = np.asarray([p["probabilities"] for p in predictions])
    np.testing.assert_array_equal(classes, expected["classes"])
    np.testing.assert_allclose(probabilities, expected["probabilities"], rtol=1e-5, atol=1e-6)


def test_tf_serving_row_request_with_b64_jpegs_equals_estimator_predict(trained, server):
    url, _ = server
    images, expected = trained["images"], trained["expected"]
    # The TF Serving REST documentation's form: {"instances": [{"b64": ...}, ...]}.
    r = requests.post(
        f"{url}/v1/models/{NAME}:predict", json={"instances": [{"b64": b64(b)} for b in images]}
    )
    assert r.status_code == 200, r.text
    assert_matches(r.json()["predictions"], expected)
    # Named-input rows, URL-safe base64 without padding, an explicit version and signature.
    r = requests.post(
        f"{url}/v1/models/{NAME}/versions/1:predict",
        json={
            "signature_name": "serving_default",
            "instances": [
                {"image_bytes": {"b64": b64(b, urlsafe=True).rstrip("=")}} for b in images
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert_matches(r.json()["predictions"], expected)
    # Columnar: {"inputs": {...}} -> {"outputs": {name: [...]}}.
    r = requests.post(
        f"{url}/v1/models/{NAME}:predict",
        json={"inputs": {"image_bytes": [{"b64": b64(b)} for b in images]}},
    )
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]
    assert_matches(
        [
            {"classes": c, "probabilities": p}
            for c, p in zip(out["classes"], out["probabilities"], strict=False)
        ],
        expected,
    )


def test_v2_infer_equals_estimator_predict(trained, server):
    url, _ = server
    images, expected = trained["images"], trained["expected"]
    r = requests.post(
        f"{url}/v2/models/{NAME}/infer",
        json={
            "id": "req-1",
            "inputs": [
                {
                    "name": "image_bytes",
                    "shape": [len(images)],
                    "datatype": "BYTES",
                    "data": [b64(b) for b in images],
                }
            ],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == NAME and body["id"] == "req-1"
    outs = {o["name"]: o for o in body["outputs"]}
    assert outs["classes"]["datatype"] == "INT32" and outs["classes"]["shape"] == [len(images)]
    assert outs["probabilities"]["shape"] == [len(images), fx.NUM_CLASSES]
    probabilities = np.reshape(outs["probabilities"]["data"], outs["probabilities"]["shape"])
    assert_matches(
        [
            {"classes": c, "probabilities": p}
            for c, p in zip(outs["classes"]["data"], probabilities, strict=False)
        ],
        expected,
    )
    # Only the requested output comes back.
    r = requests.post(
        f"{url}/v2/models/{NAME}/versions/1/infer",
        json={
            "inputs": [
                {"name": "image_bytes", "shape": [1], "datatype": "BYTES", "data": [b64(images[0])]}
            ],
            "outputs": [{"name": "classes"}],
        },
    )
    assert [o["name"] for o in r.json()["outputs"]] == ["classes"]


def test_metadata_and_status_list_the_signature(trained, server):
    url, _ = server
    status = requests.get(f"{url}/v1/models/{NAME}").json()
    assert {
        "version": "1",
        "state": "AVAILABLE",
        "status": {"error_code": "OK", "error_message": ""},
    } in status["model_version_status"]
    meta = requests.get(f"{url}/v1/models/{NAME}/versions/1/metadata").json()
    assert meta["model_spec"] == {"name": NAME, "signature_name": "", "version": "1"}
    sig = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["inputs"]["image_bytes"]["dtype"] == "DT_STRING"
    assert sig["inputs"]["image_bytes"]["tensor_shape"]["dim"] == [{"size": "-1", "name": ""}]
    assert sig["outputs"]["classes"]["dtype"] == "DT_INT32"
    assert [d["size"] for d in sig["outputs"]["probabilities"]["tensor_shape"]["dim"]] == [
        "-1",
        str(fx.NUM_CLASSES),
    ]
    assert meta["metadata"]["signature_def"]["preprocessing"] == {
        "name": "resnet_eval",
        "version": 1,
        "params": {"image_size": fx.IMAGE_SIZE},
    }
    v2 = requests.get(f"{url}/v2/models/{NAME}").json()
    assert v2["inputs"] == [{"name": "image_bytes", "datatype": "BYTES", "shape": [-1]}]
    assert {"name": "probabilities", "datatype": "FP32", "shape": [-1, fx.NUM_CLASSES]} in (
        v2["outputs"]
    )
    assert requests.get(f"{url}/v2/health/live").status_code == 200
    assert requests.get(f"{url}/v2/models/{NAME}/ready").status_code == 200
    assert requests.get(f"{url}/v2/models/other/ready").status_code == 404
    assert requests.get(f"{url}/v2").json()["name"] == "estimax"
    openapi = requests.get(f"{url}/openapi.json").json()
    assert "/v1/models/{name}:predict" in openapi["paths"]
    assert "/v2/models/{name}/infer" in openapi["paths"]


def test_every_bad_request_gets_its_4xx_and_the_server_keeps_serving(trained, server):
    url, proc = server
    good = b64(trained["images"][0])
    big = fx.make_jpegs(1, seed=5)[0][0]
    import simplejpeg

    huge = simplejpeg.encode_jpeg(np.zeros((200, 150, 3), np.uint8), colorspace="RGB")
    predict = f"{url}/v1/models/{NAME}:predict"
    infer = f"{url}/v2/models/{NAME}/infer"
    cases = [
        ("post", predict, b"{not json", 400, "JSON Parse error"),
        ("post", predict, {"instances": [{"b64": "%%%"}]}, 400, "Unable to base64 decode"),
        ("post", predict, {"instances": [{"b64": b64(b"hello")}]}, 400, "not a decodable JPEG"),
        ("post", predict, {"instances": [{"b64": b64(big[:60])}]}, 400, "instance 0"),
        ("post", predict, {"instances": [{"b64": b64(huge)}]}, 400, "--max_image_pixels"),
        ("post", predict, {"instances": ["raw string"]}, 400, "encoded image bytes"),
        ("post", predict, {"instances": [{"pixels": {"b64": good}}]}, 400, "image_bytes"),
        (
            "post",
            predict,
            {"instances": [{"b64": good}], "inputs": [{"b64": good}]},
            400,
            "Not both",
        ),
        (
            "post",
            predict,
            {"signature_name": "serving_default"},
            400,
            "Missing 'inputs' or 'instances' key",
        ),
        ("post", predict, {"instances": []}, 400, "non-empty"),
        ("post", predict, [1, 2], 400, "JSON object"),
        ("post", predict, {"instances": [{"b64": good}] * 9}, 400, "--max_instances"),
        ("post", predict, {"instances": [{"b64": "A" * 300_000}]}, 413, "--max_body_bytes"),
        (
            "post",
            predict,
            {"signature_name": "nope", "instances": [{"b64": good}]},
            400,
            "not found in signature def",
        ),
        (
            "post",
            f"{url}/v1/models/other:predict",
            {"instances": [{"b64": good}]},
            404,
            "Servable not found for request: Latest(other)",
        ),
        (
            "post",
            f"{url}/v1/models/{NAME}/versions/7:predict",
            {"instances": [{"b64": good}]},
            404,
            "Specific(tiny, 7)",
        ),
        (
            "post",
            f"{url}/v1/models/{NAME}/versions/x:predict",
            {"instances": [{"b64": good}]},
            400,
            "versions are integers",
        ),
        ("get", f"{url}/v1/models/other", None, 404, "Could not find any versions"),
        ("get", f"{url}/v1/models/{NAME}/versions/9/metadata", None, 404, "Servable not found"),
        ("post", f"{url}/v1/models/{NAME}:classify", {"examples": []}, 400, "one example"),
        ("post", f"{url}/v1/models/{NAME}:regress", {"examples": []}, 400, "not supported"),
        ("get", f"{url}/v1/nothing/here", None, 404, "Malformed request"),
        (
            "post",
            infer,
            {"inputs": [{"name": "image_bytes", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
            400,
            "datatype",
        ),
        (
            "post",
            infer,
            {
                "inputs": [
                    {"name": "image_bytes", "shape": [2], "datatype": "BYTES", "data": [good]}
                ]
            },
            400,
            "does not match",
        ),
        (
            "post",
            infer,
            {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": [good]}]},
            400,
            "unknown input",
        ),
        ("post", infer, {"inputs": [{"name": "image_bytes", "shape": [1]}]}, 400, "'data'"),
        (
            "post",
            infer,
            {
                "inputs": [
                    {"name": "image_bytes", "shape": [1], "datatype": "BYTES", "data": [good]}
                ],
                "outputs": [{"name": "logits"}],
            },
            400,
            "unknown outputs",
        ),
        ("post", infer, {"nope": 1}, 400, "'inputs' list"),
        (
            "post",
            infer,
            {
                "inputs": [
                    {"name": ["image_bytes"], "shape": [1], "datatype": "BYTES", "data": [good]}
                ]
            },
            400,
            "unknown input",
        ),
        (
            "post",
            infer,
            {
                "inputs": [
                    {"name": "image_bytes", "shape": [1], "datatype": "BYTES", "data": [good]}
                ]
                * 2
            },
            400,
            "given twice",
        ),
        (
            "post",
            infer,
            {
                "inputs": [
                    {"name": "image_bytes", "shape": [1.5], "datatype": "BYTES", "data": [good]}
                ]
            },
            400,
            "'shape'",
        ),
        ("post", predict, {"instances": [[{"b64": good}]]}, 400, "encoded image bytes"),
        ("post", predict, {"inputs": {"b64": good}}, 400, "must be a list"),
        ("post", f"{url}/v2/models/other/infer", {"inputs": []}, 404, "Servable not found"),
        ("post", predict, b"[" * 100_000, 400, ""),
    ]
    for method, target, body, status, message in cases:
        kwargs = (
            {"data": body}
            if isinstance(body, bytes)
            else {"json": body}
            if body is not None
            else {}
        )
        r = getattr(requests, method)(target, timeout=60, **kwargs)
        assert r.status_code == status, (
            target,
            body if not isinstance(body, dict) else str(body)[:200],
            r.status_code,
            r.text[:300],
        )
        assert message in r.json()["error"], (message, r.text[:300])
    assert proc.poll() is None
    r = requests.post(predict, json={"instances": [{"b64": good}]})
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1


def test_new_version_is_picked_up_with_no_failed_request(trained, server):
    url, _ = server
    base, image = trained["base"], b64(trained["images"][0])
    results, stop = [], threading.Event()

    def client(me):  # keeps sending while the new version is loaded and the old one unloaded
        while not stop.is_set():
            r = requests.post(
                f"{url}/v2/models/{NAME}/infer",
                timeout=60,
                json={
                    "inputs": [
                        {"name": "image_bytes", "shape": [1], "datatype": "BYTES", "data": [image]}
                    ]
                },
            )
            results.append((r.status_code, r.json().get("model_version", r.text), me))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        path = export.export_version(
            trained["est"], str(base), preprocessing=export.resnet_eval(fx.IMAGE_SIZE)
        )
        assert path == str(base / "2")
        wait_for(lambda: states(url) == {"2": "AVAILABLE", "1": "END"})
        seen = len(results)
        wait_for(lambda: len(results) > seen + 5)  # and a few more after the switch
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert all(code == 200 for code, _, _ in results), [r for r in results if r[0] != 200][:3]
    versions = [v for _, v, _ in results]
    assert "1" in versions and versions[-1] == "2"
    for me in range(3):  # a client never goes back to the old one (answers of different
        # clients may arrive in another order than the versions were taken)
        mine = [v for _, v, who in results if who == me]
        assert mine == sorted(mine), me

    # A broken version 3 is reported and never replaces the working version 2.
    broken = base / ".tmp-broken"
    shutil.copytree(base / "2", broken)
    (broken / "model.jaxexport").write_bytes(b"not a model")
    os.rename(broken, base / "3")
    wait_for(lambda: states(url).get("3") == "END")
    status = requests.get(f"{url}/v1/models/{NAME}/versions/3").json()["model_version_status"]
    assert status[0]["status"]["error_code"] != "OK" and status[0]["status"]["error_message"]
    assert states(url)["2"] == "AVAILABLE"
    r = requests.post(
        f"{url}/v2/models/{NAME}/infer",
        json={
            "inputs": [{"name": "image_bytes", "shape": [1], "datatype": "BYTES", "data": [image]}]
        },
    )
    assert r.status_code == 200 and r.json()["model_version"] == "2"


def states(url):
    body = requests.get(f"{url}/v1/models/{NAME}").json()
    return {s["version"]: s["state"] for s in body["model_version_status"]}


def wait_for(condition, timeout=120.0):
    """Polls a condition of another process (not a timed assertion)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_predict_and_export_check_run_without_the_model_code(trained, tmp_path, capsys):
    # A fresh process in which importing the model's code or the estimator fails.
    base = tmp_path / "models"
    shutil.copytree(trained["base"] / "1", base / "1")
    image_files = []
    for i, data in enumerate(trained["images"]):
        image_files.append(str(tmp_path / f"{i}.jpg"))
        with open(image_files[-1], "wb") as f:
            f.write(data)
    # A wrong expectation (as if the export had changed) must fail loudly: a second copy.
    bad = tmp_path / "changed"
    shutil.copytree(base, bad)
    check = bad / "1" / export.versions.CHECK_FILE
    record = json.loads(check.read_text())
    record["expected"]["probabilities"][1][0] += 0.01
    check.write_text(json.dumps(record))
    # One guarded process runs the three command lines in turn (one import of JAX, not three);
    # after each it writes its exit code and a marker to stdout and stderr.
    guard = (
        "import json, sys\n"
        "for m in ('estimax.models', 'estimax.programs', 'estimax.estimator',"
        " 'optax', 'orbax'):\n    sys.modules[m] = None\n"
        "from estimax import command\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    rc = command.main(argv)\n"
        "    for f in (sys.stdout, sys.stderr):\n"
        "        print('=== exit', rc, file=f, flush=True)\n"
    )
    commands = [
        ["predict", f"--model_base_path={base}", "--top_k=2", *image_files],
        ["export-check", f"--model_base_path={base}"],
        ["export-check", f"--model_base_path={bad}"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", guard, json.dumps(commands)],
        env=fx.server_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = re.split(r"=== exit (-?\d+)\n", proc.stdout)
    errs = re.split(r"=== exit -?\d+\n", proc.stderr)
    assert len(outs) == 2 * len(commands) + 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (predicted, predict_rc), (checked, check_rc), (_, bad_rc) = zip(
        outs[0:-1:2], map(int, outs[1::2]), strict=True
    )
    assert predict_rc == 0, errs[0][-2000:]
    lines = [json.loads(x) for x in predicted.splitlines()]
    assert [x["classes"] for x in lines] == trained["expected"]["classes"].tolist()
    for line, probs in zip(lines, trained["expected"]["probabilities"], strict=False):
        top = np.argsort(-probs)[:2]
        assert [c for c, _ in line["top_k"]] == top.tolist()
        np.testing.assert_allclose([p for _, p in line["top_k"]], probs[top], rtol=1e-5)

    assert check_rc == 0 and "3 examples match" in checked, errs[1][-2000:]
    assert bad_rc == 1 and "FAILED" in errs[2] and "example #1" in errs[2], errs[2]
    # Bad command lines: one line, non-zero exit, no traceback (in this process: cheaper).
    from estimax import command

    for args, message in (
        (["predict", f"--model_base_path={tmp_path}/none", "x.jpg"], "does not exist"),
        (["predict", f"--model_base_path={base}", str(tmp_path / "no.jpg")], "no.jpg"),
        (["serve", f"--model_base_path={tmp_path}/none"], "does not exist"),
        (
            [
                "serve",
                f"--model_base_path={base}",
                "--max_batch_size=4",
                "--allowed_batch_sizes=1,2",
            ],
            "--allowed_batch_sizes",
        ),
    ):
        capsys.readouterr()
        assert command.main(args) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_export_check_refuses_an_export_that_differs(trained, tmp_path):
    from estimax.export.versions import ExportCheckError, compare

    expected = trained["expected"]
    compare(expected, expected, 1e-3, 1e-4, "same")
    changed = dict(expected, classes=expected["classes"] + 1)
    with pytest.raises(ExportCheckError, match="'classes' differs for 8 of 8"):
        compare(changed, expected, 1e-3, 1e-4, "changed")


def test_versions_on_an_object_store_appear_only_when_complete(trained):
    import fsspec

    base = "memory://serving-test/models"
    fs = fsspec.filesystem("memory")
    path = export.export_version(
        trained["est"], base, top_k=2, preprocessing=export.resnet_eval(fx.IMAGE_SIZE)
    )
    assert path.rstrip("/").endswith("serving-test/models/1") and path.startswith("memory://")
    # A version still being uploaded (no serving.json yet) is not listed.
    for name in ("model.jaxexport", "variables.msgpack", "signature.json"):
        fs.pipe(f"/serving-test/models/2/{name}", fs.cat(f"/serving-test/models/1/{name}"))
    assert export.list_versions(base) == [1]
    got = export.Servable(path).predict_images(trained["images"])
    np.testing.assert_array_equal(got["classes"], trained["expected"]["classes"])
    # top_k (an export option): the two most likely classes and their probabilities.
    order = np.argsort(-trained["expected"]["probabilities"], axis=1, kind="stable")[:, :2]
    np.testing.assert_array_equal(got["top_k_classes"], order)
    np.testing.assert_array_equal(got["top_k_classes"][:, 0], got["classes"])
    np.testing.assert_allclose(
        got["top_k_probabilities"],
        np.take_along_axis(trained["expected"]["probabilities"], order, axis=1),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        got["probabilities"], trained["expected"]["probabilities"], rtol=1e-5, atol=1e-6
    )


def test_unloaded_version_releases_its_device_memory(trained, tmp_path):
    base = tmp_path / "models"
    shutil.copytree(trained["base"] / "1", base / "1")
    manager = ModelManager("m", str(base), batch_sizes=[1], poll_wait_seconds=0)
    manager.poll()
    old = manager.get()
    buffers = [x for x in __import__("jax").tree.leaves(old.model._variables)]
    assert buffers and not any(b.is_deleted() for b in buffers)
    shutil.copytree(base / "1", base / ".tmp")
    os.rename(base / ".tmp", base / "2")
    manager.poll()
    assert manager.get().version == 2 and [s.state for s in manager.states()] == [
        "AVAILABLE",
        "END",
    ]
    assert all(b.is_deleted() for b in buffers) and not old.acquire()


def test_batcher_merges_concurrent_requests_and_refuses_past_its_queue():
    calls = []

    def run(features):
        calls.append(len(features["x"]))
        return {"y": features["x"] * 2}

    async def scenario():
        with ThreadPoolExecutor(1) as pool:
            # max_batch_size reached: the batch closes at once (a 60 s timeout is never waited).
            batcher = Batcher(
                BatchingOptions(
                    max_batch_size=4, batch_timeout_micros=60_000_000, max_enqueued_batches=2
                ),
                pool,
            )
            key = object()
            outs = await asyncio.gather(
                *[batcher.submit(key, run, {"x": np.full((1, 2), i)}) for i in range(4)]
            )
            assert calls == [4]
            for i, out in enumerate(outs):
                np.testing.assert_array_equal(out["y"], np.full((1, 2), 2 * i))
            await batcher.close()

            # A full queue answers at once.
            gate = threading.Event()
            blocked = Batcher(
                BatchingOptions(max_batch_size=2, batch_timeout_micros=0, max_enqueued_batches=1),
                pool,
            )
            slow = lambda f: (gate.wait(), run(f))[1]  # noqa: E731
            first = asyncio.ensure_future(blocked.submit(key, slow, {"x": np.ones((2, 1))}))
            await asyncio.sleep(0)
            while blocked._queued:  # the first batch leaves the queue and blocks in `slow`
                await asyncio.sleep(0)
            queued = asyncio.ensure_future(blocked.submit(key, slow, {"x": np.ones((2, 1))}))
            await asyncio.sleep(0)
            with pytest.raises(QueueFullError, match="queue .* is full"):
                await blocked.submit(key, slow, {"x": np.ones((1, 1))})
            gate.set()
            await asyncio.gather(first, queued)
            await blocked.close()

    asyncio.run(scenario())


def test_array_export_and_the_demo_answer_a_held_out_digit(tmp_path):
    # MNIST keeps its array input: [B, 784] float32, scaled as the mnist program's parser.
    import flax.linen as nn
    import jax
    import optax

    import estimax as ex
    from estimax.data import TFRecordWriter, encode_example

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(10)(features)
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
    pixels = rng.integers(0, 256, (16, 784), dtype=np.uint8)
    labels = (pixels[:, :392].mean(1) > pixels[:, 392:].mean(1)).astype(np.int32)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with TFRecordWriter(str(data_dir / "validation.tfrecords")) as w:
        for p, y in zip(pixels, labels, strict=False):
            w.write(encode_example({"image_raw": p.tobytes(), "label": int(y)}))
    x = pixels.astype(np.float32) / 255.0 - 0.5
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=str(tmp_path / "model")),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(x, labels), max_steps=2)
    base = tmp_path / "serving"
    export.export_version(
        est, str(base), serving_input=ex.TensorSpec((None, 784), np.float32), check_inputs=x[:4]
    )
    expected = next(iter(est.predict(ex.numpy_input_fn(x[:1], None, shuffle=False, num_epochs=1))))

    servable = export.Servable(str(base / "1"))
    assert servable.inputs == {"input": {"shape": [None, 784], "dtype": "float32"}}
    for bad, message in (
        ({"input": [[0.0] * 783]}, r"shape \[1, 783\].*\[batch, 784\]"),
        ({"input": [["a"] * 784]}, "numbers"),
        ({"input": [[0.0] * 784, [0.0]]}, "ragged|shape"),
        ({"pixels": [[0.0] * 784]}, "unknown"),
    ):
        with pytest.raises(export.InvalidInput, match=message):
            servable.prepare(bad)

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "estimax.serving.demo",
            f"--model_base_path={base}",
            f"--data_dir={data_dir}",
        ],
        env=fx.server_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The server's JSON worker processes are shut down, not left for the interpreter's exit
    # (which ended the quick start with multiprocessing's "leaked semaphore objects" warning).
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"curl -d @{tmp_path / 'request.json'} http://127.0.0.1:" in proc.stdout
    assert (
        f"held-out digit #0: class {int(expected['classes'])} (probability "
        f"{float(expected['probabilities'][expected['classes']]):.3f}); its label is "
        f"{labels[0]}"
    ) in proc.stdout, proc.stdout
    body = json.loads((tmp_path / "request.json").read_text())
    np.testing.assert_allclose(body["instances"][0], x[0], rtol=1e-6)


def test_the_export_holds_the_ema_weights_the_estimator_predicts_with(trained):
    # The run keeps an EMA (decay 0.9): the export must hold it, not the raw trained weights
    # (served predictions equal Estimator.predict, which uses the EMA, in the tests above).
    import jax
    from flax import serialization

    raw = trained["est"].get_variables()
    exported = serialization.msgpack_restore(
        (trained["base"] / "1" / "variables.msgpack").read_bytes()
    )
    raw_leaves = jax.tree.leaves(raw["params"])
    exported_leaves = jax.tree.leaves(exported["params"])
    assert [x.shape for x in raw_leaves] == [x.shape for x in exported_leaves]
    assert any(not np.allclose(a, b) for a, b in zip(raw_leaves, exported_leaves, strict=True))
    for a, b in zip(
        jax.tree.leaves(raw["batch_stats"]), jax.tree.leaves(exported["batch_stats"]), strict=True
    ):
        np.testing.assert_array_equal(a, b)
