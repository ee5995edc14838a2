"""``train_and_evaluate``: alternate training and evaluation, resuming where a run left off."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from absl import logging

from estimax.estimator import periodic, summaries
from estimax.estimator.hooks import SessionRunContext, SessionRunHook, SessionRunValues
from estimax.estimator.spec import EvalSpec, TrainSpec

if TYPE_CHECKING:
    from estimax.estimator.estimator import Estimator


def train_and_evaluate(
    estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec
) -> tuple[dict[str, Any] | None, list]:
    """Trains to ``train_spec.max_steps``, evaluating along the way and at the end.

    With ``eval_spec.every_steps`` it alternates ``train(max_steps=next)`` and ``evaluate`` (the
    original programs' ``steps_per_eval`` loop, but by absolute step so a restarted job resumes
    the same schedule); otherwise it evaluates after checkpoint saves, at most once per
    ``throttle_secs``, and once at the end.

    Returns:
      (the last evaluation's results, []) as the original (no exporters).
    """
    if train_spec.max_steps is None:
        raise ValueError("train_and_evaluate needs TrainSpec.max_steps.")
    max_steps = train_spec.max_steps
    results: dict[str, Any] | None = None
    evaluated_at: set[int] = set()

    def evaluate() -> dict[str, Any]:
        r = evaluate_once(
            estimator,
            estimator.get_global_step(),
            lambda: estimator.evaluate(
                eval_spec.input_fn,
                steps=eval_spec.steps,
                name=eval_spec.name,
                hooks=eval_spec.hooks,
            ),
            eval_spec.name,
        )
        evaluated_at.add(r["global_step"])
        logging.info("Eval results at step %d: %s", r["global_step"], r)
        return r

    if eval_spec.every_steps:
        results = _every_steps(estimator, train_spec, eval_spec.every_steps, max_steps, evaluate)
    else:
        results = _after_saves(estimator, train_spec, eval_spec.throttle_secs, max_steps, evaluate)
    if estimator.get_global_step() not in evaluated_at:
        results = evaluate()
    return results, []


def _every_steps(
    estimator: Estimator,
    train_spec: TrainSpec,
    every_steps: int,
    max_steps: int,
    evaluate: Callable[[], dict[str, Any]],
) -> dict[str, Any] | None:
    """Alternates ``train(max_steps=next multiple of every_steps)`` and an evaluation."""
    results = None
    current = estimator.get_global_step()
    if 0 < current < max_steps and current % every_steps == 0:
        # A restarted run: the evaluation of this checkpoint may not have been recorded
        # (the job was killed during or right after it); it is redone, else read back.
        results = evaluate()
    while current < max_steps:
        target = min(max_steps, (current // every_steps + 1) * every_steps)
        stop = _StopSeen()  # last: sees a stop any of the spec's hooks requested
        estimator.train(train_spec.input_fn, max_steps=target, hooks=[*train_spec.hooks, stop])
        current = estimator.get_global_step()
        results = evaluate()
        if current < target or stop.requested:  # a hook stopped training, or the input ended
            break
    return results


class _StopSeen(SessionRunHook):
    """Notes whether a hook asked training to stop (the hooks share one run context)."""

    def __init__(self) -> None:
        self.requested = False

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        self.requested = self.requested or run_context.stop_requested


def _after_saves(
    estimator: Estimator,
    train_spec: TrainSpec,
    throttle_secs: float,
    max_steps: int,
    evaluate: Callable[[], dict[str, Any]],
) -> dict[str, Any] | None:
    """Trains to ``max_steps``, evaluating complete checkpoints (at most once per throttle)."""
    results = None
    throttle = periodic.PeriodicAction(
        every_secs=throttle_secs, clock=estimator.clock, start_step=-1
    )

    def after_save(step: int) -> None:  # the checkpoint of `step` is complete on disk
        nonlocal results
        # The first save is evaluated; later ones at most once per throttle_secs.
        if step < max_steps and (throttle.last_step == -1 or throttle.due(step)):
            results = evaluate()
            throttle.fired(step)

    if estimator.get_global_step() < max_steps:
        estimator.train(
            train_spec.input_fn,
            max_steps=max_steps,
            hooks=train_spec.hooks,
            saving_listeners=[after_save],
        )
    return results


def eval_dir(model_dir: str, name: str | None) -> str:
    """Where ``Estimator.evaluate(name=name)`` writes its summaries."""
    return os.path.join(model_dir, "eval" if name is None else f"eval_{name}")


def evaluate_once(
    estimator: Estimator,
    step: int,
    run: Callable[[], dict[str, Any]],
    name: str | None = None,
) -> dict[str, Any]:
    """Runs an evaluation of the checkpoint at ``step`` unless one is durably recorded.

    The record (``<eval dir>/evaluations.json``) is written only after the evaluation's
    summaries are flushed and fsynced, so a process killed during or right after an evaluation
    redoes it on restart, and an evaluation already recorded is not run again (re-running a
    finished command adds no second TensorBoard point).

    Args:
      estimator: whose ``model_dir`` holds the record.
      step: the global step of the checkpoint ``run`` evaluates.
      run: runs the evaluation (``Estimator.evaluate``) and returns its results.
      name: the evaluation's name (``EvalSpec.name``).

    Returns:
      the results, run now or as recorded.
    """
    logdir = eval_dir(str(estimator.model_dir), name)
    if step:
        done = summaries.recorded_evaluations(logdir).get(step)
        if done is not None:
            logging.info("The evaluation at step %d is already recorded in %s.", step, logdir)
            return done
    results = run()
    if jax.process_index() == 0:
        summaries.record_evaluation(logdir, results)
    return results
