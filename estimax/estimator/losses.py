"""Losses that return per-example values, so the Estimator can average them exactly."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


# Label checks recorded by the losses while a step is traced (see ``label_checks``): integer
# labels outside [0, C) would get an all-zero one-hot and a zero loss, so a wrong label range
# (the converter's 1-based labels fed to C logits) "trains" silently. The counts are computed
# on the device with the step and checked by the host once per loop: no sync per step.
class LabelCheck(NamedTuple):
    """One loss's label check, recorded while a step is traced.

    Attributes:
      num_invalid: int32, the labels outside ``[0, num_classes)``.
      example: int32, the largest such label (int32 min when there is none).
      num_classes: the loss's class count.
      labels: int32, the labels checked (``[B]`` or ``[B, ...]``): evaluation finds the rows
        to count, and with the opt-in to leave out of its loss and metrics, from them.
    """

    num_invalid: jax.Array
    example: jax.Array
    num_classes: int
    labels: jax.Array


_LABEL_CHECKS: contextvars.ContextVar[list[LabelCheck] | None] = contextvars.ContextVar(
    "estimax_label_checks", default=None
)


@contextlib.contextmanager
def label_checks() -> Iterator[list[LabelCheck]]:
    """Collects, while a step is traced, each loss's :class:`LabelCheck`."""
    checks: list[LabelCheck] = []
    token = _LABEL_CHECKS.set(checks)
    try:
        yield checks
    finally:
        _LABEL_CHECKS.reset(token)


def _record_label_check(labels: jax.Array, num_classes: int) -> None:
    checks = _LABEL_CHECKS.get()
    if checks is None:
        return
    labels = labels.astype(jnp.int32)
    invalid = (labels < 0) | (labels >= num_classes)
    example = jnp.max(jnp.where(invalid, labels, jnp.iinfo(jnp.int32).min))  # the largest
    checks.append(LabelCheck(jnp.sum(invalid.astype(jnp.int32)), example, num_classes, labels))


def softmax_cross_entropy(
    logits: jax.Array, labels: jax.Array, *, label_smoothing: float = 0.0
) -> jax.Array:
    """Softmax cross-entropy per example (``tf.losses.softmax_cross_entropy`` without the mean).

    Args:
      logits: [B, C] unnormalised scores (computed in any dtype; the loss is float32).
      labels: [B] integer class ids in ``[0, C)``, or [B, C] one-hot (or probability) targets,
        the original's ``onehot_labels``.
      label_smoothing: as the original: targets become ``(1 - s) * one_hot + s / C``.

    Returns:
      [B] float32 losses. Return them as ``EstimatorSpec.loss``; the Estimator takes the mean,
      and in evaluation leaves padding rows out of it.

    Raises:
      ValueError: the labels' shape fits neither form (the message names both shapes).
    """
    logits = jnp.asarray(logits, jnp.float32)
    labels = jnp.asarray(labels)
    num_classes = logits.shape[-1]
    if labels.shape == logits.shape:
        targets = labels.astype(jnp.float32)  # one-hot / probabilities, as onehot_labels
    elif labels.shape == logits.shape[:-1] and jnp.issubdtype(labels.dtype, jnp.integer):
        _record_label_check(labels, num_classes)
        targets = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
    else:
        raise ValueError(
            f"softmax_cross_entropy: labels of shape {labels.shape} ({labels.dtype}) do not fit "
            f"logits of shape {logits.shape}: give integer class ids of shape "
            f"{logits.shape[:-1]} or one-hot labels of shape {logits.shape}"
        )
    if label_smoothing:
        targets = optax.smooth_labels(targets, label_smoothing)
    return optax.softmax_cross_entropy(logits, targets)
