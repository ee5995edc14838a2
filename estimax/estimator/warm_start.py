"""Warm starts, as tf.estimator had them: a new run's variables from another model's checkpoint.

``Estimator(warm_start_from=PATH or WarmStartSettings(...))`` (and ``--warm_start_from`` on the
programs) calls ``warm_start`` once, on the freshly initialised state, and only when its
model_dir has no checkpoint of its own (a resumed run continues from its own).

The source is a TensorFlow checkpoint of the original models (a model_dir with a ``checkpoint``
file, a ``model.ckpt-N`` prefix or its ``.index``; the names are mapped by
``estimax.models.TF_NAMES``) or an estimax model_dir or ``<model_dir>/checkpoints/<step>``
(variables matched by path). Weights and batch-norm statistics are loaded; the optimizer state
and the step start fresh (as tf.estimator's warm start); an EMA starts from the loaded weights.
A variable of another shape (a new head: another ``--num_label_classes``), or one the source
lacks, keeps its initial value; everything loaded and not loaded is logged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from estimax import models, storage
from estimax.migrate.load import MappingError, copy_tree, load_tf_state, model_scope, set_path
from estimax.migrate.names import Entry, TFNames
from estimax.migrate.tf_checkpoint import TFCheckpointError, resolve_checkpoint

__all__ = ["WarmStartReport", "WarmStartSettings", "warm_start"]


@dataclasses.dataclass(frozen=True)
class WarmStartSettings:
    """What to warm-start from (``tf.estimator.WarmStartSettings``' first two arguments).

    Attributes:
      ckpt_to_initialize_from: a TensorFlow checkpoint (model_dir, prefix or ``.index``) or
        an estimax model_dir or ``<model_dir>/checkpoints/<step>``; local, gs:// or s3://.
      vars_to_warm_start: a regular expression, or a list of them, matched (``re.match``)
        against each variable's estimax name (``params/ResNet_0/final_dense/kernel``) and,
        for a TensorFlow source, its TensorFlow name (``dense/kernel``); ``".*"``: all.
    """

    ckpt_to_initialize_from: str
    vars_to_warm_start: str | Sequence[str] = ".*"

    def wants(self, *names: str) -> bool:
        """True if any of ``names`` matches one of ``vars_to_warm_start``."""
        patterns = (
            [self.vars_to_warm_start]
            if isinstance(self.vars_to_warm_start, str)
            else list(self.vars_to_warm_start)
        )
        return any(re.match(p, n) for p in patterns for n in names)


@dataclasses.dataclass
class WarmStartReport:
    """What a warm start loaded (``loaded``) and kept as initialised (``fresh``), by name."""

    source: str
    loaded: list[str] = dataclasses.field(default_factory=list)
    fresh: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """The log lines: counts, then each variable not loaded and why."""
        lines = [
            f"Warm-started from {self.source}: {len(self.loaded)} variables loaded, "
            f"{len(self.fresh)} initialised fresh."
        ]
        lines += [f"  initialised fresh (other shape): {m}" for m in self.mismatched]
        lines += [f"  initialised fresh: {f}" for f in self.fresh if f not in self.mismatched]
        return "\n".join(lines)


def _as_settings(source: str | WarmStartSettings) -> WarmStartSettings:
    return source if isinstance(source, WarmStartSettings) else WarmStartSettings(str(source))


def _host(tree: Any) -> Any:
    """Host copies of (replicated) arrays: one addressable shard holds the whole value."""

    def one(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _like(new: Any, old: Any) -> Any:
    """``new`` (numpy) placed as ``old`` is (its sharding), leaf by leaf."""

    def put(n: Any, o: Any) -> Any:
        if isinstance(o, jax.Array):
            n = np.asarray(n, dtype=o.dtype)
            return jax.make_array_from_callback(o.shape, o.sharding, lambda idx: n[idx])
        return n

    return jax.tree.map(put, new, old)


def _is_tf_checkpoint(path: str) -> bool:
    try:
        resolve_checkpoint(path)
    except TFCheckpointError:
        return False
    return True


def _estimax_variables(path: str) -> tuple[dict[str, Any], str]:
    """The variables (``{"params": ..., <collection>: ...}``) of an estimax checkpoint at
    ``path``, and the checkpoint's directory."""
    from estimax.estimator import checkpoints

    path = path.rstrip("/")
    try:
        model_dir, step = checkpoints.step_from_checkpoint_path(path)
    except ValueError:
        model_dir, step = path, None
    checkpointer = checkpoints.Checkpointer(model_dir, keep_checkpoint_max=None, read_only=True)
    try:
        if step is None:
            step = checkpointer.latest_step()
        if step is None:
            raise TFCheckpointError(
                f"--warm_start_from={path}: neither a TensorFlow checkpoint ('checkpoint' file or "
                "model.ckpt-N.index) nor an estimax model_dir with checkpoints"
            )
        model = checkpointer.restore_numpy(step, checkpoints.MODEL_ITEM)
    finally:
        checkpointer.close()
    return checkpoints.variables_of(model), checkpointer.step_dir(step)


def _flat(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def _tf_model(params: Mapping[str, Any]) -> TFNames | None:
    """The TensorFlow names of the one mapped network found in ``params`` (None: none is)."""
    for names in models.TF_NAMES:
        try:
            model_scope(params, names)
        except MappingError:
            continue
        return names
    return None


def _from_tf(
    settings: WarmStartSettings, variables: dict[str, Any], report: WarmStartReport
) -> dict[str, Any]:
    """``variables`` with a TensorFlow checkpoint's tensors in, by the network's name map."""
    path = settings.ckpt_to_initialize_from
    model = _tf_model(variables["params"])
    if model is None:
        raise TFCheckpointError(
            f"--warm_start_from={path} is a TensorFlow checkpoint, but the model is none of "
            f"those whose TensorFlow names estimax maps "
            f"({', '.join(n.name for n in models.TF_NAMES)})"
        )

    def excluded(entry: Entry) -> bool:
        return not settings.wants(entry.flax_name, entry.tf_name)

    loaded, _, _, tf_report = load_tf_state(
        path,
        model,
        variables,
        optimizer_state=False,
        ema=False,
        allow_missing=True,
        allow_mismatch=True,
        allow_unmapped=True,
        fresh=excluded,
    )
    report.source = tf_report.checkpoint
    report.loaded = list(tf_report.loaded)
    report.fresh = list(tf_report.fresh)
    report.mismatched = [f for f, _, _, _ in tf_report.mismatched]
    return loaded


def _from_estimax(
    settings: WarmStartSettings, variables: dict[str, Any], report: WarmStartReport
) -> dict[str, Any]:
    """``variables`` with an estimax checkpoint's variables in, matched by path and shape."""
    saved, report.source = _estimax_variables(settings.ckpt_to_initialize_from)
    source_vars = _flat(saved)
    loaded = copy_tree(variables)
    for key, ours in _flat(variables).items():
        name = "/".join(key)
        theirs = source_vars.get(key)
        if not settings.wants(name) or theirs is None:
            report.fresh.append(name)
        elif np.shape(theirs) != np.shape(ours):
            report.fresh.append(name)
            report.mismatched.append(name)
        else:
            set_path(loaded, key, np.asarray(theirs, dtype=np.asarray(ours).dtype))
            report.loaded.append(name)
    return loaded


def warm_start(source: str | WarmStartSettings, state: Any) -> tuple[Any, WarmStartReport]:
    """Returns ``state`` (a fresh ``TrainState``) with the source's variables in, and a report.

    Raises:
      TFCheckpointError: the source is neither a TensorFlow nor an estimax checkpoint, or its
        network is not one estimax maps (for a TensorFlow source).
    """
    settings = _as_settings(source)
    path = settings.ckpt_to_initialize_from
    storage.configure()
    variables = _host({"params": state.params, **state.model_state})
    report = WarmStartReport(source=path)
    if _is_tf_checkpoint(path):
        loaded = _from_tf(settings, variables, report)
    else:
        loaded = _from_estimax(settings, variables, report)
    params = loaded.pop("params")
    new_state = state.replace(
        params=_like(params, state.params),
        model_state=_like(loaded, state.model_state),
        ema_params=_like(params, state.ema_params) if state.ema_params else state.ema_params,
    )
    for line in report.summary().splitlines():
        logging.info("%s", line)
    return new_state, report
