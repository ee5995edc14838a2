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
    ``--lone_requests``. Routes: TF Serving REST ``:predict`` (JSON, base64), v2 ``/infer``
    JSON (base64), v2 ``/infer`` with the binary tensor data extension (raw JPEG bytes after a
    JSON header, binary outputs), gRPC TF Serving ``PredictionService/Predict`` (``string_val``)
    and gRPC v2 ``ModelInfer`` (``raw_input_contents``). Request bodies/messages are built
    before the clock starts, so what is timed is the wire, the server and the answer's parsing.
    Bounded in count and time (``--max_seconds`` per run).
Every request must answer with one prediction: errors and lost requests are counted.
The client threads share the machine's cores with the server, as on any single-host test.

    .venv/bin/python bench/serving.py [--requests 2000 --clients 32 --routes all --repeats 3]

Writes bench/results/serving.json and bench/results/serving.md.
"""

from __future__ import annotations

import abc
import argparse
import base64
import json
import os
import platform
import struct
import sys
import tempfile
import threading
import time

import jax.numpy as jnp
import numpy as np
import requests
import simplejpeg

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import serving_fixtures as fx  # noqa: E402

import estimax as ex  # noqa: E402
from estimax import serving  # noqa: E402
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
    servable = serving.Servable(path, 1, batch_sizes=[1])
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

    def __init__(self, url: str, images: list[bytes]):
        self.url = f"{url}/v1/models/bench:predict"
        self.bodies = [
            json.dumps({"instances": [{"b64": base64.b64encode(b).decode()}]}) for b in images
        ]

    def send(self, session, i: int) -> bool:
        r = session.post(
            self.url,
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

    def __init__(self, target: str, images: list[bytes]):
        super().__init__(target)
        from estimax.serving.protos.tensorflow.core.framework import tensor_pb2
        from estimax.serving.protos.tensorflow_serving.apis import predict_pb2

        self.requests = []
        for b in images:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "bench"
            request.output_filter.append("classes")
            tensor = tensor_pb2.TensorProto(dtype=7, string_val=[b])  # DT_STRING
            tensor.tensor_shape.dim.add(size=1)
            request.inputs["image_bytes"].CopyFrom(tensor)
            self.requests.append(request)

    def send(self, channel, i: int) -> bool:
        from estimax.serving.protos.tensorflow_serving.apis import prediction_service_pb2_grpc

        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(self.requests[i % len(self.requests)], timeout=60)
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
    args = parser.parse_args()
    routes = list(ROUTES) if args.routes == "all" else args.routes.split(",")

    rng = np.random.default_rng(0)
    images = [
        simplejpeg.encode_jpeg(
            rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), quality=90, colorspace="RGB"
        )
        for _ in range(16)
    ]
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
        est = ex.Estimator(
            model_fn, ex.RunConfig(model_dir=os.path.join(tmp, "model")), predict_batch_size=8
        )
        path = serving.export_version(
            est,
            os.path.join(tmp, "models"),
            preprocessing=serving.resnet_eval(IMAGE_SIZE),
            platforms=("cpu",),
        )
        results["in_process"] = in_process(path, images, min(args.requests, 500))
        print("in-process", results["in_process"], flush=True)
        for server, flags in (
            ("no batching", []),
            (
                "batching",
                [
                    "--enable_batching",
                    "--max_batch_size=16",
                    "--batch_timeout_micros=2000",
                    "--max_enqueued_batches=64",
                ],
            ),
        ):
            grpc_port = fx.free_port()
            with fx.running_server(
                [
                    f"--model_base_path={os.path.join(tmp, 'models')}",
                    "--model_name=bench",
                    f"--grpc_port={grpc_port}",
                    *flags,
                ]
            ) as (url, _):
                made = {}
                for name in routes:
                    address = f"127.0.0.1:{grpc_port}" if name.startswith("grpc") else url
                    made[name] = ROUTES[name](address, images)
                    load_test(made[name], 64, 8, 60)  # warm the connections and threads
                    results["runs"][f"{server}/{name}"] = {
                        "server": server,
                        "route": made[name].label,
                        "flags": flags,
                        "concurrent": [],
                        "lone": [],
                    }
                # Rounds over the routes in turn: the machine's other load changes by the
                # second, and interleaving spreads it over every route alike.
                for _ in range(args.repeats):
                    for name, route in made.items():
                        run = results["runs"][f"{server}/{name}"]
                        run["concurrent"].append(
                            load_test(route, args.requests, args.clients, args.max_seconds)
                        )
                        # A lone client: what a request costs with no company.
                        run["lone"].append(
                            load_test(route, args.lone_requests, 1, args.max_seconds)
                        )
                        print(server, name, run["concurrent"][-1], run["lone"][-1], flush=True)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "serving.json"), "w") as f:
        json.dump(results, f, indent=2)
    r = results["in_process"]
    lines = [
        "# Serving load test (`bench/serving.py`)",
        "",
        f"{results['model']}; {results['image']}. Loopback; {args.clients} client threads, "
        f"then a lone client, sharing the {results['cores']} cores with the server. Load "
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
    with open(os.path.join(RESULTS, "serving.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
