"""Freed memory handed back to the system after large requests.

glibc's allocator keeps freed memory for reuse: after a 60 MB body (the bytes, their pickled
copy for a JSON worker, the socket buffers) the server's resident memory stayed 70-150 MB above
its start once earlier requests had fragmented the heap (measured in the server-attack tests on
a 2-core runner). ``malloc_trim`` returns every free page of every arena, the middle of the
heap included; nothing in Python or the standard library does, so it is called through ctypes.
Elsewhere than glibc (musl, macOS) this does nothing.

glibc's thresholds decide the rest. With its defaults, the mmap threshold moves (up to 32 MiB)
as large blocks are freed; fixed (as this server did at 1 MiB, to hand large bodies back), both
it and the trim threshold stop moving, so every block of a served model's XLA:CPU buffers above
1 MiB was a mapping of its own and the heap's top was handed back after each run: each request
then page-faulted its buffers anew. Measured on ResNet-50 at batch 1 (2 cores): 15,000 page
faults per request, the model's run 80-87 ms in the server against 43 ms in-process (issue 41's
gap to ONNX Runtime). So the server keeps freed memory as training does
(``keep_freed_memory``: both thresholds high and one arena, unless the operator set
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_ARENA_MAX``): 27 faults per
request, 44-48 ms. Large bodies go back all the same, through the trims below, which hand back
every free page whatever the thresholds.

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
# Blocks below this come from the heap (glibc caps it at HEAP_MAX / 2: 32 MiB on 64-bit; a
# larger block is a mapping of its own, handed back when freed); as estimax's training sets it.
KEEP_THRESHOLD_BYTES = 32 << 20
_NEVER_TRIM = (1 << 31) - 1  # the heap's free top is handed back by the trims, not on free
_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's own variables for these settings: where the operator set one, estimax sets none.
_OPERATORS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")

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
    """glibc's ``mallopt``, or None where the C library has none.

    Not ``estimax.ops.cpu_runtime.tune_cpu_allocator`` (training's same settings): importing
    ``estimax.ops`` loads its kernels and flax, and this module is imported where a process's
    heap is measured (tests/test_serving_memory.py), so it keeps to ctypes."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "mallopt", None)
    except OSError:
        return None


def keep_freed_memory(threshold: int = KEEP_THRESHOLD_BYTES) -> bool:
    """Keeps freed blocks of up to ``threshold`` bytes in the heap, and the heap's free top, for
    the next request to reuse (module docstring); False where there is no glibc or the operator
    set ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_ARENA_MAX`` (their
    choice stands)."""
    if any(name in os.environ for name in _OPERATORS):
        return False
    mallopt = _mallopt_function()
    if mallopt is None:
        return False
    # One arena: ``malloc_trim`` hands back a thread arena's free pages but never the free top
    # of its heap, which with the trim threshold high is handed back by nothing (measured: 30
    # MiB held after a 60 MB body, read and pickled off the main thread). Most allocations
    # here are Python's, made under the GIL anyway, and XLA:CPU's a few per run, so threads
    # sharing one arena wait little (measured: the same model times, ResNet-50 at batch 1,
    # and the body's memory back after the trims).
    one_arena = bool(mallopt(_M_ARENA_MAX, 1))
    kept = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    return bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)) and kept and one_arena


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
