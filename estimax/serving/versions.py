"""Model versions on disk as TensorFlow Serving lays them out, published atomically.

``<model_base_path>/<version>/`` with numeric versions. A version is *published* (visible to
the server) when its ``serving.json`` exists: on local disk the whole directory is renamed into
place in one step; on an object store (no rename) the files are uploaded under the final prefix
and ``serving.json`` is uploaded last, so a half-copied version is never served. (TF Serving's
users report versions loaded while still being copied; the marker is the fix.)
Plain ``export_saved_model`` directories (no ``serving.json``) are served from local disk too,
since that function also renames a complete directory into place.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
from absl import logging

from estimax.serving import artifact, skew
from estimax.serving import record as record_lib
from estimax.serving.preprocess import Preprocessing
from estimax.serving.record import SERVING_FILE
from estimax.serving.servable import IMAGE_INPUT, Servable
from estimax.storage import StorageError

if TYPE_CHECKING:
    from estimax.estimator.estimator import Estimator

CHECK_FILE = "export_check.json"
# Versions are int64, as TF Serving's (``ModelSpec.version`` is an ``Int64Value``): a folder named
# beyond it is not a version (answering it would break every gRPC reply that names the version).
MAX_VERSION = 2**63 - 1
# Written as str(version) writes it: "01" is not version 1 (the folder "1" may also exist).
_VERSION_NAME = re.compile(r"0|[1-9][0-9]{0,18}")


class ExportCheckError(AssertionError):
    """The export's predictions differ from ``Estimator.predict`` beyond the tolerance."""


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def version_number(name: str) -> int | None:
    """The version a folder name stands for: ASCII digits up to ``MAX_VERSION`` without
    leading zeros, else None.

    ``str.isdigit`` and ``int`` also take other scripts' digits (``"١"`` is 1 to ``int``) and
    ``"²"``: such a folder is not a version.
    """
    if not _VERSION_NAME.fullmatch(name):
        return None
    number = int(name)
    return number if number <= MAX_VERSION else None


def list_versions(model_base_path: str) -> list[int]:
    """The published versions under ``model_base_path``, ascending.

    Raises:
      FileNotFoundError: ``model_base_path`` does not exist.
    """
    fs, root = fsspec.core.url_to_fs(model_base_path)
    if not fs.isdir(root):
        raise FileNotFoundError(
            f"--model_base_path={model_base_path} does not exist or is not a directory"
        )
    local = _is_local(fs)
    versions = []
    for entry in fs.ls(root, detail=False):
        number = version_number(posixpath.basename(entry.rstrip("/")))
        if number is None:
            continue  # temporary and foreign entries
        if fs.exists(posixpath.join(entry, SERVING_FILE)) or (
            local and fs.exists(posixpath.join(entry, artifact.SIGNATURE_FILE))
        ):
            versions.append(number)
    return sorted(versions)


def fingerprint(version_dir: str) -> tuple[tuple[str, Any, Any], ...] | None:
    """What a version folder holds: each file's name, size and change stamp (None: no folder).

    It changes whenever a file is added, removed, grown or rewritten: a version that failed to
    load is retried when it does (a copy still under way, a file fixed by hand).
    """
    fs, root = fsspec.core.url_to_fs(version_dir)
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    stamp_keys = ("mtime", "LastModified", "updated", "generation", "ETag", "etag")
    return tuple(
        sorted(
            (
                posixpath.basename(e["name"].rstrip("/")),
                e.get("size"),
                str(next((e[k] for k in stamp_keys if e.get(k) is not None), "")),
            )
            for e in entries
        )
    )


def _next_version(fs: fsspec.AbstractFileSystem, root: str) -> int:
    entries = fs.ls(root, detail=False) if fs.isdir(root) else []
    taken = [version_number(posixpath.basename(e.rstrip("/"))) for e in entries]
    return max((n for n in taken if n is not None), default=0) + 1


def export_version(
    estimator: Estimator,
    model_base_path: str,
    serving_input: Any = None,
    preprocessing: Preprocessing | None = None,
    check_inputs: Sequence[Any] | np.ndarray | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
    top_k: int | None = None,
    checkpoint_path: str | None = None,
    platforms: tuple[str, ...] | None = None,
    eval_preprocess: Callable[[bytes], np.ndarray] | None = None,
    class_names: Sequence[str] | None = None,
    pixel_tolerance: float = skew.DEFAULT_PIXEL_TOLERANCE,
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
      preprocessing: for raw-image serving (``estimax.serving.resnet_eval(image_size)``...):
        clients then send encoded JPEG/PNG bytes as ``image_bytes``.
      check_inputs: a few examples to check the export with: encoded images when
        ``preprocessing`` is set, else an array [N, ...] of features. They and the expected
        outputs are stored in the version (``export_check.json``) for ``estimax export-check``.
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
        check images across classes (``estimax.serving.check_images(data_dir)``): predictions
        on images of one class can agree whatever the preprocessing.
      class_names: ``class_names[i]`` names class id ``i`` (as many as ``probabilities`` has
        columns); the server answers them beside the ids. From a folder conversion:
        ``estimax.serving.class_names_from_manifest(data_dir)`` (``estimax.serving.record``).
      pixel_tolerance: the largest difference of one input value accepted, as a fraction of
        the range of ``eval_preprocess``'s values (default 0.02: 5.1 levels of 0..255, 0.02
        of [0, 1]); float64 from ``eval_preprocess`` counts as float32 (what JAX feeds).

    Returns:
      The published version directory.

    Raises:
      ExportCheckError: the export disagrees with ``Estimator.predict``, or its served
        preprocessing with ``eval_preprocess`` (the message names the first difference: shape,
        dtype, or the largest value difference and its pixel); nothing is published.
    """
    from estimax.estimator.inputs import numpy_input_fn  # only the exporter needs the estimator

    if eval_preprocess is not None and preprocessing is not None and check_inputs is not None:
        _check_input_skew(preprocessing, eval_preprocess, check_inputs, pixel_tolerance)
    serving_input = _serving_input(serving_input, preprocessing)
    fs, root = fsspec.core.url_to_fs(model_base_path)
    fs.makedirs(root, exist_ok=True)
    local = _is_local(fs)
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
        )
        # serving.json marks a version published: in the staging directory (not a numeric
        # name, so never listed) it is harmless; uploads to object stores send it last.
        record_lib.write(export_dir, record)
        if check_inputs is not None:
            checked = _check(
                estimator, export_dir, preprocessing, check_inputs, rtol, atol, numpy_input_fn
            )
            if eval_preprocess is not None and preprocessing is not None:
                _check_skew(
                    estimator, checked, check_inputs, eval_preprocess, rtol, atol, numpy_input_fn
                )
            with open(os.path.join(export_dir, CHECK_FILE), "w") as f:
                json.dump(checked, f)
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
    from estimax.estimator.export import TensorSpec

    if serving_input is not None:
        return serving_input
    if preprocessing is None:
        raise ValueError(
            "export_version needs serving_input (a TensorSpec) or "
            "preprocessing (e.g. estimax.serving.resnet_eval(224))"
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
        files = sorted(os.listdir(export_dir), key=lambda n: n == SERVING_FILE)
        for name in files:  # serving.json last
            fs.put_file(os.path.join(export_dir, name), posixpath.join(final, name))
        return version, final


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
    numpy_input_fn: Any,
) -> dict:
    """Runs ``check_inputs`` through the served path and through ``estimator.predict``."""
    servable = Servable(export_dir)
    if preprocessing is not None:
        features = servable.prepare({IMAGE_INPUT: list(check_inputs)})
        raw = [_encode(b) for b in check_inputs]
    else:
        features = servable.prepare({n: check_inputs for n in servable.inputs})
        raw = _encode(check_inputs)
    served = servable.run(features)
    (array,) = features.values() if len(features) == 1 else (features,)
    predicted = list(estimator.predict(numpy_input_fn(array, None, shuffle=False, num_epochs=1)))
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


def _check_input_skew(
    preprocessing: Preprocessing,
    eval_preprocess: Callable[[bytes], np.ndarray],
    check_inputs: Sequence[Any] | np.ndarray,
    tolerance: float,
) -> None:
    """Refuses an export whose served preprocessing feeds the model other inputs than
    training's eval preprocessing (``skew.input_difference``)."""
    found = skew.input_difference(preprocessing, eval_preprocess, list(check_inputs), tolerance)
    if found:
        raise ExportCheckError(
            f"train/serve skew: the export's declared preprocessing {preprocessing.to_json()} "
            f"and eval_preprocess (the training side's) give the model different inputs (served "
            f"vs eval_preprocess): {found}. Declare the preprocessing your eval input uses "
            "(estimax.serving.image_preprocessing(...)); nothing was published."
        )


def _check_skew(
    estimator: Estimator,
    record: dict,
    check_inputs: Sequence[Any] | np.ndarray,
    eval_preprocess: Callable[[bytes], np.ndarray],
    rtol: float,
    atol: float,
    numpy_input_fn: Any,
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


def compare(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float, atol: float, what: str
) -> None:
    """Raises ``ExportCheckError`` naming the output and the worst example if they differ."""
    for name in want:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        if a.shape != b.shape:
            raise ExportCheckError(
                f"{what}: output {name!r} has shape {a.shape}, expected {b.shape}"
            )
        if a.dtype.kind in "iub":
            bad = np.flatnonzero((a != b).reshape(len(a), -1).any(axis=1))
            if bad.size:
                raise ExportCheckError(
                    f"{what}: output {name!r} differs for {bad.size} of "
                    f"{len(a)} examples (first: #{bad[0]}: {a[bad[0]]} vs "
                    f"{b[bad[0]]})"
                )
        else:
            err = np.abs(a.astype(np.float64) - b) - rtol * np.abs(b)
            if (err > atol).any():
                worst = int(np.argmax(err.reshape(len(a), -1).max(axis=1)))
                raise ExportCheckError(
                    f"{what}: output {name!r} differs beyond rtol={rtol}, atol={atol} (worst: "
                    f"example #{worst}, max |diff| "
                    f"{np.abs(a[worst].astype(np.float64) - b[worst]).max():.3g})"
                )


def check_version(version_dir: str) -> tuple[int, dict[str, float]]:
    """``estimax export-check``: reruns a version's stored check examples on this machine.

    Returns:
      (number of examples, {output: max abs difference}).

    Raises:
      FileNotFoundError: the version has no ``export_check.json`` (exported without
        ``check_inputs``).
      ExportCheckError: the served outputs differ from the expected ones.
    """
    fs, root = fsspec.core.url_to_fs(version_dir)
    if not fs.exists(posixpath.join(root, CHECK_FILE)):
        raise FileNotFoundError(
            f"{version_dir} has no {CHECK_FILE}: export it with "
            "export_version(..., check_inputs=...)"
        )
    result = rerun_check(Servable(version_dir), version_dir, "on this machine")
    assert result is not None  # the file exists
    return result


def rerun_check(
    servable: Servable, version_dir: str, where: str
) -> tuple[int, dict[str, float]] | None:
    """Runs the stored check examples of ``version_dir`` through the loaded ``servable``.

    The server runs it before a version is served: a version whose files were damaged after
    the export (a flipped bit in ``variables.msgpack``) answers other classes and is refused.

    Args:
      where: how the error names the run (``"on this machine"``, ``"at load"``).

    Returns:
      (number of examples, {output: max abs difference}); None when the version has no
      ``export_check.json`` (exported without ``check_inputs``: nothing to check).

    Raises:
      ExportCheckError: the outputs differ from the stored ones, or the stored check cannot
        be read (a damaged file cannot vouch for the version).
    """
    fs, root = fsspec.core.url_to_fs(version_dir)
    path = posixpath.join(root, CHECK_FILE)
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "r") as f:
            record = json.load(f)
        if servable.preprocessing is not None:
            images = [base64.b64decode(x["b64"], validate=True) for x in record["inputs"]]
            got = servable.predict_images(images)
        else:
            got = servable.run(servable.prepare({n: record["inputs"] for n in servable.inputs}))
        expected = {k: np.asarray(v) for k, v in record["expected"].items()}
        rtol, atol = float(record["rtol"]), float(record["atol"])
        compare(got, expected, rtol, atol, what=f"{version_dir} {where}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # binascii.Error: ValueError
        raise ExportCheckError(
            f"{version_dir}/{CHECK_FILE} cannot be read ({type(e).__name__}: {e}); export the "
            "version again"
        ) from None
    diffs = {k: float(np.abs(np.asarray(got[k], np.float64) - expected[k]).max()) for k in expected}
    return len(next(iter(expected.values()))), diffs
