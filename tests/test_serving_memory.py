"""The server hands freed memory back to the system after large requests (glibc only)."""

import subprocess
import sys
import textwrap
import threading

import pytest

from estimax.serving import memory

pytestmark = pytest.mark.skipif(memory._TRIM is None, reason="not glibc: no malloc_trim")

# Allocations between glibc's mmap thresholds, each pinned by a small one after it (as a
# server's heap is after a large body: freed buffers among live objects), then freed.
FRAGMENTED = textwrap.dedent(
    """
    import sys
    from estimax.serving import memory

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) >> 10

    # Freeing a 16 MiB buffer raises glibc's mmap threshold past 512 KiB (as a large body
    # does): the buffers below then come from the heap, not from mappings of their own.
    first = bytearray(16 << 20)
    del first
    big, pins = [], []
    for i in range(200):
        big.append(bytearray(512 << 10))
        big[-1][::4096] = b"x" * len(range(0, 512 << 10, 4096))  # touched: resident
        pins.append(bytearray(b"p" * 600))
    loaded = anon()
    del big
    freed = anon()
    assert memory.give_back()
    print(loaded, freed, anon())
    """
)


def test_freed_fragmented_memory_goes_back_to_the_system():
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, check=True
    ).stdout
    loaded, freed, trimmed = map(int, out.split())
    assert loaded >= 90, out  # 100 MiB were resident
    assert freed > loaded // 2, out  # free() alone kept most of it (the reason for the trim)
    assert trimmed < freed - 50, out  # malloc_trim gave it back


def test_a_large_request_starts_one_schedule_of_trims(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_TRIM", calls.append)
    monkeypatch.setattr(memory, "SCHEDULE_S", (0.0, 0.01, 0.02))
    memory.give_back_soon()
    memory.give_back_soon()  # while the first schedule runs: it starts over, no second thread
    assert sum(t.name == "malloc-trim" for t in threading.enumerate()) <= 1
    for t in threading.enumerate():
        if t.name == "malloc-trim":
            t.join()
    # One whole schedule after the last request (3 trims), plus what ran before it restarted.
    assert 3 <= len(calls) <= 6 and set(calls) == {0}
    assert memory._running is False


# A served model's runs: each allocates its buffers (here one of 8 MiB, written, as XLA:CPU's
# are) and frees them; the page faults of the last 20 runs say whether the pages were reused.
REUSE = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from estimax.serving import memory

    if sys.argv[1] == "kept":
        assert memory.keep_freed_memory()
    else:  # what the server did before: every block of 1 MiB or more a mapping of its own
        assert memory._mallopt_function()(memory._M_MMAP_THRESHOLD, 1 << 20)

    def run():
        buffer = np.empty(8 << 20, np.uint8)
        buffer.fill(1)
        del buffer

    run()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        run()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True
    ).stdout
    return int(out)


def test_a_served_models_buffers_are_reused_not_faulted_anew_each_run():
    # Each run's 8 MiB faulted anew when it is a fresh mapping (the ResNet-50 server measured
    # 15,000 faults a request and twice the in-process time): here 10,320 in 20 runs, fewer
    # than 2,048 a run where the kernel backs the mapping with huge pages; kept: 0.
    fixed, kept = _faults("fixed"), _faults("kept")
    assert fixed >= 20 * 256, fixed  # at least 1 MiB of pages a run
    assert kept < fixed / 20, (kept, fixed)  # fewer in 20 runs than one run's when mapped


def test_the_operators_malloc_settings_stand(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert memory.keep_freed_memory() is False
