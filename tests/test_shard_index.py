"""Index files of existing shards: checked against their shard (a cut or stale index is named and
rebuilt, never trusted), written by ``estimax-convert index`` (local, gs://, s3://; resumable,
--verify, processes, Beam), and for a job over unindexed bucket shards: each shard read once, in
all hosts together, and its reads served from what was read."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import struct
import threading
import uuid

import numpy as np
import pytest

from estimax.data import loader as L
from estimax.data import shard_index, tfrecord
from estimax.tools import convert

PER_FILE = (9, 14, 7)


def _write(root: str, payload: int = 100, index: bool = False) -> list[str]:
    files = []
    for f, n in enumerate(PER_FILE):
        path = f"{root}/data/{tfrecord.sharded_name('train', f, len(PER_FILE))}"
        with tfrecord.TFRecordWriter(path, index=index) as w:
            for i in range(n):
                w.write(struct.pack("<q", f * 1000 + i) + bytes(payload + i))
        files.append(path)
    return files


def _ids(record: bytes, rng: np.random.Generator) -> np.ndarray:
    return np.array([struct.unpack("<q", record[:8])[0]], np.int64)


def _eval_ids(files: list[str], index_dir: str | None = None) -> list[int]:
    """Every record id an eval pass (one pass, file order) over ``files`` yields."""
    source = L.TFRecordSource(files, index_dir=index_dir)
    it = iter(L.Loader(source, _ids, 4, shuffle=False, num_epochs=1, drop_remainder=False,
                       num_workers=0))  # fmt: skip
    return [int(i) for batch in it for i in batch[:, 0]]


def _idx(path: str) -> str:
    """Where estimax writes a shard's index: the hidden folder beside it."""
    return tfrecord.default_index_path(path)


ALL_IDS = [f * 1000 + i for f, n in enumerate(PER_FILE) for i in range(n)]


def test_a_cut_index_is_named_and_rebuilt_never_fewer_records(tmp_path, caplog):
    # Issue #42 item 11: an index cut to a few lines made an eval pass read those records only.
    files = _write(str(tmp_path), index=True)
    idx = _idx(files[1])
    lines = open(idx).read().splitlines()
    with open(idx, "w") as f:
        f.write("\n".join(lines[:5]) + "\n")  # 5 of its 14 records, and no trailer
    caplog.set_level(logging.INFO)
    assert _eval_ids(files) == ALL_IDS
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith(f"{idx} does not index {files[1]}: ")
    assert "its 5 records end at byte" in said[0]
    # A cut index with its trailer: its records still end before the shard does.
    with open(idx, "w") as f:
        f.write("\n".join(lines[:5] + lines[-1:]) + "\n")
    with pytest.raises(tfrecord.StaleIndexError, match="its 5 records end at byte"):
        tfrecord.RecordFile(files[1]).offsets  # noqa: B018
    # The same shard rewritten with other records after its index was written.
    shard_index.write_index(files[2])
    with tfrecord.TFRecordWriter(files[2]) as w:
        for i in range(3):
            w.write(struct.pack("<q", 2000 + i) + bytes(500))
    caplog.clear()
    assert _eval_ids(files) == ALL_IDS[: 9 + 14] + [2000, 2001, 2002]


def test_an_old_index_beside_its_shard_without_its_trailer_is_read_when_it_fits(
    tmp_path, monkeypatch
):
    files = _write(str(tmp_path))
    for path in files:
        shard_index.write_index(path)
        lines = open(_idx(path)).read().splitlines()
        assert lines[-1].startswith("# estimax-index size=")
        os.remove(_idx(path))
        with open(path + ".idx", "w") as f:  # where, and as, earlier versions wrote them
            f.write("\n".join(lines[:-1]) + "\n")
    monkeypatch.setattr(tfrecord, "record_offsets", lambda *a, **k: 1 / 0)  # no rescan
    rf = tfrecord.RecordFile(files[0])
    assert rf.index_path == files[0] + ".idx" and len(rf) == PER_FILE[0]
    assert _eval_ids(files) == ALL_IDS
    # estimax's own glob never takes one for a shard.
    assert tfrecord.list_files(f"{tmp_path}/data/train-*") == files


def test_a_copied_shard_keeps_its_index_a_same_size_rewrite_does_not(tmp_path):
    files = _write(str(tmp_path / "a"))
    shard_index.write_index(files[0])
    os.makedirs(tmp_path / "b")
    copy = str(tmp_path / "b" / "shard")
    shutil.copyfile(files[0], copy)  # another mtime than the index records
    os.makedirs(os.path.dirname(_idx(copy)))
    shutil.copyfile(_idx(files[0]), _idx(copy))
    os.utime(copy, ns=(1, 1))
    assert len(tfrecord.RecordFile(copy)) == PER_FILE[0]  # its records are where it says
    # The same size, other records: 9 records of 100..108 bytes become one of the whole size.
    size = os.path.getsize(copy)
    with tfrecord.TFRecordWriter(copy) as w:
        w.write(bytes(size - 16))
    assert os.path.getsize(copy) == size
    with pytest.raises(tfrecord.StaleIndexError, match="record 0 is not where it says"):
        tfrecord.RecordFile(copy)


def test_index_command_indexes_each_shard_once_resumes_and_verifies(object_store, capsys):
    root, _ = object_store
    files = _write(root, payload=3000)
    shard_index.write_index(files[0])  # one already indexed: skipped
    want = {f: tfrecord.record_offsets(f, verify_crc=False) for f in files}
    before = open_text(_idx(files[0]))
    assert convert.main(["index", f"{root}/data/train-*", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "indexed 2 shards (21 records," in out and "1 already had an index" in out
    assert open_text(_idx(files[0])) == before
    for f in files:
        offsets, info = tfrecord.load_index(_idx(f))
        np.testing.assert_array_equal(offsets, want[f])
        assert info.size == want[f][-1] and info.version  # the generation or ETag
    assert convert.main(["index", *files, "--no_progress"]) == 0  # idempotent
    assert "indexed 0 shards" in capsys.readouterr().out
    # --verify: a shard with a bad data CRC is named and gets no index; the others do.
    fs, fs_path = tfrecord._fs_and_path(files[1])  # noqa: SLF001
    blob = bytearray(fs.cat_file(fs_path))
    blob[int(want[files[1]][3]) + 20] ^= 0xFF  # inside record 3's data
    fs.pipe_file(fs_path, bytes(blob))
    fs.rm(_idx(fs_path))
    argv = ["index", f"{root}/data/train-*", "--verify", "--force", "--no_progress"]
    assert convert.main(argv) == 1
    err = capsys.readouterr().err
    assert f"PROBLEM: {files[1]}: record at byte offset {want[files[1]][3]}: data CRC" in err
    assert not fs.exists(_idx(fs_path)) and tfrecord.read_index(_idx(files[2])).size


def open_text(path: str) -> str:
    fs, fs_path = tfrecord._fs_and_path(path)  # noqa: SLF001
    return fs.cat_file(fs_path).decode()


def test_index_command_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert convert.main(["index", str(tmp_path / "nothing-*")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"estimax-convert index: error: no files match the pattern "
                   f"{str(tmp_path / 'nothing-*')!r}"]  # fmt: skip
    assert convert.main(["index", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "text").write_text("not a tfrecord file\n" * 3)
    assert convert.main(["index", str(tmp_path / "text"), "--no_progress"]) == 1
    assert "not a TFRecord file" in capsys.readouterr().err


def test_index_command_on_two_processes(tmp_path, capsys):
    files = _write(str(tmp_path), payload=2000)
    argv = ["index", *files, "--num_workers=2", "--connections=2", "--no_progress"]
    assert convert.main(argv) == 0
    assert "indexed 3 shards (30 records" in capsys.readouterr().out
    for f in files:
        np.testing.assert_array_equal(
            tfrecord.read_index(_idx(f)), tfrecord.record_offsets(f, verify_crc=False)
        )


def _bucket(gcs_emulator, monkeypatch) -> str:
    from conftest import point_clients_at

    bucket = f"estimax-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(bucket)
    point_clients_at(monkeypatch, "gs", gcs_emulator.url)
    return f"gs://{bucket}"


def test_a_job_over_unindexed_bucket_shards_pulls_each_once_and_serves_reads_from_it(
    gcs_emulator, monkeypatch, tmp_path, disk_with_room
):
    from conftest import point_clients_at
    from counting_proxy import CountingProxy

    root = _bucket(gcs_emulator, monkeypatch)
    files = _write(root, payload=20_000)
    sizes = {f.split("/", 3)[3]: shard_index._size(f) for f in files}  # noqa: SLF001
    proxy = CountingProxy(gcs_emulator.url)
    point_clients_at(monkeypatch, "gs", proxy.url)
    try:
        source = L.TFRecordSource(files, cache_dir=str(tmp_path))
        assert not source.read_ahead  # every shard's reads are local now
        it = iter(L.Loader(source, _ids, 5, shuffle=True, seed=1, num_workers=2))
        seen = [int(i) for _ in range(2 * len(source) // 5) for i in next(it)[:, 0]]
        it.close()
        read = {k: v for k, v in proxy.read.items() if not k.endswith(".idx")}
    finally:
        proxy.stop()
    assert sorted(seen) == sorted(ALL_IDS * 2)  # two epochs
    assert read == sizes  # each shard pulled once, whole, in two epochs
    # Not asked to write anywhere (no index_dir): the data folder is left as it was.
    assert all(shard_index.find_index(f) == [] for f in files)
    (copies,) = os.listdir(tmp_path)
    del source, it
    gc.collect()
    assert not os.path.exists(tmp_path / copies)  # the local copies go with the source


def test_a_short_local_disk_keeps_no_copies_says_so_once_and_reads_from_the_bucket(
    gcs_emulator, monkeypatch, tmp_path, caplog
):
    import collections

    from conftest import point_clients_at
    from counting_proxy import CountingProxy

    root = _bucket(gcs_emulator, monkeypatch)
    files = _write(root, payload=20_000)
    sizes = {f.split("/", 3)[3]: shard_index._size(f) for f in files}  # noqa: SLF001
    # A disk with 1 GiB free of 100: less than the 10 GiB the copies leave free.
    usage = collections.namedtuple("usage", "total used free")(100 << 30, 99 << 30, 1 << 30)
    monkeypatch.setattr(shard_index.shutil, "disk_usage", lambda path: usage)
    proxy = CountingProxy(gcs_emulator.url)
    point_clients_at(monkeypatch, "gs", proxy.url)
    caplog.set_level(logging.WARNING, logger="estimax.data.shard_index")
    try:
        source = L.TFRecordSource(files, cache_dir=str(tmp_path))
        assert source.read_ahead  # nothing kept: the records come from the bucket
        assert not any(os.listdir(d) for d in tmp_path.iterdir())
        said = [r.getMessage() for r in caplog.records if r.name == "estimax.data.shard_index"]
        assert len(said) == 1 and "disk" in said[0] and "1.0 GiB free" in said[0], said
        assert "10.0 GiB" in said[0] and "TMPDIR or cache_dir" in said[0]
        it = iter(L.Loader(source, _ids, 5, shuffle=True, seed=1, num_workers=2))
        seen = [int(i) for _ in range(len(source) // 5) for i in next(it)[:, 0]]
        it.close()
        read = {k: v for k, v in proxy.read.items() if not k.endswith(".idx")}
    finally:
        proxy.stop()
    assert sorted(seen) == sorted(ALL_IDS)  # every record, once an epoch
    assert all(read[k] > sizes[k] for k in sizes)  # pulled to index, then again to read


def test_hosts_split_the_indexing_n_hosts_pull_each_shard_once_in_all(
    gcs_emulator, monkeypatch, tmp_path
):
    from conftest import point_clients_at
    from counting_proxy import CountingProxy

    root = _bucket(gcs_emulator, monkeypatch)
    files = _write(root, payload=20_000)
    sizes = {f.split("/", 3)[3]: shard_index._size(f) for f in files}  # noqa: SLF001
    proxy = CountingProxy(gcs_emulator.url)
    point_clients_at(monkeypatch, "gs", proxy.url)
    sources: dict[int, L.TFRecordSource] = {}
    try:

        def host(h: int) -> None:
            sources[h] = L.TFRecordSource(
                files,
                host_index=h,
                num_hosts=2,
                keep_copies=False,
                cache_dir=str(tmp_path),
                index_dir=f"{root}/model/shard_indexes",  # as the programs give it
            )

        threads = [threading.Thread(target=host, args=(h,)) for h in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        read = {k: v for k, v in proxy.read.items() if not k.endswith(".idx")}
    finally:
        proxy.stop()
    assert read == sizes  # 1x in all, not 2x
    for h in range(2):
        assert [sources[h][i] for i in range(len(sources[h]))] == [
            sources[0][i] for i in range(len(sources[0]))
        ]


def test_a_read_only_bucket_is_indexed_once_by_all_hosts_into_the_jobs_index_dir(
    gcs_emulator, monkeypatch, tmp_path, caplog
):
    """Shards in a bucket the job may only read (someone else's data set): each host indexes
    its share into the job's index_dir (a bucket it may write, as <model_dir>/shard_indexes),
    takes the others' from there, and a later start pulls nothing to index; the command
    writes the same indexes there with --index_dir."""
    from conftest import point_clients_at
    from counting_proxy import CountingProxy

    root = _bucket(gcs_emulator, monkeypatch)
    files = _write(root, payload=20_000)
    sizes = {f.split("/", 3)[3]: shard_index._size(f) for f in files}  # noqa: SLF001
    model = f"estimax-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(model)
    index_dir = f"gs://{model}/run/shard_indexes"
    proxy = CountingProxy(gcs_emulator.url, read_only_buckets=(root.removeprefix("gs://"),))
    point_clients_at(monkeypatch, "gs", proxy.url)
    caplog.set_level(logging.WARNING)
    sources: dict[int, L.TFRecordSource] = {}
    try:

        def host(h: int) -> None:
            sources[h] = L.TFRecordSource(
                files, host_index=h, num_hosts=2, keep_copies=False, index_dir=index_dir
            )

        threads = [threading.Thread(target=host, args=(h,)) for h in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        read = {k: v for k, v in proxy.read.items() if not k.endswith(".idx")}
        assert not proxy.refused  # the job never even tried to write into the data's bucket
        assert read == sizes  # 1x in all
        for h in range(2):
            assert [sources[h][i] for i in range(len(sources[h]))] == [
                sources[0][i] for i in range(len(sources[0]))
            ]
        said = [r.getMessage() for r in caplog.records]
        assert any(f"their indexes written to {index_dir}" in m for m in said), said
        assert not any("every host reads every shard" in m for m in said), said
        written = sorted(os.path.basename(p) for p in tfrecord.list_files(f"{index_dir}/*.idx"))
        assert written == sorted(
            os.path.basename(shard_index.index_path_in(index_dir, f)) for f in files
        )
        # The next start (one host) finds them there: no shard is pulled to index it.
        proxy.reset()
        again = L.TFRecordSource(files, keep_copies=False, index_dir=index_dir)
        assert not {k for k in proxy.read if not k.endswith(".idx")}
        assert [again[i] for i in range(len(again))] == [
            sources[0][i] for i in range(len(sources[0]))
        ]
        # Without the index_dir nothing is written anywhere: said, and every host would read
        # every shard (here, the one host reads them all again).
        caplog.clear()
        proxy.reset()
        L.TFRecordSource(files, keep_copies=False)
        assert sum(v for k, v in proxy.read.items() if not k.endswith(".idx")) == sum(
            sizes.values()
        )
        assert any("their indexes kept nowhere" in r.getMessage() for r in caplog.records)
        # Told to write beside the data (index_beside_data), the refusal sends them to
        # index_dir: said in one line.
        caplog.clear()
        proxy.reset()
        fs, _ = tfrecord._fs_and_path(index_dir)  # noqa: SLF001
        fs.rm(index_dir, recursive=True)
        L.TFRecordSource(files, keep_copies=False, index_dir=index_dir, index_beside_data=True)
        assert proxy.refused  # the bucket is read-only: it refused the hidden index folder
        assert any(f"they are in {index_dir}" in r.getMessage() for r in caplog.records)
        assert not any(shard_index.find_index(f) for f in files) or all(
            shard_index.find_index(f) == [shard_index.index_path_in(index_dir, f)] for f in files
        )
        # The command without --index_dir writes into the folder of the shards: refused, named.
        proxy.reset()
        argv = ["index", f"{root}/data/train-*", "--force", "--no_progress"]
        assert convert.main(argv) == 1
        # The command with --index_dir: skips what is indexed there, indexes the rest there.
        gone = shard_index.index_path_in(index_dir, files[1])
        fs, fs_gone = tfrecord._fs_and_path(gone)  # noqa: SLF001
        fs.rm(fs_gone)
        proxy.reset()
        argv = ["index", f"{root}/data/train-*", f"--index_dir={index_dir}", "--no_progress"]
        assert convert.main(argv) == 0
        assert {k: v for k, v in proxy.read.items() if not k.endswith(".idx")} == {
            files[1].split("/", 3)[3]: sizes[files[1].split("/", 3)[3]]
        }
        fs.invalidate_cache()
        assert fs.exists(fs_gone)
    finally:
        proxy.stop()


def test_a_stale_bucket_index_is_rebuilt_into_the_jobs_index_dir(gcs_emulator, monkeypatch, caplog):
    root = _bucket(gcs_emulator, monkeypatch)
    files = _write(root, index=True)
    fs, fs_idx = tfrecord._fs_and_path(_idx(files[0]))  # noqa: SLF001
    lines = fs.cat_file(fs_idx).decode().splitlines()
    stale = ("\n".join(lines[:2]) + "\n").encode()
    fs.pipe_file(fs_idx, stale)
    caplog.set_level(logging.INFO)
    index_dir = f"{root}/model/shard_indexes"
    assert _eval_ids(files, index_dir) == ALL_IDS
    assert any(f"{_idx(files[0])} does not index {files[0]}" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    fs.invalidate_cache()
    assert fs.cat_file(fs_idx) == stale  # the data folder is not written
    # The fresh one in the job's folder is found past the stale one: nothing read to index.
    rf, _, why = shard_index.open_indexed(files[0], True, index_dir)
    assert rf is not None and rf.index_path == shard_index.index_path_in(index_dir, files[0])
    assert len(rf) == PER_FILE[0] and why == ""


def test_beam_index_runner_writes_the_same_indexes(tmp_path, capsys):
    if os.environ.get("ESTIMAX_REQUIRE_BEAM"):  # `make test` runs this in .venv-beam
        import apache_beam  # noqa: F401
    pytest.importorskip("apache_beam", reason="apache-beam runs in its own venv (.venv-beam)")
    files = _write(str(tmp_path), payload=500)
    argv = ["index", f"{tmp_path}/data/train-*", "--runner=DirectRunner", "--num_workers=2"]
    assert convert.main([*argv, "--no_progress"]) == 0
    assert "indexed 3 shards (30 records" in capsys.readouterr().out
    for f in files:
        np.testing.assert_array_equal(
            tfrecord.read_index(_idx(f)), tfrecord.record_offsets(f, verify_crc=False)
        )


def _index_in_thread(argv: list[str]) -> tuple[threading.Thread, dict]:
    """``estimax-convert index`` run in a thread: a FIFO it opened would block it for ever, so
    the caller joins it with a timeout (the test fails; it does not hang)."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(rc=convert.main(argv)), daemon=True)
    t.start()
    t.join(timeout=60)
    return t, out


def _unblock(fifo: str) -> None:
    """Opens the FIFO's other end, so that a reader stuck in its open (without the fix) goes."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as e:
        # ENXIO: no reader has the FIFO open (the fix refused it unopened); anything else is real.
        if e.errno != errno.ENXIO:
            raise


def test_index_command_refuses_a_fifo_shard_or_index_in_one_line(tmp_path, capsys):
    # Issue #54 cause 9: a FIFO among the globbed shards (or as a shard's index) blocked the
    # command for ever, silently.
    files = _write(str(tmp_path))
    fifo = f"{tmp_path}/data/train-00003-of-00004"
    os.mkfifo(fifo)
    try:
        t, out = _index_in_thread(["index", f"{tmp_path}/data/train-*", "--no_progress"])
        assert not t.is_alive(), "estimax-convert index hangs on a FIFO shard"
    finally:
        _unblock(fifo)
    assert out["rc"] == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"estimax-convert index: error: {fifo}: not a regular file (a FIFO); "
                   "give TFRecord shards and index files only"]  # fmt: skip
    os.remove(fifo)
    # A FIFO where a shard's index is looked up.
    os.makedirs(os.path.dirname(_idx(files[0])))
    os.mkfifo(_idx(files[0]))
    try:
        t, out = _index_in_thread(["index", files[0], "--no_progress"])
        assert not t.is_alive(), "estimax-convert index hangs on a FIFO index"
    finally:
        _unblock(_idx(files[0]))
    assert out["rc"] == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{_idx(files[0])}: not a regular file (a FIFO)" in err[0]


def test_index_command_moves_old_indexes_out_of_the_shards_glob(tmp_path, capsys):
    files = _write(str(tmp_path))
    for f in files[:2]:
        shard_index.write_index(f, f + ".idx")  # where earlier versions wrote them
    want = open(files[0] + ".idx").read()
    assert convert.main(["index", f"{tmp_path}/data/train-*", "--move", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "indexed 1 shards" in out and "2 already had an index" in out
    assert "moved 2 old <shard>.idx files into .estimax-index/" in out
    names = [os.path.basename(f) for f in files]
    assert sorted(os.listdir(tmp_path / "data")) == [".estimax-index", *names]
    assert open(_idx(files[0])).read() == want
    assert all(tfrecord.RecordFile(f).index_path == _idx(f) for f in files)


def test_index_lookup_order_and_where_estimax_writes(tmp_path):
    shard = "gs://data/imagenet/train-00000-of-01024"
    explicit, job = "gs://mine/indexes", "gs://runs/r1/shard_indexes"
    assert shard_index.index_candidates(shard, job, explicit) == [
        shard_index.index_path_in(explicit, shard),
        "gs://data/imagenet/.estimax-index/train-00000-of-01024.idx",
        shard_index.index_path_in(job, shard),
        "gs://data/imagenet/train-00000-of-01024.idx",  # earlier versions': still read
    ]
    assert shard_index.index_path_for(shard) == (
        "gs://data/imagenet/.estimax-index/train-00000-of-01024.idx"
    )
    assert shard_index.index_path_for(shard, job) == shard_index.index_path_in(job, shard)
    # A local folder: the first candidate that fits wins; none of them matches train-*.
    files = _write(str(tmp_path))
    shard_index.write_index(files[0], files[0] + ".idx")
    shard_index.write_index(files[0])
    rf, _, why = shard_index.open_indexed(files[0], False)
    assert rf is not None and rf.index_path == _idx(files[0]) and why == ""
    assert tfrecord.list_files(f"{tmp_path}/data/train-*") == files
