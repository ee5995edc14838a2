"""``train_and_evaluate``: alternate training and evaluation, resuming where a run left off."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from absl import logging

from estimax.estimator import periodic
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
        r = estimator.evaluate(eval_spec.input_fn, steps=eval_spec.steps, name=eval_spec.name)
        evaluated_at.add(r["global_step"])
        logging.info("Eval results at step %d: %s", r["global_step"], r)
        return r

    if eval_spec.every_steps:
        current = estimator.get_global_step()
        while current < max_steps:
            target = min(max_steps, (current // eval_spec.every_steps + 1) * eval_spec.every_steps)
            estimator.train(train_spec.input_fn, max_steps=target)
            current = estimator.get_global_step()
            results = evaluate()
    else:
        throttle = periodic.PeriodicAction(
            every_secs=eval_spec.throttle_secs, clock=estimator.clock, start_step=-1
        )

        def after_save(step: int) -> None:  # the checkpoint of `step` is complete on disk
            nonlocal results
            # The first save is evaluated; later ones at most once per throttle_secs.
            if step < max_steps and (throttle.last_step == -1 or throttle.due(step)):
                results = evaluate()
                throttle.fired(step)

        if estimator.get_global_step() < max_steps:
            estimator.train(train_spec.input_fn, max_steps=max_steps, saving_listeners=[after_save])
    if estimator.get_global_step() not in evaluated_at:
        results = evaluate()
    return results, []
