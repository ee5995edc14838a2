"""EfficientNet on ImageNet: the original EfficientNet ``main.py`` command line, on estimax.

    python -m estimax.programs.efficientnet --data_dir=DIR --model_dir=DIR \\
        [--model_name=efficientnet-b0 ...]

Flags have the names and defaults of the original ``models/official/efficientnet/main.py``
(tensorflow/tpu, 2019-06: the training script of EfficientNet, there named ``main.py``); the
recipe is its ``model_fn``:

* ``--model_name=efficientnet-b0`` .. ``efficientnet-b7`` (``efficientnet_builder``'s width,
  depth, resolution and dropout; ``--input_image_size`` defaults to the variant's resolution);
  ``--width_coefficient``, ``--depth_coefficient``, ``--dropout_rate``, ``--drop_connect_rate``,
  ``--batch_norm_momentum``, ``--batch_norm_epsilon`` override the variant's, as the original's
  ``override_params``. estimax adds ``efficientnet-tiny`` (B0's first three stages at a quarter
  of its width, 32x32 images), a small variant for tests and smoke runs;
* images mean/std-normalised on the device (MEAN_RGB, STDDEV_RGB of [0, 255]); the
  preprocessing is the original's ``preprocessing.py``, which is ResNet's of the same date line
  for line (inception-style random crop, flip and bicubic resize for training; a centre crop of
  ``size / (size + 32)`` of the short side and a bicubic resize for eval), so the input is
  ``estimax.data.imagenet``'s ``preprocessing="resnet"``;
* softmax cross-entropy with label smoothing 0.1 over ``--num_label_classes`` (1000) classes,
  plus ``--weight_decay`` (1e-5) times the L2 of every weight but batch norm's;
* RMSProp as ``tf.train.RMSPropOptimizer(lr, decay=0.9, momentum=0.9, epsilon=1e-3)``
  (``utils.build_optimizer``'s defaults; ``schedules.tf_rmsprop``). The original defined
  ``--momentum`` but never passed it on; here it is RMSProp's momentum (same default);
* ``--base_learning_rate`` (0.016) scaled by ``train_batch_size / 256``, 5 epochs of linear
  warm-up, then x0.97 every 2.4 epochs (``schedules.efficientnet_schedule``);
* an exponential moving average of the weights (``--moving_average_decay``, 0.9999, with TF's
  ``num_updates`` ramp; 0 turns it off), used to evaluate and for ``--export_dir``. The original
  also averaged batch norm's moving mean and variance; estimax averages the trained weights only;
* metrics ``top_1_accuracy`` and ``top_5_accuracy``; ``learning_rate`` and ``current_epoch`` in
  TensorBoard unless ``--skip_host_call``.

``--use_bfloat16`` (the original's) is ``--precision=bfloat16``. The exports take encoded
JPEG/PNG bytes (``image_bytes``) and declare their eval preprocessing as data, checked bit for
bit against the input pipeline's before they are published. Not carried over: the
``--bigtable_*`` input (use ``resnet`` for Bigtable) and the copy of the best checkpoint into
``model_dir/archive``. Every flag can also come from ``ESTIMAX_<FLAG>`` in the environment
(``ESTIMAX_MODEL_DIR``; a job runner's ``TPU_MODEL_DIR`` too), the command line winning, or from
a YAML file (``--config_file``, ``--params_override``: its flags' names, and the original's
classification configs' ``train.train_batch_size`` nesting); ``--print_config`` shows them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

import estimax as ex
from estimax import export, ops
from estimax.data import imagenet, preprocessing
from estimax.models import efficientnet
from estimax.programs import (
    classifier,
    cli,
    common,
    config_file,
    flagspec,
    inputs,
    resnet,
    schedules,
    shared_flags,
)
from estimax.programs.family import Family

# What the result line shows: "Eval results at step N: top_1_accuracy = ... on N images".
METRICS = (("top_1_accuracy", "top_5_accuracy"), "images")
# utils.build_optimizer's defaults, which the original's model_fn used.
RMSPROP_DECAY = 0.9
RMSPROP_EPSILON = 1e-3
# --model_name -> (network, input resolution): the original's eight and the tiny test variant.
MODEL_NAMES: dict[str, tuple[Callable[..., nn.Module], int]] = {
    **efficientnet.EFFICIENTNETS,
    efficientnet.TINY_NAME: (efficientnet.EfficientNetTiny, efficientnet.TINY_RESOLUTION),
}


@dataclasses.dataclass(frozen=True)
class EfficientNetConfig:
    """The recipe's hyperparameters (the flags the model_fn reads, gathered once), in the order of
    main.py's flags; ``define_flags`` takes the defaults from here. ``None`` overrides keep the
    variant's value (the original's ``override_params``).
    """

    model_name: str = "efficientnet-b0"
    train_batch_size: int = 2048
    num_train_images: int = imagenet.NUM_TRAIN_IMAGES
    write_scalars: bool = True  # not --skip_host_call
    num_label_classes: int = 1000
    batch_norm_momentum: float | None = None
    batch_norm_epsilon: float | None = None
    precision: str = "float32"  # --use_bfloat16 / --precision
    base_learning_rate: float = 0.016
    momentum: float = 0.9
    moving_average_decay: float = 0.9999
    weight_decay: float = 1e-5
    label_smoothing: float = 0.1
    dropout_rate: float | None = None
    drop_connect_rate: float | None = None
    depth_coefficient: float | None = None
    width_coefficient: float | None = None
    cpu_fast_ops: bool = True
    remat: str = "none"  # --remat: the blocks' rematerialisation policy


_C = EfficientNetConfig
# The flags main.py took from resnet_main.py, as resnet's specs with main.py's defaults.
FROM_RESNET = flagspec.with_defaults(
    (
        spec
        for spec in resnet.RESNET_FLAGS
        if spec.name
        in (
            "train_batch_size",
            "eval_batch_size",
            "num_train_images",
            "num_eval_images",
            "num_label_classes",
            "steps_per_eval",
            "skip_host_call",
            "iterations_per_loop",
            "data_format",
            "transpose_input",
            "export_to_tpu",
            "base_learning_rate",
            "weight_decay",
            "label_smoothing",
            "log_step_count_steps",
            "use_cache",
            "use_async_checkpointing",
            "save_checkpoints_steps",
        )
    ),
    {
        "train_batch_size": _C.train_batch_size,
        "steps_per_eval": 6255,
        "base_learning_rate": _C.base_learning_rate,
        "weight_decay": _C.weight_decay,
        "label_smoothing": _C.label_smoothing,
    },
)
# main.py's own flags (the shared ones are in shared_flags, and FROM_RESNET).
EFFICIENTNET_FLAGS = (
    flagspec.Str(
        "model_name",
        _C.model_name,
        f"The network: one of {', '.join(efficientnet.EFFICIENTNETS)}; estimax adds "
        f"{efficientnet.TINY_NAME} (small, for tests).",
    ),
    flagspec.Int(
        "train_steps",
        218949,
        "Number of training steps (global, absolute; 218949 is about 350 epochs at batch 2048).",
        lower=1,
    ),
    flagspec.Int(
        "input_image_size",
        None,
        "Side of the square images the network sees (default: the variant's resolution, "
        "224 for efficientnet-b0).",
        lower=1,
    ),
    flagspec.Int(
        "num_parallel_calls",
        64,
        "Parallel JPEG decode/preprocess workers (at most the CPU count).",
        lower=1,
    ),
    flagspec.Float("batch_norm_momentum", None, "Batch norm momentum to override (0.99)."),
    flagspec.Float("batch_norm_epsilon", None, "Batch norm epsilon to override (1e-3)."),
    flagspec.Bool("use_bfloat16", False, "Compute in bfloat16: the same as --precision=bfloat16."),
    flagspec.Float(
        "momentum",
        _C.momentum,
        "Momentum of the RMSProp optimizer (the original defined this flag but did not pass it "
        "on; its RMSProp used 0.9).",
    ),
    flagspec.Float(
        "moving_average_decay",
        _C.moving_average_decay,
        "Decay of the exponential moving average of the weights, which evaluation and "
        "--export_dir use; 0: no moving average.",
        lower=0.0,
        upper=1.0,
    ),
    flagspec.Float(
        "dropout_rate",
        None,
        "Dropout before the final dense layer, overriding the variant's (0.2 for b0).",
        lower=0.0,
        upper=0.99,
    ),
    flagspec.Float(
        "drop_connect_rate",
        None,
        "Drop-connect rate of the last block (0.2), overriding the variant's.",
        lower=0.0,
        upper=0.99,
    ),
    flagspec.Float(
        "depth_coefficient",
        None,
        "Depth coefficient (repeats of every stage), overriding the variant's.",
        lower=0.0,
    ),
    flagspec.Float(
        "width_coefficient",
        None,
        "Width coefficient (channels of every layer), overriding the variant's.",
        lower=0.0,
    ),
)


# --config_file/--params_override keys (docs/programs.md#the-originals-config-files). The
# original's EfficientNet main.py took flags only, no params file: its hyperparameter flags are
# the keys here (flat, as ResNet's params), with the nesting of the original's later
# classification configs (detection/configs: train.train_batch_size...) for the keys they share;
# the later main.py's keys for features estimax does not build take only their defaults.
_FLAG_KEYS = (
    "model_name",
    "train_steps",
    "input_image_size",
    "train_batch_size",
    "eval_batch_size",
    "num_train_images",
    "num_eval_images",
    "steps_per_eval",
    "skip_host_call",
    "iterations_per_loop",
    "num_parallel_calls",
    "data_format",
    "num_label_classes",
    "batch_norm_momentum",
    "batch_norm_epsilon",
    "transpose_input",
    "use_bfloat16",
    "export_to_tpu",
    "base_learning_rate",
    "moving_average_decay",
    "weight_decay",
    "label_smoothing",
    "dropout_rate",
    "drop_connect_rate",
    "use_cache",
    "depth_coefficient",
    "width_coefficient",
    "use_async_checkpointing",
    "log_step_count_steps",
    "use_tpu",
    "precision",
    "momentum",
)
_NESTED_KEYS = {
    "train.train_batch_size": "train_batch_size",
    "train.total_steps": "train_steps",
    "train.iterations_per_loop": "iterations_per_loop",
    "train.label_smoothing": "label_smoothing",
    "train.l2_weight_decay": "weight_decay",
    "eval.eval_batch_size": "eval_batch_size",
    "architecture.num_classes": "num_label_classes",
    "batch_norm_activation.batch_norm_momentum": "batch_norm_momentum",
    "batch_norm_activation.batch_norm_epsilon": "batch_norm_epsilon",
}
_NOT_BUILT = "estimax's EfficientNet is the original's 2019-06 recipe, without"
CONFIG_KEYS: config_file.ConfigKeys = {
    **{name: config_file.Flag(name) for name in _FLAG_KEYS},
    **{key: config_file.Flag(name) for key, name in _NESTED_KEYS.items()},
    "augment_name": config_file.OnlyDefault(None, f"{_NOT_BUILT} AutoAugment/RandAugment"),
    "randaug_num_layers": config_file.Unused("read only with augment_name: randaugment"),
    "randaug_magnitude": config_file.Unused("read only with augment_name: randaugment"),
    "mixup_alpha": config_file.OnlyDefault(0.0, f"{_NOT_BUILT} mixup"),
    "optimizer": config_file.OnlyDefault("rmsprop", f"{_NOT_BUILT} other optimizers"),
    "lr_schedule": config_file.OnlyDefault("exponential", f"{_NOT_BUILT} other schedules"),
    "lr_decay_factor": config_file.OnlyDefault(0.97, "the decay (x0.97) is built in"),
    "lr_decay_epoch": config_file.OnlyDefault(2.4, "the decay period (2.4 epochs) is built in"),
    "lr_warmup_epochs": config_file.OnlyDefault(5, "the warm-up (5 epochs) is built in"),
    "lars_weight_decay": config_file.Unused("read only with optimizer: lars"),
    "lars_epsilon": config_file.Unused("read only with optimizer: lars"),
    "survival_prob": config_file.OnlyDefault(
        None, "estimax takes the 2019-06 name: give drop_connect_rate (1 - survival_prob)"
    ),
    "holdout_shards": config_file.OnlyDefault(None, f"{_NOT_BUILT} held-out training shards"),
    "batch_norm_batch_size": config_file.OnlyDefault(
        None, f"{_NOT_BUILT} batch-norm groups across replicas"
    ),
    "archive_ckpt": config_file.Unused(
        "the copy of the best checkpoint into model_dir/archive is not carried over"
    ),
    "num_replicas": config_file.Unused(
        "estimax's replicas are the devices it finds, divided by --num_cores_per_replica"
    ),
}


def define_flags(fv: flags.FlagValues) -> None:
    """Defines the original EfficientNet main.py's flags (2019-06 names and defaults) on ``fv``."""
    shared_flags.define_tpu_flags(fv, master=False)
    flagspec.define(
        fv,
        shared_flags.run_flags(
            data_dir_default=inputs.FAKE_DATA_DIR,
            steps_per_eval_flag="steps_per_eval",
            precision_default=_C.precision,
            data_dir_help=(
                "Directory of the ImageNet TFRecords (train-*, validation-*), local, gs:// or "
                "s3://; 'fake' for random images, 'null' for the original's all-zero ones. The "
                "default (the original's public fake ImageNet, which cannot be reached from "
                "here) means random fake data, with a warning."
            ),
        ),
        FROM_RESNET,
        EFFICIENTNET_FLAGS,
        config_file.FLAGS,
    )


def build_model(cfg: EfficientNetConfig) -> nn.Module:
    """The network of ``cfg``: the named variant with its overrides, computing in ``precision``.

    Raises:
      ValueError: ``cfg.model_name`` is not a known variant (the message lists them).
    """
    if cfg.model_name not in MODEL_NAMES:
        raise ValueError(
            f"--model_name={cfg.model_name!r}: must be one of {', '.join(MODEL_NAMES)}."
        )
    constructor, _ = MODEL_NAMES[cfg.model_name]
    # The original overrides a coefficient only when it is given and non-zero, the rest when given.
    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("width_coefficient", cfg.width_coefficient or None),
            ("depth_coefficient", cfg.depth_coefficient or None),
            ("dropout_rate", cfg.dropout_rate),
            ("drop_connect_rate", cfg.drop_connect_rate),
            ("bn_momentum", cfg.batch_norm_momentum),
            ("bn_epsilon", cfg.batch_norm_epsilon),
        )
        if value is not None
    }
    return constructor(
        num_classes=cfg.num_label_classes,
        dtype=jnp.bfloat16 if cfg.precision == "bfloat16" else jnp.float32,
        conv=ops.FastConv if cfg.cpu_fast_ops else nn.Conv,
        remat=cfg.remat,
        **overrides,
    )


def make_optimizer(
    cfg: EfficientNetConfig, schedule: optax.Schedule
) -> optax.GradientTransformation:
    """``tf.train.RMSPropOptimizer(schedule, decay=0.9, momentum, epsilon=1e-3)`` (TF's update)."""
    return schedules.tf_rmsprop(schedule, RMSPROP_DECAY, cfg.momentum, RMSPROP_EPSILON)


def make_model_fn(cfg: EfficientNetConfig):
    """Returns ``model_fn(features, labels, mode, params)``: the original main.py's model_fn."""
    schedule = schedules.efficientnet_schedule(
        cfg.base_learning_rate, cfg.train_batch_size, cfg.num_train_images
    )
    return classifier.make_model_fn(
        classifier.Recipe(
            network=functools.partial(build_model, cfg),
            optimizer=make_optimizer(cfg, schedule),
            schedule=schedule,
            train_batch_size=cfg.train_batch_size,
            num_train_images=cfg.num_train_images,
            label_smoothing=cfg.label_smoothing,
            weight_decay=cfg.weight_decay,
            # tf.train.ExponentialMovingAverage(decay, num_updates=global_step); 0: none.
            ema_decay=cfg.moving_average_decay or None,
            write_scalars=cfg.write_scalars,
        )
    )


def _precision(fv: flags.FlagValues) -> str:
    """``--precision``, or bfloat16 with the original's ``--use_bfloat16``."""
    if not fv.use_bfloat16:
        return fv.precision
    if fv["precision"].present and fv.precision != "bfloat16":
        raise cli.UsageError(
            f"--use_bfloat16 with --precision={fv.precision}: they disagree; give one of them."
        )
    return "bfloat16"


def config_from_flags(fv: flags.FlagValues) -> EfficientNetConfig:
    """The model and recipe the flags ask for.

    Raises:
      UsageError: an unknown ``--model_name`` (the message lists the known ones), or
        ``--use_bfloat16`` against ``--precision=float32``.
    """
    if fv.model_name not in MODEL_NAMES:
        raise cli.UsageError(
            f"--model_name={fv.model_name!r} is not an EfficientNet: use one of "
            f"{', '.join(MODEL_NAMES)}."
        )
    return EfficientNetConfig(
        model_name=fv.model_name,
        train_batch_size=fv.train_batch_size,
        num_train_images=fv.num_train_images,
        write_scalars=not fv.skip_host_call,
        num_label_classes=fv.num_label_classes,
        batch_norm_momentum=fv.batch_norm_momentum,
        batch_norm_epsilon=fv.batch_norm_epsilon,
        precision=_precision(fv),
        base_learning_rate=fv.base_learning_rate,
        momentum=fv.momentum,
        moving_average_decay=fv.moving_average_decay,
        weight_decay=fv.weight_decay,
        label_smoothing=fv.label_smoothing,
        dropout_rate=fv.dropout_rate,
        drop_connect_rate=fv.drop_connect_rate,
        depth_coefficient=fv.depth_coefficient,
        width_coefficient=fv.width_coefficient,
        cpu_fast_ops=fv.cpu_fast_ops,
        remat=fv.remat,
    )


def image_size(fv: flags.FlagValues) -> int:
    """``--input_image_size``, else the resolution of ``--model_name``'s variant."""
    return fv.input_image_size or MODEL_NAMES[fv.model_name][1]


def serving_preprocessing(fv: flags.FlagValues) -> export.Preprocessing:
    """The eval preprocessing an export declares: a centre crop of ``size / (size + 32)`` of the
    short side, bicubic resize, uint8 (normalised on the device), as ``preprocessing.py``."""
    return export.image_preprocessing(
        image_size(fv),
        crop="center",
        crop_padding=preprocessing.CROP_PADDING,
        resize="bicubic",
        dtype="uint8",
    )


def make_inputs(fv: flags.FlagValues) -> tuple[Any, str | None, list[str]]:
    """``(input_fn(is_training=...), data_dir, notes)`` of ``--data_dir`` (EfficientNet's
    preprocessing.py is ResNet's: see the module docstring)."""
    return inputs.imagenet_inputs(fv, image_size(fv))


def run_from_flags(fv: flags.FlagValues) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop. Returns the last eval results, if any."""
    return common.run_resnet_style_family(fv, FAMILY, make_inputs, image_size)


FAMILY = Family(
    name="efficientnet",
    doc=__doc__,
    define_flags=define_flags,
    config_from_flags=config_from_flags,
    make_model_fn=make_model_fn,
    model_flags=("model_name", "num_label_classes", "width_coefficient", "depth_coefficient"),
    # Clients send JPEG/PNG bytes; the server applies the declared eval preprocessing, and the
    # model (and export) take uint8 [0, 255] images.
    input_spec=lambda fv: ex.TensorSpec((None, image_size(fv), image_size(fv), 3), np.uint8),
    serving_preprocessing=serving_preprocessing,
    run_from_flags=run_from_flags,
    metrics=METRICS,
    config_keys=CONFIG_KEYS,
)


def run() -> None:
    """Console-script entry point (``efficientnet``)."""
    FAMILY.main()


if __name__ == "__main__":
    run()
