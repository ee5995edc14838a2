"""Serving load test: `estimax serve` over loopback vs calling the export in-process.

Exports an (initialised, untrained: speed does not depend on the weights) tiny ResNet (the
test variant: every block type, 8 filters) for 32x32 images with the ResNet eval preprocessing,
so that the numbers are the serving stack's own cost (HTTP, JSON, base64, JPEG decode, batching)
rather than the network's; a ResNet-18 at 64x64 ran at ~4 images/s in-process on this shared
machine (load 11), where no serving overhead is visible. Then:
  * in-process: ``Servable.predict_images`` on one JPEG at a time (the same decode +
    preprocess + export call the server makes), sequentially;
  * the real server process (``--grpc_port`` too), without and with dynamic batching:
    ``--clients`` threads, each with its own keep-alive connection or channel, send
    ``--requests`` requests in all (one JPEG each) on each route, then a lone client sends
    ``--lone_requests`` (with ``--baseline_tree``, alternating between the two servers in a
    shuffled order, route by route). Routes: TF Serving REST ``:predict`` (JSON, base64), v2
    ``/infer`` JSON (base64), v2 ``/infer`` with the binary tensor data extension (raw JPEG
    bytes after a JSON header, binary outputs), gRPC TF Serving ``PredictionService/Predict``
    (``string_val``) and gRPC v2 ``ModelInfer`` (``raw_input_contents``). Request
    bodies/messages are built before the clock starts, so what is timed is the wire, the
    server and the answer's parsing.
    Bounded in count and time (``--max_seconds`` per run).
Every request must answer with one prediction: errors and lost requests are counted.
The client threads share the machine's cores with the server, as on any single-host test.

    .venv/bin/python bench/serving.py [--requests 2000 --clients 32 --routes all --repeats 3]

Writes bench/results/serving.json and bench/results/serving.md.

``--baseline_tree DIR`` (a checkout of an earlier commit's ``estimax/``, e.g. ``git archive REF
estimax | tar -x -C DIR``): each server configuration runs twice at once, the code of ``DIR``
("before") and this checkout's ("after"), their rounds interleaved route by route, so both see
the same load; written as the "Before and after" section of serving.md and ``before_after`` of
serving.json, keeping the rest of the files.

``--part peer`` (also run by ``--part all``): ONNX Runtime beside estimax on the same ResNet-50
(resnet50, 224x224, float32, initialised weights) on the CPU, from one export: estimax's export
as it serves it, and ``estimax export-onnx`` of it in ONNX Runtime with the same number of
threads (the machine's cores). In-process: the network on the same preprocessed batches of each
size (``--peer_batch_sizes``), rounds interleaved, median latency; over HTTP: ``estimax serve``
against bench/onnx_http.py (a minimal ThreadingHTTPServer around onnxruntime doing the same
JPEG decode + preprocessing with estimax's recipe), the same TF Serving REST requests (one JPEG
each) from ``--peer_clients`` clients, then one: the lone client's ``--peer_lone_requests``
alternate between the two servers in a shuffled order (both see the same moments of the
machine's load), and each server's own account of where their time went (estimax's
``/v2/models/bench/stats``, bench/onnx_http.py's ``/stats``) is written beside them. Each number
is also given as estimax / ONNX Runtime. Writes the "ONNX Runtime beside estimax" section of
serving.md and ``peer`` of serving.json, keeping the rest of the files.

``--part models`` (also run by ``--part all``): several models in one server. The tiny model in
a server alone (``--model_name``) beside ``--models`` copies of it in another
(``--model_config_file``: each its own model, version, metrics and batching queue), request i
asking copy i mod N; REST ``:predict`` and gRPC ``Predict`` from ``--clients`` clients, then a
lone client alternating between the two servers; without batching (and with it, given
``--models_batching``). Writes the "Several models in one server" section and ``models``.

    .venv/bin/python bench/serving.py --part models --models 4 --requests 1000 --clients 16 \\
        --lone_requests 200 --repeats 3 --models_batching
"""

from __future__ import annotations

import abc
import argparse
import base64
import contextlib
import json
import os
import platform
import random
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import requests
import simplejpeg

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import serving_fixtures as fx  # noqa: E402

import estimax as ex  # noqa: E402
from estimax import export  # noqa: E402
from estimax.data import preprocessing  # noqa: E402
from estimax.models import get_model  # noqa: E402

IMAGE_SIZE = 32
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def model_fn(features, labels, mode, params):
    logits = get_model("resnet_tiny", num_classes=10)(
        preprocessing.normalize(features, jnp), train=False
    )
    predictions = {
        "classes": jnp.argmax(logits, 1),
        "probabilities": __import__("jax").nn.softmax(logits),
    }
    return ex.EstimatorSpec(
        mode=mode, predictions=predictions, export_outputs={"classify": predictions}
    )


def percentiles(latencies: list[float]) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def in_process(path: str, images: list[bytes], count: int) -> dict:
    servable = export.Servable(path, 1, batch_sizes=[1])
    servable.warm()
    latencies = []
    start = time.perf_counter()
    for i in range(count):
        t = time.perf_counter()
        servable.predict_images([images[i % len(images)]])
        latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return {"requests": count, "requests_per_s": count / wall, **percentiles(latencies)}


def load_test(route: Route, total: int, clients: int, max_seconds: float) -> dict:
    lock = threading.Lock()
    next_index = [0]
    latencies, errors = [], []
    deadline = time.monotonic() + max_seconds

    def client() -> None:
        state = route.connect()
        try:
            while time.monotonic() < deadline:
                with lock:
                    i = next_index[0]
                    if i >= total:
                        return
                    next_index[0] += 1
                t = time.perf_counter()
                try:
                    ok, detail = route.send(state, i), ""
                except Exception as e:  # noqa: BLE001 - every failure is counted, not raised
                    ok, detail = False, f"{type(e).__name__}: {e}"[:200]
                elapsed = time.perf_counter() - t
                with lock:
                    (latencies.append(elapsed) if ok else errors.append(detail or "wrong answer"))
        finally:
            route.close(state)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    sent = next_index[0]
    return {
        "requests": total,
        "sent": sent,
        "ok": len(latencies),
        "errors": len(errors),
        "lost": sent - len(latencies) - len(errors),
        "first_error": errors[:1],
        "clients": clients,
        "seconds": wall,
        "requests_per_s": len(latencies) / wall,
        **percentiles(latencies or [0.0]),
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median requests/s."""
    return sorted(runs, key=lambda r: r["requests_per_s"])[len(runs) // 2]


class Route(abc.ABC):
    """One way of asking the server for one image's class: bodies built ahead of time."""

    label = ""

    def connect(self):
        return requests.Session()

    @abc.abstractmethod
    def send(self, state, i: int) -> bool:
        """Sends request ``i`` on ``state`` (what ``connect`` made); True if it was answered."""

    def close(self, state) -> None:
        state.close()


class RestJson(Route):
    label = "REST `:predict` JSON (b64)"

    def __init__(self, url: str, images: list[bytes], names: tuple[str, ...] = ("bench",)):
        # Request i asks model names[i % len(names)] (--part models spreads them).
        self.urls = [f"{url}/v1/models/{name}:predict" for name in names]
        self.bodies = [
            json.dumps({"instances": [{"b64": base64.b64encode(b).decode()}]}) for b in images
        ]

    def send(self, session, i: int) -> bool:
        r = session.post(
            self.urls[i % len(self.urls)],
            data=self.bodies[i % len(self.bodies)],
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        return r.status_code == 200 and len(r.json()["predictions"]) == 1


class V2Json(Route):
    label = "v2 `/infer` JSON (b64)"

    def __init__(self, url: str, images: list[bytes]):
        self.url = f"{url}/v2/models/bench/infer"
        self.bodies = [
            json.dumps(
                {
                    "inputs": [
                        {
                            "name": "image_bytes",
                            "shape": [1],
                            "datatype": "BYTES",
                            "data": [base64.b64encode(b).decode()],
                        }
                    ],
                    "outputs": [{"name": "classes"}],
                }
            )
            for b in images
        ]

    def send(self, session, i: int) -> bool:
        r = session.post(
            self.url,
            data=self.bodies[i % len(self.bodies)],
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        return r.status_code == 200 and len(r.json()["outputs"][0]["data"]) == 1


class V2Binary(Route):
    label = "v2 `/infer` binary tensors (tritonclient's form)"

    def __init__(self, url: str, images: list[bytes]):
        self.url = f"{url}/v2/models/bench/infer"
        self.bodies = []
        for b in images:
            framed = struct.pack("<I", len(b)) + b
            head = json.dumps(
                {
                    "inputs": [
                        {
                            "name": "image_bytes",
                            "shape": [1],
                            "datatype": "BYTES",
                            "parameters": {"binary_data_size": len(framed)},
                        }
                    ],
                    "outputs": [{"name": "classes", "parameters": {"binary_data": True}}],
                }
            ).encode()
            self.bodies.append((head + framed, str(len(head))))

    def send(self, session, i: int) -> bool:
        body, length = self.bodies[i % len(self.bodies)]
        r = session.post(
            self.url,
            data=body,
            headers={
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": length,
            },
            timeout=60,
        )
        if r.status_code != 200:
            return False
        n = int(r.headers["Inference-Header-Content-Length"])
        head = json.loads(r.content[:n])
        return head["outputs"][0]["parameters"]["binary_data_size"] == 4 == len(r.content) - n


class GrpcRoute(Route):
    def __init__(self, target: str):
        self.target = target

    def connect(self):
        import grpc

        return grpc.insecure_channel(self.target)


class GrpcPredict(GrpcRoute):
    label = "gRPC TF Serving `Predict` (string_val)"

    def __init__(self, target: str, images: list[bytes], names: tuple[str, ...] = ("bench",)):
        super().__init__(target)
        from estimax.serving.protos.tensorflow.core.framework import tensor_pb2
        from estimax.serving.protos.tensorflow_serving.apis import predict_pb2

        self.requests: list[list] = [[] for _ in names]  # [model][image]
        for model, name in zip(self.requests, names, strict=True):
            for b in images:
                request = predict_pb2.PredictRequest()
                request.model_spec.name = name
                request.output_filter.append("classes")
                tensor = tensor_pb2.TensorProto(dtype=7, string_val=[b])  # DT_STRING
                tensor.tensor_shape.dim.add(size=1)
                request.inputs["image_bytes"].CopyFrom(tensor)
                model.append(request)

    def send(self, channel, i: int) -> bool:
        from estimax.serving.protos.tensorflow_serving.apis import prediction_service_pb2_grpc

        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        model = self.requests[i % len(self.requests)]
        response = stub.Predict(model[i % len(model)], timeout=60)
        return len(response.outputs["classes"].int_val) == 1


class GrpcModelInfer(GrpcRoute):
    label = "gRPC v2 `ModelInfer` (raw contents)"

    def __init__(self, target: str, images: list[bytes]):
        super().__init__(target)
        # tritonclient's copy of the v2 messages (the server's own copy cannot share a
        # process with them); the wire format is the same.
        from tritonclient.grpc import service_pb2

        self.requests = []
        for b in images:
            request = service_pb2.ModelInferRequest(model_name="bench")
            request.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
            request.outputs.add(name="classes")
            request.raw_input_contents.append(struct.pack("<I", len(b)) + b)
            self.requests.append(request)
        self.response = service_pb2.ModelInferResponse

    def send(self, channel, i: int) -> bool:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=self.response.FromString,
        )
        response = call(self.requests[i % len(self.requests)], timeout=60)
        return len(response.raw_output_contents) == 1 and len(response.raw_output_contents[0]) == 4


ROUTES = {
    "rest_json": RestJson,
    "v2_json": V2Json,
    "v2_binary": V2Binary,
    "grpc_predict": GrpcPredict,
    "grpc_v2": GrpcModelInfer,
}


def _peer_export(tmp: str, images: list[bytes]) -> tuple[str, str]:
    """ResNet-50 (initialised) behind resnet_eval(224), and its ONNX model."""
    from estimax.export.formats import onnx_export

    def resnet50_fn(features, labels, mode, params):
        logits = get_model("resnet50", num_classes=1000)(
            preprocessing.normalize(features, jnp), train=False
        )
        predictions = {"classes": jnp.argmax(logits, 1), "probabilities": jax.nn.softmax(logits)}
        return ex.EstimatorSpec(
            mode=mode, predictions=predictions, export_outputs={"classify": predictions}
        )

    est = ex.Estimator(
        resnet50_fn,
        ex.RunConfig(model_dir=os.path.join(tmp, "r50"), num_shards=1),
        predict_batch_size=2,
    )
    path = export.export_version(
        est,
        os.path.join(tmp, "r50_models"),
        preprocessing=export.resnet_eval(224),
        check_inputs=images[:2],
        platforms=("cpu",),
    )
    est.close()
    out = os.path.join(tmp, "r50.onnx")
    print(onnx_export.describe(onnx_export.export_onnx(path, out)), flush=True)
    return path, out


def _peer_in_process(path: str, onnx_path: str, images, sizes, rounds: int) -> dict:
    import onnxruntime as ort

    servable = export.Servable(path, 1, batch_sizes=sizes)
    servable.warm()
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    # Its threads otherwise spin after each call and take the cores from XLA's next call in
    # this process (interleaved rounds).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    runs: dict = {}
    for size in sizes:
        pixels = servable.prepare({"image_bytes": [images[i % len(images)] for i in range(size)]})
        x = pixels["input"]
        engines = {
            "estimax": lambda: servable.run(pixels),
            "onnxruntime": lambda: session.run(None, {"input": x}),
        }
        times: dict = {name: [] for name in engines}
        for fn in engines.values():
            fn()  # warm
        for _ in range(rounds):  # interleaved: the machine's load changes by the second
            for name, fn in engines.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        runs[size] = {
            name: {"median_ms": 1000 * float(np.median(t)), "images_per_s": size / np.median(t)}
            for name, t in times.items()
        }
        print("in-process batch", size, runs[size], flush=True)
    return runs


@contextlib.contextmanager
def _onnx_server(onnx_path: str):
    port = fx.free_port()
    script = os.path.join(os.path.dirname(__file__), "onnx_http.py")
    threads = str(os.cpu_count() or 1)
    proc = subprocess.Popen(
        [sys.executable, script, onnx_path, str(port), threads], env=fx.server_env()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # wait for readiness (a process start, not a timed assertion)
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(url, timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def lone_interleaved(routes: dict[str, Route], count: int, seed: int) -> dict[str, dict]:
    """A lone client's ``count`` requests to each route, one route's request after another's in
    an order shuffled each turn, so that every route sees the same moments of the machine's
    load (a route's block of requests measured after another's saw a different machine).
    Requests/s of a lone client: 1 / its mean latency."""
    rng = random.Random(seed)
    states = {name: route.connect() for name, route in routes.items()}
    latencies: dict[str, list[float]] = {name: [] for name in routes}
    errors: dict[str, list[str]] = {name: [] for name in routes}
    try:
        for i in range(count):
            order = list(routes)
            rng.shuffle(order)
            for name in order:
                t = time.perf_counter()
                try:
                    ok, detail = routes[name].send(states[name], i), ""
                except Exception as e:  # noqa: BLE001 - every failure is counted, not raised
                    ok, detail = False, f"{type(e).__name__}: {e}"[:200]
                elapsed = time.perf_counter() - t
                (latencies[name].append(elapsed) if ok else errors[name].append(detail or "no"))
    finally:
        for name, route in routes.items():
            route.close(states[name])
    return {
        name: {
            "requests": count,
            "sent": count,
            "ok": len(latencies[name]),
            "errors": len(errors[name]),
            "lost": 0,
            "first_error": errors[name][:1],
            "clients": 1,
            "seconds": sum(latencies[name]),
            "requests_per_s": len(latencies[name]) / max(sum(latencies[name]), 1e-9),
            **percentiles(latencies[name] or [0.0]),
        }
        for name in routes
    }


def _phases(url: str, estimax_server: bool) -> tuple[int, dict[str, float]]:
    """A server's own account of its time: (requests, {phase: seconds in all}). estimax's
    Triton statistics (compute_input: decoding, with its hand-off; compute_infer: the run;
    compute_output: the answer written), bench/onnx_http.py's /stats."""
    if not estimax_server:
        stats = requests.get(f"{url}/stats", timeout=30).json()
        return stats["requests"], stats["seconds"]
    model = requests.get(f"{url}/v2/models/bench/stats", timeout=30).json()["model_stats"][0]
    phases = model["inference_stats"]
    return phases["success"]["count"], {
        "server": phases["success"]["ns"] / 1e9,
        **{k: phases[k]["ns"] / 1e9 for k in ("compute_input", "compute_infer", "compute_output")},
    }


def _peer_http(path: str, onnx_path: str, images, args) -> dict:
    base = os.path.dirname(path)
    out: dict = {}
    with (
        fx.running_server([f"--model_base_path={base}", "--model_name=bench"]) as (url, _),
        _onnx_server(onnx_path) as onnx_url,
    ):
        urls = {"estimax": url, "onnxruntime": onnx_url}
        routes = {name: RestJson(u, images) for name, u in urls.items()}
        for route in routes.values():
            load_test(route, 4, 2, 120)  # warm
        for name in routes:
            out[name] = {"concurrent": [], "lone": [], "lone_phases": {}}
        for round_ in range(args.repeats):
            for name, route in routes.items():
                c = load_test(route, args.peer_requests, args.peer_clients, args.max_seconds)
                out[name]["concurrent"].append(c)
                print("http", name, c, flush=True)
            before = {name: _phases(u, name == "estimax") for name, u in urls.items()}
            lone = lone_interleaved(routes, args.peer_lone_requests, seed=round_)
            for name, u in urls.items():
                out[name]["lone"].append(lone[name])
                (n0, s0), (n1, s1) = before[name], _phases(u, name == "estimax")
                phases = out[name]["lone_phases"]
                phases["requests"] = phases.get("requests", 0) + n1 - n0
                for k in s1:
                    phases[k] = phases.get(k, 0.0) + s1[k] - s0[k]
                print("http lone", name, lone[name], flush=True)
    return out


def peer(args) -> dict:
    """ONNX Runtime beside estimax on ResNet-50 (see the module docstring)."""
    big = [
        simplejpeg.encode_jpeg(
            np.random.default_rng(i).integers(0, 255, (375, 500, 3), dtype=np.uint8),
            quality=90,
            colorspace="RGB",
        )
        for i in range(8)
    ]
    results: dict = {"load_before": open("/proc/loadavg").read().split()[:3]}
    sizes = [int(b) for b in args.peer_batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path, onnx_path = _peer_export(tmp, big)
        results["in_process"] = _peer_in_process(path, onnx_path, big, sizes, args.peer_rounds)
        results["http"] = _peer_http(path, onnx_path, big, args)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    results["threads"] = os.cpu_count()
    results["cpu"] = _cpu_name()
    return results


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _peer_http_lines(r: dict, args) -> list[str]:
    """The HTTP table and its ratios."""
    lines: list[str] = []
    lines += [
        "",
        f"Over HTTP (TF Serving REST `:predict`, one 500x375 JPEG per request, decode + "
        f"preprocessing in the server), {args.repeats} rounds, median round; `estimax serve` "
        "without batching against bench/onnx_http.py:",
        "",
        f"| server | ok / sent | req/s, {args.peer_clients} clients | p50 ms | p99 ms | "
        "lone req/s | lone p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    med = {}
    for name, runs in r["http"].items():
        every = runs["concurrent"] + runs["lone"]
        c, lone = median_run(runs["concurrent"]), median_run(runs["lone"])
        med[name] = (c, lone)
        lines.append(
            f"| {name} | {sum(x['ok'] for x in every)} / {sum(x['sent'] for x in every)} | "
            f"{c['requests_per_s']:.2f} | {c['p50_ms']:.0f} | {c['p99_ms']:.0f} | "
            f"{lone['requests_per_s']:.2f} | {lone['p50_ms']:.0f} |"
        )
    (ce, le), (co, lo) = med["estimax"], med["onnxruntime"]
    lines += [
        "",
        f"Ratios estimax / ONNX Runtime over HTTP: throughput "
        f"{ce['requests_per_s'] / co['requests_per_s']:.2f} ({args.peer_clients} clients), "
        f"{le['requests_per_s'] / lo['requests_per_s']:.2f} (lone); lone p50 latency "
        f"{le['p50_ms'] / lo['p50_ms']:.2f}. The lone client's requests alternate between the "
        f"two servers in a shuffled order ({args.peer_lone_requests} to each a round).",
    ]
    e, o = (r["http"][name].get("lone_phases") for name in ("estimax", "onnxruntime"))
    if e and o and e["requests"] and o["requests"]:

        def ms(phases: dict, key: str) -> str:
            return f"{1000 * phases[key] / phases['requests']:.1f}"

        lines += [
            "",
            "Where a lone request's time went, by each server's own account (mean ms, over the "
            "lone requests of every round):",
            "",
            f"- estimax (`/v2/models/bench/stats`): {ms(e, 'server')} in the server: "
            f"{ms(e, 'compute_input')} decoding the JPEG and preprocessing (with its hand-off "
            f"to a thread), {ms(e, 'compute_infer')} running the model, "
            f"{ms(e, 'compute_output')} writing the answer; the rest is HTTP, JSON and base64.",
            f"- ONNX Runtime (bench/onnx_http.py `/stats`): {ms(o, 'parse')} parsing the JSON "
            f"and base64, {ms(o, 'prepare')} decoding and preprocessing, {ms(o, 'run')} "
            f"running the model, {ms(o, 'answer')} writing the answer.",
        ]
    return lines


def peer_markdown(r: dict, args) -> str:
    """The "ONNX Runtime beside estimax" section of serving.md."""
    lines = [
        "## ONNX Runtime beside estimax (`--part peer`)",
        "",
        f"ResNet-50 (224x224, float32, initialised weights), one export; {r['cpu']}, "
        f"{r['threads']} threads for each engine (XLA:CPU's default pool; ONNX Runtime "
        f"`intra_op_num_threads={r['threads']}`). Load average before "
        f"{' '.join(r['load_before'])}, after {' '.join(r['load_after'])} (a shared machine; "
        "other engineers' jobs ran: read the ratios, measured interleaved in one run).",
        "",
        f"In-process, the network alone on the same preprocessed uint8 batch, median of "
        f"{args.peer_rounds} interleaved calls:",
        "",
        "| batch | estimax ms | ONNX Runtime ms | estimax img/s | ONNX Runtime img/s | "
        "estimax / ONNX Runtime (throughput) |",
        "|---|---|---|---|---|---|",
    ]
    for size, row in r["in_process"].items():
        e, o = row["estimax"], row["onnxruntime"]
        lines.append(
            f"| {size} | {e['median_ms']:.1f} | {o['median_ms']:.1f} | {e['images_per_s']:.1f} "
            f"| {o['images_per_s']:.1f} | {e['images_per_s'] / o['images_per_s']:.2f} |"
        )
    lines += _peer_http_lines(r, args) + [
        "",
        "- The ONNX model is `estimax export-onnx` of the same export, so ONNX Runtime runs the "
        "export's own computation: estimax.ops' 1x1 convolutions as matmuls, NHWC with a "
        "transpose pair around each convolution (ONNX convolves NCHW), batch norm as separate "
        "elementwise ops (XLA fuses them; ONNX Runtime's Conv+BN fusions need NCHW convolutions "
        "followed by BatchNormalization). A ResNet-50 exported to ONNX from an NCHW framework "
        "with folded batch norm would likely run faster in ONNX Runtime; these rows measure "
        "what a team gets from an estimax export.",
        "- HTTP: `estimax serve` is FastAPI on uvicorn (no batching); bench/onnx_http.py is "
        "Python's ThreadingHTTPServer around one onnxruntime session, preprocessing with "
        "estimax's recipe (an ONNX model's client does it), no batching. Both decode the JPEG "
        "and resize it in the server.",
        "- ONNX Runtime runs without spinning threads (`session.intra_op.allow_spinning=0`), "
        "in-process and in the wrapper: otherwise they take the cores from XLA's next call in "
        "the same process, and from the request's Python work on 2 cores.",
        "",
    ]
    return "\n".join(lines)


def _write_models(results: dict, args) -> None:
    heading = "## Several models in one server"
    _write_section("models", heading, models_markdown(results, args), results)


def _write_peer(results: dict, args) -> None:
    _write_section("peer", "## ONNX Runtime beside estimax", peer_markdown(results, args), results)


def _write_section(key: str, heading: str, section: str, results: dict) -> None:
    """serving.json's ``key`` and serving.md's section under ``heading``, the rest kept."""
    os.makedirs(RESULTS, exist_ok=True)
    json_path, md_path = os.path.join(RESULTS, "serving.json"), os.path.join(RESULTS, "serving.md")
    data = json.load(open(json_path)) if os.path.exists(json_path) else {}
    data[key] = results
    with open(json_path, "w") as f:
        json.dump(data, f, indent=2)
    text = open(md_path).read() if os.path.exists(md_path) else ""
    pattern = re.compile(re.escape(heading) + r".*?(?=\n## |\Z)", re.S)
    text = pattern.sub(lambda m: section, text) if pattern.search(text) else text + "\n" + section
    with open(md_path, "w") as f:
        f.write(text)
    print(section)


def _route_servers(tmp: str, images: list[bytes], routes: list[str], args, results: dict) -> None:
    """The routes against `estimax serve`, without and with batching, rounds interleaved
    (with ``--baseline_tree``, the baseline's server and this one's, interleaved too)."""
    trees: list[tuple[str, dict[str, str]]] = [("", {})]
    if args.baseline_tree:
        trees = [
            ("before", {"PYTHONPATH": os.path.abspath(args.baseline_tree)}),
            ("after", {}),
        ]
    for server, flags in (
        ("no batching", []),
        ("batching", BATCHING),
    ):
        with contextlib.ExitStack() as stack:
            made = {}
            for tree, env in trees:
                grpc_port = fx.free_port()
                url, _ = stack.enter_context(
                    fx.running_server(
                        [
                            f"--model_base_path={os.path.join(tmp, 'models')}",
                            "--model_name=bench",
                            f"--grpc_port={grpc_port}",
                            *flags,
                        ],
                        env=env,
                    )
                )
                for name in routes:
                    address = f"127.0.0.1:{grpc_port}" if name.startswith("grpc") else url
                    key = f"{server}/{name}" if not tree else f"{tree}/{server}/{name}"
                    made[key] = ROUTES[name](address, images)
                    load_test(made[key], 64, 8, 60)  # warm the connections and threads
                    results["runs"][key] = {
                        "server": f"{server} ({tree})" if tree else server,
                        "route": made[key].label,
                        "flags": flags,
                        "concurrent": [],
                        "lone": [],
                    }
            # Rounds over the routes in turn: the machine's other load changes by the
            # second, and interleaving spreads it over every route (and tree) alike.
            order = sorted(made, key=lambda k: (k.split("/")[-1], k))
            for round_ in range(args.repeats):
                for key in order:
                    route, run = made[key], results["runs"][key]
                    run["concurrent"].append(
                        load_test(route, args.requests, args.clients, args.max_seconds)
                    )
                    print(key, run["concurrent"][-1], flush=True)
                # A lone client: what a request costs with no company. With a baseline, its
                # requests alternate between the two trees' servers in a shuffled order, route
                # by route, so that both see the same moments of the machine's load.
                for name in routes:
                    keys = [k for k in order if k.split("/")[-1] == name]
                    lone = lone_interleaved(
                        {k: made[k] for k in keys}, args.lone_requests, seed=round_
                    )
                    for k in keys:
                        results["runs"][k]["lone"].append(lone[k])
                        print(k, "lone", lone[k], flush=True)


def _tiny_images() -> list[bytes]:
    """The routes' requests: 16 64x48 JPEGs of random pixels."""
    rng = np.random.default_rng(0)
    return [
        simplejpeg.encode_jpeg(
            rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), quality=90, colorspace="RGB"
        )
        for _ in range(16)
    ]


def _tiny_export(tmp: str) -> str:
    """The tiny ResNet's export under ``tmp/models`` (version 1); returns its path."""
    est = ex.Estimator(
        model_fn, ex.RunConfig(model_dir=os.path.join(tmp, "model")), predict_batch_size=8
    )
    path = export.export_version(
        est,
        os.path.join(tmp, "models"),
        preprocessing=export.resnet_eval(IMAGE_SIZE),
        platforms=("cpu",),
    )
    est.close()
    return path


BATCHING = [
    "--enable_batching",
    "--max_batch_size=16",
    "--batch_timeout_micros=2000",
    "--max_enqueued_batches=64",
]
MODELS_ROUTES = ("rest_json", "grpc_predict")


def models_run(args) -> dict:
    """One model in a server against ``--models`` copies of it in another
    (``--model_config_file``), the requests spread over the copies (request i asks copy
    i % N), rounds interleaved: what several models cost per request."""
    images = _tiny_images()
    names = tuple(f"bench{i}" for i in range(args.models))
    results: dict = {
        "load_before": open("/proc/loadavg").read().split()[:3],
        "cores": os.cpu_count(),
        "models": args.models,
        "clients": args.clients,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.dirname(_tiny_export(tmp))
        config = os.path.join(tmp, "models.config")
        with open(config, "w") as f:
            f.write("model_config_list {\n")
            for name in names:
                f.write(f'  config {{ name: "{name}" base_path: "{base}" }}\n')
            f.write("}\n")
        servers = [("no batching", [])] + ([("batching", BATCHING)] if args.models_batching else [])
        for server, flags in servers:
            with contextlib.ExitStack() as stack:
                made = {}
                for kind, serve, asked in (
                    ("1 model", [f"--model_base_path={base}", "--model_name=bench"], ("bench",)),
                    (f"{len(names)} models", [f"--model_config_file={config}"], names),
                ):
                    grpc_port = fx.free_port()
                    url, _ = stack.enter_context(
                        fx.running_server([*serve, f"--grpc_port={grpc_port}", *flags])
                    )
                    for name in MODELS_ROUTES:
                        address = f"127.0.0.1:{grpc_port}" if name.startswith("grpc") else url
                        key = f"{server}/{name}/{kind}"
                        made[key] = ROUTES[name](address, images, asked)
                        load_test(made[key], 16 * len(asked), 8, 60)  # every copy warmed
                        results["runs"][key] = {
                            "server": server,
                            "route": made[key].label,
                            "kind": kind,
                            "flags": flags,
                            "concurrent": [],
                            "lone": [],
                        }
                for round_ in range(args.repeats):  # interleaved: the load changes by the second
                    for key, route in made.items():
                        run = results["runs"][key]
                        run["concurrent"].append(
                            load_test(route, args.requests, args.clients, args.max_seconds)
                        )
                        print(key, run["concurrent"][-1], flush=True)
                    for name in MODELS_ROUTES:  # the lone client's, one server then the other
                        keys = [k for k in made if k.split("/")[1] == name]
                        lone = lone_interleaved(
                            {k: made[k] for k in keys}, args.lone_requests, seed=round_
                        )
                        for k in keys:
                            results["runs"][k]["lone"].append(lone[k])
                            print(k, "lone", lone[k], flush=True)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    return results


def models_markdown(r: dict, args) -> str:
    """The "Several models in one server" section of serving.md."""
    n = r["models"]
    lines = [
        "## Several models in one server (`--part models`)",
        "",
        f"The tiny ResNet of the routes above: one server with it alone (`--model_name`) "
        f"beside one serving {n} copies of it (`--model_config_file`, each its own model, "
        f"version and batching queue), request i asking copy i mod {n}; {args.clients} "
        f"clients, then a lone one (its requests alternating between the two servers in a "
        f"shuffled order); {args.repeats} rounds, interleaved, median round. Load "
        f"average before {' '.join(r['load_before'])}, after {' '.join(r['load_after'])}.",
        "",
        f"| server | route | models | ok / sent | req/s, {args.clients} clients | p50 ms | "
        "p99 ms | lone req/s | lone p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    medians: dict = {}
    for run in r["runs"].values():
        every = run["concurrent"] + run["lone"]
        c, lone = median_run(run["concurrent"]), median_run(run["lone"])
        medians[run["server"], run["route"], run["kind"]] = (c, lone)
        lines.append(
            f"| {run['server']} | {run['route']} | {run['kind']} | "
            f"{sum(x['ok'] for x in every)} / {sum(x['sent'] for x in every)} | "
            f"{c['requests_per_s']:.0f} | {c['p50_ms']:.1f} | {c['p99_ms']:.1f} | "
            f"{lone['requests_per_s']:.0f} | {lone['p50_ms']:.1f} |"
        )
    lines += ["", f"{n} models / 1 model, per route (1.00: no cost of its own):", ""]
    for (server, route, kind), (c, lone) in medians.items():
        if kind == "1 model":
            continue
        c1, lone1 = medians[server, route, "1 model"]
        lines.append(
            f"- {server}, {route}: throughput {c['requests_per_s'] / c1['requests_per_s']:.2f} "
            f"({args.clients} clients), {lone['requests_per_s'] / lone1['requests_per_s']:.2f} "
            f"(lone); lone p50 latency {lone['p50_ms'] / lone1['p50_ms']:.2f}."
        )
    lines.append("")
    return "\n".join(lines)


def _routes_run(args) -> dict:
    """The tiny model's export in-process and over every route (see the module docstring)."""
    routes = list(ROUTES) if args.routes == "all" else args.routes.split(",")

    images = _tiny_images()
    results: dict = {
        "load_before": open("/proc/loadavg").read().split()[:3],
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "model": "tiny ResNet (resnet_tiny), 32x32 input, 10 classes",
        "image": "64x48 JPEG q90 (random pixels), one per request",
        "clients": args.clients,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_export(tmp)
        results["in_process"] = in_process(path, images, min(args.requests, 500))
        print("in-process", results["in_process"], flush=True)
        _route_servers(tmp, images, routes, args, results)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    os.makedirs(RESULTS, exist_ok=True)
    if args.baseline_tree:  # serving.json's "before_after" (main writes it with its section)
        results["baseline_tree"] = args.baseline_tree
        results["baseline_ref"] = args.baseline_ref
        return results
    json_path = os.path.join(RESULTS, "serving.json")
    kept = json.load(open(json_path)) if os.path.exists(json_path) else {}
    with open(json_path, "w") as f:  # the other parts' keys stay, as their sections do
        parts = ("peer", "models", "before_after")
        json.dump({**results, **{k: kept[k] for k in parts if k in kept}}, f, indent=2)
    return results


def _routes_markdown(results: dict, args) -> str:
    """serving.md's routes table."""
    r = results["in_process"]
    lines = [
        "# Serving load test (`bench/serving.py`)",
        "",
        f"{results['model']}; {results['image']}. Loopback; {args.clients} client threads, "
        f"then a lone client (with a baseline, its requests alternating between the two "
        f"servers in a shuffled order, route by route), sharing the {results['cores']} cores "
        f"with the server. Load "
        f"average before {' '.join(results['load_before'])}, after "
        f"{' '.join(results['load_after'])} (a shared machine: compare rows of one run only).",
        "",
        f"In-process `Servable.predict_images`, sequential: {r['requests']} requests, "
        f"{r['requests_per_s']:.1f} req/s, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms.",
        "",
        f"Each route ran {args.repeats} rounds (routes interleaved); the row shows the round "
        "with the median req/s (and the range of req/s over the rounds).",
        "",
        f"| server | route | ok / sent | errors | lost | req/s, {args.clients} clients (range) "
        "| p50 ms | p99 ms | lone req/s | lone p50 ms | lone p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"].values():
        every = run["concurrent"] + run["lone"]
        c, lone = median_run(run["concurrent"]), median_run(run["lone"])
        spread = sorted(r["requests_per_s"] for r in run["concurrent"])
        lines.append(
            f"| {run['server']} | {run['route']} | {sum(r['ok'] for r in every)} / "
            f"{sum(r['sent'] for r in every)} | {sum(r['errors'] for r in every)} | "
            f"{sum(r['lost'] for r in every)} | {c['requests_per_s']:.0f} "
            f"({spread[0]:.0f}-{spread[-1]:.0f}) | {c['p50_ms']:.1f} | {c['p99_ms']:.1f} | "
            f"{lone['requests_per_s']:.0f} | {lone['p50_ms']:.1f} | {lone['p99_ms']:.1f} |"
        )
    batching = next((r for r in results["runs"].values() if r["flags"]), None)
    if batching:
        lines += ["", "Batching flags: " + " ".join(batching["flags"])]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--lone_requests", type=int, default=200)
    parser.add_argument("--max_seconds", type=float, default=180)
    parser.add_argument(
        "--routes", default="all", help=f"comma-separated among {sorted(ROUTES)}, or all"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the routes")
    parser.add_argument("--part", choices=("routes", "peer", "models", "all"), default="all")
    parser.add_argument("--peer_batch_sizes", default="1,8")
    parser.add_argument("--peer_rounds", type=int, default=5)
    parser.add_argument("--peer_requests", type=int, default=24)
    parser.add_argument("--peer_clients", type=int, default=4)
    parser.add_argument(
        "--peer_lone_requests", type=int, default=24, help="lone requests to each, per round"
    )
    parser.add_argument("--models", type=int, default=4, help="--part models: copies served")
    parser.add_argument(
        "--models_batching", action="store_true", help="--part models: with batching too"
    )
    parser.add_argument(
        "--baseline_tree",
        default="",
        help="a directory holding an earlier estimax/: its server beside this one (docstring)",
    )
    parser.add_argument("--baseline_ref", default="", help="what --baseline_tree holds (notes)")
    args = parser.parse_args()
    if args.part == "peer":
        _write_peer(peer(args), args)
        return
    if args.part == "models":
        _write_models(models_run(args), args)
        return
    results = _routes_run(args)
    text = _routes_markdown(results, args)
    if args.baseline_tree:  # a section of serving.md, the routes table and the rest kept
        heading = "## Before and after (`--baseline_tree`)"
        text = text.replace(
            "# Serving load test (`bench/serving.py`)",
            f"{heading}\n\nbefore: {args.baseline_ref or args.baseline_tree}; after: this "
            "checkout. Both servers ran at once, their rounds interleaved route by route.",
        )
        _write_section("before_after", heading, text, results)
    else:
        md_path = os.path.join(RESULTS, "serving.md")
        if os.path.exists(md_path):  # the other parts' sections stay
            old = open(md_path).read()
            for heading in (
                "## ONNX Runtime beside estimax",
                "## Several models in one server",
                "## Before and after",
            ):
                kept = re.search(re.escape(heading) + r".*?(?=\n## |\Z)", old, re.S)
                if kept:
                    text += "\n" + kept.group()
        with open(md_path, "w") as f:
            f.write(text)
        print(text)
    if args.part == "all":
        _write_peer(peer(args), args)
        _write_models(models_run(args), args)


if __name__ == "__main__":
    main()
