"""Streaming evaluation metrics that take a mask, so padded rows never count.

A metric function called inside ``model_fn`` returns an unreduced per-example metric. The
Estimator reduces it under the batch's padding mask into sums (a ``Mean``'s total and count,
or ``Counts``: a confusion matrix, a histogram of scores), sums those across replicas and
batches inside ``jit``, and computes the value once at the end, on the host: every real
example counts exactly once, whatever the batch and device count (the CLU ``metrics.py``
pattern).

| metric (``tf.metrics`` name)              | summed state                 | value              |
|-------------------------------------------|------------------------------|--------------------|
| ``accuracy``, ``top_k_accuracy``, ``mean``| ``Mean`` (total, count)      | their ratio        |
| ``precision``, ``recall``, ``f1_score``,  | ``Counts``: the confusion    | from its cells     |
| ``mean_per_class_accuracy``, ``mean_iou``,| matrix ``[C, C]`` (rows:     | (float64)          |
| ``confusion_matrix``                      | label, columns: prediction)  |                    |
| ``auc`` (ROC, PR)                         | ``Counts``: negatives and    | from the threshold |
|                                           | positives per score bucket   | counts             |

Why not a library: ``clu.metrics`` has none of the confusion-matrix or AUC metrics, and
``metrax`` (google-metrax 0.2.4) has precision, recall and AUC but no confusion matrix, mean IoU
or mean per-class accuracy; its ``Precision``/``Recall`` take no weights (the padding of the last
batch could not be masked out) and its AUC states carry ``num_thresholds`` as a summed array
leaf (summing over replicas changes it). Everything here is a sum of counts, which the masked
pytrees above already stream and sum exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


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


def _as_class_ids(labels: jax.Array, predictions: jax.Array, what: str = "accuracy") -> jax.Array:
    """Predicted class ids: the argmax of logits/probabilities ``[..., C]``, or ids as given."""
    if (
        labels.ndim >= 2
        and labels.shape == predictions.shape
        and not jnp.issubdtype(labels.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{what}: labels of shape {labels.shape} look one-hot; pass class ids "
            f"(labels.argmax(-1)), as tf.metrics.{what} took"
        )
    if predictions.ndim == labels.ndim + 1:  # logits or probabilities: take the argmax class
        return jnp.argmax(predictions, axis=-1)
    if predictions.shape != labels.shape:
        raise ValueError(
            f"{what}: predictions of shape {predictions.shape} match neither labels "
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


def as_per_example(metric: Any, name: str) -> Any:
    """Checks that ``metric`` is a metric object, with an error naming the offending entry."""
    if isinstance(metric, PerExample | ClassPairs | ScoreBuckets):
        return metric
    raise TypeError(
        f"eval_metrics[{name!r}] is a {type(metric).__name__}; expected a metric from "
        "estimax.metrics (accuracy, top_k_accuracy, mean, precision, recall, f1_score, auc, "
        "mean_per_class_accuracy, mean_iou, confusion_matrix)."
    )


def from_spec(eval_metrics: Any) -> dict[str, Any]:
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


# --- Metrics of counts: the confusion matrix and the AUC's score buckets -------------------------


@flax.struct.dataclass
class Counts:
    """A reduced metric made of counts (weights summed over batches and replicas).

    ``statistic`` names what ``compute`` derives from them (a static field: the same for
    every batch, so sums keep the tree's structure); ``options`` its settings.
    """

    counts: jax.Array
    statistic: str = flax.struct.field(pytree_node=False)
    options: tuple = flax.struct.field(pytree_node=False, default=())

    def compute(self) -> Any:
        """The metric's value on the host, in float64 (a matrix for ``confusion_matrix``)."""
        return _STATISTICS[self.statistic](np.asarray(self.counts, np.float64), *self.options)


def _weights_like(labels: jax.Array, weights: jax.Array | None, mask: jax.Array) -> jax.Array:
    """Per-element weights ``labels.shape``: the row's mask (and weight) on all its elements."""
    shape = labels.shape
    w = jnp.broadcast_to(mask.reshape((shape[0],) + (1,) * (len(shape) - 1)), shape)
    w = w.astype(jnp.float32)
    if weights is not None:
        weights = jnp.asarray(weights, jnp.float32)
        if weights.ndim == 1 and len(shape) > 1:
            weights = weights.reshape((shape[0],) + (1,) * (len(shape) - 1))
        w = w * jnp.broadcast_to(weights, shape)
    return w


@flax.struct.dataclass
class ClassPairs:
    """Per-element (label, predicted class) pairs not yet counted into a confusion matrix."""

    labels: jax.Array
    predicted: jax.Array
    weights: jax.Array | None
    num_classes: int = flax.struct.field(pytree_node=False)
    statistic: str = flax.struct.field(pytree_node=False)
    options: tuple = flax.struct.field(pytree_node=False, default=())

    def reduce(self, mask: jax.Array) -> Counts:
        """The confusion matrix ``[C, C]`` of the rows where ``mask`` is set.

        Labels or predictions outside ``[0, C)`` are not counted (as scikit-learn's
        ``confusion_matrix(labels=range(C))``).
        """
        labels = jnp.asarray(self.labels, jnp.int32)
        predicted = jnp.asarray(self.predicted, jnp.int32)
        w = _weights_like(labels, self.weights, mask)
        c = self.num_classes
        valid = (labels >= 0) & (labels < c) & (predicted >= 0) & (predicted < c)
        cells = jnp.where(valid, labels * c + predicted, 0).reshape(-1)
        counts = jnp.zeros((c * c,), jnp.float32).at[cells].add(jnp.where(valid, w, 0).reshape(-1))
        return Counts(counts.reshape(c, c), self.statistic, self.options)


def auc_thresholds(num_thresholds: int) -> np.ndarray:
    """The thresholds of ``auc`` (``tf.metrics.auc``'s): ``-eps``, ``i / (n - 1)``, ``1 + eps``."""
    if num_thresholds < 2:
        raise ValueError(f"auc: num_thresholds must be >= 2, got {num_thresholds}.")
    eps = 1e-7
    inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
    return np.asarray([-eps, *inner, 1.0 + eps], np.float32)


@flax.struct.dataclass
class ScoreBuckets:
    """Per-example binary labels and scores not yet counted into threshold buckets."""

    curve: str = flax.struct.field(pytree_node=False)
    num_thresholds: int = flax.struct.field(pytree_node=False)
    scores: jax.Array
    labels: jax.Array
    weights: jax.Array | None

    def reduce(self, mask: jax.Array) -> Counts:
        """``[2, n + 1]``: the weight of negatives (row 0) and positives (row 1) by how many
        thresholds their score exceeds, over the rows where ``mask`` is set."""
        labels = jnp.asarray(self.labels).astype(bool)
        w = _weights_like(labels, self.weights, mask).reshape(-1)
        scores = jnp.clip(jnp.asarray(self.scores, jnp.float32), 0.0, 1.0).reshape(-1)
        thresholds = jnp.asarray(auc_thresholds(self.num_thresholds))
        bucket = jnp.searchsorted(thresholds, scores, side="left")  # thresholds < score
        index = labels.reshape(-1).astype(jnp.int32) * (self.num_thresholds + 1) + bucket
        counts = jnp.zeros((2 * (self.num_thresholds + 1),), jnp.float32).at[index].add(w)
        return Counts(counts.reshape(2, -1), "auc", (self.curve,))


def _pairs(
    labels: Any,
    predictions: Any,
    weights: Any,
    num_classes: int | None,
    statistic: str,
    options: tuple = (),
) -> ClassPairs:
    labels, predictions = jnp.asarray(labels), jnp.asarray(predictions)
    if predictions.ndim == labels.ndim + 1:
        if num_classes is not None and num_classes != predictions.shape[-1]:
            raise ValueError(
                f"{statistic}: num_classes={num_classes} but the predictions have "
                f"{predictions.shape[-1]} classes."
            )
        num_classes = predictions.shape[-1]
    if num_classes is None:
        if predictions.dtype != jnp.bool_ and labels.dtype != jnp.bool_:
            raise ValueError(
                f"{statistic}: give num_classes= for class-id predictions (or pass logits "
                "[B, C], or boolean labels and predictions for a binary metric)."
            )
        num_classes = 2
    ids = _as_class_ids(labels, predictions, statistic).astype(jnp.int32)
    return ClassPairs(labels.astype(jnp.int32), ids, weights, int(num_classes), statistic, options)


def _positive_class(class_id: int | None, num_classes: int, what: str) -> int | None:
    """The class a binary statistic is of: ``class_id``; class 1 of two; None: the mean."""
    if class_id is not None and not 0 <= class_id < num_classes:
        raise ValueError(f"{what}: class_id={class_id} is not in [0, {num_classes}).")
    if class_id is None and num_classes == 2:
        return 1
    return class_id


def _class_statistic(statistic: str, doc: str) -> Callable[..., ClassPairs]:
    """A metric of the confusion matrix that is of one class, or the mean over classes."""

    def metric(
        labels: Any,
        predictions: Any,
        weights: Any = None,
        *,
        num_classes: int | None = None,
        class_id: int | None = None,
    ) -> ClassPairs:
        pairs = _pairs(labels, predictions, weights, num_classes, statistic)
        positive = _positive_class(class_id, pairs.num_classes, statistic)
        return dataclasses.replace(pairs, options=(positive,))

    metric.__name__ = metric.__qualname__ = statistic
    metric.__doc__ = doc
    return metric


def _matrix_statistic(statistic: str, doc: str) -> Callable[..., ClassPairs]:
    """A metric of the whole confusion matrix."""

    def metric(
        labels: Any, predictions: Any, num_classes: int | None = None, weights: Any = None
    ) -> ClassPairs:
        return _pairs(labels, predictions, weights, num_classes, statistic)

    metric.__name__ = metric.__qualname__ = statistic
    metric.__doc__ = doc
    return metric


precision = _class_statistic(
    "precision",
    """Precision ``tp / (tp + fp)`` (``tf.metrics.precision``), exact over the eval set.

    ``precision(labels, predictions, weights=None, *, num_classes=None, class_id=None)``.
    Binary (two classes, or boolean labels and predictions): of class 1, or ``class_id``.
    More classes: of ``class_id`` against the rest, else the mean over classes (scikit-learn's
    ``average="macro"``). 0 where nothing was predicted as the class.

    Args:
      labels: [B, ...] class ids (or booleans).
      predictions: [B, ...] class ids (or booleans), or [B, ..., C] logits/probabilities.
      weights: optional [B] or [B, ...] weights.
      num_classes: needed for class-id predictions with more than two classes.
      class_id: the class to report.
    """,
)
recall = _class_statistic(
    "recall",
    """Recall ``tp / (tp + fn)`` (``tf.metrics.recall``); the arguments as ``precision``'s.""",
)
f1_score = _class_statistic(
    "f1_score",
    """F1, the harmonic mean of precision and recall (``tf.contrib.metrics.f1_score`` at the
    predicted classes); the arguments as ``precision``'s (the mean over classes: of each
    class's F1, as scikit-learn's ``average="macro"``).""",
)
mean_per_class_accuracy = _matrix_statistic(
    "mean_per_class_accuracy",
    """The mean over classes of each class's accuracy (its recall): the original's
    ``tf.metrics.mean_per_class_accuracy(labels, predictions, num_classes, weights)``,
    scikit-learn's ``balanced_accuracy_score``. Classes without any example are left out.""",
)
mean_iou = _matrix_statistic(
    "mean_iou",
    """The mean over classes of ``tp / (tp + fp + fn)`` (``tf.metrics.mean_iou(labels,
    predictions, num_classes, weights)``), for classification or segmentation (``[B, H, W]``
    labels); classes in neither labels nor predictions are left out, as the original did.""",
)
confusion_matrix = _matrix_statistic(
    "confusion_matrix",
    """The confusion matrix ``[C, C]`` (rows: labels, columns: predictions), as
    ``tf.math.confusion_matrix(labels, predictions, num_classes, weights)``: an array in the
    evaluation results, a table in TensorBoard.""",
)


def auc(
    labels: Any,
    predictions: Any,
    weights: Any = None,
    num_thresholds: int = 200,
    curve: str = "ROC",
) -> ScoreBuckets:
    """The area under the ROC or precision-recall curve (``tf.metrics.auc``), binary.

    Streamed with ``num_thresholds`` thresholds (the original's 200 by default: ``-eps``,
    ``i / (n - 1)``, ``1 + eps``): exact for the scores bucketed by them, i.e. what
    scikit-learn computes on ``np.searchsorted(auc_thresholds(n), scores)``; more thresholds
    approach scikit-learn on the raw scores (its exact AUC keeps every score), at
    ``O(num_thresholds)`` memory. ROC: the trapezoidal area (``roc_auc_score``). PR: the
    average precision, ``sum (R_i - R_i+1) P_i`` (``average_precision_score``; the original's
    trapezoidal PR area is known to overestimate). NaN without positives or negatives.

    Args:
      labels: [B] booleans or 0/1 (for a class of a multi-class model: ``labels == k``).
      predictions: [B] probabilities of the positive class in [0, 1] (clipped to it).
      weights: optional [B] weights.
      num_thresholds: how many thresholds.
      curve: ``"ROC"`` or ``"PR"``.
    """
    if curve not in ("ROC", "PR"):
        raise ValueError(f"auc: curve must be 'ROC' or 'PR', got {curve!r}.")
    auc_thresholds(num_thresholds)  # checks it
    labels, predictions = jnp.asarray(labels), jnp.asarray(predictions)
    if predictions.shape != labels.shape:
        raise ValueError(
            f"auc: predictions {predictions.shape} must have the labels' shape {labels.shape} "
            "(the positive class's probability; for class k of logits: "
            "jax.nn.softmax(logits)[:, k] with labels == k)."
        )
    return ScoreBuckets(curve, int(num_thresholds), predictions, labels, weights)


# --- The statistics, from the summed counts (host, float64) -------------------------------------


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a / b``, 0 where ``b`` is 0 (scikit-learn's ``zero_division=0``)."""
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


def _per_class(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(true positives, false positives, false negatives) of each class of a confusion matrix."""
    tp = np.diag(m)
    return tp, m.sum(axis=0) - tp, m.sum(axis=1) - tp


def _of_class(values: np.ndarray, positive: int | None) -> float:
    return float(values[positive] if positive is not None else values.mean())


def _precision(m: np.ndarray, positive: int | None) -> float:
    tp, fp, _ = _per_class(m)
    return _of_class(_ratio(tp, tp + fp), positive)


def _recall(m: np.ndarray, positive: int | None) -> float:
    tp, _, fn = _per_class(m)
    return _of_class(_ratio(tp, tp + fn), positive)


def _f1(m: np.ndarray, positive: int | None) -> float:
    tp, fp, fn = _per_class(m)
    return _of_class(_ratio(2 * tp, 2 * tp + fp + fn), positive)


def _mean_per_class_accuracy(m: np.ndarray) -> float:
    tp, _, fn = _per_class(m)
    present = (tp + fn) > 0
    return float((tp[present] / (tp + fn)[present]).mean()) if present.any() else float("nan")


def _mean_iou(m: np.ndarray) -> float:
    tp, fp, fn = _per_class(m)
    union = tp + fp + fn
    present = union > 0
    return float((tp[present] / union[present]).mean()) if present.any() else float("nan")


def _matrix(m: np.ndarray) -> np.ndarray:
    return m.astype(np.int64) if np.array_equal(m, np.round(m)) else m


def _auc(buckets: np.ndarray, curve: str) -> float:
    """The area from ``[2, n + 1]`` bucket weights (``ScoreBuckets.reduce``)."""
    negatives, positives = buckets
    # Above threshold i: the examples whose bucket is > i (cumulative sums from the top).
    tp = np.cumsum(positives[::-1])[::-1][1:]
    fp = np.cumsum(negatives[::-1])[::-1][1:]
    if positives.sum() <= 0 or negatives.sum() <= 0:
        return float("nan")
    tpr, fpr = tp / positives.sum(), fp / negatives.sum()
    if curve == "ROC":
        tpr, fpr = np.append(tpr, 0.0), np.append(fpr, 0.0)  # above every score: (0, 0)
        return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2))
    precision_at = _ratio(tp, tp + fp)
    gained = tpr - np.append(tpr[1:], 0.0)  # the recall each lower threshold adds
    return float(np.sum(gained * precision_at))


_STATISTICS: dict[str, Any] = {
    "precision": _precision,
    "recall": _recall,
    "f1_score": _f1,
    "mean_per_class_accuracy": _mean_per_class_accuracy,
    "mean_iou": _mean_iou,
    "confusion_matrix": _matrix,
    "auc": _auc,
}
