"""ResNet on ImageNet: the original ``resnet_main.py`` command line, on estimax.

    python -m estimax.programs.resnet --data_dir=DIR --model_dir=DIR [--resnet_depth=50 ...]

Flags have the names and defaults of ``resnet_main.py`` as of 2018-12 (ORIGINAL_SYSTEM.md §2.1);
the recipe is its ``resnet_model_fn`` (§2.3): mean/std normalisation on the device, ResNet v1,
softmax cross-entropy with label smoothing, weight decay on every weight but batch norm's, SGD
with Nesterov momentum, linear warm-up and step decay scaled by batch/256, metrics
``top_1_accuracy``/``top_5_accuracy``, ``learning_rate`` and ``current_epoch`` in TensorBoard.
``--data_dir`` defaults to the original's public fake ImageNet, which is not reachable here: it
means local fake data. With ``--bigtable_instance`` the tf.Examples come from the rows of a Cloud
Bigtable table instead (``--bigtable_*`` flags, ``estimax.data.bigtable``). TPU-only flags are
accepted (see ``estimax.programs.common``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging

import estimax as ex
from estimax import ops
from estimax.data import bigtable, imagenet, preprocessing
from estimax.estimator import schedules
from estimax.models.resnet import RESNET_DEPTHS, resnet_v1
from estimax.programs import common, logs


def define_flags(fv: flags.FlagValues) -> None:
    """Defines resnet_main.py's flags (2018-12 names and defaults) on ``fv``."""
    d = functools.partial
    common.define_tpu_flags(fv)
    f = {name: d(getattr(flags, name), flag_values=fv) for name in (
        "DEFINE_string", "DEFINE_integer", "DEFINE_float", "DEFINE_bool", "DEFINE_enum")}
    f["DEFINE_string"]("data_dir", common.FAKE_DATA_DIR,
                       "Directory of the ImageNet TFRecords (train-* and validation-*), local or "
                       "gs://. The default, the original's public fake ImageNet bucket, cannot be "
                       "reached from estimax's machines: it means local random fake data. "
                       "'' or 'null': zero images with label 0 (the original's null input). Not "
                       "used with --bigtable_instance.")
    f["DEFINE_string"]("model_dir", None, "Directory for checkpoints and TensorBoard summaries.")
    f["DEFINE_integer"]("resnet_depth", 50, "Depth of ResNet: one of 18, 34, 50, 101, 152, 200.")
    f["DEFINE_enum"]("mode", "train_and_eval", list(common.MODES),
                     "train: train to --train_steps; eval: evaluate each new checkpoint in "
                     "--model_dir until the one at --train_steps; train_and_eval: alternate "
                     "--steps_per_eval training steps and an evaluation.")
    f["DEFINE_integer"]("train_steps", 112590, "Number of training steps (global, absolute; "
                        "112590 is about 90 epochs at batch 1024).")
    f["DEFINE_integer"]("train_batch_size", 1024, "Global batch size for training.")
    f["DEFINE_integer"]("eval_batch_size", 1024, "Global batch size for evaluation.")
    f["DEFINE_integer"]("num_train_images", 1281167, "Size of the training set (for epochs and "
                        "the learning-rate schedule).")
    f["DEFINE_integer"]("num_eval_images", 50000, "Size of the evaluation set. estimax "
                        "evaluates every one exactly once (the original dropped the remainder "
                        "of num_eval_images / eval_batch_size).")
    f["DEFINE_integer"]("num_label_classes", 1000, "Number of classes.")
    f["DEFINE_integer"]("steps_per_eval", 1251, "Training steps between evaluations in "
                        "train_and_eval mode.")
    f["DEFINE_integer"]("eval_timeout", None, "In eval mode, stop after this many seconds "
                        "without a new checkpoint (default: wait for the last one).")
    f["DEFINE_bool"]("skip_host_call", False, "Do not write learning_rate and current_epoch to "
                     "TensorBoard (the original's host_call).")
    f["DEFINE_integer"]("iterations_per_loop", 1251, "Training steps per device call (on CPU "
                        "they are dispatched one by one, still with one host sync per loop).")
    f["DEFINE_integer"]("num_cores", 8, "Number of replicas (devices) to train on; if this job "
                        "has fewer devices, all of them are used (with a warning).")
    f["DEFINE_integer"]("num_parallel_calls", 8, "Parallel JPEG decode/preprocess workers.")
    f["DEFINE_string"]("data_format", "channels_last", f"{common.UNUSED_HELP}: the models are NHWC "
                       "and XLA picks device layouts itself.")
    f["DEFINE_bool"]("transpose_input", True, f"{common.UNUSED_HELP}: it fed the TPU infeed in "
                     "HWCN layout.")
    f["DEFINE_string"]("export_dir", None, "After training, export the model for serving "
                       "(estimax.serving) under this directory.")
    f["DEFINE_bool"]("export_to_tpu", False, f"{common.UNUSED_HELP}: every export is lowered for "
                     "cpu, cuda and tpu.")
    f["DEFINE_enum"]("precision", "bfloat16", ["bfloat16", "float32"],
                     "Compute dtype of the network (parameters and loss stay float32).")
    f["DEFINE_float"]("base_learning_rate", 0.1, "Learning rate for a batch of 256; scaled "
                      "linearly by train_batch_size / 256.")
    f["DEFINE_float"]("momentum", 0.9, "Nesterov momentum of the SGD optimizer.")
    f["DEFINE_float"]("weight_decay", 1e-4, "L2 weight decay on every weight but batch norm's.")
    f["DEFINE_float"]("label_smoothing", 0.0, "Label smoothing of the cross-entropy.")
    f["DEFINE_integer"]("log_step_count_steps", 64, "Log 'loss = X, step = N' and the speed "
                        "every N steps.")
    f["DEFINE_bool"]("enable_lars", False, "LARS optimizer; the original used it only when "
                     "train_batch_size >= 16384, which estimax does not implement (it stops "
                     "with a message in that case).")
    f["DEFINE_float"]("poly_rate", 0.0, "LARS polynomial decay power (only with LARS).")
    f["DEFINE_bool"]("use_cache", True, f"{common.UNUSED_HELP}: the loader re-reads the files each "
                     "epoch; the OS page cache does what tf.data's cache() did.")
    f["DEFINE_bool"]("use_async_checkpointing", False, "estimax checkpoints are always "
                     "asynchronous (Orbax); accepted for compatibility.")
    f["DEFINE_integer"]("image_size", 224, "Side of the square images the network sees.")
    f["DEFINE_integer"]("profile_every_n_steps", 0, f"{common.UNUSED_HELP}: use jax.profiler.")
    bigtable_help = {
        "bigtable_project": "Cloud Bigtable input: the table's Google Cloud project (default: "
                            "the credentials' project, or the emulator's when "
                            "BIGTABLE_EMULATOR_HOST is set).",
        "bigtable_instance": "Cloud Bigtable input: read the tf.Examples from the rows of "
                             "--bigtable_table in this instance instead of --data_dir (one "
                             "serialized tf.Example per row; load a table with `estimax-convert "
                             "to-bigtable`).",
        "bigtable_table": "Cloud Bigtable input: the table.",
        "bigtable_train_prefix": "Cloud Bigtable input: row key prefix of the training rows "
                                 "(keys <prefix><10-digit index>, e.g. train_0000003892).",
        "bigtable_eval_prefix": "Cloud Bigtable input: row key prefix of the evaluation rows.",
        "bigtable_column_family": "Cloud Bigtable input: column family of the tf.Example cell.",
        "bigtable_column_qualifier": "Cloud Bigtable input: column qualifier of the tf.Example "
                                     "cell.",
    }
    for name, default in (("bigtable_project", None), ("bigtable_instance", None),
                          ("bigtable_table", "imagenet"), ("bigtable_train_prefix", "train_"),
                          ("bigtable_eval_prefix", "validation_"),
                          ("bigtable_column_family", "tfexample"),
                          ("bigtable_column_qualifier", "example")):
        f["DEFINE_string"](name, default, bigtable_help[name])
    # estimax additions.
    f["DEFINE_integer"]("save_checkpoints_steps", None, "Checkpoint every N steps (default: "
                        "max(100, iterations_per_loop), as the original).")
    f["DEFINE_integer"]("keep_checkpoint_max", 5, "Number of recent checkpoints kept.")
    f["DEFINE_bool"]("cpu_fast_ops", True, "Use estimax.ops' convolution and max-pool, whose "
                     "gradients XLA:CPU runs several times faster; identical ops on GPU/TPU.")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The recipe's hyperparameters (the flags the model_fn reads, gathered once)."""

    resnet_depth: int = 50
    num_label_classes: int = 1000
    precision: str = "bfloat16"
    base_learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    label_smoothing: float = 0.0
    train_batch_size: int = 1024
    num_train_images: int = 1281167
    write_scalars: bool = True
    cpu_fast_ops: bool = True


def build_model(cfg: ResNetConfig) -> nn.Module:
    """The network of ``cfg``: ResNet v1 of ``resnet_depth`` in the compute dtype of ``precision``."""
    kwargs: dict[str, Any] = {"dtype": jnp.bfloat16 if cfg.precision == "bfloat16"
                              else jnp.float32}
    kwargs.update(ops.fast_layers() if cfg.cpu_fast_ops else ops.standard_layers())
    return resnet_v1(cfg.resnet_depth, cfg.num_label_classes, **kwargs)


def make_model_fn(cfg: ResNetConfig):
    """Returns ``model_fn(features, labels, mode, params)``: resnet_main.py's resnet_model_fn."""
    schedule = schedules.resnet_schedule(cfg.base_learning_rate, cfg.train_batch_size,
                                         cfg.num_train_images)

    def model_fn(features, labels, mode, params):
        """features: [B, S, S, 3] uint8 (or float) in [0, 255]; labels: [B] int32 in [0, C)."""
        del params
        if isinstance(features, dict):
            features = features["feature"]
        model = build_model(cfg)
        # Normalised on the device, as the original, so the host ships uint8.
        images = preprocessing.normalize(features, jnp, dtype=model.dtype)
        logits = model(images, train=mode == ex.ModeKeys.TRAIN)  # float32
        predictions = {"classes": jnp.argmax(logits, axis=1),
                       "probabilities": jax.nn.softmax(logits)}
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(mode=mode, predictions=predictions,
                                    export_outputs={"classify": predictions})
        loss = ex.losses.softmax_cross_entropy(logits, labels,
                                               label_smoothing=cfg.label_smoothing)
        step = ex.get_global_step()
        learning_rate = schedule(step)
        scalars = None
        if cfg.write_scalars:
            scalars = {"learning_rate": learning_rate,
                       "current_epoch": schedules.current_epoch(step, cfg.train_batch_size,
                                                                cfg.num_train_images)}
        return ex.EstimatorSpec(
            mode=mode,
            loss=loss,
            # tf.train.MomentumOptimizer(lr, momentum, use_nesterov=True): momentum accumulates
            # the raw gradient and the rate scales it after, as optax.sgd does.
            optimizer=optax.sgd(schedule, momentum=cfg.momentum, nesterov=True),
            # The Estimator adds weight_decay * sum(l2_loss(w)) over non-batch-norm weights.
            weight_decay=cfg.weight_decay,
            eval_metrics={"top_1_accuracy": ex.metrics.accuracy(labels, logits),
                          "top_5_accuracy": ex.metrics.top_k_accuracy(labels, logits, k=5)},
            predictions=predictions,
            scalars=scalars,
        )

    return model_fn


def bigtable_table(fv: flags.FlagValues) -> bigtable.BigtableTable:
    """The ``--bigtable_*`` flags as the input's table spec."""
    return bigtable.BigtableTable(
        project=fv.bigtable_project, instance=fv.bigtable_instance, table=fv.bigtable_table,
        train_prefix=fv.bigtable_train_prefix, eval_prefix=fv.bigtable_eval_prefix,
        column_family=fv.bigtable_column_family, column_qualifier=fv.bigtable_column_qualifier)


def main(argv: list[str]) -> None:
    """The program: ``run_from_flags(flags.FLAGS)``."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    try:
        run_from_flags(flags.FLAGS)
    except bigtable.BigtableError as e:
        # A table that cannot be read is a setup problem: its message, without a traceback.
        sys.exit(f"FATAL: Cloud Bigtable input: {e}")


def run_from_flags(fv: flags.FlagValues) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop. Returns the last eval results, if any."""
    logs.setup()
    common.log_unused_tpu_flags(fv)
    if fv.enable_lars and fv.train_batch_size >= 16384:
        raise app.UsageError(
            f"--enable_lars with --train_batch_size={fv.train_batch_size}: LARS is not "
            "implemented in estimax. Use a batch below 16384 (SGD with momentum, as the "
            "original did there) or --noenable_lars.")
    if fv.resnet_depth not in RESNET_DEPTHS:
        raise app.UsageError(f"--resnet_depth={fv.resnet_depth}: must be one of "
                             f"{sorted(RESNET_DEPTHS)}.")
    cfg = ResNetConfig(
        resnet_depth=fv.resnet_depth, num_label_classes=fv.num_label_classes,
        precision=fv.precision, base_learning_rate=fv.base_learning_rate, momentum=fv.momentum,
        weight_decay=fv.weight_decay, label_smoothing=fv.label_smoothing,
        train_batch_size=fv.train_batch_size, num_train_images=fv.num_train_images,
        write_scalars=not fv.skip_host_call, cpu_fast_ops=fv.cpu_fast_ops)
    save_steps = fv.save_checkpoints_steps or max(100, fv.iterations_per_loop)
    config = ex.RunConfig(
        model_dir=fv.model_dir, iterations_per_loop=fv.iterations_per_loop,
        num_shards=common.resolve_num_shards(fv.num_cores, "num_cores"),
        save_checkpoints_steps=save_steps, keep_checkpoint_max=fv.keep_checkpoint_max,
        log_step_count_steps=fv.log_step_count_steps)
    est = ex.Estimator(make_model_fn(cfg), config, train_batch_size=fv.train_batch_size,
                       eval_batch_size=fv.eval_batch_size,
                       predict_batch_size=fv.eval_batch_size)
    inputs = functools.partial(
        imagenet.input_fn, image_size=fv.image_size, preprocessing="resnet",
        num_parallel_calls=fv.num_parallel_calls, fake_eval_examples=fv.num_eval_images,
        num_classes=fv.num_label_classes)
    if fv.bigtable_instance:
        logging.info("Reading the tf.Examples from Cloud Bigtable (--bigtable_instance); "
                     "--data_dir is not used")
        inputs = functools.partial(inputs, None, bigtable=bigtable_table(fv))
    else:
        data_dir, fake_kind = common.resolve_data_dir(fv.data_dir)
        inputs = functools.partial(inputs, data_dir, fake_data=fake_kind)
    loop = common.LoopConfig(
        mode=fv.mode, train_steps=fv.train_steps, steps_per_eval=fv.steps_per_eval,
        eval_steps=-(-fv.num_eval_images // fv.eval_batch_size), eval_timeout=fv.eval_timeout,
        export_dir=fv.export_dir, epochs_per_step=fv.train_batch_size / fv.num_train_images)
    # The original served JPEG bytes through a tf.map_fn of the eval preprocessing; an estimax
    # export is a compiled function of arrays, so it takes preprocessed images (uint8, [0, 255]).
    serving = lambda: ex.TensorSpec((None, fv.image_size, fv.image_size, 3), np.uint8)  # noqa: E731
    try:
        results = common.run(est, inputs(is_training=True), inputs(is_training=False), loop,
                             serving)
    finally:
        est.close()
    if results is not None:
        print(f"Eval results at step {results['global_step']}: top_1_accuracy = "
              f"{results['top_1_accuracy']:.4f}, top_5_accuracy = "
              f"{results['top_5_accuracy']:.4f} on {results['num_examples']} images")
    logging.info("TensorBoard logs: tensorboard --logdir=%s", est.model_dir)
    sys.stdout.flush()
    return results


def run() -> None:
    """Console-script entry point (``resnet``)."""
    define_flags(flags.FLAGS)
    # --help lists the flags this program defines through its helpers, too.
    flags.adopt_module_key_flags(common)
    app.run(main)


if __name__ == "__main__":
    run()
