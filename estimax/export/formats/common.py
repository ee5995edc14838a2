"""What the SavedModel and ONNX writers share: reading an export version, its inputs and
outputs by name, its check inputs as features, and the comparison with estimax's answers.

Reads the export's files only (no model code), with JAX, flax's msgpack and fsspec; the check
record is ``export_check.json`` (``estimax.export.versions``): the check inputs (encoded images,
one array, or arrays by input name) and what ``Estimator.predict`` answered for them, with the
tolerance it was checked at.
"""

from __future__ import annotations

import base64
import json
import posixpath
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["check_features", "compare", "feature_tree", "io_specs", "load_export"]

_FILES = (
    "serving.json",
    "model.jaxexport",
    "variables.msgpack",
    "export_check.json",
    "signature.json",
)


def _read(path: str, mode: str = "rb") -> Any:
    import fsspec

    with fsspec.open(path, mode) as f:
        return f.read()


def _exists(path: str) -> bool:
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    return bool(fs.exists(root))


def load_export(export_dir: str) -> dict[str, Any]:
    """``{"spec", "exported", "variables", "check", "signature"}`` of one export version.

    Raises:
      FileNotFoundError: not a version of an estimax export published with check inputs.
    """
    import jax
    from flax import serialization

    for name in _FILES:
        if not _exists(posixpath.join(export_dir, name)):
            raise FileNotFoundError(
                f"{export_dir} has no {name}: give a version directory of an estimax export "
                "published with check inputs (export_version(..., check_inputs=...))"
            )
    return {
        "spec": json.loads(_read(posixpath.join(export_dir, "serving.json"), "r")),
        "exported": jax.export.deserialize(
            bytearray(_read(posixpath.join(export_dir, "model.jaxexport")))
        ),
        "variables": serialization.msgpack_restore(
            _read(posixpath.join(export_dir, "variables.msgpack"))
        ),
        "check": json.loads(_read(posixpath.join(export_dir, "export_check.json"), "r")),
        "signature": json.loads(_read(posixpath.join(export_dir, "signature.json"), "r")),
    }


def _flat_names(tree: Any, single: str) -> list[str]:
    """Leaf names in JAX's flattening order: ``single`` for a lone leaf, else the dict keys
    joined with ``/`` (as ``Servable`` names inputs and outputs)."""
    import jax

    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) or single
        for path in paths
    ]


def feature_tree(exported: Any, leaf: Callable[[int], Any]) -> Any:
    """The export's feature pytree with ``leaf(i)`` for its i-th argument (``in_avals[i]``)."""
    import jax

    return jax.tree.unflatten(exported.in_tree, [leaf(i) for i in range(len(exported.in_avals))])[
        0
    ][1]


def io_specs(export: dict[str, Any]) -> tuple[list[tuple[str, np.dtype, list]], list[tuple]]:
    """``([(name, dtype, shape)] of the inputs, [(name, dtype)] of the outputs)``; shapes have
    None for the batch. Names as ``estimax serve`` gives them (``input``/``output`` when single).

    An input's dtype is the one the export declares (``signature.json``, what clients send and
    ``estimax serve`` takes), which may be wider than the one the model computes in: an int64
    input is int32 in the module without JAX's 64-bit mode (``computed_dtypes``)."""
    import jax

    from estimax.export import artifact

    exported = export["exported"]
    n_weights = len(jax.tree.leaves(export["variables"]))
    names = _flat_names(feature_tree(exported, lambda i: i), "input")
    declared = artifact.named_specs(export["signature"]["inputs"], "input")
    inputs = []
    for i, aval in enumerate(exported.in_avals[n_weights:]):
        shape = [d if isinstance(d, int) else None for d in aval.shape]
        dtype = declared[names[i]]["dtype"] if names[i] in declared else aval.dtype
        inputs.append((names[i], np.dtype(dtype), shape))
    out_names = _flat_names(
        jax.tree.unflatten(exported.out_tree, list(range(len(exported.out_avals)))), "output"
    )
    outputs = [(n, np.dtype(a.dtype)) for n, a in zip(out_names, exported.out_avals, strict=True)]
    return inputs, outputs


def check_features(export: dict[str, Any]) -> dict[str, np.ndarray]:
    """The check inputs as the model's features: images preprocessed by estimax's recipe."""
    from estimax.export.preprocess import from_spec

    check = export["check"]
    inputs, _ = io_specs(export)
    pre = export["spec"].get("preprocessing")
    if pre:
        recipe = from_spec(pre)
        images = [base64.b64decode(x["b64"]) for x in check["inputs"]]
        ((name, dtype, _),) = inputs
        return {name: np.stack([recipe(b) for b in images]).astype(dtype)}
    stored = check["inputs"]
    if isinstance(stored, dict):  # several inputs, by name
        return {name: np.asarray(stored[name], dtype) for name, dtype, _ in inputs}
    ((name, dtype, _),) = inputs
    return {name: np.asarray(stored, dtype)}


def check_images(export: dict[str, Any]) -> list[bytes]:
    """The encoded check images of an export with preprocessing."""
    return [base64.b64decode(x["b64"]) for x in export["check"]["inputs"]]


def compare(
    got: dict[str, Any],
    export: dict[str, Any],
    atol: float | None,
    what: str,
    error: type[Exception],
    names: Sequence[str] | None = None,
) -> float:
    """Raises ``error`` unless ``got`` matches the recorded outputs (integers equal, floats
    within atol + rtol * |expected|); returns the largest float difference.

    Args:
      atol: None: the export's own check tolerance (``export_check.json``'s atol).
      what: who answered ``got``, for the message ("the SavedModel").
      names: the outputs to compare (default: every recorded one).
    """
    check = export["check"]
    atol = float(check.get("atol", 1e-4)) if atol is None else atol
    rtol = float(check.get("rtol", 0.0))
    worst = 0.0
    for name in names or list(check["expected"]):
        want, have = np.asarray(check["expected"][name]), np.asarray(got[name])
        if want.dtype.kind in "iub":
            rows = (have.reshape(len(have), -1) != want.reshape(len(want), -1)).any(axis=1)
            bad = np.flatnonzero(rows)
            if bad.size:
                raise error(
                    f"{what}'s {name} differ from estimax's for {bad.size} of {len(want)} check "
                    f"inputs (first: #{bad[0]}: {have[bad[0]]} vs {want[bad[0]]}); not published"
                )
            continue
        diff = np.abs(have.astype(np.float64) - want)
        worst = max(worst, float(diff.max()))
        if (diff - rtol * np.abs(want) > atol).any():
            raise error(
                f"{what}'s {name} differ from estimax's by up to {diff.max():.3g} (> atol "
                f"{atol} + rtol {rtol}) on the check inputs; not published"
            )
    return worst
