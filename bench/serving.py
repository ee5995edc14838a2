"""Serving load test: `estimax serve` over loopback vs calling the export in-process.

Exports an (initialised, untrained: speed does not depend on the weights) tiny ResNet (the
test variant: every block type, 8 filters) for 32x32 images with the ResNet eval preprocessing,
so that the numbers are the serving stack's own cost (HTTP, JSON, base64, JPEG decode, batching)
rather than the network's; a ResNet-18 at 64x64 ran at ~4 images/s in-process on this shared
machine (load 11), where no serving overhead is visible. Then:
  * in-process: ``Servable.predict_images`` on one JPEG at a time (the same decode +
    preprocess + export call the server makes), sequentially;
  * the real server process, without and with dynamic batching: ``--clients`` threads, each
    with a keep-alive connection, send ``--requests`` TF Serving ``:predict`` requests in all
    (one b64 JPEG each). Bounded in count and time (``--max_seconds`` per run).
Every request must answer 200 with one prediction: errors and lost requests are counted.
The client threads share the machine's cores with the server, as on any single-host test.

    .venv/bin/python bench/serving.py [--requests 2000 --clients 32]

Writes bench/results/serving.json and bench/results/serving.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
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


def load_test(url: str, bodies: list[str], total: int, clients: int, max_seconds: float) -> dict:
    lock = threading.Lock()
    next_index = [0]
    latencies, errors = [], []
    deadline = time.monotonic() + max_seconds

    def client() -> None:
        session = requests.Session()
        while time.monotonic() < deadline:
            with lock:
                i = next_index[0]
                if i >= total:
                    return
                next_index[0] += 1
            t = time.perf_counter()
            try:
                r = session.post(
                    f"{url}/v1/models/bench:predict",
                    data=bodies[i % len(bodies)],
                    headers={"Content-Type": "application/json"},
                    timeout=60,
                )
                ok = r.status_code == 200 and len(r.json()["predictions"]) == 1
                detail = r.text[:200]
            except requests.RequestException as e:
                ok, detail = False, str(e)
            elapsed = time.perf_counter() - t
            with lock:
                (latencies.append(elapsed) if ok else errors.append(detail))

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--lone_requests", type=int, default=200)
    parser.add_argument("--max_seconds", type=float, default=180)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    images = [
        simplejpeg.encode_jpeg(
            rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), quality=90, colorspace="RGB"
        )
        for _ in range(16)
    ]
    bodies = [json.dumps({"instances": [{"b64": base64.b64encode(b).decode()}]}) for b in images]
    results: dict = {
        "load_before": open("/proc/loadavg").read().split()[:3],
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "model": "tiny ResNet (resnet_tiny), 32x32 input, 10 classes",
        "image": "64x48 JPEG q90 (random pixels), one per request",
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
        for name, flags in (
            ("server", []),
            (
                "server_batching",
                [
                    "--enable_batching",
                    "--max_batch_size=16",
                    "--batch_timeout_micros=2000",
                    "--max_enqueued_batches=64",
                ],
            ),
        ):
            with fx.running_server(
                [f"--model_base_path={os.path.join(tmp, 'models')}", "--model_name=bench", *flags]
            ) as (url, _):
                load_test(url, bodies, 64, 8, 60)  # warm the connections and threads
                results[name] = load_test(
                    url, bodies, args.requests, args.clients, args.max_seconds
                )
                results[name]["flags"] = flags
                # A lone client: what batching adds to a request that has no company.
                results[name + "_lone"] = load_test(
                    url, bodies, args.lone_requests, 1, args.max_seconds
                )
            print(name, results[name], flush=True)
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "serving.json"), "w") as f:
        json.dump(results, f, indent=2)
    rows = [
        ("in-process `Servable.predict_images` (sequential)", results["in_process"]),
        ("`estimax serve`, no batching", results["server"]),
        ("`estimax serve --enable_batching`", results["server_batching"]),
        ("`estimax serve`, no batching, 1 client", results["server_lone"]),
        ("`estimax serve --enable_batching`, 1 client", results["server_batching_lone"]),
    ]
    lines = [
        "# Serving load test (`bench/serving.py`)",
        "",
        f"{results['model']}; {results['image']}. Loopback, {args.clients} client threads "
        "(and a lone client) "
        f"sharing the {results['cores']} cores with the server. Load average before "
        f"{' '.join(results['load_before'])}, after {' '.join(results['load_after'])}.",
        "",
        "| path | requests | ok | errors | lost | req/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(
            f"| {label} | {r['requests']} | {r.get('ok', r['requests'])} | "
            f"{r.get('errors', 0)} | {r.get('lost', 0)} | {r['requests_per_s']:.1f} | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |"
        )
    lines += ["", "Batching flags: " + " ".join(results["server_batching"]["flags"]), ""]
    with open(os.path.join(RESULTS, "serving.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
