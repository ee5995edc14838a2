"""The original's exporters: ``BestExporter``, ``LatestExporter``, ``FinalExporter``.

``EvalSpec(exporters=[...])`` runs them after each of that spec's evaluations in
``train_and_evaluate``, as ``tf.estimator`` did. Each publishes estimax exports (numbered
versions that ``estimax serve`` hot-loads, through ``export_version``) under
``model_dir/export/<name>/``.

What survives a kill: nothing is kept in memory. Which evaluation is the best is derived from
the evaluations recorded in the watched eval directory (``evaluations.json``); which step each
version holds is in its ``signature.json``. So an exporter that runs again after a restart (or
for an evaluation that was recorded just before a kill) exports exactly what is missing, and
running a finished job again publishes nothing new.

| the original                                   | estimax                                        |
|------------------------------------------------|------------------------------------------------|
| ``BestExporter(name, serving_input_receiver_fn,| the same; or ``metric=``, ``mode=`` instead of |
| compare_fn=_loss_smaller, exports_to_keep=5)`` | ``compare_fn``; ``export_version``'s arguments |
|                                                | (``preprocessing=``, ``check_inputs=`` ...) as |
|                                                | keywords                                       |
| ``event_file_pattern='eval/*.tfevents.*'``     | the EvalSpec's own ``evaluations.json``        |
| ``LatestExporter(name, ..., exports_to_keep)`` | the same                                       |
| ``FinalExporter(name, ...)``                   | the same; "final" also after an early stop     |
| export dir ``<timestamp>``                     | version ``1, 2, ...`` (TF Serving's layout)    |
"""

from __future__ import annotations

import inspect
import posixpath
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import fsspec
from absl import logging

from estimax import storage
from estimax.estimator import best as best_lib
from estimax.estimator import summaries
from estimax.export import artifact, publish, versions
from estimax.state import checkpoints as ckpt_lib

if TYPE_CHECKING:
    from estimax.estimator.estimator import Estimator

_EXPORT_ARGS = frozenset(inspect.signature(publish.export_version).parameters) - {
    "estimator",
    "model_base_path",
    "serving_input",
    "checkpoint_path",
}


def _loss_smaller(
    best_eval_result: Mapping[str, Any], current_eval_result: Mapping[str, Any]
) -> bool:
    """The original's default ``compare_fn``: the current evaluation's loss is smaller."""
    return best_lib.compare_by("loss", "min", "BestExporter")(best_eval_result, current_eval_result)


class Exporter:
    """An exporter for ``EvalSpec(exporters=...)``: the original's ``tf.estimator.Exporter``.

    Subclasses implement ``export``. estimax adds ``watch(eval_dir)``: ``train_and_evaluate``
    names the directory of the evaluations the exporter follows before each ``export``.

    Args:
      name: the export directory's name: ``model_dir/export/<name>/``.
      serving_input_receiver_fn: returns the export's input ``TensorSpec`` (or a dict of them);
        or None with ``preprocessing=`` (raw-image exports).
      export_args: ``export_version``'s keyword arguments (``preprocessing``, ``check_inputs``,
        ``top_k``, ``eval_preprocess``, ``platforms``...).
    """

    def __init__(
        self,
        name: str,
        serving_input_receiver_fn: Callable[[], Any] | None,
        export_args: Mapping[str, Any],
    ):
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"exporter name {name!r}: a plain directory name is needed.")
        unknown = sorted(set(export_args) - _EXPORT_ARGS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}({name!r}): unknown argument(s) {unknown}; it takes "
                f"export_version's {sorted(_EXPORT_ARGS)}."
            )
        if serving_input_receiver_fn is None and export_args.get("preprocessing") is None:
            raise ValueError(
                f"{type(self).__name__}({name!r}) needs serving_input_receiver_fn (returning a "
                "TensorSpec) or preprocessing= (e.g. estimax.export.resnet_eval(224))."
            )
        self.name = name
        self._serving_input_receiver_fn = serving_input_receiver_fn
        self._export_args = dict(export_args)
        self.eval_dir: str | None = None
        self.exports_to_keep: int | None = None  # all

    def watch(self, eval_dir: str) -> None:
        """estimax addition: the directory whose recorded evaluations this exporter follows."""
        self.eval_dir = eval_dir

    def export(
        self,
        estimator: Estimator,
        export_path: str,
        checkpoint_path: str,
        eval_result: Mapping[str, Any],
        is_the_final_export: bool,
    ) -> str | None:
        """Exports (or not) after an evaluation; returns the published version's path or None.

        Args:
          estimator: the Estimator being trained.
          export_path: ``model_dir/export/<name>``.
          checkpoint_path: the evaluated checkpoint.
          eval_result: its evaluation's results.
          is_the_final_export: this is the evaluation after training ended (max_steps
            reached, or stopped early).
        """
        step = _step_of(checkpoint_path)
        chosen = self.choose(
            step, dict(eval_result), is_the_final_export, exported_steps(export_path)
        )
        if chosen is None:
            return None
        source = ckpt_lib.step_path(ckpt_lib.step_from_checkpoint_path(checkpoint_path)[0], chosen)
        if not storage.exists(source):
            logging.warning(
                "%s: checkpoint %s no longer exists: it was not exported. Keep the best one with "
                "RunConfig(keep_best_checkpoint=BestCheckpoint(...)).",
                type(self).__name__,
                source,
            )
            return None
        serving_input = (
            self._serving_input_receiver_fn() if self._serving_input_receiver_fn else None
        )
        path = publish.export_version(
            estimator, export_path, serving_input, checkpoint_path=source, **self._export_args
        )
        _keep_newest(export_path, self.exports_to_keep)
        return path

    def choose(
        self, step: int, eval_result: dict[str, Any], final: bool, published: dict[int, int]
    ) -> int | None:
        """The step of the checkpoint to publish now, or None.

        Args:
          step: the evaluated checkpoint's.
          eval_result: its results.
          final: whether training has ended.
          published: ``{version: step}`` of what is published already.
        """
        raise NotImplementedError


def exported_steps(export_path: str) -> dict[int, int]:
    """``{version: global step}`` of the versions published under ``export_path``."""
    fs, root = fsspec.core.url_to_fs(export_path)
    if not fs.isdir(root):
        return {}
    found = {}
    for version in versions.list_versions(export_path):
        path = posixpath.join(root, str(version), artifact.SIGNATURE_FILE)
        try:
            with fs.open(path, "rb") as f:
                found[version] = int(storage.load_json(f.read())["global_step"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            logging.warning("Export %s/%d has no readable step (%s).", export_path, version, e)
    return found


def _keep_newest(export_path: str, exports_to_keep: int | None) -> None:
    """Deletes all but the newest ``exports_to_keep`` versions (the original's GC)."""
    if exports_to_keep is None:
        return
    fs, root = fsspec.core.url_to_fs(export_path)
    for version in versions.list_versions(export_path)[:-exports_to_keep]:
        path = posixpath.join(root, str(version))
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError as e:
            logging.warning("Can not delete %s: %s", path, e)


def _check_keep(exports_to_keep: int | None) -> None:
    if exports_to_keep is not None and exports_to_keep <= 0:
        raise ValueError(
            f"exports_to_keep, if given, must be a positive number (None keeps all); got "
            f"{exports_to_keep}."
        )


def _step_of(checkpoint_path: str) -> int:
    return ckpt_lib.step_from_checkpoint_path(checkpoint_path)[1]


class BestExporter(Exporter):
    """Exports the checkpoint each time an evaluation is the best so far.

    Best by ``compare_fn(best_eval_result, current_eval_result)`` (the original's; default:
    smaller ``loss``), or by ``metric`` and ``mode`` (``"min"``/``"max"``). The best so far is
    that of the evaluations recorded in the watched eval directory, so after a restart the
    exporter compares against the same best, and an export missed by a kill (the evaluation was
    recorded, the export not yet published) is made at the next export call, from the best
    checkpoint (keep it with ``RunConfig(keep_best_checkpoint=BestCheckpoint(...))``).

    Args:
      name: ``model_dir/export/<name>/``.
      serving_input_receiver_fn: returns the export's input ``TensorSpec``(s).
      compare_fn: ``(best_eval_result, current_eval_result) -> bool``, True if current is better.
      exports_to_keep: how many of the newest (best) versions to keep; None keeps all.
      metric, mode: instead of ``compare_fn``: e.g. ``metric="accuracy", mode="max"``.
      **export_args: ``export_version``'s keyword arguments (``preprocessing``,
        ``check_inputs``, ``top_k``, ``eval_preprocess``, ``platforms``...).
    """

    def __init__(
        self,
        name: str = "best_exporter",
        serving_input_receiver_fn: Callable[[], Any] | None = None,
        compare_fn: Callable[..., bool] | None = None,
        exports_to_keep: int | None = 5,
        *,
        metric: str | None = None,
        mode: str = "min",
        **export_args: Any,
    ):
        super().__init__(name, serving_input_receiver_fn, export_args)
        if compare_fn is not None and metric is not None:
            raise ValueError(f"BestExporter({name!r}): give compare_fn or metric=, not both.")
        if metric is not None:
            compare_fn = best_lib.compare_by(metric, mode, f"BestExporter({name!r})")
        self._compare = compare_fn or _loss_smaller
        _check_keep(exports_to_keep)
        self.exports_to_keep = exports_to_keep

    def choose(
        self, step: int, eval_result: dict[str, Any], final: bool, published: dict[int, int]
    ) -> int | None:
        found = summaries.read_evaluations(self.eval_dir) if self.eval_dir else None
        recorded = dict(found.evaluations) if found else {}
        if found and found.damage and published and published[max(published)] not in recorded:
            # What the published version scored is known only from the damaged record: a
            # version is not replaced on the word of a record that cannot be verified.
            logging.warning(
                "%s: not exporting step %d: the evaluations in %s are damaged (%s) and the "
                "event files there do not hold step %d's, which version %d serves; delete "
                "that version to publish the best of the evaluations that can be verified.",
                type(self).__name__,
                step,
                self.eval_dir,
                found.damage,
                published[max(published)],
                max(published),
            )
            return None
        recorded.setdefault(step, eval_result)
        best = best_lib.best_of(recorded, self._compare)
        assert best is not None  # this evaluation is among them
        if published and published[max(published)] == best[0]:
            return None  # the best is published already (a redone call, or not better)
        shown = {k: v for k, v in best[1].items() if not isinstance(v, list)}
        logging.info("Exporting the best model so far (step %d: %s).", best[0], shown)
        return best[0]


class LatestExporter(Exporter):
    """Exports every evaluated checkpoint, keeping the ``exports_to_keep`` newest versions.

    A checkpoint already published (the newest version holds its step) is not published again.
    """

    def __init__(
        self,
        name: str,
        serving_input_receiver_fn: Callable[[], Any] | None = None,
        exports_to_keep: int | None = 5,
        **export_args: Any,
    ):
        super().__init__(name, serving_input_receiver_fn, export_args)
        _check_keep(exports_to_keep)
        self.exports_to_keep = exports_to_keep

    def choose(
        self, step: int, eval_result: dict[str, Any], final: bool, published: dict[int, int]
    ) -> int | None:
        return None if published and published[max(published)] >= step else step


class FinalExporter(Exporter):
    """Exports once, after the evaluation that ends training (at ``max_steps``, or after an
    early stop: the original exported only at ``max_steps``)."""

    def __init__(
        self,
        name: str,
        serving_input_receiver_fn: Callable[[], Any] | None = None,
        **export_args: Any,
    ):
        super().__init__(name, serving_input_receiver_fn, export_args)

    def choose(
        self, step: int, eval_result: dict[str, Any], final: bool, published: dict[int, int]
    ) -> int | None:
        if not final or step in published.values():
            return None
        logging.info("Performing the final export in the end of training.")
        return step
