"""Inception v3 on ImageNet: the original ``inception_v3.py`` command line, on estimax.

    python -m estimax.programs.inception_v3 --data_dir=DIR --model_dir=DIR [--use_data=real ...]

Flags have the names and defaults of the original ``models/experimental/inception/inception_v3.py``
(tensorflow/tpu r1.8). The recipe is its ``inception_model_fn``:

* images in [-1, 1] (Inception preprocessing), 1001 classes (index 0: background);
* loss: softmax cross-entropy with label smoothing 0.1 on the logits (weight 1) and on the
  auxiliary logits (weight 0.4), plus slim's L2 regularisation of 4e-5 on weights (every
  weight but batch norm's; slim's batch norm has no scale);
* RMSProp (decay 0.9, momentum 0.9, epsilon 1.0) as TF's ``RMSPropOptimizer`` (see
  ``make_optimizer``), or ``--optimizer=sgd|momentum``;
* staircase exponential decay 0.94 every 3 epochs of ``0.165 * batch / 256``, floored;
* an exponential moving average (0.995) of the weights, used for evaluation and export
  (``--moving_average``);
* metrics ``accuracy`` and ``accuracy@5``; ``learning_rate`` and ``current_epoch`` in TensorBoard.

Labels: the files hold 1-based labels 1..1000 and the estimax input hands the model ``label - 1``
(as ResNet's input did). The original Inception read the file's label *unshifted* into 1001
logits, so class ``k`` of the files is logit ``k`` and logit 0 (background) is never a target.
The model_fn adds the 1 back, so logits, predictions and exported models index classes as the
original's did (and its checkpoints' heads would line up).

``inception_v4`` is this program with v4's network, defaults and warm-up schedule
(``estimax.programs.inception_v4``). Every flag can also come from ``ESTIMAX_<FLAG>`` in the
environment (``ESTIMAX_MODEL_DIR``; a job runner's ``TPU_MODEL_DIR`` too), the command line
winning.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

import estimax as ex
from estimax import export, ops
from estimax.data import imagenet
from estimax.models import inception_v3 as inception_v3_model
from estimax.models.inception_v3 import InceptionV3
from estimax.programs import (
    cli,
    common,
    configs,
    exports,
    flagspec,
    logs,
    schedules,
    shared_flags,
)
from estimax.programs.family import Family
from estimax.programs.inputs import check_data, shard_index_dir
from estimax.programs.job import Job
from estimax.programs.shared_flags import UNUSED_HELP

# Constants of the original inception_v3.py / inception_v4.py.
RMSPROP_DECAY = 0.9
RMSPROP_MOMENTUM = 0.9
RMSPROP_EPSILON = 1.0
MOVING_AVERAGE_DECAY = 0.995
LABEL_SMOOTHING = 0.1
AUX_LOSS_WEIGHT = 0.4
# What the result line shows: "Eval results at step N: accuracy = ... on N images".
METRICS = (("accuracy", "accuracy@5"), "images")
# The smallest input the networks' stride-2 stem and reductions leave a 1x1 map for.
MIN_IMAGE_SIZE = 107
# slim's inception_v3_arg_scope / inception_v4_arg_scope(weight_decay=0.00004): an
# l2_regularizer on conv and fully connected weights, summed into the loss by get_total_loss.
WEIGHT_DECAY = 0.00004


@dataclasses.dataclass(frozen=True)
class Variant:
    """What differs between the Inception v3 and v4 programs.

    Attributes:
      name: program name, for messages and ``model_dir/flags.json``.
      model: the Flax network's constructor (``num_classes``, ``dtype``, ``conv``, ``max_pool``).
      defaults: flag defaults that differ between the two originals.
      schedule_flags: the variant's warm-up flags, ``(name, default, help)``; the default's type
        is the flag's, the name the keyword of ``schedule``.
      schedule: the learning-rate schedule's factory (``estimax.programs.schedules``).
      doc: the program's docstring (its ``--help``).
      tf_names: the network's TensorFlow names (``estimax.models.TF_NAMES``).
    """

    name: str
    model: Callable[..., nn.Module]
    defaults: dict[str, Any]
    schedule_flags: tuple[tuple[str, Any, str], ...]
    schedule: Callable[..., optax.Schedule]
    doc: str = ""
    tf_names: Any = None

    def make_schedule(self, fv: flags.FlagValues) -> optax.Schedule:
        """The schedule of the parsed flags."""
        return self.schedule(
            fv.learning_rate,
            fv.train_batch_size,
            learning_rate_decay=fv.learning_rate_decay,
            learning_rate_decay_epochs=fv.learning_rate_decay_epochs,
            **{name: fv[name].value for name, _, _ in self.schedule_flags},
        )


V3 = Variant(
    name="inception_v3",
    model=InceptionV3,
    defaults={
        "train_batch_size": 1024,
        "train_steps": 213000,
        "learning_rate": 0.165,
        "use_annotated_bbox": False,
        "learning_rate_decay_epochs": 3,
    },
    schedule_flags=(
        (
            "use_learning_rate_warmup",
            False,
            "Cold start at 0.1x the rate for --cold_epochs, "
            "then a linear warm-up for --warmup_epochs.",
        ),
        ("cold_epochs", 2, "Epochs at the cold learning rate (with --use_learning_rate_warmup)."),
        ("warmup_epochs", 7, "Epochs of linear warm-up (with --use_learning_rate_warmup)."),
    ),
    schedule=schedules.inception_v3_schedule,
    doc=__doc__,
    tf_names=inception_v3_model.TF_NAMES,
)

# The original inception_v3.py's flags; the values of ``Variant.defaults`` replace their defaults
# (``define_flags``), and the variant's schedule flags follow.
INCEPTION_FLAGS = (
    flagspec.Int(
        "num_shards",
        8,
        "Number of replicas (devices); if this job has fewer "
        "devices, all of them are used (with a warning).",
        lower=1,
    ),
    flagspec.Int(
        "iterations", 100, "Training steps per device call (iterations_per_loop).", lower=1
    ),
    flagspec.Int("train_batch_size", 1024, "Global (not per-shard) training batch size.", lower=1),
    flagspec.Int("eval_batch_size", 1024, "Global (not per-shard) evaluation batch size.", lower=1),
    flagspec.Int(
        "eval_total_size",
        0,
        "Number of evaluation images; 0 means all "
        f"{imagenet.NUM_EVAL_IMAGES:,}. estimax evaluates each exactly once (the "
        "original dropped the last partial batch).",
        lower=0,
    ),
    flagspec.Int("train_steps", 213000, "Number of training steps (global, absolute).", lower=1),
    flagspec.Int(
        "train_steps_per_eval",
        2000,
        "Training steps between evaluations in train_and_eval.",
        lower=1,
    ),
    flagspec.Int(
        "min_eval_interval",
        180,
        f"{UNUSED_HELP} (defined but unused by the original too).",
    ),
    flagspec.Bool(
        "per_host_input_for_training",
        True,
        f"{UNUSED_HELP}: each host always feeds its own devices.",
    ),
    flagspec.Enum(
        "use_data",
        "real",
        ["fake", "real"],
        "'fake': random images (no files "
        "read), with a warning; 'real': the TFRecords in --data_dir.",
    ),
    flagspec.Float(
        "learning_rate",
        0.165,
        "Learning rate for a batch of 256; scaled by train_batch_size / 256.",
    ),
    flagspec.Enum(
        "optimizer",
        "RMS",
        ["sgd", "RMS", "momentum"],
        "Optimizer: RMSProp "
        "(decay 0.9, momentum 0.9, epsilon 1.0), plain SGD, or SGD with momentum "
        "0.9.",
    ),
    flagspec.Int(
        "num_classes",
        1001,
        "Number of logits (1000 ImageNet classes + background at 0).",
        lower=2,
    ),
    flagspec.Int("width", 299, "Width of the network's input images.", lower=MIN_IMAGE_SIZE),
    flagspec.Int(
        "height", 299, "Height of the network's input images (== width).", lower=MIN_IMAGE_SIZE
    ),
    flagspec.Bool(
        "transpose_enabled",
        False,
        f"{UNUSED_HELP}: it fed the TPU infeed in HWCN layout.",
    ),
    flagspec.Bool("log_device_placement", False, f"{UNUSED_HELP} (a TF session option)."),
    flagspec.Int("save_summary_steps", 100, "Write training summaries every N steps.", lower=1),
    flagspec.Int(
        "save_checkpoints_secs",
        1000,
        "Save a checkpoint every N seconds (and at the end of each training phase).",
        lower=1,
    ),
    flagspec.Bool(
        "moving_average",
        True,
        "Keep an exponential moving average (0.995) of the weights and evaluate/export with it.",
    ),
    flagspec.Str(
        "preprocessing", "inception", "Preprocessing: 'inception' (estimax has no 'vgg')."
    ),
    flagspec.Bool(
        "use_annotated_bbox",
        False,
        "Sample training crops around the records' image/object/bbox boxes.",
    ),
    flagspec.Float("learning_rate_decay", 0.94, "Factor of the staircase learning-rate decay."),
    flagspec.Float("learning_rate_decay_epochs", 3, "Epochs between learning-rate decays."),
    flagspec.Bool("display_tensors", False, f"{UNUSED_HELP} (a TPU debugging aid)."),
    flagspec.Bool(
        "clear_update_collections",
        True,
        f"{UNUSED_HELP}: batch-norm statistics always update in the training step.",
    ),
    flagspec.Bool("prefetch_enabled", True, f"{UNUSED_HELP}: the loader always prefetches."),
    flagspec.Int(
        "prefetch_dataset_buffer_size",
        8 * 1024 * 1024,
        f"{UNUSED_HELP} (a tf.data read buffer).",
    ),
    flagspec.Int(
        "num_files_infeed",
        8,
        f"{UNUSED_HELP}: the loader reads every file of this host.",
    ),
    flagspec.Int(
        "num_parallel_calls",
        64,
        "Parallel JPEG decode/preprocess workers (at most the CPU count).",
        lower=1,
    ),
    flagspec.Int(
        "initial_shuffle_buffer_size",
        1024,
        f"{UNUSED_HELP}: the loader shuffles the whole epoch.",
    ),
    flagspec.Int(
        "followup_shuffle_buffer_size",
        1000,
        f"{UNUSED_HELP}: the loader shuffles the whole epoch.",
    ),
)
_FLAG_BY_TYPE = {bool: flagspec.Bool, int: flagspec.Int, float: flagspec.Float}


def define_flags(fv: flags.FlagValues, variant: Variant = V3) -> None:
    """Defines the original inception_v3.py / inception_v4.py flags on ``fv``."""
    shared_flags.define_tpu_flags(fv)
    flagspec.define(
        fv,
        shared_flags.run_flags(
            data_dir_default="",
            steps_per_eval_flag="train_steps_per_eval",
            precision_default="float32",
            data_dir_help=(
                "Directory of the ImageNet TFRecords (train-*, validation-*), local, gs:// or "
                "s3://; read with --use_data=real. The original's public "
                "gs://cloud-tpu-test-datasets/fake_imagenet means random fake data here (it "
                "cannot be reached), with a warning."
            ),
        ),
        flagspec.with_defaults(INCEPTION_FLAGS, variant.defaults),
        (_FLAG_BY_TYPE[type(d)](name, d, text) for name, d, text in variant.schedule_flags),
    )


def make_optimizer(name: str, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The original's optimizers, on optax.

    ``RMS`` is ``tf.train.RMSPropOptimizer(lr, decay=0.9, momentum=0.9, epsilon=1.0)``
    (``schedules.tf_rmsprop``: TF's update, epsilon inside the square root).
    """
    if name == "RMS":
        return schedules.tf_rmsprop(schedule, RMSPROP_DECAY, RMSPROP_MOMENTUM, RMSPROP_EPSILON)
    if name == "momentum":
        return optax.sgd(schedule, momentum=0.9)
    if name == "sgd":
        return optax.sgd(schedule)
    raise ValueError(f"--optimizer={name!r}: must be sgd, RMS or momentum.")


@dataclasses.dataclass(frozen=True)
class InceptionConfig:
    """The recipe's hyperparameters, gathered once from the flags."""

    model: Callable[..., nn.Module]
    schedule: optax.Schedule
    optimizer: str = "RMS"
    num_classes: int = 1001
    train_batch_size: int = 1024
    moving_average: bool = True
    precision: str = "float32"
    cpu_fast_ops: bool = True
    remat: str = "none"  # --remat: the blocks' rematerialisation policy


def build_model(cfg: InceptionConfig) -> nn.Module:
    """The network of ``cfg`` (with its auxiliary head) in the compute dtype of ``precision``."""
    kwargs: dict[str, Any] = {"dtype": jnp.bfloat16 if cfg.precision == "bfloat16" else jnp.float32}
    kwargs.update(ops.fast_layers() if cfg.cpu_fast_ops else ops.standard_layers())
    if cfg.remat != "none":  # only then: a stand-in ``cfg.model`` need not know the field
        kwargs["remat"] = cfg.remat
    return cfg.model(num_classes=cfg.num_classes, **kwargs)


def make_model_fn(cfg: InceptionConfig):
    """Returns ``model_fn(features, labels, mode, params)``: the original inception_model_fn."""

    def model_fn(features, labels, mode, params):
        """features: [B, S, S, 3] float in [-1, 1]; labels: [B] int32, file label - 1."""
        del params
        if isinstance(features, dict):
            features = features["feature"]
        model = build_model(cfg)
        logits, aux_logits = model(
            jnp.asarray(features, model.dtype), train=mode == ex.ModeKeys.TRAIN
        )
        predictions = {
            "classes": jnp.argmax(logits, axis=1),
            "probabilities": jax.nn.softmax(logits),
        }
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(
                mode=mode, predictions=predictions, export_outputs={"classify": predictions}
            )
        # Back to the file's label (see the module docstring): logit 0 is background.
        targets = labels + 1
        loss = ex.losses.softmax_cross_entropy(
            logits, targets, label_smoothing=LABEL_SMOOTHING
        ) + AUX_LOSS_WEIGHT * ex.losses.softmax_cross_entropy(
            aux_logits, targets, label_smoothing=LABEL_SMOOTHING
        )
        step = ex.get_global_step()
        return ex.EstimatorSpec(
            mode=mode,
            loss=loss,
            optimizer=make_optimizer(cfg.optimizer, cfg.schedule),
            weight_decay=WEIGHT_DECAY,
            ema_decay=MOVING_AVERAGE_DECAY if cfg.moving_average else None,
            eval_metrics={
                "accuracy": ex.metrics.accuracy(targets, logits),
                "accuracy@5": ex.metrics.top_k_accuracy(targets, logits, k=5),
            },
            predictions=predictions,
            # The original's host_call wrote the epoch as an integer.
            scalars={
                "learning_rate": cfg.schedule(step),
                "current_epoch": jnp.floor(schedules.current_epoch(step, cfg.train_batch_size)),
            },
        )

    return model_fn


def config_from_flags(fv: flags.FlagValues, variant: Variant) -> InceptionConfig:
    """The model and recipe the flags ask for (``estimax-convert tf-checkpoint`` builds it too)."""
    return InceptionConfig(
        model=variant.model,
        schedule=variant.make_schedule(fv),
        optimizer=fv.optimizer,
        num_classes=fv.num_classes,
        train_batch_size=fv.train_batch_size,
        moving_average=fv.moving_average,
        precision=fv.precision,
        cpu_fast_ops=fv.cpu_fast_ops,
        remat=fv.remat,
    )


def check_flags(fv: flags.FlagValues) -> None:
    """Refuses flag values estimax cannot run (one ``UsageError`` naming the flag)."""
    if fv.width != fv.height:
        raise cli.UsageError(
            f"--width={fv.width} and --height={fv.height}: estimax's input "
            "makes square images; give the same value to both."
        )
    if fv.preprocessing != "inception":
        raise cli.UsageError(
            f"--preprocessing={fv.preprocessing!r}: estimax implements only "
            "'inception' preprocessing."
        )


def make_inputs(fv: flags.FlagValues) -> tuple[Any, str | None, list[str]]:
    """``(input_fn(is_training=...), data_dir, notes)`` of ``--data_dir`` / ``--use_data``."""
    # The original's default --data_dir is '': "not set" unless given (an unset $DATA_DIR).
    given = fv.data_dir if fv["data_dir"].present or fv.data_dir else None
    data_dir, fake_kind, notes = check_data(
        given,
        fv.mode,
        use_fake=fv.use_data == "fake",
        fake_hint="--use_data=fake",
        compile_only=bool(fv.compile_for),
    )
    inputs = functools.partial(
        imagenet.input_fn,
        data_dir,
        image_size=fv.width,
        preprocessing="inception",
        num_parallel_calls=max(1, min(fv.num_parallel_calls, os.cpu_count() or 1)),
        fake_data=fake_kind,
        fake_eval_examples=eval_size(fv),
        skip_bad_records=fv.skip_bad_records,
        # Files hold labels 1..num_classes-1 (class 0 is the background logit).
        num_classes=fv.num_classes - 1,
        use_annotated_bbox=fv.use_annotated_bbox,
        index_dir=shard_index_dir(fv.model_dir),
        index_beside_data=fv.index_beside_data,
    )
    return inputs, data_dir, notes


def eval_size(fv: flags.FlagValues) -> int:
    """The number of evaluation images (``--eval_total_size``, 0: all of ImageNet's)."""
    return fv.eval_total_size or imagenet.NUM_EVAL_IMAGES


def run_config(fv: flags.FlagValues) -> ex.RunConfig:
    """The ``RunConfig`` of the original's flags."""
    return configs.run_config(
        fv,
        "iterations",
        num_shards=shared_flags.resolve_num_shards(
            fv.num_shards, "num_shards", compile_only=bool(fv.compile_for)
        ),
        save_checkpoints_secs=fv.save_checkpoints_secs,
        save_summary_steps=fv.save_summary_steps,
        keep_checkpoint_max=fv.keep_checkpoint_max,
        skip_nonfinite_steps=fv.skip_nonfinite_steps,
    )


def run_from_flags(fv: flags.FlagValues, variant: Variant = V3) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop. Returns the last eval results, if any."""
    logs.setup()
    shared_flags.log_unused_tpu_flags(fv)
    shared_flags.check_locations(fv)
    check_flags(fv)
    inputs, data_dir, notes = make_inputs(fv)
    loop = configs.LoopConfig.from_flags(
        fv,
        steps_per_eval=fv.train_steps_per_eval,
        eval_examples=eval_size(fv),
        train_examples=imagenet.NUM_TRAIN_IMAGES,
    )
    return common.run(
        Job.for_family(
            family(variant),
            fv,
            config_from_flags(fv, variant),
            config=run_config(fv),
            loop=loop,
            notes=tuple(notes),
            input_fn=inputs,
            batch_sizes=(fv.train_batch_size, fv.eval_batch_size),
            # Class id = the file's label (id 0 is the background logit).
            **exports.image_export(data_dir, 0, fv.num_classes, fv.precision),
        )
    )


def family(variant: Variant) -> Family:
    """The family of an Inception variant (its program is this module's, with its flags)."""
    return Family(
        name=variant.name,
        doc=variant.doc,
        define_flags=functools.partial(define_flags, variant=variant),
        config_from_flags=functools.partial(config_from_flags, variant=variant),
        make_model_fn=make_model_fn,
        # The flags that change the checkpoint's tree (logits, optimizer slots, averages).
        model_flags=("num_classes", "optimizer", "moving_average"),
        # Clients send JPEG/PNG bytes; the server applies the eval preprocessing, the model (and
        # export) take images in [-1, 1]; the export holds the moving-average weights.
        input_spec=lambda fv: ex.TensorSpec((None, fv.width, fv.width, 3), np.float32),
        serving_preprocessing=lambda fv: export.inception_eval(fv.width),
        run_from_flags=functools.partial(run_from_flags, variant=variant),
        metrics=METRICS,
        tf_names=variant.tf_names,
    )


FAMILY = family(V3)


def run() -> None:
    """Console-script entry point (``inception_v3``)."""
    FAMILY.main()


if __name__ == "__main__":
    run()
