"""Inception v3 on ImageNet: the original ``inception_v3.py`` command line, on estimax.

    python -m estimax.programs.inception_v3 --data_dir=DIR --model_dir=DIR [--use_data=real ...]

Flags have the names and defaults of ``models/experimental/inception/inception_v3.py`` (r1.8,
ORIGINAL_SYSTEM.md §6). The recipe is its ``inception_model_fn``:

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
(``estimax.programs.inception_v4``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from absl import app, flags, logging

import estimax as ex
from estimax import ops
from estimax.data import imagenet
from estimax.estimator import schedules
from estimax.models.inception_v3 import InceptionV3
from estimax.programs import common, logs

# Constants of the original inception_v3.py / inception_v4.py.
RMSPROP_DECAY = 0.9
RMSPROP_MOMENTUM = 0.9
RMSPROP_EPSILON = 1.0
MOVING_AVERAGE_DECAY = 0.995
LABEL_SMOOTHING = 0.1
AUX_LOSS_WEIGHT = 0.4
# slim's inception_v3_arg_scope / inception_v4_arg_scope(weight_decay=0.00004): an
# l2_regularizer on conv and fully connected weights, summed into the loss by get_total_loss.
WEIGHT_DECAY = 0.00004


@dataclasses.dataclass(frozen=True)
class Variant:
    """What differs between the Inception v3 and v4 programs.

    Attributes:
      name: program name, for messages.
      model: the Flax network's constructor (``num_classes``, ``dtype``, ``conv``, ``max_pool``).
      defaults: flag defaults that differ between the two originals.
      define_schedule_flags: defines the variant's warm-up flags.
      schedule: ``schedule(fv) -> optax.Schedule`` from the parsed flags.
    """

    name: str
    model: Callable[..., nn.Module]
    defaults: dict[str, Any]
    define_schedule_flags: Callable[[flags.FlagValues], None]
    schedule: Callable[[flags.FlagValues], optax.Schedule]


def _define_v3_schedule_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_bool("use_learning_rate_warmup", False, "Cold start at 0.1x the rate for "
                      "--cold_epochs, then a linear warm-up for --warmup_epochs.", flag_values=fv)
    flags.DEFINE_integer("cold_epochs", 2, "Epochs at the cold learning rate (with "
                         "--use_learning_rate_warmup).", flag_values=fv)
    flags.DEFINE_integer("warmup_epochs", 7, "Epochs of linear warm-up (with "
                         "--use_learning_rate_warmup).", flag_values=fv)


def _v3_schedule(fv: flags.FlagValues) -> optax.Schedule:
    return schedules.inception_v3_schedule(
        fv.learning_rate, fv.train_batch_size, learning_rate_decay=fv.learning_rate_decay,
        learning_rate_decay_epochs=fv.learning_rate_decay_epochs,
        use_learning_rate_warmup=fv.use_learning_rate_warmup, cold_epochs=fv.cold_epochs,
        warmup_epochs=fv.warmup_epochs)


V3 = Variant(
    name="inception_v3",
    model=InceptionV3,
    defaults={"train_batch_size": 1024, "train_steps": 213000, "learning_rate": 0.165,
              "use_annotated_bbox": False, "learning_rate_decay_epochs": 3},
    define_schedule_flags=_define_v3_schedule_flags,
    schedule=_v3_schedule,
)


def define_flags(fv: flags.FlagValues, variant: Variant = V3) -> None:
    """Defines the original inception_v3.py / inception_v4.py flags on ``fv``."""
    unused = common.UNUSED_HELP
    dv = variant.defaults
    s = functools.partial(flags.DEFINE_string, flag_values=fv)
    i = functools.partial(flags.DEFINE_integer, flag_values=fv)
    fl = functools.partial(flags.DEFINE_float, flag_values=fv)
    b = functools.partial(flags.DEFINE_bool, flag_values=fv)
    e = functools.partial(flags.DEFINE_enum, flag_values=fv)
    common.define_tpu_flags(fv)
    s("data_dir", "", "Directory of the ImageNet TFRecords (train-*, validation-*), local or "
      "gs://. The original's public gs://cloud-tpu-test-datasets/fake_imagenet means local "
      "random fake data here (it cannot be reached).")
    s("model_dir", None, "Directory for checkpoints and TensorBoard summaries.")
    i("num_shards", 8, "Number of replicas (devices); if this job has fewer devices, all of "
      "them are used (with a warning).")
    i("iterations", 100, "Training steps per device call (iterations_per_loop).")
    i("train_batch_size", dv["train_batch_size"], "Global (not per-shard) training batch size.")
    i("eval_batch_size", 1024, "Global (not per-shard) evaluation batch size.")
    i("eval_total_size", 0, "Number of evaluation images; 0 means all 50,000. estimax "
      "evaluates each exactly once (the original dropped the last partial batch).")
    i("train_steps", dv["train_steps"], "Number of training steps (global, absolute).")
    i("train_steps_per_eval", 2000, "Training steps between evaluations in train_and_eval.")
    e("mode", "train_and_eval", list(common.MODES),
      "train, eval (follow the checkpoints of a training job) or train_and_eval.")
    i("min_eval_interval", 180, f"{unused} (defined but unused by the original too).")
    i("eval_timeout", None, "In eval mode, stop after this many seconds without a new "
      "checkpoint (default: wait for the one at --train_steps).")
    b("per_host_input_for_training", True, f"{unused}: each host always feeds its own devices.")
    e("use_data", "real", ["fake", "real"], "'fake': random images (no files read); 'real': "
      "the TFRecords in --data_dir.")
    fl("learning_rate", dv["learning_rate"], "Learning rate for a batch of 256; scaled by "
       "train_batch_size / 256.")
    e("optimizer", "RMS", ["sgd", "RMS", "momentum"], "Optimizer: RMSProp (decay 0.9, "
      "momentum 0.9, epsilon 1.0), plain SGD, or SGD with momentum 0.9.")
    i("num_classes", 1001, "Number of logits (1000 ImageNet classes + background at 0).")
    i("width", 299, "Width of the network's input images (>= 107).")
    i("height", 299, "Height of the network's input images (== width).")
    b("transpose_enabled", False, f"{unused}: it fed the TPU infeed in HWCN layout.")
    b("log_device_placement", False, f"{unused} (a TF session option).")
    i("save_summary_steps", 100, "Write training summaries every N steps.")
    i("save_checkpoints_secs", 1000, "Save a checkpoint every N seconds (and at the end of "
      "each training phase).")
    b("moving_average", True, "Keep an exponential moving average (0.995) of the weights and "
      "evaluate/export with it.")
    s("preprocessing", "inception", "Preprocessing: 'inception' (estimax has no 'vgg').")
    b("use_annotated_bbox", dv["use_annotated_bbox"], "Sample training crops around the "
      "records' image/object/bbox boxes.")
    fl("learning_rate_decay", 0.94, "Factor of the staircase learning-rate decay.")
    fl("learning_rate_decay_epochs", dv["learning_rate_decay_epochs"],
       "Epochs between learning-rate decays.")
    b("display_tensors", False, f"{unused} (a TPU debugging aid).")
    b("clear_update_collections", True, f"{unused}: batch-norm statistics always update in "
      "the training step.")
    variant.define_schedule_flags(fv)
    b("prefetch_enabled", True, f"{unused}: the loader always prefetches.")
    i("prefetch_dataset_buffer_size", 8 * 1024 * 1024, f"{unused} (a tf.data read buffer).")
    i("num_files_infeed", 8, f"{unused}: the loader reads every file of this host.")
    i("num_parallel_calls", 64, "Parallel JPEG decode/preprocess workers (at most the CPU "
      "count).")
    i("initial_shuffle_buffer_size", 1024, f"{unused}: the loader shuffles the whole epoch.")
    i("followup_shuffle_buffer_size", 1000, f"{unused}: the loader shuffles the whole epoch.")
    # estimax additions.
    e("precision", "float32", ["bfloat16", "float32"], "Compute dtype of the network "
      "(estimax; the original Inception ran float32).")
    i("keep_checkpoint_max", 5, "Number of recent checkpoints kept.")
    b("cpu_fast_ops", True, "Use estimax.ops' convolution and max-pool, whose gradients "
      "XLA:CPU runs several times faster; identical ops on GPU/TPU.")


def make_optimizer(name: str, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The original's optimizers, on optax.

    ``RMS`` is ``tf.train.RMSPropOptimizer(lr, decay=0.9, momentum=0.9, epsilon=1.0)``, whose
    update is ``ms = 0.9 ms + 0.1 g^2`` (``ms`` starts at 1, not 0), ``mom = 0.9 mom + lr * g /
    sqrt(ms + eps)`` (epsilon *inside* the square root), ``w -= mom``. ``optax.rmsprop`` would
    apply the learning rate after the momentum, which differs from TF whenever the rate changes,
    so the chain is spelled out: ``scale_by_rms(initial_scale=1, eps_in_sqrt=True)``, then the
    rate, then the momentum trace.
    """
    if name == "RMS":
        return optax.chain(
            optax.scale_by_rms(decay=RMSPROP_DECAY, eps=RMSPROP_EPSILON, initial_scale=1.0,
                               eps_in_sqrt=True),
            optax.scale_by_learning_rate(schedule),
            optax.trace(decay=RMSPROP_MOMENTUM))
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


def build_model(cfg: InceptionConfig) -> nn.Module:
    """The network of ``cfg`` (with its auxiliary head) in the compute dtype of ``precision``."""
    kwargs: dict[str, Any] = {"dtype": jnp.bfloat16 if cfg.precision == "bfloat16"
                              else jnp.float32}
    kwargs.update(ops.fast_layers() if cfg.cpu_fast_ops else ops.standard_layers())
    return cfg.model(num_classes=cfg.num_classes, **kwargs)


def make_model_fn(cfg: InceptionConfig):
    """Returns ``model_fn(features, labels, mode, params)``: the original inception_model_fn."""

    def model_fn(features, labels, mode, params):
        """features: [B, S, S, 3] float in [-1, 1]; labels: [B] int32, file label - 1."""
        del params
        if isinstance(features, dict):
            features = features["feature"]
        model = build_model(cfg)
        logits, aux_logits = model(jnp.asarray(features, model.dtype),
                                   train=mode == ex.ModeKeys.TRAIN)
        predictions = {"classes": jnp.argmax(logits, axis=1),
                       "probabilities": jax.nn.softmax(logits)}
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(mode=mode, predictions=predictions,
                                    export_outputs={"classify": predictions})
        # Back to the file's label (see the module docstring): logit 0 is background.
        targets = labels + 1
        loss = (ex.losses.softmax_cross_entropy(logits, targets, label_smoothing=LABEL_SMOOTHING)
                + AUX_LOSS_WEIGHT * ex.losses.softmax_cross_entropy(
                    aux_logits, targets, label_smoothing=LABEL_SMOOTHING))
        step = ex.get_global_step()
        return ex.EstimatorSpec(
            mode=mode,
            loss=loss,
            optimizer=make_optimizer(cfg.optimizer, cfg.schedule),
            weight_decay=WEIGHT_DECAY,
            ema_decay=MOVING_AVERAGE_DECAY if cfg.moving_average else None,
            eval_metrics={"accuracy": ex.metrics.accuracy(targets, logits),
                          "accuracy@5": ex.metrics.top_k_accuracy(targets, logits, k=5)},
            predictions=predictions,
            # The original's host_call wrote the epoch as an integer.
            scalars={"learning_rate": cfg.schedule(step),
                     "current_epoch": jnp.floor(schedules.current_epoch(
                         step, cfg.train_batch_size))},
        )

    return model_fn


def run_from_flags(fv: flags.FlagValues, variant: Variant = V3) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop. Returns the last eval results, if any."""
    logs.setup()
    common.log_unused_tpu_flags(fv)
    if fv.width != fv.height:
        raise app.UsageError(f"--width={fv.width} and --height={fv.height}: estimax's input "
                             "makes square images; give the same value to both.")
    if fv.preprocessing != "inception":
        raise app.UsageError(f"--preprocessing={fv.preprocessing!r}: estimax implements only "
                             "'inception' preprocessing.")
    if fv.num_classes < 2:
        raise app.UsageError(f"--num_classes={fv.num_classes}: must be >= 2 (classes + "
                             "background).")
    schedule = variant.schedule(fv)
    cfg = InceptionConfig(
        model=variant.model, schedule=schedule, optimizer=fv.optimizer,
        num_classes=fv.num_classes, train_batch_size=fv.train_batch_size,
        moving_average=fv.moving_average, precision=fv.precision,
        cpu_fast_ops=fv.cpu_fast_ops)
    config = ex.RunConfig(
        model_dir=fv.model_dir, iterations_per_loop=fv.iterations,
        num_shards=common.resolve_num_shards(fv.num_shards, "num_shards"),
        save_checkpoints_secs=fv.save_checkpoints_secs, save_summary_steps=fv.save_summary_steps,
        keep_checkpoint_max=fv.keep_checkpoint_max)
    est = ex.Estimator(make_model_fn(cfg), config, train_batch_size=fv.train_batch_size,
                       eval_batch_size=fv.eval_batch_size,
                       predict_batch_size=fv.eval_batch_size)
    data_dir, fake_kind = common.resolve_data_dir(fv.data_dir, use_fake=fv.use_data == "fake")
    eval_size = fv.eval_total_size or imagenet.NUM_EVAL_IMAGES
    inputs = functools.partial(
        imagenet.input_fn, data_dir, image_size=fv.width, preprocessing="inception",
        num_parallel_calls=max(1, min(fv.num_parallel_calls, os.cpu_count() or 1)),
        fake_data=fake_kind, fake_eval_examples=eval_size,
        # Files hold labels 1..num_classes-1 (class 0 is the background logit).
        num_classes=fv.num_classes - 1, use_annotated_bbox=fv.use_annotated_bbox)
    loop = common.LoopConfig(
        mode=fv.mode, train_steps=fv.train_steps, steps_per_eval=fv.train_steps_per_eval,
        eval_steps=-(-eval_size // fv.eval_batch_size), eval_timeout=fv.eval_timeout,
        epochs_per_step=fv.train_batch_size / imagenet.NUM_TRAIN_IMAGES)
    try:
        results = common.run(est, inputs(is_training=True), inputs(is_training=False), loop)
    finally:
        est.close()
    if results is not None:
        print(f"Eval results at step {results['global_step']}: accuracy = "
              f"{results['accuracy']:.4f}, accuracy@5 = {results['accuracy@5']:.4f} on "
              f"{results['num_examples']} images")
    logging.info("TensorBoard logs: tensorboard --logdir=%s", est.model_dir)
    sys.stdout.flush()
    return results


def main(argv: list[str]) -> None:
    """The program: ``run_from_flags(flags.FLAGS, V3)``."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    run_from_flags(flags.FLAGS, V3)


def run() -> None:
    """Console-script entry point (``inception_v3``)."""
    define_flags(flags.FLAGS, V3)
    # --help lists the flags this program defines through its helpers, too.
    flags.adopt_module_key_flags(common)
    app.run(main)


if __name__ == "__main__":
    run()
