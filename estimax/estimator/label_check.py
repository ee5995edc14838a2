"""Integer labels outside ``[0, num_classes)``: caught once per loop, never silently trained on.

``losses.softmax_cross_entropy`` counts such labels on the device with each step (see
``losses.label_checks``); the training loop hands each loop's per-step counts to
:class:`InvalidLabelCheck` at the host sync, so checking costs no host sync per step. TensorFlow
raised ``Received a label value of 3 which is outside the valid range of [0, 3)``; without a
check, the label's one-hot row is all zeros, its loss is 0, and training "converges".
"""

from __future__ import annotations

from typing import Any

import numpy as np
from absl import logging

__all__ = ["InvalidLabelError", "InvalidLabelCheck"]


class InvalidLabelError(ValueError):
    """A training batch had integer labels outside ``[0, num_classes)`` (training stopped)."""


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
            f"Received a {where}: labels must be class ids 0..{num_classes - 1} "
            "(estimax-convert writes the original's 1-based labels: subtract 1 in the input_fn). "
            f"Nothing from that loop was saved; {self._checkpointer.intact()}. "
            "RunConfig(allow_invalid_labels=True) trains on them instead."
        )
