"""The end of ``make demo``: serve the exported MNIST model and classify one held-out digit.

    python -m estimax.serving.demo --model_base_path=runs/mnist_demo/serving \
        --data_dir=runs/mnist_demo/data [--index=0]

Writes ``<model_base_path>/../request.json`` (TensorFlow Serving's ``{"instances": [...]}`` with
held-out digit ``--index`` of ``validation.tfrecords``, scaled as the program's parser does),
starts ``estimax serve`` on a free loopback port, POSTs the file to ``/v1/models/mnist:predict``
(what the README's ``curl`` line does), prints the answer and the true label, and stops the
server. Exit 1 if the server does not answer 200.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

from estimax.data import example, tfrecord


def held_out_digit(data_dir: str, index: int) -> tuple[list[float], int]:
    """Digit ``index`` of ``data_dir/validation.tfrecords``: 784 floats in [-0.5, 0.5], label."""
    path = os.path.join(data_dir, "validation.tfrecords")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist: run python -m estimax.tools.mnist_data "
            f"--output_dir={data_dir} first"
        )
    schema = {
        "image_raw": example.FixedLenFeature((), "string"),
        "label": example.FixedLenFeature((), "int64"),
    }
    for i, record in enumerate(tfrecord.read_records(path)):
        if i == index:
            parsed = example.parse_example(record, schema)
            pixels = np.frombuffer(parsed["image_raw"], np.uint8)
            # As the mnist program's parser: [0, 255] -> [-0.5, 0.5].
            return (pixels.astype(np.float32) / 255.0 - 0.5).tolist(), int(parsed["label"])
    raise ValueError(f"--index={index}: {path} has only {i + 1} digits")


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def main(argv: list[str] | None = None) -> int:
    """Runs the demo's last step; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m estimax.serving.demo")
    parser.add_argument("--model_base_path", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--model_name", default="mnist")
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        pixels, label = held_out_digit(args.data_dir, args.index)
    except (OSError, ValueError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    request_file = os.path.join(
        os.path.dirname(os.path.abspath(args.model_base_path)), "request.json"
    )
    body = json.dumps({"instances": [pixels]}).encode()
    with open(request_file, "wb") as f:
        f.write(body)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "estimax",
            "serve",
            f"--model_base_path={args.model_base_path}",
            f"--model_name={args.model_name}",
            f"--port={port}",
            "--file_system_poll_wait_seconds=0",
        ]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:  # the server loads and compiles the model before it listens
            if server.poll() is not None:
                print(f"demo: estimax serve exited with {server.returncode}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(url + "/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                print("demo: the server did not become ready in 300 s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        target = f"{url}/v1/models/{args.model_name}:predict"
        status, answer = _post(target, body)
        print(f"curl -d @{request_file} {target}")
        if status != 200:
            print(f"demo: the server answered {status}: {answer}", file=sys.stderr)
            return 1
        prediction = answer["predictions"][0]
        probability = prediction["probabilities"][prediction["classes"]]
        print(
            f"Served prediction for held-out digit #{args.index}: class "
            f"{prediction['classes']} (probability {probability:.3f}); its label is {label}"
        )
        return 0
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
