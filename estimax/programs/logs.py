"""Log set-up shared by the command-line programs."""

from __future__ import annotations

import logging as py_logging

from absl import logging


class _QuietLibraries(py_logging.Filter):
    """Drops INFO chatter of Orbax internals (it logs each array transfer) from program output."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        noisy = "/orbax/" in record.pathname
        return record.levelno >= py_logging.WARNING or not noisy


def setup() -> None:
    """Shows estimax's INFO lines (``loss = X, step = N``) and hides libraries' INFO noise."""
    logging.set_verbosity(logging.INFO)
    py_logging.getLogger("absl").addFilter(_QuietLibraries())
