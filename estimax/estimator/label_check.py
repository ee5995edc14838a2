"""Integer labels outside ``[0, num_classes)``: caught once per loop, never silently trained on
or evaluated as a loss of 0.

``losses.softmax_cross_entropy`` counts such labels on the device with each step (see
``losses.label_checks``); the training loop hands each loop's per-step counts to
:class:`InvalidLabelCheck` at the host sync, so checking costs no host sync per step. TensorFlow
raised ``Received a label value of 3 which is outside the valid range of [0, 3)``; without a
check, the label's one-hot row is all zeros, its loss is 0, and training "converges".

Evaluation counts them on the device too, summed with the metrics over the batches
(``steps.EvalOutput``); :class:`EvalLabelCheck` reads the running count every
``iterations_per_loop`` batches and at the end. With ``RunConfig(allow_invalid_labels=True)``
those examples are left out of the eval loss and metrics and counted (``invalid_labels`` in the
results, ``eval/invalid_labels`` in TensorBoard); an understated eval loss is what early
stopping and best-model exports would otherwise act on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from absl import logging

__all__ = ["EvalLabelCheck", "InvalidLabelError", "InvalidLabelCheck"]


class InvalidLabelError(ValueError):
    """A training or evaluation batch had integer labels outside ``[0, num_classes)``."""


def _hint(num_classes: int) -> str:
    """What valid labels are, and the two usual reasons they are not."""
    return (
        f"labels must be class ids 0..{num_classes - 1}. Likely causes: estimax-convert writes "
        "the original's 1-based labels (subtract 1 in the input_fn), or a class folder without "
        "images (or in one split only) was given a label, so the data has more classes than the "
        "model (the converter's summary and manifest.json list every class with its count)"
    )


class InvalidLabelCheck:
    """Reads a loop's label-check signals; raises, or counts and warns.

    Args:
      checkpointer: its ``intact()`` (the latest checkpoint) is named in the error.
      summaries: writes ``train/invalid_labels`` (the running count), or None.
      allow: ``RunConfig(allow_invalid_labels=True)``: count and warn instead of stopping.
    """

    def __init__(self, checkpointer: Any, summaries: Any, allow: bool):
        self._checkpointer = checkpointer
        self._summaries = summaries
        self._allow = allow
        self.count = 0

    def after_loop(self, loop: Any) -> None:
        """``loop``: has ``begin``, ``end`` and ``signals`` (``steps.Signals`` of ``[steps]``
        host arrays)."""
        signals = loop.signals
        counts = signals.invalid_labels
        examples, classes = signals.invalid_label_example, signals.label_classes
        if counts is None:
            return
        counts = np.asarray(counts).reshape(-1)
        bad = np.flatnonzero(counts > 0)
        if not bad.size:
            return
        first = int(bad[0])
        label = int(np.asarray(examples).reshape(-1)[first])
        num_classes = int(np.asarray(classes).reshape(-1)[first])
        self.count += int(counts.sum())
        if self._summaries is not None:
            self._summaries.scalars(loop.end, {"train/invalid_labels": self.count})
        where = (
            f"label value {label} is outside the valid range [0, {num_classes}) at step "
            f"{loop.begin + first + 1} ({int(counts.sum())} such label(s) in steps "
            f"{loop.begin + 1}..{loop.end})"
        )
        if self._allow:
            logging.warning(
                "Training on an invalid %s; their loss is 0 (allow_invalid_labels). %d so far.",
                where,
                self.count,
            )
            return
        raise InvalidLabelError(
            f"Received a {where}: {_hint(num_classes)}. "
            f"Nothing from that loop was saved; {self._checkpointer.intact()}. "
            "RunConfig(allow_invalid_labels=True) trains on them instead."
        )


class EvalLabelCheck:
    """Reads an evaluation's running label check; raises, or counts and leaves them out.

    Args:
      allow: ``RunConfig(allow_invalid_labels=True)``: such examples were left out of the loss
        and metrics (``steps.eval_step(exclude_invalid_labels=True)``); count and warn instead of
        stopping.
    """

    def __init__(self, allow: bool):
        self._allow = allow

    def check(self, signals: Any, batches: int, final: bool = False) -> int | None:
        """``signals``: the merged ``steps.Signals`` of the first ``batches`` batches, on the
        host (three scalars). Returns the count (None: no loss took integer labels).

        Raises:
          InvalidLabelError: there are such labels and ``allow`` is not set.
        """
        if signals.invalid_labels is None:
            return None
        count = int(np.asarray(signals.invalid_labels))
        if count == 0 or (self._allow and not final):
            return count
        label = int(np.asarray(signals.invalid_label_example))
        num_classes = int(np.asarray(signals.label_classes))
        where = (
            f"label value {label} outside the valid range [0, {num_classes}) in evaluation "
            f"({count} example(s) with such labels in the first {batches} batch(es))"
        )
        if self._allow:
            logging.warning(
                "Evaluation left out %d example(s) from the loss and metrics: %s "
                "(allow_invalid_labels).",
                count,
                where,
            )
            return count
        raise InvalidLabelError(
            f"Received a {where}: {_hint(num_classes)}. Nothing was written. "
            "RunConfig(allow_invalid_labels=True) leaves them out of the eval loss and metrics "
            "and counts them (eval/invalid_labels) instead."
        )
