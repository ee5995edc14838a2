"""Freed memory handed back to the system after large requests.

glibc's allocator keeps freed memory for reuse: after a 60 MB body (the bytes, their pickled
copy for a JSON worker, the socket buffers) the server's resident memory stayed 70-150 MB above
its start once earlier requests had fragmented the heap (measured in the server-attack tests on
a 2-core runner). ``malloc_trim`` returns every free page of every arena, the middle of the
heap included; nothing in Python or the standard library does, so it is called through ctypes.
Elsewhere than glibc (musl, macOS) this does nothing.

glibc also raises its mmap threshold (up to 32 MiB) each time a large block is freed, after
which blocks of up to that size come from the heap instead of mappings of their own; the heap's
pages around them cannot all be handed back. With the threshold moving, the server-attack
tests measured the anonymous RSS 26-36 MiB above its start after a 60 MB JSON body that
followed the other attacks (trims included); with it fixed at 1 MiB, back below its start (the
same tests, the same loaded 2-core machine). So the server fixes it (``fix_mmap_threshold``),
unless the operator set ``MALLOC_MMAP_THRESHOLD_`` themselves. A block of 1 MiB or more is then
its own mapping, returned when freed; the cost is a mapping and its page faults per such block
(XLA:CPU's buffers of a served model included): microseconds per MiB, against the milliseconds
a model that has such buffers takes per call.

A large request's memory is not all freed when it is answered (the JSON worker's feeder thread,
the connection's buffers and the event loop let go of theirs a little later), so a large
request starts a short schedule of trims, ``SCHEDULE_S`` after it, restarted by the next one:
the idea of jemalloc's decay, which returns dirty pages over seconds rather than at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any

SCHEDULE_S = (0.0, 0.5, 2.0, 8.0)  # seconds after the latest large request
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

_lock = threading.Lock()
_again = threading.Event()  # a large request ended while a schedule runs: start it over
_running = False


def _trim_function() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


_TRIM = _trim_function()


def _mallopt_function() -> Any:
    """glibc's ``mallopt``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "mallopt", None)
    except OSError:
        return None


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Makes every block of ``threshold`` bytes or more a mapping of its own, for good (module
    docstring); False where there is no glibc or ``MALLOC_MMAP_THRESHOLD_`` is set (the
    operator's choice stands)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _mallopt_function()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def give_back() -> bool:
    """Returns the allocator's free pages to the system now; False where there is no glibc."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def _schedule() -> None:
    global _running
    while True:
        _again.clear()
        previous = 0.0
        for at in SCHEDULE_S:
            if _again.wait(at - previous):
                break  # another large request: from the start
            previous = at
            give_back()
        else:
            with _lock:
                if not _again.is_set():
                    _running = False
                    return


def give_back_soon() -> None:
    """Trims now and over the next seconds (module docstring), in a background thread (a trim
    walks the whole heap: not on the event loop); one schedule at a time, however many large
    requests end meanwhile."""
    global _running
    if _TRIM is None:
        return
    with _lock:
        _again.set()
        if _running:
            return
        _running = True
    threading.Thread(target=_schedule, name="malloc-trim", daemon=True).start()
