"""Feeding the devices: a bounded device prefetch, and whether the input held training back.

``DevicePrefetcher`` keeps a few batches already transferred to the devices (2 by default, as
flax's ImageNet example's ``prefetch_to_device``), so host-to-device copies overlap the step that
runs; host and device memory for input stay O(prefetch x batch) whatever the loop length. It
records, with each batch, the input iterator's position right after that batch was read, so a
checkpoint saves the position of the last batch *trained on*, not of the last one prefetched.
``BlockPrefetcher`` hands out blocks of batches stacked for a device loop over them
(``RunConfig.steps_per_device_call``), one transfer per block.

``DeviceIdle`` estimates how long the devices sat idle while the host was still reading input
(a step already finished when the read after it returned): the fraction of a loop lost to the
input.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from absl import logging


@dataclasses.dataclass
class Fed:
    """One batch on the devices.

    Attributes:
      value: what ``put`` returned (arrays on the devices).
      info: what ``prepare`` returned besides the host batch (e.g. the number of real rows).
      input_state: the input iterator's ``get_state()`` right after this batch was read, or None
        when the iterator has no ``get_state``.
      num_skipped: the iterator's ``num_skipped`` (bad records skipped) then, or None.
      count: how many batches ``value`` holds (``BlockPrefetcher``: stacked on a leading axis).
    """

    value: Any
    info: Any
    input_state: Any
    num_skipped: int | None
    count: int = 1


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
        self.expected_batches: int | None = None  # the input's len(), where it has one

    @property
    def limited(self) -> bool:
        """Whether at most ``limit`` elements are read (the input itself may be endless)."""
        return self._limit is not None

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

    def next(self, count: int | None = None) -> Fed | None:
        """The next batch on the devices, or None when the input (or the limit) is exhausted.

        ``count``: the most batches wanted (a ``BlockPrefetcher`` hands out up to that many at
        once; this one, one).
        """
        self.fill()
        return self._queue.popleft() if self._queue else None

    def has_next(self) -> bool:
        """Whether another batch comes (reads ahead, as ``fill``, to know)."""
        self.fill()
        return bool(self._queue)


class BlockPrefetcher(DevicePrefetcher):
    """Hands out blocks of up to ``block`` batches stacked on a new leading axis, one transfer
    per block (for a device loop over them, ``lax.scan``).

    It reads up to ``block`` batches ahead on the host and transfers a block when it is asked
    for (while the device call before it runs); host and device memory stay O(block x batch).

    Args:
      put_block: ``stacked host tree -> device tree`` (leading axis: the block's batches).
      block: the most batches in a block.
      The others: as ``DevicePrefetcher``'s (``put`` is not used: blocks go by ``put_block``).
    """

    def __init__(
        self,
        iterator: Iterator,
        prepare: Callable[[Any], tuple[Any, Any]],
        put_block: Callable[[Any], Any],
        block: int,
        limit: int | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ):
        super().__init__(iterator, prepare, lambda host: host, block, limit, timer)
        self._put_block = put_block

    def next(self, count: int | None = None) -> Fed | None:
        """The next ``count`` (default ``block``) batches, fewer where the input ends, stacked
        on the devices; None when the input (or the limit) is exhausted."""
        self.fill()
        count = min(count or self._size, len(self._queue))
        if not count:
            return None
        taken = [self._queue.popleft() for _ in range(count)]
        stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *(f.value for f in taken))
        last = taken[-1]
        return Fed(self._put_block(stacked), last.info, last.input_state, last.num_skipped, count)


class EndlessEvalInput:
    """Warns once when an evaluation's input looks endless: more batches than its ``len()``
    promised, or still going after ``limit_secs`` (an eval ``input_fn`` must be finite; a
    training input passed by mistake repeats forever and the evaluation never returns).
    """

    def __init__(self, expected: int | None, clock: Callable[[], float], limit_secs: float = 600.0):
        self._expected = expected
        self._clock = clock
        self._limit = limit_secs
        self._start = clock()
        self.warned = False

    def check(self, batches: int, examples: int) -> None:
        """Called after each batch with the batches and examples read so far."""
        if self.warned:
            return
        over = self._expected is not None and batches > self._expected
        if not over and self._clock() - self._start < self._limit:
            return
        self.warned = True
        logging.warning(
            "evaluate has read %d batches (%d examples)%s and its input has not ended: an eval "
            "input_fn must be finite (num_epochs=1, shuffle off); a repeating one never ends. "
            "Pass evaluate(steps=N) to evaluate N batches.",
            batches,
            examples,
            f", more than its len() of {self._expected}"
            if over
            else f" in {self._clock() - self._start:.0f} s",
        )


class DeviceIdle:
    """Estimates, per loop, how long the devices sat idle waiting for the input.

    No thread and no sync: right after dispatching step ``i`` (and waiting for step ``i - 1``)
    the host reads the next batch. If step ``i`` has already finished when that read returns
    (``is_ready()``, which does not block), the devices ran dry during the read, and the read's
    time counts as idle (at most step ``i``'s own time too much: it ran during the first part of
    the read). If step ``i`` is still running, the input kept up. (A helper thread waiting on
    every step's completion measured this exactly, for 35 us of host time per step: a quarter
    of the loop's cost on a near-zero-cost model, bench/overhead.py.)
    """

    def __init__(self, timer: Callable[[], float] = time.perf_counter):
        self._timer = timer
        self._idle = 0.0
        self._loop_start = timer()

    def after_read(self, running: Any, read_secs: float) -> None:
        """``running``: an output of the step dispatched before a read that took ``read_secs``."""
        if read_secs > 0 and running.is_ready():
            self._idle += read_secs

    def end_loop(self) -> tuple[float, float]:
        """(input-idle secs, loop secs) since the last call."""
        now = self._timer()
        idle, loop_secs = self._idle, now - self._loop_start
        self._idle, self._loop_start = 0.0, now
        return idle, loop_secs
