"""SessionRunHooks: user code run once per host loop, with the original's names and meaning.

TPUEstimator ran ``iterations_per_loop`` steps in one ``session.run``; a ``SessionRunHook`` saw
one ``before_run``/``after_run`` pair per loop. estimax keeps that unit: the host meets the
devices once per loop (it fetches the loop's per-step metrics there), and hooks run then.

| the original (``tf.train``)                 | estimax (``estimax.*``)                          |
|---------------------------------------------|--------------------------------------------------|
| ``SessionRunHook.begin()``                  | the same, before the first step (no graph to    |
|                                             | change: add host work in ``after_run``)          |
| ``after_create_session(session, coord)``    | ``session``: a ``HookSession`` (mode, model_dir, |
|                                             | the step it starts at); ``coord``: None          |
| ``before_run(run_context)`` ->              | the same; the return value is ignored (every     |
| ``SessionRunArgs(fetches)``                 | per-step metric is fetched anyway)               |
| ``after_run(run_context, run_values)``      | ``run_values.results``: ``{metric: [n]}``, one   |
|                                             | value per step of the loop, on the host          |
| ``run_context.request_stop()``              | the same: training ends after this loop, with a  |
|                                             | checkpoint at its last step                      |
| ``end(session)``                            | the same (``session.global_step``: the last one) |
| ``CheckpointSaverListener.after_save``      | ``saving_listeners``: ``listener(step)`` or an   |
| returning True stops (TF >= 1.13)           | object with ``after_save(session, step)``; True  |
|                                             | stops training                                   |
| ``StopAtStepHook``, ``LoggingTensorHook``,  | ``StopAtStepHook``, ``LoggingTensorHook``,       |
| ``StepCounterHook``, ``ProfilerHook``,      | ``StepCounterHook``, ``ProfilerHook``,           |
| ``stop_if_no_decrease_hook``,               | the same; the decision is recorded in model_dir: |
| ``stop_if_no_increase_hook``                | a stopped job stays stopped                      |

estimax adds one method, ``end_loop_at(step)``: a hook may ask for a loop to end at a step
(``StopAtStepHook`` to stop exactly there, ``ProfilerHook`` to trace exactly its steps).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from estimax import storage
from estimax.estimator import best as best_lib
from estimax.estimator import periodic
from estimax.estimator import summaries as summaries_lib


@dataclasses.dataclass
class HookSession:
    """What ``after_create_session`` and ``end`` receive in place of a ``tf.Session``.

    Attributes:
      mode: ``ModeKeys.TRAIN``, ``EVAL`` or ``PREDICT``.
      model_dir: the Estimator's model directory.
      global_step: the checkpoint's step when the run starts; in ``end``, the last step run
        (training) or evaluated.
      results: in ``end`` of an evaluation, its results (``Estimator.evaluate``'s return value).
    """

    mode: str
    model_dir: str
    global_step: int
    results: dict[str, Any] | None = None


class SessionRunContext:
    """Passed to ``before_run``/``after_run``: which session, and a way to stop."""

    def __init__(self, session: HookSession):
        self.session = session
        self.original_args = None  # no SessionRunArgs: every metric is fetched
        self._stop_requested = False

    def request_stop(self) -> None:
        """Ends the run after this loop (training: with a checkpoint at its last step)."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        """Whether a hook asked to stop."""
        return self._stop_requested


@dataclasses.dataclass
class SessionRunValues:
    """What one loop produced, on the host.

    Attributes:
      results: training: ``{metric: array [n]}`` per step of the loop (``loss`` and the spec's
        ``scalars``); evaluation: the metrics over the batches so far; prediction: the batch's
        predictions (padding rows removed).
      begin_step: the global step before the loop (prediction: batches before this one).
      end_step: the global step after it.
    """

    results: Mapping[str, Any]
    begin_step: int
    end_step: int

    @property
    def steps(self) -> np.ndarray:
        """The step numbers of ``results``' rows: ``begin_step + 1 .. end_step``."""
        return np.arange(self.begin_step + 1, self.end_step + 1)


class SessionRunHook:
    """Base class of hooks: override what you need (every method does nothing by default)."""

    def begin(self) -> None:
        """Called once before the first step (checkpoint not yet restored)."""

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        """Called once the model is restored or initialised; ``coord`` is always None."""

    def before_run(self, run_context: SessionRunContext) -> None:
        """Called before each loop; a returned ``SessionRunArgs`` is ignored."""

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Called after each loop with its values; may ``run_context.request_stop()``."""

    def end(self, session: HookSession) -> None:
        """Called once at the end of the run (not when a step raised)."""

    def end_loop_at(self, step: int) -> int | None:
        """estimax addition: a step > ``step`` at which the next loop must end, or None."""
        del step
        return None


class StopAtStepHook(SessionRunHook):
    """Stops training at a step: ``num_steps`` after the start, or at ``last_step``.

    Loops are shortened to end there, so training stops at exactly that step (with a checkpoint).
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None):
        if (num_steps is None) == (last_step is None):
            raise ValueError("StopAtStepHook: give exactly one of num_steps and last_step.")
        self._num_steps = num_steps
        self._last_step = last_step

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        if self._num_steps is not None:
            self._last_step = session.global_step + self._num_steps

    def end_loop_at(self, step: int) -> int | None:
        return self._last_step if self._last_step is not None and step < self._last_step else None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if self._last_step is not None and run_values.end_step >= self._last_step:
            run_context.request_stop()


class LoggingTensorHook(SessionRunHook):
    """Logs named metrics every ``every_n_iter`` steps (at their true steps) or ``every_n_secs``.

    Args:
      tensors: metric names (``loss`` or the spec's ``scalars``), or ``{label: name}``.
      every_n_iter: log the values of the steps on this grid.
      every_n_secs: log the loop's last values at most this often.
      at_end: also log the last values when the run ends.
      formatter: ``{label: value} -> str``; default ``label = value, ...``.
    """

    def __init__(
        self,
        tensors: Sequence[str] | Mapping[str, str],
        every_n_iter: int | None = None,
        every_n_secs: float | None = None,
        at_end: bool = False,
        formatter: Callable[[dict[str, Any]], str] | None = None,
    ):
        if (every_n_iter is None) == (every_n_secs is None) and not at_end:
            raise ValueError("LoggingTensorHook: give one of every_n_iter and every_n_secs.")
        self._names = dict(tensors) if isinstance(tensors, Mapping) else {t: t for t in tensors}
        self._every_n_iter = every_n_iter
        self._timer = periodic.PeriodicAction(every_secs=every_n_secs)
        self._every_n_secs = every_n_secs
        self._at_end = at_end
        self._format = formatter or (
            lambda values: ", ".join(f"{k} = {v}" for k, v in values.items())
        )
        self._last: dict[str, Any] | None = None

    def _values(self, results: Mapping[str, Any], row: int) -> dict[str, Any]:
        missing = [n for n in self._names.values() if n not in results]
        if missing:
            raise KeyError(f"LoggingTensorHook: no metric {missing}; there are {sorted(results)}.")
        return {label: np.asarray(results[n])[row] for label, n in self._names.items()}

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        steps = run_values.steps
        if self._every_n_iter is not None:
            for step in periodic.steps_due(
                run_values.begin_step, run_values.end_step, self._every_n_iter
            ):
                values = self._values(run_values.results, step - run_values.begin_step - 1)
                logging.info("%s (step %d)", self._format(values), step)
        if self._every_n_secs is not None and self._timer.due(run_values.end_step):
            logging.info("%s", self._format(self._values(run_values.results, len(steps) - 1)))
            self._timer.fired(run_values.end_step)
        self._last = self._values(run_values.results, len(steps) - 1)

    def end(self, session: HookSession) -> None:
        if self._at_end and self._last is not None:
            logging.info("%s", self._format(self._last))


class StepCounterHook(SessionRunHook):
    """Logs (and with ``output_dir`` writes to TensorBoard) ``global_step/sec``.

    Measured over whole loops, every ``every_n_steps`` steps or ``every_n_secs`` seconds.
    """

    def __init__(
        self,
        every_n_steps: int | None = 100,
        every_n_secs: float | None = None,
        output_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._cadence = (every_n_steps, every_n_secs)
        self._clock = clock
        self._output_dir = output_dir
        self._timer: periodic.PeriodicAction | None = None
        self._writer: Any = None

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        every_steps, every_secs = self._cadence
        self._timer = periodic.PeriodicAction(
            every_steps, every_secs, clock=self._clock, start_step=session.global_step
        )
        if self._output_dir is not None:
            from estimax.estimator.summaries import Summaries

            self._writer = Summaries(self._output_dir)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        assert self._timer is not None
        step = run_values.end_step
        if not self._timer.due(step):
            return
        elapsed = self._timer.seconds_since_fired()
        if elapsed > 0:
            rate = (step - self._timer.last_step) / elapsed
            logging.info("global_step/sec: %g", rate)
            if self._writer is not None:
                self._writer.scalars(step, {"global_step/sec": rate})
        self._timer.fired(step)

    def end(self, session: HookSession) -> None:
        if self._writer is not None:
            self._writer.close()


class _NoImprovementHook(SessionRunHook):
    """Stops training when an evaluated metric has not improved for a number of steps, and
    records that decision in ``model_dir`` (``early_stopping.json``) so the job stays stopped.

    The original's rule (``tf.estimator.experimental``): over the recorded evaluations in step
    order, skipping those before ``min_steps``, stop as soon as one comes
    ``max_steps_without_improvement`` or more steps after the best so far. When training goes
    on after a recorded stop (``RunConfig(train_after_early_stop=True)``), only evaluations
    after that stop can stop it again.
    """

    def __init__(
        self,
        model_dir: str,
        eval_dir: str,
        metric_name: str,
        max_steps_without_improvement: int,
        mode: str,
        min_steps: int,
        run_every_steps: int | None,
        run_every_secs: float | None,
    ):
        if max_steps_without_improvement < 0:
            raise ValueError(
                "max_steps_without_decrease/increase must be >= 0, got "
                f"{max_steps_without_improvement}."
            )
        self.model_dir = model_dir
        self.eval_dir = eval_dir
        self._metric = metric_name
        self._patience = max_steps_without_improvement
        self._mode = mode
        self._compare = best_lib.compare_by(metric_name, mode, f"early stopping on {metric_name!r}")
        self._min_steps = min_steps
        self._timer = periodic.PeriodicAction(run_every_steps, run_every_secs)
        self._checked = False  # the original checks at the first step, then on its cadence

    def decision(self, step: int) -> dict[str, Any] | None:
        """Whether training at ``step`` must stop: the decision (recorded), or None."""
        evaluations = summaries_lib.recorded_evaluations(self.eval_dir)
        earlier = best_lib.read_early_stop(self.model_dir)
        after = earlier["stopped_at"] if earlier is not None else -1
        best: tuple[int, dict[str, Any]] | None = None
        for at in sorted(evaluations):
            if at < self._min_steps:
                continue
            results = evaluations[at]
            best_lib.metric_value(results, self._metric, f"early stopping on {self._metric!r}")
            if best is None or self._compare(best_eval_result=best[1], current_eval_result=results):
                best = (at, results)
            if at - best[0] >= self._patience and at > after:
                return self._stop(step, at, best)
        return None

    def _stop(self, step: int, at: int, best: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        record = {
            "stopped_at": int(step),
            "best_step": best[0],
            "best_value": best[1][self._metric],
            "metric": self._metric,
            "mode": self._mode,
            "steps_without_improvement": at - best[0],
            "max_steps_without_improvement": self._patience,
            "eval_dir": self.eval_dir,
        }
        logging.info(
            'No %s in metric "%s" for %d steps, which is greater than or equal to max steps (%d) '
            "configured for early stopping.",
            "increase" if self._mode == "max" else "decrease",
            self._metric,
            at - best[0],
            self._patience,
        )
        if jax.process_index() == 0:
            best_lib.record_early_stop(self.model_dir, record)
        logging.info("Training %s.", best_lib.describe_early_stop(record))
        return record

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        step = run_values.end_step
        if self._checked and not self._timer.due(step):
            return
        self._checked = True
        self._timer.fired(step)
        if self.decision(step) is not None:
            run_context.request_stop()


def _early_stopping_hook(
    estimator: Any, metric_name: str, max_steps: int, mode: str, options: dict[str, Any]
) -> SessionRunHook:
    settings: dict[str, Any] = {
        "eval_dir": None,
        "min_steps": 0,
        "run_every_secs": 60,
        "run_every_steps": None,
        "eval_name": None,
    }
    unknown = sorted(set(options) - set(settings))
    if unknown:
        raise TypeError(
            f"early stopping: unknown argument(s) {unknown}; it takes {list(settings)}."
        )
    settings.update(options)
    if settings["eval_dir"] is not None and settings["eval_name"] is not None:
        raise ValueError("early stopping: give eval_dir or eval_name, not both.")
    model_dir = str(estimator.model_dir)
    every_steps = settings["run_every_steps"]
    return _NoImprovementHook(
        model_dir,
        settings["eval_dir"] or best_lib.eval_dir(model_dir, settings["eval_name"]),
        metric_name,
        max_steps,
        mode,
        settings["min_steps"],
        every_steps,
        None if every_steps is not None else settings["run_every_secs"],
    )


def stop_if_no_decrease_hook(
    estimator: Any,
    metric_name: str,
    max_steps_without_decrease: int,
    eval_dir: str | None = None,
    min_steps: int = 0,
    run_every_secs: float | None = 60,
    run_every_steps: int | None = None,
    *,
    eval_name: str | None = None,
) -> SessionRunHook:
    """A hook stopping training when ``metric_name`` has not decreased for that many steps.

    As ``tf.estimator.experimental.stop_if_no_decrease_hook``: it reads the evaluations recorded
    in ``eval_dir`` (default: the estimator's ``model_dir/eval``, or ``model_dir/eval_<name>``
    for ``eval_name``; ``train_and_evaluate`` and ``Estimator.evaluate`` record each one), at
    the first loop and then every ``run_every_secs`` or ``run_every_steps``;
    ``train_and_evaluate`` also asks it right after each evaluation it watches. The decision
    is recorded in ``model_dir/early_stopping.json``: running the job again trains nothing
    (``RunConfig(train_after_early_stop=True)`` trains on).
    """
    options = {
        "eval_dir": eval_dir,
        "min_steps": min_steps,
        "run_every_secs": run_every_secs,
        "run_every_steps": run_every_steps,
        "eval_name": eval_name,
    }
    return _early_stopping_hook(estimator, metric_name, max_steps_without_decrease, "min", options)


def stop_if_no_increase_hook(
    estimator: Any, metric_name: str, max_steps_without_increase: int, **options: Any
) -> SessionRunHook:
    """A hook stopping training when ``metric_name`` (e.g. accuracy) has not increased for that
    many steps: ``tf.estimator.experimental.stop_if_no_increase_hook``. ``options`` are
    ``stop_if_no_decrease_hook``'s (``eval_dir``, ``min_steps``, ``run_every_secs``,
    ``run_every_steps``, ``eval_name``), by name; the decision is recorded the same way."""
    return _early_stopping_hook(estimator, metric_name, max_steps_without_increase, "max", options)


def early_stopping_hooks(hooks: Iterable[Any]) -> list[_NoImprovementHook]:
    """The early-stopping hooks among ``hooks`` (``train_and_evaluate`` asks them itself)."""
    return [h for h in hooks if isinstance(h, _NoImprovementHook)]


class ProfilerHook(SessionRunHook):
    """Captures a ``jax.profiler`` trace of training steps ``start .. stop`` (inclusive).

    The trace goes to ``output_dir/plugins/profile/<run>/`` (default: the model_dir), where
    TensorBoard's profile plugin finds it; every step carries a step marker. Loops are shortened
    so the trace holds exactly those steps. On ``gs://``/``s3://`` the trace is written locally,
    then uploaded when it stops.
    """

    def __init__(self, steps: tuple[int, int], output_dir: str | None = None):
        start, stop = steps
        if not 1 <= start <= stop:
            raise ValueError(f"profile steps must be 1 <= START <= STOP, got {start},{stop}.")
        self.start, self.stop = start, stop
        self._output_dir = output_dir
        self._local: str | None = None
        self.tracing = False

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        if self._output_dir is None:
            self._output_dir = session.model_dir

    def end_loop_at(self, step: int) -> int | None:
        # Loops end right before the first traced step and at the last one.
        if step < self.start - 1:
            return self.start - 1
        return self.stop if step < self.stop else None

    def before_run(self, run_context: SessionRunContext) -> None:
        step = run_context.session.global_step
        if self.start - 1 <= step < self.stop and not self.tracing:
            assert self._output_dir is not None
            remote = storage.is_remote(self._output_dir)
            self._local = tempfile.mkdtemp(prefix="estimax_trace_") if remote else None
            jax.profiler.start_trace(self._local or self._output_dir)
            self.tracing = True
            logging.info("Profiling steps %d..%d.", self.start, self.stop)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if self.tracing and run_values.end_step >= self.stop:
            self.close()

    def end(self, session: HookSession) -> None:
        if self.tracing:
            self.close()

    def close(self) -> None:
        """Stops the trace and writes it (uploads it, for a remote output_dir)."""
        jax.profiler.stop_trace()
        self.tracing = False
        assert self._output_dir is not None
        if self._local is not None:
            for root, _, files in os.walk(self._local):
                for name in files:
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, self._local)
                    storage.upload_file(path, storage.join(self._output_dir, *rel.split(os.sep)))
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None
        logging.info(
            "Wrote the profile of steps %d..%d under %s.",
            self.start,
            self.stop,
            storage.join(self._output_dir, "plugins", "profile"),
        )


def parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    """``"START,STOP"`` (or one step) -> ``(START, STOP)``; empty -> None; else ValueError."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        numbers *= 2
    if len(numbers) != 2 or not 1 <= numbers[0] <= numbers[1]:
        raise ValueError(
            f"profile steps {text!r}: expected START,STOP with 1 <= START <= STOP (e.g. 100,110)."
        )
    return numbers[0], numbers[1]


def as_listener(listener: Any) -> Callable[[int], Any]:
    """A saving listener as ``step -> stop?``: a callable, or a ``CheckpointSaverListener``-like
    object whose ``after_save(None, global_step)`` is called (its other methods are not)."""
    if hasattr(listener, "after_save"):
        return lambda step: listener.after_save(None, step)
    return listener


def all_hooks(hooks: Iterable[SessionRunHook] | None) -> list[SessionRunHook]:
    """The hooks as a list, each checked to be a hook (one clear error for anything else)."""
    found = list(hooks or [])
    for hook in found:
        if not isinstance(hook, SessionRunHook):
            raise TypeError(
                f"hooks must be estimax.SessionRunHook instances; got {type(hook).__name__}."
            )
    return found
