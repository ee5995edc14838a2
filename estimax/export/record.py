"""The export record: ``serving.json``, what a version holds beside its ``jax.export`` artifact.

Every version directory ``<model_base_path>/<version>/`` written by ``export_version`` holds one
JSON object in ``serving.json`` (written last: on an object store its presence marks the version
published). The server, ``estimax predict``/``export-check`` and the format exporters
(``estimax.export.formats.savedmodel``...) read it with ``read``::

    {
      "format": "estimax.serving/1",   # required; another value is refused with a clear error
      "preprocessing": {...} | null,   # Preprocessing.to_json(): clients send encoded images as
                                       # "image_bytes", the server decodes and preprocesses them
      "top_k": 5,                      # optional: the server adds top_k_classes/_probabilities
      "class_names": ["cat", "dog"],   # optional: class_names[i] names served class id i
      "random": true                   # optional: answers are drawn (sampling, dropout at
                                       # serving): the server never caches them
    }

**Class names.** ``class_names[i]`` is the name of the class the model answers as id ``i``: the
value of its ``classes`` output and column ``i`` of its ``probabilities`` output (0-based), so
the list is as long as ``probabilities`` has columns. ``""`` marks an id without a name. The
server answers them beside the ids: a ``class_names`` output (and ``top_k_class_names``), TF
Serving's ``classify`` labels and Open Inference Protocol's classification extension.

**From the converter.** ``estimax-convert`` writes ``label_map`` (``{name: label}``) in its
``manifest.json`` with the original's **1-based** labels (1..N); an ``input_fn`` that hands the
model ``label - 1`` (as the examples do) serves id ``label - 1``. ``class_names_from_manifest``
makes the list with ``id = label - label_offset`` (``label_offset=1`` by default; 0 for a model
trained on the labels unshifted, whose id 0 is then a class without a name, e.g. the background
class of the 1001-way Inception models).

Older versions load unchanged: a record without ``top_k`` or ``class_names``, or a plain
``export_saved_model`` directory without ``serving.json`` (an ``ExportRecord()``: arrays in and
out, no names).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import posixpath
from collections.abc import Sequence
from typing import Any

import fsspec

SERVING_FILE = "serving.json"
SERVING_FORMAT = "estimax.serving/1"
MANIFEST_FILE = "manifest.json"  # estimax-convert's (estimax.tools.convert_shards)
MANIFEST_FORMAT = "estimax-convert/1"

__all__ = [
    "SERVING_FILE",
    "SERVING_FORMAT",
    "ExportRecord",
    "check_class_names",
    "check_regular",
    "class_names_from_manifest",
    "read",
    "write",
]


@dataclasses.dataclass(frozen=True)
class ExportRecord:
    """The contents of ``serving.json`` (module docstring).

    Attributes:
      preprocessing: the recorded ``Preprocessing.to_json()``, or None (the export takes arrays).
      top_k: how many top classes the server adds, or None.
      class_names: ``class_names[i]`` names served class id ``i``; None: no names.
      random: the version's answers are drawn, not computed: never served from a cache.
    """

    preprocessing: dict[str, Any] | None = None
    top_k: int | None = None
    class_names: tuple[str, ...] | None = None
    random: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as ``serving.json``."""
        out: dict[str, Any] = {"format": SERVING_FORMAT, "preprocessing": self.preprocessing}
        if self.top_k is not None:
            out["top_k"] = int(self.top_k)
        if self.class_names is not None:
            out["class_names"] = list(self.class_names)
        if self.random:
            out["random"] = True
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> ExportRecord:
        """Parses ``serving.json``'s object; ValueError naming ``where`` if it is not one."""
        if not isinstance(data, dict) or data.get("format") != SERVING_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where} has format {found!r}; this estimax reads {SERVING_FORMAT!r}")
        names = data.get("class_names")
        if names is not None and (
            not isinstance(names, list) or not all(isinstance(n, str) for n in names)
        ):
            raise ValueError(f"{where}: class_names must be a list of strings")
        return cls(
            preprocessing=data.get("preprocessing"),
            top_k=data.get("top_k"),
            class_names=tuple(names) if names is not None else None,
            random=data.get("random") is True,
        )


def check_regular(fs: fsspec.AbstractFileSystem, path: str, shown: str) -> None:
    """Raises ValueError naming ``shown`` unless ``path`` is a regular file (or a store's object).

    Opening a FIFO blocks until something writes to it (for ever, in a version folder): it once
    stopped the server's single version-loading thread, and every later version with it. A
    device or socket is no export's file either. Refused before it is opened.
    """
    kind = fs.info(path).get("type", "file")
    if kind != "file":
        raise ValueError(
            f"{shown} is not a regular file (a FIFO, device or socket: {kind}); export the "
            "version again"
        )


def read(version_dir: str) -> ExportRecord:
    """The record of a version directory (local or fsspec URL); ``ExportRecord()`` if none."""
    fs, root = fsspec.core.url_to_fs(version_dir)
    path = posixpath.join(root, SERVING_FILE)
    if not fs.exists(path):
        return ExportRecord()
    check_regular(fs, path, f"{version_dir}/{SERVING_FILE}")
    with fs.open(path, "r") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{version_dir}/{SERVING_FILE} is not JSON: {e}") from None
    return ExportRecord.from_json(data, f"{version_dir}/{SERVING_FILE}")


def write(version_dir: str, record: ExportRecord) -> None:
    """Writes ``serving.json`` into a local version directory."""
    with open(posixpath.join(version_dir, SERVING_FILE), "w") as f:
        json.dump(record.to_json(), f, indent=2)


def check_class_names(
    names: Sequence[str], outputs: dict[str, dict[str, Any]], where: str
) -> tuple[str, ...]:
    """``names`` as a tuple, checked against the export's outputs (``{name: {"shape", ...}}``).

    Linear in the number of names (ImageNet-21k's 21,841 took 11 s when each was counted
    against the whole list), at export and at every load.

    Raises:
      ValueError: names that are not strings, are not valid Unicode (a lone surrogate, as
        ``json`` reads ``"\\udc80"``: no answer could carry it) or repeat, an export without a
        ``classes`` or ``probabilities`` output, or a count other than ``probabilities``'
        columns.
    """
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: class_names must be a list of strings, got {names!r:.80}")
    for i, n in enumerate(names):
        try:
            n.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: class_names[{i}] = {n[:80]!r} is not valid Unicode "
                f"({e.reason} at character {e.start}): every protocol answers names as UTF-8"
            ) from None
    counts = collections.Counter(n for n in names if n)
    repeated = sorted(n for n, k in counts.items() if k > 1)
    if repeated:
        raise ValueError(f"{where}: class_names repeat {repeated[:5]}")
    probabilities = outputs.get("probabilities")
    if probabilities is not None and len(probabilities["shape"]) == 2:
        columns = probabilities["shape"][1]
        if columns is not None and columns != len(names):
            raise ValueError(
                f"{where}: {len(names)} class_names for a model of {columns} classes (its "
                "'probabilities' output); name every class id 0..N-1 (\"\" for one without a name)"
            )
    elif "classes" not in outputs:
        raise ValueError(
            f"{where}: class_names need a 'classes' or 'probabilities' output; the export's "
            f"outputs are {sorted(outputs)}"
        )
    return tuple(names)


def class_names_from_manifest(path: str, label_offset: int = 1) -> list[str]:
    """The class names of an ``estimax-convert`` output, by served id (module docstring).

    Args:
      path: the converter's ``--output_dir`` or its ``manifest.json`` (local or fsspec URL).
      label_offset: served id = label - ``label_offset`` (1: the model was trained on
        ``label - 1``; 0: on the labels as written).

    Returns:
      ``names[id]`` for ids ``0..max label - label_offset``; ``""`` for an id no label maps to.

    Raises:
      FileNotFoundError: no manifest there. ValueError: not a converter's manifest, or a label
        that would map below id 0.
    """
    fs, root = fsspec.core.url_to_fs(path)
    if not root.endswith(".json"):
        root = posixpath.join(root, MANIFEST_FILE)
    if not fs.exists(root):
        raise FileNotFoundError(f"{path}: no {MANIFEST_FILE} (the output of estimax-convert)")
    with fs.open(root, "r") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: {MANIFEST_FILE} is not JSON: {e}") from None
    label_map = data.get("label_map") if isinstance(data, dict) else None
    if not isinstance(label_map, dict) or not label_map or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not an estimax-convert manifest with a label_map")
    ids = {name: int(label) - label_offset for name, label in label_map.items()}
    low = min(ids, key=lambda n: ids[n])
    if ids[low] < 0:
        raise ValueError(
            f"{path}: label {label_map[low]} of {low!r} maps to id {ids[low]} with "
            f"label_offset={label_offset}; the converter's labels start at 1"
        )
    names = [""] * (max(ids.values()) + 1)
    for name, i in ids.items():
        names[i] = name
    return names
