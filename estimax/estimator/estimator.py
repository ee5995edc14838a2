"""The Estimator: train, evaluate, predict and export a traced ``model_fn`` on a device mesh.

Who owns what:

| piece                                    | owner                   | where                       |
|------------------------------------------|-------------------------|-----------------------------|
| layers, loss, metrics, optimizer choice  | the user's ``model_fn`` | traced in ``ModelFnModule`` |
| gradients, cross-replica mean, optimizer | pure steps              | ``steps.train_step`` etc.   |
| update, weight decay, clip, EMA          |                         |                             |
| the steps on the mesh (jit, shardings,   | ``Estimator``           | ``_*_fn`` below             |
| donation), the loops, host syncs         |                         |                             |
| batches (per host)                       | the user's ``input_fn`` | host; we pad/shard them     |
| batches ahead on the devices (bounded)   | ``DevicePrefetcher``    | ``feeding.py``              |
| position in the input                    | the input iterator      | ``get_state``/``set_state`` |
| checkpoints (model + input position)     | Orbax ``Checkpointer``  | ``model_dir/checkpoints``   |
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
``iterations_per_loop`` is. Once per loop the host fetches that loop's per-step metrics (one
small scalar per step and metric), checks them for NaN, writes them at their true step numbers,
and may checkpoint. After every step the loop asks whether a preemption notice (SIGTERM) has
come; if so it stops after that step, saves it with the input position and raises ``Preempted``
(exit status 0).

With many processes (``jax.distributed``) each reads its own shard of the input; every process
takes part in each step, save and evaluation batch, and each host's input position is saved.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import PartitionSpec as P

from estimax.estimator import checkpoints as ckpt_lib
from estimax.estimator import distributed, feeding, periodic, preflight, replication
from estimax.estimator import export as export_lib
from estimax.estimator import steps as steps_lib
from estimax.estimator import summaries as summaries_lib
from estimax.estimator.replication import REPLICA_AXIS
from estimax.estimator.spec import EstimatorSpec, InputContext, ModeKeys, RunConfig
from estimax.estimator.steps import TrainState, get_global_step  # noqa: F401 (public names)
from estimax.estimator.watchdog import Watchdog
from estimax.ops import native

_RESERVED_PARAMS_KEYS = ("batch_size", "context")
_MODEL_FN_ARGS = ("features", "labels", "mode", "params", "config")
# The share of a loop the devices may sit idle waiting for input before we warn.
INPUT_BOUND_WARNING_FRACTION = 0.1


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


def _to_host(tree: Any) -> Any:
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


def _input_state_of_this_process(meta: Mapping[str, Any]) -> Any:
    """This process's input position in a checkpoint's meta (each host saved its own)."""
    states = meta.get("input_states")
    if states is None:  # written by one process, or before positions were kept per host
        if jax.process_count() > 1 and meta.get("input_state") is not None:
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


def _split_batch(element: Any) -> tuple[Any, Any]:
    if isinstance(element, tuple) and len(element) == 2:
        return element
    return element, None


def _leading_rows(tree: Any, n: int | None) -> Any:
    """Copies of the first ``n`` (None: all) rows of every leaf (a sample that keeps no batch)."""
    return jax.tree.map(lambda x: np.array(np.asarray(x)[:n]), tree)


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
            checkpoint of the original models, or an estimax one; ``estimax.migrate``).
        """
        config = config or RunConfig()
        if model_dir is not None:
            config = dataclasses.replace(config, model_dir=model_dir)
        if config.model_dir is None:
            config = dataclasses.replace(config, model_dir=tempfile.mkdtemp(prefix="estimax_"))
            logging.warning("Using temporary folder as model directory: %s", config.model_dir)
        params = dict(params or {})
        reserved = [k for k in _RESERVED_PARAMS_KEYS if k in params]
        if reserved:
            raise ValueError(
                f"params must not contain the reserved keys {reserved}: the "
                "Estimator sets params['batch_size'] and params['context']."
            )
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
        for mode, what in (
            (ModeKeys.TRAIN, "train_batch_size"),
            (ModeKeys.EVAL, "eval_batch_size"),
            (ModeKeys.PREDICT, "predict_batch_size"),
        ):
            size = self._batch_sizes[mode]
            if size is not None:
                replication.per_replica_batch(size, self.num_replicas, what)
        self._clock = clock
        self._base_rng = jax.random.PRNGKey(config.seed)
        self._checkpointer: ckpt_lib.Checkpointer | None = None
        self._compiled: dict[Any, Any] = {}  # jitted step functions, by what they compute
        self._summaries: dict[str, summaries_lib.Summaries] = {}
        self._is_chief = jax.process_index() == 0
        self._warned_input_bound = False
        self._nonfinite_skipped = 0  # steps skipped (skip_nonfinite_steps) by this process
        self._warm_start_from = warm_start_from  # issue 24: used by _run_training's first init
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
            what = {
                ModeKeys.TRAIN: "train_batch_size",
                ModeKeys.EVAL: "eval_batch_size",
                ModeKeys.PREDICT: "predict_batch_size",
            }[mode]
            raise ValueError(
                f"Estimator needs {what} to run mode {mode!r}; pass it to the "
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

    def _replica_slice(self, tree: Any, mode: str) -> Any:
        n = self._per_replica_batch(mode) or 1
        return jax.tree.map(lambda x: np.asarray(x)[:n], tree)

    def _with_replicated_sharding(self, abstract: Any) -> Any:
        sharding = replication.replicated(self.mesh)
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract
        )

    def _initial_state(self, features: Any, labels: Any) -> TrainState:
        sample = self._replica_slice((features, labels), ModeKeys.TRAIN)
        return replication.run_init(self._init_fn, self.mesh, self._base_rng, *sample)

    def _restore_train_state(
        self, checkpointer: ckpt_lib.Checkpointer, step: int, features: Any, labels: Any
    ) -> TrainState:
        sample = self._replica_slice((features, labels), ModeKeys.TRAIN)
        abstract = self._with_replicated_sharding(
            jax.eval_shape(self._init_fn, self._base_rng, *sample)
        )
        meta = checkpointer.restore_meta(step)
        items = {
            "model": {
                "step": abstract.step,
                "params": abstract.params,
                "model_state": abstract.model_state,
            }
        }
        if meta.get("has_optimizer", True) and jax.tree.leaves(abstract.opt_state):
            items["optimizer"] = abstract.opt_state
        if meta.get("has_ema") and jax.tree.leaves(abstract.ema_params):
            items["ema"] = abstract.ema_params
        restored = checkpointer.restore(step, **items)
        model = restored["model"]
        ema = restored.get("ema", abstract.ema_params)
        if jax.tree.leaves(abstract.ema_params) and "ema" not in restored:
            logging.warning("Checkpoint %d has no EMA of the weights; starting it from them.", step)
            ema = model["params"]
        return TrainState(
            step=model["step"],
            params=model["params"],
            model_state=model["model_state"],
            opt_state=restored.get("optimizer", abstract.opt_state),
            ema_params=ema,
        )

    def _get_checkpointer(self) -> ckpt_lib.Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = ckpt_lib.Checkpointer(
                self.model_dir, self.config.keep_checkpoint_max
            )
        return self._checkpointer

    def latest_checkpoint(self) -> str | None:
        """Returns the path of the newest complete checkpoint in ``model_dir``, or None."""
        step = self._get_checkpointer().latest_step()
        if step is None:
            return None
        return os.path.join(ckpt_lib.checkpoint_dir(self.model_dir), str(step))

    def get_global_step(self) -> int:
        """Returns the step of the newest checkpoint in ``model_dir`` (0 if there is none)."""
        return self._get_checkpointer().latest_step() or 0

    def get_variables(self, checkpoint_path: str | None = None) -> dict[str, Any]:
        """Returns the variables of a checkpoint (default: the latest) as numpy arrays.

        ``{"params": ..., <collection>: ...}`` nested by module name; the counterpart of the
        original's ``get_variable_value``/``get_variable_names``.
        """
        step: int | None
        if checkpoint_path is not None:
            model_dir, step = ckpt_lib.step_from_checkpoint_path(checkpoint_path)
            checkpointer = ckpt_lib.Checkpointer(model_dir, None, read_only=True)
        else:
            checkpointer = self._get_checkpointer()
            step = checkpointer.latest_step()
            if step is None:
                raise FileNotFoundError(f"No checkpoint in {self.model_dir}: train first.")
        model = checkpointer.restore_numpy(step, "model")
        return {"params": model["params"], **model.get("model_state", {})}

    def _init_variables_fn(self, mode: str) -> Callable:
        def init(rng, features, labels):
            return steps_lib.init_variables(self._module(mode), rng, (features, labels))

        return init

    def _load_variables(
        self, features: Any, labels: Any, mode: str, checkpoint_path: str | None
    ) -> tuple[dict, int]:
        """Returns (variables, step) of the given/latest checkpoint, for EVAL or PREDICT.

        Uses the EMA of the weights when the checkpoint has one. Without any checkpoint the
        model is initialised, with a warning, as the original did.
        """
        step: int | None
        if checkpoint_path is not None:
            model_dir, step = ckpt_lib.step_from_checkpoint_path(checkpoint_path)
            checkpointer = ckpt_lib.Checkpointer(model_dir, None, read_only=True)
            if step not in checkpointer.all_steps():
                raise FileNotFoundError(f"No complete checkpoint at {checkpoint_path}.")
        else:
            checkpointer = self._get_checkpointer()
            step = checkpointer.latest_step()
        sample = self._replica_slice((features, labels), mode)
        init = self._init_variables_fn(mode)
        if step is None:
            logging.warning(
                "Could not find trained model in model_dir: %s, running initialization to %s.",
                self.model_dir,
                mode,
            )
            variables = replication.run_init(init, self.mesh, self._base_rng, *sample)
            return dict(variables), 0
        abstract = dict(
            self._with_replicated_sharding(jax.eval_shape(init, self._base_rng, *sample))
        )
        abstract_params = abstract.pop("params", {})
        meta = checkpointer.restore_meta(step)
        items = {
            "model": {
                "step": jax.ShapeDtypeStruct(
                    (), jnp.int32, sharding=replication.replicated(self.mesh)
                ),
                "params": abstract_params,
                "model_state": abstract,
            }
        }
        if meta.get("has_ema"):
            items["ema"] = abstract_params
        restored = checkpointer.restore(step, **items)
        params = restored["ema"] if "ema" in restored else restored["model"]["params"]
        return {"params": params, **restored["model"]["model_state"]}, step

    # ------------------------------------------------------------------ training

    def _train_step_fn(self) -> Callable:
        """``(state, rng, features, labels) -> (state, metrics)``: one step on the mesh."""
        key = ("train_step",)
        if key not in self._compiled:
            step = functools.partial(
                steps_lib.train_step,
                self._module(ModeKeys.TRAIN),
                axis_name=REPLICA_AXIS,
                skip_nonfinite=self.config.skip_nonfinite_steps,
            )

            def per_replica(state, rng, features, labels):
                return step(state, (features, labels), rng)

            sharded = jax.shard_map(
                per_replica,
                mesh=self.mesh,
                in_specs=(P(), P(), P(REPLICA_AXIS), P(REPLICA_AXIS)),
                out_specs=(P(), P()),
            )
            self._compiled[key] = jax.jit(sharded, donate_argnums=(0,))
        return self._compiled[key]

    def train(
        self,
        input_fn: Callable[[dict], Iterable],
        hooks: Any = None,
        steps: int | None = None,
        max_steps: int | None = None,
        saving_listeners: Iterable[Callable[[int], Any]] | None = None,
    ) -> Estimator:
        """Trains, resuming from the latest checkpoint in ``model_dir``.

        Args:
          input_fn: ``input_fn(params) -> iterable of (features, labels)`` per-host batches of
            ``params["batch_size"]`` examples. If its iterator has ``get_state``/``set_state``,
            the input position is saved with each checkpoint and restored on resume.
          hooks: not supported (the original's SessionRunHooks have no equivalent); must be None.
          steps: train this many more steps (incremental).
          max_steps: train until the global step reaches this (absolute); already there -> no-op.
          saving_listeners: callables ``listener(step)`` run after each checkpoint is complete
            on disk (the original's ``CheckpointSaverListener.after_save``).

        Returns:
          self, as the original.
        """
        if hooks:
            raise ValueError(
                "hooks are not supported; use RunConfig settings or train in chunks with max_steps."
            )
        if steps is not None and max_steps is not None:
            raise ValueError("Can not provide both steps and max_steps.")
        if steps is None and max_steps is None:
            raise ValueError("One of `steps` or `max_steps` must be set. Cannot be both `None`.")
        if steps is not None and steps <= 0:
            raise ValueError(f"Must specify steps > 0, given: {steps}")
        if max_steps is not None and max_steps <= 0:
            raise ValueError(f"Must specify max_steps > 0, given: {max_steps}")
        while True:
            try:
                self._run_training(input_fn, steps, max_steps, list(saving_listeners or []))
                break
            except ckpt_lib.CorruptCheckpointError as e:
                # issue 15: the damaged step (one without a manifest that Orbax could not read)
                # has been set aside, so this cannot repeat for it: resume from the previous one.
                logging.warning("%s Resuming from the previous checkpoint now.", e)
        return self

    def _run_training(
        self,
        input_fn: Callable[[dict], Iterable],
        steps: int | None,
        max_steps: int | None,
        listeners: list[Callable[[int], Any]],
    ) -> int:
        checkpointer = self._get_checkpointer()
        start = checkpointer.latest_step() or 0
        if max_steps is not None and start >= max_steps:
            logging.info("Skipping training since max_steps has already saved.")
            return start
        target = start + steps if steps is not None else max_steps
        assert target is not None  # train() asks for steps or max_steps
        per_host = replication.per_host_batch(self._batch_size(ModeKeys.TRAIN))
        iterator = iter(input_fn(self._input_params(ModeKeys.TRAIN)))
        stateful = hasattr(iterator, "get_state") and hasattr(iterator, "set_state")
        if start:
            input_state = _input_state_of_this_process(checkpointer.restore_meta(start))
            if input_state is not None and stateful:
                iterator.set_state(input_state)  # type: ignore[attr-defined]  # checked: stateful
            elif input_state is not None:
                logging.warning(
                    "The input iterator has no set_state(): resuming at step %d "
                    "restarts the input from its beginning.",
                    start,
                )
        sample: list[tuple[Any, Any]] = []

        def prepare(element: Any) -> tuple[tuple[Any, Any], None]:
            features, labels = _split_batch(element)
            size = int(np.shape(jax.tree.leaves(features)[0])[0])
            if size != per_host:
                raise ValueError(
                    f"input_fn yielded a training batch of {size} examples; this host must "
                    f"feed {per_host} (train_batch_size / number of hosts). Training "
                    "batches need a fixed size: repeat the data and drop the remainder."
                )
            if not sample:  # what init/restore trace the model with
                sample.append(
                    _leading_rows((features, labels), self._per_replica_batch(ModeKeys.TRAIN))
                )
            return (features, labels), None

        feeder = feeding.DevicePrefetcher(
            iterator,
            prepare,
            lambda b: replication.to_device(b, self.mesh, P(REPLICA_AXIS)),
            size=self.config.device_prefetch,
            limit=target - start,
        )
        fed = feeder.next()
        if fed is None:
            raise ValueError("input_fn produced no training batch.")
        if start:
            state = self._restore_train_state(checkpointer, start, *sample[0])
            logging.info("Restored checkpoint at step %d from %s", start, self.model_dir)
        else:
            state = self._initial_state(*sample[0])
            if self._warm_start_from is not None:  # issue 24; no checkpoint of our own yet
                from estimax.migrate import warm_start

                state, _ = warm_start.warm_start(self._warm_start_from, state)
        del sample[:]
        self._preflight(state, start)
        rng = jax.device_put(self._base_rng, replication.replicated(self.mesh))
        step_fn = self._train_step_fn()
        summaries = self._summary_writer("")
        logger = _StepLogger(
            self.config,
            self._batch_size(ModeKeys.TRAIN),
            self._clock,
            start,
            target,
            summaries if self._is_chief else None,
        )
        saver = periodic.PeriodicAction(
            self.config.save_checkpoints_steps,
            self.config.save_checkpoints_secs,
            self._clock,
            start,
        )
        timeline = feeding.DeviceTimeline()
        step = start
        last_skipped: int | None = 0  # bad records the input has skipped (None: it cannot say)
        preempted = False
        watchdog = Watchdog(self.config.watchdog_timeout_secs).start(start)
        notice = distributed.PreemptionNotice().__enter__()
        try:
            while fed is not None and not preempted:
                begin = step
                loop_metrics = []  # per step: a dict of device scalars, fetched once per loop
                previous_loss = input_state = None
                skipped = last_skipped
                for _ in range(min(self.config.iterations_per_loop, target - begin)):
                    if fed is None:
                        fed = feeder.next()
                        if fed is None:
                            break
                    state, metrics = step_fn(state, rng, *fed.value)
                    timeline.dispatched(metrics["loss"], feeder.input_wait_secs)
                    loop_metrics.append(metrics)
                    input_state, skipped = fed.input_state, fed.num_skipped
                    fed = None  # its device buffers go once the step is done with them
                    if previous_loss is not None:
                        # At most one step queued behind the running one: the host never runs
                        # ahead (holding batches) by more than that, whatever the loop length.
                        previous_loss.block_until_ready()
                        watchdog.heartbeat(begin + len(loop_metrics) - 1)
                    previous_loss = metrics["loss"]
                    if notice.reached(begin + len(loop_metrics)):
                        # Every process stops after this same step and saves it (see
                        # PreemptionNotice); the batches read ahead are not trained on.
                        preempted = True
                        break
                    feeder.fill()  # read and transfer the next batches while this step runs
                if not loop_metrics:
                    break
                step = begin + len(loop_metrics)
                fetched = _to_host(loop_metrics)  # the loop's one host sync
                watchdog.heartbeat(step)
                host_metrics = {
                    k: np.stack([np.asarray(m[k]) for m in fetched]) for k in fetched[0]
                }
                idle_secs, loop_secs = timeline.end_loop()
                self._check_finite(host_metrics, begin, step, checkpointer)  # issue 15: dict
                logger.record(begin, host_metrics)
                self._report_input_wait(
                    step, idle_secs, loop_secs, summaries if self._is_chief else None
                )
                if skipped is not None and skipped != last_skipped and self._is_chief:
                    # Bad records the input skipped (skip_bad_records=True): never silent.
                    summaries.scalars(step, {"input/skipped_records": skipped})
                    logging.warning("The input has skipped %d bad records so far.", skipped)
                    last_skipped = skipped
                if not preempted:
                    fed = feeder.next()  # None: the steps asked for are done, or input ended
                # All processes must take part in a save: they agree on a time-based cadence.
                due = saver.due(step)
                if self.config.save_checkpoints_secs is not None:
                    due = distributed.agree(due)
                if due or fed is None or preempted:
                    checkpointer.save(
                        step,
                        {
                            "step": state.step,
                            "params": state.params,
                            "model_state": state.model_state,
                        },
                        state.opt_state,
                        state.ema_params,
                        input_state,
                        input_states=(
                            distributed.allgather_json(input_state)
                            if jax.process_count() > 1
                            else None
                        ),
                    )
                    logging.info("Saving checkpoints for %d into %s.", step, self.model_dir)
                    saver.fired(step)
                    if listeners:
                        checkpointer.wait_until_finished()
                        for listener in listeners:
                            listener(step)
            if step < target and not preempted:
                logging.info("Input ended at step %d, before the %d steps asked for.", step, target)
        finally:
            notice.__exit__()
            timeline.close()
            checkpointer.wait_until_finished()
            watchdog.stop()
            logger.close()
            summaries.flush()
        logging.info("Loss for final step: %s.", logger.last_loss)
        if preempted:
            stop = Preempted(step, str(self.model_dir))
            logging.warning("%s", stop)
            raise stop
        return step

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

    def _report_input_wait(
        self,
        step: int,
        idle_secs: float,
        loop_secs: float,
        summaries: summaries_lib.Summaries | None,
    ) -> None:
        """Writes ``input/wait_fraction`` and warns (once) when the input held training back."""
        if loop_secs <= 0:
            return
        fraction = min(1.0, idle_secs / loop_secs)
        if summaries is not None:
            summaries.scalars(step, {"input/wait_fraction": fraction})
        if fraction > INPUT_BOUND_WARNING_FRACTION and not self._warned_input_bound:
            self._warned_input_bound = True
            logging.warning(
                "Training is input-bound: the devices waited for input %.0f%% of the loop ending "
                "at step %d. Try more input parallelism (--num_parallel_calls, the loader's "
                "process workers), caching or a cheaper preprocessing; TensorBoard shows "
                "input/wait_fraction.",
                100 * fraction,
                step,
            )

    def _check_finite(
        self,
        host_metrics: dict[str, np.ndarray],
        begin: int,
        end: int,
        checkpointer: ckpt_lib.Checkpointer,
    ) -> None:
        """Stops on a non-finite loss in steps ``begin+1..end``, or counts the skipped steps.

        With ``RunConfig.skip_nonfinite_steps`` the step made no update (``steps.train_step``);
        its ``nonfinite_skipped`` flag is taken out of ``host_metrics`` here and counted.
        """
        losses = host_metrics["loss"]
        if "nonfinite_skipped" in host_metrics:
            flags = np.asarray(host_metrics.pop("nonfinite_skipped")).reshape(-1)
            skipped = np.flatnonzero(flags > 0)
            if skipped.size:
                self._nonfinite_skipped += int(skipped.size)
                logging.warning(
                    "Skipped %d training step(s) with a non-finite loss or gradient in steps "
                    "%d..%d (first: step %d, loss %s); no update was made. %d skipped so far.",
                    skipped.size,
                    begin + 1,
                    end,
                    begin + skipped[0] + 1,
                    losses[skipped[0]],
                    self._nonfinite_skipped,
                )
                if self._is_chief:
                    self._summary_writer("").scalars(
                        end, {"train/nonfinite_skipped_steps": self._nonfinite_skipped}
                    )
            return
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            checkpointer.wait_until_finished()
            saved = checkpointer.latest_step()
            raise NanLossError(
                f"NaN loss during training: the loss was {losses[bad[0]]} at step "
                f"{begin + bad[0] + 1} (steps {begin + 1}..{end} ran in one device loop). "
                f"Nothing from that loop was saved; the latest checkpoint "
                f"({'step ' + str(saved) if saved is not None else 'none'}) in "
                f"{self.model_dir} is intact."
            )

    # ------------------------------------------------------------------ evaluation

    def _eval_batch_fn(self) -> tuple[Callable, Callable]:
        """``(totals, variables, step, features, labels, mask) -> (totals, batch metrics)``."""
        key = ("eval",)
        if key not in self._compiled:
            step_fn = functools.partial(
                steps_lib.eval_step, self._module(ModeKeys.EVAL), axis_name=REPLICA_AXIS
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
                return jax.tree.map(jnp.add, totals, batch), batch

            self._compiled[key] = (jax.jit(accumulate), jax.jit(accumulate, donate_argnums=(0,)))
        return self._compiled[key]

    def evaluate(
        self,
        input_fn: Callable[[dict], Iterable],
        steps: int | None = None,
        hooks: Any = None,
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
          hooks: must be None.
          checkpoint_path: a checkpoint directory; None means the latest in ``model_dir``.
          name: write results to ``model_dir/eval_<name>`` instead of ``model_dir/eval``.

        Returns:
          ``{metric: value, "loss": ..., "global_step": step, "num_examples": n}``.
        """
        if hooks:
            raise ValueError("hooks are not supported in evaluate().")
        if steps is not None and steps <= 0:
            raise ValueError(f"Must specify steps > 0, given: {steps}")
        per_host = replication.per_host_batch(self._batch_size(ModeKeys.EVAL))
        iterator = iter(input_fn(self._input_params(ModeKeys.EVAL)))
        sample: list[tuple[Any, Any]] = []
        # With many hosts every process must run the same number of batches (each is one
        # collective computation), though the hosts' shards may hold different numbers of
        # examples: a host whose input has ended runs this batch again, fully masked.
        masked: list[Any] = []
        many = jax.process_count() > 1

        def prepare(element: Any) -> tuple[tuple[Any, Any, np.ndarray], int]:
            features, labels = _split_batch(element)
            (features, labels), mask, n = replication.pad_batch((features, labels), per_host)
            if not sample:
                sample.append(
                    _leading_rows((features, labels), self._per_replica_batch(ModeKeys.EVAL) or 1)
                )
                if many:
                    masked.append((features, labels, np.zeros_like(mask)))
            return (features, labels, mask), n

        feeder = feeding.DevicePrefetcher(
            iterator,
            prepare,
            lambda b: replication.to_device(b, self.mesh, P(REPLICA_AXIS)),
            size=self.config.device_prefetch,
            limit=steps,
        )
        fed = feeder.next()
        empty = [i for i, has in enumerate(distributed.any_process(fed is not None)) if not has]
        if empty:
            raise ValueError(
                "The eval input_fn produced no examples"
                + (f" on process(es) {empty}: every host needs at least one." if many else ".")
            )
        assert fed is not None
        variables, step = self._load_variables(*sample[0], ModeKeys.EVAL, checkpoint_path)
        step_array = jnp.asarray(step, jnp.int32)
        first_fn, accumulate = self._eval_batch_fn()
        totals, _ = first_fn(None, variables, step_array, *fed.value)
        num_examples = fed.info
        previous = None
        while True:
            fed = feeder.next()
            if not any(distributed.any_process(fed is not None)):
                break
            if fed is None:  # this host's shard has ended; others still have examples
                value = replication.to_device(masked[0], self.mesh, P(REPLICA_AXIS))
            else:
                value, num_examples = fed.value, num_examples + fed.info
            totals, batch = accumulate(totals, variables, step_array, *value)
            fed = value = None
            if previous is not None:  # at most one batch queued behind the running one
                jax.block_until_ready(previous)
            previous = batch
        totals = _to_host(totals)
        results = {k: float(np.asarray(m.compute())) for k, m in totals.items()}
        global_step = int(step or 0)
        results["global_step"] = global_step
        # Examples counted on every host, not only this one.
        results["num_examples"] = int(_sum_over_hosts(num_examples))
        logging.info(
            "Saving dict for global step %d: %s",
            global_step,
            ", ".join(f"{k} = {v}" for k, v in sorted(results.items())),
        )
        if self._is_chief:
            writer = self._summary_writer("eval" if name is None else f"eval_{name}")
            writer.scalars(
                global_step,
                {k: v for k, v in results.items() if k not in ("global_step", "num_examples")},
            )
            writer.flush()
        return results

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
        hooks: Any = None,
        checkpoint_path: str | None = None,
        yield_single_examples: bool = True,
    ) -> Iterator[Any]:
        """Yields predictions for every example of ``input_fn`` (padding rows removed).

        Streams: results are yielded while the input is still being read, with a bounded number
        of batches in flight, so memory does not depend on the input's length.

        Args:
          input_fn: yields feature batches, or ``(features, labels)`` (labels ignored).
          predict_keys: keep only these keys of a predictions dict.
          hooks: must be None.
          checkpoint_path: a checkpoint directory; None means the latest in ``model_dir``.
          yield_single_examples: yield one value per example (else one per batch).
        """
        if hooks:
            raise ValueError("hooks are not supported in predict().")
        per_host = replication.per_host_batch(self._batch_size(ModeKeys.PREDICT))
        iterator = iter(input_fn(self._input_params(ModeKeys.PREDICT)))
        sample: list[Any] = []

        def prepare(element: Any) -> tuple[Any, int]:
            features, _ = _split_batch(element)
            features, _, n = replication.pad_batch(features, per_host)
            if not sample:
                sample.append(
                    _leading_rows(features, self._per_replica_batch(ModeKeys.PREDICT) or 1)
                )
            return features, n

        feeder = feeding.DevicePrefetcher(
            iterator,
            prepare,
            lambda b: replication.to_device(b, self.mesh, P(REPLICA_AXIS)),
            size=self.config.device_prefetch,
        )
        predict_fn = self._predict_fn()
        variables = step_array = None
        pending: list[tuple[Any, int]] = []  # dispatched, not yet yielded: at most 2

        def results(preds: Any, n: int) -> Iterator[Any]:
            preds = jax.tree.map(lambda x: replication.to_local_numpy(x)[:n], preds)
            if isinstance(preds, dict) and predict_keys is not None:
                missing = [k for k in predict_keys if k not in preds]
                if missing:
                    raise ValueError(
                        f"predict_keys {missing} are not among the predictions {sorted(preds)}."
                    )
                preds = {k: preds[k] for k in predict_keys}
            if not yield_single_examples:
                yield preds
                return
            for i in range(n):
                yield jax.tree.map(lambda x, i=i: x[i], preds)

        while (fed := feeder.next()) is not None:
            if variables is None:
                variables, step = self._load_variables(
                    sample[0], None, ModeKeys.PREDICT, checkpoint_path
                )
                step_array = jnp.asarray(step, jnp.int32)
            pending.append((predict_fn(variables, step_array, fed.value), fed.info))
            fed = None
            feeder.fill()
            if len(pending) > 1:  # the next batch runs while this one's results are yielded
                yield from results(*pending.pop(0))
        for preds, n in pending:
            yield from results(preds, n)

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
          checkpoint_path: a checkpoint directory; None means the latest in ``model_dir``.
          platforms: platforms to lower for (default: cpu, cuda and tpu).
        """
        input_specs = serving_input_receiver_fn()
        export_lib.check_input_specs(input_specs)
        variables, step = self._load_variables(
            export_lib.example_batch(input_specs), None, ModeKeys.PREDICT, checkpoint_path
        )
        module = self._module(ModeKeys.PREDICT)

        def serve(variables: Any, features: Any) -> Any:
            return steps_lib.serving_outputs(
                module, variables, jnp.asarray(step, jnp.int32), features
            )

        return export_lib.export_saved_model(
            export_dir_base, serve, variables, input_specs, step, platforms
        )

    # ------------------------------------------------------------------ summaries

    def _summary_writer(self, subdir: str) -> summaries_lib.Summaries:
        if subdir not in self._summaries:
            self._summaries[subdir] = summaries_lib.Summaries(
                os.path.join(self.model_dir, subdir),
                # issue 15: a redone evaluation adds no second point at a step.
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


def _sum_over_hosts(value: int) -> int:
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.sum(multihost_utils.process_allgather(np.int64(value))))


class _StepLogger:
    """Writes training scalars and the original's log lines at their true step numbers."""

    def __init__(
        self,
        config: RunConfig,
        global_batch: int,
        clock: Callable[[], float],
        start: int,
        target: int,
        summaries: summaries_lib.Summaries | None,
    ):
        self._config = config
        self._global_batch = global_batch
        self._summaries = summaries
        # Speed is measured over whole loops: the host sees steps finish once per loop.
        self._speed = periodic.PeriodicAction(
            every_steps=config.log_step_count_steps, clock=clock, start_step=start
        )
        self._first = start + 1
        self.last_loss: float | None = None
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=target, initial=start, unit="step", dynamic_ncols=True)

    def record(self, begin: int, metrics: Mapping[str, np.ndarray]) -> None:
        """Writes the per-step ``metrics`` (``{name: [n]}``) of steps ``begin + 1 .. begin + n``."""
        losses = np.asarray(metrics["loss"]).reshape(-1)
        end = begin + losses.shape[0]
        if self._summaries is not None:
            for step in periodic.steps_due(
                begin, end, self._config.save_summary_steps, self._first
            ):
                self._summaries.scalars(
                    step,
                    {k: np.asarray(v).reshape(-1)[step - begin - 1] for k, v in metrics.items()},
                )
        for step in periodic.steps_due(begin, end, self._config.log_step_count_steps, self._first):
            summaries_lib.log_step(step, losses[step - begin - 1])
        self.last_loss = float(losses[-1])
        if self._bar is not None:
            self._bar.update(end - begin)
            self._bar.set_postfix(loss=f"{self.last_loss:.4g}")
        if self._speed.due(end):
            elapsed = self._speed.seconds_since_fired()
            if elapsed > 0:
                steps_per_sec = (end - self._speed.last_step) / elapsed
                summaries_lib.log_speed(steps_per_sec, steps_per_sec * self._global_batch)
                if self._summaries is not None:
                    self._summaries.scalars(
                        end,
                        {
                            "global_step/sec": steps_per_sec,
                            "examples/sec": steps_per_sec * self._global_batch,
                        },
                    )
            self._speed.fired(end)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
