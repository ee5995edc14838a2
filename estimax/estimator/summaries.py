"""TensorBoard event files and the original's log lines."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from absl import logging
from tensorboardX import SummaryWriter

from estimax import storage


class Summaries:
    """Writes scalars to TensorBoard event files under one directory, lazily opened."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self._writer: SummaryWriter | None = None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Writes each named scalar at ``step``."""
        if self._writer is None:
            storage.makedirs(self.logdir)
            storage.register_summary_writers()  # gs:// and s3:// event files through fsspec
            self._writer = SummaryWriter(self.logdir, flush_secs=30)
        for name, value in values.items():
            self._writer.add_scalar(name, float(np.asarray(value)), global_step=int(step))

    def flush(self) -> None:
        """Makes everything written so far visible to readers."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def log_step(step: int, loss: float) -> None:
    """Logs the original's ``LoggingTensorHook`` line: ``loss = X, step = N``."""
    logging.info("loss = %s, step = %d", _fmt(loss), step)


def log_speed(steps_per_sec: float, examples_per_sec: float) -> None:
    """Logs the original's ``ExamplesPerSecondHook`` lines."""
    logging.info("global_step/sec: %g", steps_per_sec)
    logging.info("examples/sec: %g", examples_per_sec)


def _fmt(x: float) -> str:
    return np.format_float_positional(np.float32(x), precision=7, trim="-")
