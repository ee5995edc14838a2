"""The Estimator: train, evaluate, predict and export a traced ``model_fn`` on a device mesh.

Who owns what:

| piece                                    | owner                   | where                       |
|------------------------------------------|-------------------------|-----------------------------|
| train, evaluate, predict, export: which  | ``Estimator``           | this module                 |
| checkpoint, input and run; summaries     |                         |                             |
| layers, loss, metrics, optimizer choice  | the user's ``model_fn`` | traced in ``ModelFnModule`` |
| gradients, cross-replica mean, optimizer | pure steps              | ``steps.train_step`` etc.   |
| update, weight decay, clip, EMA          |                         |                             |
| the steps on a mesh (jit, shardings,     | ``StepBuilder`` ->      | ``step_builder.py``         |
| donation), as a value                    | ``Steps``               |                             |
| the training loop and its parts (checks, | ``TrainingRun``         | ``loop.py``                 |
| reports, saves, listeners, watchdog)     |                         |                             |
| the evaluation loop (totals, label       | ``EvaluationRun``       | ``evaluation.py``           |
| check, masked batches, results written)  |                         |                             |
| the prediction loop (streamed results)   | ``PredictionRun``       | ``prediction.py``           |
| which checkpoint; the state restored or  | ``restoring``           | ``state/restoring.py``      |
| initialised (warm start)                 |                         |                             |
| user code once per host loop             | ``SessionRunHook``      | ``hooks.py``                |
| batches (per host)                       | the user's ``input_fn`` | host; ``batches.py`` checks |
|                                          |                         | and pads them               |
| batches ahead on the devices (bounded)   | ``DevicePrefetcher``    | ``feeding.py``              |
| position in the input                    | the input iterator      | ``get_state``/``set_state`` |
| checkpoints (model + input position)     | Orbax ``Checkpointer``  | ``model_dir/checkpoints``   |
| a train state <-> checkpoint items       | ``state_items`` etc.    | ``state/checkpoints.py``    |
| restoring one (train, eval, predict)     | ``restore_state``       | ``state/checkpoints.py``    |
| cadences (save, log, summaries)          | ``PeriodicAction``      | ``periodic.py``             |
| summaries and log lines                  | ``Summaries``           | ``model_dir[/eval]``        |
| many hosts (joining, comparing notes)    | ``jax.distributed``     | ``parallel/distributed.py`` |
| processes agree before step 0            | pre-flight check        | ``parallel/preflight.py``   |
| preemption: save at an agreed step       | ``PreemptionNotice``    | ``parallel/distributed.py`` |
| no step completes -> stacks, exit 75     | ``Watchdog``            | ``parallel/watchdog.py``    |

Replication: one ``jit`` over a ``Mesh`` whose ``data`` axis holds the replicas. Inside
``shard_map`` each replica runs ``model_fn`` on its slice of the batch (so the model sees
per-replica shapes and batch norm uses per-replica statistics, as on TPU); gradients are averaged
over replicas with ``pmean`` (the original ``CrossShardOptimizer``), so no user code changes
between one device and many.

The training loop streams: each step is dispatched (asynchronously) as soon as its batch is on
the devices, with ``RunConfig.device_prefetch`` batches transferred ahead and at most one more
step queued behind the running one, so input memory is O(prefetch x batch) whatever
``iterations_per_loop`` is (``RunConfig.steps_per_device_call``: blocks of steps per device
call, a ``lax.scan``, where the host's cost per step matters). Once per loop the host fetches
that loop's per-step metrics (one small scalar per step and metric), checks them for NaN,
writes them at their true step numbers, and may checkpoint. After every step (or device call)
the loop asks whether a preemption notice (SIGTERM) has come; if so it stops after that step,
saves it with the input position and raises ``Preempted`` (exit status 0).

With many processes (``jax.distributed``) each reads its own shard of the input; every process
takes part in each step, save and evaluation batch, and each host's input position is saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from estimax.estimator import batches as batches_lib
from estimax.estimator import best as best_lib
from estimax.estimator import evaluation as evaluation_lib
from estimax.estimator import export as export_lib
from estimax.estimator import feeding, logs, step_builder, utilization
from estimax.estimator import hooks as hooks_lib
from estimax.estimator import loop as loop_lib
from estimax.estimator import prediction as prediction_lib
from estimax.estimator import summaries as summaries_lib
from estimax.estimator.loop import NanLossError, Preempted  # noqa: F401 (public names)
from estimax.estimator.spec import (
    BestCheckpoint,
    EstimatorSpec,
    ModeKeys,
    RunConfig,
    original_keywords,
)
from estimax.estimator.steps import TrainState, get_global_step  # noqa: F401 (public names)
from estimax.ops import native
from estimax.parallel import layouts, preflight, replication
from estimax.state import checkpoints as ckpt_lib
from estimax.state import restoring

_RESERVED_PARAMS_KEYS = ("batch_size", "context")
# The constructor argument that sets each mode's global batch size (one place for the map).
_BATCH_SIZE_ARGS = {
    ModeKeys.TRAIN: "train_batch_size",
    ModeKeys.EVAL: "eval_batch_size",
    ModeKeys.PREDICT: "predict_batch_size",
}


def _with_model_dir(config: RunConfig, model_dir: str | None) -> RunConfig:
    """``config`` with ``model_dir`` (the argument's, the config's, or a new temporary one)."""
    if model_dir is not None:
        config = dataclasses.replace(config, model_dir=model_dir)
    if config.model_dir is None:
        config = dataclasses.replace(config, model_dir=tempfile.mkdtemp(prefix="estimax_"))
        logging.warning("Using temporary folder as model directory: %s", config.model_dir)
    return config


def _checked_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of the user's ``params``, refusing the keys the Estimator sets itself."""
    params = dict(params or {})
    reserved = [k for k in _RESERVED_PARAMS_KEYS if k in params]
    if reserved:
        raise ValueError(
            f"params must not contain the reserved keys {reserved}: the "
            "Estimator sets params['batch_size'] and params['context']."
        )
    return params


def _check_train_steps(steps: int | None, max_steps: int | None) -> None:
    """The original's errors for ``train(steps=, max_steps=)``."""
    if steps is not None and max_steps is not None:
        raise ValueError("Can not provide both steps and max_steps.")
    if steps is None and max_steps is None:
        raise ValueError("One of `steps` or `max_steps` must be set. Cannot be both `None`.")
    if steps is not None and steps <= 0:
        raise ValueError(f"Must specify steps > 0, given: {steps}")
    if max_steps is not None and max_steps <= 0:
        raise ValueError(f"Must specify max_steps > 0, given: {max_steps}")


@original_keywords
class Estimator:
    """Trains, evaluates, predicts with and exports a model defined by a ``model_fn``."""

    def __init__(
        self,
        model_fn: Callable[..., EstimatorSpec],
        config: RunConfig | None = None,
        params: Mapping[str, Any] | None = None,
        train_batch_size: int | None = None,
        eval_batch_size: int | None = None,
        predict_batch_size: int | None = None,
        model_dir: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        warm_start_from: Any = None,
    ):
        """Creates an Estimator.

        Args:
          model_fn: ``model_fn(features, labels, mode, params[, config]) -> EstimatorSpec``,
            traced (never run eagerly); Flax modules created in it are owned by the Estimator.
          config: a RunConfig; its ``model_dir`` is where checkpoints and summaries go.
          params: hyperparameters passed to ``model_fn`` and ``input_fn``; ``batch_size`` and
            ``context`` are reserved (the Estimator sets them).
          train_batch_size, eval_batch_size, predict_batch_size: GLOBAL batch sizes; each must
            divide by the number of replicas.
          model_dir: overrides ``config.model_dir``.
          clock: time source for the ``*_secs`` settings (tests inject one).
          warm_start_from: a checkpoint path or ``estimax.WarmStartSettings`` to initialise the
            variables from when ``model_dir`` has no checkpoint of its own (a TensorFlow
            checkpoint of the original models, or an estimax one; ``state.warm_start``).
        """
        config = _with_model_dir(config or RunConfig(), model_dir)
        params = _checked_params(params)
        # The steps close over these, never over the Estimator (compile_for builds them again).
        self._builder = step_builder.StepBuilder(model_fn, params, config)
        self.config = config
        self.params = params
        assert config.model_dir is not None  # set above
        self.model_dir: str = config.model_dir
        # Replicas x cores per replica (RunConfig.num_cores_per_replica; parallel.layouts).
        self.mesh = self._builder.make_mesh()
        self.num_replicas = layouts.num_replicas(self.mesh)
        self._batch_sizes = {
            ModeKeys.TRAIN: train_batch_size,
            ModeKeys.EVAL: eval_batch_size,
            ModeKeys.PREDICT: predict_batch_size,
        }
        for mode, size in self._batch_sizes.items():
            if size is not None:
                replication.per_replica_batch(size, self.num_replicas, _BATCH_SIZE_ARGS[mode])
        self._clock = clock
        logs.show_progress()  # TF printed `loss = X, step = N` without any logging set-up
        # Built once (jitted, traced at first use): what train, evaluate and predict run.
        self._steps = self._builder.build(self.mesh, self._batch_sizes)
        # XLA counts a loop's body once: the micro-batch loop's k bodies, where it is a loop.
        k = config.gradient_accumulation_steps
        self._utilization = utilization.StepUtilization(
            list(self.mesh.devices.flat),
            loop_multiplier=1 if step_builder.accumulation_unrolled(self.mesh) else k,
        )
        self._checkpointer: ckpt_lib.Checkpointer | None = None
        self._summaries: dict[str, summaries_lib.Summaries] = {}
        self._is_chief = jax.process_index() == 0
        # The variables' first values when model_dir has no checkpoint (``train_state``).
        self._warm_start_from = warm_start_from
        if jax.default_backend() == "cpu":
            # Which convolution kernels estimax.ops will call: a 2-5x difference on CPUs.
            logging.info("CPU convolutions (estimax.ops): %s", native.status())

    @property
    def step_builder(self) -> step_builder.StepBuilder:
        """What builds this Estimator's steps (its ``model_fn``, params and config)."""
        return self._builder

    @property
    def batch_sizes(self) -> dict[str, int | None]:
        """The global batch size of each mode (``ModeKeys.TRAIN``/``EVAL``/``PREDICT``)."""
        return dict(self._batch_sizes)

    @property
    def clock(self) -> Callable[[], float]:
        """The time source of the ``*_secs`` cadences (injectable for tests)."""
        return self._clock

    def _batch_size(self, mode: str) -> int:
        size = self._batch_sizes[mode]
        if size is None:
            raise ValueError(
                f"Estimator needs {_BATCH_SIZE_ARGS[mode]} to run mode {mode!r}; pass it to the "
                "constructor (a global batch size)."
            )
        return size

    # ------------------------------------------------------------------ checkpoints and input

    def _get_checkpointer(self) -> ckpt_lib.Checkpointer:
        if self._checkpointer is None:
            best = self.config.keep_best_checkpoint
            self._checkpointer = ckpt_lib.Checkpointer(
                self.model_dir,
                self.config.keep_checkpoint_max,
                keep_also=None if best is None else best_lib.KeepBest(self.model_dir, best),
            )
        return self._checkpointer

    def best_checkpoint(self) -> str | None:
        """The path of the best checkpoint of ``model_dir``, or None if none was evaluated.

        Best by ``RunConfig.keep_best_checkpoint`` (default: the smallest ``loss`` in
        ``model_dir/eval``), among the checkpoints that still exist; what
        ``checkpoint_path="best"`` names.
        """
        best = self.config.keep_best_checkpoint or BestCheckpoint()
        step = best_lib.best_checkpoint_step(
            self.model_dir, best, self._get_checkpointer().all_steps()
        )
        return None if step is None else ckpt_lib.step_path(self.model_dir, step)

    def _open_checkpoint(
        self, checkpoint_path: str | None
    ) -> tuple[ckpt_lib.Checkpointer, int | None]:
        """The checkpointer and step of ``checkpoint_path`` ("best": ``best_checkpoint()``), or
        of ``model_dir``'s latest."""
        return restoring.open_checkpoint(
            self.model_dir, checkpoint_path, self._get_checkpointer, self.best_checkpoint
        )

    def latest_checkpoint(self) -> str | None:
        """Returns the path of the newest complete checkpoint in ``model_dir``, or None."""
        step = self._get_checkpointer().latest_step()
        if step is None:
            return None
        return ckpt_lib.step_path(self.model_dir, step)

    def get_global_step(self) -> int:
        """Returns the step of the newest checkpoint in ``model_dir`` (0 if there is none)."""
        return self._get_checkpointer().latest_step() or 0

    def get_variables(self, checkpoint_path: str | None = None) -> dict[str, Any]:
        """Returns the variables of a checkpoint (default: the latest) as numpy arrays.

        ``{"params": ..., <collection>: ...}`` nested by module name; the counterpart of the
        original's ``get_variable_value``/``get_variable_names``.
        """
        checkpointer, step = self._open_checkpoint(checkpoint_path)
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.model_dir}: train first.")
        # Host numpy whatever devices wrote it: no abstract layout on this mesh to restore to.
        return ckpt_lib.variables_of(checkpointer.restore_numpy(step, ckpt_lib.MODEL_ITEM))

    def _load_variables(
        self, sample: Any, mode: str, checkpoint_path: str | None
    ) -> tuple[dict, int]:
        """Returns (variables, step) of the given/latest checkpoint, for EVAL or PREDICT."""
        checkpointer, step = self._open_checkpoint(checkpoint_path)
        return restoring.load_variables(self._steps, self.mesh, checkpointer, step, sample, mode)

    def _feeder(
        self, mode: str, input_fn: Callable[[dict], Iterable], limit: int | None = None
    ) -> tuple[feeding.DevicePrefetcher, list[Any]]:
        """``batches.feeder`` for ``mode``: its prefetcher, and the first batch's rows."""
        return batches_lib.feeder(
            mode, input_fn, self.params, self._batch_size(mode), self.mesh, self.config, limit
        )

    # ------------------------------------------------------------------ training

    def train(
        self,
        input_fn: Callable[[dict], Iterable],
        hooks: Iterable[hooks_lib.SessionRunHook] | None = None,
        steps: int | None = None,
        max_steps: int | None = None,
        saving_listeners: Iterable[Any] | None = None,
        checkpoint_path: str | None = None,
        *,
        last_segment: bool = True,
    ) -> Estimator:
        """Trains, resuming from the latest checkpoint in ``model_dir`` (one stopped early stays
        stopped: nothing is trained, unless ``RunConfig(train_after_early_stop=True)``).

        Args:
          input_fn: ``input_fn(params) -> iterable of (features, labels)`` per-host batches of
            ``params["batch_size"]`` examples. If its iterator has ``get_state``/``set_state``,
            the input position is saved with each checkpoint and restored on resume.
          hooks: ``estimax.SessionRunHook``s, called once per loop of ``iterations_per_loop``
            steps with that loop's per-step metrics; ``request_stop()`` ends training after the
            loop, with a checkpoint there.
          steps: train this many more steps (incremental).
          max_steps: train until the global step reaches this (absolute); already there -> no-op.
          saving_listeners: run after each checkpoint is complete on disk: callables
            ``listener(step)`` or objects with ``after_save(session, step)`` (the original's
            ``CheckpointSaverListener``); one returning True stops training (TF >= 1.13).
          checkpoint_path: when ``model_dir`` has no checkpoint yet, start from this one (its
            whole state; ``"best"``: ``best_checkpoint()``); an older one of this model_dir is
            refused (it would overwrite the later steps' history).
          last_segment: False when more training follows in the same job (train_and_evaluate's
            segments): the ``Loss for final step`` line is left to the last one.

        Returns:
          self, as the original.
        """
        _check_train_steps(steps, max_steps)
        user_hooks = hooks_lib.all_hooks(hooks)
        if self.config.profile_steps is not None:
            user_hooks.append(hooks_lib.ProfilerHook(self.config.profile_steps))
        listeners = [hooks_lib.as_listener(x) for x in saving_listeners or []]
        if best_lib.held_back(self.model_dir, self.config) is not None:
            return self
        while True:
            try:
                self._run_training(
                    input_fn, steps, max_steps, listeners, user_hooks, checkpoint_path, last_segment
                )
                break
            except ckpt_lib.CorruptCheckpointError as e:
                # The damaged step (one without a manifest that Orbax could not read)
                # has been set aside, so this cannot repeat for it: resume from the previous one.
                logging.warning("%s Resuming from the previous checkpoint now.", e)
        return self

    def _run_training(
        self,
        input_fn: Callable[[dict], Iterable],
        steps: int | None,
        max_steps: int | None,
        listeners: list[Callable[[int], Any]],
        hooks: list[hooks_lib.SessionRunHook],
        checkpoint_path: str | None = None,
        last_segment: bool = True,
    ) -> int:
        checkpointer = self._get_checkpointer()
        source, start = restoring.training_start(
            checkpointer, checkpoint_path, self.best_checkpoint
        )
        if max_steps is not None and start >= max_steps:
            logging.info("Skipping training since max_steps has already saved.")
            return start
        target = start + steps if steps is not None else max_steps
        assert target is not None  # train() asks for steps or max_steps
        session = hooks_lib.HookSession(ModeKeys.TRAIN, self.model_dir, start)
        user_hooks = loop_lib.Hooks(hooks, session)
        feeder, sample = self._feeder(ModeKeys.TRAIN, input_fn, limit=target - start)
        if start:
            batches_lib.restore_input_position(feeder, source, start)
        if not feeder.has_next():
            raise ValueError(
                "input_fn produced no training batch: its input ended before a whole batch of "
                f"{replication.per_host_batch(self._batch_size(ModeKeys.TRAIN))} examples (this "
                "host's part of train_batch_size). A finite input (num_epochs=1) with fewer "
                "examples than that, and drop_remainder, yields none: repeat it "
                "(num_epochs=None)."
            )
        state = restoring.train_state(
            self._steps,
            self.mesh,
            source,
            start,
            sample.pop(),
            self._warm_start_from,
            self.model_dir,
        )
        # With many processes: all must train the same config, batches and parameter shapes.
        preflight.check_training(self.config, self._batch_sizes, state.params, start)
        setup = loop_lib.Setup(
            config=self.config,
            model_dir=self.model_dir,
            clock=self._clock,
            checkpointer=checkpointer,
            summaries=self._summary_writer("") if self._is_chief else None,
            step_fn=(
                self._steps.train_loop
                if self.config.steps_per_device_call > 1
                else self._steps.train
            ),
            rng=jax.device_put(self._steps.rng, replication.replicated(self.mesh)),
            state=state,
            feeder=feeder,
            start=start,
            target=target,
            global_batch=self._batch_size(ModeKeys.TRAIN),
            hooks=user_hooks,
            listeners=listeners,
            last_segment=last_segment,
            utilization=self._utilization,
        )
        del state  # the run owns it (its buffers are donated to the steps)
        with contextlib.ExitStack() as stack:
            # Every part's cleanup runs whatever raises (a failed final save included).
            return loop_lib.TrainingRun(setup, stack).run()

    # ------------------------------------------------------------------ evaluation

    def evaluate(
        self,
        input_fn: Callable[[dict], Iterable],
        steps: int | None = None,
        hooks: Iterable[hooks_lib.SessionRunHook] | None = None,
        checkpoint_path: str | None = None,
        name: str | None = None,
    ) -> dict[str, float]:
        """Evaluates a checkpoint on ``input_fn``'s examples.

        With ``steps=None`` every example of the (finite) eval input counts exactly once: the
        last, partial batch is padded and the padding masked out of every metric, on any number
        of devices (the original dropped the remainder: 848 of ImageNet's 50,000 images).
        Batches stream through a bounded device prefetch: memory does not grow with the input.

        Args:
          input_fn: ``input_fn(params) -> iterable of (features, labels)``, finite.
          steps: evaluate at most this many batches.
          hooks: ``estimax.SessionRunHook``s, called once per ``iterations_per_loop`` batches
            with the metrics so far (``request_stop()`` ends the evaluation there); ``end``
            sees the results in ``session.results``.
          checkpoint_path: a checkpoint directory, or ``"best"`` (``best_checkpoint()``); None
            means the latest in ``model_dir``.
          name: write results to ``model_dir/eval_<name>`` instead of ``model_dir/eval``.

        Returns:
          ``{metric: value, "loss": ..., "global_step": step, "num_examples": n}``.
        """
        if steps is not None and steps <= 0:
            raise ValueError(f"Must specify steps > 0, given: {steps}")
        run = loop_lib.Hooks(
            hooks_lib.all_hooks(hooks), hooks_lib.HookSession(ModeKeys.EVAL, self.model_dir, 0)
        )
        feeder, sample = self._feeder(ModeKeys.EVAL, input_fn, limit=steps)
        subdir = "eval" if name is None else f"eval_{name}"
        evaluation = evaluation_lib.EvaluationRun(
            self._steps,
            self.mesh,
            self.config,
            self._clock,
            self._batch_size(ModeKeys.EVAL),
            functools.partial(self._summary_writer, subdir) if self._is_chief else None,
        )
        load = functools.partial(
            self._load_variables, mode=ModeKeys.EVAL, checkpoint_path=checkpoint_path
        )
        return evaluation.run(feeder, sample, run, load)

    # ------------------------------------------------------------------ prediction

    def predict(
        self,
        input_fn: Callable[[dict], Iterable],
        predict_keys: list[str] | None = None,
        hooks: Iterable[hooks_lib.SessionRunHook] | None = None,
        checkpoint_path: str | None = None,
        yield_single_examples: bool = True,
    ) -> Iterator[Any]:
        """Yields predictions for every example of ``input_fn`` (padding rows removed).

        Streams: results are yielded while the input is still being read, with a bounded number
        of batches in flight, so memory does not depend on the input's length.

        Args:
          input_fn: yields feature batches, or ``(features, labels)`` (labels ignored).
          predict_keys: keep only these keys of a predictions dict.
          hooks: ``estimax.SessionRunHook``s, called once per batch with its predictions on
            the host (``request_stop()`` ends the prediction after that batch).
          checkpoint_path: a checkpoint directory, or ``"best"`` (``best_checkpoint()``); None
            means the latest in ``model_dir``.
          yield_single_examples: yield one value per example (else one per batch).
        """
        run = loop_lib.Hooks(
            hooks_lib.all_hooks(hooks), hooks_lib.HookSession(ModeKeys.PREDICT, self.model_dir, 0)
        )
        feeder, sample = self._feeder(ModeKeys.PREDICT, input_fn)
        prediction = prediction_lib.PredictionRun(self._steps, predict_keys, yield_single_examples)
        load = functools.partial(
            self._load_variables, mode=ModeKeys.PREDICT, checkpoint_path=checkpoint_path
        )
        yield from prediction.run(feeder, sample, run, load)

    # ------------------------------------------------------------------ export

    def export_saved_model(
        self,
        export_dir_base: str,
        serving_input_receiver_fn: Callable[[], Any],
        checkpoint_path: str | None = None,
        platforms: tuple[str, ...] | None = None,
    ) -> str:
        """Exports the model for serving; returns the export directory.

        Writes ``export_dir_base/<timestamp>/``: the PREDICT-mode computation as a serialized
        ``jax.export`` artifact (StableHLO, batch dimension symbolic), its variables, and a
        ``signature.json``. ``estimax.export.load`` runs it without the model's Python code.

        Args:
          export_dir_base: parent directory of the timestamped export.
          serving_input_receiver_fn: returns the features' spec: a pytree of ``TensorSpec`` whose
            first dimension is None (the batch).
          checkpoint_path: a checkpoint directory, or ``"best"`` (``best_checkpoint()``); None
            means the latest in ``model_dir``.
          platforms: platforms to lower for (default: cpu, cuda and tpu).
        """
        input_specs = serving_input_receiver_fn()
        export_lib.check_input_specs(input_specs)
        variables, step = self._load_variables(
            (export_lib.example_batch(input_specs), None), ModeKeys.PREDICT, checkpoint_path
        )
        serving = self._steps.serve

        def serve(variables: Any, features: Any) -> Any:
            return serving(variables, jnp.asarray(step, jnp.int32), features)

        return export_lib.export_saved_model(
            export_dir_base, serve, variables, input_specs, step, platforms
        )

    # ------------------------------------------------------------------ summaries

    def _summary_writer(self, subdir: str) -> summaries_lib.Summaries:
        if subdir not in self._summaries:
            self._summaries[subdir] = summaries_lib.Summaries(
                os.path.join(self.model_dir, subdir),
                # A redone evaluation (killed before it was recorded) adds no second point.
                unique_steps=subdir.startswith("eval"),
            )
        return self._summaries[subdir]

    def close(self) -> None:
        """Flushes summaries and finishes pending checkpoint writes."""
        for writer in self._summaries.values():
            writer.close()
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

    def get_variable_names(self, checkpoint_path: str | None = None) -> list[str]:
        """The variables' names in a checkpoint (default: the newest), as warm starts name them
        (``bert/encoder/layer_0/attention/self/query/kernel``) and ``global_step``."""
        from estimax.state import variables

        return variables.get_variable_names(self, checkpoint_path)

    def get_variable_value(self, name: str, checkpoint_path: str | None = None) -> Any:
        """The value (numpy) of variable ``name`` in a checkpoint (default: the newest)."""
        from estimax.state import variables

        return variables.get_variable_value(self, name, checkpoint_path)
