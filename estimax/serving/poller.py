"""A background thread that calls one function every few seconds until stopped.

What polls in the server: each model's versions on disk (``ModelManager``, every
``--file_system_poll_wait_seconds``) and the model config file (``ConfigPoller``, every
``--model_config_file_poll_wait_seconds``). A poll that raises is logged and the next one runs
on time: the poller outlives any one bad poll.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Poller"]

log = logging.getLogger(__name__)


class Poller:
    """Calls ``poll()`` every ``interval`` seconds in a daemon thread named ``name``.

    Args:
      poll: one poll; an exception it raises is logged (``"<what>: poll failed"``, with its
        traceback) and polling goes on.
      interval: seconds between the end of one poll and the start of the next.
      name: the thread's name.
      what: what is polled, as the log line names it (``Model m``, ``--model_config_file=...``).
      logger: where that line goes (default: this module's); the owner's, as before.
      wait: ``wait(seconds) -> stopped``: waits out the interval, True once ``stop`` was called.
        Default: the poller's stop event's ``wait``; a test gives its own to step the polls.
    """

    def __init__(
        self,
        poll: Callable[[], None],
        interval: float,
        *,
        name: str,
        what: str,
        logger: logging.Logger | None = None,
        wait: Callable[[float], bool] | None = None,
    ):
        self._poll = poll
        self.interval = interval
        self.name = name
        self.what = what
        self._log = logger or log
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread; its first poll is one interval from now."""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._wait(self.interval) and not self._stop.is_set():
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad poll
                self._log.exception("%s: poll failed", self.what)

    def stop(self, timeout: float = 30.0) -> None:
        """Stops polling: no poll starts after this; waits up to ``timeout`` s for one running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
