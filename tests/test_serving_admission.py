"""Admission (issue #53): deadlines, priorities, the response cache and sharing between models.

One real server for the module, in this process (its HTTP and gRPC ports, three copies of the
small raw-image export), so a model's runs can be held on an ``Event`` (``Valve``): a queue is
saturated deterministically, and what ran is counted, never timed. Clients: NVIDIA's
``tritonclient.http`` and plain HTTP for v2 REST; for gRPC a real channel with the v2 and TF
Serving stubs (``estimax.serving.protos``: this process serves gRPC, and tritonclient's gRPC
messages share their names with the server's). The queueing rules themselves (the batching
queue's order, aging) are also checked in process on their own, with a stand-in clock.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import json
import os
import shutil
import threading
import time
import types

import numpy as np
import pytest

requests = pytest.importorskip("requests")
grpc = pytest.importorskip("grpc")
uvicorn = pytest.importorskip("uvicorn")
triton_http = pytest.importorskip("tritonclient.http")
triton_utils = pytest.importorskip("tritonclient.utils")

import serving_fixtures as fx  # noqa: E402

from estimax.export import record as record_lib  # noqa: E402
from estimax.serving import admission, response_cache  # noqa: E402
from estimax.serving.batching import Batcher, BatchingOptions  # noqa: E402
from estimax.serving.manager import ModelManager  # noqa: E402
from estimax.serving.options import ServerOptions  # noqa: E402

LOW, HIGH = 3, 1  # --priority_levels=3: 1 the highest


class Valve:
    """Wraps a servable's ``run``: counts each run's instance count, and holds runs while shut."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.sizes: list[int] = []
        self.started = threading.Semaphore(0)

    def wrap(self, run):
        def held(features):
            self.sizes.append(int(next(iter(features.values())).shape[0]))
            self.started.release()
            assert self.open.wait(120), "the valve was never opened"
            return run(features)

        return held

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=120), "no run started"


def wait(condition, what: str, timeout: float = 60.0) -> None:
    """Waits for ``condition()`` (a state change on another thread), bounded."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def served(tmp_path_factory, dense_export):
    """A server of models a, b, c (c's answers cached), run caps of 1 per model on 2 threads."""
    from estimax.serving.server import Server

    root = tmp_path_factory.mktemp("admission")
    options = ServerOptions(
        grpc_port=fx.free_port(),
        metrics_paths=("/metrics",),
        access_log=False,
        enable_model_warmup=False,
        max_concurrent_per_model=1,
        priority_aging_ms=600_000,  # no aging within a test: the order is the levels'
        response_cache_models=("c",),
        rest_api_timeout_in_ms=120_000,
    )
    options.batching.num_batch_threads = 2
    bases = {n: dense_export(str(root / n)) for n in "abc"}
    managers = [ModelManager(n, b, [1], poll_wait_seconds=0) for n, b in bases.items()]
    server = Server(managers, options)
    for m in managers:
        m.start()
    valves = {}
    for n in "abc":
        valves[n] = Valve()
        servable = server.core.models[n].manager.get()
        servable.run = valves[n].wrap(servable.run)
    port = fx.free_port()
    uv = uvicorn.Server(
        uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait(lambda: uv.started, "the server to start", 120)
    images, _ = fx.make_jpegs(8)
    channel = grpc.insecure_channel(f"127.0.0.1:{options.grpc_port}")
    try:
        yield types.SimpleNamespace(
            url=f"http://127.0.0.1:{port}",
            host=f"127.0.0.1:{port}",
            channel=channel,
            core=server.core,
            valves=valves,
            bases=bases,
            images=images,
        )
    finally:
        for v in valves.values():
            v.open.set()
        channel.close()
        uv.should_exit = True
        thread.join(30)
        for m in managers:
            m.stop()


def v2_body(images: list[bytes], **parameters) -> dict:
    body = {
        "inputs": [
            {
                "name": "image_bytes",
                "shape": [len(images)],
                "datatype": "BYTES",
                "data": [base64.b64encode(i).decode() for i in images],
            }
        ]
    }
    if parameters:
        body["parameters"] = parameters
    return body


def post(served, model: str, n: int, **parameters) -> requests.Response:
    """A v2 JSON inference of ``n`` images (n identifies the request to the valve)."""
    body = v2_body(served.images[:n], **parameters)
    return requests.post(f"{served.url}/v2/models/{model}/infer", json=body, timeout=120)


def metric(served, name: str, **labels) -> float:
    """A Prometheus sample's value from /metrics (0 if absent)."""
    text = requests.get(served.url + "/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def triton_input(images: list[bytes]):
    tensor = triton_http.InferInput("image_bytes", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_), binary_data=True)
    return [tensor]


def grpc_v2(served):
    from estimax.serving.protos.triton import grpc_service_pb2 as pb
    from estimax.serving.protos.triton import grpc_service_pb2_grpc as stubs

    return pb, stubs.GRPCInferenceServiceStub(served.channel)


def grpc_request(pb, model: str, images: list[bytes]):
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="image_bytes", datatype="BYTES", shape=[len(images)])
    tensor.contents.bytes_contents.extend(images)
    return request


def hold(served, model: str):
    """Shuts ``model``'s valve and starts one request (1 image) that holds its only slot."""
    valve = served.valves[model]
    valve.started = threading.Semaphore(0)  # runs of earlier tests counted there too
    valve.open.clear()
    pool = concurrent.futures.ThreadPoolExecutor(16)
    first = pool.submit(post, served, model, 1)
    valve.wait_started()
    return valve, pool, first


def waiting(served, model: str) -> int:
    gate = served.core.models[model].gate
    return gate.waiting


# ----------------------------------------------------------------------------- deadlines
def test_a_request_past_its_timeout_in_the_queue_gets_504_and_never_runs(served):
    valve, pool, first = hold(served, "a")
    before = metric(
        served, "estimax_serving_deadline_exceeded_total", model_name="a", stage="queued"
    )
    client = triton_http.InferenceServerClient(served.host)
    try:
        with pytest.raises(triton_utils.InferenceServerException) as e:
            client.infer("a", triton_input(served.images[:2]), timeout=100_000)  # 100 ms
        assert e.value.status() == "504" and admission.DEADLINE_MESSAGE in e.value.message()
        assert valve.sizes == [1]  # still held: the queued request did not run
    finally:
        valve.open.set()
        client.close()
    assert first.result().status_code == 200
    assert post(served, "a", 5).status_code == 200  # runs after anything still queued
    assert valve.sizes[-2:] == [1, 5] and 2 not in valve.sizes
    after = metric(
        served, "estimax_serving_deadline_exceeded_total", model_name="a", stage="queued"
    )
    assert after == before + 1
    pool.shutdown()


def test_grpc_deadlines_and_the_timeout_parameter_end_a_queued_request_unrun(served):
    pb, stub = grpc_v2(served)
    valve, pool, first = hold(served, "a")
    try:
        with pytest.raises(grpc.RpcError) as e:  # the call's own deadline
            stub.ModelInfer(grpc_request(pb, "a", served.images[:2]), timeout=0.2)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        request = grpc_request(pb, "a", served.images[:3])
        request.parameters["timeout"].int64_param = 100_000  # v2's, in microseconds
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert admission.DEADLINE_MESSAGE in e.value.details()
        assert valve.sizes[-1] == 1  # still held
    finally:
        valve.open.set()
    assert first.result().status_code == 200
    stub.ModelInfer(grpc_request(pb, "a", served.images[:5]), timeout=60)
    assert valve.sizes[-2:] == [1, 5] and 2 not in valve.sizes and 3 not in valve.sizes
    pool.shutdown()


def test_a_tf_serving_predict_call_past_its_grpc_deadline_never_runs(served):
    """The gRPC deadline bounds every service's calls, TF Serving's PredictionService too."""
    from estimax.serving.protos.tensorflow.core.framework import (
        tensor_pb2,
        tensor_shape_pb2,
        types_pb2,
    )
    from estimax.serving.protos.tensorflow_serving.apis import (
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    def predict(n: int):
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "a"
        shape = tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n)]
        )
        request.inputs["image_bytes"].CopyFrom(
            tensor_pb2.TensorProto(
                dtype=types_pb2.DT_STRING, tensor_shape=shape, string_val=served.images[:n]
            )
        )
        return request

    stub = prediction_service_pb2_grpc.PredictionServiceStub(served.channel)
    before = metric(
        served, "estimax_serving_deadline_exceeded_total", model_name="a", stage="queued"
    )
    valve, pool, first = hold(served, "a")
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.Predict(predict(6), timeout=0.2)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server counts it when its own timer (or gRPC's cancellation) ends the call.
        name = "estimax_serving_deadline_exceeded_total"
        wait(
            lambda: metric(served, name, model_name="a", stage="queued") == before + 1,
            "the server to count the expired call",
        )
        assert valve.sizes[-1] == 1  # still held
    finally:
        valve.open.set()
    assert first.result().status_code == 200
    assert stub.Predict(predict(5), timeout=60).model_spec.name == "a"
    assert valve.sizes[-2:] == [1, 5] and 6 not in valve.sizes
    pool.shutdown()


# ----------------------------------------------------------------------------- priorities
def test_priorities_reorder_a_saturated_queue(served):
    valve, pool, first = hold(served, "b")
    try:
        low = []
        for n in (2, 3):  # one after the other: their order of arrival is known
            low.append(pool.submit(post, served, "b", n, priority=LOW))
            wait(lambda n=n: waiting(served, "b") == n - 1, "a low-priority request to queue")
        default = pool.submit(post, served, "b", 4)  # the default level, 2
        wait(lambda: waiting(served, "b") == 3, "the default-level request to queue")
        high = pool.submit(post, served, "b", 5, priority=HIGH)
        wait(lambda: waiting(served, "b") == 4, "the high-priority request to queue")
    finally:
        valve.open.set()
    for f in [first, *low, default, high]:
        assert f.result().status_code == 200
    # Highest level first; within a level, first come first served.
    assert valve.sizes[-5:] == [1, 5, 4, 2, 3]
    pool.shutdown()


@pytest.fixture(scope="module")
def own_levels(served, tmp_path_factory, dense_export):
    """Model d, 5 levels of its own and its default the lowest, from its base path's
    config.json (Triton's JSON names); a, b and c keep the server's 3 levels, default 2."""
    base = dense_export(str(tmp_path_factory.mktemp("own_levels")))
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump({"dynamic_batching": {"priority_levels": 5, "default_priority_level": 5}}, f)
    manager = ModelManager("d", base, [1], poll_wait_seconds=0)
    served.core.add(manager)
    manager.start()
    served.valves["d"] = Valve()
    servable = manager.get()
    servable.run = served.valves["d"].wrap(servable.run)
    yield "d"
    manager.stop()


def test_a_models_own_priority_levels_order_its_queue_and_the_others_keep_the_server_default(
    served, own_levels
):
    config = requests.get(f"{served.url}/v2/models/d/config", timeout=30).json()
    assert config["parameters"]["priority_levels"] == {"string_value": "5"}
    assert config["parameters"]["default_priority_level"] == {"string_value": "5"}
    other = requests.get(f"{served.url}/v2/models/b/config", timeout=30).json()
    assert other["parameters"]["priority_levels"] == {"string_value": "3"}
    assert other["parameters"]["default_priority_level"] == {"string_value": "2"}
    # Level 5 is d's own: b (3 levels) refuses it, over REST and gRPC, before any work.
    refused = post(served, "b", 1, priority=5)
    assert refused.status_code == 400 and "give 1 (highest) to 3" in refused.json()["error"]
    pb, stub = grpc_v2(served)
    request = grpc_request(pb, "b", served.images[:1])
    request.parameters["priority"].int64_param = 5
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(request, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert post(served, "d", 1, priority=6).status_code == 400
    valve, pool, first = hold(served, "d")
    try:
        queued = []
        # A request of level 5, one of no priority (d's default: 5), then levels 4 and 1.
        for n, parameters in ((2, {"priority": 5}), (3, {}), (4, {"priority": 4})):
            queued.append(pool.submit(post, served, "d", n, **parameters))
            wait(lambda n=n: waiting(served, "d") == n - 1, f"request {n} to queue")
        request = grpc_request(pb, "d", served.images[:5])
        request.parameters["priority"].int64_param = 1  # gRPC takes d's levels too
        queued.append(pool.submit(stub.ModelInfer, request, timeout=120))
        wait(lambda: waiting(served, "d") == 4, "the level-1 request to queue")
    finally:
        valve.open.set()
    assert first.result().status_code == 200
    assert [f.result().status_code for f in queued[:3]] == [200] * 3
    assert queued[3].result().model_name == "d"
    # Level 1, then 4, then the two of level 5 (the default one among them) as they came.
    assert valve.sizes[-5:] == [1, 5, 4, 2, 3]
    pool.shutdown()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "config.json: not JSON"),
        ('{"bogus": 1}', "config.json: unknown fields ['bogus']"),
        ('{"response_cache": {"enable": 1}}', "response_cache.enable must be true or false"),
        ('{"response_cache": true}', 'response_cache must be {"enable": true}'),
        ('{"dynamic_batching": {"priority_levels": 0}}', "priority_levels must be an integer >= 1"),
        ('{"dynamic_batching": {"priority_levels": "x"}}', "priority_levels must be an integer"),
        (
            '{"dynamic_batching": {"priority_levels": 2, "default_priority_level": 3}}',
            "default_priority_level=3 is outside its priority_levels=2",
        ),
    ],
)
def test_a_bad_config_json_in_a_base_path_is_one_line_naming_it(tmp_path, text, message):
    from estimax.serving.core import ServingCore

    (tmp_path / "config.json").write_text(text)
    core = ServingCore([], ServerOptions(access_log=False))
    with pytest.raises(ValueError) as e:
        core.prepare(ModelManager("m", str(tmp_path), [1], poll_wait_seconds=0))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(tmp_path / "config.json") in str(e.value) or "model 'm'" in str(e.value)


def test_the_settings_sources_override_in_order():
    from estimax.serving import model_settings

    options = ServerOptions(
        priority_levels=3, default_priority_level=2, response_cache_models=("m",)
    )
    assert model_settings.resolve("m", options) == model_settings.ModelSettings(True, 3, 2)
    assert not model_settings.resolve("n", options).response_cache
    file = {"response_cache": False, "priority_levels": 5}
    override = {"response_cache": True}
    # The override's field wins over the file's, the file's over the server's flags.
    assert model_settings.resolve("m", options, {}, file) == model_settings.ModelSettings(
        False, 5, 2
    )
    assert model_settings.resolve("m", options, override, file).response_cache
    # Levels alone: the server's default level, or the model's lowest if that is beyond them.
    assert model_settings.resolve("m", options, {"priority_levels": 1}).default_priority_level == 1
    # Triton's JSON writes uint64 as strings; a config read back parses again.
    parsed = model_settings.parse(
        {"dynamic_batching": {"priority_levels": "4", "default_priority_level": "1"}}, "x"
    )
    assert parsed == {"priority_levels": 4, "default_priority_level": 1}


def test_aging_lets_a_low_request_overtake_newer_high_ones():
    """The no-starvation rule: one level better per aging step waited (stand-in clock)."""
    now = [0.0]

    async def order(low_waited: float) -> list[str]:
        gate = admission.Gate(1, aging_s=0.1, clock=lambda: now[0])
        await gate.enter(1)  # the holder
        ran: list[str] = []

        async def request(name: str, level: int) -> None:
            await gate.enter(level)
            ran.append(name)
            gate.leave()

        now[0] = 0.0
        tasks = [asyncio.ensure_future(request("low", 3))]
        await asyncio.sleep(0)
        now[0] = low_waited
        tasks.append(asyncio.ensure_future(request("high", 1)))
        await asyncio.sleep(0)
        gate.leave()
        await asyncio.gather(*tasks)
        return ran

    assert asyncio.run(order(0.15)) == ["high", "low"]  # aged one level: 2 > 1
    assert asyncio.run(order(0.25)) == ["low", "high"]  # aged two: level 1, and older


def test_the_batching_queue_runs_by_priority_level():
    """--enable_batching: the queue is ordered by level (then arrival) before a batch forms."""
    started, release = threading.Event(), threading.Event()
    order: list[int] = []

    def run(features):
        order.append(int(features["x"][0]))
        started.set()
        assert release.wait(60)
        return {"y": features["x"]}

    async def main() -> list[int]:
        executor = concurrent.futures.ThreadPoolExecutor(1)
        options = BatchingOptions(max_batch_size=1, batch_timeout_micros=0, num_batch_threads=1)
        batcher = Batcher(options, executor, aging_s=600.0)
        loop = asyncio.get_running_loop()

        def submit(x: int, level: int):
            return asyncio.ensure_future(
                batcher.submit("m", run, {"x": np.array([x])}, level=level)
            )

        tasks = [submit(0, 2)]
        assert await loop.run_in_executor(None, started.wait, 60)
        tasks += [submit(1, 3), submit(2, 3), submit(3, 2), submit(4, 1)]
        for _ in range(5):
            await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(*tasks)
        assert [int(r["y"][0]) for r in results] == [0, 1, 2, 3, 4]  # each got its own rows
        await batcher.close()
        executor.shutdown()
        return order

    assert asyncio.run(main()) == [0, 4, 3, 1, 2]


# ----------------------------------------------------------------------------- sharing
def test_a_flooded_model_does_not_take_the_other_models_run_threads(served):
    """Model a holds its one slot and 7 more wait; b still answers, over REST and gRPC."""
    valve, pool, first = hold(served, "a")
    try:
        flood = [pool.submit(post, served, "a", 1) for _ in range(7)]
        wait(lambda: waiting(served, "a") == 7, "the flood to queue")
        response = post(served, "b", 1)
        assert response.status_code == 200 and response.json()["model_name"] == "b"
        pb, stub = grpc_v2(served)
        answer = stub.ModelInfer(grpc_request(pb, "b", served.images[:1]), timeout=60)
        assert answer.model_name == "b"
        assert valve.sizes[-1] == 1 and not valve.open.is_set()  # a is still held
    finally:
        valve.open.set()
    assert all(f.result().status_code == 200 for f in [first, *flood])
    pool.shutdown()


# ----------------------------------------------------------------------------- cache
def test_a_repeated_request_is_a_hit_with_the_same_bytes_and_a_new_version_misses(served):
    client = triton_http.InferenceServerClient(served.host)
    valve = served.valves["c"]
    hits = {"model_name": "c", "result": "hit"}
    misses = {"model_name": "c", "result": "miss"}
    name = "estimax_serving_response_cache_total"
    try:
        runs = len(valve.sizes)
        images = served.images[2:4]
        one = client.infer("c", triton_input(images))
        h0, m0 = metric(served, name, **hits), metric(served, name, **misses)
        two = client.infer("c", triton_input(images))
        assert metric(served, name, **hits) == h0 + 1 and metric(served, name, **misses) == m0
        assert len(valve.sizes) == runs + 1  # answered from memory: no second run
        for output in ("classes", "probabilities"):
            assert one.as_numpy(output).tobytes() == two.as_numpy(output).tobytes()
        client.infer("c", triton_input(images[:1]))  # other inputs: a miss
        assert metric(served, name, **misses) == m0 + 1
        assert metric(served, "estimax_serving_response_cache_bytes") > 0
        # Version 2 (the same weights) is served: its answers are not version 1's.
        base = served.bases["c"]
        shutil.copytree(os.path.join(base, "1"), os.path.join(base, "2"))
        served.core.models["c"].manager.poll()
        three = client.infer("c", triton_input(images))
        assert three.get_response()["model_version"] == "2"
        assert metric(served, name, **misses) == m0 + 2
        assert three.as_numpy("probabilities").tobytes() == one.as_numpy("probabilities").tobytes()
        # Models not opted in are never cached.
        post(served, "b", 2)
        assert metric(served, name, model_name="b", result="miss") == 0
    finally:
        client.close()


def test_the_cache_key_is_the_inputs_content_and_random_models_are_never_cached():
    x = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    key = response_cache.request_key("m", 1, "/p/1", x)
    assert key == response_cache.request_key("m", 1, "/p/1", {"x": x["x"].copy()})
    for other in (
        response_cache.request_key("m", 2, "/p/2", x),
        response_cache.request_key("n", 1, "/p/1", x),
        response_cache.request_key("m", 1, "/p/1", {"x": x["x"].reshape(3, 2)}),
        response_cache.request_key("m", 1, "/p/1", {"x": x["x"].astype(np.float64)}),
        response_cache.request_key("m", 1, "/p/1", {"x": x["x"] + 1}),
    ):
        assert other != key
    cache = response_cache.ResponseCache(max_bytes=200)
    drawn = record_lib.ExportRecord.from_json(
        {"format": record_lib.SERVING_FORMAT, "random": True}, "serving.json"
    )
    assert drawn.random and drawn.to_json()["random"] is True
    assert not cache.caches(True, types.SimpleNamespace(record=drawn))  # enabled: still not
    plain = dataclasses.replace(drawn, random=False)
    assert cache.caches(True, types.SimpleNamespace(record=plain))
    assert not cache.caches(False, types.SimpleNamespace(record=plain))  # not enabled
    assert not response_cache.ResponseCache(max_bytes=0).caches(
        True, types.SimpleNamespace(record=plain)
    )
    # The bound: the least recently used answer goes first.
    for i in range(3):
        cache.put("m", bytes([i]), {"y": np.zeros(10, np.float32)})  # 40 + 64 bytes each
    assert cache.get("m", bytes([0])) is None and cache.get("m", bytes([2])) is not None
    assert cache.bytes <= 200


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"priority": "high"}, "parameters.priority must be an integer"),
        ({"priority": True}, "parameters.priority must be an integer"),
        ({"priority": 4}, "parameters.priority=4 is out of range"),
        ({"priority": -1}, "parameters.priority=-1 is out of range"),
        ({"timeout": 1.5}, "parameters.timeout must be an integer"),
        ({"timeout": -5}, "parameters.timeout=-5 is out of range"),
    ],
)
def test_a_bad_priority_or_timeout_is_refused_with_one_line(served, parameters, message):
    runs = len(served.valves["b"].sizes)
    response = post(served, "b", 1, **parameters)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error and "\n" not in error
    assert len(served.valves["b"].sizes) == runs  # refused before any work


def test_a_bad_priority_over_grpc_is_invalid_argument(served):
    pb, stub = grpc_v2(served)
    for set_bad in (
        lambda p: setattr(p["priority"], "string_param", "high"),
        lambda p: setattr(p["priority"], "uint64_param", 7),
        lambda p: setattr(p["timeout"], "bool_param", True),
    ):
        request = grpc_request(pb, "b", served.images[:1])
        set_bad(request.parameters)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "parameters." in e.value.details()


def test_the_admission_flags_set_their_options_and_bad_ones_are_one_line():
    from estimax.serving import cli

    parser = cli.argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"), {})
    args = parser.parse_args(
        [
            "serve",
            "--priority_levels=5",
            "--default_priority_level=4",
            "--max_concurrent_per_model=2",
            "--response_cache_models=a, b",
            "--response_cache_bytes=1000",
        ]
    )
    options = cli._server_options(args)
    assert (options.priority_levels, options.default_priority_level) == (5, 4)
    assert options.max_concurrent_per_model == 2
    assert options.response_cache_models == ("a", "b") and options.response_cache_bytes == 1000
    with pytest.raises(ValueError, match="--default_priority_level=4 must be from 1 to"):
        cli._server_options(parser.parse_args(["serve", "--default_priority_level=4"]))
