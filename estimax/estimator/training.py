"""``train_and_evaluate``: alternate training and evaluations, resuming where a run left off.

One job may have several evaluations (``EvalSpec``s, each with its name, cadence, hooks and
exporters): training runs in segments up to the next step an every-``every_steps`` evaluation
is due at, and evaluations that follow checkpoints (``throttle_secs``) run from a saving
listener. After each evaluation its spec's exporters run, then the early-stopping hooks that
watch it are asked: a stop ends training there (recorded in ``model_dir``, so it stays
stopped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from absl import logging

from estimax import storage
from estimax.estimator import best as best_lib
from estimax.estimator import hooks as hooks_lib
from estimax.estimator import periodic, summaries
from estimax.estimator.hooks import SessionRunContext, SessionRunHook, SessionRunValues
from estimax.estimator.spec import EvalSpec, TrainSpec
from estimax.state import checkpoints as ckpt_lib
from estimax.state import goodput

if TYPE_CHECKING:
    from estimax.estimator.estimator import Estimator

EXPORT_SUBDIR = "export"


def train_and_evaluate(
    estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec | Sequence[EvalSpec]
) -> tuple[Any, list]:
    """Trains to ``train_spec.max_steps``, evaluating along the way and at the end.

    For each ``EvalSpec``: with ``every_steps`` it evaluates each time the global step reaches
    a multiple of it (by absolute step, so a restarted job resumes the same schedule);
    otherwise after checkpoint saves, at most once per ``throttle_secs``. Every spec is
    evaluated once at the end. Each writes to ``model_dir/eval_<name>`` (``model_dir/eval``
    for ``name=None``), which TensorBoard shows as a run of its own.

    Args:
      estimator: the Estimator.
      train_spec: the input, ``max_steps`` and training hooks (early-stopping hooks among them
        are also asked right after each evaluation they watch).
      eval_spec: one ``EvalSpec``, or a list of them with distinct names.

    Returns:
      (results, export results): for one EvalSpec, its last results and the paths its exporters
      published after the last evaluation, as the original; for a list, ``{name: results}``
      and the paths of all of them.
    """
    if train_spec.max_steps is None:
        raise ValueError("train_and_evaluate needs TrainSpec.max_steps.")
    several = not isinstance(eval_spec, EvalSpec)
    specs: list[Any] = list(eval_spec) if isinstance(eval_spec, Sequence) else [eval_spec]
    _check_specs(specs)
    job = _Job(estimator, train_spec, [_Evaluation(s, estimator) for s in specs])
    job.run()
    if not several:
        only = job.evaluations[0]
        return only.results, only.exported
    return (
        {e.spec.name: e.results for e in job.evaluations},
        [path for e in job.evaluations for path in e.exported],
    )


def _check_specs(specs: list[Any]) -> None:
    if not specs:
        raise ValueError("train_and_evaluate needs at least one EvalSpec.")
    for spec in specs:
        if not isinstance(spec, EvalSpec):
            raise TypeError(
                f"train_and_evaluate takes estimax.EvalSpec objects; got {type(spec).__name__}."
            )
    names = [s.name for s in specs]
    repeated = sorted({str(n) for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"train_and_evaluate: several EvalSpecs are named {repeated}; each evaluation "
            "writes to model_dir/eval_<name>, so give each EvalSpec its own name=."
        )


@dataclasses.dataclass
class _Evaluation:
    """One EvalSpec in a job: when it is due, what it last gave, what its exporters wrote."""

    spec: EvalSpec
    estimator: Estimator
    results: dict[str, Any] | None = None
    exported: list[str] = dataclasses.field(default_factory=list)
    evaluated_at: set[int] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.dir = best_lib.eval_dir(str(self.estimator.model_dir), self.spec.name)
        self.throttle = periodic.PeriodicAction(
            every_secs=self.spec.throttle_secs, clock=self.estimator.clock, start_step=-1
        )

    def due_after_save(self, step: int) -> bool:
        """Whether this throttled evaluation is due for the checkpoint saved at ``step``."""
        if self.spec.every_steps is not None:
            return False
        return self.throttle.last_step == -1 or self.throttle.due(step)

    def run(self, step: int, final: bool) -> dict[str, Any]:
        """Evaluates the checkpoint at ``step`` (or reads the recorded evaluation), then runs the
        spec's exporters."""
        spec, est = self.spec, self.estimator
        results = evaluate_once(
            est,
            step,
            lambda: est.evaluate(spec.input_fn, steps=spec.steps, name=spec.name, hooks=spec.hooks),
            spec.name,
        )
        self.evaluated_at.add(results["global_step"])
        self.throttle.fired(step)
        logging.info(
            "Eval results%s at step %d: %s",
            "" if spec.name is None else f" ({spec.name})",
            results["global_step"],
            results,
        )
        self.results = results
        self.exported = self.export(results, final)
        return results

    def export(self, results: dict[str, Any], final: bool) -> list[str]:
        """Runs the spec's exporters after an evaluation (on the chief); what they published."""
        if jax.process_index() != 0:
            return []
        est = self.estimator
        checkpoint_path = ckpt_lib.step_path(est.model_dir, results["global_step"])
        published = []
        for exporter in self.spec.exporters:
            if hasattr(exporter, "watch"):
                exporter.watch(self.dir)
            path = exporter.export(
                est,
                storage.join(est.model_dir, EXPORT_SUBDIR, exporter.name),
                checkpoint_path,
                results,
                final,
            )
            if path is not None:
                published.append(path)
        return published


class _Job:
    """The schedule of one ``train_and_evaluate`` call."""

    def __init__(self, estimator: Estimator, train_spec: TrainSpec, evaluations: list[_Evaluation]):
        self.estimator = estimator
        self.train_spec = train_spec
        self.evaluations = evaluations
        self.max_steps: int = train_spec.max_steps or 0
        self.stoppers = hooks_lib.early_stopping_hooks(train_spec.hooks)
        self.stopped = False

    def run(self) -> None:
        est = self.estimator
        current = est.get_global_step()
        self.stopped = best_lib.held_back(est.model_dir, est.config) is not None
        if 0 < current < self.max_steps and not self.stopped:
            # A restarted job: the evaluations due at this checkpoint may not have been recorded
            # (killed during or right after them): each is redone, else read back.
            for e in self._every_steps_due(current):
                self._evaluate(e, current)
        while current < self.max_steps and not self.stopped:
            target = self._next_target(current)
            stop_seen = _StopSeen()  # last: sees a stop any of the spec's hooks requested
            est.train(
                self.train_spec.input_fn,
                max_steps=target,
                hooks=[*self.train_spec.hooks, stop_seen],
                saving_listeners=[self._after_save] if self._throttled() else None,
                last_segment=target >= self.max_steps,
            )
            reached = est.get_global_step()
            ended = reached < target or stop_seen.requested or reached >= self.max_steps
            for e in self._every_steps_due(reached):
                self._evaluate(e, reached)
            if ended or reached == current:
                self.stopped = self.stopped or reached < self.max_steps
                break
            current = reached
        self._final(est.get_global_step())

    def _throttled(self) -> bool:
        return any(e.spec.every_steps is None for e in self.evaluations)

    def _next_target(self, current: int) -> int:
        """The next step a segment of training ends at: max_steps or an evaluation's step."""
        targets = [self.max_steps] + [
            (current // e.spec.every_steps + 1) * e.spec.every_steps
            for e in self.evaluations
            if e.spec.every_steps is not None
        ]
        return min(targets)

    def _every_steps_due(self, step: int) -> list[_Evaluation]:
        return [
            e
            for e in self.evaluations
            if e.spec.every_steps is not None and step % e.spec.every_steps == 0 and step > 0
        ]

    def _after_save(self, step: int) -> bool:
        """The saving listener: throttled evaluations of the complete checkpoint at ``step``;
        True (stop training) if an early-stopping hook says so."""
        if step >= self.max_steps:
            return False  # evaluated by _final
        for e in self.evaluations:
            if e.due_after_save(step):
                self._evaluate(e, step)
        return self.stopped

    def _evaluate(self, evaluation: _Evaluation, step: int, final: bool = False) -> None:
        evaluation.run(step, final)
        if self.stopped:
            return
        for hook in self.stoppers:
            if hook.eval_dir == evaluation.dir and hook.decision(step) is not None:
                self.stopped = True
                return

    def _final(self, step: int) -> None:
        """Every spec is evaluated at the last step (unless it was), then the final exports."""
        if not step:
            return
        for e in self.evaluations:
            if step in e.evaluated_at and e.results is not None:
                e.exported = e.export(e.results, final=True)
            else:
                self._evaluate(e, step, final=True)


class _StopSeen(SessionRunHook):
    """Notes whether a hook asked training to stop (the hooks share one run context)."""

    def __init__(self) -> None:
        self.requested = False

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        self.requested = self.requested or run_context.stop_requested


eval_dir = best_lib.eval_dir  # where ``Estimator.evaluate(name=name)`` writes


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
    record = goodput.recorder(str(estimator.model_dir))
    with record.phase("eval"):
        results = run()
    if not record.active:
        # The evaluation's line, so a job killed later keeps it; an evaluation run by a saving
        # listener is inside a training loop, whose line (with its steps) follows.
        record.flush()
    if jax.process_index() == 0:
        summaries.record_evaluation(logdir, results)
    return results
