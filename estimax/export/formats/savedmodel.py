"""An estimax export -> a TensorFlow SavedModel for TF Serving and ``tf.saved_model.load``.

Needs TensorFlow: install the ``estimax[tf]`` extra (``make .venv-tf/.installed-stamp``); no
other part of estimax imports this module. ::

    python -m estimax.export.formats.savedmodel --export_dir=serving/3 --output_dir=savedmodel/3

The input is one version of any estimax export published with check inputs
(``export_check.json``); missing parent folders of ``--output_dir`` are created. The output's
``serving_default`` signature:

- an export that takes arrays takes the same arrays (its input names, declared dtypes and
  shapes, with a dynamic batch: ``input`` for a single tensor; an int64 input the model computes
  in int32, as JAX does without its 64-bit mode, is cast inside);
- an image export takes a ``[None]`` string tensor of encoded JPEG/PNG images: under the
  original's key for estimax's recipes (ResNet ``input``, Inception ``image_bytes``), under
  ``image_bytes`` (as ``estimax serve``) for a declared ``image_preprocessing``. The recorded
  preprocessing runs in TensorFlow ops inside the SavedModel
  (``estimax.export.formats.tf_preprocess``:
  decode, crop, resize method and grid, channels, scaling, mean/std), pixel for pixel as
  estimax's; a recipe TensorFlow cannot reproduce exactly is refused in one line naming it.

Outputs are the export's (``top_k_*`` too when it declares ``top_k``), with ``classes`` as int64
(TensorFlow's argmax type, what the original answered) and bfloat16 as float32. The network is
the export's StableHLO wrapped by ``jax2tf`` (one ``XlaCallModule`` op, lowered for the export's
platforms) with the weights as ``tf.Variable``s.

The SavedModel is written aside and loaded back with ``tf.saved_model.load``; it is moved into
place only if its preprocessing gives estimax's pixels on every check image, its integer outputs
equal estimax's and its float outputs are within ``--atol`` (default: the tolerance the export
itself was checked with against ``Estimator.predict``, ``export_check.json``'s ``atol``: 1e-4
for float32, 2e-2 for bfloat16).

Serving it: TF Serving runs ``XlaCallModule`` only with ``--xla_cpu_compilation_enabled=true``;
jax.export promises 3 weeks of forward compatibility, so pair TensorFlow with the JAX that
exported (tested: TF 2.21.0 with jax 0.10.2). See the README's "Coming from TPUEstimator".
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from estimax.export.formats import common as export_formats

__all__ = ["SavedModelCheckError", "export_savedmodel", "main"]

# The original's serving input keys for its recipes; a declared recipe uses estimax serve's.
INPUT_KEYS = {"resnet_eval": "input", "inception_eval": "image_bytes", "image": "image_bytes"}


class SavedModelCheckError(AssertionError):
    """The SavedModel's predictions differ from estimax's on the export's check images."""


def _safe(name: str) -> str:
    """A TensorFlow tensor name for an export input/output name (nested names use ``/``)."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name).lstrip("/_.-") or "input"


def _network(export: dict[str, Any]) -> tuple[Any, Any]:
    """(jax2tf's function of (weights, features), the tf.Module holding the weights)."""
    import tensorflow as tf
    from jax.experimental import jax2tf

    exported = export["exported"]
    features = export_formats.feature_tree(
        exported,
        lambda i: "(b, " + ", ".join(str(d) for d in exported.in_avals[i].shape[1:]) + ")",
    )
    network = jax2tf.convert(
        exported.call,
        polymorphic_shapes=[None, features],
        with_gradient=False,  # serving only; the export carries no VJP
        native_serialization_platforms=tuple(p.lower() for p in exported.platforms),
    )
    module = tf.Module()
    # A flat list: tf.Module wraps a dict attribute in a _DictWrapper, which the exported
    # function (traced with plain dicts) refuses; the tree is rebuilt inside the function.
    module.weights = [
        tf.Variable(np.asarray(x), trainable=False) for x in tf.nest.flatten(export["variables"])
    ]
    variables = export["variables"]

    # Not AutoGraph's to convert: the serving tf.function would otherwise rewrite JAX's own
    # Python (jax2tf, jax.export: hundreds of functions, AST by AST) the first time a process
    # exports, about 100 s of CPU for the one XlaCallModule op that comes out the same (jax2tf's
    # own advice is autograph=False). What estimax writes around it is still converted.
    @tf.autograph.experimental.do_not_convert
    def call(feats: Any) -> Any:
        return network(tf.nest.pack_sequence_as(variables, list(module.weights)), feats)

    return call, module


def _answers(export: dict[str, Any], outputs: Any) -> dict[str, Any]:
    """The export's outputs by name; classes int64, bfloat16 as float32, top_k as declared."""
    import tensorflow as tf

    _, specs = export_formats.io_specs(export)
    flat = tf.nest.flatten(outputs)
    out = {}
    for (name, _), value in zip(specs, flat, strict=True):
        if value.dtype == tf.bfloat16:
            value = tf.cast(value, tf.float32)
        out[_safe(name)] = tf.cast(value, tf.int64) if name == "classes" else value
    top_k = export["spec"].get("top_k")
    if top_k is not None and "probabilities" in out:
        k = min(int(top_k), int(out["probabilities"].shape[-1]))
        top = tf.math.top_k(out["probabilities"], k=k)  # ties: lower class first, as estimax
        out["top_k_classes"] = tf.cast(top.indices, tf.int32)
        out["top_k_probabilities"] = top.values
    return out


def _serving_function(export: dict[str, Any], module: Any, network: Any) -> tuple[Any, Any]:
    """(the ``serving_default`` tf.function, the key its image input has or None)."""
    import tensorflow as tf

    from estimax.export.formats import tf_preprocess
    from estimax.export.preprocess import from_spec

    inputs, _ = export_formats.io_specs(export)
    record = export["spec"].get("preprocessing")
    if record:
        pre = from_spec(record)
        preprocess = tf_preprocess.preprocess_fn(pre)
        key = INPUT_KEYS[pre.name]
        ((name, _, shape),) = inputs
        pixel_spec = tf.TensorSpec(shape[1:], tf.as_dtype(pre.output_dtype))

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name=key)])
        def serve_images(images: Any) -> dict[str, Any]:
            pixels = tf.map_fn(preprocess, images, fn_output_signature=pixel_spec)
            features = export_formats.feature_tree(export["exported"], lambda i: pixels)
            return _answers(export, network(features))

        # Kept in the SavedModel for the pixel check (one image -> the model's input).
        module.preprocess = tf.function(preprocess, input_signature=[tf.TensorSpec([], tf.string)])
        return serve_images, key
    specs = {
        name: tf.TensorSpec([None, *shape[1:]], tf.as_dtype(dtype), name=_safe(name))
        for name, dtype, shape in inputs
    }
    n_weights = len(tf.nest.flatten(export["variables"]))

    avals = export["exported"].in_avals

    def computed(feature: Any, i: int) -> Any:
        # Declared int64 (float64), computed in int32 (float32) as JAX does without its 64-bit
        # mode: the signature takes what clients send and casts it, as estimax serve does.
        dtype = tf.as_dtype(avals[i].dtype)
        return feature if feature.dtype == dtype else tf.cast(feature, dtype)

    @tf.function(input_signature=[specs])
    def serve_arrays(features: dict[str, Any]) -> dict[str, Any]:
        names = [name for name, _, _ in inputs]
        tree = export_formats.feature_tree(
            export["exported"],
            lambda i: computed(features[names[i - n_weights]], i) if i >= n_weights else None,
        )
        return _answers(export, network(tree))

    return serve_arrays, None


def export_savedmodel(export_dir: str, output_dir: str, *, atol: float | None = None) -> str:
    """Writes ``output_dir`` (a SavedModel) from the estimax export version ``export_dir``.

    Args:
      export_dir: one version directory of an estimax export (``serving.json``,
        ``model.jaxexport``, ``variables.msgpack``, ``export_check.json``).
      output_dir: where the SavedModel goes (must not exist; missing parents are created).
        Local paths only.
      atol: the largest |difference| of a float output allowed against estimax's (None: the
        export's own check tolerance).

    Returns:
      ``output_dir``.

    Raises:
      FileNotFoundError: not an estimax export with check inputs.
      ValueError: its preprocessing has no exact TensorFlow version (the message names it).
      SavedModelCheckError: the reloaded SavedModel disagrees with estimax (nothing written).
    """
    import tensorflow as tf

    export = export_formats.load_export(export_dir)
    if os.path.exists(output_dir):
        raise FileExistsError(f"{output_dir} exists: give a new --output_dir")
    network, module = _network(export)
    serve, key = _serving_function(export, module, network)
    module.serve = serve
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".savedmodel-", dir=parent)
    try:
        tf.saved_model.save(module, staging, signatures={"serving_default": serve})
        _check(staging, export, key, atol)
        os.rename(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def _check_pixels(loaded: Any, export: dict[str, Any]) -> None:
    """Refuses a SavedModel whose preprocessing gives other pixels than estimax's: uint8 equal,
    float32 within float32 rounding (TensorFlow's graph optimizer may turn ``/ stddev`` into a
    multiplication: 2e-7 apart measured; one pixel level is 1/stddev, far above that)."""
    import tensorflow as tf

    from estimax.export.preprocess import from_spec

    pre = from_spec(export["spec"]["preprocessing"])
    for i, image in enumerate(export_formats.check_images(export)):
        got = loaded.preprocess(tf.constant(image)).numpy()
        want = pre(image)
        same = got.shape == want.shape and (
            np.array_equal(got, want)
            if want.dtype == np.uint8
            else np.allclose(got, want, rtol=1e-6, atol=1e-6)
        )
        if not same:
            diff = np.abs(got.astype(np.float64) - want).max() if got.shape == want.shape else "-"
            raise SavedModelCheckError(
                f"the SavedModel's preprocessing ({pre.name} {pre.params}) gives other pixels "
                f"than estimax's on check image #{i} (max |diff| {diff}); not published"
            )


def _check(saved: str, export: dict[str, Any], key: str | None, atol: float | None) -> None:
    """Loads ``saved`` with ``tf.saved_model.load`` and compares it with estimax's outputs."""
    import tensorflow as tf

    loaded = tf.saved_model.load(saved)
    fn = loaded.signatures["serving_default"]
    if key is not None:
        _check_pixels(loaded, export)
        out = fn(**{key: tf.constant(export_formats.check_images(export))})
    else:
        features = export_formats.check_features(export)
        out = fn(**{_safe(name): tf.constant(value) for name, value in features.items()})
    got = {name: out[_safe(name)].numpy() for name in export["check"]["expected"]}
    export_formats.compare(got, export, atol, "the SavedModel", SavedModelCheckError)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m estimax.export.formats.savedmodel``: the command line; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export_dir", required=True, help="an estimax export version directory")
    parser.add_argument(
        "--output_dir", required=True, help="the SavedModel to write (new; parents are created)"
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        help="largest |difference| of a float output vs estimax allowed (default: the export's "
        "own check tolerance, export_check.json's atol)",
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
    except (OSError, ValueError, SavedModelCheckError) as e:
        print(f"export-savedmodel: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the SavedModel {args.output_dir} (checked with tf.saved_model.load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
