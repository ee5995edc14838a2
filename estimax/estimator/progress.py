"""Training progress: one line updated in place on a terminal, plain log lines elsewhere.

On a terminal (stderr is a tty) a tqdm bar shows ``step N/max_steps``, the rate, the time
elapsed, the ETA and the last loss, redrawn once per host loop; log lines written meanwhile
(``loss = X, step = N``, checkpoints, evaluations) are printed above it, never through it.
Elsewhere (CI, a file, a pipe) nothing is redrawn, so a log holds no carriage returns: the
progress is a plain ``Progress: step N / M (P%), ETA H:MM:SS`` line at the speed lines' cadence.
"""

from __future__ import annotations

import datetime
import logging as py_logging
import sys
from collections.abc import Callable
from typing import IO, Any

BAR_FORMAT = (
    "step {n_fmt}/{total_fmt} |{bar}| {percentage:3.0f}% "
    "[{elapsed}, ETA {remaining}, {rate_fmt}{postfix}]"
)


def is_terminal(stream: IO) -> bool:
    """Whether ``stream`` is an interactive terminal (a progress line can be redrawn there)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def eta(remaining_steps: int, steps_per_sec: float) -> str:
    """``H:MM:SS`` for ``remaining_steps`` at ``steps_per_sec`` (``?`` without a rate)."""
    if steps_per_sec <= 0:
        return "?"
    return str(datetime.timedelta(seconds=round(remaining_steps / steps_per_sec)))


class _AboveTheBar:
    """A stream whose writes clear the progress bars on it first and redraw them after."""

    def __init__(self, stream: IO):
        self.stream = stream

    def write(self, text: str) -> int:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self.stream):
            written = self.stream.write(text)
            self.stream.flush()
        return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _console_handlers(stream: IO) -> list[py_logging.StreamHandler]:
    """The logging handlers that write to ``stream``: the root's, absl's (its Python handler)."""
    found = []
    for logger in (py_logging.getLogger(), py_logging.getLogger("absl")):
        for handler in logger.handlers:
            # absl's handler writes through its Python handler (a StreamHandler).
            inner = getattr(handler, "python_handler", handler)
            if isinstance(inner, py_logging.StreamHandler) and inner.stream is stream:
                found.append(inner)
    return found


def logs_above_the_bar(stream: IO) -> Callable[[], None]:
    """Makes log records written to ``stream`` print above its progress bars; returns the
    function that undoes it."""
    handlers = _console_handlers(stream)
    above = _AboveTheBar(stream)
    for handler in handlers:
        handler.setStream(above)

    def restore() -> None:
        for handler in handlers:
            if handler.stream is above:
                handler.setStream(stream)

    return restore


class ProgressBar:
    """The in-place progress line of one ``train`` call (only on a terminal).

    Args:
      start: the step training starts at.
      target: the step it must reach.
      stream: where to draw (stderr).
    """

    def __init__(self, start: int, target: int, stream: IO | None = None):
        from tqdm import tqdm

        self._stream = stream or sys.stderr
        self._restore_logs = logs_above_the_bar(self._stream)
        self._bar = tqdm(
            total=target,
            initial=start,
            unit="step",
            file=self._stream,
            dynamic_ncols=True,
            bar_format=BAR_FORMAT,
        )

    def update(self, steps: int, loss: float) -> None:
        """Advances by ``steps`` steps whose last loss was ``loss``."""
        self._bar.set_postfix_str(f"loss={loss:.4g}", refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        """Leaves the final line on the terminal and gives the log handlers their stream back."""
        try:
            self._bar.close()
        finally:
            self._restore_logs()
