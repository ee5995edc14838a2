"""One servable version: an export plus its serving spec (inputs, preprocessing, batch sizes).

``Servable.prepare`` turns request values into the model's features (decoding and preprocessing
images with estimax's eval recipe when the export records one); ``Servable.run`` pads the batch
to one of a few compiled sizes and calls the export. The HTTP server, ``estimax predict`` and
``export_version``'s parity check all go through these two functions.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from estimax.export import artifact
from estimax.export import preprocess as preprocess_lib
from estimax.export import record as record_lib
from estimax.export.record import SERVING_FILE

IMAGE_INPUT = "image_bytes"  # the original's image_serving_input_fn key
DEFAULT_INPUT = "input"  # the name of a single unnamed tensor input


class InvalidInput(ValueError):
    """A request value the model cannot take (wrong shape, dtype, or not an image)."""


class RequestCancelled(Exception):
    """The request was given up (timed out) while its work was under way: the work stops."""


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size`` (inclusive): the shapes compiled ahead."""
    sizes, s = [], 1
    while s < max_batch_size:
        sizes.append(s)
        s *= 2
    return sizes + [max_batch_size]


class Servable:
    """A loaded version: see the module docstring.

    Attributes:
      version: the numeric version (directory name), or None outside a model base path.
      inputs: ``{name: {"shape": [None, ...], "dtype": str}}`` as clients send them
        (``image_bytes`` of dtype ``string`` for raw-image exports).
      outputs: ``{name: {"shape": [None, ...], "dtype": str}}``.
      preprocessing: the recorded ``Preprocessing``, or None (the export takes arrays).
      record: the version's ``serving.json`` (``estimax.export.record``).
      class_names: ``class_names[i]`` names class id ``i``, or None; with them the outputs
        gain ``class_names`` [batch] (the name of ``classes``) and, with ``top_k``,
        ``top_k_class_names`` [batch, k].
    """

    def __init__(
        self,
        path: str,
        version: int | None = None,
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    ):
        """Loads ``path`` (an export directory, local or fsspec URL)."""
        self.path = path
        self.version = version
        self.record = record_lib.read(path)
        self.model = artifact.load(path)
        signature = self.model.signature
        self._model_inputs = artifact.named_specs(signature["inputs"], DEFAULT_INPUT)
        self._computed = self.model.computed_dtypes()
        self._single_input = artifact.is_leaf_spec(signature["inputs"])
        self.outputs = artifact.named_specs(signature["outputs"], "output")
        self._single_output = artifact.is_leaf_spec(signature["outputs"])
        pre = self.record.preprocessing
        self.preprocessing = preprocess_lib.from_spec(pre) if pre else None
        if self.preprocessing is not None:
            (model_input,) = self._model_inputs.values()
            want = (list(model_input["shape"][1:]), np.dtype(model_input["dtype"]))
            got = (list(self.preprocessing.output_shape), self.preprocessing.output_dtype)
            if want != got:
                raise ValueError(
                    f"{path}: preprocessing {self.preprocessing.name} makes "
                    f"{got}, the export takes {want}"
                )
            self.inputs: dict[str, dict[str, Any]] = {
                IMAGE_INPUT: {"shape": [None], "dtype": "string"}
            }
        else:
            self.inputs = self._model_inputs
        self.top_k = self.record.top_k
        if self.top_k is not None:
            probs = self.outputs.get("probabilities")
            if probs is None or len(probs["shape"]) != 2:
                raise ValueError(
                    f"{path}: top_k needs a [batch, classes] output named 'probabilities'"
                )
            self.top_k = min(int(self.top_k), int(probs["shape"][1]))
            self.outputs = {
                **self.outputs,
                "top_k_classes": {"shape": [None, self.top_k], "dtype": "int32"},
                "top_k_probabilities": {"shape": [None, self.top_k], "dtype": probs["dtype"]},
            }
        self.class_names = self._named_outputs(path)
        self.batch_sizes = sorted({int(b) for b in batch_sizes})
        self._in_flight = 0
        self._retired = False
        self._cond = threading.Condition()

    def _named_outputs(self, path: str) -> np.ndarray | None:
        """The record's class names as an array (adds their outputs), or None."""
        if self.record.class_names is None:
            return None
        names = record_lib.check_class_names(
            self.record.class_names, self.outputs, f"{path}/{SERVING_FILE}"
        )
        classes = self.outputs.get("classes")
        if classes is not None and len(classes["shape"]) == 1:
            self.outputs["class_names"] = {"shape": [None], "dtype": "string"}
        if self.top_k is not None:
            self.outputs["top_k_class_names"] = {"shape": [None, self.top_k], "dtype": "string"}
        return np.asarray(names, dtype=np.str_)

    def names_of(self, ids: np.ndarray) -> np.ndarray:
        """The class names of integer class ids (any shape; ``""`` for an unnamed id)."""
        assert self.class_names is not None
        ids = np.asarray(ids)
        known = (ids >= 0) & (ids < len(self.class_names))
        return np.where(known, self.class_names[np.where(known, ids, 0)], "")

    @property
    def global_step(self) -> int:
        """The training step of the exported weights."""
        return self.model.global_step

    # --------------------------------------------------------------------- inputs
    def prepare(
        self,
        columns: dict[str, Any],
        max_pixels: int = 1 << 26,
        cancelled: threading.Event | None = None,
    ) -> dict[str, np.ndarray]:
        """Request values -> the model's features, validated.

        Args:
          columns: ``{input name: batch}``; for a raw-image export ``{"image_bytes": [bytes]}``,
            otherwise arrays (or nested lists) of shape [N, *signature shape].
          max_pixels: images with more pixels are refused before decoding.
          cancelled: once set, decoding stops before the next image (``RequestCancelled``).

        Returns:
          ``{name: [N, ...] array}`` of the export's input dtypes.

        Raises:
          InvalidInput: a missing/unknown input, a wrong shape or dtype, an undecodable image.
          RequestCancelled: ``cancelled`` was set.
        """
        unknown = sorted(set(columns) - set(self.inputs))
        missing = sorted(set(self.inputs) - set(columns))
        if unknown or missing:
            raise InvalidInput(
                f"the model's inputs are {sorted(self.inputs)}; "
                + (f"unknown: {unknown}" if unknown else f"missing: {missing}")
            )
        if self.preprocessing is not None:
            (name,) = self._model_inputs
            return {name: self._images(columns[IMAGE_INPUT], max_pixels, cancelled)}
        features = {}
        sizes = set()
        for name, spec in self._model_inputs.items():
            features[name] = _as_array(name, columns[name], spec, self._computed.get(name))
            sizes.add(features[name].shape[0])
        if len(sizes) != 1:
            raise InvalidInput(f"all inputs must have the same batch size, got {sorted(sizes)}")
        if sizes == {0}:
            raise InvalidInput("the request has no instances")
        return features

    def _images(
        self, column: Any, max_pixels: int, cancelled: threading.Event | None
    ) -> np.ndarray:
        """Encoded images -> the preprocessed batch (``prepare``'s image path)."""
        assert self.preprocessing is not None
        images = []
        for i, data in enumerate(column):
            if cancelled is not None and cancelled.is_set():
                raise RequestCancelled(
                    f"stopped decoding before image {i} of {len(column)}: the request timed out"
                )
            if not isinstance(data, (bytes, bytearray)):
                raise InvalidInput(
                    f"instance {i}: {IMAGE_INPUT} must be encoded image bytes "
                    '(in JSON: {"b64": "<base64 of the JPEG/PNG>"})'
                )
            data = bytes(data)
            try:
                preprocess_lib.check_image_size(data, max_pixels)
                images.append(self.preprocessing(data))
            except ValueError as e:  # ImageDecodeError is a ValueError
                raise InvalidInput(f"instance {i}: {e}") from None
        if not images:
            raise InvalidInput("the request has no instances")
        return np.stack(images)

    # --------------------------------------------------------------------- running
    def run(self, features: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Runs a prepared batch: pads it to a compiled size (chunks past the largest).

        Returns:
          ``{output name: [N, ...] array}``.
        """
        n = next(iter(features.values())).shape[0]
        pieces = []
        start = 0
        for size, m in self.executions(n):
            chunk = {k: v[start : start + m] for k, v in features.items()}
            start += m
            if size != m:  # pad with copies of the first row; the extra outputs are dropped
                chunk = {
                    k: np.concatenate([v, np.repeat(v[:1], size - m, axis=0)])
                    for k, v in chunk.items()
                }
            out = self.model(next(iter(chunk.values())) if self._single_input else chunk)
            out = {"output": out} if self._single_output else _flatten(out)
            pieces.append({k: np.asarray(v)[:m] for k, v in out.items()})
        outputs = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
        if self.top_k is not None:
            # Ties keep the lower class first, as tf.nn.top_k.
            order = np.argsort(-outputs["probabilities"], axis=1, kind="stable")[:, : self.top_k]
            outputs["top_k_classes"] = order.astype(np.int32)
            outputs["top_k_probabilities"] = np.take_along_axis(
                outputs["probabilities"], order, axis=1
            )
        if self.class_names is not None:
            if "class_names" in self.outputs:
                outputs["class_names"] = self.names_of(outputs["classes"])
            if "top_k_classes" in outputs:
                outputs["top_k_class_names"] = self.names_of(outputs["top_k_classes"])
        return outputs

    def executions(self, n: int) -> list[tuple[int, int]]:
        """How ``run`` computes ``n`` instances: ``(compiled batch size, instances)`` per call.

        Chunks of the largest compiled size, the last padded up to the next compiled size.
        """
        largest = self.batch_sizes[-1]
        out = []
        for start in range(0, n, largest):
            m = min(largest, n - start)
            out.append((next(b for b in self.batch_sizes if b >= m), m))
        return out

    def warm(self) -> None:
        """Compiles the export for every batch size it will be called with."""
        for size in self.batch_sizes:
            self.run(
                {
                    name: np.zeros((size, *spec["shape"][1:]), spec["dtype"])
                    for name, spec in self._model_inputs.items()
                }
            )

    def predict_images(self, images: Sequence[bytes]) -> dict[str, np.ndarray]:
        """prepare + run for a list of encoded images (``estimax predict``, the parity check)."""
        return self.run(self.prepare({IMAGE_INPUT: list(images)}))

    # --------------------------------------------------------------------- lifetime
    def acquire(self) -> bool:
        """Marks one request in flight; False if the version has been unloaded."""
        with self._cond:
            if self._retired:
                return False
            self._in_flight += 1
            return True

    def release(self) -> None:
        """Ends a request started with ``acquire``."""
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Waits at most ``timeout`` seconds for the requests in flight to end; whether they
        have (model control's bounded unload, ``estimax.serving.control``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    def retire(self) -> None:
        """Refuses new requests, waits for those in flight, then frees the device memory."""
        with self._cond:
            self._retired = True
            self._cond.wait_for(lambda: self._in_flight == 0)
        self.model.close()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _as_array(name: str, value: Any, spec: dict, computed: np.dtype | None = None) -> np.ndarray:
    """``value`` as the input ``name`` of dtype ``spec["dtype"]``; ``computed``: the (narrower)
    integer dtype the model computes it in, whose range the values must fit too."""
    dtype = np.dtype(spec["dtype"])
    try:
        array = np.asarray(value)
    except ValueError:
        raise InvalidInput(
            f"input {name!r} is a ragged list; all instances need the shape {spec['shape'][1:]}"
        ) from None
    if array.dtype == object or array.dtype.kind in "SUV":
        raise InvalidInput(f"input {name!r} must be numbers of dtype {dtype.name}")
    want = tuple(spec["shape"][1:])
    if tuple(array.shape[1:]) != want:
        raise InvalidInput(
            f"input {name!r} has shape {list(array.shape)}; the model takes "
            f"[batch, {', '.join(map(str, want))}]"
            if want
            else f"input {name!r} has shape {list(array.shape)}; the model takes [batch]"
        )
    if dtype.kind in "iu" and array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or not np.all(array == np.round(array)):
            raise InvalidInput(f"input {name!r} must be integers ({dtype.name}), got floats")
    if dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInput(
                f"input {name!r} has values outside {dtype.name}'s range [{info.min}, {info.max}]"
            )
    if computed is not None and computed.kind in "iu" and computed != dtype and array.size:
        # JAX without its 64-bit mode computes an int64 input in int32: a larger value would
        # wrap to another id without a word.
        info = np.iinfo(computed)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInput(
                f"input {name!r} has values outside [{info.min}, {info.max}]: the model computes "
                f"this {dtype.name} input in {computed.name} (JAX without its 64-bit mode)"
            )
    if dtype.kind == "b" and array.dtype.kind != "b":
        raise InvalidInput(f"input {name!r} must be booleans")
    return array.astype(dtype)
