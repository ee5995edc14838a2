"""What a library user sees in the log: estimax's lines, not Orbax's.

- Orbax logs ~60 INFO lines per checkpoint, and on a failed save an ERROR with a traceback from
  each of its threads (22 of them on a full disk), before estimax raises its own one-line error
  (``StorageError`` naming the path and the fix). :class:`QuietOrbax` sends every Orbax record
  to the debug level: ``absl.logging.set_verbosity(absl.logging.DEBUG)`` shows them again.
- TensorFlow's Estimator printed ``loss = X, step = N`` without any set-up; a script that
  configured no logging at all gets estimax's INFO lines the same way (:func:`show_progress`).
  A script that configured logging (a handler, or absl's verbosity) is left as it is.
"""

from __future__ import annotations

import logging as py_logging
import os

from absl import logging

__all__ = ["QuietOrbax", "quiet_orbax", "show_progress"]

_ORBAX = f"{os.sep}orbax{os.sep}"


class QuietOrbax(py_logging.Filter):
    """Lets Orbax's records through only when debug logging is on, as DEBUG records."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        if _ORBAX not in record.pathname:
            return True
        if logging.get_verbosity() < logging.DEBUG:
            return False
        record.levelno, record.levelname = py_logging.DEBUG, "DEBUG"
        return True


_FILTER = QuietOrbax()


def quiet_orbax() -> None:
    """Installs :class:`QuietOrbax` on the ``absl`` logger Orbax writes to (once)."""
    logger = py_logging.getLogger("absl")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def show_progress() -> None:
    """Shows estimax's INFO lines when the program configured no logging at all."""
    quiet_orbax()
    # Untouched defaults: absl at WARNING and the root logger at WARNING. (A library imported
    # earlier may have given root a plain stderr handler: that still counts as no set-up.)
    if logging.get_verbosity() != logging.WARNING or (
        py_logging.getLogger().level != py_logging.WARNING
    ):
        return
    if not py_logging.getLogger().handlers:
        logging.use_absl_handler()  # what absl's app.run installs: stderr, absl's line format
    logging.set_verbosity(logging.INFO)
