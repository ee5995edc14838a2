"""The user-facing contract: modes, the spec a ``model_fn`` returns, and run configuration."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import optax

from estimax.parallel import replication
from estimax.parallel.layouts import Layout, format_dims, partition_lists

_T = TypeVar("_T")

_HOOKS = "SessionRunHooks go to Estimator.train/evaluate/predict(hooks=[...])"
_DEVICES = "not needed: the same code runs on CPU, GPU and TPU (JAX finds the devices)"
_HOSTS = (
    "many hosts join through jax.distributed: --coordinator_address, --num_processes, "
    "--process_id (docs/many-hosts.md)"
)

# The original's keyword arguments that estimax does not take, with what replaces each. A user
# porting a TPUEstimator job gets one line naming the replacement instead of Python's bare
# "unexpected keyword argument".
ORIGINAL_KEYWORDS: dict[str, dict[str, str]] = {
    "EstimatorSpec": {
        "train_op": "set optimizer=optax.<optimizer>(...): the Estimator differentiates loss "
        "and applies it (gradients averaged over replicas: no CrossShardOptimizer)",
        "eval_metric_ops": "set eval_metrics={name: ex.metrics.accuracy(labels, logits)} or "
        "eval_metrics=(metric_fn, tensors)",
        "host_call": "set scalars={name: scalar} (written every save_summary_steps at the true "
        "step)",
        "training_hooks": _HOOKS,
        "evaluation_hooks": _HOOKS,
        "prediction_hooks": _HOOKS,
        "scaffold_fn": "initialisation is the Flax modules'; to start from another run's "
        "weights, warm-start the Estimator",
        "scaffold": "initialisation is the Flax modules'; to start from another run's weights, "
        "warm-start the Estimator",
    },
    "RunConfig": {
        "tf_random_seed": "set seed=",
        "tpu_config": "its fields are RunConfig's own: iterations_per_loop=, num_shards=",
        "cluster": _HOSTS,
        "master": _HOSTS,
        "evaluation_master": _HOSTS,
        "session_config": "XLA is configured with XLA_FLAGS; there is no session",
        "train_distribute": "not needed: replication over all devices is built in "
        "(num_shards= to use fewer)",
        "keep_checkpoint_every_n_hours": "set keep_checkpoint_max= (None keeps all) and "
        "keep_best_checkpoint=estimax.BestCheckpoint(metric, mode) to keep the best one too",
    },
    "TrainSpec": {},
    "EvalSpec": {
        "start_delay_secs": "evaluation follows checkpoints: set throttle_secs= (at most one "
        "evaluation per that many seconds) or every_steps=",
    },
    "Estimator": {
        "use_tpu": _DEVICES,
        "eval_on_tpu": _DEVICES,
        "export_to_tpu": "export_saved_model lowers for cpu, cuda and tpu at once",
        "export_to_cpu": "export_saved_model lowers for cpu, cuda and tpu at once",
        "embedding_config_spec": "TPU embeddings are not supported",
        "batch_axis": "batches are split over replicas along axis 0",
    },
}


def original_keywords(cls: type[_T]) -> type[_T]:
    """Class decorator: the original's keywords in ``ORIGINAL_KEYWORDS`` get a one-line
    ``TypeError`` naming their estimax replacement (keywords the class takes pass through)."""
    table = ORIGINAL_KEYWORDS[cls.__name__]
    init = cls.__init__
    accepted = set(inspect.signature(init).parameters)
    known = {k: v for k, v in table.items() if k not in accepted}

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key in known:
                raise TypeError(
                    f"{cls.__name__}({key}=...) is TPUEstimator's; in estimax: {known[key]}."
                )
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


class ModeKeys:
    """The three modes a ``model_fn`` is called in; the values are the original's strings."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an ``input_fn`` learns about its place in the job (``params["context"]``).

    Attributes:
      host_index: index of this host (process) among ``num_hosts``; read this host's shard of files.
      num_hosts: number of hosts feeding the job.
      num_replicas: number of accelerator replicas the global batch is split over.
      global_batch_size: the batch size the Estimator was given for this mode.
    """

    host_index: int = 0
    num_hosts: int = 1
    num_replicas: int = 1
    global_batch_size: int = 0

    # tf.distribute.InputContext names, for input functions written against those.
    @property
    def input_pipeline_id(self) -> int:
        """Alias of ``host_index`` (``tf.distribute.InputContext`` name)."""
        return self.host_index

    @property
    def num_input_pipelines(self) -> int:
        """Alias of ``num_hosts`` (``tf.distribute.InputContext`` name)."""
        return self.num_hosts


@original_keywords
@dataclasses.dataclass
class EstimatorSpec:
    """What ``model_fn(features, labels, mode, params)`` returns.

    Replaces ``TPUEstimatorSpec``: the optimizer stands in for ``train_op`` (the Estimator
    differentiates ``loss`` and applies it), ``eval_metrics`` is a dict of metric objects from
    ``estimax.metrics`` (or the original's ``(metric_fn, tensors)``), and ``scalars`` stands in
    for the ``host_call`` that wrote summaries.

    Attributes:
      mode: the mode the spec was built for.
      loss: the training/eval loss: a scalar, or per-example losses ``[B]`` (then the Estimator
        averages them, and in eval masks padding rows so the eval loss is exact).
      optimizer: an ``optax.GradientTransformation``; required in TRAIN.
      eval_metrics: ``{name: Metric}`` computed in EVAL, streamed over the whole eval input; or
        TPUEstimatorSpec's ``(metric_fn, tensors)``, ``metric_fn(*tensors)`` (``**tensors`` for a
        dict) returning that dict.
      predictions: an array ``[B, ...]`` or a dict of them; required in PREDICT.
      export_outputs: optional ``{signature_name: predictions_dict}`` for export; the first entry
        (or ``predictions``) is what the exported function returns.
      scalars: ``{name: scalar}`` written to TensorBoard every summary step in TRAIN (e.g. the
        learning rate, the epoch), like the original's ``host_call``.
      summaries: ``{name: ex.summary.image(...) | histogram(...) | text(...)}`` written with the
        scalars in TRAIN (the original's image/histogram/text summaries in ``host_call``).
      weight_decay: if set, ``weight_decay * sum(l2 of kernels)`` is added to the loss, excluding
        batch-norm parameters (as the original ResNet did by name).
      ema_decay: if set, an exponential moving average of the parameters is kept and used for
        evaluation, prediction and export (Inception's ``moving_average``).
      gradient_clip_norm: if set, gradients are clipped to this global norm before the optimizer.
    """

    mode: str
    loss: Any = None
    optimizer: optax.GradientTransformation | None = None
    eval_metrics: Mapping[str, Any] | None = None
    predictions: Any = None
    export_outputs: Mapping[str, Any] | None = None
    scalars: Mapping[str, Any] | None = None
    summaries: Mapping[str, Any] | None = None
    weight_decay: float | None = None
    ema_decay: float | None = None
    gradient_clip_norm: float | None = None


_MODES = ("min", "max")


def check_mode(mode: str, what: str) -> None:
    """Refuses a metric mode other than ``"min"`` (smaller is better) or ``"max"``."""
    if mode not in _MODES:
        raise ValueError(
            f"{what}: mode must be 'min' (smaller is better, e.g. loss) or 'max' (larger is "
            f"better, e.g. accuracy), got {mode!r}."
        )


@dataclasses.dataclass(frozen=True)
class BestCheckpoint:
    """Which evaluated checkpoint is the best: by ``metric``, smaller (``"min"``) or larger
    (``"max"``) being better, in the evaluations recorded for ``eval_name``.

    ``RunConfig(keep_best_checkpoint=BestCheckpoint("accuracy", "max"))`` keeps that checkpoint
    beside the ``keep_checkpoint_max`` newest (never rotated away), and
    ``checkpoint_path="best"`` names it.

    Attributes:
      metric: a key of the evaluation results (``loss``, ``accuracy``, ...).
      mode: ``"min"`` or ``"max"``.
      eval_name: the ``EvalSpec.name`` (``Estimator.evaluate(name=)``) whose evaluations count;
        None: ``model_dir/eval``.
    """

    metric: str = "loss"
    mode: str = "min"
    eval_name: str | None = None

    def __post_init__(self) -> None:
        check_mode(self.mode, f"BestCheckpoint({self.metric!r})")


@original_keywords
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how a job runs: the original ``RunConfig`` + ``TPUConfig`` in one.

    Immutable: derive a changed copy with ``dataclasses.replace(config, model_dir=...)``.

    Attributes:
      model_dir: directory (local or any path Orbax/fsspec accepts) for checkpoints and summaries.
      iterations_per_loop: training steps between host synchronisations: once per loop the host
        fetches the loop's per-step metrics, checks for NaN, logs and may checkpoint. Steps are
        streamed (each dispatched when its batch is on the devices), so memory does not grow
        with it. The last loop of a ``train`` call is shortened so ``steps``/``max_steps`` are
        hit exactly.
      num_shards: number of replicas (devices) to use; ``None`` means every device.
      save_checkpoints_steps: save every N steps (at loop boundaries).
      save_checkpoints_secs: save every N seconds; the default (600) applies when neither is set,
        as in the original.
      keep_checkpoint_max: how many recent checkpoints to keep (``None`` keeps all).
      keep_best_checkpoint: a ``BestCheckpoint``: also keep the checkpoint whose recorded
        evaluation is the best by its metric, whatever its age (``checkpoint_path="best"``).
      train_after_early_stop: train even though this model_dir's training was stopped early
        (``stop_if_no_decrease_hook``/``stop_if_no_increase_hook`` record that decision in
        ``model_dir/early_stopping.json``; by default a later ``train()`` trains nothing and
        says so).
      save_summary_steps: write training scalars every N steps.
      log_step_count_steps: log ``loss = X, step = N`` and the speed every N steps.
      seed: seed of parameter initialisation and of the dropout streams.
      device_prefetch: how many input batches are transferred to the devices ahead of the step
        that uses them (flax's ``prefetch_to_device`` default, 2); input memory is about
        ``device_prefetch + 3`` batches whatever ``iterations_per_loop`` is.
      watchdog_timeout_secs: if no training step completes for this long, log every thread's
        Python stack and the last completed step and exit with status 75
        (``estimax.parallel.watchdog.HANG_EXIT_CODE``) so a job runner restarts the job from
        its last checkpoint. Generous by default (30 min: compiling a large model's first step
        takes minutes); None or 0 disables it.
      peer_timeout_secs: many hosts: seconds without a heartbeat from another process (killed,
        hung, unreachable) after which this one prints one line naming it and the last
        checkpoint step and exits with status 75, so the job runner restarts the job and it
        resumes from that checkpoint (``estimax.parallel.distributed.PeerWatch``). None: what
        ``distributed.initialize`` set (``--peer_timeout``, 60 s by default). Above 45 s give
        it to ``distributed.initialize`` too: JAX's own heartbeat timeout is set there.
      skip_nonfinite_steps: a step whose loss or gradients are NaN/Inf makes no update (params,
        optimizer state, batch statistics and EMA stay as they were) instead of stopping
        training with ``NanLossError``; skipped steps are counted (TensorBoard scalar
        ``train/nonfinite_skipped_steps`` and a warning per loop that had any).
      allow_invalid_labels: train on integer labels outside ``[0, num_classes)`` (their loss is
        0), counting them (``train/invalid_labels``) with a warning per loop, instead of
        stopping with ``InvalidLabelError``; in evaluation, leave such examples out of the loss
        and every metric and count them (``invalid_labels`` in the results,
        ``eval/invalid_labels`` in TensorBoard) with a warning.
      profile_steps: ``(START, STOP)``: capture a ``jax.profiler`` trace of training steps
        START..STOP (inclusive, with step markers) under ``model_dir/plugins/profile/``, where
        TensorBoard's profile plugin finds it (``estimax.ProfilerHook``); None: no trace.
      steps_per_device_call: run up to this many training steps in one device call, a
        ``lax.scan`` over that many batches stacked and transferred at once, instead of one
        call per step (the default, 1). It pays where the host's cost per step (a dispatch, a
        transfer, the loop's bookkeeping: tens of microseconds) is a large part of a step: small
        models, small batches, fast accelerators (a near-zero-cost model on a CPU: ~50 us of
        host CPU time per step over a plain jitted loop one call per step, none at k = 10,
        ``bench/results/overhead.md``, its ``zero_k10_k100`` section). Opt-in because it costs
        elsewhere: input memory becomes about 4 x k batches (a block read ahead, one being
        stacked, one running and one queued on the devices; ``device_prefetch`` is not used),
        XLA:CPU runs convolution gradients inside a device loop many times slower (an MNIST
        step: 12.7 s against 0.33 s), and each new block length compiles the step again. Calls
        never cross a loop's end (checkpoints, hooks, the last step): a loop of n steps runs
        ``n // k`` calls of k steps and one of the rest, so choose a k that divides
        ``iterations_per_loop``.
        Per-step metrics, summaries, the NaN check and the input position are kept per step as
        without it; a preemption notice stops training after the call that follows it.
      gradient_accumulation_steps: k > 1 splits each replica's share of the train batch into k
        micro-batches, run one after the other inside the jitted step (a ``lax.scan``), and
        makes one optimizer update with their mean gradient: activation memory is that of a
        batch k times smaller, the update that of the whole batch. ``train_batch_size`` stays
        the optimizer's (global) batch, so a step still reads one batch from the input and the
        input position, ``global_step``, schedules, summaries, checkpoints, early stopping and
        ``iterations_per_loop`` all count optimizer steps; ``gradient_clip_norm`` clips the
        accumulated gradient and the EMA is updated once per step. ``params["batch_size"]`` in
        TRAIN is the per-replica micro-batch. Batch-norm statistics are per micro-batch (its
        moving averages are updated k times a step). k must divide the per-replica batch
        (``train_batch_size / replicas``). On CPU the loop is unrolled (XLA:CPU runs
        convolution gradients inside a loop many times slower), so compiling takes longer
        with k there.
      num_cores_per_replica: TPUEstimator's ``TPUConfig.num_cores_per_replica``: the devices
        (cores) one model replica runs on, 1, 2, 4, ..., 128 (default 1: a replica per device).
        The devices used are ``num_cores_per_replica x replicas`` (``num_shards`` replicas, or
        every device / N). Each replica's devices hold the same parameters; how its activations
        are split over them is ``input_partition_dims`` (``estimax.parallel.layouts``).
      input_partition_dims: ``[features_dims, labels_dims]`` as TPUEstimator's: how each input
        is split over a replica's cores (spatial partitioning), e.g. ``[[1, 2, 2, 1], None]``
        splits NHWC images in 2 x 2 tiles over 4 cores and gives every core the whole labels.
        Each list's entries multiply to ``num_cores_per_replica`` (dict features: a dict of
        lists, None for an input every core gets whole); each split dimension of the input
        must divide by its entry. The host feeds whole images; the transfer to the devices and
        XLA do the split (halo exchanges for convolutions, batch-norm statistics over the
        replica's cores), with no change to the model.
      shard_parameters: FSDP, as big_vision's ``fsdp(axis="data", min_size_to_shard_mb=...)``:
        every parameter of at least this many MiB is split over the replicas on its largest
        dimension that divides by their number (its gradient, optimizer state and EMA with
        it), and gathered whole for the forward and backward passes; smaller ones stay
        replicated. None (default): every replica holds everything.
      num_slices: the TPU slices (or simulated slices of hosts) the replicas are spread over:
        data parallel across slices over the data-center network, a leading ``dcn`` mesh axis
        (``mesh_utils.create_hybrid_device_mesh``), gradients reduced inside each slice before
        they cross it; cores per replica and FSDP stay inside a slice. None (default):
        ``$MEGASCALE_NUM_SLICES`` where the job sets it, else 1. Must divide the processes and
        the devices; a ``MEGASCALE_*`` value that disagrees is refused.

    Mutable collections such as ``batch_stats`` are computed per replica, as on TPU, and
    averaged over replicas after each step (one consistent copy to checkpoint); pass
    ``axis_name=estimax.REPLICA_AXIS`` to ``nn.BatchNorm`` for cross-replica batch norm.
    """

    model_dir: str | None = None
    iterations_per_loop: int = 100
    num_shards: int | None = None
    save_checkpoints_steps: int | None = None
    save_checkpoints_secs: float | None = None
    keep_checkpoint_max: int | None = 5
    keep_best_checkpoint: BestCheckpoint | None = None
    train_after_early_stop: bool = False
    save_summary_steps: int = 100
    log_step_count_steps: int = 100
    seed: int = 0
    device_prefetch: int = 2
    watchdog_timeout_secs: float | None = 1800.0
    peer_timeout_secs: float | None = None
    skip_nonfinite_steps: bool = False
    profile_steps: tuple[int, int] | None = None
    allow_invalid_labels: bool = False
    steps_per_device_call: int = 1
    gradient_accumulation_steps: int = 1
    num_cores_per_replica: int = 1
    input_partition_dims: Sequence[Any] | None = None
    shard_parameters: float | None = None
    num_slices: int | None = None
    # The layout the three fields above make (``estimax.parallel.layouts.Layout``): built once,
    # here, and read by the step builder, the input transfer and the programs' checks.
    layout: Layout = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_layout(self.num_cores_per_replica, self.input_partition_dims, self.shard_parameters)
        # Resolved once (flag, else $MEGASCALE_NUM_SLICES, else 1): the layout reads a count.
        object.__setattr__(self, "num_slices", replication.num_slices_from(self.num_slices))
        object.__setattr__(self, "layout", Layout.from_config(self))  # frozen: set once here
        if self.iterations_per_loop < 1:
            raise ValueError(
                f"RunConfig.iterations_per_loop must be >= 1, got {self.iterations_per_loop}."
            )
        if not 1 <= self.steps_per_device_call <= self.iterations_per_loop:
            raise ValueError(
                "RunConfig.steps_per_device_call must be from 1 to iterations_per_loop "
                f"({self.iterations_per_loop}): a device call never crosses a host sync; got "
                f"{self.steps_per_device_call}."
            )
        if self.gradient_accumulation_steps < 1:
            raise ValueError(
                "RunConfig.gradient_accumulation_steps (--gradient_accumulation_steps) must be "
                f">= 1 (1: no accumulation), got {self.gradient_accumulation_steps}; e.g. 2 "
                "halves the activation memory of a train step."
            )
        if self.save_checkpoints_steps is not None and self.save_checkpoints_secs is not None:
            raise ValueError(
                "RunConfig: set save_checkpoints_steps or save_checkpoints_secs, not both."
            )
        if self.save_checkpoints_steps is None and self.save_checkpoints_secs is None:
            object.__setattr__(self, "save_checkpoints_secs", 600.0)  # frozen: set once here
        for name in ("save_summary_steps", "log_step_count_steps", "device_prefetch"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.watchdog_timeout_secs is not None and self.watchdog_timeout_secs < 0:
            raise ValueError(
                "RunConfig.watchdog_timeout_secs must be >= 0 (0 or None disables it), got "
                f"{self.watchdog_timeout_secs}."
            )
        if self.peer_timeout_secs is not None and self.peer_timeout_secs < 0:
            raise ValueError(
                f"RunConfig.peer_timeout_secs must be >= 0, got {self.peer_timeout_secs}."
            )
        if self.profile_steps is not None and not (
            len(self.profile_steps) == 2 and 1 <= self.profile_steps[0] <= self.profile_steps[1]
        ):
            raise ValueError(
                "RunConfig.profile_steps must be (START, STOP) with 1 <= START <= STOP, got "
                f"{self.profile_steps}."
            )
        if self.keep_checkpoint_max is not None and self.keep_checkpoint_max < 1:
            raise ValueError(
                "RunConfig.keep_checkpoint_max must be >= 1 or None, got "
                f"{self.keep_checkpoint_max}."
            )
        if self.keep_best_checkpoint is not None and not isinstance(
            self.keep_best_checkpoint, BestCheckpoint
        ):
            raise TypeError(
                "RunConfig.keep_best_checkpoint must be an estimax.BestCheckpoint(metric, mode), "
                f"got {self.keep_best_checkpoint!r}."
            )


@original_keywords
@dataclasses.dataclass
class TrainSpec:
    """The training half of ``train_and_evaluate``: an input function, where to stop, and the
    ``SessionRunHook``s passed to ``Estimator.train``."""

    input_fn: Callable[[dict], Any]
    max_steps: int | None = None
    hooks: Sequence[Any] = ()


@original_keywords
@dataclasses.dataclass
class EvalSpec:
    """The evaluation half of ``train_and_evaluate``.

    Attributes:
      input_fn: the eval input function (finite; evaluated exactly when ``steps`` is None).
      steps: number of eval batches, or None for the whole input.
      name: results go to ``model_dir/eval_<name>`` instead of ``model_dir/eval`` (with several
        EvalSpecs, each needs its own name; TensorBoard shows each directory as a run).
      every_steps: evaluate each time this many training steps have been done (the original
        programs' ``steps_per_eval``). None: after each checkpoint save (throttled).
      throttle_secs: with ``every_steps=None``, do not evaluate more often than this.
      hooks: ``SessionRunHook``s passed to each ``Estimator.evaluate``.
      exporters: ``estimax.BestExporter``, ``LatestExporter``, ``FinalExporter`` (or any object
        with ``name`` and ``export(estimator, export_path, checkpoint_path, eval_result,
        is_the_final_export)``, the original's ``Exporter``), run after each of this spec's
        evaluations; each writes under ``model_dir/export/<name>/``. One exporter or a list.
    """

    input_fn: Callable[[dict], Any]
    steps: int | None = None
    name: str | None = None
    every_steps: int | None = None
    throttle_secs: float = 600.0
    hooks: Sequence[Any] = ()
    exporters: Any = ()

    def __post_init__(self) -> None:
        exporters = self.exporters
        if exporters is None:
            exporters = ()
        elif not isinstance(exporters, list | tuple):
            exporters = (exporters,)
        names = []
        for exporter in exporters:
            if not (hasattr(exporter, "name") and callable(getattr(exporter, "export", None))):
                raise TypeError(
                    "EvalSpec(exporters=...) takes estimax.BestExporter, LatestExporter or "
                    f"FinalExporter objects (name and export()); got {type(exporter).__name__}."
                )
            names.append(exporter.name)
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(
                f"EvalSpec(exporters=...): the names {duplicated} are used more than once; each "
                "exporter writes to model_dir/export/<name>, so names must be unique."
            )
        self.exporters = tuple(exporters)
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"EvalSpec.every_steps must be >= 1 or None, got {self.every_steps}.")


# TPUConfig's values (tensorflow/estimator tpu_config.py): a replica spans a power of two cores.
CORES_PER_REPLICA = (1, 2, 4, 8, 16, 32, 64, 128)


def check_layout(cores: int, input_partition_dims: Any, shard_parameters: float | None) -> None:
    """Raises ValueError (one line naming the flag and the field) for a layout TPUEstimator
    would refuse: cores per replica not a power of two up to 128, partition dims that are not
    ``[features_dims, labels_dims]`` of positive ints multiplying to the cores, or a
    non-positive FSDP size."""
    if cores not in CORES_PER_REPLICA:
        raise ValueError(
            f"--num_cores_per_replica={cores} (RunConfig.num_cores_per_replica) must be one of "
            f"{', '.join(map(str, CORES_PER_REPLICA))}, as TPUConfig's."
        )
    if shard_parameters is not None and not shard_parameters > 0:
        raise ValueError(
            f"--fsdp_min_size_mb={shard_parameters} (RunConfig.shard_parameters) must be a "
            "size in MiB > 0 (big_vision's default is 4), or unset for no FSDP."
        )
    if input_partition_dims is None:
        return
    if not isinstance(input_partition_dims, list | tuple) or len(input_partition_dims) not in (
        1,
        2,
    ):
        raise ValueError(
            "RunConfig.input_partition_dims must be [features_dims] or [features_dims, "
            f"labels_dims] (e.g. [[1, 2, 2, 1], None]), got {input_partition_dims!r}."
        )
    for what, dims in zip(("features", "labels"), input_partition_dims, strict=False):
        for where, entry in partition_lists(dims):
            flag = f"--input_partition_dims={format_dims(entry)} (RunConfig.input_partition_dims)"
            if not (
                isinstance(entry, list | tuple)
                and entry
                and all(isinstance(d, int) and d >= 1 for d in entry)
            ):
                raise ValueError(
                    f"{flag}: the {what}{where} dims must be a list of positive integers, one "
                    "per dimension (NHWC images: 1,2,2,1)."
                )
            product = 1
            for d in entry:
                product *= d
            if product != cores:
                raise ValueError(
                    f"{flag}: the {what}{where} dims multiply to {product}, not to "
                    f"--num_cores_per_replica={cores}: each input is split over exactly the "
                    "cores of one replica."
                )
