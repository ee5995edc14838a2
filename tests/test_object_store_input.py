"""Training input from object stores (fake-gcs-server, moto): batched concurrent reads, exact
resume after a SIGKILL, memory that does not grow with the epochs."""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from estimax.data import loader as L
from estimax.data import shard_index, tfrecord

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_FILE = (9, 14, 7)


def _write(root: str, payload: int = 100) -> list[str]:
    files = []
    for f, n in enumerate(PER_FILE):
        path = f"{root}/data/{tfrecord.sharded_name('train', f, len(PER_FILE))}"
        with tfrecord.TFRecordWriter(path) as w:
            for i in range(n):
                w.write(struct.pack("<q", f * 1000 + i) + bytes(payload))
        shard_index.write_index(path)
        files.append(path)
    return files


def _ids_transform(record: bytes, rng: np.random.Generator):
    return np.array([struct.unpack("<q", record[:8])[0], rng.integers(1 << 30)], np.int64)


def test_read_many_reads_each_record_once_coalescing_neighbours(object_store, monkeypatch):
    root, _ = object_store
    files = _write(root)
    source = L.TFRecordSource(files)
    assert source.read_ahead  # remote files: workers read chunks ahead
    want = {i: source[i] for i in range(len(source))}
    fs = source._record_files[0]._fs
    calls = []
    cat_ranges = fs.cat_ranges

    def spy(paths, starts, ends, **kw):
        calls.append(list(zip(paths, starts, ends, strict=True)))
        return cat_ranges(paths, starts, ends, **kw)

    monkeypatch.setattr(fs, "cat_ranges", spy)
    # Runs of neighbours in file 0 (records 0-2) and file 1 (its records 0-1), and two loners.
    ids = [0, 1, 2, 20, 9, 10, 5]
    assert source.read_many(ids) == [want[i] for i in ids]
    assert len(calls) == 1  # one concurrent call for the chunk
    assert len(calls[0]) == 4  # 7 records in 4 ranges
    record = 12 + 108 + 4  # framed: header, id + payload, footer
    assert sum(end - start for _, start, end in calls[0]) == 7 * record  # no byte twice


CHILD = """
import faulthandler
import json, struct, sys

import numpy as np

from estimax.data import loader, tfrecord


def transform(record, rng):
    return np.array([struct.unpack("<q", record[:8])[0], rng.integers(1 << 30)], np.int64)


if __name__ == "__main__":
    # A hang shows where every thread waits (on stderr, which the test prints), not only a timeout.
    faulthandler.dump_traceback_later(240, exit=True)
    files = tfrecord.list_files(sys.argv[1] + "/data/train-*")
    it = iter(loader.Loader(loader.TFRecordSource(files), transform, 4, shuffle=True, seed=3,
                            num_workers=2, worker_type="process", chunk_size=2))
    for k in range(int(sys.argv[2])):
        batch = next(it)
        print(json.dumps({"ids": batch[:, 0].tolist(), "r": batch[:, 1].tolist(),
                          "state": it.get_state()}), flush=True)
    sys.stdin.read()  # until killed, with reads and batches still in flight
"""


def _batches(it, n):
    return [next(it).tolist() for _ in range(n)]


def test_a_sigkilled_reader_resumes_exactly_from_its_saved_position(object_store, tmp_path):
    root, _ = object_store
    files = _write(root)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, str(script), root, "13"],  # 13 batches of 4: across two epochs of 30
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline() or "{}") for _ in range(13)]
        assert all(lines), proc.stderr.read() if proc.poll() is not None else "no output"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def loader():
        return L.Loader(
            L.TFRecordSource(files), _ids_transform, 4, shuffle=True, seed=3, num_workers=2
        )

    straight = _batches(iter(loader()), 20)
    killed = [np.stack([ln["ids"], ln["r"]], 1).tolist() for ln in lines]
    assert killed == straight[:13]
    resumed = iter(loader())
    resumed.set_state(lines[-1]["state"])
    assert _batches(resumed, 7) == straight[13:]
    resumed.close()


MEMORY_CHILD = """
import faulthandler
import sys

import numpy as np

from estimax.data import loader, tfrecord


def transform(record, rng):
    return np.frombuffer(record, np.uint8)[:4096].copy()


if __name__ == "__main__":
    # A hang shows where every thread waits (on stderr, which the test prints), not only a timeout.
    faulthandler.dump_traceback_later(240, exit=True)
    files = tfrecord.list_files(sys.argv[1] + "/data/train-*")
    source = loader.TFRecordSource(files)
    it = iter(loader.Loader(source, transform, 6, shuffle=True, seed=0, num_workers=2,
                            worker_type=sys.argv[2], chunk_size=3))
    per_epoch = len(source) // 6
    for epoch in range(int(sys.argv[3])):
        for _ in range(per_epoch):
            next(it)
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so it would start at the
        # pytest worker's peak and hide any growth below it.
        with open("/proc/self/status") as f:
            own = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
        print(epoch, own, flush=True)
"""


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_peak_memory_does_not_grow_with_the_epochs(object_store, tmp_path, worker_type):
    # 30 records of ~200 KB (6 MB an epoch); 16 epochs read ~96 MB from the store. A cache of
    # what was read, or per-epoch state that piles up, would show as growth after epoch 3.
    root, _ = object_store
    _write(root, payload=200_000)
    script = tmp_path / "memory_child.py"
    script.write_text(textwrap.dedent(MEMORY_CHILD))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(script), root, worker_type, "16"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    peak = [int(line.split()[1]) for line in out.stdout.splitlines()]  # KiB
    assert len(peak) == 16
    assert peak[-1] - peak[3] < 12 * 1024, peak  # less than two epochs' bytes, in KiB


def test_a_bucket_backed_training_reads_no_shard_in_full_before_its_first_batch(
    gcs_emulator, monkeypatch, caplog, disk_with_room
):
    import uuid

    from conftest import point_clients_at
    from counting_proxy import CountingProxy

    from estimax import storage
    from estimax.data import imagenet, tfrecord
    from estimax.tools import convert

    caplog.set_level(logging.INFO, logger="estimax.data.sources")
    bucket = f"estimax-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(bucket)
    point_clients_at(monkeypatch, "gs", gcs_emulator.url)
    data_dir = f"gs://{bucket}/imagenet"
    # The converter writes straight into the bucket: 4 shards of 64 images, each with its index.
    args = ["--train_examples=256", "--validation_examples=0", "--train_shards=4"]
    args += ["--min_size=40", "--max_size=64", "--num_workers=1", "--no_progress"]
    assert convert.main(["fake-imagenet", f"--output_dir={data_dir}", *args]) == 0
    fs, root = storage.filesystem(data_dir)
    listed = fs.ls(root, detail=True) + fs.ls(f"{root}/.estimax-index", detail=True)
    sizes = {e["name"].split("/", 1)[1]: e["size"] for e in listed if e["type"] == "file"}
    shards = sorted(n for n in sizes if n.startswith("imagenet/train-"))
    idx = {n: tfrecord.hidden_index_path(n) for n in shards}  # in the hidden folder
    assert len(shards) == 4 and all(idx[n] in sizes for n in shards)
    # The job's own index folder (<model_dir>/shard_indexes), as the programs give it.
    index_dir = f"gs://{bucket}/model/shard_indexes"

    def first_batch_reads() -> tuple[dict[str, int], dict[str, int]]:
        """Bytes and requests of each object until the first batch is out."""
        proxy = CountingProxy(gcs_emulator.url)
        point_clients_at(monkeypatch, "gs", proxy.url)
        try:
            fn = imagenet.input_fn(
                data_dir, True, image_size=32, num_parallel_calls=2, index_dir=index_dir
            )
            it = iter(fn({"batch_size": 8}))
            images, _ = next(it)
            assert images.shape == (8, 32, 32, 3)
            it.close()
            return dict(proxy.read), dict(proxy.requests)
        finally:
            proxy.stop()

    read, requests = first_batch_reads()
    assert "indexed" not in caplog.text
    for name in shards:
        # Only the records it needs (a batch and the read-ahead), fewer than half of them:
        # never the whole shard, nor a request per record to find them.
        assert read.get(name, 0) < sizes[name] / 2, (name, read.get(name), sizes[name])
        assert requests.get(name, 0) < 32, requests
        assert read[idx[name]] == sizes[idx[name]]  # its index, read once
    # Without the index files the same input reads each shard once, whole, to index it; keeps
    # what it read for its own reads (nothing pulled twice); and writes the indexes into the
    # job's index folder (never into the data's).
    point_clients_at(monkeypatch, "gs", gcs_emulator.url)
    fs, _ = storage.filesystem(data_dir)
    for name in shards:
        fs.rm(f"{bucket}/{idx[name]}")
    read, requests = first_batch_reads()
    assert all(read[name] == sizes[name] for name in shards), (read, sizes)
    said = [r for r in caplog.records if r.name == "estimax.data.sources"]
    assert [r.getMessage().split(":")[0] for r in said] == [
        "4 of 4 shards have no usable .idx index file"
    ]
    line = said[0].getMessage()
    assert said[0].levelname == "WARNING"
    assert f"({sum(sizes[n] for n in shards) / 1e6:.1f} MB" in line
    assert f"`estimax-convert index '{data_dir}/train-0000*'`" in line
    assert all(requests[name] < 32 for name in shards), requests
    point_clients_at(monkeypatch, "gs", gcs_emulator.url)
    fs, _ = storage.filesystem(data_dir)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/.estimax-index") or not fs.ls(f"{root}/.estimax-index")
    assert len(fs.ls(index_dir.removeprefix("gs://"))) == 4
    # The next start finds the indexes in the job's folder, and reads only what it needs.
    caplog.clear()
    read, _ = first_batch_reads()
    assert not [r for r in caplog.records if r.name == "estimax.data.sources"]
    assert all(read.get(name, 0) < sizes[name] / 2 for name in shards), (read, sizes)


class _CountingSource:
    """A source that wants read-ahead; records which chunks were read."""

    read_ahead = True

    def __init__(self):
        self.calls: list[list[int]] = []

    def read_many(self, ids):
        self.calls.append(list(ids))
        return [b"r%d" % i for i in ids]


def test_read_ahead_reads_a_window_of_chunks_ahead_of_their_decoding():
    import concurrent.futures

    from estimax.data.read_ahead import ReadAhead

    source = _CountingSource()
    ahead = ReadAhead(source, depth=2)
    takes = [ahead.start([i]) for i in range(6)]
    assert ahead.in_window == 2  # chunks 0 and 1 begun; 2-5 wait
    assert takes[0]() == [b"r0"]
    assert ahead.in_window == 2  # 0 taken: 2 begun
    assert takes[5]() == [b"r5"]  # its decoding came first: begun then, the window unchanged
    assert ahead.in_window == 2
    ahead.close()
    # Never begun: never read, and their decoding learns the loader stopped.
    with pytest.raises(concurrent.futures.CancelledError):
        takes[3]()
    read = {c[0] for c in source.calls}
    assert {0, 5} <= read <= {0, 1, 2, 5}


def test_reads_queued_when_the_pool_shuts_down_fail_instead_of_hanging():
    # At interpreter exit concurrent.futures shuts every thread pool down while the loader's
    # threads may still decode: a read begun then must fail, or its chunk's decoding (and the
    # exit, which joins that thread) waits forever. Seen in CI: a child hung at exit for 240 s.
    from estimax.data.read_ahead import ReadAhead

    ahead = ReadAhead(_CountingSource(), depth=1)
    first, second = ahead.start([0]), ahead.start([1])
    assert first.args[0].future.result(timeout=60) == [b"r0"]  # begun and read
    ahead._pool.shutdown(wait=True)  # noqa: SLF001 - as interpreter exit does to every pool
    assert first() == [b"r0"]  # taking it begins the next read, which cannot be scheduled
    assert second.args[0].future.done()  # failed at once: nothing waits on it forever
    with pytest.raises(RuntimeError, match="cannot schedule new futures"):
        second()


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_an_epoch_at_object_store_latency_reads_each_record_once(
    gcs_emulator, monkeypatch, worker_type
):
    import uuid

    from conftest import point_clients_at
    from counting_proxy import CountingProxy

    from estimax.data import produce
    from estimax.data.read_ahead import CHUNKS_PER_WORKER

    bucket = f"estimax-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(bucket)
    point_clients_at(monkeypatch, "gs", gcs_emulator.url)
    files = _write(f"gs://{bucket}")
    offsets = {f.split("/", 3)[3]: tfrecord.RecordFile(f).offsets for f in files}
    total = sum(PER_FILE)  # 30 records
    # Every request held 20 ms, as an object store's first byte.
    proxy = CountingProxy(gcs_emulator.url, delay=0.02)
    point_clients_at(monkeypatch, "gs", proxy.url)
    try:
        source = L.TFRecordSource(files)
        loader = L.Loader(
            source, _ids_transform, 3, shuffle=True, seed=5, num_workers=2,
            worker_type=worker_type, chunk_size=2,
        )  # fmt: skip
        it = iter(loader)
        seen = [i for _ in range(total // 3) for i in next(it)[:, 0].tolist()]
        it.close()
        ranges = list(proxy.ranges)
    finally:
        proxy.stop()
    assert sorted(seen) == sorted(f * 1000 + i for f, n in enumerate(PER_FILE) for i in range(n))
    fetched: dict[tuple[str, int], int] = {}
    for name, byte_range in ranges:
        if name in offsets:  # a shard (not an index file): the records its range covers
            lo, hi = (int(x) for x in byte_range.split("=")[1].split("-"))
            for j, (a, b) in enumerate(zip(offsets[name][:-1], offsets[name][1:], strict=True)):
                if lo <= a and b <= hi + 1:
                    fetched[(name, j)] = fetched.get((name, j), 0) + 1
    # One epoch used: every record read, and beyond it (read for nothing when the run stops) at
    # most the batches decoded ahead and the read-ahead's window, whatever the latency.
    window = CHUNKS_PER_WORKER * 2 * 2  # chunks per worker x workers x records per chunk
    ahead = produce._blocks_in_flight(loader) * 3  # batches decoded ahead (slots) x batch
    assert len(fetched) == total
    assert total <= sum(fetched.values()) <= total + ahead + window, (fetched, ahead, window)
