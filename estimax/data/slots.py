"""Batch slots: workers write elements straight into a batch's rows; the consumer gets views.

Why: pickling each decoded image back from a worker process and stacking it into a batch cost
the training process ~0.115 ms of CPU per image (a ceiling of ~8,700 images/s per host), and the
workers ~29% of their time. Here a batch is one block of memory (a *slot*): shared memory
(``multiprocessing.shared_memory``) for process workers, plain memory for thread workers. A
worker writes each element's arrays into its row; what comes back is only which rows are bad.
The batch the consumer gets is views of the slot (no copy); the slot returns to the pool when the
last of those views is gone (``weakref.finalize`` on their common base array): after the
consumer's transfer to the devices, whenever that is.

Bounds: the loader asks for at most its in-flight blocks + ``prefetch`` + 1 slots. A consumer
that keeps batches (``list(loader)``) holds their slots; the pool then grows rather than
deadlock (the memory is the consumer's, as copies would be), and says so once in the log.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np

__all__ = ["Layout", "SlotPool", "attach", "flatten", "write_rows"]

log = logging.getLogger(__name__)

_ALIGN = 64  # cache line: rows of different leaves never share one


def flatten(element: Any) -> tuple[list[np.ndarray], Any]:
    """An element (an array, a scalar, or tuples/dicts of them) -> (leaves, structure)."""
    if isinstance(element, tuple):
        parts = [flatten(e) for e in element]
        return [leaf for p in parts for leaf in p[0]], ("tuple", [p[1] for p in parts])
    if isinstance(element, dict):
        keys = list(element)
        parts = [flatten(element[k]) for k in keys]
        return [leaf for p in parts for leaf in p[0]], ("dict", keys, [p[1] for p in parts])
    return [np.asarray(element)], None


def _unflatten(structure: Any, leaves: list[np.ndarray], at: list[int]) -> Any:
    if structure is None:
        leaf = leaves[at[0]]
        at[0] += 1
        return leaf
    if structure[0] == "tuple":
        return tuple(_unflatten(s, leaves, at) for s in structure[1])
    return {k: _unflatten(s, leaves, at) for k, s in zip(structure[1], structure[2], strict=True)}


class Layout:
    """Where each leaf of a batch of ``batch_size`` elements lies in a slot (picklable)."""

    def __init__(self, example: Any, batch_size: int):
        leaves, self.structure = flatten(example)
        self.batch_size = batch_size
        self.leaves: list[tuple[tuple[int, ...], str, int]] = []  # (shape, dtype, offset)
        offset = 0
        for leaf in leaves:
            self.leaves.append((tuple(leaf.shape), leaf.dtype.str, offset))
            size = batch_size * leaf.nbytes
            offset += -(-size // _ALIGN) * _ALIGN
        self.nbytes = max(offset, _ALIGN)

    def arrays(self, buffer: Any) -> list[np.ndarray]:
        """The leaves' ``[batch_size, *shape]`` arrays over ``buffer`` (a slot's memory)."""
        return [
            np.ndarray((self.batch_size, *shape), np.dtype(dtype), buffer=buffer, offset=offset)
            for shape, dtype, offset in self.leaves
        ]

    def check(self, leaves: list[np.ndarray]) -> None:
        """Raises ValueError if an element's leaves do not have the batch's shapes and dtypes."""
        want = [(shape, dtype) for shape, dtype, _ in self.leaves]
        got = [(tuple(leaf.shape), leaf.dtype.str) for leaf in leaves]
        if got != want:
            raise ValueError(
                f"the transform gave {got} (shape, dtype) after {want}: every example of a batch "
                "must have the same shapes and dtypes (resize or crop images to one size)"
            )


def write_rows(dests: list[np.ndarray], layout: Layout, row: int, element: Any) -> None:
    """Writes one element into row ``row`` of a slot's leaf arrays ``dests``."""
    leaves, _ = flatten(element)
    layout.check(leaves)
    for dest, leaf in zip(dests, leaves, strict=True):
        dest[row] = leaf


# A worker process's attached slots, by name: attached once, reused for every later batch.
_ATTACHED: dict[str, tuple[shared_memory.SharedMemory, list[np.ndarray]]] = {}


def attach(name: str, layout: Layout) -> list[np.ndarray]:
    """In a worker process: the leaf arrays of the shared slot ``name``."""
    hit = _ATTACHED.get(name)
    if hit is None:
        # Python < 3.13 registers an attached segment with the resource tracker too; the
        # forkserver's workers share their owner's tracker, where that is a no-op (a set).
        shm = shared_memory.SharedMemory(name=name)
        hit = (shm, layout.arrays(shm.buf))
        _ATTACHED[name] = hit
    return hit[1]


# Shared slots closed while a consumer still held views of them: closed at a later chance
# (their mapping cannot be closed before, and a SharedMemory dropped then complains).
_RETIRED: list[shared_memory.SharedMemory] = []
_RETIRED_LOCK = threading.Lock()


def _close_retired(more: list[shared_memory.SharedMemory]) -> None:
    with _RETIRED_LOCK:
        keep = []
        for memory in _RETIRED + more:
            try:
                memory.close()
            except BufferError:
                keep.append(memory)
        _RETIRED[:] = keep


class SlotPool:
    """The slots of one loader iterator; shared memory or not.

    Args:
      layout: the batch's layout.
      shared: slots in named shared memory (process workers) or plain memory.
      limit: slots before the pool grows (only when the consumer holds all of them).
    """

    def __init__(self, layout: Layout, shared: bool, limit: int):
        self.layout = layout
        self.shared = shared
        self.limit = max(1, limit)
        self._memory: list[Any] = []  # SharedMemory or bytearray, by slot index
        self._arrays: list[list[np.ndarray]] = []
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._grew = False
        self._closed = False

    def __len__(self) -> int:
        return len(self._memory)

    def name(self, slot: int) -> str:
        """The shared-memory name of ``slot`` (for process workers)."""
        return self._memory[slot].name

    def arrays(self, slot: int) -> list[np.ndarray]:
        """The leaf arrays of ``slot``, for writing in this process."""
        return self._arrays[slot]

    def _new(self) -> int:
        with self._lock:
            if self.shared:
                memory: Any = shared_memory.SharedMemory(create=True, size=self.layout.nbytes)
                buffer = memory.buf
            else:
                memory = bytearray(self.layout.nbytes)
                buffer = memory
            self._memory.append(memory)
            self._arrays.append(self.layout.arrays(buffer))
            return len(self._memory) - 1

    def acquire(self, consumer_holds_all: Callable[[], bool]) -> int | None:
        """A free slot, a new one while under the limit, or None (wait and ask again).

        ``consumer_holds_all()`` says the consumer holds every slot (none queued for it): then
        the pool grows past its limit rather than wait forever.
        """
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if len(self._memory) < self.limit:
            return self._new()
        try:
            return self._free.get(timeout=0.02)
        except queue.Empty:
            pass
        if consumer_holds_all():
            if not self._grew:
                self._grew = True
                log.info(
                    "the consumer holds all %d batch slots (it keeps batches): adding slots",
                    len(self._memory),
                )
            return self._new()
        return None

    def release(self, slot: int) -> None:
        """Returns ``slot`` to the pool (a batch never handed out, or dropped)."""
        self._free.put(slot)

    def batch(self, slot: int, rows: int) -> Any:
        """The first ``rows`` rows of ``slot`` as an element-structured batch of views.

        The slot returns to the pool once no view of it is left.
        """
        memory = self._memory[slot]
        base = np.frombuffer(memory.buf if self.shared else memory, np.uint8, self.layout.nbytes)
        weakref.finalize(base, self._free.put, slot)
        leaves = [a[:rows] for a in self.layout.arrays(base)]
        return _unflatten(self.layout.structure, leaves, [0])

    def close(self) -> None:
        """Unlinks the shared slots: their memory is freed once the last view is gone."""
        if self._closed:
            return
        self._closed = True
        self._arrays.clear()  # this process's own views; a consumer's keep their slot mapped
        shared = [m for m in self._memory if isinstance(m, shared_memory.SharedMemory)]
        for memory in shared:
            try:
                memory.unlink()
            except FileNotFoundError:
                pass
        self._memory = []
        _close_retired(shared)
