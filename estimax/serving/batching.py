"""Dynamic batching with TensorFlow Serving's knobs, on the server's asyncio loop.

Concurrent requests are merged into one device call: a batch closes when it holds
``max_batch_size`` instances or ``batch_timeout_micros`` after its first request arrived, so a
lone request waits at most the timeout. At most ``max_enqueued_batches`` batches' worth of
instances wait; past that a request is refused at once (429), never left to hang.
``num_batch_threads`` batches run at the same time (fewer with a per-model cap, ``slots``).
Batches are padded to allowed sizes by ``Servable.run``. Waiting requests are ordered by their
priority level, aged (``rank``, the rule of ``estimax.serving.admission``), then by arrival:
with every request at one level that is first come, first served.

Hand-written because the knobs must be TF Serving's and the device call runs in a thread
pool under one asyncio loop; no maintained Python batcher offers both (``ray.serve`` batching
needs Ray).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np


def rank(level: int, arrived: float, now: float, aging_s: float) -> float:
    """The effective level of a request of ``level`` waiting since ``arrived`` (lower goes
    first): one level better per ``aging_s`` waited (``estimax.serving.admission``'s rule)."""
    if aging_s <= 0:
        return level
    return level - (now - arrived) // aging_s


class QueueFullError(RuntimeError):
    """The batching queue is full: the request is refused (HTTP 429)."""


@dataclasses.dataclass
class BatchingOptions:
    """TensorFlow Serving's ``BatchingParameters`` (its names and meanings).

    Attributes:
      max_batch_size: most instances in one device call.
      batch_timeout_micros: most time a batch waits to fill after its first request.
      max_enqueued_batches: queue bound, in batches of ``max_batch_size`` instances.
      num_batch_threads: batches run concurrently.
      allowed_batch_sizes: sizes batches are padded to (compiled ahead); the last must equal
        ``max_batch_size``. Empty: powers of two up to ``max_batch_size``.
    """

    max_batch_size: int = 32
    batch_timeout_micros: int = 1000
    max_enqueued_batches: int = 16
    num_batch_threads: int = 1
    allowed_batch_sizes: tuple[int, ...] = ()

    def validate(self) -> None:
        """Raises ValueError naming the flag when the options are inconsistent."""
        if self.max_batch_size < 1:
            raise ValueError("--max_batch_size must be >= 1")
        if self.batch_timeout_micros < 0:
            raise ValueError("--batch_timeout_micros must be >= 0")
        if self.max_enqueued_batches < 1 or self.num_batch_threads < 1:
            raise ValueError("--max_enqueued_batches and --num_batch_threads must be >= 1")
        sizes = list(self.allowed_batch_sizes)
        if sizes and (
            sizes != sorted(set(sizes)) or sizes[-1] != self.max_batch_size or sizes[0] < 1
        ):
            raise ValueError(
                "--allowed_batch_sizes must increase and end with --max_batch_size "
                f"({self.max_batch_size}), got {sizes}"
            )


@dataclasses.dataclass
class _Task:
    key: Any  # the servable: tasks of different versions never share a batch
    run: Callable[[dict], dict]
    features: dict[str, np.ndarray]
    size: int
    arrived: float
    future: asyncio.Future
    on_start: Callable[[float], None] | None = None
    level: int = 0  # its priority level (lower first), aged while it waits


class Batcher:
    """Merges concurrent ``submit`` calls into batches (see the module docstring)."""

    def __init__(
        self,
        options: BatchingOptions,
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
        slots: int = 0,
        aging_s: float = 0.0,
    ):
        """Starts nothing until the first ``submit`` (it needs the running loop).

        ``slots``: batches of this queue run at once, at most (0: ``num_batch_threads``);
        ``aging_s``: a waiting request's level improves by one per this many seconds.
        """
        options.validate()
        self.options = options
        self._slot_count = min(slots or options.num_batch_threads, options.num_batch_threads)
        self._aging_s = aging_s
        self._executor = executor
        self._clock = clock
        self._tasks: collections.deque[_Task] = collections.deque()
        self._queued = 0
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._slots: asyncio.Semaphore | None = None
        self.batches_run = 0

    @property
    def capacity(self) -> int:
        """How many instances may wait."""
        return self.options.max_enqueued_batches * self.options.max_batch_size

    @property
    def queued(self) -> int:
        """How many instances wait now."""
        return self._queued

    async def submit(
        self,
        key: Any,
        run: Callable[[dict], dict],
        features: dict[str, np.ndarray],
        on_start: Callable[[float], None] | None = None,
        level: int = 0,
    ) -> dict[str, np.ndarray]:
        """Queues one request's instances; returns its rows of the batch's outputs.

        ``on_start(seconds waited)`` is called when the request's batch starts running;
        ``level``: its priority level (lower goes first).

        Raises:
          QueueFullError: the queue holds ``capacity`` instances already.
        """
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
            self._slots = asyncio.Semaphore(self._slot_count)
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        size = int(next(iter(features.values())).shape[0])
        if self._queued + size > self.capacity:
            raise QueueFullError(
                "The batch scheduling queue to which this task was submitted is full "
                f"({self._queued} instances waiting, --max_enqueued_batches="
                f"{self.options.max_enqueued_batches} x --max_batch_size="
                f"{self.options.max_batch_size}); retry later"
            )
        future = asyncio.get_running_loop().create_future()
        self._tasks.append(_Task(key, run, features, size, self._clock(), future, on_start, level))
        self._queued += size
        self._wakeup.set()
        return await future

    async def _loop(self) -> None:
        assert self._wakeup is not None and self._slots is not None
        timeout = self.options.batch_timeout_micros / 1e6
        while True:
            while not self._drop_given_up():
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._slots.acquire()  # while busy, the next batch keeps filling
            # Wait for the batch to fill, at most `timeout` after its first request arrived.
            while self._drop_given_up() and self._fill() < self.options.max_batch_size:
                left = self._tasks[0].arrived + timeout - self._clock()
                if left <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), left)
                except TimeoutError:
                    break
            if not self._drop_given_up():
                self._slots.release()
                continue
            batch = [self._tasks.popleft()]
            total = batch[0].size
            while (
                self._tasks
                and self._tasks[0].key is batch[0].key
                and total + self._tasks[0].size <= self.options.max_batch_size
            ):
                total += self._tasks[0].size
                batch.append(self._tasks.popleft())
            self._queued -= total
            asyncio.get_running_loop().create_task(self._run(batch))

    def _drop_given_up(self) -> bool:
        """Drops the requests given up while they waited (timed out: nobody reads their rows,
        so they are not run); whether any request is left."""
        if any(t.future.done() for t in self._tasks):
            self._queued -= sum(t.size for t in self._tasks if t.future.done())
            self._tasks = collections.deque(t for t in self._tasks if not t.future.done())
        if len(self._tasks) > 1:  # the best effective level first, then the oldest
            now = self._clock()
            self._tasks = collections.deque(
                sorted(
                    self._tasks,
                    key=lambda t: (rank(t.level, t.arrived, now, self._aging_s), t.arrived),
                )
            )
        return bool(self._tasks)

    def _fill(self) -> int:
        first = self._tasks[0]
        total = 0
        for task in self._tasks:
            if task.key is not first.key:
                break
            total += task.size
        return total

    async def _run(self, batch: list[_Task]) -> None:
        assert self._slots is not None
        try:
            features = {
                k: np.concatenate([t.features[k] for t in batch]) for k in batch[0].features
            }
            now = self._clock()
            for task in batch:
                if task.on_start is not None:
                    task.on_start(now - task.arrived)
            loop = asyncio.get_running_loop()
            outputs = await loop.run_in_executor(self._executor, batch[0].run, features)
            self.batches_run += 1
            start = 0
            for task in batch:
                if not task.future.done():
                    task.future.set_result(
                        {k: v[start : start + task.size] for k, v in outputs.items()}
                    )
                start += task.size
        except Exception as e:  # noqa: BLE001 - every waiting request gets the error
            for task in batch:
                if not task.future.done():
                    task.future.set_exception(e)
        finally:
            self._slots.release()

    def close_soon(self) -> None:
        """Stops the batching loop from any thread (a model no longer served: nothing queued)."""
        task = self._loop_task
        if task is not None:
            task.get_loop().call_soon_threadsafe(task.cancel)

    async def close(self) -> None:
        """Stops the batching loop (pending requests are cancelled)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in self._tasks:
            task.future.cancel()
