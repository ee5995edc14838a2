"""An estimax export -> a TensorFlow SavedModel for TF Serving and ``tf.saved_model.load``.

Needs TensorFlow: install the ``estimax[tf]`` extra (``make .venv-tf/.installed-stamp``); no
other part of estimax imports this module. ::

    python -m estimax.serving.savedmodel --export_dir=serving/3 --output_dir=savedmodel/3

The input is one version of an estimax export (``--export_dir`` of a program, published with
check images: ``export_check.json``). The output's ``serving_default`` signature is the
original's: a ``[None]`` string tensor of encoded JPEG/PNG images under the original's key
(ResNet ``input``, Inception ``image_bytes``), outputs ``classes`` (int64) and
``probabilities`` (float32). The recorded preprocessing runs in TensorFlow ops inside the
SavedModel (decode, crop, resize: the original's own, see ``_resnet_eval``/``_inception_eval``),
the network is the export's StableHLO wrapped by ``jax2tf`` (one ``XlaCallModule`` op, lowered
for the export's platforms) with the weights as ``tf.Variable``s. The preprocessing is
estimax's eval recipe (``estimax.serving.resnet_eval``/``inception_eval``), which differs from
the original's by a sub-pixel shift of the resize (ORIGINAL_SYSTEM.md §4): the SavedModel
answers as ``estimax serve`` does (measured on the test's JPEGs: identical pixels, max
|probability difference| 6e-8).

The SavedModel is written aside, loaded back with ``tf.saved_model.load`` and run on the export's
check images; it is moved into place only if its classes equal estimax's and its probabilities
are within ``--atol`` of them (default: the tolerance the export itself was checked with against
``Estimator.predict``, ``export_check.json``'s ``atol``: 1e-4 for float32, 2e-2 for bfloat16).

Serving it: TF Serving runs ``XlaCallModule`` only with ``--xla_cpu_compilation_enabled=true``;
jax.export promises 3 weeks of forward compatibility, so pair TensorFlow with the JAX that
exported (tested: TF 2.21.0 with jax 0.10.2). See the README's "Coming from TPUEstimator".
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import posixpath
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SavedModelCheckError", "export_savedmodel", "main"]

INPUT_KEYS = {"resnet_eval": "input", "inception_eval": "image_bytes"}


class SavedModelCheckError(AssertionError):
    """The SavedModel's predictions differ from estimax's on the export's check images."""


def _read(path: str, mode: str = "rb") -> Any:
    import fsspec

    with fsspec.open(path, mode) as f:
        return f.read()


def _decode(tf: Any, data: Any) -> Any:
    """Encoded JPEG/PNG -> uint8 [H, W, 3]; JPEG with the fast integer DCT, as estimax's decoder
    (the accurate one differs by up to 5 levels; measured on the test's JPEGs)."""
    return tf.cond(
        tf.io.is_jpeg(data),
        lambda: tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_FAST"),
        lambda: tf.io.decode_png(data, channels=3),
    )


def _round_u8(tf: Any, image: Any) -> Any:
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def _cubic_matrix(tf: Any, size_in: Any, size_out: int) -> Any:
    """``[size_out, size_in]`` weights of OpenCV's INTER_CUBIC along one axis.

    TensorFlow has no op with OpenCV's bicubic (half-pixel centres, kernel a=-0.75, borders
    replicated): its half-pixel bicubic uses a=-0.5 and its legacy one another sampling grid
    (up to 32 levels apart on the check images), so the resize is two matrix products.
    """
    a = -0.75
    scale = tf.cast(size_in, tf.float32) / float(size_out)
    src = (tf.range(size_out, dtype=tf.float32) + 0.5) * scale - 0.5
    x0 = tf.floor(src)
    t = src - x0
    weights = []
    for k in (-1, 0, 1, 2):
        d = tf.abs(t - float(k))
        w = tf.where(
            d <= 1.0,
            ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0,
            ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a,
        )
        index = tf.clip_by_value(tf.cast(x0, tf.int32) + k, 0, size_in - 1)
        weights.append(tf.one_hot(index, size_in) * w[:, None])
    return tf.add_n(weights)


def _resnet_eval(tf: Any, data: Any, image_size: int) -> Any:
    """estimax's ResNet eval: the original's centre crop, OpenCV's bicubic resize, uint8."""
    image = _decode(tf, data)
    shape = tf.shape(image)
    height, width = shape[0], shape[1]
    fraction = tf.constant(image_size / (image_size + 32), tf.float32)
    crop = tf.cast(fraction * tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
    y = ((height - crop) + 1) // 2
    x = ((width - crop) + 1) // 2
    image = tf.cast(tf.image.crop_to_bounding_box(image, y, x, crop, crop), tf.float32)
    rows = _cubic_matrix(tf, crop, image_size)
    image = tf.einsum("oh,hwc,pw->opc", rows, image, rows)
    return _round_u8(tf, image)


def _inception_eval(tf: Any, data: Any, image_size: int) -> Any:
    """``central_crop(0.875)``, bilinear resize, [-1, 1]: as estimax's inception eval."""
    image = _decode(tf, data)
    shape = tf.shape(image)
    h, w = tf.cast(shape[0], tf.float64), tf.cast(shape[1], tf.float64)
    y = tf.cast((h - h * 0.875) / 2, tf.int32)
    x = tf.cast((w - w * 0.875) / 2, tf.int32)
    image = tf.image.crop_to_bounding_box(image, y, x, shape[0] - 2 * y, shape[1] - 2 * x)
    image = tf.image.resize(image, [image_size, image_size], method="bilinear")
    image = tf.cast(_round_u8(tf, image), tf.float32)
    return image * (2.0 / 255.0) - 1.0


_PREPROCESS = {"resnet_eval": _resnet_eval, "inception_eval": _inception_eval}


def export_savedmodel(export_dir: str, output_dir: str, *, atol: float | None = None) -> str:
    """Writes ``output_dir`` (a SavedModel) from the estimax export version ``export_dir``.

    Args:
      export_dir: one version directory of an estimax export (``serving.json``,
        ``model.jaxexport``, ``variables.msgpack``, ``export_check.json``).
      output_dir: where the SavedModel goes (must not exist). Local paths only.
      atol: the largest |difference| of a probability allowed against estimax's (None: the
        export's own check tolerance).

    Returns:
      ``output_dir``.

    Raises:
      FileNotFoundError: not an estimax export with check images.
      SavedModelCheckError: the reloaded SavedModel disagrees with estimax (nothing written).
    """
    import jax
    import tensorflow as tf
    from flax import serialization
    from jax.experimental import jax2tf

    for name in ("serving.json", "model.jaxexport", "variables.msgpack", "export_check.json"):
        if not os.path.exists(os.path.join(export_dir, name)):
            raise FileNotFoundError(
                f"{export_dir} has no {name}: give a version directory of an estimax export "
                "published with check images (a program's --export_dir/<version>)"
            )
    if os.path.exists(output_dir):
        raise FileExistsError(f"{output_dir} exists: give a new --output_dir")
    spec = json.loads(_read(posixpath.join(export_dir, "serving.json"), "r"))
    recipe = (spec.get("preprocessing") or {}).get("name")
    if recipe not in _PREPROCESS:
        raise ValueError(
            f"{export_dir}: preprocessing {recipe!r}; a SavedModel is made for image exports "
            f"({', '.join(_PREPROCESS)})"
        )
    image_size = int(spec["preprocessing"]["params"]["image_size"])
    exported = jax.export.deserialize(bytearray(_read(os.path.join(export_dir, "model.jaxexport"))))
    variables = serialization.msgpack_restore(_read(os.path.join(export_dir, "variables.msgpack")))
    check = json.loads(_read(os.path.join(export_dir, "export_check.json"), "r"))

    pixels_dtype = tf.uint8 if recipe == "resnet_eval" else tf.float32
    network = jax2tf.convert(
        exported.call,
        polymorphic_shapes=[None, f"(b, {image_size}, {image_size}, 3)"],
        with_gradient=False,  # serving only; the export carries no VJP
        native_serialization_platforms=tuple(p.lower() for p in exported.platforms),
    )
    preprocess = _PREPROCESS[recipe]
    key = INPUT_KEYS[recipe]

    module = tf.Module()
    # A flat list: tf.Module wraps a dict attribute in a _DictWrapper, which the exported
    # function (traced with plain dicts) refuses; the tree is rebuilt inside the function.
    module.weights = [
        tf.Variable(np.asarray(x), trainable=False) for x in tf.nest.flatten(variables)
    ]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name=key)])
    def serve(images: Any) -> dict[str, Any]:
        pixels = tf.map_fn(
            lambda data: preprocess(tf, data, image_size),
            images,
            fn_output_signature=tf.TensorSpec([image_size, image_size, 3], pixels_dtype),
        )
        outputs = network(tf.nest.pack_sequence_as(variables, list(module.weights)), pixels)
        probabilities = tf.cast(outputs["probabilities"], tf.float32)
        return {
            "classes": tf.cast(outputs["classes"], tf.int64),
            "probabilities": probabilities,
        }

    module.serve = serve
    staging = tempfile.mkdtemp(
        prefix=".savedmodel-", dir=os.path.dirname(os.path.abspath(output_dir))
    )
    try:
        tf.saved_model.save(module, staging, signatures={"serving_default": serve})
        _check(tf, staging, key, check, float(check.get("atol", 1e-4)) if atol is None else atol)
        os.rename(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def _check(tf: Any, saved: str, key: str, check: dict, atol: float) -> None:
    """Loads ``saved`` with ``tf.saved_model.load`` and compares it with estimax's outputs."""
    images = [base64.b64decode(x["b64"]) for x in check["inputs"]]
    loaded = tf.saved_model.load(saved)
    out = loaded.signatures["serving_default"](**{key: tf.constant(images)})
    classes = out["classes"].numpy()
    probabilities = out["probabilities"].numpy()
    want_classes = np.asarray(check["expected"]["classes"])
    want_probabilities = np.asarray(check["expected"]["probabilities"])
    if not np.array_equal(classes, want_classes):
        bad = np.flatnonzero(classes != want_classes)
        raise SavedModelCheckError(
            f"the SavedModel's classes differ from estimax's for {bad.size} of {len(classes)} "
            f"check images (first: #{bad[0]}: {classes[bad[0]]} vs {want_classes[bad[0]]}); "
            "not published"
        )
    worst = float(np.abs(probabilities - want_probabilities).max())
    if worst > atol:
        raise SavedModelCheckError(
            f"the SavedModel's probabilities differ from estimax's by up to {worst:.3g} "
            f"(> atol {atol}) on the check images; not published"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m estimax.serving.savedmodel``: the command line; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export_dir", required=True, help="an estimax export version directory")
    parser.add_argument("--output_dir", required=True, help="the SavedModel to write (new)")
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        help="largest |probability difference| vs estimax allowed (default: the export's own "
        "check tolerance, export_check.json's atol)",
    )
    args = parser.parse_args(argv)
    try:
        export_savedmodel(args.export_dir, args.output_dir, atol=args.atol)
    except ImportError as e:
        print(
            f"export-savedmodel: error: {e}: install the estimax[tf] extra (TensorFlow)",
            file=sys.stderr,
        )
        return 2
    except (FileNotFoundError, FileExistsError, ValueError, SavedModelCheckError) as e:
        print(f"export-savedmodel: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the SavedModel {args.output_dir} (checked with tf.saved_model.load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
