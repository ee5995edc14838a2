"""Shared set-up of the serving tests: a tiny bf16 ResNet with EMA trained on small real JPEGs."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import simplejpeg

import estimax as ex
from estimax.data import preprocessing
from estimax.models import get_model

IMAGE_SIZE = 32
NUM_CLASSES = 3


def make_jpegs(n: int, seed: int = 0) -> tuple[list[bytes], np.ndarray]:
    """n small JPEGs (sizes vary, 40..90 px) of three colour-dominated classes, and labels."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(n):
        label = i % NUM_CLASSES
        h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
        yy, xx = np.mgrid[0:h, 0:w]
        img = rng.integers(0, 80, (h, w, 3)).astype(np.float32)
        img[..., label] += 120 + 60 * np.sin(xx / 7.0 + yy / 11.0)
        images.append(
            simplejpeg.encode_jpeg(
                np.clip(img, 0, 255).astype(np.uint8), quality=90, colorspace="RGB"
            )
        )
        labels.append(label)
    return images, np.asarray(labels, np.int32)


def classify_spec(logits, labels, mode, **train):
    """The classifier's EstimatorSpec: classes and probabilities; SGD with momentum (and
    ``train``'s extra fields, e.g. ema_decay) to train."""
    predictions = {"classes": jnp.argmax(logits, axis=1), "probabilities": jax.nn.softmax(logits)}
    if mode == ex.ModeKeys.PREDICT:
        return ex.EstimatorSpec(
            mode=mode, predictions=predictions, export_outputs={"classify": predictions}
        )
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.05, momentum=0.9),
        predictions=predictions,
        **train,
    )


def model_fn(features, labels, mode, params):
    """The resnet program's model_fn, tiny: uint8 [B, S, S, 3] -> classes, probabilities."""
    del params
    model = get_model("resnet_tiny", num_classes=NUM_CLASSES, dtype=jnp.bfloat16)
    images = preprocessing.normalize(features, jnp, dtype=jnp.bfloat16)
    logits = model(images, train=mode == ex.ModeKeys.TRAIN).astype(jnp.float32)
    return classify_spec(logits, labels, mode, ema_decay=0.9)


def build_estimator(model_dir: str) -> ex.Estimator:
    """The tiny estimator (global batch 8, EMA of the weights, bfloat16 compute)."""
    return ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=model_dir, iterations_per_loop=2),
        train_batch_size=8,
        predict_batch_size=8,
    )


def preprocess_all(images: list[bytes]) -> np.ndarray:
    """The eval pipeline's preprocessing of each image: [N, S, S, 3] uint8."""
    return np.stack([preprocessing.resnet_preprocess(b, False, IMAGE_SIZE) for b in images])


def predict(est: ex.Estimator, images: list[bytes]) -> dict[str, np.ndarray]:
    """Estimator.predict on the eval-preprocessed images."""
    out = list(
        est.predict(ex.numpy_input_fn(preprocess_all(images), None, shuffle=False, num_epochs=1))
    )
    return {k: np.stack([o[k] for o in out]) for k in ("classes", "probabilities")}


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """The environment of a server process: one CPU device, the worktree importable."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        **os.environ,
        "XLA_FLAGS": "",
        "ESTIMAX_ONEDNN": "0",
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


@contextlib.contextmanager
def running_server(
    args: list[str],
    timeout: float = 180.0,
    log_path: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
    open_files: int | None = None,
):
    """Starts ``estimax serve ARGS --port=P`` and yields its base URL once it is ready.

    ``log_path``: its output goes there (appended: the test may read it meanwhile); ``env``:
    more environment variables; ``port``: the port it listens on without a ``--port`` flag
    (one the environment gives it); ``open_files``: its open-file limit (``ulimit -n``).
    """
    import tempfile

    import requests

    # Its output goes to a file, not a pipe: a pipe nobody reads stops a chatty server once
    # its buffer is full (the server would hang, not the test fail).
    log = open(log_path, "a") if log_path else tempfile.TemporaryFile("w+")
    flags = [] if port is not None else [f"--port={(port := free_port())}"]
    command = [sys.executable, "-m", "estimax", "serve", *flags, *args]
    if open_files is not None:  # set in the child before it becomes the server (no fork here)
        command = [sys.executable, "-c", _LIMIT_FILES, str(open_files), *command]
    proc = subprocess.Popen(
        command,
        env={**server_env(), **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:  # wait for readiness (a process start, not a timed assertion)
            if proc.poll() is not None:
                if log_path:
                    with open(log_path) as f:
                        output = f.read()
                else:
                    log.seek(0)
                    output = log.read()
                raise RuntimeError(f"server exited with {proc.returncode}: {output[-4000:]}")
            try:
                if requests.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# python -c _LIMIT_FILES N COMMAND...: runs COMMAND with an open-file limit of N.
_LIMIT_FILES = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


def export_dense(
    root: str, class_names: list[str] | None = None, warmup_requests: list | None = None
) -> str:
    """A small, fast-to-build export (a dense layer over 32x32 RGB) taking raw JPEG bytes.

    It goes through the real raw-image path (JPEG decoded and preprocessed in the server);
    returns the model base path holding version 1 (with ``class_names`` and
    ``warmup_requests``, if given).
    """
    from estimax import export

    est, images = dense_estimator(root)
    base = os.path.join(root, "serving")
    export.export_version(
        est,
        base,
        preprocessing=export.resnet_eval(IMAGE_SIZE),
        check_inputs=images[:2],
        class_names=class_names,
        warmup_requests=warmup_requests,
    )
    return base


def dense_estimator(root: str) -> tuple[ex.Estimator, list[bytes]]:
    """The trained estimator behind ``export_dense`` (one step) and its 8 training JPEGs."""
    import flax.linen as nn

    def dense_model_fn(features, labels, mode, params):
        x = features.astype(jnp.float32).reshape(features.shape[0], -1) / 255.0
        logits = nn.Dense(NUM_CLASSES)(x)
        predictions = {"classes": logits.argmax(-1), "probabilities": jax.nn.softmax(logits)}
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(mode=mode, predictions=predictions)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            predictions=predictions,
        )

    images, labels = make_jpegs(8)
    est = ex.Estimator(
        dense_model_fn,
        ex.RunConfig(model_dir=os.path.join(root, "model")),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(preprocess_all(images), labels), max_steps=1)
    return est, images


def serve_flags(base, name: str, grpc_port: int, *more: str) -> list[str]:
    """``estimax serve``'s flags for the model at ``base``, with gRPC on ``grpc_port``."""
    return [f"--model_base_path={base}", f"--model_name={name}", f"--grpc_port={grpc_port}", *more]


def anonymous_rss(pid: int) -> int:
    """The bytes of a process's resident anonymous memory (its heap, arenas and mappings).

    What a leak or a held request grows. The whole RSS also counts the pages of code the
    process has run (jaxlib's XLA alone is ~100 MiB of them), which grow when a new shape is
    compiled and are the kernel's to drop, so it read as "memory not given back".
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    """Waits for a condition of a server process (with a deadline; not a timed assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def tf_predict_request(name: str, images: list[bytes], dims=None, outputs=()):
    """A TF Serving ``PredictRequest`` of encoded images (``dims``: the shape it claims)."""
    from estimax.serving.protos.tensorflow.core.framework import tensor_pb2, tensor_shape_pb2
    from estimax.serving.protos.tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in (dims or [len(images)])]
    )
    request.inputs["image_bytes"].CopyFrom(
        tensor_pb2.TensorProto(dtype=7, tensor_shape=shape, string_val=images)  # DT_STRING
    )
    request.output_filter.extend(outputs)
    return request


def grpc_predict(target: str, request):
    """TF Serving's gRPC ``Predict`` (the ``PredictionServiceStub`` its clients use)."""
    import grpc

    from estimax.serving.protos.tensorflow_serving.apis import prediction_service_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        return stub.Predict(request, timeout=60)
