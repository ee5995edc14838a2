"""JSON request bodies parsed, and large JSON answers written, outside the server's event loop.

CPython's JSON parser holds the GIL for a whole document, so in a thread it stalls the event
loop as much as on it (measured on a loaded 2-core machine: a 60 MB body took 3.9 s to parse,
3.3 s of which the event loop stood still with the parse in a thread; health checks and every
other request waited). Bodies larger than ``INLINE_BYTES`` are therefore parsed in a worker
process, which sends the document back with its lists of numbers packed as numpy arrays
(``pack``: unpickling an array copies its bytes, where unpickling millions of Python floats
would hold the GIL again); answers holding more than ``INLINE_ELEMENTS`` numbers are written to
JSON text there too. Smaller ones (nearly every request) are handled in place: a process hop
costs more than their parse. So are bodies of few values up to ``INLINE_TEXT_BYTES`` (base64
images, mostly: strings parse at hundreds of MB/s, numbers at ~40): measured, a 470 KB request of
one 500x375 JPEG parsed in 0.17 ms in place against 1.9-3.5 ms through a worker.

So the request code takes a packed array wherever a body had a list of at least ``PACK_MIN``
numbers. The workers fork from a forkserver that has imported this module once (as the input
loader's) and end with the server (``estimax.data.worker_exit``); a worker that dies (killed
for memory) costs its request a 503 and is replaced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import numpy as np

from estimax.data.worker_exit import exit_with_parent
from estimax.serving.protocol import ApiError

INLINE_BYTES = 256 << 10  # parsed in place: ~10 ms of the loop at most
# Past INLINE_BYTES, a body with fewer than INLINE_VALUES commas (every value but a container's
# first follows one) is parsed in place up to this size: 2 MiB of base64 images took 0.7 ms to
# parse, 2 ms to decode from base64 and 0.4 ms to count (against ~50 ms for 2 MB of numbers).
INLINE_TEXT_BYTES = 2 << 20
INLINE_VALUES = 4096
INLINE_ELEMENTS = 1 << 16  # numbers an answer may hold and still be written in place
PACK_MIN = 64  # lists of fewer numbers stay lists (shapes, parameters, a few values)
WORKERS = 2
_T = TypeVar("_T")


def light(raw: bytes | bytearray) -> bool:
    """Whether a body is parsed and walked in place: small, or few values (base64 images)."""
    size = len(raw)
    return size <= INLINE_BYTES or (size <= INLINE_TEXT_BYTES and raw.count(b",") < INLINE_VALUES)


def parse(raw: bytes | bytearray) -> Any:
    """JSON (NaN/Infinity allowed, as TF Serving) or 400."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        if "4300 digits" in str(e):  # Python's own limit on converting an integer
            raise ApiError(400, "JSON Parse error: a number has more than 4300 digits") from None
        raise ApiError(400, f"JSON Parse error: {e}") from None
    except RecursionError:
        raise ApiError(400, "JSON Parse error: nested too deeply") from None


def pack(tree: Any) -> Any:
    """``tree`` with each list of ``PACK_MIN`` or more numbers (any nesting) as a numpy array.

    A list packs when numpy makes a number or boolean array of it: the array its consumer would
    make with ``np.asarray``. Ragged lists, strings, objects, integers past 64 bits stay lists
    (their elements are packed in turn).
    """
    if isinstance(tree, dict):
        return {k: pack(v) for k, v in tree.items()}
    if not isinstance(tree, list):
        return tree
    try:
        array = np.asarray(tree)
    except (ValueError, TypeError, OverflowError):  # ragged, or too deep for numpy
        array = None
    if array is not None and array.dtype.kind in "biuf":
        return array if array.size >= PACK_MIN else tree
    return [pack(v) for v in tree]


def encode(body: Any) -> bytes:
    """``body`` as compact JSON; numpy arrays and scalars as their lists and numbers."""
    return json.dumps(body, separators=(",", ":"), default=_plain).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _parse_packed(raw: bytes | bytearray, check: Callable[[Any], None] | None) -> Any:
    """A worker's task: parse, check, then pack (unpacked if packing recurses too deep)."""
    tree = parse(raw)
    if check is not None:
        check(tree)
    try:
        return pack(tree)
    except RecursionError:
        return tree


def _noop() -> None:
    """A task that starts a worker (the first one imports this module)."""


class JsonWorkers:
    """Parses bodies and writes answers, in place or in worker processes (module docstring)."""

    def __init__(self, workers: int = WORKERS):
        """Starts nothing until ``start`` or the first large body."""
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload([__name__])
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers,
                    mp_context=ctx,
                    initializer=exit_with_parent,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def start(self) -> concurrent.futures.Future:
        """Starts the workers now (the first start imports JAX there: seconds)."""
        return self._executor().submit(_noop)

    async def loads(
        self,
        raw: bytes | bytearray,
        check: Callable[[Any], None] | None = None,
        large: bool | None = None,
    ) -> Any:
        """The JSON document of a request body; 400 if it is not JSON.

        ``check(document)`` (a module-level function: it may run in a worker) raises
        ``ApiError`` for what no model can take, before the document comes back. ``large``:
        ``not light(raw)``, when the caller knows it already.
        """
        if large is None:
            large = not light(raw)
        if not large:
            tree = parse(raw)
            if check is not None:
                check(tree)
            return tree
        return await self._run(_parse_packed, raw, check)

    @staticmethod
    async def walk(large: bool, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, Python work over a parsed body or an answer: in a thread when
        ``large`` (the loop answers others meanwhile), else in place (a thread hop would cost
        a small request more than the work)."""
        if large:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def dumps(self, body: Any, numbers: int) -> bytes:
        """``body`` as JSON text (``numbers``: how many numbers its arrays hold)."""
        if numbers <= INLINE_ELEMENTS:
            return encode(body)
        return await self._run(encode, body)

    async def _run(self, fn: Any, *args: Any) -> Any:
        pool = self._executor()
        try:
            try:
                return await asyncio.wrap_future(pool.submit(fn, *args))
            finally:
                # The executor's feeder thread keeps the last task it sent, pickled (the whole
                # body), until it sends another: a no-op lets it go (measured: 64 MB held),
                # after an answer or an error (a 400 from the worker held it before).
                with contextlib.suppress(RuntimeError, BrokenProcessPool):
                    pool.submit(_noop)
        except BrokenProcessPool:
            with self._lock:  # the next request gets new workers
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise ApiError(
                503,
                "The JSON worker process ended (out of memory?) while handling this request; retry",
            ) from None

    def close(self) -> None:
        """Stops the workers and waits for them to end (queued work is dropped)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            # Waiting costs nothing at exit (the interpreter joins the workers anyway) and
            # frees the pool's semaphores; without it multiprocessing warned of leaked ones.
            pool.shutdown(wait=True, cancel_futures=True)
