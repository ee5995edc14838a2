"""Publishing a trained model as the next version, checked against ``Estimator.predict``.

A version is *published* (visible to the server) when its ``serving.json`` exists: on local disk
the whole directory is renamed into place in one step; on an object store (no rename) the files
are uploaded under the final prefix and ``serving.json`` is uploaded last, so a half-copied
version is never served. (TF Serving's users report versions loaded while still being copied;
the marker is the fix.)
"""

from __future__ import annotations

import base64
import errno
import json
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
import numpy as np
from absl import logging

from estimax.estimator.estimator import Estimator
from estimax.estimator.export import TensorSpec
from estimax.estimator.inputs import numpy_input_fn
from estimax.export import artifact, skew, warmup
from estimax.export import record as record_lib
from estimax.export.preprocess import Preprocessing
from estimax.export.record import SERVING_FILE
from estimax.export.servable import DEFAULT_INPUT, IMAGE_INPUT, InvalidInput, Servable
from estimax.export.versions import (
    CHECK_FILE,
    ExportCheckError,
    compare,
    is_local,
    version_number,
)
from estimax.storage import StorageError


def _next_version(fs: fsspec.AbstractFileSystem, root: str) -> int:
    entries = fs.ls(root, detail=False) if fs.isdir(root) else []
    taken = [version_number(posixpath.basename(e.rstrip("/"))) for e in entries]
    return max((n for n in taken if n is not None), default=0) + 1


def export_version(
    estimator: Estimator,
    model_base_path: str,
    serving_input: Any = None,
    preprocessing: Preprocessing | None = None,
    check_inputs: Sequence[Any] | np.ndarray | dict[str, Any] | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
    top_k: int | None = None,
    checkpoint_path: str | None = None,
    platforms: tuple[str, ...] | None = None,
    eval_preprocess: Callable[[bytes], np.ndarray] | None = None,
    class_names: Sequence[str] | None = None,
    pixel_tolerance: float = skew.DEFAULT_PIXEL_TOLERANCE,
    warmup_requests: Sequence[Any] | None = None,
    random: bool = False,
) -> str:
    """Exports ``estimator``'s model as the next version under ``model_base_path``.

    Calls ``estimator.export_saved_model`` (the weights it evaluates with: the EMA when the run
    keeps one) into a temporary directory, optionally checks it against ``estimator.predict``,
    writes ``serving.json`` and publishes ``<model_base_path>/<max version + 1>/`` atomically.

    Args:
      estimator: a trained ``estimax.Estimator``.
      model_base_path: local path or fsspec URL (``gs://``, ``s3://``, ``memory://``...).
      serving_input: ``TensorSpec`` (or dict of them) the export takes; default for images:
        ``TensorSpec((None, *preprocessing.output_shape), preprocessing.output_dtype)``.
      preprocessing: for raw-image serving (``estimax.export.resnet_eval(image_size)``...):
        clients then send encoded JPEG/PNG bytes as ``image_bytes``.
      check_inputs: a few examples to check the export with: encoded images when
        ``preprocessing`` is set, else the features, of any dtype: an array [N, ...] for a model
        with one input, or per input name (``serving_input``'s keys) a dict of arrays
        ``{"input_ids": [N, 128], "input_mask": ...}`` or a list of per-example dicts. They and
        the expected outputs are stored in the version (``export_check.json``), rerun by
        ``estimax export-check``, by the server before it serves the version, and by
        ``export-savedmodel``/``export-onnx``.
      rtol, atol: the parity tolerance for float outputs (integer outputs must be equal).
      top_k: also answer ``top_k_classes`` and ``top_k_probabilities`` [batch, k] (computed
        by the server from ``probabilities``).
      checkpoint_path: a checkpoint to export; None = the latest.
      platforms: lowering platforms (default: ``export_saved_model``'s cpu, cuda, tpu).
      eval_preprocess: the training side's own eval preprocessing of one encoded image (the
        function your eval ``input_fn`` applies). With ``preprocessing`` and ``check_inputs``,
        an export whose served preprocessing disagrees with training's (a train/serve skew) is
        refused: first the two model inputs of each check image are compared (shape, dtype, and
        values within ``pixel_tolerance``), before anything is exported; then ``check_inputs``
        go through it and ``Estimator.predict``, and the predictions are compared. Draw the
        check images across classes (``estimax.export.check_images(data_dir)``): predictions
        on images of one class can agree whatever the preprocessing.
      class_names: ``class_names[i]`` names class id ``i`` (as many as ``probabilities`` has
        columns); the server answers them beside the ids. From a folder conversion:
        ``estimax.export.class_names_from_manifest(data_dir)`` (``estimax.export.record``).
      pixel_tolerance: the largest difference of one input value accepted, as a fraction of
        the range of ``eval_preprocess``'s values (default 0.02: 5.1 levels of 0..255, 0.02
        of [0, 1]); float64 from ``eval_preprocess`` counts as float32 (what JAX feeds).
      warmup_requests: requests a server replays before it serves the version (TF Serving's
        warm-up records, ``assets.extra/tf_serving_warmup_requests``; ``estimax serve``
        replays them too): a list of 1 to 1,000 requests, each in ``check_inputs``' form (a
        list of encoded images with ``preprocessing``, else an array [N, ...] or a dict by
        input name). Each is run through the export first (one the export refuses is a
        ValueError naming it, and nothing is published); the file is published with the
        version, never after it.
      random: the model's answers are drawn (sampling, dropout kept at serving): written as
        ``"random": true`` in ``serving.json``, and a server never answers it from its response
        cache, whatever the model's config asks (``estimax.serving.response_cache``).

    Returns:
      The published version directory.

    Raises:
      ExportCheckError: the export disagrees with ``Estimator.predict``, or its served
        preprocessing with ``eval_preprocess`` (the message names the first difference: shape,
        dtype, or the largest value difference and its pixel); nothing is published.
    """
    if isinstance(check_inputs, dict) and preprocessing is not None:
        raise ValueError(
            "check_inputs: with preprocessing, a list of encoded images (the export takes "
            "image_bytes), not a dict"
        )
    if eval_preprocess is not None and preprocessing is not None and check_inputs is not None:
        assert not isinstance(check_inputs, dict)
        _check_input_skew(preprocessing, eval_preprocess, check_inputs, pixel_tolerance)
    serving_input = _serving_input(serving_input, preprocessing)
    fs, root = fsspec.core.url_to_fs(model_base_path)
    fs.makedirs(root, exist_ok=True)
    local = is_local(fs)
    staging_parent = (
        os.path.join(root, f".tmp-export-{uuid.uuid4().hex}")
        if local
        else tempfile.mkdtemp(prefix="estimax-export-")
    )
    try:
        export_dir = estimator.export_saved_model(
            staging_parent,
            lambda: serving_input,
            checkpoint_path=checkpoint_path,
            platforms=platforms,
        )
        record = record_lib.ExportRecord(
            preprocessing=preprocessing.to_json() if preprocessing else None,
            top_k=int(top_k) if top_k is not None else None,
            class_names=_checked_names(export_dir, class_names),
            random=bool(random),
        )
        # serving.json marks a version published: in the staging directory (not a numeric
        # name, so never listed) it is harmless; uploads to object stores send it last.
        record_lib.write(export_dir, record)
        if check_inputs is not None:
            checked = _check(estimator, export_dir, preprocessing, check_inputs, rtol, atol)
            if eval_preprocess is not None and preprocessing is not None:
                assert not isinstance(check_inputs, dict)
                _check_skew(estimator, checked, check_inputs, eval_preprocess, rtol, atol)
            with open(os.path.join(export_dir, CHECK_FILE), "w") as f:
                json.dump(checked, f)
        if warmup_requests is not None:
            _write_warmup(export_dir, preprocessing is not None, warmup_requests)
        version, final = _publish(fs, root, export_dir, local)
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        raise StorageError(
            e.errno,
            f"Could not write the export under {model_base_path}: {e.strerror or e}. Nothing "
            "was published; earlier versions are intact.",
        ) from e
    finally:
        shutil.rmtree(staging_parent, ignore_errors=True)
    url = final if local else fs.unstrip_protocol(final)
    logging.info("Published version %d of the model under %s", version, model_base_path)
    return url


def _serving_input(serving_input: Any, preprocessing: Preprocessing | None) -> Any:
    """The export's input spec: ``serving_input``, else the preprocessing's output."""
    if serving_input is not None:
        return serving_input
    if preprocessing is None:
        raise ValueError(
            "export_version needs serving_input (a TensorSpec) or "
            "preprocessing (e.g. estimax.export.resnet_eval(224))"
        )
    return TensorSpec((None, *preprocessing.output_shape), preprocessing.output_dtype)


def _publish(
    fs: fsspec.AbstractFileSystem, root: str, export_dir: str, local: bool
) -> tuple[int, str]:
    """Moves the staged ``export_dir`` to ``root/<max version + 1>``; (version, its path)."""
    while True:
        version = _next_version(fs, root)
        final = posixpath.join(root, str(version))
        if local:
            try:
                os.rename(export_dir, final)  # atomic; fails if another writer took it
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    continue
                raise  # any other failure would retry forever
            return version, final
        files = sorted(
            (
                os.path.relpath(os.path.join(folder, name), export_dir)
                for folder, _, names in os.walk(export_dir)
                for name in names
            ),
            key=lambda n: n == SERVING_FILE,
        )
        for name in files:  # serving.json last; assets.extra/ and its kin by their paths
            fs.put_file(
                os.path.join(export_dir, name),
                posixpath.join(final, *name.split(os.sep)),
            )
        return version, final


def _write_warmup(export_dir: str, images: bool, requests: Sequence[Any]) -> None:
    """Runs each of ``requests`` through the staged export, then writes them as its warm-up
    records (``estimax.export.warmup``); ValueError naming the request the export refuses."""
    if isinstance(requests, (dict, np.ndarray, str, bytes)) or not isinstance(requests, Sequence):
        raise ValueError(
            "warmup_requests: a list of requests, each as check_inputs takes (with "
            "preprocessing: a list of encoded images)"
        )
    servable = Servable(export_dir)
    try:
        written: list[dict[str, Any]] = []
        for i, request in enumerate(requests):
            try:
                if images:
                    if isinstance(request, (bytes, bytearray)) or not isinstance(request, Sequence):
                        raise ValueError("a list of encoded images (one request), not one image")
                    columns: dict[str, Any] = {IMAGE_INPUT: [bytes(b) for b in request]}
                    servable.run(servable.prepare(columns))
                else:
                    # The features: of the inputs' own dtypes, as a server checks them.
                    columns = servable.prepare(check_columns(request, list(servable.inputs)))
                    servable.run(columns)
            except (InvalidInput, ValueError, TypeError) as e:
                raise ValueError(f"warmup_requests[{i}]: {e}") from None
            written.append(columns)
        warmup.write(export_dir, written)
    finally:
        servable.model.close()


def _checked_names(export_dir: str, names: Sequence[str] | None) -> tuple[str, ...] | None:
    """``names`` checked against the export's outputs (ValueError before anything is published)."""
    if names is None:
        return None
    with open(os.path.join(export_dir, artifact.SIGNATURE_FILE)) as f:
        outputs = artifact.named_specs(json.load(f)["outputs"], "output")
    return record_lib.check_class_names(names, outputs, "export_version(class_names=...)")


def _encode(x: Any) -> Any:
    if isinstance(x, (bytes, bytearray)):
        return {"b64": base64.b64encode(bytes(x)).decode()}
    return np.asarray(x).tolist()


def _check(
    estimator: Estimator,
    export_dir: str,
    preprocessing: Preprocessing | None,
    check_inputs: Any,
    rtol: float,
    atol: float,
) -> dict:
    """Runs ``check_inputs`` through the served path and through ``estimator.predict``."""
    servable = Servable(export_dir)
    if preprocessing is not None:
        features = servable.prepare({IMAGE_INPUT: list(check_inputs)})
        raw: Any = [_encode(b) for b in check_inputs]
    else:
        columns = check_columns(check_inputs, list(servable.inputs))
        features = servable.prepare(columns)
        # One array for a single unnamed input (as earlier versions stored it), else by name.
        raw = (
            _encode(columns[DEFAULT_INPUT])
            if list(columns) == [DEFAULT_INPUT]
            else {k: _encode(v) for k, v in features.items()}
        )
    served = servable.run(features)
    inputs = servable.model.signature["inputs"]
    fed = next(iter(features.values())) if artifact.is_leaf_spec(inputs) else _nest(features)
    predicted = list(estimator.predict(numpy_input_fn(fed, None, shuffle=False, num_epochs=1)))
    expected = {
        k: np.stack([np.asarray(p[k]) for p in predicted]) for k in served if k in predicted[0]
    }
    compare(served, expected, rtol, atol, what=f"the export in {export_dir} vs Estimator.predict")
    servable.model.close()
    return {
        "inputs": raw,
        "expected": {k: v.tolist() for k, v in expected.items()},
        "rtol": rtol,
        "atol": atol,
    }


def check_columns(check_inputs: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """``check_inputs`` as ``{input name: [N, ...] array}`` for an export taking arrays.

    Takes one array [N, ...] (a model with one input), a dict of arrays by input name (nested
    dicts as the serving input nests them, or names joined with ``/``), or a list of
    per-example dicts. Raises ValueError naming what does not fit the export's inputs.
    """
    if isinstance(check_inputs, dict):
        columns = {k: np.asarray(v) for k, v in _flatten(check_inputs).items()}
    elif (
        isinstance(check_inputs, Sequence)
        and not isinstance(check_inputs, str | bytes)
        and len(check_inputs)
        and all(isinstance(x, dict) for x in check_inputs)
    ):
        examples = [_flatten(x) for x in check_inputs]
        keys = set(examples[0])
        odd = next((i for i, x in enumerate(examples) if set(x) != keys), None)
        if odd is not None:
            raise ValueError(
                f"check_inputs: example #{odd} has the inputs {sorted(examples[odd])}, "
                f"example #0 {sorted(keys)}"
            )
        columns = {k: np.stack([np.asarray(x[k]) for x in examples]) for k in examples[0]}
    elif len(names) == 1:
        return {names[0]: np.asarray(check_inputs)}
    else:
        raise ValueError(
            f"check_inputs: the model takes the inputs {sorted(names)}: give check_inputs as "
            "{name: array [N, ...]} or a list of {name: value} (one per example)"
        )
    if set(columns) != set(names):
        raise ValueError(
            f"check_inputs: the model takes the inputs {sorted(names)}, check_inputs has "
            f"{sorted(columns)}"
        )
    return columns


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A dict of inputs by ``/``-joined name (as ``Servable`` names nested inputs)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        out.update(_flatten(v, name) if isinstance(v, dict) else {name: v})
    return out


def _nest(features: dict[str, np.ndarray]) -> dict[str, Any]:
    """``/``-joined names back to the serving input's nested dicts (what ``model_fn`` gets)."""
    out: dict[str, Any] = {}
    for name, value in features.items():
        *parents, leaf = name.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _check_input_skew(
    preprocessing: Preprocessing,
    eval_preprocess: Callable[[bytes], np.ndarray],
    check_inputs: Sequence[Any] | np.ndarray,
    tolerance: float,
) -> None:
    """Refuses an export whose served preprocessing feeds the model other inputs than
    training's eval preprocessing (``skew.input_difference``)."""
    images = list(check_inputs)
    found = skew.input_difference(preprocessing, eval_preprocess, images, tolerance)
    if found:
        closest = skew.closest_declaration(preprocessing, eval_preprocess, images, tolerance)
        hint = (
            f"the closest declaration that agrees: {skew.declaration(closest)}"
            if closest is not None
            else "no declaration that differs only in resize/antialias agrees"
        )
        raise ExportCheckError(
            f"train/serve skew: the export's declared preprocessing {preprocessing.to_json()} "
            f"and eval_preprocess (the training side's) give the model different inputs (served "
            f"vs eval_preprocess): {found}. Declare the preprocessing your eval input uses "
            f"({hint}); nothing was published."
        )


def _check_skew(
    estimator: Estimator,
    record: dict,
    check_inputs: Sequence[Any] | np.ndarray,
    eval_preprocess: Callable[[bytes], np.ndarray],
    rtol: float,
    atol: float,
) -> None:
    """Refuses an export whose served preprocessing gives other predictions than training's."""
    features = np.stack([np.asarray(eval_preprocess(bytes(b))) for b in check_inputs])
    predicted = list(estimator.predict(numpy_input_fn(features, None, shuffle=False, num_epochs=1)))
    served = {k: np.asarray(v) for k, v in record["expected"].items()}
    expected = {
        k: np.stack([np.asarray(p[k]) for p in predicted]) for k in served if k in predicted[0]
    }
    compare(
        served,
        expected,
        rtol,
        atol,
        what=(
            "train/serve skew: the export's declared preprocessing vs eval_preprocess (the "
            "training side's) on check_inputs; declare the preprocessing your eval input uses"
        ),
    )
