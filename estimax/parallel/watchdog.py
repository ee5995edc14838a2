"""A hang watchdog: no training step completes within a timeout -> stacks, then exit.

A multi-host job hangs rather than fails when one host stops (a stuck input read, a dead
filesystem mount, a collective waiting for a peer that never comes). The job runner sees a live
process and waits forever. The watchdog turns that into what a runner can act on: it logs the
Python stack of every thread (where it hangs) and the last completed step, then ends the process
with ``HANG_EXIT_CODE`` so the runner restarts it from the last checkpoint.

Hand-written because no library ships it (apple/axlearn's trainer has one inside the trainer);
it is a daemon thread waiting on an event with a timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

from absl import logging

# EX_TEMPFAIL of sysexits.h: "a temporary failure; the user is invited to retry".
HANG_EXIT_CODE = 75


def _exit_process(code: int) -> None:
    # os._exit, not sys.exit: the main thread is the one that hangs; nothing it would run on the
    # way out (atexit, jax.distributed's shutdown barrier) can be trusted to return.
    os._exit(code)


def format_stacks() -> str:
    """The Python stack of every thread of this process, each headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    # sys._current_frames is the documented way to read other threads' stacks (faulthandler
    # needs a real file descriptor, which captured or redirected stderr may not have).
    for ident, frame in sys._current_frames().items():  # noqa: SLF001
        parts.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n")
        parts.extend(traceback.format_stack(frame))
    return "".join(parts)


class Watchdog:
    """Ends the process when ``heartbeat`` is not called for ``timeout_secs``.

    Use as a context manager around a loop that calls ``heartbeat(step)`` after each completed
    step. Between ``start`` and ``stop`` the timeout is measured from the last heartbeat (or from
    ``start``).

    Args:
      timeout_secs: seconds without a heartbeat before the dump and exit; None or 0 disables.
      what: what a heartbeat stands for, for the message ("training step").
      exit_fn: ends the process with a status (tests inject one).
      clock: seconds, monotonic.
    """

    def __init__(
        self,
        timeout_secs: float | None,
        what: str = "training step",
        exit_fn: Callable[[int], None] = _exit_process,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.timeout_secs = timeout_secs or None
        self._what = what
        self._exit_fn = exit_fn
        self._clock = clock
        self._cond = threading.Condition()
        self._last_beat = clock()
        self._last_step: int | None = None
        self._stopped = True
        self._thread: threading.Thread | None = None
        self.fired = False

    def start(self, step: int | None = None) -> Watchdog:
        """Starts watching; ``step`` is the last completed step so far (e.g. the restored one)."""
        if self.timeout_secs is None:
            return self
        with self._cond:
            self._last_beat, self._last_step, self._stopped = self._clock(), step, False
        self._thread = threading.Thread(target=self._watch, daemon=True, name="estimax-watchdog")
        self._thread.start()
        return self

    def heartbeat(self, step: int) -> None:
        """Records that ``step`` has completed."""
        with self._cond:
            self._last_beat, self._last_step = self._clock(), step

    def stop(self) -> None:
        """Stops watching (before slow work that completes no step: evaluation, export)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not watching inside (work that completes no step: an evaluation, a listener); the
        timeout starts afresh after it, from the last step seen."""
        running = self._thread is not None
        self.stop()
        try:
            yield
        finally:
            if running:
                self.start(self._last_step)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _watch(self) -> None:
        assert self.timeout_secs is not None
        with self._cond:
            while not self._stopped:
                left = self._last_beat + self.timeout_secs - self._clock()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._stopped:
                return
            last = self._last_step
        self.fired = True
        logging.error(
            "Watchdog: no %s completed in %g s (last completed step: %s). The stacks of all "
            "threads follow; exiting with status %d so the job runner restarts from the last "
            "checkpoint.",
            self._what,
            self.timeout_secs,
            "none" if last is None else last,
            HANG_EXIT_CODE,
        )
        print(
            f"estimax watchdog: no {self._what} completed in {self.timeout_secs:g} s; last "
            f"completed step: {'none' if last is None else last}; stacks of all threads:",
            file=sys.stderr,
            flush=True,
        )
        print(format_stacks(), file=sys.stderr, flush=True)
        self._exit_fn(HANG_EXIT_CODE)
