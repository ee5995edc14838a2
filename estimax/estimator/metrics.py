"""Streaming evaluation metrics that take a mask, so padded rows never count.

A metric function called inside ``model_fn`` returns an unreduced per-example metric
(``PerExample``). The Estimator reduces it under the batch's padding mask into a ``Mean``
(total, count), sums those across replicas and batches inside ``jit``, and computes the ratio
once at the end: every real example counts exactly once, whatever the batch and device count
(the CLU ``metrics.py`` pattern).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Mean:
    """A reduced metric: ``total`` of weighted values and the ``count`` of their weights."""

    total: jax.Array
    count: jax.Array

    def compute(self) -> jax.Array:
        """Returns the mean, or NaN when no example was counted."""
        return jnp.where(self.count > 0, self.total / jnp.maximum(self.count, 1e-12), jnp.nan)


@flax.struct.dataclass
class PerExample:
    """Per-example metric values ``[B]`` (and optional weights ``[B]``) not yet reduced."""

    values: jax.Array
    weights: jax.Array | None = None

    def reduce(self, mask: jax.Array) -> Mean:
        """Reduces over the batch, counting only rows where ``mask`` ([B], 1 = real) is set."""
        values = jnp.asarray(self.values, jnp.float32).reshape(mask.shape[0], -1).mean(axis=1)
        weights = mask.astype(jnp.float32)
        if self.weights is not None:
            weights = weights * jnp.asarray(self.weights, jnp.float32).reshape(mask.shape[0])
        return Mean(total=jnp.sum(values * weights), count=jnp.sum(weights))


def _as_class_ids(labels: jax.Array, predictions: jax.Array) -> jax.Array:
    if (
        labels.ndim >= 2
        and labels.shape == predictions.shape
        and not jnp.issubdtype(labels.dtype, jnp.integer)
    ):
        raise ValueError(
            f"accuracy: labels of shape {labels.shape} look one-hot; pass class ids "
            "(labels.argmax(-1)), as tf.metrics.accuracy took"
        )
    if predictions.ndim == labels.ndim + 1:  # logits or probabilities: take the argmax class
        return jnp.argmax(predictions, axis=-1)
    if predictions.shape != labels.shape:
        raise ValueError(
            f"accuracy: predictions of shape {predictions.shape} match neither labels "
            f"{labels.shape} (class ids) nor labels + a class axis (logits)."
        )
    return predictions


def accuracy(
    labels: jax.Array, predictions: jax.Array, weights: jax.Array | None = None
) -> PerExample:
    """Top-1 accuracy (``tf.metrics.accuracy``).

    Args:
      labels: [B] integer class ids.
      predictions: [B] class ids, or [B, C] logits/probabilities (argmax is taken).
      weights: optional [B] per-example weights.
    """
    labels = jnp.asarray(labels)
    ids = _as_class_ids(labels, jnp.asarray(predictions))
    return PerExample((ids == labels).astype(jnp.float32), weights)


def top_k_accuracy(
    labels: jax.Array, logits: jax.Array, k: int = 5, weights: jax.Array | None = None
) -> PerExample:
    """Whether the label is among the ``k`` highest logits (``tf.nn.in_top_k`` + mean).

    Ties are broken as ``in_top_k`` does: a label counts when fewer than ``k`` classes score
    strictly higher than it.

    Args:
      labels: [B] integer class ids.
      logits: [B, C] scores.
      k: how many top classes count as a hit.
      weights: optional [B] per-example weights.
    """
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    label_score = jnp.take_along_axis(logits, labels[:, None].astype(jnp.int32), axis=-1)
    higher = jnp.sum(logits > label_score, axis=-1)
    return PerExample((higher < k).astype(jnp.float32), weights)


def mean(values: jax.Array, weights: jax.Array | None = None) -> PerExample:
    """The mean of per-example ``values`` ([B] or [B, ...], averaged per example first)."""
    return PerExample(jnp.asarray(values), weights)


def as_per_example(metric: Any, name: str) -> PerExample:
    """Checks that ``metric`` is a metric object, with an error naming the offending entry."""
    if isinstance(metric, PerExample):
        return metric
    raise TypeError(
        f"eval_metrics[{name!r}] is a {type(metric).__name__}; expected a metric from "
        "estimax.metrics (accuracy, top_k_accuracy, mean)."
    )


def from_spec(eval_metrics: Any) -> dict[str, PerExample]:
    """``{name: metric}`` from ``EstimatorSpec.eval_metrics``.

    Takes a dict of metrics, or TPUEstimatorSpec's ``(metric_fn, tensors)``: ``metric_fn`` is
    called (in the traced eval step) with ``tensors`` (a list: positionally; a dict: by name) and
    returns the dict, e.g. ``lambda labels, logits: {"accuracy": accuracy(labels, logits)}``.
    """
    if eval_metrics is None:
        return {}
    if isinstance(eval_metrics, tuple | list):
        if len(eval_metrics) != 2 or not callable(eval_metrics[0]):
            raise TypeError(
                "eval_metrics as a tuple must be (metric_fn, tensors), as TPUEstimatorSpec's; "
                f"got a {type(eval_metrics).__name__} of {len(eval_metrics)} items"
            )
        metric_fn, tensors = eval_metrics
        if isinstance(tensors, Mapping):
            eval_metrics = metric_fn(**tensors)
        else:
            eval_metrics = metric_fn(*tensors)
        if not isinstance(eval_metrics, Mapping):
            raise TypeError(
                f"eval_metrics=(metric_fn, tensors): metric_fn returned a "
                f"{type(eval_metrics).__name__}; it must return {{name: metric}}, e.g. "
                '{"accuracy": estimax.metrics.accuracy(labels, logits)}'
            )
    if not isinstance(eval_metrics, Mapping):
        raise TypeError(
            "eval_metrics must be {name: metric} or (metric_fn, tensors), got a "
            f"{type(eval_metrics).__name__}"
        )
    return {name: as_per_example(metric, name) for name, metric in eval_metrics.items()}
