"""One cadence primitive for checkpoints, summaries, log lines and evaluations.

``PeriodicAction(every_steps=..., every_secs=..., clock=...)`` answers "is it due at this step?"
the way TF's ``SecondOrStepTimer`` (behind ``CheckpointSaverHook`` and ``LoggingTensorHook``) and
CLU's ``periodic_actions`` do: due when ``every_steps`` steps or ``every_secs`` seconds have
passed since it last fired. The clock is injectable so tests control time. ``steps_due`` lists
the step numbers in a finished loop that fall on the ``every_steps`` grid (per-step summaries
written at their true steps after a loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class PeriodicAction:
    """Decides when a periodic action (save, log, evaluate) is due.

    Args:
      every_steps: due when at least this many steps passed since the last firing.
      every_secs: due when at least this many seconds (of ``clock``) passed since then.
      clock: seconds, monotonic; tests inject a fake one.
      start_step: the step counted as the last firing (e.g. the step training resumed at).
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_secs: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        start_step: int = 0,
    ):
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 or None, got {every_steps}.")
        if every_secs is not None and every_secs < 0:
            raise ValueError(f"every_secs must be >= 0 or None, got {every_secs}.")
        self.every_steps = every_steps
        self.every_secs = every_secs
        self._clock = clock
        self.last_step = start_step
        self.last_time = clock()

    def due(self, step: int) -> bool:
        """True when ``step`` is at least ``every_steps`` past, or ``every_secs`` after, the last
        firing (and ``step`` is not the step it last fired at)."""
        if step == self.last_step:
            return False
        if self.every_steps is not None and step - self.last_step >= self.every_steps:
            return True
        return self.every_secs is not None and self._clock() - self.last_time >= self.every_secs

    def fired(self, step: int) -> None:
        """Records that the action ran at ``step`` (now)."""
        self.last_step = step
        self.last_time = self._clock()

    def __call__(self, step: int, action: Callable[[int], object], force: bool = False) -> bool:
        """Runs ``action(step)`` if due (or ``force``); returns whether it ran."""
        if not (force or self.due(step)):
            return False
        action(step)
        self.fired(step)
        return True

    def seconds_since_fired(self) -> float:
        """Seconds of ``clock`` since the last firing."""
        return self._clock() - self.last_time


def steps_due(begin: int, end: int, every_steps: int, first: int | None = None) -> list[int]:
    """The steps in ``(begin, end]`` that are multiples of ``every_steps``, plus ``first`` if in.

    The original wrote summaries and ``loss = ...`` lines at ``step % every_steps == 0`` (and at
    the first step of a run); a loop's per-step metrics are written after the loop at those steps.
    """
    steps = [s for s in range(begin + 1, end + 1) if s % every_steps == 0 or s == first]
    return steps
