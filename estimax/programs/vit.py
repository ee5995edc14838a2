"""ViT on ImageNet: big_vision's ViT-S/16, B/16, L/16 and its ImageNet recipe, on estimax.

    estimax train --family=vit --data_dir=DIR --model_dir=DIR [--model_name=vit-s16 ...]

The network is ``estimax.models.vit`` (big_vision's ``big_vision/models/vit.py``); the recipe is
big_vision's ``big_vision/configs/vit_s16_i1k.py`` ("Better plain ViT baselines for
ImageNet-1k", https://arxiv.org/abs/2205.01580), read in google-research/big_vision at commit
2f3f493a, with its optimizer as ``big_vision/optax.py`` builds it and its schedule as
``big_vision/utils.py``'s ``create_learning_rate_schedule``:

* ``--model_name=vit-s16`` (default), ``vit-b16``, ``vit-l16``: S/16 with the head of
  ``vit_s16_i1k.py`` (global average pooling, fixed 2-D sin-cos position embeddings, a tanh
  ``pre_logits`` layer), B/16 and L/16 with the head of ``configs/vit_i1k.py`` (class token,
  learned position embeddings, ``pre_logits``); ``--pool_type``, ``--posemb``,
  ``--representation_size`` override them. estimax adds ``vit-tiny`` (width 32, 2 blocks of 2
  heads, 8x8 patches of 32x32 images), a small variant for tests and smoke runs;
* the input: an inception-style random crop, a random flip and ``--augment=randaugment``
  (``randaug(2,10)``: ``--randaug_num_layers``, ``--randaug_magnitude``) on the host, then
  ``--mixup_alpha=0.2`` mixup of each batch (``estimax.data.augment``); eval is a centre crop of
  224/256 of the short side resized to 224, the region of big_vision's ``resize_small(256)|
  central_crop(224)``. The images go to the device as uint8 (float32 once mixed) and are scaled
  to [-1, 1] there (``value_range(-1, 1)``);
* ``--loss=softmax`` (``softmax_xent``, the config's) or ``sigmoid`` (``sigmoid_xent``: the sum
  over classes of the binary cross-entropies), on one-hot (or mixed) targets, with
  ``--label_smoothing`` (0, as the config);
* Adam (``optax.scale_by_adam``, ``--adam_beta1`` 0.9, ``--adam_beta2`` 0.999, ``--adam_epsilon``
  1e-8) with its first moment kept in ``--mu_dtype=bfloat16``, after clipping the gradients'
  global norm to ``--grad_clip_norm`` (1.0); the update is ``-(schedule(step)) * (lr * adam +
  wd * kernel)``: ``--base_learning_rate`` 0.001 (not scaled with the batch), decoupled weight
  decay ``--weight_decay`` 1e-4 on the kernels only (big_vision's ``wd_mults``
  ``.*/kernel$``), both following the schedule: ``--warmup_steps`` (10,000) of linear warm-up
  from 0, then a cosine to 0 at ``--train_steps``;
* ``--train_batch_size`` 1024 and ``--train_steps`` 112,603 (90 epochs of ImageNet's 1,281,167
  images; big_vision trains on ``train[:99%]`` and keeps 1% as minival);
* metrics ``top_1_accuracy`` and ``top_5_accuracy``; ``learning_rate`` and ``current_epoch`` in
  TensorBoard unless ``--skip_host_call``.

big_vision's published figures for this recipe (``vit_s16_i1k.py``'s docstring): ViT-S/16
"should take 6-7h to finish 90ep on a TPU-v3-8 and reach 76.5%" top-1 on ImageNet validation
(``big_vision/models/vit.py`` names the resulting 90-, 150- and 300-epoch checkpoints,
``i1k-s16-90ep`` ...). estimax has not reproduced it (no TPU here); it is what a full run should
be held to.

The exports take encoded JPEG/PNG bytes (``image_bytes``) and declare their eval preprocessing
as data, checked bit for bit against the input pipeline's before they are published. Every flag
can also come from ``ESTIMAX_<FLAG>`` in the environment, the command line winning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

import estimax as ex
from estimax import export
from estimax.data import augment, imagenet, preprocessing
from estimax.models import vit
from estimax.programs import (
    classifier,
    cli,
    common,
    flagspec,
    inputs,
    resnet,
    schedules,
    shared_flags,
)
from estimax.programs.family import Family

METRICS = (("top_1_accuracy", "top_5_accuracy"), "images")
# --model_name -> (network, input resolution): big_vision's three and the tiny test variant.
MODEL_NAMES: dict[str, tuple[Callable[..., nn.Module], int]] = {
    **vit.VIT_VARIANTS,
    vit.TINY_NAME: (vit.ViTTiny, vit.TINY_RESOLUTION),
}
AUGMENTS = ("none", "randaugment")
LOSSES = ("softmax", "sigmoid")
MU_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """The recipe (big_vision's ``vit_s16_i1k.py``); ``define_flags`` takes the defaults here.
    ``None`` model overrides keep the variant's value."""

    model_name: str = "vit-s16"
    train_batch_size: int = 1024
    train_steps: int = 112_603  # ceil(90 * 1,281,167 / 1024)
    num_train_images: int = imagenet.NUM_TRAIN_IMAGES
    write_scalars: bool = True  # not --skip_host_call
    num_label_classes: int = 1000
    precision: str = "float32"
    base_learning_rate: float = 0.001
    weight_decay: float = 0.0001
    warmup_steps: int = 10_000
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    mu_dtype: str = "bfloat16"
    grad_clip_norm: float = 1.0
    label_smoothing: float = 0.0
    loss: str = "softmax"
    dropout_rate: float = 0.0
    pool_type: str | None = None
    posemb: str | None = None
    representation_size: int | None = None
    remat: str = "none"  # --remat: the encoder blocks' rematerialisation policy


_C = ViTConfig
# The flags ResNet's resnet_main.py also has, with big_vision's values as defaults.
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
            "label_smoothing",
            "log_step_count_steps",
            "save_checkpoints_steps",
        )
    ),
    {
        "train_batch_size": _C.train_batch_size,
        "steps_per_eval": 2500,  # the config's evals' log_steps
        "iterations_per_loop": 250,
        "label_smoothing": _C.label_smoothing,
    },
)
VIT_FLAGS = (
    flagspec.Str(
        "model_name",
        _C.model_name,
        f"The network: one of {', '.join(vit.VIT_VARIANTS)} (big_vision's S/16, B/16, L/16); "
        f"estimax adds {vit.TINY_NAME} (small, for tests).",
    ),
    flagspec.Int(
        "train_steps",
        _C.train_steps,
        "Number of training steps (global, absolute; 112603 is 90 epochs at batch 1024); the "
        "cosine schedule ends here.",
        lower=1,
    ),
    flagspec.Int(
        "input_image_size",
        None,
        "Side of the square images the network sees (default: the variant's, 224; 32 for "
        "vit-tiny). Must be a multiple of the patch size.",
        lower=1,
    ),
    flagspec.Int(
        "num_parallel_calls",
        64,
        "Parallel JPEG decode/preprocess/augment workers (at most the CPU count).",
        lower=1,
    ),
    flagspec.Float(
        "base_learning_rate",
        _C.base_learning_rate,
        "Peak learning rate of Adam's update (big_vision's config.lr; not scaled with the batch).",
        lower=0.0,
    ),
    flagspec.Float(
        "weight_decay",
        _C.weight_decay,
        "Decoupled weight decay on every kernel, following the schedule but not the learning "
        "rate (big_vision's config.wd).",
        lower=0.0,
    ),
    flagspec.Int(
        "warmup_steps",
        _C.warmup_steps,
        "Steps of linear warm-up from 0 before the cosine decay.",
        lower=0,
    ),
    flagspec.Float("adam_beta1", _C.adam_beta1, "Adam's beta1.", lower=0.0, upper=1.0),
    flagspec.Float("adam_beta2", _C.adam_beta2, "Adam's beta2.", lower=0.0, upper=1.0),
    flagspec.Float("adam_epsilon", _C.adam_epsilon, "Adam's epsilon.", lower=0.0),
    flagspec.Enum(
        "mu_dtype",
        _C.mu_dtype,
        list(MU_DTYPES),
        "Dtype of Adam's first moment (big_vision's optax mu_dtype); the second stays float32.",
    ),
    flagspec.Float(
        "grad_clip_norm",
        _C.grad_clip_norm,
        "Clip the gradients to this global norm before Adam; 0: no clipping.",
        lower=0.0,
    ),
    flagspec.Enum(
        "loss",
        _C.loss,
        LOSSES,
        "softmax: softmax cross-entropy (big_vision's softmax_xent); sigmoid: the sum over "
        "classes of the binary cross-entropies (sigmoid_xent).",
    ),
    flagspec.Enum(
        "augment",
        "randaugment",
        AUGMENTS,
        "Training augmentation after the random crop and flip: randaugment (big_vision's "
        "randaug(N, M)) or none.",
    ),
    flagspec.Int("randaug_num_layers", 2, "RandAugment's N: ops applied to each image.", lower=0),
    flagspec.Float(
        "randaug_magnitude",
        10.0,
        "RandAugment's M: the ops' shared magnitude, 0..10.",
        lower=0.0,
        upper=10.0,
    ),
    flagspec.Float(
        "mixup_alpha",
        0.2,
        "Mixup of each training batch with a Beta(alpha, alpha) ratio (big_vision's mixup.p); "
        "0: no mixup.",
        lower=0.0,
    ),
    flagspec.Float(
        "dropout_rate",
        _C.dropout_rate,
        "Dropout in the transformer (0 in big_vision's ImageNet configs).",
        lower=0.0,
        upper=0.99,
    ),
    flagspec.Str(
        "pool_type",
        None,
        "Override the variant's pooling: gap (mean of the tokens) or tok (class token).",
    ),
    flagspec.Str(
        "posemb",
        None,
        "Override the variant's position embeddings: learn or sincos2d.",
    ),
    flagspec.Int(
        "representation_size",
        None,
        "Override the variant's pre_logits layer: its size, or 0 for none.",
        lower=0,
    ),
)


def define_flags(fv: flags.FlagValues) -> None:
    """Defines the ViT program's flags on ``fv``."""
    shared_flags.define_tpu_flags(fv, master=False)
    flagspec.define(
        fv,
        shared_flags.run_flags(
            data_dir_default="fake",
            steps_per_eval_flag="steps_per_eval",
            precision_default=_C.precision,
            data_dir_help=(
                "Directory of the ImageNet TFRecords (train-*, validation-*), local, gs:// or "
                "s3://; 'fake' (the default, with a warning) for random images, 'null' for "
                "all-zero ones."
            ),
        ),
        FROM_RESNET,
        VIT_FLAGS,
    )


def build_model(cfg: ViTConfig) -> nn.Module:
    """The network of ``cfg``: the named variant with its overrides, computing in ``precision``.

    Raises:
      ValueError: an unknown ``model_name``, ``pool_type`` or ``posemb``.
    """
    if cfg.model_name not in MODEL_NAMES:
        raise ValueError(
            f"--model_name={cfg.model_name!r}: must be one of {', '.join(MODEL_NAMES)}."
        )
    constructor, _ = MODEL_NAMES[cfg.model_name]
    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("pool_type", cfg.pool_type),
            ("posemb", cfg.posemb),
            ("rep_size", cfg.representation_size),
        )
        if value is not None
    }
    return constructor(
        num_classes=cfg.num_label_classes,
        dropout=cfg.dropout_rate,
        dtype=jnp.bfloat16 if cfg.precision == "bfloat16" else jnp.float32,
        remat=cfg.remat,
        **overrides,
    )


def warmup_cosine(total_steps: int, warmup_steps: int) -> optax.Schedule:
    """big_vision's ``create_learning_rate_schedule(decay_type='cosine', warmup_steps=...)`` with
    base 1: ``0.5 * (1 + cos(pi * progress)) * min(1, step / warmup)``, ``progress`` the clipped
    ``(step - warmup) / (total - warmup)``."""

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        progress = (step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        lr = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.clip(progress, 0.0, 1.0)))
        if warmup_steps:
            lr = lr * jnp.minimum(1.0, step / warmup_steps)
        return jnp.asarray(lr, jnp.float32)

    return schedule


def _kernels(params: Any) -> Any:
    """True at every ``kernel`` (big_vision's default ``wd_mults``: ``.*/kernel$``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params
    )


def make_optimizer(cfg: ViTConfig, multiplier: optax.Schedule) -> optax.GradientTransformation:
    """big_vision's ``optax.make`` for this config: clip, Adam (``mu_dtype``), ``* lr``, ``+ wd *
    kernel``, ``* schedule``, ``* -1``."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm) if cfg.grad_clip_norm else optax.identity(),
        optax.scale_by_adam(
            b1=cfg.adam_beta1,
            b2=cfg.adam_beta2,
            eps=cfg.adam_epsilon,
            mu_dtype=MU_DTYPES[cfg.mu_dtype],
        ),
        optax.scale(cfg.base_learning_rate),
        optax.add_decayed_weights(cfg.weight_decay, _kernels)
        if cfg.weight_decay
        else optax.identity(),
        optax.scale_by_schedule(multiplier),
        optax.scale(-1.0),
    )


def loss_fn(cfg: ViTConfig, logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example ``--loss`` of ``logits`` against integer labels or [B, C] targets."""
    if cfg.loss == "softmax":
        return ex.losses.softmax_cross_entropy(logits, labels, label_smoothing=cfg.label_smoothing)
    logits = jnp.asarray(logits, jnp.float32)
    labels = jnp.asarray(labels)
    if labels.ndim == 1:
        targets = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    else:
        targets = labels.astype(jnp.float32)
    if cfg.label_smoothing:
        targets = optax.smooth_labels(targets, cfg.label_smoothing)
    # big_vision's sigmoid_xent: -sum(t * log p + (1 - t) * log(1 - p)) over the classes.
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1)


def to_unit_range(images: Any, dtype: Any) -> jax.Array:
    """big_vision's ``value_range(-1, 1)`` of [0, 255] images: ``x / 127.5 - 1``."""
    return (jnp.asarray(images, jnp.float32) / 127.5 - 1.0).astype(dtype)


def make_model_fn(cfg: ViTConfig):
    """Returns ``model_fn(features, labels, mode, params)``: big_vision's classification step."""
    multiplier = warmup_cosine(cfg.train_steps, cfg.warmup_steps)
    # The Estimator clips (EstimatorSpec.gradient_clip_norm, the same optax clip): under FSDP
    # its norm is over the whole gradients, where optax's in the chain would see one
    # replica's slice of each split leaf (and could not even be compiled).
    optimizer = make_optimizer(dataclasses.replace(cfg, grad_clip_norm=0.0), multiplier)

    def model_fn(features, labels, mode, params):
        """features: [B, S, S, 3] uint8/float in [0, 255]; labels: [B] int or [B, C] targets."""
        del params
        if isinstance(features, dict):
            features = features["feature"]
        model = build_model(cfg)
        logits = model(to_unit_range(features, model.dtype), train=mode == ex.ModeKeys.TRAIN)
        predictions = classifier.classify(logits)
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(
                mode=mode, predictions=predictions, export_outputs={"classify": predictions}
            )
        step = ex.get_global_step()
        scalars = None
        if cfg.write_scalars:
            scalars = {
                "learning_rate": cfg.base_learning_rate * multiplier(step),
                "current_epoch": schedules.current_epoch(
                    step, cfg.train_batch_size, cfg.num_train_images
                ),
            }
        # Mixed training labels are [B, C] targets; accuracy needs class ids (eval's).
        eval_metrics = None
        if jnp.ndim(labels) == 1:
            eval_metrics = {
                "top_1_accuracy": ex.metrics.accuracy(labels, logits),
                "top_5_accuracy": ex.metrics.top_k_accuracy(labels, logits, k=5),
            }
        return ex.EstimatorSpec(
            mode=mode,
            loss=loss_fn(cfg, logits, labels),
            optimizer=optimizer,
            gradient_clip_norm=cfg.grad_clip_norm or None,
            eval_metrics=eval_metrics,
            predictions=predictions,
            scalars=scalars,
        )

    return model_fn


def _check_override(fv: flags.FlagValues, name: str, values: tuple[str, ...]) -> str | None:
    value = fv[name].value
    if value is not None and value not in values:
        raise cli.UsageError(f"--{name}={value!r}: must be one of {', '.join(values)}.")
    return value


def config_from_flags(fv: flags.FlagValues) -> ViTConfig:
    """The model and recipe the flags ask for.

    Raises:
      UsageError: an unknown ``--model_name``, ``--pool_type`` or ``--posemb`` (the message lists
        the known ones), or an image size the patches do not divide.
    """
    if fv.model_name not in MODEL_NAMES:
        raise cli.UsageError(
            f"--model_name={fv.model_name!r} is not a ViT: use one of {', '.join(MODEL_NAMES)}."
        )
    size, patch = image_size(fv), vit.patch_size(fv.model_name)
    if size % patch:
        raise cli.UsageError(
            f"--input_image_size={size}: {fv.model_name}'s {patch}x{patch} patches need a "
            f"multiple of {patch}."
        )
    return ViTConfig(
        model_name=fv.model_name,
        train_batch_size=fv.train_batch_size,
        train_steps=fv.train_steps,
        num_train_images=fv.num_train_images,
        write_scalars=not fv.skip_host_call,
        num_label_classes=fv.num_label_classes,
        precision=fv.precision,
        base_learning_rate=fv.base_learning_rate,
        weight_decay=fv.weight_decay,
        warmup_steps=fv.warmup_steps,
        adam_beta1=fv.adam_beta1,
        adam_beta2=fv.adam_beta2,
        adam_epsilon=fv.adam_epsilon,
        mu_dtype=fv.mu_dtype,
        grad_clip_norm=fv.grad_clip_norm,
        label_smoothing=fv.label_smoothing,
        loss=fv.loss,
        dropout_rate=fv.dropout_rate,
        pool_type=_check_override(fv, "pool_type", ("gap", "tok")),
        posemb=_check_override(fv, "posemb", ("learn", "sincos2d")),
        representation_size=fv.representation_size,
        remat=fv.remat,
    )


def image_size(fv: flags.FlagValues) -> int:
    """``--input_image_size``, else the resolution of ``--model_name``'s variant."""
    return fv.input_image_size or MODEL_NAMES[fv.model_name][1]


def serving_preprocessing(fv: flags.FlagValues) -> export.Preprocessing:
    """The eval preprocessing an export declares: a centre crop of ``size / (size + 32)`` of the
    short side (224/256: big_vision's ``resize_small(256)|central_crop(224)`` region), bicubic
    resize, uint8 (scaled to [-1, 1] on the device)."""
    return export.image_preprocessing(
        image_size(fv),
        crop="center",
        crop_padding=preprocessing.CROP_PADDING,
        resize="bicubic",
        dtype="uint8",
    )


def augmentation(fv: flags.FlagValues) -> augment.RandAugment | None:
    """The per-image training augmentation of ``--augment``."""
    if fv.augment == "none":
        return None
    return augment.RandAugment(fv.randaug_num_layers, fv.randaug_magnitude)


def make_inputs(fv: flags.FlagValues) -> tuple[Any, str | None, list[str]]:
    """``(input_fn(is_training=...), data_dir, notes)`` of ``--data_dir``: ResNet's random crop
    and flip (big_vision's decode_jpeg_and_inception_crop|flip_lr, with the original's area
    range 0.08..1), then RandAugment on the uint8 crop and mixup on the batch."""
    return inputs.imagenet_inputs(
        fv, image_size(fv), augment=augmentation(fv), mixup_alpha=fv.mixup_alpha
    )


def run_from_flags(fv: flags.FlagValues) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> the mode loop. Returns the last eval results, if any."""
    return common.run_resnet_style_family(fv, FAMILY, make_inputs, image_size)


FAMILY = Family(
    name="vit",
    doc=__doc__,
    define_flags=define_flags,
    config_from_flags=config_from_flags,
    make_model_fn=make_model_fn,
    model_flags=(
        "model_name",
        "num_label_classes",
        "input_image_size",
        "pool_type",
        "posemb",
        "representation_size",
    ),
    input_spec=lambda fv: ex.TensorSpec((None, image_size(fv), image_size(fv), 3), np.uint8),
    serving_preprocessing=serving_preprocessing,
    run_from_flags=run_from_flags,
    metrics=METRICS,
)


def run() -> None:
    """Entry point (``python -m estimax.programs.vit``)."""
    FAMILY.main()


if __name__ == "__main__":
    run()
