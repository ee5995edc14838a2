"""Serving exported models: load an export directory and run it, without the model's code."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import serialization

from estimax.estimator.export import MODEL_FILE, SIGNATURE_FILE, VARIABLES_FILE


class ExportedModel:
    """A loaded export: call it with a batch of features to get the predictions."""

    def __init__(self, export_dir: str):
        """Loads ``export_dir`` as written by ``Estimator.export_saved_model``."""
        for name in (MODEL_FILE, VARIABLES_FILE, SIGNATURE_FILE):
            if not os.path.exists(os.path.join(export_dir, name)):
                raise FileNotFoundError(
                    f"{export_dir} is not an estimax export: {name} is missing.")
        with open(os.path.join(export_dir, MODEL_FILE), "rb") as f:
            self._exported = jax.export.deserialize(bytearray(f.read()))
        with open(os.path.join(export_dir, VARIABLES_FILE), "rb") as f:
            self._variables = serialization.msgpack_restore(f.read())
        with open(os.path.join(export_dir, SIGNATURE_FILE)) as f:
            self.signature: dict = json.load(f)
        self.export_dir = export_dir

    @property
    def global_step(self) -> int:
        """The training step the exported weights come from."""
        return int(self.signature["global_step"])

    def __call__(self, features: Any) -> Any:
        """Runs the model on a batch: ``features`` as the signature's inputs, any batch size."""
        features = jax.tree.map(np.asarray, features)
        outputs = self._exported.call(self._variables, features)
        return jax.device_get(outputs)


def load(export_dir: str) -> ExportedModel:
    """Loads an export directory written by ``Estimator.export_saved_model``."""
    return ExportedModel(export_dir)
