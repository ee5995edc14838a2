"""Batch slots (estimax.data.slots): workers write into shared batches; bounded; always freed."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from estimax.data import loader as L

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = [struct.pack("<q", i) for i in range(40)]


def _transform(record: bytes, rng: np.random.Generator):
    (rid,) = struct.unpack("<q", record)
    return np.full((4, 4, 3), rid, np.int32), {"id": np.int64(rid), "r": rng.integers(1 << 20)}


def _loader(**kw):
    kw.setdefault("num_workers", 2)
    kw.setdefault("worker_type", "process")
    return L.Loader(RECORDS, _transform, 4, shuffle=True, seed=5, chunk_size=2, **kw)


def _check(batch) -> None:
    """Every row's pixels are its record's id: the row was written whole, by its own record."""
    images, meta = batch
    assert images.shape == (4, 4, 4, 3) and meta["id"].shape == (4,)
    np.testing.assert_array_equal(images[:, 0, 0, 0], meta["id"])
    assert (images == images[:, :1, :1, :1]).all()


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_kept_batch_is_never_overwritten_and_matches_in_process(worker_type):
    want = [tuple(_copy(b)) for b, _ in zip(_loader(num_workers=0), range(30), strict=False)]
    it = iter(_loader(worker_type=worker_type))
    kept = next(it)
    first = _copy(kept)
    for k in range(1, 30):  # many more batches than slots stream past the kept one
        batch = next(it)
        _check(batch)
        np.testing.assert_array_equal(batch[0], want[k][0])
        np.testing.assert_array_equal(batch[1]["r"], want[k][1]["r"])
        del batch
    np.testing.assert_array_equal(kept[0], first[0])
    np.testing.assert_array_equal(kept[1]["id"], first[1]["id"])
    np.testing.assert_array_equal(first[0], want[0][0])
    it.close()


def _copy(batch):
    images, meta = batch
    return images.copy(), {k: v.copy() for k, v in meta.items()}


def test_slots_are_reused_when_batches_are_dropped_and_grow_when_kept():
    it = iter(_loader())
    seen = set()
    for _ in range(30):
        images, _ = next(it)
        seen.add(images.__array_interface__["data"][0])
        del images
    pool = it._pools[0]
    # Reused: 30 batches came from at most the pool's limit of slots.
    assert len(seen) <= len(pool) <= pool.limit
    # A consumer that keeps every batch (list() of a pass) gets them all: the pool grows.
    kept = list(_loader(num_epochs=1, drop_remainder=False))
    assert len(kept) == 10
    for batch in kept:
        _check(batch)
    assert sorted(np.concatenate([b[1]["id"] for b in kept]).tolist()) == list(range(40))
    it.close()


def _shm_names(pool) -> list[str]:
    return [f"/dev/shm/{pool.name(i).lstrip('/')}" for i in range(len(pool))]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory in /dev/shm")
def test_close_frees_the_shared_slots_even_with_a_batch_still_held():
    it = iter(_loader())
    held = next(it)
    names = _shm_names(it._pools[0])
    assert names and all(os.path.exists(n) for n in names)
    it.close()
    assert not any(os.path.exists(n) for n in names)
    _check(held)  # still readable: its mapping lives as long as the batch


CHILD = """
import sys

from estimax.data import loader
import numpy as np


def transform(record, rng):
    return np.zeros((8, 8), np.uint8) + record[0]


if __name__ == "__main__":
    it = iter(loader.Loader([b"a"] * 64, transform, 4, shuffle=False, num_workers=2,
                            worker_type="process", chunk_size=2))
    batch = next(it)
    pool = it._pools[0]
    with open(sys.argv[1], "w") as f:
        f.write("\\n".join(pool.name(i) for i in range(len(pool))))
    sys.stdin.read()  # until killed
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory in /dev/shm")
def test_a_sigkilled_loader_leaves_no_shared_slot_behind(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    names_file = tmp_path / "names"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(names_file)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (names_file.exists() and names_file.read_text()):
            assert proc.poll() is None, "the loader's process ended before it could be killed"
            assert time.monotonic() < deadline, "the child never wrote its slots"
            time.sleep(0.1)
        paths = [f"/dev/shm/{n.lstrip('/')}" for n in names_file.read_text().split()]
        assert paths and all(os.path.exists(p) for p in paths)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # multiprocessing's resource tracker unlinks what its dead owner left, once the workers
        # (worker_exit) and the forkserver are gone.
        deadline = time.monotonic() + 60
        while any(os.path.exists(p) for p in paths):
            assert time.monotonic() < deadline, [p for p in paths if os.path.exists(p)]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _env_transform(record: bytes, rng: np.random.Generator):
    return np.int64(os.environ.get("ESTIMAX_TEST_WORKER_ENV", "-1"))


def test_process_workers_see_the_environment_of_now_not_the_forkservers(monkeypatch):
    # The forkserver is already running (earlier loaders, or this one) with its own environment;
    # storage clients in the workers must still see what is set now (STORAGE_EMULATOR_HOST...).
    first = iter(
        L.Loader(RECORDS, _env_transform, 4, shuffle=False, num_workers=2, worker_type="process")
    )
    assert next(first).tolist() == [-1] * 4
    first.close()
    monkeypatch.setenv("ESTIMAX_TEST_WORKER_ENV", "7")
    it = iter(
        L.Loader(RECORDS, _env_transform, 4, shuffle=False, num_workers=2, worker_type="process")
    )
    assert next(it).tolist() == [7] * 4
    it.close()
