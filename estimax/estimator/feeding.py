"""Feeding the devices: a bounded device prefetch, and whether the input held training back.

``DevicePrefetcher`` keeps a few batches already transferred to the devices (2 by default, as
flax's ImageNet example's ``prefetch_to_device``), so host-to-device copies overlap the step that
runs; host and device memory for input stay O(prefetch x batch) whatever the loop length. It
records, with each batch, the input iterator's position right after that batch was read, so a
checkpoint saves the position of the last batch *trained on*, not of the last one prefetched.

``DeviceTimeline`` learns when each dispatched step finished on the devices (a helper thread
waits on each step's loss: JAX has no completion callback) and so how long the devices sat idle
while the host was still reading input: the fraction of a loop lost to the input.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax


@dataclasses.dataclass
class Fed:
    """One batch on the devices.

    Attributes:
      value: what ``put`` returned (arrays on the devices).
      info: what ``prepare`` returned besides the host batch (e.g. the number of real rows).
      input_state: the input iterator's ``get_state()`` right after this batch was read, or None
        when the iterator has no ``get_state``.
      num_skipped: the iterator's ``num_skipped`` (bad records skipped) then, or None.
    """

    value: Any
    info: Any
    input_state: Any
    num_skipped: int | None


class DevicePrefetcher:
    """Reads input batches and transfers up to ``size`` of them to the devices ahead of use.

    Args:
      iterator: the host input (yields per-host batches).
      prepare: ``element -> (host_tree, info)``: checks/pads a batch; raises on a bad one.
      put: ``host_tree -> device_tree`` (e.g. ``make_array_from_process_local_data``).
      size: how many batches to hold on the devices ahead of the one in use (>= 1).
      limit: read at most this many elements in all (None: until the input ends).
      timer: seconds, for the time spent waiting for the input.
    """

    def __init__(
        self,
        iterator: Iterator,
        prepare: Callable[[Any], tuple[Any, Any]],
        put: Callable[[Any], Any],
        size: int = 2,
        limit: int | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ):
        if size < 1:
            raise ValueError(f"prefetch size must be >= 1, got {size}.")
        self._iterator = iterator
        self._prepare = prepare
        self._put = put
        self._size = size
        self._limit = limit
        self._timer = timer
        self._queue: collections.deque[Fed] = collections.deque()
        self._stateful = hasattr(iterator, "get_state")
        self._ended = False
        self.num_read = 0
        self.input_wait_secs = 0.0  # host seconds blocked on the input iterator

    @property
    def iterator(self) -> Iterator:
        """The input iterator (to restore its position before the first read)."""
        return self._iterator

    def fill(self) -> None:
        """Reads and transfers batches until ``size`` are waiting (or the input/limit ends)."""
        while (
            len(self._queue) < self._size
            and not self._ended
            and (self._limit is None or self.num_read < self._limit)
        ):
            start = self._timer()
            try:
                element = next(self._iterator)
            except StopIteration:
                self._ended = True
                return
            finally:
                self.input_wait_secs += self._timer() - start
            self.num_read += 1
            # get_state: the stateful-iterator protocol (checked once in __init__).
            state = self._iterator.get_state() if self._stateful else None  # type: ignore[attr-defined]
            skipped = getattr(self._iterator, "num_skipped", None)
            host, info = self._prepare(element)
            self._queue.append(Fed(self._put(host), info, state, skipped))

    def next(self) -> Fed | None:
        """The next batch on the devices, or None when the input (or the limit) is exhausted."""
        self.fill()
        return self._queue.popleft() if self._queue else None


class DeviceTimeline:
    """Measures, per loop, how long the devices waited for the input.

    Call ``dispatched(marker, input_wait_secs)`` right after dispatching each step (``marker``: a
    small output of the step, e.g. its loss; ``input_wait_secs``: the host's total input wait so
    far). The devices idled for the input before step ``i`` for
    ``min(input wait since step i-1 was dispatched, dispatch_i - done_{i-1})``: the gap between the
    previous step finishing and this one being dispatched, as far as the host spent it reading
    input (the rest is the host's own work: logging, checkpoints).
    """

    def __init__(self, timer: Callable[[], float] = time.perf_counter):
        self._timer = timer
        self._markers: queue.SimpleQueue = queue.SimpleQueue()
        self._done: list[float] = []
        self._cond = threading.Condition()
        self._dispatch: list[tuple[float, float]] = []  # (dispatch time, input wait so far)
        self._prev: tuple[float, float, float] | None = None  # (dispatch, wait, done) before
        self._loop_start = timer()
        self._thread = threading.Thread(
            target=self._wait_loop, daemon=True, name="estimax-device-timeline"
        )
        self._thread.start()

    def _wait_loop(self) -> None:
        while True:
            marker = self._markers.get()
            if marker is None:
                return
            try:
                jax.block_until_ready(marker)
            except Exception:  # noqa: BLE001 - the main thread sees the same error when it syncs
                pass
            with self._cond:
                self._done.append(self._timer())
                self._cond.notify_all()

    def dispatched(self, marker: Any, input_wait_secs: float) -> None:
        """Records that a step was just dispatched; ``marker`` is ready when it has finished."""
        now = self._timer()
        if self._prev is None and not self._dispatch:
            # The run's first step: its dispatch included compiling it; time loops from here.
            self._loop_start = now
        self._dispatch.append((now, input_wait_secs))
        self._markers.put(marker)

    def end_loop(self) -> tuple[float, float]:
        """Waits until the loop's steps are recorded; returns (input-idle secs, loop secs)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._done) >= len(self._dispatch))
            done = list(self._done)
            self._done.clear()
        idle = 0.0
        prev = self._prev
        for (dispatch, wait), finished in zip(self._dispatch, done, strict=False):
            if prev is not None:
                prev_dispatch, prev_wait, prev_done = prev
                idle += max(0.0, min(wait - prev_wait, dispatch - prev_done))
            prev = (dispatch, wait, finished)
        self._prev = prev
        self._dispatch.clear()
        now = self._timer()
        loop_secs, self._loop_start = now - self._loop_start, now
        return idle, loop_secs

    def close(self) -> None:
        """Stops the helper thread."""
        self._markers.put(None)
        self._thread.join()
