"""Log set-up shared by the command-line programs."""

from __future__ import annotations

from absl import logging

from estimax.estimator import logs


def setup() -> None:
    """Shows estimax's INFO lines (``loss = X, step = N``) and hides Orbax's (debug only)."""
    logging.set_verbosity(logging.INFO)
    logs.quiet_orbax()
