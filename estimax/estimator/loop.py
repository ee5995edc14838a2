"""The training loop as components: each owns its cadence and its cleanup; the loop asks them.

Steps are dispatched one by one as their batches reach the devices (at most one queued behind
the running one), or with ``RunConfig.steps_per_device_call`` a block of them per device call,
never across a loop's end; once per loop of ``iterations_per_loop`` steps the host fetches the
loop's per-step outputs (its one sync with the devices) and asks each component in turn, as CLU's
periodic actions, torchtitan's and kauldron's trainers do. Every component is constructed and
entered under one ``contextlib.ExitStack``, so every cleanup runs whatever raises (a failed
checkpoint write, a NaN, a hook's error, ``Preempted``).

| component            | asked                  | does                             | cleanup      |
|----------------------|------------------------|----------------------------------|--------------|
| ``PreemptionNotice`` | after every step/call  | stop, save at an agreed step     | SIGTERM      |
| ``Watchdog``         | heartbeat every step   | no step in time: stacks, exit 75 | its thread   |
|                      |                        | (paused around listeners)        |              |
| ``DeviceIdle``       | after every input read | device idle time per loop        |              |
| ``ProfilerHook``     | around steps it traces | a trace with step markers        | stops it     |
| ``NonfiniteCheck``   | every loop             | NaN/Inf loss -> ``NanLossError`` |              |
| ``SkippedStepsReport`` | every loop           | counts non-finite skipped steps  |              |
| ``StepLogger``       | every loop             | scalars, log lines, speed, MFU   | bar, flush   |
| ``InputReports``     | every loop             | input wait, skipped records      |              |
| ``Hooks`` (the user's) | before/after a loop  | may request a stop               | trace        |
| ``Saver``            | every loop             | saves when due, last, on a stop; | waits for    |
|                      |                        | listeners (may request a stop)   | the write    |
| ``GoodputReport``    | every loop             | the goodput record's interval,   | last line    |
|                      |                        | ``goodput/*`` scalars            |              |
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from estimax.estimator import feeding, periodic, progress
from estimax.estimator import hooks as hooks_lib
from estimax.estimator import summaries as summaries_lib
from estimax.estimator import utilization as utilization_lib
from estimax.estimator.label_check import InvalidLabelCheck
from estimax.estimator.spec import ModeKeys, RunConfig
from estimax.estimator.steps import Signals, StepOutput
from estimax.parallel import distributed
from estimax.parallel.watchdog import Watchdog
from estimax.state import checkpoints as ckpt_lib
from estimax.state import goodput

# The share of a loop the devices may sit idle waiting for input before we warn.
INPUT_BOUND_WARNING_FRACTION = 0.1
_NO_SCOPE = contextlib.nullcontext()  # reusable: the step's scope when nothing is traced


class NanLossError(RuntimeError):
    """Training produced a NaN or infinite loss. Checkpoints written before it are intact."""


class Preempted(SystemExit):
    """Training stopped on a preemption notice (SIGTERM) after saving a checkpoint at ``step``.

    A ``SystemExit`` with status 0: a script that does not catch it ends as a job runner expects
    of a preempted job (saved, exit 0); the next start of the same command continues at ``step``.
    """

    def __init__(self, step: int, model_dir: str):
        super().__init__(0)
        self.step = step
        self.model_dir = model_dir

    def __str__(self) -> str:
        return (
            f"Preempted (SIGTERM): saved a checkpoint at step {self.step} in {self.model_dir}; "
            "run the same command again to continue from it."
        )


class Interrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C (SIGINT) after saving a checkpoint at ``step``.

    A ``KeyboardInterrupt``, as Ctrl-C always is (a notebook cell stops; a script exits 130),
    but the steps trained since the last checkpoint are saved first, as on SIGTERM.
    """

    def __init__(self, step: int, model_dir: str):
        super().__init__(
            f"Interrupted (Ctrl-C): saved a checkpoint at step {step} in {model_dir}; run the "
            "same command again to continue from it."
        )
        self.step = step
        self.model_dir = model_dir


def to_host(tree: Any) -> Any:
    """Fetches replicated device values (metrics) as numpy, from this process's first copy.

    ``jax.device_get`` refuses arrays spanning other processes' devices; every process holds a
    whole copy of a replicated one.
    """
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)  # one process: all transfers started at once
    return jax.tree.map(
        lambda x: np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x), tree
    )


@jax.jit
def _stack(outputs: list[StepOutput]) -> StepOutput:
    """A loop's device calls' outputs (scalars of one step, or ``[m]`` of m steps) as one
    ``StepOutput`` of ``[n]`` (compiled once per loop shape)."""
    return jax.tree.map(
        lambda *calls: jnp.concatenate([jnp.reshape(c, (-1,)) for c in calls]), *outputs
    )


@dataclasses.dataclass(frozen=True)
class LoopEnd:
    """What the host knows at a sync: the loop's steps, their outputs, and where input stands.

    Components read it and change nothing in it.

    Attributes:
      begin, end: the global step before and after the loop.
      metrics: ``{"loss": [n], <scalar>: [n]}`` per-step values on the host (``n = end -
        begin``): the user's metrics, as logged and as hooks see them.
      signals: the framework's per-step signals (``[n]`` numpy arrays, or None).
      input_state: the input position after the last batch trained on (None: not resumable).
      skipped: bad records the input has skipped so far (None: it cannot say).
    """

    begin: int
    end: int
    metrics: Mapping[str, np.ndarray]
    signals: Signals
    input_state: Any
    skipped: int | None


class _Report(Protocol):
    def after_loop(self, loop: LoopEnd) -> None: ...


class NonfiniteCheck:
    """Stops training on a NaN/Inf loss, naming the step (the checkpoints before it are kept)."""

    def __init__(self, checkpointer: ckpt_lib.Checkpointer):
        self._checkpointer = checkpointer

    def after_loop(self, loop: LoopEnd) -> None:
        if loop.signals.nonfinite_skipped is not None:
            return  # skip_nonfinite_steps: such steps made no update (SkippedStepsReport)
        losses = loop.metrics["loss"]
        bad = np.flatnonzero(~np.isfinite(losses))
        if not bad.size:
            return
        raise NanLossError(
            f"NaN loss during training: the loss was {losses[bad[0]]} at step "
            f"{loop.begin + bad[0] + 1} (steps {loop.begin + 1}..{loop.end} ran in one device "
            f"loop). Nothing from that loop was saved; {self._checkpointer.intact()}."
        )


class SkippedStepsReport:
    """Counts the steps ``RunConfig.skip_nonfinite_steps`` skipped; warns and writes the count."""

    def __init__(self, summaries: summaries_lib.Summaries | None):
        self._summaries = summaries
        self.count = 0

    def after_loop(self, loop: LoopEnd) -> None:
        flags = loop.signals.nonfinite_skipped
        if flags is None:
            return
        skipped = np.flatnonzero(np.asarray(flags).reshape(-1) > 0)
        if not skipped.size:
            return
        self.count += int(skipped.size)
        logging.warning(
            "Skipped %d training step(s) with a non-finite loss or gradient in steps %d..%d "
            "(first: step %d, loss %s); no update was made. %d skipped so far.",
            skipped.size,
            loop.begin + 1,
            loop.end,
            loop.begin + skipped[0] + 1,
            loop.metrics["loss"][skipped[0]],
            self.count,
        )
        if self._summaries is not None:
            self._summaries.scalars(loop.end, {"train/nonfinite_skipped_steps": self.count})


class StepLogger:
    """Writes training scalars and the original's log lines at their true step numbers, and
    shows the progress (``progress.py``: a line with the ETA on a terminal). With each speed it
    logs and writes the achieved TFLOP/s and MFU per device (``utilization.py``)."""

    def __init__(
        self,
        config: RunConfig,
        global_batch: int,
        clock: Callable[[], float],
        start: int,
        target: int,
        summaries: summaries_lib.Summaries | None,
        utilization: utilization_lib.StepUtilization | None = None,
    ):
        self._config = config
        self._global_batch = global_batch
        self._summaries = summaries
        self._utilization = utilization
        self._cost: utilization_lib.StepCost | None = None  # known after the first dispatch
        # Speed is measured over whole loops: the host sees steps finish once per loop.
        self._speed = periodic.PeriodicAction(
            every_steps=config.log_step_count_steps, clock=clock, start_step=start
        )
        self._first = start + 1
        self._target = target
        self.last_loss: float | None = None
        # A line redrawn in place on a terminal; plain lines (no carriage returns) elsewhere.
        self._bar = (
            progress.ProgressBar(start, target, sys.stderr)
            if progress.is_terminal(sys.stderr)
            else None
        )

    def measure(self, step_fn: Callable[..., Any], *args: Any) -> None:
        """Reads the cost of ``step_fn(*args)``, the run's first dispatch (once per run)."""
        if self._utilization is not None:
            self._cost = self._utilization.cost(step_fn, *args)

    def after_loop(self, loop: LoopEnd) -> None:
        """Writes the per-step metrics of steps ``begin + 1 .. end``."""
        begin, end, metrics = loop.begin, loop.end, loop.metrics
        losses = metrics["loss"]
        self.last_loss = float(losses[-1])
        if self._bar is not None:  # first: the lines below are printed above the updated bar
            self._bar.update(end - begin, self.last_loss)
        if self._summaries is not None:
            for step in periodic.steps_due(
                begin, end, self._config.save_summary_steps, self._first
            ):
                self._summaries.scalars(step, {k: v[step - begin - 1] for k, v in metrics.items()})
        for step in periodic.steps_due(begin, end, self._config.log_step_count_steps, self._first):
            summaries_lib.log_step(step, losses[step - begin - 1])
        if self._speed.due(end):
            self._log_speed(end)

    def _log_speed(self, end: int) -> None:
        elapsed = self._speed.seconds_since_fired()
        if elapsed > 0:
            steps_per_sec = (end - self._speed.last_step) / elapsed
            examples_per_sec = steps_per_sec * self._global_batch
            summaries_lib.log_speed(steps_per_sec, examples_per_sec)
            rates = {} if self._cost is None else self._cost.rates(steps_per_sec)
            utilization_lib.log_rates(rates)
            if self._bar is None and end < self._target:  # the bar shows it on a terminal
                logging.info(
                    "Progress: step %d / %d (%d%%), ETA %s",
                    end,
                    self._target,
                    100 * end // max(self._target, 1),
                    progress.eta(self._target - end, steps_per_sec),
                )
            if self._summaries is not None:
                self._summaries.scalars(
                    end,
                    {"global_step/sec": steps_per_sec, "examples/sec": examples_per_sec, **rates},
                )
        self._speed.fired(end)

    def close(self) -> None:
        """Closes the progress bar and makes the summaries durable."""
        if self._bar is not None:
            self._bar.close()
        if self._summaries is not None:
            self._summaries.flush()


class InputReports:
    """Whether the input held training back (``input/wait_fraction``, a warning once) and how
    many bad records it skipped (``input/skipped_records``, a warning when it changes)."""

    def __init__(self, idle: feeding.DeviceIdle, summaries: summaries_lib.Summaries | None):
        self._idle = idle
        self._summaries = summaries
        self._warned = False
        self._skipped: int | None = 0

    def after_loop(self, loop: LoopEnd) -> None:
        idle_secs, loop_secs = self._idle.end_loop()
        if loop_secs > 0:
            self._wait_fraction(loop.end, min(1.0, idle_secs / loop_secs))
        if loop.skipped is not None and loop.skipped != self._skipped:
            # Bad records the input skipped (skip_bad_records=True): never silent.
            if self._summaries is not None:
                self._summaries.scalars(loop.end, {"input/skipped_records": loop.skipped})
                logging.warning("The input has skipped %d bad records so far.", loop.skipped)
            self._skipped = loop.skipped

    def _wait_fraction(self, step: int, fraction: float) -> None:
        if self._summaries is not None:
            self._summaries.scalars(step, {"input/wait_fraction": fraction})
        if fraction > INPUT_BOUND_WARNING_FRACTION and not self._warned:
            self._warned = True
            logging.warning(
                "Training is input-bound: the devices waited for input %.0f%% of the loop ending "
                "at step %d. Try more input parallelism (--num_parallel_calls, the loader's "
                "process workers), caching or a cheaper preprocessing; TensorBoard shows "
                "input/wait_fraction.",
                100 * fraction,
                step,
            )


class Hooks:
    """The user's ``SessionRunHook``s, called once per loop; ``end`` runs on a normal finish."""

    def __init__(self, hooks: list[hooks_lib.SessionRunHook], session: hooks_lib.HookSession):
        self.hooks = hooks
        self.session = session
        self.context = hooks_lib.SessionRunContext(session)
        for hook in hooks:
            hook.begin()

    def started(self) -> None:
        """The model is restored (or initialised): ``after_create_session``."""
        for hook in self.hooks:
            hook.after_create_session(self.session, None)

    def loop_end(self, step: int, end: int) -> int:
        """The step the loop starting after ``step`` must end at (``end``, or a hook's)."""
        for hook in self.hooks:
            at = hook.end_loop_at(step)
            if at is not None and step < at < end:
                end = at
        return end

    def before_run(self, step: int) -> bool:
        """Calls ``before_run``; returns whether the loop's steps are to be traced."""
        if self.session.mode == ModeKeys.TRAIN:  # evaluation/prediction: the checkpoint's step
            self.session.global_step = step
        for hook in self.hooks:
            hook.before_run(self.context)
        return any(getattr(h, "tracing", False) for h in self.hooks)

    def after_run(self, begin: int, end: int, results: Mapping[str, Any]) -> bool:
        """Calls ``after_run``; returns whether a hook (on any process) asked to stop."""
        if not self.hooks:
            return False
        if self.session.mode == ModeKeys.TRAIN:
            self.session.global_step = end
        values = hooks_lib.SessionRunValues(results, begin, end)
        for hook in self.hooks:
            hook.after_run(self.context, values)
        # Every process runs the same steps: one host's stop is everyone's.
        return any(distributed.any_process(self.context.stop_requested))

    def end(self) -> None:
        """Calls ``end`` (the run finished without an error)."""
        for hook in self.hooks:
            hook.end(self.session)

    def close(self) -> None:
        """Stops a profiler trace left running by an error (cleanup; ``end`` was not called)."""
        for hook in self.hooks:
            if isinstance(hook, hooks_lib.ProfilerHook) and hook.tracing:
                hook.close()


class Saver:
    """Saves when ``save_checkpoints_steps/secs`` say, at the run's last step and on a stop; then
    runs the saving listeners (watchdog paused: they complete no step). A listener returning
    True stops training (TF >= 1.13's ``after_save``)."""

    def __init__(
        self,
        config: RunConfig,
        clock: Callable[[], float],
        start: int,
        checkpointer: ckpt_lib.Checkpointer,
        listeners: list[Callable[[int], Any]],
        watchdog: Watchdog,
    ):
        self._cadence = periodic.PeriodicAction(
            config.save_checkpoints_steps, config.save_checkpoints_secs, clock, start
        )
        self._by_time = config.save_checkpoints_secs is not None
        self._checkpointer = checkpointer
        self._listeners = listeners
        self._watchdog = watchdog
        self.model_dir = checkpointer.model_dir

    def after_loop(self, loop: LoopEnd, state: Any, final: bool) -> bool:
        """Saves ``state`` at ``loop.end`` if due (or ``final``); True: a listener said stop."""
        due = self._cadence.due(loop.end)
        if self._by_time:  # all processes must take part in a save: they agree on the time
            due = distributed.agree(due)
        if not (due or final):
            return False
        self._checkpointer.save_state(
            loop.end,
            state,
            loop.input_state,
            input_states=(
                distributed.allgather_json(loop.input_state) if jax.process_count() > 1 else None
            ),
        )
        logging.info("Saving checkpoints for %d into %s.", loop.end, self.model_dir)
        self._cadence.fired(loop.end)
        if not self._listeners:
            return False
        self._checkpointer.wait_until_finished()
        stop = False
        with self._watchdog.paused():
            for listener in self._listeners:
                stop = bool(listener(loop.end)) or stop
        stop = any(distributed.any_process(stop))  # one host's stop is everyone's
        if stop:
            logging.info("A saving listener asked to stop training at step %d.", loop.end)
        return stop


def _abandon_goodput(lost: list[int]) -> None:
    goodput.abandon_all(f"lost process {', '.join(map(str, lost))}")


class GoodputReport:
    """Writes the goodput record's line for each loop (``state/goodput.py``) and its buckets
    as TensorBoard scalars. The run's time is ``productive`` unless a phase inside it (a
    compile, a save, an evaluation) takes it; the input waits of the loop are moved out."""

    def __init__(
        self,
        model_dir: str,
        start: int,
        feeder: feeding.DevicePrefetcher,
        summaries: summaries_lib.Summaries | None,
        stack: contextlib.ExitStack,
    ):
        self._record = goodput.recorder(model_dir)
        self._record.train_start(start)  # the reader counts steps past it as lost
        self._feeder = feeder
        self._waited = feeder.input_wait_secs  # waits before the run are not the loop's
        self._summaries = summaries
        stack.callback(self._record.flush)  # last: the run's end (the final save's wait)
        stack.enter_context(self._record.phase("productive"))

    def after_loop(self, loop: LoopEnd) -> None:
        """Closes the loop's interval (called after the save, which it includes)."""
        waited = self._feeder.input_wait_secs
        self._record.move(waited - self._waited, "input")
        self._waited = waited
        self._record.interval(loop.begin, loop.end)
        if self._summaries is not None:
            self._summaries.scalars(loop.end, self._record.scalars())


@dataclasses.dataclass
class Setup:
    """What a training run needs from the Estimator.

    Attributes:
      config, model_dir, clock: the Estimator's.
      checkpointer: where checkpoints go.
      summaries: the training summaries (None on processes other than the chief).
      step_fn: ``(state, rng, features, labels) -> (state, StepOutput)`` on the mesh.
      rng: the replicated base key.
      state: the restored or initial train state.
      feeder: the bounded device prefetch of the input (``BlockPrefetcher`` with
        ``steps_per_device_call`` > 1: then ``step_fn`` runs a block of steps per call).
      start, target: the global step training starts at and must reach.
      global_batch: examples per step (for examples/sec).
      hooks, listeners: the user's.
      last_segment: False when more training follows this run in the same job.
      utilization: the Estimator's step costs and peak (for TFLOP/s and MFU; None: neither).
    """

    config: RunConfig
    model_dir: str
    clock: Callable[[], float]
    checkpointer: ckpt_lib.Checkpointer
    summaries: summaries_lib.Summaries | None
    step_fn: Callable
    rng: Any
    state: Any
    feeder: feeding.DevicePrefetcher
    start: int
    target: int
    global_batch: int
    hooks: Hooks
    listeners: list[Callable[[int], Any]]
    last_segment: bool = True
    utilization: utilization_lib.StepUtilization | None = None


def _reached(notice: distributed.PreemptionNotice, first: int, last: int) -> bool:
    """After a block of steps: whether a preemption notice asks to stop (asked at each step, as
    processes agree on the step through these calls); the block's last step is saved."""
    return any([notice.reached(step) for step in range(first, last + 1)])


class TrainingRun:
    """Runs the loops of one ``Estimator.train`` call; every part is entered on ``stack``."""

    def __init__(self, setup: Setup, stack: contextlib.ExitStack):
        s = self.setup = setup
        self.state, self.step = s.state, s.start
        self._blocks = isinstance(s.feeder, feeding.BlockPrefetcher)
        stack.callback(s.hooks.close)
        # Before the checkpointer's wait below: its cleanup (the last line) runs after it.
        self.goodput = GoodputReport(s.model_dir, s.start, s.feeder, s.summaries, stack)
        self.logger = StepLogger(
            s.config, s.global_batch, s.clock, s.start, s.target, s.summaries, s.utilization
        )
        stack.callback(self.logger.close)
        self.watchdog = stack.enter_context(Watchdog(s.config.watchdog_timeout_secs))
        self.watchdog.start(s.start)
        # Many hosts: a lost peer ends this process with one line and status 75 (not JAX's abort).
        watch = distributed.watch_peers(
            s.config.peer_timeout_secs,
            ckpt_lib.checkpoint_dir(s.config.model_dir) if s.config.model_dir else None,
        )
        if watch is not None and _abandon_goodput not in watch.on_lost:
            # The steps in flight when a peer is lost are in no checkpoint: the record says so.
            watch.on_lost.append(_abandon_goodput)
        stack.callback(s.checkpointer.wait_until_finished)
        self.idle = feeding.DeviceIdle()
        self.notice = stack.enter_context(distributed.PreemptionNotice())
        self.saver = Saver(s.config, s.clock, s.start, s.checkpointer, s.listeners, self.watchdog)
        self.reports: list[_Report] = [
            InvalidLabelCheck(s.checkpointer, s.summaries, s.config.allow_invalid_labels),
            NonfiniteCheck(s.checkpointer),
            SkippedStepsReport(s.summaries),
            self.logger,
            InputReports(self.idle, s.summaries),
        ]
        self.preempted = self.stopped = False
        self._input_state: Any = None
        self._skipped: int | None = None
        # (step, reduced EstimatorSpec.summaries) of this loop's summary steps only.
        self._summaries: list[tuple[int, Any]] = []
        self._measured = False  # whether the logger has the compiled step's cost

    def run(self) -> int:
        """Trains until the target step, the input's end, a stop or a preemption; the last step."""
        hooks, target = self.setup.hooks, self.setup.target
        hooks.started()
        more = True  # the Estimator saw a first batch
        while more and not (self.preempted or self.stopped):  # a saving listener may stop it
            self.notice.keep_handlers()
            begin = self.step
            length = hooks.loop_end(
                begin, min(begin + self.setup.config.iterations_per_loop, target)
            )
            outputs = self._steps(length - begin, traced=hooks.before_run(begin))
            if not outputs:
                break
            loop = self._sync(begin, outputs)
            for report in self.reports:
                report.after_loop(loop)
            self.stopped = hooks.after_run(begin, self.step, loop.metrics)
            # No more: the steps are done, or the input ended.
            more = not (self.preempted or self.stopped) and self.setup.feeder.has_next()
            final = not more
            self.stopped = self.saver.after_loop(loop, self.state, final) or self.stopped
            self.goodput.after_loop(loop)
        if self.step < target and not (self.preempted or self.stopped):
            feeder = self.setup.feeder
            logging.warning(
                "Input ended at step %d, before the %d steps asked for: this host read %d "
                "batches of %d examples in this run. A finite input_fn (num_epochs set) ends "
                "training early; repeat it (num_epochs=None) to train to the step asked for.",
                self.step,
                target,
                feeder.num_read,
                self.setup.global_batch // max(1, jax.process_count()),
            )
        hooks.end()
        if self.setup.last_segment or self.step < target or self.preempted or self.stopped:
            # Not after each of train_and_evaluate's segments: only where training ends.
            logging.info("Loss for final step: %s.", self.logger.last_loss)
        if self.preempted:
            stop: BaseException = (
                Interrupted(self.step, self.setup.model_dir)
                if self.notice.signal_name == "SIGINT"
                else Preempted(self.step, self.setup.model_dir)
            )
            logging.warning("%s", stop)
            raise stop
        return self.step

    def _steps(self, count: int, traced: bool) -> list[StepOutput]:
        """Dispatches up to ``count`` steps, one device call queued behind the running one;
        their outputs (summaries left out: ``_keep_summaries`` keeps the summary steps')."""
        s, feeder, idle = self.setup, self.setup.feeder, self.idle
        step_fn, rng, watchdog, notice = s.step_fn, s.rng, self.watchdog, self.notice
        outputs: list[StepOutput] = []
        previous = fed = None
        state, step, end = self.state, self.step, self.step + count
        while step < end:
            # A block never crosses the loop's end (a host sync: checkpoints, hooks, the last step).
            fed = feeder.next(end - step)
            if fed is None:
                break
            first, step = step + 1, step + fed.count
            if not self._measured:
                # Once per run, before the first call: it compiles the step for the call (or
                # finds it compiled), so its flops cost no second compile and no step any time.
                self.logger.measure(step_fn, state, rng, *fed.value)
                self._measured = True
            with jax.profiler.StepTraceAnnotation("train", step_num=first) if traced else _NO_SCOPE:
                state, out = step_fn(state, rng, *fed.value)
            if out.summaries is not None:
                self._keep_summaries(first, step, out.summaries)
                out = out.replace(summaries=None)
            outputs.append(out)
            self._input_state, self._skipped = fed.input_state, fed.num_skipped
            fed = None  # its device buffers go once the step is done with them
            if previous is not None:
                # At most one call queued behind the running one: the host never runs ahead
                # (holding batches) by more than that, whatever the loop length.
                previous.block_until_ready()
                watchdog.heartbeat(first - 1)
            previous = out.loss
            if notice.reached(step) if first == step else _reached(notice, first, step):
                # Every process stops after this same step and saves it (see PreemptionNotice);
                # the batches read ahead are not trained on.
                self.preempted = True
                break
            waited = feeder.input_wait_secs
            feeder.fill()  # read and transfer the next batches while this step runs
            idle.after_read(previous, feeder.input_wait_secs - waited)
        self.state, self.step = state, step
        return outputs

    def _keep_summaries(self, first: int, last: int, summaries: Any) -> None:
        """Keeps the image/histogram/text summaries of the summary steps in ``first..last``
        (stacked ``[last - first + 1]`` for a block); others' are dropped at once (device
        memory does not grow with the loop's length)."""
        if self.setup.summaries is None:
            return
        every, run_first = self.setup.config.save_summary_steps, self.setup.start + 1
        for step in periodic.steps_due(first - 1, last, every, run_first):
            if self._blocks:
                i = step - first
                self._summaries.append((step, jax.tree.map(lambda x, i=i: x[i], summaries)))
            else:
                self._summaries.append((step, summaries))

    def _sync(self, begin: int, outputs: list[StepOutput]) -> LoopEnd:
        """The loop's one host sync: its per-step outputs as ``[n]`` numpy arrays."""
        if self._summaries and self.setup.summaries is not None:
            for step, values in to_host(self._summaries):
                self.setup.summaries.summaries(step, values)
            self._summaries = []
        # Stacked on the devices: one transfer per metric, not one per step and metric (that
        # cost 6 us per step of host time, bench/overhead.py).
        if len(outputs) == 1:  # nothing to stack: spare the dispatch (one call in the loop)
            host = jax.tree.map(lambda v: np.reshape(v, (-1,)), to_host(outputs[0]))
        else:
            host = to_host(_stack(outputs))
        self.watchdog.heartbeat(self.step)
        return LoopEnd(
            begin, self.step, host.metrics(), host.signals, self._input_state, self._skipped
        )
