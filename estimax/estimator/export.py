"""Export for serving: the PREDICT computation as a ``jax.export`` (StableHLO) artifact.

An export directory holds ``model.jaxexport`` (the serialized computation, batch dimension
symbolic, lowered for several platforms), ``variables.msgpack`` (the weights it takes) and
``signature.json`` (input and output names, shapes, dtypes, the global step). Serving it needs
JAX, not the model's Python code (``estimax.export.load``).

This module is a leaf: it receives the function to serve, its variables and its input specs
(``Estimator.export_saved_model`` gathers them) and knows nothing of the Estimator.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import serialization

from estimax import storage
from estimax.ops.native import native_kernels

DEFAULT_PLATFORMS = ("cpu", "cuda", "tpu")
MODEL_FILE = "model.jaxexport"
VARIABLES_FILE = "variables.msgpack"
SIGNATURE_FILE = "signature.json"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one serving input; ``shape[0]`` is None (the batch).

    Example: ``TensorSpec((None, 28, 28), np.uint8)``.
    """

    shape: tuple[int | None, ...]
    dtype: Any
    name: str | None = None


def _is_spec(x: Any) -> bool:
    return isinstance(x, TensorSpec)


def _describe(tree: Any) -> Any:
    return jax.tree.map(
        lambda s: {"shape": list(s.shape), "dtype": str(np.dtype(s.dtype))},
        tree,
        is_leaf=lambda x: isinstance(x, (TensorSpec, jax.ShapeDtypeStruct)),
    )


def check_input_specs(spec_tree: Any) -> None:
    """Raises unless ``spec_tree`` is a TensorSpec pytree with only the batch dimension None."""
    leaves = jax.tree.leaves(spec_tree, is_leaf=_is_spec)
    if not leaves or not all(_is_spec(s) for s in leaves):
        raise TypeError(
            "serving_input_receiver_fn must return a TensorSpec or a dict of them, "
            f"got {spec_tree!r}."
        )
    for s in leaves:
        if not s.shape or s.shape[0] is not None or any(d is None for d in s.shape[1:]):
            raise ValueError(
                f"Serving input {s} must have shape (None, d1, d2, ...): only the "
                "batch dimension may be None."
            )


def example_batch(spec_tree: Any) -> Any:
    """A batch of one zero example per input of ``spec_tree`` (``[1, d1, ...]`` arrays)."""
    return jax.tree.map(lambda s: np.zeros((1, *s.shape[1:]), s.dtype), spec_tree, is_leaf=_is_spec)


def export_saved_model(
    export_dir_base: str,
    apply_fn: Callable[[Any, Any], Any],
    variables: Any,
    input_specs: Any,
    global_step: int,
    platforms: tuple[str, ...] | None = None,
) -> str:
    """Writes ``export_dir_base/<timestamp>/`` and returns its path (see module docstring).

    Args:
      export_dir_base: parent directory of the timestamped export.
      apply_fn: ``apply_fn(variables, features) -> outputs`` (an array or a dict of them), the
        computation to serve; traced with a symbolic batch dimension.
      variables: the weights ``apply_fn`` takes (a pytree of arrays; written as msgpack).
      input_specs: a ``TensorSpec`` pytree, ``shape[0]`` None (the batch).
      global_step: the training step the variables are from (recorded in the signature).
      platforms: platforms to lower for (default: cpu, cuda and tpu).
    """
    check_input_specs(input_specs)
    spec_tree, step, variables = input_specs, int(global_step), jax.device_get(variables)
    (batch,) = jax.export.symbolic_shape("batch")
    feature_specs = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((batch, *s.shape[1:]), s.dtype), spec_tree, is_leaf=_is_spec
    )
    variable_specs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), variables
    )
    platforms = tuple(platforms or DEFAULT_PLATFORMS)
    # Traced without estimax's oneDNN kernels: the artifact must run where that library is
    # not built (its CPU lowering then uses XLA's own convolutions).
    with native_kernels(False):
        exported = jax.export.export(jax.jit(apply_fn), platforms=platforms)(
            variable_specs, feature_specs
        )
    final = _new_export_dir(export_dir_base)
    staging = storage.staging_dir(final)  # local: final + ".tmp"; gs://, s3://: a local temp dir
    try:
        _write_files(staging, exported, variables, spec_tree, step, platforms)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)  # never a partial export, even on a full disk
        raise storage.StorageError(
            e.errno,
            f"Could not write the export {final}: {e.strerror or e}"
            + (
                " (the disk is full or a file size limit was reached)"
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
                else ""
            )
            + ". Nothing was published; earlier exports are intact.",
        ) from e
    # The directory appears under its final name only when complete (object stores: the
    # signature is uploaded last, so a loader waiting for it never reads half an export).
    storage.publish_dir(staging, final, last=SIGNATURE_FILE)
    logging.info("Exported the model at step %d to %s", step, final)
    return final


def _new_export_dir(export_dir_base: str) -> str:
    """``export_dir_base/<unix time>``, the first such name not taken."""
    timestamp = int(time.time())
    while storage.exists(storage.join(export_dir_base, str(timestamp))):
        timestamp += 1
    return storage.join(export_dir_base, str(timestamp))


def _write_files(
    staging: str,
    exported: Any,
    variables: Any,
    spec_tree: Any,
    step: int,
    platforms: tuple[str, ...],
) -> None:
    """Writes the model, variables and signature files of an export into ``staging``."""
    with open(os.path.join(staging, MODEL_FILE), "wb") as f:
        f.write(exported.serialize())
    with open(os.path.join(staging, VARIABLES_FILE), "wb") as f:
        f.write(serialization.msgpack_serialize(jax.tree.map(np.asarray, variables)))
    signature = {
        "format": "estimax.jax_export/1",
        "global_step": int(step),
        "platforms": list(platforms),
        "inputs": _describe(spec_tree),
        "outputs": jax.tree.unflatten(
            exported.out_tree,
            [
                {
                    "shape": [d if isinstance(d, int) else None for d in a.shape],
                    "dtype": str(np.dtype(a.dtype)),
                }
                for a in exported.out_avals
            ],
        ),
    }
    with open(os.path.join(staging, SIGNATURE_FILE), "w") as f:
        json.dump(signature, f, indent=2)
