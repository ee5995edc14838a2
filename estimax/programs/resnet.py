"""ResNet on ImageNet: the original ``resnet_main.py`` command line, on estimax.

    python -m estimax.programs.resnet --data_dir=DIR --model_dir=DIR [--resnet_depth=50 ...]

Flags have the names and defaults of the original ``resnet_main.py`` (tensorflow/tpu, 2018-12);
the recipe is its ``resnet_model_fn``: mean/std normalisation on the device, ResNet v1,
softmax cross-entropy with label smoothing, weight decay on every weight but batch norm's, SGD
with Nesterov momentum, linear warm-up and step decay scaled by batch/256, metrics
``top_1_accuracy``/``top_5_accuracy``, ``learning_rate`` and ``current_epoch`` in TensorBoard.
``--data_dir`` defaults to the original's public fake ImageNet, which is not reachable here: it
means local fake data, with a warning at start and in TensorBoard. With ``--bigtable_instance``
the tf.Examples come from the rows of a Cloud Bigtable table instead (``--bigtable_*`` flags,
``estimax.data.bigtable``). TPU-only flags are accepted and explained in their help. Every flag
can also come from ``ESTIMAX_<FLAG>`` in the environment (``ESTIMAX_MODEL_DIR``; a job runner's
``TPU_MODEL_DIR`` too), the command line winning. The original's YAML configs run as they are:
``--config_file=configs/cloud/v3-8.yaml`` (or ``--hparams_file``) and ``--params_override``, in its
order (defaults < config file < override < environment < command line); ``--print_config`` shows
each value and where it came from.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags, logging

import estimax as ex
from estimax import export, ops
from estimax.data import bigtable, imagenet
from estimax.models import resnet as resnet_model
from estimax.models.resnet import RESNET_DEPTHS, resnet_v1
from estimax.programs import (
    classifier,
    cli,
    common,
    config_file,
    configs,
    exports,
    flagspec,
    logs,
    schedules,
    shared_flags,
)
from estimax.programs.family import Family
from estimax.programs.inputs import FAKE_DATA_DIR, check_data, shard_index_dir
from estimax.programs.job import Job
from estimax.programs.shared_flags import UNUSED_HELP

# What the result line shows: "Eval results at step N: top_1_accuracy = ... on N images".
METRICS = (("top_1_accuracy", "top_5_accuracy"), "images")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The recipe's hyperparameters (the flags the model_fn reads, gathered once).

    The defaults are the original's and the flags' (``define_flags`` takes them from here).
    """

    resnet_depth: int = 50
    num_label_classes: int = 1000
    precision: str = "bfloat16"
    base_learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    label_smoothing: float = 0.0
    train_batch_size: int = 1024
    num_train_images: int = imagenet.NUM_TRAIN_IMAGES
    write_scalars: bool = True
    cpu_fast_ops: bool = True
    remat: str = "none"  # --remat: the blocks' rematerialisation policy


_C = ResNetConfig
# resnet_main.py's own flags (the shared ones are in shared_flags).
RESNET_FLAGS = (
    flagspec.Int(
        "resnet_depth",
        _C.resnet_depth,
        f"Depth of ResNet: one of {', '.join(map(str, sorted(RESNET_DEPTHS)))}.",
    ),
    flagspec.Int(
        "train_steps",
        112590,
        "Number of training steps (global, absolute; 112590 is about 90 epochs at batch 1024).",
        lower=1,
    ),
    flagspec.Int(
        "train_batch_size", _C.train_batch_size, "Global batch size for training.", lower=1
    ),
    flagspec.Int("eval_batch_size", 1024, "Global batch size for evaluation.", lower=1),
    flagspec.Int(
        "num_train_images",
        _C.num_train_images,
        "Size of the training set (for epochs and the learning-rate schedule).",
        lower=1,
    ),
    flagspec.Int(
        "num_eval_images",
        imagenet.NUM_EVAL_IMAGES,
        "Size of the evaluation "
        "set. estimax evaluates every one exactly once (the original dropped the "
        "remainder of num_eval_images / eval_batch_size).",
        lower=1,
    ),
    flagspec.Int("num_label_classes", _C.num_label_classes, "Number of classes.", lower=2),
    flagspec.Int(
        "steps_per_eval",
        1251,
        "Training steps between evaluations in train_and_eval mode.",
        lower=1,
    ),
    flagspec.Bool(
        "skip_host_call",
        not _C.write_scalars,
        "Do not write learning_rate and current_epoch to TensorBoard (the original's host_call).",
    ),
    flagspec.Int(
        "iterations_per_loop",
        1251,
        "Training steps per device call (on CPU "
        "they are dispatched one by one, still with one host sync per loop).",
        lower=1,
    ),
    flagspec.Int(
        "num_cores",
        8,
        "Number of replicas (devices) to train on; if this job "
        "has fewer devices, all of them are used (with a warning).",
        lower=1,
    ),
    flagspec.Int("num_parallel_calls", 8, "Parallel JPEG decode/preprocess workers.", lower=1),
    flagspec.Str(
        "data_format",
        "channels_last",
        f"{UNUSED_HELP}: the models are NHWC and XLA picks device layouts itself.",
    ),
    flagspec.Bool(
        "transpose_input",
        True,
        f"{UNUSED_HELP}: it fed the TPU infeed in HWCN layout.",
    ),
    flagspec.Bool(
        "export_to_tpu",
        False,
        f"{UNUSED_HELP}: every export is lowered for cpu, cuda and tpu.",
    ),
    flagspec.Float(
        "base_learning_rate",
        _C.base_learning_rate,
        "Learning rate for a batch of 256; scaled linearly by train_batch_size / 256.",
    ),
    flagspec.Float("momentum", _C.momentum, "Nesterov momentum of the SGD optimizer."),
    flagspec.Float(
        "weight_decay", _C.weight_decay, "L2 weight decay on every weight but batch norm's."
    ),
    flagspec.Float(
        "label_smoothing",
        _C.label_smoothing,
        "Label smoothing of the cross-entropy.",
        lower=0.0,
        upper=1.0,
    ),
    flagspec.Int(
        "log_step_count_steps",
        64,
        "Log 'loss = X, step = N' and the speed every N steps.",
        lower=1,
    ),
    flagspec.Bool(
        "enable_lars",
        False,
        "LARS optimizer; the original used it only when "
        "train_batch_size >= 16384, which estimax does not implement (it stops "
        "with a message in that case).",
    ),
    flagspec.Float("poly_rate", 0.0, "LARS polynomial decay power (only with LARS)."),
    flagspec.Bool(
        "use_cache",
        True,
        f"{UNUSED_HELP}: the loader re-reads the files "
        "each epoch; the OS page cache does what tf.data's cache() did.",
    ),
    flagspec.Bool(
        "use_async_checkpointing",
        False,
        "estimax checkpoints are always asynchronous (Orbax); accepted for compatibility.",
    ),
    flagspec.Int("image_size", 224, "Side of the square images the network sees.", lower=1),
    flagspec.Int(
        "profile_every_n_steps",
        0,
        "N > 0: one jax.profiler trace of step N for TensorBoard's profile plugin (the "
        "original traced every N steps); --profile_steps=START,STOP traces a range.",
    ),
    # estimax additions.
    flagspec.Int(
        "save_checkpoints_steps",
        None,
        "Checkpoint every N steps (default: max(100, iterations_per_loop), as the original).",
        lower=1,
    ),
)


# The keys of the original's params (configs/resnet_config.py's RESNET_CFG, 2019-06 on; the
# 2019-04 configs/default.yaml had the same) that --config_file and --params_override take,
# and what each does here (docs/programs.md#the-originals-config-files). Every other key is
# refused, as the original's is_strict=True refused it.
_NOT_BUILT = "estimax's ResNet is the original's 2018-12 ResNet v1, without"
CONFIG_KEYS: config_file.ConfigKeys = {
    # Keys that are flags of the same name (flags the original had as params too).
    **{
        name: config_file.Flag(name)
        for name in (
            "resnet_depth",
            "train_batch_size",
            "eval_batch_size",
            "num_train_images",
            "num_eval_images",
            "train_steps",
            "base_learning_rate",
            "iterations_per_loop",
            "use_tpu",
            "num_cores",
            "enable_lars",
            "transpose_input",
            "precision",
            "num_label_classes",
            "use_cache",
            "use_async_checkpointing",
            "image_size",
            "momentum",
            "weight_decay",
            "label_smoothing",
            "poly_rate",
            "skip_host_call",
            "num_parallel_calls",
            "data_format",
        )
    },
    "dropblock_groups": config_file.OnlyDefault("", f"{_NOT_BUILT} DropBlock"),
    "dropblock_keep_prob": config_file.Unused(
        "DropBlock's keep probability, read only with dropblock_groups (which must be empty)"
    ),
    "dropblock_size": config_file.Unused(
        "DropBlock's block size, read only with dropblock_groups (which must be empty)"
    ),
    "pre_activation": config_file.OnlyDefault(False, f"{_NOT_BUILT} ResNet v2 (pre-activation)"),
    "norm_act_layer": config_file.OnlyDefault("bn_relu", f"{_NOT_BUILT} other norm layers"),
    "augment_name": config_file.OnlyDefault(
        None, "estimax's ResNet input has no AutoAugment/RandAugment"
    ),
    "randaug_magnitude": config_file.Unused("read only with augment_name: randaugment"),
    "randaug_num_layers": config_file.Unused("read only with augment_name: randaugment"),
    "use_resnetd_stem": config_file.OnlyDefault(False, f"{_NOT_BUILT} the ResNet-D stem"),
    "resnetd_shortcut": config_file.OnlyDefault(False, f"{_NOT_BUILT} the ResNet-D shortcut"),
    "replace_stem_max_pool": config_file.OnlyDefault(
        False, f"{_NOT_BUILT} a strided convolution in place of the stem's max pool"
    ),
    "se_ratio": config_file.OnlyDefault(None, f"{_NOT_BUILT} squeeze-and-excitation"),
    "drop_connect_rate": config_file.OnlyDefault(None, f"{_NOT_BUILT} stochastic depth"),
    "dropout_rate": config_file.OnlyDefault(None, f"{_NOT_BUILT} dropout"),
    "moving_average_decay": config_file.OnlyDefault(
        0, f"{_NOT_BUILT} a moving average of the weights"
    ),
    "bn_momentum": config_file.OnlyDefault(
        0.9, "estimax's ResNet has the original's batch-norm momentum, 0.9, built in"
    ),
}


def define_flags(fv: flags.FlagValues) -> None:
    """Defines resnet_main.py's flags (2018-12 names and defaults) on ``fv``."""
    shared_flags.define_tpu_flags(fv)
    flagspec.define(
        fv,
        shared_flags.run_flags(
            data_dir_default=FAKE_DATA_DIR,
            steps_per_eval_flag="steps_per_eval",
            precision_default=_C.precision,
            data_dir_help=(
                "Directory of the ImageNet TFRecords (train-* and validation-*), local, gs:// or "
                "s3://. The default, the original's public fake ImageNet bucket, cannot be "
                "reached from here: it means random fake data, with a warning. 'fake': random "
                "images; 'null': zero images with label 0 (the original's null input). Not "
                "used with --bigtable_instance."
            ),
        ),
        RESNET_FLAGS,
        config_file.FLAGS,
        (
            flagspec.Str(name, default, f"Cloud Bigtable input: {text}")
            for name, default, text in BIGTABLE_FLAGS
        ),
    )


# The --bigtable_* flags: (name, default, help).
BIGTABLE_FLAGS = (
    (
        "bigtable_project",
        None,
        "the table's Google Cloud project (default: the credentials' "
        "project, or the emulator's when BIGTABLE_EMULATOR_HOST is set).",
    ),
    (
        "bigtable_instance",
        None,
        "read the tf.Examples from the rows of --bigtable_table in this "
        "instance instead of --data_dir (one serialized tf.Example per row; load a table with "
        "`estimax-convert to-bigtable`).",
    ),
    ("bigtable_table", "imagenet", "the table."),
    (
        "bigtable_train_prefix",
        "train_",
        "row key prefix of the training rows (keys "
        "<prefix><10-digit index>, e.g. train_0000003892).",
    ),
    ("bigtable_eval_prefix", "validation_", "row key prefix of the evaluation rows."),
    ("bigtable_column_family", "tfexample", "column family of the tf.Example cell."),
    ("bigtable_column_qualifier", "example", "column qualifier of the tf.Example cell."),
)


def build_model(cfg: ResNetConfig) -> nn.Module:
    """The network of ``cfg``: ResNet v1 of ``resnet_depth``, computing in ``precision``."""
    kwargs: dict[str, Any] = {"dtype": jnp.bfloat16 if cfg.precision == "bfloat16" else jnp.float32}
    kwargs.update(ops.fast_layers() if cfg.cpu_fast_ops else ops.standard_layers())
    return resnet_v1(cfg.resnet_depth, cfg.num_label_classes, remat=cfg.remat, **kwargs)


def make_model_fn(cfg: ResNetConfig):
    """Returns ``model_fn(features, labels, mode, params)``: resnet_main.py's resnet_model_fn."""
    schedule = schedules.resnet_schedule(
        cfg.base_learning_rate, cfg.train_batch_size, cfg.num_train_images
    )
    return classifier.make_model_fn(
        classifier.Recipe(
            network=functools.partial(build_model, cfg),
            # tf.train.MomentumOptimizer(lr, momentum, use_nesterov=True): momentum accumulates
            # the raw gradient and the rate scales it after, as optax.sgd does.
            optimizer=optax.sgd(schedule, momentum=cfg.momentum, nesterov=True),
            schedule=schedule,
            train_batch_size=cfg.train_batch_size,
            num_train_images=cfg.num_train_images,
            label_smoothing=cfg.label_smoothing,
            weight_decay=cfg.weight_decay,
            write_scalars=cfg.write_scalars,
        )
    )


def bigtable_table(fv: flags.FlagValues) -> bigtable.BigtableTable:
    """The ``--bigtable_*`` flags as the input's table spec."""
    return bigtable.BigtableTable(
        project=fv.bigtable_project,
        instance=fv.bigtable_instance,
        table=fv.bigtable_table,
        train_prefix=fv.bigtable_train_prefix,
        eval_prefix=fv.bigtable_eval_prefix,
        column_family=fv.bigtable_column_family,
        column_qualifier=fv.bigtable_column_qualifier,
    )


def config_from_flags(fv: flags.FlagValues) -> ResNetConfig:
    """The model and recipe the flags ask for (``estimax-convert tf-checkpoint`` builds it too)."""
    return ResNetConfig(
        resnet_depth=fv.resnet_depth,
        num_label_classes=fv.num_label_classes,
        precision=fv.precision,
        base_learning_rate=fv.base_learning_rate,
        momentum=fv.momentum,
        weight_decay=fv.weight_decay,
        label_smoothing=fv.label_smoothing,
        train_batch_size=fv.train_batch_size,
        num_train_images=fv.num_train_images,
        write_scalars=not fv.skip_host_call,
        cpu_fast_ops=fv.cpu_fast_ops,
        remat=fv.remat,
    )


def check_flags(fv: flags.FlagValues) -> None:
    """Refuses flag values estimax cannot run (one ``UsageError`` naming the flag)."""
    if fv.enable_lars and fv.train_batch_size >= 16384:
        raise cli.UsageError(
            f"--enable_lars with --train_batch_size={fv.train_batch_size}: LARS is not "
            "implemented in estimax. Use a batch below 16384 (SGD with momentum, as the "
            "original did there) or --noenable_lars."
        )
    if fv.resnet_depth not in RESNET_DEPTHS:
        raise cli.UsageError(
            f"--resnet_depth={fv.resnet_depth}: must be one of {sorted(RESNET_DEPTHS)}."
        )


def make_inputs(fv: flags.FlagValues) -> tuple[Any, str | None, list[str]]:
    """``(input_fn(is_training=...), data_dir, notes)`` of ``--data_dir`` or ``--bigtable_*``."""
    inputs = functools.partial(
        imagenet.input_fn,
        image_size=fv.image_size,
        preprocessing="resnet",
        num_parallel_calls=fv.num_parallel_calls,
        fake_eval_examples=fv.num_eval_images,
        num_classes=fv.num_label_classes,
        skip_bad_records=fv.skip_bad_records,
        index_dir=shard_index_dir(fv.model_dir),
        index_beside_data=fv.index_beside_data,
    )
    cli.check_given(fv, tuple(name for name, _, _ in BIGTABLE_FLAGS))
    if fv.bigtable_instance:
        logging.info(
            "Reading the tf.Examples from Cloud Bigtable (--bigtable_instance); "
            "--data_dir is not used"
        )
        return functools.partial(inputs, None, bigtable=bigtable_table(fv)), None, []
    data_dir, fake_kind, notes = check_data(fv.data_dir, fv.mode, compile_only=bool(fv.compile_for))
    return functools.partial(inputs, data_dir, fake_data=fake_kind), data_dir, notes


def run_from_flags(fv: flags.FlagValues) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop. Returns the last eval results, if any."""
    logs.setup()
    shared_flags.log_unused_tpu_flags(fv)
    shared_flags.check_locations(fv)
    check_flags(fv)
    inputs, data_dir, notes = make_inputs(fv)
    config, loop = configs.resnet_style_configs(
        fv,
        num_shards=shared_flags.resolve_num_shards(
            fv.num_cores, "num_cores", compile_only=bool(fv.compile_for)
        ),
    )
    return common.run(
        Job.for_family(
            FAMILY,
            fv,
            config_from_flags(fv),
            config=config,
            loop=loop,
            notes=tuple(notes),
            input_fn=inputs,
            batch_sizes=(fv.train_batch_size, fv.eval_batch_size),
            # The input hands the model the file's label - 1.
            **exports.image_export(data_dir, 1, fv.num_label_classes, fv.precision),
        )
    )


FAMILY = Family(
    name="resnet",
    doc=__doc__,
    define_flags=define_flags,
    config_from_flags=config_from_flags,
    make_model_fn=make_model_fn,
    model_flags=("resnet_depth", "num_label_classes"),
    # As the original's image_serving_input_fn, clients send JPEG/PNG bytes; the server applies
    # estimax's eval preprocessing, and the model (and export) take uint8 [0, 255] images.
    input_spec=lambda fv: ex.TensorSpec((None, fv.image_size, fv.image_size, 3), np.uint8),
    serving_preprocessing=lambda fv: export.resnet_eval(fv.image_size),
    run_from_flags=run_from_flags,
    metrics=METRICS,
    tf_names=resnet_model.TF_NAMES,
    config_keys=CONFIG_KEYS,
)


def run() -> None:
    """Console-script entry point (``resnet``)."""
    FAMILY.main()


if __name__ == "__main__":
    run()
