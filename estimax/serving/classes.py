"""Class names in answers: TF Serving's classify API and the v2 classification extension.

An export that records class names (``estimax.export.record``) answers them three ways, on
every protocol:

* its outputs gain ``class_names`` (and ``top_k_class_names``), strings beside the ids
  (``Servable.run``): TF Serving's ``predict``, v2's ``infer``, their gRPC twins;
* TF Serving's ``classify`` (REST ``:classify``, gRPC ``Classify``): ``tf.Example``-style
  inputs in, ``[label, score]`` pairs out, one per class in id order, as TF Serving answers a
  classification signature (label ``""`` for an id without a name, or an export without names);
* the Open Inference Protocol's classification extension (Triton's
  ``extension_classification.md``): an output requested with ``parameters: {"classification":
  k}`` is answered as BYTES ``[batch, k]`` of ``"value:index[:label]"``, the k highest values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from estimax.export.servable import IMAGE_INPUT, Servable
from estimax.serving.protocol import ApiError, echo_names

SCORES = "probabilities"  # the output classify answers from ([batch, classes])


def check_classify(servable: Servable) -> None:
    """400 unless the export can be classified (a [batch, classes] ``probabilities`` output)."""
    spec = servable.outputs.get(SCORES)
    if spec is None or len(spec["shape"]) != 2:
        raise ApiError(
            400,
            f"classify needs a [batch, classes] '{SCORES}' output; this model's outputs are "
            f"{sorted(servable.outputs)}: use predict",
        )


def classify_results(servable: Servable, outputs: dict[str, np.ndarray]) -> list[list[tuple]]:
    """Per instance, ``(label, score)`` for every class id in order (TF Serving's classify)."""
    scores = np.asarray(outputs[SCORES], np.float64)
    labels = (
        servable.class_names.tolist()
        if servable.class_names is not None
        else [""] * scores.shape[1]
    )
    return [list(zip(labels, row.tolist(), strict=True)) for row in scores]


def example_columns(servable: Servable, examples: Sequence[dict[str, list]]) -> dict[str, Any]:
    """``tf.Example``-style instances (``{feature: [values]}``) -> the model's input columns.

    An image export takes one ``image_bytes`` value per example; an array input its values
    flattened (row-major), as many as the input's shape holds.
    """
    if not examples:
        raise ApiError(400, "classify needs at least one example")
    names = sorted(servable.inputs)
    columns: dict[str, list] = {n: [] for n in names}
    for i, example in enumerate(examples):
        if sorted(example) != names:
            raise ApiError(
                400, f"example {i}: features {echo_names(example)}; the model's inputs are {names}"
            )
        for name in names:
            columns[name].append(_feature(servable, name, example[name], f"example {i}"))
    return columns


def _feature(servable: Servable, name: str, values: list, where: str) -> Any:
    spec = servable.inputs[name]
    if name == IMAGE_INPUT and servable.preprocessing is not None:
        if len(values) != 1 or not isinstance(values[0], (bytes, bytearray)):
            raise ApiError(400, f"{where}: {IMAGE_INPUT} must be one bytes value (the image)")
        return values[0]
    shape = [int(d) for d in spec["shape"][1:]]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ApiError(400, f"{where}: feature {name!r} must hold numbers")
    if len(values) != int(np.prod(shape)):
        raise ApiError(
            400,
            f"{where}: feature {name!r} has {len(values)} values; input {name!r} of shape "
            f"{shape} needs {int(np.prod(shape))}",
        )
    return np.asarray(values).reshape(shape)


def classification_k(value: Any, where: str) -> int:
    """The ``classification`` parameter's class count (400 unless an integer >= 1)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"{where}: classification must be an integer >= 1, got {value!r}")
    return value


def classification(array: np.ndarray, k: int, servable: Servable, name: str) -> np.ndarray:
    """The classification extension's answer for one output: ``[batch, min(k, classes)]``.

    Strings ``"value:index"`` (``":label"`` added when the export names the classes and the
    output has one value per class); values are written as Triton does (C++'s
    ``std::to_string``: six decimals for floats).
    """
    if array.dtype.kind not in "biuf" or array.ndim < 1:
        raise ApiError(400, f"output {name!r}: classification needs a numeric output")
    rows = array.reshape(len(array), -1)
    k = min(k, rows.shape[1])
    # Highest first; ties keep the lower index first (a stable sort).
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    values = np.take_along_axis(rows, order, axis=1)
    names = servable.class_names
    labelled = names is not None and rows.shape[1] == len(names)
    out = np.empty(order.shape, dtype=object)
    for i, j in np.ndindex(order.shape):
        v = values[i, j]
        text = f"{v:f}" if rows.dtype.kind == "f" else str(int(v))
        text += f":{order[i, j]}"
        if labelled:
            assert names is not None
            text += f":{names[order[i, j]]}"
        out[i, j] = text
    return out.astype(np.str_)
