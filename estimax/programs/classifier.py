"""The ImageNet classifier ``model_fn`` that the resnet and efficientnet programs share.

Both originals' ``model_fn`` did the same around their network: subtract MEAN_RGB and divide by
STDDEV_RGB on the device, return ``classes`` and ``probabilities`` in PREDICT, train on softmax
cross-entropy (with label smoothing) plus weight decay on all but batch norm's weights, report
``top_1_accuracy``/``top_5_accuracy``, and write ``learning_rate`` and ``current_epoch`` through
the ``host_call`` unless ``--skip_host_call``. A program states what differs -- the network, the
optimizer and its schedule, the constants, a moving average -- as a ``Recipe``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import estimax as ex
from estimax.data import preprocessing
from estimax.programs import schedules


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What one program's classifier trains with.

    Attributes:
      network: builds the Flax network (called inside ``model_fn``, so its submodules belong to
        the Estimator's module); its ``dtype`` is the compute dtype the images are cast to.
      optimizer: the optax optimizer (it holds ``schedule``).
      schedule: ``step -> learning rate``, for the ``learning_rate`` scalar.
      train_batch_size: global batch size, for the ``current_epoch`` scalar.
      num_train_images: examples per epoch, for the ``current_epoch`` scalar.
      label_smoothing: of the cross-entropy.
      weight_decay: L2 factor on every weight but batch norm's (None: none).
      ema_decay: moving average of the weights used to evaluate and export (None: none).
      write_scalars: write ``learning_rate`` and ``current_epoch`` (the original's host_call).
    """

    network: Callable[[], nn.Module]
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    train_batch_size: int
    num_train_images: int
    label_smoothing: float = 0.0
    weight_decay: float | None = None
    ema_decay: float | None = None
    write_scalars: bool = True


def classify(logits: jax.Array) -> dict[str, jax.Array]:
    """The originals' predictions: ``classes`` [B] int and ``probabilities`` [B, C] (softmax)."""
    return {"classes": jnp.argmax(logits, axis=1), "probabilities": jax.nn.softmax(logits)}


def make_model_fn(recipe: Recipe):
    """Returns ``model_fn(features, labels, mode, params)`` classifying with ``recipe``."""

    def model_fn(features, labels, mode, params):
        """features: [B, S, S, 3] uint8 (or float) in [0, 255]; labels: [B] int32 in [0, C)."""
        del params
        if isinstance(features, dict):
            features = features["feature"]
        model = recipe.network()
        # Normalised on the device, as the originals, so the host ships uint8.
        images = preprocessing.normalize(features, jnp, dtype=model.dtype)
        logits = model(images, train=mode == ex.ModeKeys.TRAIN)  # float32
        predictions = classify(logits)
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(
                mode=mode, predictions=predictions, export_outputs={"classify": predictions}
            )
        step = ex.get_global_step()
        scalars = None
        if recipe.write_scalars:
            scalars = {
                "learning_rate": recipe.schedule(step),
                "current_epoch": schedules.current_epoch(
                    step, recipe.train_batch_size, recipe.num_train_images
                ),
            }
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(
                logits, labels, label_smoothing=recipe.label_smoothing
            ),
            optimizer=recipe.optimizer,
            # The Estimator adds weight_decay * sum(l2_loss(w)) over non-batch-norm weights.
            weight_decay=recipe.weight_decay,
            ema_decay=recipe.ema_decay,
            eval_metrics={
                "top_1_accuracy": ex.metrics.accuracy(labels, logits),
                "top_5_accuracy": ex.metrics.top_k_accuracy(labels, logits, k=5),
            },
            predictions=predictions,
            scalars=scalars,
        )

    return model_fn
