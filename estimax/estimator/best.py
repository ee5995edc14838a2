"""The best model: which recorded evaluation is the best, and the early-stopping decision.

Everything here is derived from what ``model_dir`` holds, never from a process's memory, so a
job killed and started again sees the same best checkpoint, the same best export and the same
decision to stop:

| fact                               | where it is recorded                  | who reads it       |
|------------------------------------|---------------------------------------|--------------------|
| each evaluation's results          | ``<eval dir>/evaluations.json``       | ``best_of``        |
| the best checkpoint (kept)         | derived: ``best_of`` over those       | ``KeepBest``,      |
|                                    |                                       | ``checkpoint_path= |
|                                    |                                       | "best"``           |
| the best export                    | derived the same way; each export's   | ``BestExporter``   |
|                                    | ``signature.json`` names its step     |                    |
| training stopped early (and why)   | ``model_dir/early_stopping.json``     | ``Estimator.train``|
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import logging

from estimax import storage
from estimax.estimator import summaries
from estimax.estimator.spec import BestCheckpoint, check_mode

EARLY_STOP_FILE = "early_stopping.json"

# (best_eval_result, current_eval_result) -> whether the current one is better: the original
# BestExporter's compare_fn.
Compare = Callable[..., bool]


def eval_dir(model_dir: str, name: str | None) -> str:
    """Where ``Estimator.evaluate(name=name)`` writes its summaries and records."""
    return storage.join(model_dir, "eval" if name is None else f"eval_{name}")


def metric_value(results: Mapping[str, Any], metric: str, who: str) -> float:
    """``results[metric]`` as a number, or one error naming the metrics there are."""
    if metric not in results:
        raise KeyError(
            f"{who}: the evaluation results have no {metric!r}; they have "
            f"{sorted(k for k in results if k != 'global_step')}. Name one of those (the keys "
            "of EstimatorSpec.eval_metrics, or 'loss')."
        )
    value = results[metric]
    if isinstance(value, list | tuple):
        raise ValueError(
            f"{who}: {metric!r} is not one number (a confusion matrix?); pick a scalar."
        )
    return float(value)


def compare_by(metric: str, mode: str, who: str) -> Compare:
    """A ``compare_fn`` on ``metric``: strictly smaller (``"min"``) or larger (``"max"``) wins.

    A NaN never wins, and loses to any number.
    """
    check_mode(mode, who)

    def compare(
        best_eval_result: Mapping[str, Any], current_eval_result: Mapping[str, Any]
    ) -> bool:
        best = metric_value(best_eval_result, metric, who)
        current = metric_value(current_eval_result, metric, who)
        if math.isnan(current):
            return False
        if math.isnan(best):
            return True
        return current < best if mode == "min" else current > best

    return compare


def best_of(
    evaluations: Mapping[int, Mapping[str, Any]],
    compare: Compare,
    steps: Sequence[int] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """The best ``(step, results)`` of recorded evaluations (the earliest of equals), or None.

    Args:
      evaluations: ``{global_step: results}`` (``summaries.recorded_evaluations``).
      compare: ``compare(best_eval_result=, current_eval_result=)``, True if current is better.
      steps: only these steps count (e.g. the checkpoints that still exist); None: all.
    """
    best: tuple[int, dict[str, Any]] | None = None
    allowed = None if steps is None else set(steps)
    for step in sorted(evaluations):
        if allowed is not None and step not in allowed:
            continue
        results = dict(evaluations[step])
        if best is None or compare(best_eval_result=best[1], current_eval_result=results):
            best = (step, results)
    return best


def best_checkpoint_step(
    model_dir: str, best: BestCheckpoint, existing: Sequence[int]
) -> int | None:
    """The step of the best of ``existing`` checkpoints by ``best``'s recorded evaluations."""
    who = f"RunConfig(keep_best_checkpoint=BestCheckpoint({best.metric!r}, {best.mode!r}))"
    found = best_of(
        summaries.recorded_evaluations(eval_dir(model_dir, best.eval_name)),
        compare_by(best.metric, best.mode, who),
        steps=existing,
    )
    return None if found is None else found[0]


@dataclasses.dataclass
class KeepBest:
    """An Orbax preservation policy: the best evaluated checkpoint is never rotated away.

    Orbax asks it at each save which of the existing checkpoints to preserve (with its
    ``LatestN(keep_checkpoint_max)``); the evaluations are read then, once per save. A damaged
    ``evaluations.json`` is rebuilt from the event files (``summaries.read_evaluations``);
    where nothing can be rebuilt, every checkpoint is kept: none is deleted on the word of a
    record that cannot be verified.
    """

    model_dir: str
    best: BestCheckpoint

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        """``[whether to keep]`` for each of Orbax's checkpoint infos (their ``.step``)."""
        del context
        steps = [int(c.step) for c in checkpoints]
        found = summaries.read_evaluations(eval_dir(self.model_dir, self.best.eval_name))
        if found.damage is not None and not found.evaluations:
            _warn_once(
                f"Keeping every checkpoint of {self.model_dir}: its evaluations record is "
                f"damaged ({found.damage}) and no event file says which checkpoint is the best."
            )
            return [True] * len(steps)
        who = f"RunConfig(keep_best_checkpoint=BestCheckpoint({self.best.metric!r}, "
        who += f"{self.best.mode!r}))"
        try:
            chosen = best_of(
                found.evaluations, compare_by(self.best.metric, self.best.mode, who), steps
            )
        except (KeyError, ValueError) as e:
            # A wrong metric name must not stop a save: say so, and keep the newest only.
            logging.warning("Not keeping a best checkpoint: %s", e)
            chosen = None
        keep = None if chosen is None else chosen[0]
        return [s == keep for s in steps]


# --- Early stopping, recorded -------------------------------------------------------------------


def read_early_stop(model_dir: str) -> dict[str, Any] | None:
    """The recorded early-stopping decision of ``model_dir`` (``early_stopping.json``), or None.

    A record that is not a decision (not JSON, nested absurdly deep, steps that are not
    non-negative integers) is one warning and None: training is not held back on its word.
    """
    path = storage.join(model_dir, EARLY_STOP_FILE)
    if not storage.exists(path):
        return None
    try:
        with storage.open_file(path, "rb") as f:
            record = storage.load_json(f.read())
        if not isinstance(record, dict):
            raise TypeError(f"a JSON {type(record).__name__}, not an object")
        steps = {k: record.get(k) for k in ("stopped_at", "best_step")}
        for key, value in steps.items():
            if type(value) is not int or value < 0:
                raise ValueError(f"{key} = {_short(value)} is not a step")
        return {**steps, **{k: v for k, v in record.items() if k not in steps}}
    except (ValueError, TypeError) as e:
        _warn_once(f"{path} is unreadable ({e}): training is not held back by it.")
        return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Logs ``message`` as a warning once per process: the file is read at every check."""
    if message not in _warned:
        _warned.add(message)
        logging.warning("%s", message)


def _short(value: Any) -> str:
    """``repr(value)``, cut to a length a log line can hold."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def record_early_stop(model_dir: str, record: Mapping[str, Any]) -> None:
    """Writes the early-stopping decision to ``model_dir/early_stopping.json`` (durably)."""
    summaries.write_json(
        storage.join(model_dir, EARLY_STOP_FILE), dict(record), "record the early stop"
    )


def describe_early_stop(record: Mapping[str, Any]) -> str:
    """``stopped early at step N (best M: metric = v at step M; ...)`` for log lines."""
    return (
        f"stopped early at step {record['stopped_at']} (best {record['best_step']}: "
        f"{record.get('metric')} = {record.get('best_value')}; no "
        f"{'increase' if record.get('mode') == 'max' else 'decrease'} for "
        f"{record.get('steps_without_improvement')} steps in {record.get('eval_dir')})"
    )


def held_back(model_dir: str, config: Any) -> dict[str, Any] | None:
    """The early stop that keeps ``model_dir`` from training (logged, saying how to train on),
    or None: none was recorded, or ``config.train_after_early_stop`` asks to train on."""
    record = read_early_stop(model_dir)
    if record is None:
        return None
    if config.train_after_early_stop:
        logging.info(
            "Training %s; training on (RunConfig(train_after_early_stop=True)).",
            describe_early_stop(record),
        )
        return None
    logging.warning(
        "Training %s: not training. To train on, set RunConfig(train_after_early_stop=True) "
        "(or delete %s).",
        describe_early_stop(record),
        storage.join(model_dir, EARLY_STOP_FILE),
    )
    return record
