"""Loading one export directory (a ``jax.export`` artifact) and running it, on any fsspec path.

The on-disk format is the one ``Estimator.export_saved_model`` writes (estimator/export.py):
``model.jaxexport``, ``variables.msgpack``, ``signature.json``. This module reads it with JAX,
flax's msgpack and fsspec only: serving never imports the model's Python code.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from typing import Any

import fsspec
import jax
import numpy as np
from flax import serialization

# The file names of estimator/export.py's format (repeated, not imported, so that serving does
# not load the training stack; tests/test_serving.py loads real exports, which pins them).
MODEL_FILE = "model.jaxexport"
VARIABLES_FILE = "variables.msgpack"
SIGNATURE_FILE = "signature.json"


def is_leaf_spec(x: Any) -> bool:
    """Whether ``x`` is one ``{"shape", "dtype"}`` spec rather than a tree of them."""
    return isinstance(x, dict) and set(x) == {"shape", "dtype"}


def named_specs(tree: Any, single_name: str) -> dict[str, dict]:
    """Flattens a signature's ``inputs``/``outputs`` into ``{name: {"shape", "dtype"}}``.

    A single unnamed tensor gets ``single_name``; nested dicts join their keys with "/".
    """
    if is_leaf_spec(tree):
        return {single_name: tree}
    out: dict[str, dict] = {}

    def walk(prefix: str, node: Any) -> None:
        if is_leaf_spec(node):
            out[prefix] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        else:
            raise ValueError(f"unsupported signature entry {node!r}")

    walk("", tree)
    return out


def _read(
    fs: fsspec.AbstractFileSystem, root: str, export_dir: str, name: str, parse: Callable
) -> Any:
    """``parse(bytes)`` of one file of the export; an error names the file."""
    # A FIFO blocks its reader for ever (it once stopped every later version from loading):
    # refused unopened, as record.check_regular does (the layers keep this module from it).
    kind = fs.info(posixpath.join(root, name)).get("type", "file")
    if kind != "file":
        raise ValueError(
            f"{export_dir}/{name} is not a regular file (a FIFO, device or socket: {kind}); "
            "export the version again"
        )
    with fs.open(posixpath.join(root, name), "rb") as f:
        data = f.read()
    try:
        return parse(bytearray(data) if parse is jax.export.deserialize else data)
    except Exception as e:  # noqa: BLE001 - a damaged file of any kind: say which one
        raise ValueError(
            f"{export_dir}/{name} cannot be read ({type(e).__name__}: {e}); export the "
            "version again"
        ) from e


class ExportedModel:
    """A loaded export: call it with a batch of features to get the predictions.

    The weights are put on the default device once; the computation is compiled once per batch
    size it sees (callers pad to a few sizes, see ``Servable``).
    """

    def __init__(self, export_dir: str):
        """Loads ``export_dir`` (local or any fsspec URL) as written by ``export_saved_model``."""
        fs, root = fsspec.core.url_to_fs(export_dir)
        for name in (MODEL_FILE, VARIABLES_FILE, SIGNATURE_FILE):
            if not fs.exists(posixpath.join(root, name)):
                raise FileNotFoundError(
                    f"{export_dir} is not an estimax export: {name} is missing."
                )
        self._exported = _read(fs, root, export_dir, MODEL_FILE, jax.export.deserialize)
        variables = _read(fs, root, export_dir, VARIABLES_FILE, serialization.msgpack_restore)
        self.signature: dict = _read(fs, root, export_dir, SIGNATURE_FILE, json.loads)
        platform = jax.default_backend()
        platforms = [p.lower() for p in self._exported.platforms]
        if platform not in platforms and not (platform == "gpu" and "cuda" in platforms):
            raise ValueError(
                f"{export_dir} was lowered for {platforms}, not for this machine's "
                f"{platform}: export it again with platforms including {platform!r}."
            )
        self._variables: Any = jax.device_put(variables)
        # None once close()d.
        self._call: Callable[..., Any] | None = jax.jit(self._exported.call)
        self.export_dir = export_dir

    def computed_dtypes(self) -> dict[str, np.dtype]:
        """``{input name: dtype}`` as the model computes each input (names as ``named_specs``):
        the declared dtype, or a narrower one where JAX runs without its 64-bit mode (an int64
        input is computed in int32, a float64 one in float32)."""
        (_, features), _ = jax.tree.unflatten(self._exported.in_tree, self._exported.in_avals)
        flat = jax.tree_util.tree_flatten_with_path(features)[0]
        return {
            "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) or "input": (
                np.dtype(aval.dtype)
            )
            for path, aval in flat
        }

    @property
    def global_step(self) -> int:
        """The training step the exported weights come from."""
        return int(self.signature["global_step"])

    def __call__(self, features: Any) -> Any:
        """Runs the model on a batch: ``features`` as the signature's inputs, any batch size.

        Returns the outputs' pytree as numpy arrays (leading dimension = batch).
        """
        if self._call is None:
            raise RuntimeError(f"{self.export_dir}: this model was closed; load it again")
        features = jax.tree.map(np.asarray, features)
        return jax.device_get(self._call(self._variables, features))

    def close(self) -> None:
        """Releases the device buffers of the weights and the compiled executables."""
        for leaf in jax.tree.leaves(self._variables):
            if isinstance(leaf, jax.Array):
                leaf.delete()
        self._variables = None
        self._call = None


def load(export_dir: str) -> ExportedModel:
    """Loads an export directory written by ``Estimator.export_saved_model``."""
    return ExportedModel(export_dir)
