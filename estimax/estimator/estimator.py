"""The Estimator: train, evaluate, predict and export a traced ``model_fn`` on a device mesh.

Who owns what:

| piece                                    | owner                   | where                       |
|------------------------------------------|-------------------------|-----------------------------|
| layers, loss, metrics, optimizer choice  | the user's ``model_fn`` | traced in ``ModelFnModule`` |
| gradients, cross-replica mean, optimizer | pure steps              | ``steps.train_step`` etc.   |
| update, weight decay, clip, EMA          |                         |                             |
| the steps on the mesh (jit, shardings,   | ``Estimator``           | ``_*_fn`` below             |
| donation); eval and predict loops        |                         |                             |
| the training loop and its parts (checks, | ``TrainingRun``         | ``loop.py``                 |
| reports, saves, listeners, watchdog)     |                         |                             |
| user code once per host loop             | ``SessionRunHook``      | ``hooks.py``                |
| batches (per host)                       | the user's ``input_fn`` | host; we pad/shard them     |
| batches ahead on the devices (bounded)   | ``DevicePrefetcher``    | ``feeding.py``; ``_feeder`` |
| position in the input                    | the input iterator      | ``get_state``/``set_state`` |
| checkpoints (model + input position)     | Orbax ``Checkpointer``  | ``model_dir/checkpoints``   |
| a train state <-> checkpoint items       | ``state_items`` etc.    | ``checkpoints.py``          |
| restoring one (train, eval, predict)     | ``restore_state``       | ``checkpoints.py``          |
| cadences (save, log, summaries)          | ``PeriodicAction``      | ``periodic.py``             |
| summaries and log lines                  | ``Summaries``           | ``model_dir[/eval]``        |
| many hosts (joining, comparing notes)    | ``jax.distributed``     | ``distributed.py``          |
| processes agree before step 0            | pre-flight check        | ``preflight.py``            |
| preemption: save at an agreed step       | ``PreemptionNotice``    | ``distributed.py``          |
| no step completes -> stacks, exit 75     | ``Watchdog``            | ``watchdog.py``             |

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
import copy
import dataclasses
import functools
import inspect
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import PartitionSpec as P

from estimax.estimator import best as best_lib
from estimax.estimator import checkpoints as ckpt_lib
from estimax.estimator import compile as compile_lib
from estimax.estimator import distributed, feeding, label_check, logs, preflight, replication
from estimax.estimator import export as export_lib
from estimax.estimator import hooks as hooks_lib
from estimax.estimator import loop as loop_lib
from estimax.estimator import steps as steps_lib
from estimax.estimator import summaries as summaries_lib
from estimax.estimator.loop import NanLossError, Preempted  # noqa: F401 (public names)
from estimax.estimator.replication import REPLICA_AXIS
from estimax.estimator.spec import (
    BestCheckpoint,
    EstimatorSpec,
    InputContext,
    ModeKeys,
    RunConfig,
    original_keywords,
)
from estimax.estimator.steps import TrainState, get_global_step  # noqa: F401 (public names)
from estimax.ops import native

_RESERVED_PARAMS_KEYS = ("batch_size", "context")
_MODEL_FN_ARGS = ("features", "labels", "mode", "params", "config")
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


def _is_global(state: Any) -> bool:
    """An input position of the global order (estimax.data.order): the same on every host."""
    return isinstance(state, Mapping) and state.get("order") == "global"


def _input_state_of_this_process(meta: Mapping[str, Any]) -> Any:
    """This process's input position in a checkpoint's meta (each host saved its own)."""
    states = meta.get("input_states")
    if states and len(states) != jax.process_count() and all(map(_is_global, states)):
        # A position in the global order means the same on any number of hosts.
        return states[0]
    if states is None:  # written by one process, or before positions were kept per host
        state = meta.get("input_state")
        if jax.process_count() > 1 and state is not None and not _is_global(state):
            logging.warning(
                "The checkpoint holds one input position (written by a single process); every "
                "process resumes from it."
            )
        return meta.get("input_state")
    if len(states) != jax.process_count():
        logging.warning(
            "The checkpoint holds the input positions of %d processes; this job has %d. The "
            "input restarts from its beginning (the examples seen differ from an "
            "uninterrupted run).",
            len(states),
            jax.process_count(),
        )
        return None
    return states[jax.process_index()]


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


def _split_batch(element: Any) -> tuple[Any, Any]:
    if isinstance(element, tuple) and len(element) == 2:
        return element
    return element, None


def _check_rows(features: Any, labels: Any) -> None:
    """One error naming every shape when a batch's arrays disagree on their leading size."""
    # Per batch on the input path: the leading sizes only; names are made for the error.
    sizes = {
        np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves((features, labels))
    }
    if len(sizes) <= 1:
        return
    described = ", ".join(
        f"{part}{jax.tree_util.keystr(path)} {np.shape(leaf)}"
        for part, tree in (("features", features), ("labels", labels))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
    raise ValueError(
        f"input_fn yielded a batch whose arrays differ in batch size: {described}; "
        "features and labels must have the same leading (batch) size."
    )


def _check_train_batch(features: Any, per_host: int) -> None:
    first = features if isinstance(features, np.ndarray) else jax.tree.leaves(features)[0]
    size = int(np.shape(first)[0])
    if size != per_host:
        raise ValueError(
            f"input_fn yielded a training batch of {size} examples; this host must "
            f"feed {per_host} (train_batch_size / number of hosts). Training "
            "batches need a fixed size: repeat the data and drop the remainder."
        )


def _restore_input_position(
    feeder: feeding.DevicePrefetcher, checkpointer: ckpt_lib.Checkpointer, step: int
) -> None:
    """Puts the input where it was when the checkpoint at ``step`` was written (if it can)."""
    input_state = _input_state_of_this_process(checkpointer.restore_meta(step))
    iterator = feeder.iterator
    if input_state is not None and hasattr(iterator, "set_state"):
        iterator.set_state(input_state)
    elif input_state is not None:
        logging.warning(
            "The input iterator has no set_state(): resuming at step %d "
            "restarts the input from its beginning.",
            step,
        )


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


def _same_dir(a: str, b: str) -> bool:
    """Whether two model_dir paths name the same directory."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _leading_rows(tree: Any, n: int | None) -> Any:
    """Copies of the first ``n`` (None: all) rows of every leaf (a sample that keeps no batch)."""
    return jax.tree.map(lambda x: np.array(np.asarray(x)[:n]), tree)


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
            checkpoint of the original models, or an estimax one; ``estimator.warm_start``).
        """
        config = _with_model_dir(config or RunConfig(), model_dir)
        params = _checked_params(params)
        self._model_fn_args = self._check_model_fn(model_fn)
        self._model_fn = model_fn
        self.config = config
        self.params = params
        assert config.model_dir is not None  # set above
        self.model_dir: str = config.model_dir
        self.mesh = replication.make_mesh(config.num_shards)
        self.num_replicas = self.mesh.size
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
        self._base_rng = jax.random.PRNGKey(config.seed)
        self._checkpointer: ckpt_lib.Checkpointer | None = None
        self._compiled: dict[Any, Any] = {}  # jitted step functions, by what they compute
        self._summaries: dict[str, summaries_lib.Summaries] = {}
        self._is_chief = jax.process_index() == 0
        # The variables' first values when model_dir has no checkpoint (``_train_state``).
        self._warm_start_from = warm_start_from
        if jax.default_backend() == "cpu":
            # Which convolution kernels estimax.ops will call: a 2-5x difference on CPUs.
            logging.info("CPU convolutions (estimax.ops): %s", native.status())

    @property
    def clock(self) -> Callable[[], float]:
        """The time source of the ``*_secs`` cadences (injectable for tests)."""
        return self._clock

    # ------------------------------------------------------------------ model_fn plumbing

    @staticmethod
    def _check_model_fn(model_fn: Callable) -> tuple[str, ...]:
        try:
            names = tuple(inspect.signature(model_fn).parameters)
        except (TypeError, ValueError):
            return ("features", "labels", "mode", "params")
        if "features" not in names:
            raise ValueError(
                f"model_fn {model_fn!r} must have a `features` argument; it has {list(names)}."
            )
        unknown = [n for n in names if n not in _MODEL_FN_ARGS]
        if unknown:
            raise ValueError(
                f"model_fn has unexpected argument(s) {unknown}; allowed: {list(_MODEL_FN_ARGS)}."
            )
        return names

    def _call_model_fn(self, features, labels, mode) -> EstimatorSpec:
        params = dict(self.params)
        params["batch_size"] = self._per_replica_batch(mode)
        available = {
            "features": features,
            "labels": labels,
            "mode": mode,
            "params": params,
            "config": self.config,
        }
        return self._model_fn(**{n: available[n] for n in self._model_fn_args})

    def _module(self, mode: str) -> steps_lib.ModelFnModule:
        return steps_lib.ModelFnModule(call=self._call_model_fn, mode=mode)

    def _batch_size(self, mode: str) -> int:
        size = self._batch_sizes[mode]
        if size is None:
            raise ValueError(
                f"Estimator needs {_BATCH_SIZE_ARGS[mode]} to run mode {mode!r}; pass it to the "
                "constructor (a global batch size)."
            )
        return size

    def _per_replica_batch(self, mode: str) -> int | None:
        size = self._batch_sizes[mode]
        return None if size is None else size // self.num_replicas

    def _input_params(self, mode: str) -> dict:
        global_batch = self._batch_size(mode)
        params = dict(self.params)
        params["batch_size"] = replication.per_host_batch(global_batch)
        params["context"] = InputContext(
            host_index=jax.process_index(),
            num_hosts=jax.process_count(),
            num_replicas=self.num_replicas,
            global_batch_size=global_batch,
        )
        return params

    # ------------------------------------------------------------------ state

    def _init_fn(self, rng: jax.Array, features: Any, labels: Any) -> TrainState:
        return steps_lib.init_state(self._module(ModeKeys.TRAIN), rng, (features, labels))

    def _init_variables_fn(self, mode: str) -> Callable:
        def init(rng, features, labels):
            return steps_lib.init_variables(self._module(mode), rng, (features, labels))

        return init

    def _with_replicated_sharding(self, abstract: Any) -> Any:
        sharding = replication.replicated(self.mesh)
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract
        )

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
        if checkpoint_path is None:
            checkpointer = self._get_checkpointer()
            return checkpointer, checkpointer.latest_step()
        if checkpoint_path == "best":
            best = self.best_checkpoint()
            if best is None:
                raise FileNotFoundError(
                    f"checkpoint_path='best': no checkpoint of {self.model_dir} has a recorded "
                    "evaluation yet (evaluate first: Estimator.evaluate or train_and_evaluate)."
                )
            checkpoint_path = best
        model_dir, step = ckpt_lib.step_from_checkpoint_path(checkpoint_path)
        checkpointer = ckpt_lib.Checkpointer(model_dir, None, read_only=True)
        if step not in checkpointer.all_steps():
            raise FileNotFoundError(f"No complete checkpoint at {checkpoint_path}.")
        return checkpointer, step

    def _train_state(self, checkpointer: ckpt_lib.Checkpointer, step: int, sample: Any) -> Any:
        """The train state at ``step`` (restored), or initialised from ``sample`` at step 0."""
        if not step:
            state = replication.run_init(self._init_fn, self.mesh, self._base_rng, *sample)
            if self._warm_start_from is not None:  # no checkpoint of our own yet
                from estimax.estimator import warm_start

                state, _ = warm_start.warm_start(self._warm_start_from, state)
            return state
        abstract = self._with_replicated_sharding(
            jax.eval_shape(self._init_fn, self._base_rng, *sample)
        )
        state = checkpointer.restore_state(step, abstract)
        if state.ema_params is None:
            if jax.tree.leaves(abstract.ema_params):
                logging.warning(
                    "Checkpoint %d has no EMA of the weights; starting it from them.", step
                )
            ema = state.params if jax.tree.leaves(abstract.ema_params) else abstract.ema_params
            state = dataclasses.replace(state, ema_params=ema)
        logging.info("Restored checkpoint at step %d from %s", step, self.model_dir)
        return state

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
        """Returns (variables, step) of the given/latest checkpoint, for EVAL or PREDICT.

        Uses the EMA of the weights when the checkpoint has one. Without any checkpoint the
        model is initialised, with a warning, as the original did.
        """
        checkpointer, step = self._open_checkpoint(checkpoint_path)
        init = self._init_variables_fn(mode)
        if step is None:
            logging.warning(
                "Could not find trained model in model_dir: %s, running initialization to %s.",
                self.model_dir,
                mode,
            )
            variables = replication.run_init(init, self.mesh, self._base_rng, *sample)
            return dict(variables), 0
        variables = dict(
            self._with_replicated_sharding(jax.eval_shape(init, self._base_rng, *sample))
        )
        params = variables.pop("params", {})
        abstract = TrainState(
            step=cast(
                Any, jax.ShapeDtypeStruct((), jnp.int32, sharding=replication.replicated(self.mesh))
            ),
            params=params,
            model_state=variables,
            opt_state={},
            ema_params=params,  # read only if the checkpoint has an EMA
        )
        state = checkpointer.restore_state(step, abstract)
        chosen = state.params if state.ema_params is None else state.ema_params
        return {"params": chosen, **state.model_state}, step

    # ------------------------------------------------------------------ feeding

    def _feeder(
        self, mode: str, input_fn: Callable[[dict], Iterable], limit: int | None = None
    ) -> tuple[feeding.DevicePrefetcher, list[Any]]:
        """The one input set-up of the three modes: ``input_fn`` called with this host's params,
        each batch checked (training: its size) or padded (evaluation, prediction), and put on
        the mesh ahead of use.

        Returns:
          the prefetcher, and a list that holds, once the first batch is read, its first
          per-replica rows ``(features, labels)``: what the model is initialised or restored with.
        """
        per_host = replication.per_host_batch(self._batch_size(mode))
        rows = self._per_replica_batch(mode) or 1
        iterable = input_fn(self._input_params(mode))
        iterator = iter(iterable)
        sample: list[Any] = []

        def prepare(element: Any) -> tuple[Any, int | None]:
            host: Any
            features, labels = _split_batch(element)
            if mode == ModeKeys.PREDICT:
                labels = None
            _check_rows(features, labels)
            if mode == ModeKeys.TRAIN:
                _check_train_batch(features, per_host)
                host, info = (features, labels), None
            else:
                (features, labels), mask, n = replication.pad_batch((features, labels), per_host)
                host, info = ((features, labels, mask) if mode == ModeKeys.EVAL else features), n
            if not sample:
                sample.append(_leading_rows((features, labels), rows))
            return host, info

        block = self.config.steps_per_device_call if mode == ModeKeys.TRAIN else 1
        feeder: feeding.DevicePrefetcher
        if block > 1:
            feeder = feeding.BlockPrefetcher(
                iterator,
                prepare,
                lambda b: replication.to_device(b, self.mesh, P(None, REPLICA_AXIS)),
                block,
                limit=limit,
            )
        else:
            feeder = feeding.DevicePrefetcher(
                iterator,
                prepare,
                lambda b: replication.to_device(b, self.mesh, P(REPLICA_AXIS)),
                size=self.config.device_prefetch,
                limit=limit,
            )
        with contextlib.suppress(TypeError):  # an infinite input has no len()
            feeder.expected_batches = len(iterable)  # type: ignore[arg-type]
        return feeder, sample

    # ------------------------------------------------------------------ training

    def _train_step_fn(self, per_call: int | None = None) -> Callable:
        """``(state, rng, features, labels) -> (state, StepOutput)`` on the mesh: one step, or
        with ``per_call`` (default ``steps_per_device_call``) > 1 a device loop over batches
        stacked ``[n, B, ...]`` (outputs ``[n]``)."""
        block = (per_call or self.config.steps_per_device_call) > 1
        key = ("train_step", block)
        if key not in self._compiled:
            step = functools.partial(
                steps_lib.train_step,
                self._module(ModeKeys.TRAIN),
                axis_name=REPLICA_AXIS,
                skip_nonfinite=self.config.skip_nonfinite_steps,
            )

            def per_replica(state, rng, features, labels):
                return step(state, (features, labels), rng)

            def per_replica_loop(state, rng, features, labels):
                return jax.lax.scan(
                    lambda state, batch: step(state, batch, rng), state, (features, labels)
                )

            batch = P(None, REPLICA_AXIS) if block else P(REPLICA_AXIS)
            sharded = jax.shard_map(
                per_replica_loop if block else per_replica,
                mesh=self.mesh,
                in_specs=(P(), P(), batch, batch),
                out_specs=(P(), P()),
            )
            self._compiled[key] = jax.jit(sharded, donate_argnums=(0,))
        return self._compiled[key]

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
        source, start = self._training_start(checkpointer, checkpoint_path)
        if max_steps is not None and start >= max_steps:
            logging.info("Skipping training since max_steps has already saved.")
            return start
        target = start + steps if steps is not None else max_steps
        assert target is not None  # train() asks for steps or max_steps
        session = hooks_lib.HookSession(ModeKeys.TRAIN, self.model_dir, start)
        user_hooks = loop_lib.Hooks(hooks, session)
        feeder, sample = self._feeder(ModeKeys.TRAIN, input_fn, limit=target - start)
        if start:
            _restore_input_position(feeder, source, start)
        if not feeder.has_next():
            raise ValueError(
                "input_fn produced no training batch: its input ended before a whole batch of "
                f"{replication.per_host_batch(self._batch_size(ModeKeys.TRAIN))} examples (this "
                "host's part of train_batch_size). A finite input (num_epochs=1) with fewer "
                "examples than that, and drop_remainder, yields none: repeat it "
                "(num_epochs=None)."
            )
        state = self._train_state(source, start, sample.pop())
        self._preflight(state, start)
        setup = loop_lib.Setup(
            config=self.config,
            model_dir=self.model_dir,
            clock=self._clock,
            checkpointer=checkpointer,
            summaries=self._summary_writer("") if self._is_chief else None,
            step_fn=self._train_step_fn(),
            rng=jax.device_put(self._base_rng, replication.replicated(self.mesh)),
            state=state,
            feeder=feeder,
            start=start,
            target=target,
            global_batch=self._batch_size(ModeKeys.TRAIN),
            hooks=user_hooks,
            listeners=listeners,
            last_segment=last_segment,
        )
        del state  # the run owns it (its buffers are donated to the steps)
        with contextlib.ExitStack() as stack:
            # Every part's cleanup runs whatever raises (a failed final save included).
            return loop_lib.TrainingRun(setup, stack).run()

    def _training_start(
        self, checkpointer: ckpt_lib.Checkpointer, checkpoint_path: str | None
    ) -> tuple[ckpt_lib.Checkpointer, int]:
        """Where training starts: (the checkpointer to restore from, its step; 0: initialise)."""
        start = checkpointer.latest_step() or 0
        if checkpoint_path is None:
            return checkpointer, start
        chosen, step = self._open_checkpoint(checkpoint_path)
        assert step is not None  # _open_checkpoint refuses a path without a checkpoint
        if _same_dir(chosen.model_dir, self.model_dir):
            if step == start:
                return checkpointer, start
            raise ValueError(
                f"train(checkpoint_path={checkpoint_path!r}) is step {step} of this model_dir, "
                f"whose latest checkpoint is step {start}: training from it here would "
                "overwrite the history of the later steps. Train from it in a new model_dir: "
                "Estimator(..., model_dir=NEW).train(..., checkpoint_path="
                f"{ckpt_lib.step_path(self.model_dir, step)!r})."
            )
        if start:
            logging.info(
                "%s has its own checkpoint (step %d): resuming from it, not from %s.",
                self.model_dir,
                start,
                checkpoint_path,
            )
            return checkpointer, start
        logging.info("Starting from checkpoint %s (step %d).", checkpoint_path, step)
        return chosen, step

    def _preflight(self, state: TrainState, start: int) -> None:
        """With many processes: all must train the same config, batches and parameter shapes."""
        if jax.process_count() == 1:
            return
        config = {k: repr(v) for k, v in dataclasses.asdict(self.config).items()}
        preflight.check(
            {
                "config": config,
                "batch_sizes": {k: v for k, v in self._batch_sizes.items()},
                "params": {
                    jax.tree_util.keystr(path): list(np.shape(leaf))
                    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
                },
                "start_step": start,
            }
        )

    # ------------------------------------------------------------------ evaluation

    def _eval_batch_fn(self) -> tuple[Callable, Callable]:
        """``(totals, variables, step, features, labels, mask) -> (totals, batch metrics)``."""
        key = ("eval",)
        if key not in self._compiled:
            step_fn = functools.partial(
                steps_lib.eval_step,
                self._module(ModeKeys.EVAL),
                axis_name=REPLICA_AXIS,
                exclude_invalid_labels=self.config.allow_invalid_labels,
            )

            def per_replica(variables, step, features, labels, mask):
                return step_fn(variables, step, (features, labels), mask)

            sharded = jax.shard_map(
                per_replica,
                mesh=self.mesh,
                in_specs=(P(), P(), P(REPLICA_AXIS), P(REPLICA_AXIS), P(REPLICA_AXIS)),
                out_specs=P(),
            )

            def accumulate(totals, variables, step, features, labels, mask):
                batch = sharded(variables, step, features, labels, mask)
                if totals is None:
                    return batch, batch
                return totals.merge(batch), batch

            self._compiled[key] = (jax.jit(accumulate), jax.jit(accumulate, donate_argnums=(0,)))
        return self._compiled[key]

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
        feeder.fill()  # the first batches: the model's shapes, and whether there is any
        empty = [i for i, has in enumerate(distributed.any_process(feeder.num_read > 0)) if not has]
        if empty:
            raise ValueError(
                "The eval input_fn produced no examples"
                + (
                    f" on process(es) {empty}: every host needs at least one."
                    if jax.process_count() > 1
                    else "."
                )
            )
        variables, step = self._load_variables(sample[0], ModeKeys.EVAL, checkpoint_path)
        run.session.global_step = step
        run.started()
        totals, num_examples, invalid = self._eval_loop(feeder, variables, step, sample[0], run)
        results: dict[str, Any] = _metric_values(totals)
        results["global_step"] = int(step or 0)
        # Examples counted on every host, not only this one.
        results["num_examples"] = int(_sum_over_hosts(num_examples))
        if invalid is not None:
            results["invalid_labels"] = invalid  # left out of the loss and metrics above
        self._write_eval(results, name)
        run.session.results = results
        run.end()
        return results

    def _write_eval(self, results: dict[str, Any], name: str | None) -> None:
        """Logs the results as the original did and writes them to TensorBoard (durably)."""
        global_step = results["global_step"]
        logging.info(
            "Saving dict for global step %d: %s",
            global_step,
            ", ".join(
                f"{k} = {v.tolist() if isinstance(v, np.ndarray) else v}"
                for k, v in sorted(results.items())
            ),
        )
        if self._is_chief:
            writer = self._summary_writer("eval" if name is None else f"eval_{name}")
            values = {
                # The training run's tag is train/invalid_labels; this one's says eval.
                ("eval/invalid_labels" if k == "invalid_labels" else k): v
                for k, v in results.items()
                if k not in ("global_step", "num_examples")
            }
            writer.scalars(global_step, {k: v for k, v in values.items() if np.ndim(v) == 0})
            writer.tables(global_step, {k: v for k, v in values.items() if np.ndim(v) == 2})
            writer.flush()

    def _eval_loop(
        self,
        feeder: feeding.DevicePrefetcher,
        variables: Any,
        step: int,
        sample: Any,
        run: loop_lib.Hooks,
    ) -> tuple[steps_lib.EvalOutput, int, int | None]:
        """Accumulates the metrics of every batch; (totals on the devices, examples counted,
        examples with invalid labels left out, with ``allow_invalid_labels``; else None).
        Every ``iterations_per_loop`` batches the label check reads its count (it raises
        ``InvalidLabelError`` without the opt-in).

        With many hosts every process must run the same number of batches (each is one
        collective computation), though the hosts' shards may hold different numbers of
        examples: a host whose input has ended runs a batch again, fully masked.
        """
        step_array = jnp.asarray(step, jnp.int32)
        first_fn, accumulate = self._eval_batch_fn()
        per_loop, hooks = self.config.iterations_per_loop, bool(run.hooks)
        allow = self.config.allow_invalid_labels
        labels = label_check.EvalLabelCheck(allow)
        run.before_run(0)
        first = feeder.next()
        assert first is not None  # evaluate() checked that the input has a batch
        totals, previous = first_fn(None, variables, step_array, *first.value)
        num_examples, batches, masked = first.info, 1, None
        del first
        endless = (
            None
            if feeder.limited
            else feeding.EndlessEvalInput(feeder.expected_batches, self._clock)
        )
        while True:
            if endless is not None:
                endless.check(batches, num_examples)
            fed = feeder.next()
            more = any(distributed.any_process(fed is not None))
            if batches % per_loop == 0:  # a loop's end: the label check's and the hooks' turn
                labels.check(loop_lib.to_host(totals.signals), batches)
                if hooks:
                    values = _metric_values(totals)
                    if run.after_run(batches - per_loop, batches, values) or not more:
                        break
                    run.before_run(batches)
            if not more:
                break
            if fed is None:  # this host's shard has ended; others still have examples
                masked = masked or self._masked_batch(sample)
                value = masked
            else:
                value, num_examples = fed.value, num_examples + fed.info
            totals, batch = accumulate(totals, variables, step_array, *value)
            fed = value = None
            jax.block_until_ready(previous)  # at most one batch queued behind the running one
            previous, batches = batch, batches + 1
        if hooks and batches % per_loop:
            run.after_run(batches - batches % per_loop, batches, _metric_values(totals))
        invalid = labels.check(loop_lib.to_host(totals.signals), batches, final=True)
        return totals, num_examples, invalid if allow else None

    def _masked_batch(self, sample: Any) -> Any:
        """A whole eval batch on the devices that counts nothing (its mask is all zeros)."""
        per_host = replication.per_host_batch(self._batch_size(ModeKeys.EVAL))
        host, mask, _ = replication.pad_batch(sample, per_host)
        return replication.to_device((*host, np.zeros_like(mask)), self.mesh, P(REPLICA_AXIS))

    # ------------------------------------------------------------------ prediction

    def _predict_fn(self) -> Callable:
        key = ("predict",)
        if key not in self._compiled:
            step_fn = functools.partial(steps_lib.predict_step, self._module(ModeKeys.PREDICT))
            self._compiled[key] = jax.jit(
                jax.shard_map(
                    step_fn,
                    mesh=self.mesh,
                    in_specs=(P(), P(), P(REPLICA_AXIS)),
                    out_specs=P(REPLICA_AXIS),
                )
            )
        return self._compiled[key]

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
        predict_fn = self._predict_fn()
        variables = step_array = None
        pending: list[tuple[Any, int]] = []  # dispatched, not yet yielded
        # The next batch runs while this one's results are yielded; with hooks, one at a time
        # (each hook's before_run/after_run pair brackets one batch).
        depth = 1 if run.hooks else 2
        batches = 0
        while (fed := feeder.next()) is not None:
            if variables is None:
                variables, step = self._load_variables(sample[0], ModeKeys.PREDICT, checkpoint_path)
                step_array = jnp.asarray(step, jnp.int32)
                run.session.global_step = step
                run.started()
            run.before_run(batches)
            pending.append((predict_fn(variables, step_array, fed.value), fed.info))
            fed = None
            feeder.fill()
            if len(pending) >= depth:
                preds = _host_predictions(*pending.pop(0), predict_keys)
                batches += 1
                stop = run.after_run(batches - 1, batches, preds)
                yield from _examples(preds, yield_single_examples)
                if stop:
                    pending.clear()
                    break
        for preds, n in pending:
            yield from _examples(_host_predictions(preds, n, predict_keys), yield_single_examples)
        run.end()

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
        ``signature.json``. ``estimax.serving.load`` runs it without the model's Python code.

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
        module = self._module(ModeKeys.PREDICT)

        def serve(variables: Any, features: Any) -> Any:
            return steps_lib.serving_outputs(
                module, variables, jnp.asarray(step, jnp.int32), features
            )

        return export_lib.export_saved_model(
            export_dir_base, serve, variables, input_specs, step, platforms
        )

    def compile_for(
        self, topology: str, features: Any, labels: Any = None, **options: Any
    ) -> list[compile_lib.StepReport]:
        """Compiles the train and eval steps for a Cloud TPU slice, on any host (needs libtpu).

        The steps ``train``/``evaluate`` would run (this ``model_fn``, its EMA and precision,
        the donated state, each batch size's per-replica shapes) on a mesh over the slice's
        devices; ``estimax.estimator.compile`` has the rest.

        Args:
          topology: e.g. ``v5e:2x4`` (``compile.KNOWN_TOPOLOGIES``).
          features, labels: ``TensorSpec`` pytrees of a batch (batch dimension None).
          **options: ``num_shards`` (default ``config.num_shards``), ``search`` (look for the
            largest batch that fits when a step does not).

        Returns:
          a ``StepReport`` per step whose global batch size was given to the constructor.
        """

        def build(mesh: Any, mode: str, batch: int) -> compile_lib.Steps:
            return copy.copy(self)._steps_on(mesh, mode, batch)  # noqa: SLF001 (a copy of self)

        options.setdefault("num_shards", self.config.num_shards)
        sizes = {m: self._batch_sizes[m] for m in (ModeKeys.TRAIN, ModeKeys.EVAL)}
        batches = {m: size for m, size in sizes.items() if size is not None}
        return compile_lib.compile_for(build, topology, (features, labels), batches, **options)

    def _steps_on(self, mesh: Any, mode: str, batch: int) -> compile_lib.Steps:
        """(Called on a copy.) The steps on ``mesh`` with ``mode``'s global batch ``batch``."""
        self.mesh, self.num_replicas, self._compiled = mesh, mesh.size, {}
        self._batch_sizes = {**self._batch_sizes, mode: batch}
        init_eval = self._init_variables_fn(ModeKeys.EVAL)
        _, eval_fn = self._eval_batch_fn()
        # One step, whatever steps_per_device_call: a device loop runs the same step body.
        return compile_lib.Steps(
            self._init_fn, self._train_step_fn(per_call=1), init_eval, eval_fn, self._base_rng
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


def _metric_values(totals: steps_lib.EvalOutput) -> dict[str, Any]:
    """The values of accumulated eval metrics (a host sync): numbers, or arrays (a confusion
    matrix)."""
    values = {}
    for name, metric in loop_lib.to_host(totals.metrics).items():
        value = np.asarray(metric.compute())
        values[name] = float(value) if value.ndim == 0 else value
    return values


def _host_predictions(preds: Any, n: int, predict_keys: list[str] | None) -> Any:
    """A batch's predictions as host numpy, its ``n`` real rows, the keys asked for."""
    preds = jax.tree.map(lambda x: replication.to_local_numpy(x)[:n], preds)
    if isinstance(preds, dict) and predict_keys is not None:
        missing = [k for k in predict_keys if k not in preds]
        if missing:
            raise ValueError(
                f"predict_keys {missing} are not among the predictions {sorted(preds)}."
            )
        preds = {k: preds[k] for k in predict_keys}
    return preds


def _examples(preds: Any, single: bool) -> Iterator[Any]:
    """A batch's predictions, whole or one example at a time."""
    if not single:
        yield preds
        return
    n = int(np.shape(jax.tree.leaves(preds)[0])[0])
    for i in range(n):
        yield jax.tree.map(lambda x, i=i: x[i], preds)


def _sum_over_hosts(value: int) -> int:
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.sum(multihost_utils.process_allgather(np.int64(value))))
