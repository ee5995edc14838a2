"""Input faults: a record whose data CRC is wrong, a shard replaced while training reads it, a
worker process killed. Each ends as designed: exactly the bad record skipped (everywhere), or
one error that names the shard or says the worker died, never a traceback of pipe errors.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from estimax.data import chunks, example, shard_index, tfrecord, workers
from estimax.data import loader as L
from estimax.programs import cli, mnist
from estimax.tools import mnist_data

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# ------------------------------------------------------------- one record's data CRC wrong


def _mnist_file(path: str, count: int = 10) -> np.ndarray:
    images = np.arange(count * 784, dtype=np.int64).reshape(count, 784).astype(np.uint8)
    labels = np.arange(count) % 10
    mnist_data.write_tfrecords(path, images, labels)
    return labels


def _flip_data_byte(path: str, record: int) -> int:
    """Flips a byte inside record ``record``'s data (its framing intact); its offset."""
    offsets = tfrecord.record_offsets(path)
    with open(path, "r+b") as f:
        f.seek(int(offsets[record]) + 12 + 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    return int(offsets[record])


def test_a_record_with_a_wrong_data_crc_is_skipped_alone_everywhere(tmp_path, caplog):
    path = str(tmp_path / "train.tfrecords")
    labels = _mnist_file(path)
    offset = _flip_data_byte(path, 3)
    kept = [int(x) for i, x in enumerate(labels) if i != 3]

    # The reading API: the one record, then the rest.
    bad: list[tfrecord.CorruptRecordError] = []
    records = list(tfrecord.read_records(path, on_bad_record=bad.append))
    assert [int(example.decode_example(r)["label"][0]) for r in records] == kept
    assert [(e.offset, e.problem.split(" (")[0]) for e in bad] == [(offset, "data CRC mismatch")]

    # The MNIST program's reader (--skip_bad_records) and the loader skip the same record.
    caplog.set_level(logging.WARNING)
    _, got = mnist.load_tfrecords(path, skip_bad_records=True)
    assert got.tolist() == kept
    assert (
        f"Skipped a damaged record (--skip_bad_records): {path}: record at byte offset "
        f"{offset}: data CRC mismatch" in caplog.text
    )
    assert "Skipped 1 bad records of" in caplog.text

    def label(record, rng):
        return np.int32(example.decode_example(record)["label"][0])

    ld = L.Loader(
        L.TFRecordSource([path]), label, 1, shuffle=False, num_epochs=1, num_workers=0,
        skip_bad_records=True, drop_remainder=False,
    )  # fmt: skip
    it = iter(ld)
    assert [int(b[0]) for b in it] == kept and it.num_skipped == 1

    # Without the flag: one line naming the record, and what the flag would do.
    with pytest.raises(cli.UsageError) as refused:
        mnist.load_tfrecords(path)
    assert str(refused.value).startswith(f"{path}: record at byte offset {offset}: data CRC")
    assert str(refused.value).endswith("(skip such records with --skip_bad_records).")


# ------------------------------------------------------------- a shard replaced while read


def _write(path: str, sizes: list[int], fill: int) -> None:
    with tfrecord.TFRecordWriter(path) as w:
        for n in sizes:
            w.write(bytes([fill]) * n)


def _first_byte(record: bytes, rng: np.random.Generator) -> np.ndarray:
    return np.asarray([record[0], len(record)], np.int64)


def _reading(path: str, skip_bad_records: bool) -> L.LoaderIterator:
    """A loader over the one shard ``path``, its first batch read (the file's first version)."""
    ld = L.Loader(
        L.TFRecordSource([path]), _first_byte, 2, shuffle=False, num_workers=0, prefetch=1,
        skip_bad_records=skip_bad_records,
    )  # fmt: skip
    it = iter(ld)
    assert next(it).tolist() == [[1, 40], [1, 40]]
    return it


@pytest.mark.parametrize("skip_bad_records", [False, True])
def test_a_local_shard_replaced_while_read_is_an_error_naming_it(tmp_path, skip_bad_records):
    path = str(tmp_path / "train-00000-of-00001")
    _write(path, [40] * 8, fill=1)
    it = _reading(path, skip_bad_records)
    # Another converter run writes the shard again: same size, same record sizes, other data,
    # renamed into place (as TFRecordWriter does). Without a check it is read on, silently.
    _write(path, [40] * 8, fill=2)
    with pytest.raises(tfrecord.ShardChangedError) as changed:
        for _ in range(20):
            next(it)
    assert str(changed.value).startswith(
        f"{path} changed while it was being read (replaced by another file of the same size)"
    )


# The same size in other records: the old offsets land inside records (the reader finds damage).
OTHER_RECORDS = [20, 60] + [40] * 6


@pytest.mark.parametrize("same_records", [False, True])
def test_a_shard_replaced_on_an_object_store_is_an_error_naming_it(
    object_store, tmp_path, monkeypatch, same_records
):
    base, _ = object_store
    path = f"{base}/train-00000-of-00001"
    local = str(tmp_path / "shard")
    _write(local, [40] * 8, fill=1)
    fs, key = tfrecord.storage.filesystem(path)
    fs.put_file(local, key)
    # Indexed, so its records are read from the bucket (an unindexed shard is streamed once into
    # a local copy that the run then reads: a snapshot no replacement reaches).
    shard_index.write_index(path)
    if same_records:  # nothing looks damaged: only the periodic check can tell
        monkeypatch.setattr(tfrecord, "RECHECK_SECS", 0.0)
    it = _reading(path, skip_bad_records=True)
    _write(local, [40] * 8 if same_records else OTHER_RECORDS, fill=2)
    assert os.path.getsize(local) == 8 * (40 + 16)
    fs.put_file(local, key)
    with pytest.raises(tfrecord.ShardChangedError) as changed:
        for _ in range(20):
            batch = next(it)
            assert batch[:, 0].tolist() == [1, 1]  # never the new file's records
    assert str(changed.value).startswith(f"{path} changed while it was being read (replaced: ")


# ------------------------------------------------------------- a worker process killed


def _wait_on_fifo(record: bytes, rng: np.random.Generator) -> np.ndarray:
    """Blocks until someone writes to the FIFO the record names (nobody does)."""
    with open(record.decode()) as f:
        f.read()
    return np.zeros(1)


def test_a_killed_worker_is_one_error_whichever_pipe_finds_it(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    pool = workers.ProcessWorkers(2, chunks.ChunkWorker([fifo.encode()], _wait_on_fifo, 0))
    task = chunks.TransformChunk(epochs=[0], record_ids=[0])
    try:
        # Waiting for the reply of a worker that dies meanwhile (blocked on the FIFO).
        pending = pool.submit(task)  # to worker 0: both are idle
        os.kill(pool._procs[0].pid, signal.SIGKILL)
        with pytest.raises(L.SourceError) as received:
            pending.result()
        # Sending to a dead worker (BrokenPipeError before): worker 1, the least busy.
        os.kill(pool._procs[1].pid, signal.SIGKILL)
        pool._procs[1].join()
        with pytest.raises(L.SourceError) as sent:
            pool.submit(task)
    finally:
        pool.shutdown()
    for error in (sent.value, received.value):
        assert str(error) == (
            "a loader worker process died (killed by SIGKILL: out of memory? Fewer or lighter "
            "workers need less); the input cannot go on"
        )


PROGRAM = """
import os, signal
import numpy as np
from estimax.data import loader
from estimax.programs import cli


def transform(record, rng):
    return np.zeros(4, np.float32)


def run(fv):
    ld = loader.Loader([b"x"] * 64, transform, 4, shuffle=False, num_workers=2,
                       worker_type="process", chunk_size=1)
    it = iter(ld)
    next(it)
    for proc in it._workers._procs:  # the OOM killer, say
        os.kill(proc.pid, signal.SIGKILL)
    while True:
        next(it)


if __name__ == "__main__":
    cli.main(lambda fv: None, run, "A program whose input workers are killed.")
"""


@pytest.mark.slow  # a child process with two worker processes
def test_a_program_whose_workers_are_killed_ends_in_one_line(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "FATAL: input: a loader worker process died (killed by SIGKILL: out of memory? Fewer or "
        "lighter workers need less); the input cannot go on"
    )
