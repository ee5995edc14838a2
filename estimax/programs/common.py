"""What the programs share: TPU flags, run flags, the data check, the modes and the run's tail.

The three programs keep the original's flag names and defaults; the flags below are the ones the
originals had for the TPU or the cloud. estimax accepts them so a user's command line runs as
written, and maps or explains each:

| original flag                         | in estimax                                              |
|---------------------------------------|---------------------------------------------------------|
| ``--num_cores`` / ``--num_shards``    | ``RunConfig.num_shards`` (replicas) when it is <= the   |
|                                       | number of JAX devices; else all devices, with a warning |
| ``--tpu``, ``--master``               | unused: JAX finds its devices; multi-host jobs call     |
|                                       | ``jax.distributed.initialize()``                        |
| ``--gcp_project``, ``--tpu_zone``     | unused (they located the TPU)                           |
| ``--use_tpu``                         | unused: the same code runs on TPU, GPU or CPU           |
| ``--transpose_input``, ``--data_format`` | unused: XLA picks layouts; models are NHWC           |
| ``--export_to_tpu``                   | unused: an export is lowered for cpu, cuda and tpu      |

The modes are the original ``resnet_main.py``'s: ``train`` trains to
``train_steps``; ``eval`` follows the checkpoints a training job writes until the one at
``train_steps`` is evaluated; ``train_and_eval`` alternates ``steps_per_eval`` training steps and a
full evaluation, resuming where a previous run stopped.

Each program is a model family (``estimax.programs.family``; listed in ``families``): it maps its
flags to a ``Job`` (``Job.for_family`` takes the model, the recorded flags and the export from
the family) and calls ``run(job)``, the tail they share: take the
writer lock of ``model_dir`` (``estimax.state.lock``), compare and record the model-shaping
flags (``model_dir/flags.json``), keep fake-data warnings in TensorBoard, build the Estimator,
run the mode, export (``export``), close, print the result line. The checks that need no
Estimator (locations, data, splits) run before it, in ``check_locations`` and ``check_data``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import posixpath
import time
from collections.abc import Callable
from typing import Any

import fsspec
import jax
import numpy as np
from absl import flags, logging

import estimax as ex
from estimax.compile import compile as compile_lib
from estimax.compile import gpu_compile
from estimax.compile import search as search_lib
from estimax.estimator import spec as spec_lib
from estimax.estimator import step_builder
from estimax.models.layers import REMAT_CHOICES
from estimax.programs import cli, flagspec
from estimax.programs.cli import UsageError
from estimax.programs.family import Family
from estimax.state import lock

# resnet_main.py's default --data_dir (2018-12): a public bucket of fake ImageNet records. It
# cannot be reached here (no network), so it means local fake data (see resolve_data_dir).
FAKE_DATA_DIR = "gs://cloud-tpu-test-datasets/fake_imagenet"
# --data_dir values that ask for fake data in so many words: the original's null input (zero
# images, label 0) and random images.
FAKE_DATA_DIRS = {"null": "zeros", "fake": "random"}

MODES = ("train", "eval", "train_and_eval")

UNUSED_HELP = "Accepted for compatibility with the original's command lines; unused by estimax"


# The original's TPU/cloud flags (same names, defaults None/True), accepted and explained.
TPU_FLAGS = (
    flagspec.Bool(
        "use_tpu",
        True,
        f"{UNUSED_HELP}: the same code runs on whatever JAX backend is present (TPU, GPU or CPU).",
    ),
    flagspec.Str(
        "tpu",
        None,
        f"{UNUSED_HELP}: the Cloud TPU name (e.g. $TPU_NAME). JAX "
        "finds local TPU chips itself; multi-host jobs use jax.distributed.",
    ),
    flagspec.Str("gcp_project", None, f"{UNUSED_HELP} (it located the Cloud TPU)."),
    flagspec.Str("tpu_zone", None, f"{UNUSED_HELP} (it located the Cloud TPU)."),
)
# Compile the steps for a TPU slice instead of running them (estimax.compile.compile).
COMPILE_FOR_FLAG = flagspec.Str(
    "compile_for",
    None,
    "Compile this run's train and eval steps for a Cloud TPU slice or NVIDIA GPUs instead of "
    "running them (no TPU, GPU, network or data needed; needs libtpu: pip install -e '.[tpu]', "
    "or for GPUs JAX's CUDA plugin: pip install -e '.[gpu-compile]') and print per step "
    "whether it fits, its memory, work and roofline speed per device; if a step does not fit, "
    f"exit 2 naming the largest global batch that does. Topologies: "
    f"{compile_lib.known_topologies()}.",
)
# TPUConfig's model parallelism and FSDP (estimax.parallel.layouts; docs/layouts.md).
LAYOUT_FLAGS = (
    flagspec.Int(
        "num_cores_per_replica",
        1,
        "TPUConfig's num_cores_per_replica: the devices one model replica runs on (1, 2, 4, ..., "
        "128); the replicas are the devices (--num_cores/--num_shards, the total) divided by "
        "it. Each replica's cores hold the same weights; --input_partition_dims says how its "
        "images are split over them.",
        lower=1,
    ),
    flagspec.Str(
        "input_partition_dims",
        None,
        "TPUConfig's input_partition_dims for the images (NHWC; labels are not split): e.g. "
        "1,2,2,1 splits each image in 2 x 2 tiles over 4 cores per replica (spatial "
        "partitioning, for images too large for one device's memory). The entries multiply to "
        "--num_cores_per_replica and each split side must divide by its entry.",
    ),
    flagspec.Float(
        "fsdp_min_size_mb",
        None,
        "FSDP (big_vision's fsdp(min_size_to_shard_mb=...)): split every parameter of at least "
        "this many MiB, with its gradient, optimizer state and moving average, over the "
        "replicas (on its largest dimension that divides by their number); gathered whole "
        "for each step. Checkpoints restore under any layout. Default: off.",
        lower=0.0,
    ),
)
# The older programs' way to name the TPU.
MASTER_FLAG = flagspec.Str(
    "master", None, f"{UNUSED_HELP}: the TPU's gRPC address (e.g. $TPU_GRPC_URL)."
)


def define_tpu_flags(fv: flags.FlagValues, *, master: bool = True) -> None:
    """Defines the original's TPU/cloud flags and the many-hosts flags on ``fv``.

    Args:
      fv: the flag registry (``flags.FLAGS`` for a program, a fresh one in tests).
      master: also define ``--master`` (the older programs' way to name the TPU).
    """
    flagspec.define(
        fv, (*TPU_FLAGS, COMPILE_FOR_FLAG, *LAYOUT_FLAGS), (MASTER_FLAG,) if master else ()
    )
    cli.define_cluster_flags(fv)


def log_unused_tpu_flags(fv: flags.FlagValues) -> None:
    """Says, once, that the TPU-locating flags given on the command line are not needed."""
    given = [
        f"--{name}={fv[name].value}"
        for name in ("tpu", "master", "gcp_project", "tpu_zone")
        if name in fv and fv[name].present and fv[name].value
    ]
    if given:
        logging.info(
            "%s: not needed by estimax, which runs on the local JAX devices %s.",
            " ".join(given),
            jax.devices(),
        )


def resolve_num_shards(
    requested: int | None, flag_name: str, *, compile_only: bool = False
) -> int | None:
    """Maps ``--num_cores``/``--num_shards`` to ``RunConfig.num_shards``.

    Args:
      requested: the flag's value (the original's default 8 is the cores of one Cloud TPU).
      flag_name: for the message.
      compile_only: ``--compile_for``: the slice's devices, not this host's, are what
        ``requested`` is checked against (when the steps are compiled).

    Returns:
      ``requested`` if this job has that many devices (or with ``compile_only``); else None
      (every device), after a warning that names the flag, the value and the devices found.
    """
    available = jax.device_count()
    if requested is None:
        return None
    if requested < 1:
        raise UsageError(f"--{flag_name}={requested}: must be >= 1.")
    if requested > available and not compile_only:
        logging.warning(
            "--%s=%d but this job has %d %s device(s); using all %d. (The original's default "
            "8 was the cores of one Cloud TPU; set --%s to at most %d to silence this.)",
            flag_name,
            requested,
            available,
            jax.default_backend(),
            available,
            flag_name,
            available,
        )
        return None
    return requested


def run_flags(
    *,
    data_dir_default: str | None,
    data_dir_help: str,
    steps_per_eval_flag: str,
    precision_default: str,
) -> tuple[flagspec.Flag, ...]:
    """The flags every ImageNet program has, with one wording.

    Args:
      data_dir_default, data_dir_help: the program's ``--data_dir`` (the originals differ).
      steps_per_eval_flag: the name of the program's steps-between-evaluations flag.
      precision_default: the program's compute dtype.
    """
    return (
        flagspec.Str("data_dir", data_dir_default, data_dir_help),
        flagspec.Str(
            "model_dir",
            None,
            "Directory for checkpoints and TensorBoard summaries "
            "(local, gs:// or s3://; default $TPU_MODEL_DIR when a job runner sets "
            "it). One trainer at a time: a second one on the same directory stops.",
        ),
        flagspec.Enum(
            "mode",
            "train_and_eval",
            MODES,
            "train: train to --train_steps; eval: evaluate each new checkpoint in "
            "--model_dir until the one at --train_steps (another job trains); "
            f"train_and_eval: alternate --{steps_per_eval_flag} training steps and an "
            "evaluation.",
        ),
        flagspec.Int(
            "eval_timeout",
            None,
            "In eval mode, stop after this many seconds "
            "without a new checkpoint (default: wait for the one at --train_steps).",
            lower=0,
        ),
        flagspec.Str(
            "export_dir",
            None,
            "After training, publish the model for serving as "
            "the next numbered version under this directory (export_dir/1, 2, ...: "
            "`estimax serve --model_base_path=DIR` serves it; clients send JPEG/PNG "
            "bytes); with a moving average of the weights, the averaged weights are "
            "exported.",
        ),
        *COMMON_RUN_FLAGS,
        flagspec.Enum("precision", precision_default, ["bfloat16", "float32"], PRECISION_HELP),
    )


PRECISION_HELP = (
    "Compute dtype of the network (parameters and loss stay float32). On a "
    "CPU, bfloat16 convolutions run natively only where the CPU has bf16 "
    "instructions (AVX-512 bf16 or AMX); elsewhere (AVX2-only CPUs such as "
    "AMD Zen 2) they run as float32 kernels on bf16 values, one rounding back "
    "to bf16 each (`python -m estimax.ops.native status` says which), so "
    "float32 is as fast there."
)


# The part of the run flags that is the same, default included, in every ImageNet program.
COMMON_RUN_FLAGS = (
    flagspec.Bool(
        "skip_bad_records",
        False,
        "Skip (and count, with a warning) records "
        "that cannot be read or decoded instead of stopping.",
    ),
    flagspec.Bool(
        "skip_nonfinite_steps",
        False,
        "Skip (make no update for, and count in TensorBoard's "
        "train/nonfinite_skipped_steps and a warning) training steps whose loss or gradients "
        "are NaN/Inf, instead of stopping at the first one with the last good checkpoint kept.",
    ),
    flagspec.Int("keep_checkpoint_max", 5, "Number of recent checkpoints kept.", lower=1),
    # tf.estimator's warm_start_from (estimax.state.warm_start).
    flagspec.Str(
        "warm_start_from",
        None,
        "When --model_dir has no checkpoint yet, initialise the variables from this checkpoint: "
        "a TensorFlow checkpoint of the original ResNet/Inception (its model_dir, or "
        "model.ckpt-N) or an estimax model_dir. Variables of another shape (a new head: "
        "another number of classes) start fresh; the log lists what was loaded.",
    ),
    flagspec.Bool(
        "cpu_fast_ops",
        True,
        "Use estimax.ops' convolution and max-pool, whose "
        "gradients XLA:CPU runs several times faster; identical ops on GPU/TPU.",
    ),
    # Rematerialisation per block (estimax.parallel.remat.remat_block): not a model-shaping flag
    # (the parameters are the same), so a run may resume under another policy.
    flagspec.Enum(
        "remat",
        "none",
        REMAT_CHOICES,
        "Recompute each block's activations (residual, MBConv, Inception or encoder block) in "
        "the backward pass instead of keeping them: less memory, about one more forward pass "
        "of compute. none: keep all; full: keep only each block's input; or a "
        "jax.checkpoint_policies name (dots_saveable: keep convolution and matmul outputs). "
        "--compile_for reports the memory under the policy given.",
    ),
)


def define_run_flags(
    fv: flags.FlagValues,
    *,
    data_dir_default: str | None,
    data_dir_help: str,
    steps_per_eval_flag: str,
    precision_default: str,
) -> None:
    """Defines ``run_flags(...)`` on ``fv`` (see there for the arguments)."""
    flagspec.define(
        fv,
        run_flags(
            data_dir_default=data_dir_default,
            data_dir_help=data_dir_help,
            steps_per_eval_flag=steps_per_eval_flag,
            precision_default=precision_default,
        ),
    )


def check_locations(fv: flags.FlagValues) -> None:
    """Checks ``--model_dir`` (required unless ``--compile_for``) and ``--export_dir`` before any
    work (see cli)."""
    cli.check_location("model_dir", fv.model_dir, required=not fv.compile_for)
    cli.check_location("export_dir", fv.export_dir)


def shard_index_dir(model_dir: str | None) -> str | None:
    """Where a job keeps the indexes of bucket shards that have none and may not get one beside
    them (a read-only bucket of TensorFlow-written shards): ``<model_dir>/shard_indexes``, which
    every host of the job reads and writes, so the hosts share the indexing and later starts
    pull nothing to index (``estimax.data.shard_index``). None without a model_dir."""
    return f"{model_dir.rstrip('/')}/shard_indexes" if model_dir else None


def resolve_data_dir(data_dir: str | None, *, use_fake: bool = False) -> tuple[str | None, str]:
    """Returns ``(data_dir, fake_kind)`` for ``estimax.data.imagenet.input_fn``.

    * ``'null'``: the original's null input (zero images, label 0); ``'fake'``: random images.
    * ``gs://cloud-tpu-test-datasets/fake_imagenet`` (resnet's default) or ``use_fake``: local
      random fake data; the public bucket is not reachable from here, and what it held (random
      images in the real format) is what local random data stands in for.
    * anything else: the real TFRecord files there.

    Raises:
      UsageError: ``data_dir`` is None or empty (fake data only when asked for).
    """
    if use_fake:
        return None, "random"
    if data_dir is not None and data_dir.strip() in FAKE_DATA_DIRS:
        return None, FAKE_DATA_DIRS[data_dir.strip()]
    cli.check_location("data_dir", data_dir, required=True)
    assert data_dir is not None
    if data_dir.rstrip("/") == FAKE_DATA_DIR:
        return None, "random"
    return data_dir, "random"


def check_data(
    data_dir: str | None,
    mode: str,
    *,
    use_fake: bool = False,
    fake_hint: str = "--data_dir=fake",
    compile_only: bool = False,
) -> tuple[str | None, str, list[str]]:
    """``resolve_data_dir`` plus what a user must hear at start: fake data, a missing split.

    Args:
      data_dir: the ``--data_dir`` value.
      mode: ``--mode`` (which splits the run reads).
      use_fake: fake data asked for by another flag (``--use_data=fake``).
      fake_hint: how this program asks for fake data, for the messages.
      compile_only: ``--compile_for``: no data is read, so none is checked (it may be remote).

    Returns:
      ``(data_dir, fake_kind, notes)``: the first two for the input; ``notes`` the warnings to
      keep in TensorBoard's run description.

    Raises:
      UsageError: no data asked for, or a split the mode reads has no files.
    """
    if compile_only:
        return None, "random", []
    if data_dir is None and not use_fake:
        raise UsageError(
            f"--data_dir is not set: give the directory of the ImageNet TFRecords "
            f"(train-*, validation-*), or ask for fake data with {fake_hint}."
        )
    resolved, kind = resolve_data_dir(data_dir, use_fake=use_fake)
    if resolved is None:
        why = (
            "--use_data=fake"
            if use_fake
            else f"--data_dir={data_dir}"
            + (
                " (the original's public fake ImageNet, which cannot be read from here)"
                if kind == "random" and data_dir not in FAKE_DATA_DIRS
                else ""
            )
        )
        note = (
            f"FAKE DATA: {why}: training and evaluating on "
            f"{'all-zero' if kind == 'zeros' else 'random'} images, not a real data set."
        )
        logging.warning("*** %s ***", note)
        return None, kind, [note]
    _check_splits(resolved, data_dir, mode, fake_hint)
    return resolved, kind, []


def _check_splits(resolved: str, data_dir: str | None, mode: str, fake_hint: str) -> None:
    """Raises UsageError naming the first split ``mode`` reads that has no files."""
    from estimax.data import imagenet, tfrecord

    splits = {"train": [True], "eval": [False], "train_and_eval": [True, False]}[mode]
    for is_training in splits:
        pattern = imagenet.file_pattern(resolved, is_training)
        try:
            tfrecord.list_files(pattern)
        except (FileNotFoundError, OSError):
            raise UsageError(
                f"--data_dir={data_dir} has no {posixpath.basename(pattern)} files, which "
                f"--mode={mode} reads: point --data_dir at the ImageNet TFRecords "
                f"(estimax-convert writes them), or ask for fake data with {fake_hint}."
            ) from None


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How a program drives its Estimator (the original's mode flags, gathered).

    Attributes:
      mode: ``train``, ``eval`` or ``train_and_eval``.
      train_steps: the global step training ends at (absolute; resumed runs continue to it).
      steps_per_eval: training steps between evaluations in ``train_and_eval``.
      eval_steps: eval batches per evaluation; None evaluates every eval example once.
      eval_timeout: ``eval`` mode stops after this many seconds without a new checkpoint
        (None: waits for the checkpoint at ``train_steps``).
      export_dir: after training, export the model for serving under this directory.
      epochs_per_step: for the 'Training for N steps (E epochs in total)' log line.
    """

    mode: str
    train_steps: int
    steps_per_eval: int
    eval_steps: int | None = None
    eval_timeout: float | None = None
    export_dir: str | None = None
    epochs_per_step: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--mode={self.mode!r}: must be one of {', '.join(MODES)}.")
        if self.train_steps < 1:
            raise UsageError(f"--train_steps={self.train_steps}: must be >= 1.")
        if self.steps_per_eval < 1:
            raise UsageError(
                f"the steps between evaluations must be >= 1, got {self.steps_per_eval}."
            )

    @classmethod
    def from_flags(
        cls, fv: flags.FlagValues, *, steps_per_eval: int, eval_examples: int, train_examples: int
    ) -> LoopConfig:
        """The loop of an ImageNet program's flags (``define_run_flags`` and the batch sizes).

        Args:
          fv: parsed flags with ``mode``, ``train_steps``, ``train_batch_size``,
            ``eval_batch_size``, ``eval_timeout``, ``export_dir``.
          steps_per_eval: the program's steps-between-evaluations flag's value.
          eval_examples: evaluation examples (every one evaluated once).
          train_examples: examples per epoch (for the log line).
        """
        return cls(
            mode=fv.mode,
            train_steps=fv.train_steps,
            steps_per_eval=steps_per_eval,
            eval_steps=-(-eval_examples // fv.eval_batch_size),
            eval_timeout=fv.eval_timeout,
            export_dir=fv.export_dir,
            epochs_per_step=fv.train_batch_size / train_examples,
        )


def run_config(fv: flags.FlagValues, iterations_flag: str, **fields: Any) -> ex.RunConfig:
    """The ``RunConfig`` of the flags every program has, with the program's ``fields``.

    Args:
      fv: the parsed flags (``--model_dir``, ``--watchdog_timeout``, ``--profile_steps``,
        ``--steps_per_device_call``, ``--gradient_accumulation_steps`` and the program's
        ``iterations_flag``).
      iterations_flag: the name of the program's iterations-per-loop flag.
      **fields: the program's other ``RunConfig`` fields.

    Raises:
      UsageError: ``--steps_per_device_call`` above the steps per loop.
    """
    iterations = int(fv[iterations_flag].value or 1)  # never None: the flag has a default
    if fv.steps_per_device_call > iterations:
        raise UsageError(
            f"--steps_per_device_call={fv.steps_per_device_call} is more than "
            f"--{iterations_flag}={iterations}: a device call never crosses a loop's end."
        )
    fields.update(layout_fields(fv, fields.get("num_shards")))
    return ex.RunConfig(
        model_dir=fv.model_dir,
        iterations_per_loop=iterations,
        watchdog_timeout_secs=fv.watchdog_timeout,
        profile_steps=cli.profile_steps(fv),
        steps_per_device_call=fv.steps_per_device_call,
        gradient_accumulation_steps=fv.gradient_accumulation_steps,
        **fields,
    )


def layout_fields(fv: flags.FlagValues, num_cores: int | None) -> dict[str, Any]:
    """``RunConfig``'s layout fields from ``--num_cores_per_replica``, ``--input_partition_dims``
    and ``--fsdp_min_size_mb``, with ``num_shards`` as replicas: the original's ``--num_cores``
    (``num_cores``, resolved) counts every core, so it is divided by the cores per replica.

    Raises:
      UsageError: one line naming the flag (TPUConfig's checks, ``spec.check_layout``).
    """
    cores = fv.num_cores_per_replica
    dims: list[Any] | None = None
    if fv.input_partition_dims:
        try:
            dims = [[int(d) for d in fv.input_partition_dims.split(",")], None]
        except ValueError:
            raise UsageError(
                f"--input_partition_dims={fv.input_partition_dims}: give integers separated by "
                "commas, one per image dimension (NHWC), e.g. 1,2,2,1."
            ) from None
    try:
        spec_lib.check_layout(cores, dims, fv.fsdp_min_size_mb)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if num_cores is not None and num_cores % cores:
        raise UsageError(
            f"--num_cores_per_replica={cores} does not divide the {num_cores} cores asked for "
            f"(--num_cores/--num_shards): use a multiple of {cores}."
        )
    return {
        "num_shards": None if num_cores is None else num_cores // cores,
        "num_cores_per_replica": cores,
        "input_partition_dims": dims,
        "shard_parameters": fv.fsdp_min_size_mb,
    }


def check_layout(job: Job) -> None:
    """The layout's checks that need the devices and the image size, before anything runs:
    ``--num_cores_per_replica`` dividing the devices, each split image side dividing by its
    entry (the served image; training batches are checked again when the first arrives).

    Raises:
      UsageError: one line naming the flag.
    """
    config = job.config
    if config.num_cores_per_replica == 1 and config.input_partition_dims is None:
        return
    try:
        layout = config.layout
        layout.make_mesh(config.num_shards)
        features, _ = compile_inputs(job)
        shaped = jax.tree.map(
            lambda t: jax.ShapeDtypeStruct((1, *t.shape[1:]), t.dtype),
            features,
            is_leaf=lambda x: isinstance(x, ex.TensorSpec),
        )
        layout.input_specs(shaped, None)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resnet_style_configs(
    fv: flags.FlagValues, num_shards: int | None
) -> tuple[ex.RunConfig, LoopConfig]:
    """The RunConfig and loop of the flags resnet_main.py and EfficientNet's main.py share.

    ``--iterations_per_loop``, ``--save_checkpoints_steps`` (default max(100,
    iterations_per_loop), as both originals), ``--log_step_count_steps``, ``--steps_per_eval``,
    ``--num_eval_images``, ``--num_train_images`` and ``run_flags``' flags.
    """
    config = run_config(
        fv,
        "iterations_per_loop",
        num_shards=num_shards,
        save_checkpoints_steps=fv.save_checkpoints_steps or max(100, fv.iterations_per_loop),
        keep_checkpoint_max=fv.keep_checkpoint_max,
        log_step_count_steps=fv.log_step_count_steps,
        skip_nonfinite_steps=fv.skip_nonfinite_steps,
    )
    loop = LoopConfig.from_flags(
        fv,
        steps_per_eval=fv.steps_per_eval,
        eval_examples=fv.num_eval_images,
        train_examples=fv.num_train_images,
    )
    return config, loop


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything the shared tail needs, gathered by a program from its flags.

    Attributes:
      program: the program's name (kept in ``model_dir/flags.json``).
      model_flags: the flags that decide the checkpoint's shape, ``{name: value}``.
      model_fn, config, params: the Estimator's (built after the model_dir checks, so nothing
        is written into a model_dir that another trainer holds).
      batch_sizes: ``(train, eval)`` global batch sizes (predict uses eval's).
      input_fn: ``input_fn(is_training=...)`` -> the Estimator's input function.
      loop: mode, steps, export settings.
      serving: the features' spec for ``--export_dir``.
      preprocessing: for image programs, what the server applies to the JPEG/PNG bytes clients
        send (``estimax.export.resnet_eval(size)``...); None: clients send ``serving`` arrays.
      eval_preprocess: the input pipeline's eval preprocessing of one encoded image; with
        ``preprocessing`` declared as data, the export is checked to match it (no skew).
      check_inputs: returns a few examples (encoded images with ``preprocessing``, else an
        array of features) that the export is checked with against ``Estimator.predict``
        before it is published; None, or returning None: no check (fake data has no images).
      class_names: returns the export's class names by served id (``manifest_class_names``);
        None, or returning None: the export names no class.
      export_tolerance: ``(rtol, atol)`` for that check.
      metrics: the metrics printed for the last evaluation, and what its examples are called.
      notes: warnings to keep in TensorBoard's run description (fake data).
    """

    program: str
    model_flags: dict[str, Any]
    model_fn: Callable
    config: Any
    batch_sizes: tuple[int, int]
    input_fn: Callable[..., Callable]
    loop: LoopConfig
    serving: Any
    metrics: tuple[tuple[str, ...], str]
    params: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    preprocessing: Any = None
    eval_preprocess: Callable[[bytes], Any] | None = None
    check_inputs: Callable[[], Any] | None = None
    class_names: Callable[[], list[str] | None] | None = None
    export_tolerance: tuple[float, float] = (1e-3, 1e-4)
    # --warm_start_from: used only while model_dir has no checkpoint.
    warm_start_from: str | None = None
    # --compile_for: compile the steps for this TPU slice instead of running them.
    compile_for: str | None = None
    # (current --remat, model_fn under another --remat policy): what --compile_for tries when
    # the train step does not fit; None where the model has no --remat.
    remat: tuple[str, Callable[[str], Callable]] | None = None

    @classmethod
    def for_family(cls, family: Family, fv: flags.FlagValues, recipe: Any, **rest: Any) -> Job:
        """A job whose model, ``flags.json`` record, export and result line are ``family``'s.

        Args:
          family: the program's family.
          fv: the parsed flags.
          recipe: the family's config of these flags (``family.config_from_flags(fv)``, or a
            variant of it).
          **rest: the other fields (config, loop, input_fn, batch_sizes, ...).
        """
        return cls(
            program=family.name,
            model_flags=family.recorded_flags(fv),
            model_fn=family.make_model_fn(recipe),
            serving=family.input_spec(fv),
            preprocessing=family.preprocessing(fv),
            metrics=family.metrics,
            warm_start_from=fv["warm_start_from"].value if "warm_start_from" in fv else None,
            compile_for=fv["compile_for"].value if "compile_for" in fv else None,
            remat=_remat_variants(family, recipe),
            **rest,
        )


def _remat_variants(family: Family, recipe: Any) -> tuple[str, Callable[[str], Callable]] | None:
    """``Job.remat`` of a family's recipe that has a ``remat`` field (its --remat)."""
    if (
        not dataclasses.is_dataclass(recipe)
        or isinstance(recipe, type)
        or not hasattr(recipe, "remat")
    ):
        return None
    return recipe.remat, lambda policy: family.make_model_fn(
        dataclasses.replace(recipe, remat=policy)
    )


def checkpoint_path(model_dir: str, step: int) -> str:
    """The path ``Estimator.evaluate(checkpoint_path=...)`` takes for ``step`` in ``model_dir``."""
    from estimax.state import checkpoints

    return checkpoints.step_path(model_dir, step)


def evaluate_checkpoints(
    est: Any, eval_input_fn: Callable, loop: LoopConfig, clock: Callable[[], float] = time.monotonic
) -> dict[str, Any] | None:
    """``--mode=eval``: evaluates each new checkpoint until the one at ``train_steps``.

    As the original: ``for ckpt in checkpoints_iterator(model_dir, timeout=eval_timeout)``;
    a checkpoint removed (``keep_checkpoint_max``) before it is read is skipped.

    Returns:
      the last evaluation's results (None if no checkpoint appeared before the timeout).
    """
    from estimax.estimator import training
    from estimax.state import checkpoints

    where = checkpoints.checkpoint_dir(est.model_dir)
    fs, fs_path = fsspec.core.url_to_fs(est.model_dir)
    logging.info(
        "Waiting for checkpoints in %s (a training job's --model_dir=%s%s) and "
        "evaluating each new one until step %d; %s.",
        where,
        est.model_dir,
        "" if fs.exists(fs_path) else ", which does not exist yet",
        loop.train_steps,
        "no --eval_timeout: waiting as long as it takes"
        if loop.eval_timeout is None
        else f"giving up after --eval_timeout={loop.eval_timeout:g} s without a new one",
    )
    results = None
    for step in ex.checkpoints_iterator(est.model_dir, timeout=loop.eval_timeout):
        start = clock()
        try:
            # Recorded durably once its summaries are written: a restarted evaluator redoes an
            # evaluation that was cut off, and never repeats a recorded one.
            results = training.evaluate_once(
                est,
                step,
                functools.partial(
                    est.evaluate,
                    eval_input_fn,
                    steps=loop.eval_steps,
                    checkpoint_path=checkpoint_path(est.model_dir, step),
                ),
            )
        except FileNotFoundError:
            logging.info(
                "Checkpoint %s no longer exists, skipping checkpoint",
                checkpoint_path(est.model_dir, step),
            )
            continue
        logging.info("Eval results: %s. Elapsed seconds: %d", results, clock() - start)
        if step >= loop.train_steps:
            logging.info("Evaluation finished after training step %d", step)
            break
    return results


def run_mode(
    est: Any,
    train_input_fn: Callable,
    eval_input_fn: Callable,
    loop: LoopConfig,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any] | None:
    """Runs ``loop.mode`` (the original's main after the estimator is built).

    Returns:
      the last evaluation's results, or None when there was no evaluation.
    """
    if loop.mode == "eval":
        return evaluate_checkpoints(est, eval_input_fn, loop, clock)
    start = clock()
    results = None
    logging.info(
        "Training for %d steps (%.2f epochs in total). Current step %d.",
        loop.train_steps,
        loop.train_steps * loop.epochs_per_step,
        est.get_global_step(),
    )
    if loop.mode == "train":
        est.train(train_input_fn, max_steps=loop.train_steps)
    else:
        # Train to the next multiple of steps_per_eval, evaluate, repeat: by absolute step, so a
        # restarted job resumes the same schedule (the original's train(max_steps=next) loop).
        results, _ = ex.train_and_evaluate(
            est,
            ex.TrainSpec(train_input_fn, max_steps=loop.train_steps),
            ex.EvalSpec(eval_input_fn, steps=loop.eval_steps, every_steps=loop.steps_per_eval),
        )
    logging.info(
        "Finished training up to step %d. Elapsed seconds %d.",
        est.get_global_step(),
        clock() - start,
    )
    return results


def export(est: Any, job: Job) -> str:
    """``--export_dir``: publishes the latest checkpoint as the next numbered version there.

    The layout TensorFlow Serving and ``estimax serve --model_base_path`` read
    (``export_dir/1``, ``export_dir/2``...), checked against ``Estimator.predict`` first.
    Returns the version's path.
    """
    from estimax import export

    logging.info("Starting to export model.")
    if job.loop.export_dir is None:
        raise ValueError("export() needs --export_dir.")
    rtol, atol = job.export_tolerance
    path = export.export_version(
        est,
        job.loop.export_dir,
        serving_input=job.serving,
        preprocessing=job.preprocessing,
        check_inputs=job.check_inputs() if job.check_inputs else None,
        rtol=rtol,
        atol=atol,
        eval_preprocess=job.eval_preprocess,
        class_names=job.class_names() if job.class_names else None,
    )
    logging.info("Exported the model to %s", path)
    return path


def export_tolerance(precision: str) -> tuple[float, float]:
    """``(rtol, atol)`` between an export and ``Estimator.predict`` for a compute dtype.

    In bf16 the two round differently: predict may run estimax's oneDNN kernels, the export
    XLA's own convolutions (it must not need the library).
    """
    return (0.0, 2e-2) if precision == "bfloat16" else (1e-3, 1e-4)


def sample_images(data_dir: str | None, count: int = 8) -> list[bytes] | None:
    """``count`` encoded images of ``validation-*`` in ``data_dir``, drawn across classes
    (``estimax.export.check_images``); None: fake data."""
    if data_dir is None:
        return None
    from estimax import export

    return export.check_images(data_dir, count) or None


def image_export(
    data_dir: str | None, label_offset: int, num_classes: int, precision: str
) -> dict[str, Any]:
    """The ``Job`` fields of an ImageNet-style program's export: check images across classes
    from ``data_dir``, the manifest's class names (``manifest_class_names``), the tolerance.

    The manifest is read now, when the program builds its job: a label outside the model's
    classes stops the program here, in one line, not at the export after training.

    Raises:
      UsageError: the manifest gives a class a label the model has no class for.
    """
    names = manifest_class_names(data_dir, label_offset, num_classes, strict=True)
    return {
        "check_inputs": lambda: sample_images(data_dir),
        "class_names": lambda: names,
        "export_tolerance": export_tolerance(precision),
    }


def manifest_class_names(
    data_dir: str | None, label_offset: int, num_classes: int, strict: bool = False
) -> list[str] | None:
    """The class names of ``data_dir``'s ``estimax-convert`` manifest, by the model's class id.

    ``label_offset``: class id = the file's label - ``label_offset``. Ids no class folder maps to
    (ImageNet's 1000 classes trained on a 10-class folder, Inception's background logit) are
    named ``""``. None, with a warning where there is a manifest, when the names cannot be this
    model's: the export is then published without them rather than lose the trained model.

    Args:
      data_dir: the converter's output (local or fsspec URL); None: fake data, no names.
      label_offset: see above.
      num_classes: the model's classes (logits).
      strict: before training: a label outside the model's classes is a UsageError (the data
        holds labels the model cannot learn) rather than a warning.

    Raises:
      UsageError: with ``strict``, a label outside ``label_offset .. label_offset +
        num_classes - 1``.
    """
    if data_dir is None:
        return None
    path = posixpath.join(data_dir, "manifest.json")
    try:
        label_map = _manifest_labels(path)
    except FileNotFoundError:
        return None  # TFRecords of another converter: nothing names the classes
    except (OSError, ValueError) as e:
        logging.warning("Exporting without class names: %s", e)
        return None
    # Checked before any list is sized by a label: a damaged label (10**12) is a MemoryError.
    outside = {n: v for n, v in label_map.items() if not 0 <= v - label_offset < num_classes}
    if outside:
        name, label = min(outside.items(), key=lambda item: abs(item[1]))
        why = (
            f"{path} gives class {name[:60]!r} the label {_short_int(label)}, outside the "
            "model's "
            f"{num_classes} classes (labels {label_offset}..{label_offset + num_classes - 1})"
            + (f" and {len(outside) - 1} more" if len(outside) > 1 else "")
        )
        if strict:
            raise UsageError(
                f"--data_dir={data_dir}: {why}: give the model as many classes as the "
                "converter wrote, or convert the classes this model has"
            )
        logging.warning("Exporting without class names: %s", why)
        return None
    names = [""] * num_classes
    for name, label in label_map.items():
        names[label - label_offset] = name
    return names


def _short_int(value: int) -> str:
    """``value`` for a log line: a damaged label can have hundreds of digits."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _manifest_labels(path: str) -> dict[str, int]:
    """``label_map`` of an ``estimax-convert`` manifest: class name -> label (an integer).

    Raises:
      FileNotFoundError: there is none. ValueError: it is not one (or damaged).
    """
    from estimax import storage
    from estimax.export.record import MANIFEST_FORMAT

    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(root):
        raise FileNotFoundError(path)
    with fs.open(root, "rb") as f:
        try:
            data = storage.load_json(f.read())
        except ValueError as e:
            raise ValueError(f"{path} is not JSON ({e})") from None
    label_map = data.get("label_map") if isinstance(data, dict) else None
    if not isinstance(label_map, dict) or not label_map or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not an estimax-convert manifest with a label_map")
    for name, label in label_map.items():
        if type(label) is not int:
            raise ValueError(
                f"{path}: the label of {name[:60]!r} is {str(label)[:40]}, not a number"
            )
    if len(set(label_map.values())) < len(label_map):
        raise ValueError(f"{path}: two classes have one label")
    return label_map


def write_run_description(model_dir: str, notes: list[str] | tuple[str, ...]) -> None:
    """Keeps ``notes`` as a text summary (``run_description``) in TensorBoard's run."""
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(model_dir, filename_suffix=".description")
    writer.add_text("run_description", "\n\n".join(f"**WARNING** {n}" for n in notes), 0)
    writer.close()


def for_cluster_role(loop: LoopConfig) -> LoopConfig:
    """The mode for this process's task in a cluster spec (``$TF_CONFIG``, ``$CLUSTER_SPEC``).

    An evaluator task evaluates each checkpoint the training tasks write (``eval``); with an
    evaluator in the job, the training tasks only train, as TF's ``train_and_evaluate`` did.
    """
    from estimax.parallel import launch

    evaluator = launch.evaluator_task()
    if evaluator is not None:
        logging.info("%s: this process is the job's evaluator (mode eval).", evaluator)
        return dataclasses.replace(loop, mode="eval")
    if loop.mode == "train_and_eval" and launch.has_evaluator():
        logging.info(
            "The cluster spec has an evaluator task, which evaluates each checkpoint: this "
            "process only trains (mode train)."
        )
        return dataclasses.replace(loop, mode="train")
    return loop


def check_accumulation(config: ex.RunConfig, train_batch: int, replicas: int) -> None:
    """A ``UsageError`` line when ``--gradient_accumulation_steps`` does not divide each
    replica's train batch (naming the flag and the values that do)."""
    try:
        step_builder.micro_batch(train_batch, replicas, config.gradient_accumulation_steps)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run(job: Job) -> dict[str, Any] | None:
    """The tail every program shares: model_dir checks and lock, the mode, export, print, close.

    Returns:
      the last evaluation's results, or None when there was no evaluation.
    """
    if job.compile_for:
        return {"compile_for": [r.as_dict() for r in compile_job(job)]}
    check_layout(job)
    check_accumulation(
        job.config,
        job.batch_sizes[0],
        job.config.num_shards or jax.device_count() // job.config.num_cores_per_replica,
    )
    job = dataclasses.replace(job, loop=for_cluster_role(job.loop))
    model_dir = job.config.model_dir
    training = job.loop.mode != "eval"
    if training and job.loop.export_dir and jax.process_count() > 1:
        # Each host predicts only its own shard, so the export's parity check (and the single
        # version directory every host would publish) needs one process. Said before training.
        raise UsageError(
            f"--export_dir with {jax.process_count()} processes: export from one process once "
            "training is done: run the same command as a single process (without "
            "--coordinator_address/--num_processes/--process_id) with --export_dir; it finds "
            "training finished and exports the latest checkpoint."
        )
    # Eval mode only reads model_dir: no writer lock. A multi-host job is one trainer: its
    # first process holds the lock and records the flags for all.
    writer = training and jax.process_index() == 0
    with lock.WriterLock(model_dir) if writer else contextlib.nullcontext():
        cli.check_model_dir(model_dir, job.program, job.model_flags, write=writer)
        if job.notes and jax.process_index() == 0:
            write_run_description(model_dir, job.notes)
        est = ex.Estimator(
            job.model_fn,
            job.config,
            params=job.params,
            train_batch_size=job.batch_sizes[0],
            eval_batch_size=job.batch_sizes[1],
            predict_batch_size=job.batch_sizes[1],
            warm_start_from=job.warm_start_from,
        )
        try:
            results = run_mode(
                est, job.input_fn(is_training=True), job.input_fn(is_training=False), job.loop
            )
            if training and job.loop.export_dir:
                export(est, job)
        finally:
            est.close()
    if results is not None:
        names, examples = job.metrics
        values = ", ".join(f"{name} = {results[name]:.4f}" for name in names)
        # An evaluation rebuilt from the event files (a damaged evaluations.json) has no count.
        counted = results.get("num_examples")
        print(
            f"Eval results at step {results['global_step']}: {values}"
            + (f" on {counted} {examples}" if counted is not None else "")
        )
    print(f"TensorBoard logs: tensorboard --logdir={est.model_dir}", flush=True)
    return results


def compile_inputs(job: Job) -> tuple[Any, Any]:
    """The (features, labels) a program's steps are compiled with: what it serves, int32 labels.

    The one place that says what a program's input batches look like to ``--compile_for``.
    """
    return job.serving, ex.TensorSpec((None,), np.int32)


class DoesNotFit(UsageError):
    """``--compile_for``: a step does not fit; the message names the largest batch that does."""

    def __init__(self, message: str, reports: list[Any]):
        super().__init__(message)
        self.reports = reports


def compile_job(job: Job) -> list[Any]:
    """``--compile_for``: compiles the job's train and eval steps for a TPU slice or GPUs, one
    line each.

    Nothing is read or written: no data, no ``model_dir``. The steps are the ones a run's
    ``StepBuilder`` builds; a train step that does not fit is compiled again under other
    layouts (``estimax.compile.search``).

    Returns:
      the ``estimax.compile.compile.StepReport`` of each step.

    Raises:
      UsageError: an unknown topology, no libtpu, a batch that does not divide over the slice.
      DoesNotFit: a step does not fit (after searching for the largest batch that does).
    """
    config, topology = job.config, job.compile_for
    assert topology is not None  # run() calls this for --compile_for only
    if gpu_compile.is_gpu_target(topology):
        gpu_compile.use_cpu_backend()  # nothing runs here: no CUDA start, no traceback
    # The steps a run builds, under the run's layout on the slice's devices (this host may
    # have fewer devices than a replica's cores: nothing runs here).
    builder = step_builder.StepBuilder(job.model_fn, dict(job.params or {}), config)
    train_batch, eval_batch = job.batch_sizes
    batch_sizes = {ex.ModeKeys.TRAIN: train_batch, ex.ModeKeys.EVAL: eval_batch}
    try:
        reports = search_lib.compile_steps(
            builder, topology, compile_inputs(job), batch_sizes, search=True
        )
    except compile_lib.CompileForError as e:
        raise UsageError(f"--compile_for={topology}: {e}") from None
    for report in reports:
        print(report.line(), flush=True)
    failed = [r for r in reports if not r.fits]
    if failed:
        message = " ".join(compile_lib.describe_failure(r) for r in failed)
        train = next((r for r in failed if r.step == "train"), None)
        if train is not None:
            tries = search_lib.layout_alternatives(config, train, job.serving, job.remat)
            message += search_lib.other_layouts(builder, topology, compile_inputs(job), tries)
        raise DoesNotFit(message, reports)
    return reports


def imagenet_inputs(
    fv: flags.FlagValues, image_size: int, **preprocessing: Any
) -> tuple[Any, str | None, list[str]]:
    """``(input_fn(is_training=...), data_dir, notes)`` of ``--data_dir`` for a program whose
    input is ResNet's (``efficientnet``, ``vit``): its flags, the job's shard-index folder and
    ``preprocessing``'s extra ``imagenet.input_fn`` arguments (``augment``, ``mixup_alpha``)."""
    from estimax.data import imagenet

    data_dir, fake_kind, notes = check_data(fv.data_dir, fv.mode, compile_only=bool(fv.compile_for))
    inputs = functools.partial(
        imagenet.input_fn,
        data_dir,
        image_size=image_size,
        preprocessing="resnet",
        num_parallel_calls=max(1, min(fv.num_parallel_calls, os.cpu_count() or 1)),
        fake_data=fake_kind,
        fake_eval_examples=fv.num_eval_images,
        num_classes=fv.num_label_classes,
        skip_bad_records=fv.skip_bad_records,
        index_dir=shard_index_dir(fv.model_dir),
        **preprocessing,
    )
    return inputs, data_dir, notes


def run_resnet_style_family(
    fv: flags.FlagValues,
    family: Family,
    make_inputs: Callable[[flags.FlagValues], tuple[Any, str | None, list[str]]],
    image_size: Callable[[flags.FlagValues], int],
) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop, for a program whose input, eval crop and
    export are ResNet's (``efficientnet``, ``vit``). Returns the last eval results, if any."""
    from estimax.data import preprocessing
    from estimax.programs import logs

    logs.setup()
    cfg = family.config_from_flags(fv)
    log_unused_tpu_flags(fv)
    check_locations(fv)
    inputs, data_dir, notes = make_inputs(fv)
    config, loop = resnet_style_configs(fv, num_shards=None)
    return run(
        Job.for_family(
            family,
            fv,
            cfg,
            input_fn=inputs,
            notes=tuple(notes),
            batch_sizes=(fv.train_batch_size, fv.eval_batch_size),
            config=config,
            loop=loop,
            # The export is refused if its declared preprocessing differs from the input's.
            eval_preprocess=functools.partial(
                preprocessing.resnet_preprocess, is_training=False, image_size=image_size(fv)
            ),
            # The input hands the model the file's label - 1.
            **image_export(data_dir, 1, cfg.num_label_classes, cfg.precision),
        )
    )
