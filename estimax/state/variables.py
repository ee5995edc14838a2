"""What was trained, by name, as tf.estimator read it: ``Estimator.get_variable_names()`` and
``get_variable_value(name)``.

The names are those warm starts match (``estimax.migrate.assignment``): each variable's Flax
path written as TensorFlow wrote names (``bert/encoder/layer_0/attention/self/query/kernel``,
``ResNet_0/initial_conv/kernel``), plus ``global_step``, as in a TensorFlow checkpoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from estimax.migrate.assignment import model_variables
from estimax.state import checkpoints

__all__ = ["GLOBAL_STEP", "checkpoint_values", "get_variable_names", "get_variable_value"]

GLOBAL_STEP = "global_step"


def _resolve(estimator: Any, checkpoint_path: str | None) -> str:
    """The checkpoint ``checkpoint_path`` names ("best", a step path; None: the newest)."""
    if checkpoint_path is None:
        path = estimator.latest_checkpoint()
        if path is None:
            raise FileNotFoundError(f"No checkpoint in {estimator.model_dir}: train first.")
        return str(path)
    if checkpoint_path == "best":
        best = estimator.best_checkpoint()
        if best is None:
            raise FileNotFoundError(
                f"checkpoint_path='best': no checkpoint of {estimator.model_dir} has a recorded "
                "evaluation yet."
            )
        return str(best)
    return checkpoint_path


def checkpoint_values(estimator: Any, checkpoint_path: str | None = None) -> dict[str, Any]:
    """``{name: numpy value}`` of every variable in a checkpoint (default: the newest), and
    ``global_step``; sorted by name."""
    path = _resolve(estimator, checkpoint_path)
    variables = estimator.get_variables(path)
    _, step = checkpoints.step_from_checkpoint_path(path)
    values: dict[str, Any] = {GLOBAL_STEP: np.asarray(step, np.int64)}
    for name, var in model_variables(variables).items():
        leaf = variables[var.collection]
        for key in var.path:
            leaf = leaf[key]
        values[name] = np.asarray(leaf)
    return dict(sorted(values.items()))


def get_variable_names(estimator: Any, checkpoint_path: str | None = None) -> list[str]:
    """The names of the variables in a checkpoint (default: the newest), sorted."""
    return list(checkpoint_values(estimator, checkpoint_path))


def get_variable_value(estimator: Any, name: str, checkpoint_path: str | None = None) -> Any:
    """The value of variable ``name`` in a checkpoint (default: the newest), as numpy.

    Raises:
      KeyError: no variable of that name (the message names the nearest ones).
    """
    values = checkpoint_values(estimator, checkpoint_path)
    if name not in values:
        import difflib

        near = difflib.get_close_matches(name, list(values), n=3, cutoff=0.5)
        hint = f"; nearest: {', '.join(near)}" if near else ""
        raise KeyError(
            f"no variable {name!r} in the checkpoint ({len(values)} variables: "
            f"get_variable_names() lists them{hint})"
        )
    return values[name]
