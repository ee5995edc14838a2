"""Model versions on disk as TensorFlow Serving lays them out: listing, fingerprints, checks.

``<model_base_path>/<version>/`` with numeric versions. A version is *published* (visible to
the server) when its ``serving.json`` exists (``estimax.export.publish`` writes it last).
Plain ``export_saved_model`` directories (no ``serving.json``) are served from local disk too,
since that function also renames a complete directory into place.

Nothing here imports the estimator: the server lists, fingerprints and re-checks versions
with this module alone.
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
from typing import Any

import fsspec
import numpy as np

from estimax.export import artifact
from estimax.export import record as record_lib
from estimax.export.record import SERVING_FILE
from estimax.export.servable import Servable

CHECK_FILE = "export_check.json"
# Versions are int64, as TF Serving's (``ModelSpec.version`` is an ``Int64Value``): a folder named
# beyond it is not a version (answering it would break every gRPC reply that names the version).
MAX_VERSION = 2**63 - 1
# Written as str(version) writes it: "01" is not version 1 (the folder "1" may also exist).
_VERSION_NAME = re.compile(r"0|[1-9][0-9]{0,18}")


class ExportCheckError(AssertionError):
    """The export's predictions differ from ``Estimator.predict`` beyond the tolerance."""


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
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
    local = is_local(fs)
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


def stored_columns(record: dict, names: list[str]) -> dict[str, Any]:
    """The check inputs of an ``export_check.json`` record by input name: a dict by name (a
    model with several inputs), or one array stored bare (a model with one input).

    Raises:
      ValueError: a bare array for a model with several inputs.
    """
    inputs = record["inputs"]
    if isinstance(inputs, dict):
        return dict(inputs)
    if len(names) != 1:
        raise ValueError(f"one array stored for the inputs {sorted(names)}")
    return {names[0]: inputs}


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
    record_lib.check_regular(fs, path, f"{version_dir}/{CHECK_FILE}")
    try:
        with fs.open(path, "r") as f:
            record = json.load(f)
        if servable.preprocessing is not None:
            images = [base64.b64decode(x["b64"], validate=True) for x in record["inputs"]]
            got = servable.predict_images(images)
        else:
            got = servable.run(servable.prepare(stored_columns(record, list(servable.inputs))))
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
