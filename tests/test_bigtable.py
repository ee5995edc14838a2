"""Cloud Bigtable input, against the real emulator (cbtemulator): the copy tool, the record source
under the loader (order, resume, host shards, process workers), the errors, the resnet program.

Every test loads its own table with ``estimax-convert to-bigtable`` from TFRecord shards written
here, and compares what comes back with what a TFRecordSource reads from the same shards.
"""

import dataclasses
import hashlib
import io
import os
import socket

import numpy as np
import pytest
from PIL import Image

from estimax.data import bigtable as bt
from estimax.data import example as ex
from estimax.data import imagenet, loader, tfrecord
from estimax.tools import convert

pytestmark = pytest.mark.usefixtures("bigtable_emulator")

PROJECT, INSTANCE = "test-project", "test-instance"


def _jpeg(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((12, 10, 3), value, np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _record(label: int, value: int) -> bytes:
    return ex.encode_example(
        {"image/encoded": _jpeg(value), "image/class/label": label, "image/format": b"JPEG"}
    )


def _write_shards(directory, split, per_file, start=0):
    """Shards of records whose pixel value is 10 * label, labels start+1, start+2, ..."""
    label = start
    records = []
    for s, n in enumerate(per_file):
        path = str(directory / tfrecord.sharded_name(split, s, len(per_file)))
        with tfrecord.TFRecordWriter(path) as w:
            for _ in range(n):
                label += 1
                records.append(_record(label, 10 * label % 250))
                w.write(records[-1])
    return records


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _write_shards(d, "train", [5, 7, 4])  # 16 records
    _write_shards(d, "validation", [4, 3])  # 7 records
    return d


_TABLES = iter(range(10**6))


def _load(data_dir, *extra) -> str:
    """Copies ``data_dir`` into a new table with the tool; returns the table name."""
    table = f"t{next(_TABLES)}"
    assert (
        convert.main(
            [
                "to-bigtable",
                f"--data_dir={data_dir}",
                f"--bigtable_project={PROJECT}",
                f"--bigtable_instance={INSTANCE}",
                f"--bigtable_table={table}",
                *extra,
            ]
        )
        == 0
    )
    return table


def _source(table, prefix="train_", **kw):
    return bt.BigtableSource(PROJECT, INSTANCE, table, prefix, **kw)


def _tfrecords(data_dir, split="train"):
    return loader.TFRecordSource(tfrecord.list_files(str(data_dir / f"{split}-*")))


def _digest(record: bytes, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The record's SHA-1 and one draw of its RNG: which record, and the same randomness."""
    return (
        np.frombuffer(hashlib.sha1(record).digest(), np.uint8),
        np.asarray(rng.integers(1 << 30)),
    )


def _batches(ld, n):
    it = iter(ld)
    out = [next(it) for _ in range(n)]
    it.close()
    return out


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b, strict=False):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


# ---------------------------------------------------------------- the copy tool


def _read_table(table, prefix):
    data = bt.import_bigtable()
    client = bt.data_client(PROJECT)
    try:
        rows = client.get_table(INSTANCE, table).read_rows(
            data.ReadRowsQuery(
                row_ranges=data.RowRange(
                    start_key=prefix.encode(), end_key=bt.prefix_end(prefix.encode())
                )
            )
        )
    finally:
        client.close()
    return [(r.row_key, [(c.family, c.qualifier, c.value) for c in r.cells]) for r in rows]


def test_tool_writes_one_row_per_record_byte_identical(data_dir, tmp_path, capsys):
    table = _load(data_dir)
    assert "wrote {'train': 16, 'validation': 7} rows" in capsys.readouterr().out
    for split, prefix in (("train", "train_"), ("validation", "validation_")):
        records = list(
            _tfrecords(data_dir, split)[i] for i in range(len(_tfrecords(data_dir, split)))
        )
        rows = _read_table(table, prefix)
        assert [key for key, _ in rows] == [
            f"{prefix}{i:010d}".encode() for i in range(len(records))
        ]
        assert [cells for _, cells in rows] == [[("tfexample", b"example", r)] for r in records]

    # Rows already there: refused, then replaced with --overwrite (no stale rows are left).
    assert (
        convert.main(
            [
                "to-bigtable",
                f"--data_dir={data_dir}",
                f"--bigtable_project={PROJECT}",
                f"--bigtable_instance={INSTANCE}",
                f"--bigtable_table={table}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "already has rows under the prefix 'train_' (e.g. train_0000000000)" in err
    assert "--overwrite" in err
    smaller = tmp_path / "smaller"
    smaller.mkdir()
    new_records = _write_shards(smaller, "train", [3], start=100)
    assert (
        convert.main(
            [
                "to-bigtable",
                f"--data_dir={smaller}",
                f"--bigtable_project={PROJECT}",
                f"--bigtable_instance={INSTANCE}",
                f"--bigtable_table={table}",
                "--splits=train",
                "--overwrite",
            ]
        )
        == 0
    )
    assert [cells[0][2] for _, cells in _read_table(table, "train_")] == new_records
    assert len(_read_table(table, "validation_")) == 7  # the other split is untouched


def test_tool_other_prefixes_and_column(data_dir):
    table = _load(
        data_dir,
        "--bigtable_train_prefix=tr/",
        "--bigtable_eval_prefix=ev/",
        "--bigtable_column_family=cf",
        "--bigtable_column_qualifier=q",
    )
    src = bt.BigtableSource(PROJECT, INSTANCE, table, "ev/", "cf", "q")
    tf = _tfrecords(data_dir, "validation")
    assert len(src) == len(tf) == 7
    assert src.row_key(6) == b"ev/0000000006"
    assert [src[i] for i in range(7)] == [tf[i] for i in range(7)]


def test_tool_errors(tmp_path, capsys):
    assert (
        convert.main(["to-bigtable", f"--data_dir={tmp_path}", f"--bigtable_instance={INSTANCE}"])
        == 2
    )
    assert f"no train-* TFRecord files in {tmp_path}" in capsys.readouterr().err


# ---------------------------------------------------------------- the source under the loader


def test_loader_same_records_same_order_as_tfrecords(data_dir):
    table = _load(data_dir)
    src, tf = _source(table), _tfrecords(data_dir)
    assert len(src) == len(tf) == 16
    kw = dict(batch_size=5, shuffle=True, seed=7, num_workers=2, chunk_size=3)
    # 5 batches of 5 over 16 records: three shuffled epochs, crossing epoch boundaries.
    _assert_same(
        _batches(loader.Loader(src, _digest, **kw), 5),
        _batches(loader.Loader(tf, _digest, **kw), 5),
    )
    # Eval: one pass in row order, the last batch smaller.
    kw = dict(batch_size=5, shuffle=False, num_epochs=1, drop_remainder=False, num_workers=0)
    got = list(loader.Loader(src, _digest, **kw))
    assert [len(b[0]) for b in got] == [5, 5, 5, 1]
    _assert_same(got, list(loader.Loader(tf, _digest, **kw)))


def test_resume_from_saved_state_is_exact(data_dir):
    table = _load(data_dir)
    kw = dict(batch_size=3, shuffle=True, seed=1, num_workers=2)
    reference = _batches(loader.Loader(_source(table), _digest, **kw), 9)
    it = iter(loader.Loader(_source(table), _digest, **kw))
    first = [next(it) for _ in range(4)]
    state = it.get_state()
    it.close()
    # A new source (as a restarted job has), from the saved position.
    resumed = iter(loader.Loader(_source(table), _digest, **kw))
    resumed.set_state(state)
    rest = [next(resumed) for _ in range(5)]
    resumed.close()
    _assert_same(reference, first + rest)


def test_process_workers_pickle_the_source_and_read_the_same(data_dir):
    table = _load(data_dir)
    src = _source(table)
    src[0]  # a client exists in this process; it must not travel to the workers
    kw = dict(batch_size=4, shuffle=True, seed=3, chunk_size=2)
    _assert_same(
        _batches(loader.Loader(src, _digest, num_workers=2, worker_type="process", **kw), 6),
        _batches(loader.Loader(src, _digest, num_workers=0, **kw), 6),
    )


@dataclasses.dataclass
class Ctx:
    host_index: int = 0
    num_hosts: int = 1


def _pil_preprocess(image_bytes, is_training, image_size, rng, bbox=None):
    img = np.asarray(
        Image.open(io.BytesIO(image_bytes))
        .convert("RGB")
        .resize((image_size, image_size), Image.NEAREST)
    )
    return img[:, ::-1] if is_training and rng.random() < 0.5 else img


def _input(is_training, **kw):
    return imagenet.input_fn(
        None if "bigtable" in kw else kw.pop("data_dir"),
        is_training,
        preprocessing=_pil_preprocess,
        image_size=4,
        num_parallel_calls=0,
        num_classes=300,
        **kw,
    )


@pytest.mark.parametrize("num_hosts", [1, 3])
def test_input_fn_hosts_disjoint_and_equal_to_tfrecords(data_dir, num_hosts):
    table = _load(data_dir)
    spec = bt.BigtableTable(PROJECT, INSTANCE, table)
    seen = []
    for host in range(num_hosts):
        params = {"batch_size": 2, "context": Ctx(host, num_hosts)}
        got = list(_input(False, bigtable=spec)(params))
        want = list(_input(False, data_dir=str(data_dir))(params))
        _assert_same(got, want)
        seen += [int(label) for _, labels in got for label in labels]
        train = _input(True, bigtable=spec)(params)
        _assert_same(
            _batches(train, 4),
            _batches(_input(True, data_dir=str(data_dir))(params), 4),
        )
    assert sorted(seen) == list(range(7))  # every validation row on exactly one host


# ---------------------------------------------------------------- errors


def test_missing_table_named(data_dir):
    with pytest.raises(
        bt.BigtableError,
        match=r"projects/test-project/instances/test-instance/"
        r"tables/no_such_table \(emulator at BIGTABLE_EMULATOR_HOST=localhost:\d+"
        r"\): not found.*--bigtable_table",
    ):
        _source("no_such_table")


def test_empty_prefix_named(data_dir):
    table = _load(data_dir)
    with pytest.raises(
        bt.BigtableError,
        match=rf"tables/{table} .*: no rows whose key starts "
        r"with 'test_'.*test_0000000000.*estimax-convert to-bigtable",
    ):
        _source(table, "test_")


def test_unreachable_emulator_named(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("BIGTABLE_EMULATOR_HOST", f"localhost:{port}")
    with pytest.raises(
        bt.BigtableError,
        match=rf"did not answer within 1 s; is the emulator "
        rf"running at BIGTABLE_EMULATOR_HOST=localhost:{port}\?",
    ):
        _source("any", timeout=1)


def test_no_credentials_says_what_to_do(monkeypatch, tmp_path):
    for var in ("BIGTABLE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud credentials
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # not on Google Compute Engine
    with pytest.raises(
        bt.BigtableError,
        match=r"no Google Cloud credentials for Cloud Bigtable "
        r"\(project 'p'\): run `gcloud auth application-default login`, or set "
        r"BIGTABLE_EMULATOR_HOST=host:port",
    ):
        bt.BigtableSource("p", "i", "t", "train_")


def _write_cells(table, cells):
    """Writes raw rows {key: (family, qualifier, value)} into ``table``."""
    data = bt.import_bigtable()
    client = bt.data_client(PROJECT)
    try:
        client.get_table(INSTANCE, table).bulk_mutate_rows(
            [
                data.RowMutationEntry(key, [data.SetCell(f, q, v)])
                for key, (f, q, v) in cells.items()
            ]
        )
    finally:
        client.close()


def test_row_without_the_column_and_corrupt_example_are_bad_records(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _write_shards(d, "train", [1])
    _write_shards(d, "validation", [4])
    table = _load(d)
    from estimax.tools import tfrecords_to_bigtable

    tfrecords_to_bigtable.ensure_table(PROJECT, INSTANCE, table, "other")
    _write_cells(
        table,
        {
            b"validation_0000000001": ("tfexample", b"example", b"\x0a\xffjunk"),
            b"validation_0000000004": ("other", b"example", _record(5, 50)),
        },
    )
    spec = bt.BigtableTable(PROJECT, INSTANCE, table)
    params = {"batch_size": 2}
    with pytest.raises(loader.BadRecordError) as e:
        list(_input(False, bigtable=spec)(params))
    assert str(e.value).startswith(
        f"projects/test-project/instances/test-instance/tables/"
        f"{table} (emulator at BIGTABLE_EMULATOR_HOST="
    )
    assert str(e.value).endswith(
        ": row validation_0000000001: ValueError: not a serialized "
        "tf.Example (6 bytes): Error parsing message with type "
        "'tensorflow.Example': Wire format was corrupt"
    )

    it = iter(_input(False, bigtable=spec, skip_bad_records=True)(params))
    # 0-based labels of the good rows; the blocks they were skipped from are smaller
    assert [b[1].tolist() for b in it] == [[0], [2, 3]]
    assert it.num_skipped == 2

    src = _source(table, "validation_")
    with pytest.raises(
        loader.BadRecordError,
        match=r": row validation_0000000004: the row has "
        r"no cell tfexample:example",
    ):
        src[4]


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_source_unavailable_is_not_skipped(data_dir, worker_type):
    from estimax.tools import bigtable_emulator

    # A second emulator that goes away after the keys are listed.
    with bigtable_emulator.running_emulator() as emulator:
        src = _source(_load(data_dir), timeout=1)
    assert src.emulator_host == emulator.host != os.environ["BIGTABLE_EMULATOR_HOST"]
    it = iter(
        loader.Loader(
            src,
            _digest,
            batch_size=2,
            shuffle=False,
            num_workers=1,
            worker_type=worker_type,
            skip_bad_records=True,
        )
    )
    with pytest.raises(
        bt.BigtableError,
        match=rf"did not answer within 1 s; is the emulator "
        rf"running at BIGTABLE_EMULATOR_HOST={emulator.host}\?",
    ):
        next(it)


# ---------------------------------------------------------------- the resnet program


@pytest.mark.slow
def test_resnet_trains_and_evaluates_from_bigtable(tmp_path, monkeypatch, capsys):
    assert (
        convert.main(
            [
                "fake-imagenet",
                f"--output_dir={tmp_path / 'data'}",
                "--train_examples=24",
                "--validation_examples=10",
                "--num_classes=10",
                "--train_shards=2",
                "--validation_shards=1",
                "--min_size=40",
                "--max_size=60",
                "--no_progress",
            ]
        )
        == 0
    )
    table = _load(tmp_path / "data")
    from absl import flags

    from estimax.models.resnet import ResNetTiny
    from estimax.programs import resnet

    monkeypatch.setattr(
        resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
    )
    fv = flags.FlagValues()
    resnet.define_flags(fv)
    fv(
        [
            "resnet",
            f"--model_dir={tmp_path / 'model'}",
            f"--bigtable_project={PROJECT}",
            f"--bigtable_instance={INSTANCE}",
            f"--bigtable_table={table}",
            "--train_steps=2",
            "--train_batch_size=8",
            "--eval_batch_size=4",
            "--num_eval_images=10",
            "--image_size=32",
            "--steps_per_eval=2",
            "--iterations_per_loop=1",
            "--num_cores=1",
            "--num_label_classes=10",
            "--data_dir=/nonexistent",
            # Independent of estimax.ops (plain XLA convolutions): this test is about the input.
            "--nocpu_fast_ops",
        ]
    )
    results = resnet.run_from_flags(fv)
    assert results["global_step"] == 2
    assert results["num_examples"] == 10  # every validation row once (exact eval)
    assert os.path.isdir(tmp_path / "model" / "checkpoints" / "2")


@pytest.mark.slow
def test_resnet_command_line_missing_table_says_so_without_traceback(tmp_path):
    import subprocess
    import sys

    # The program's own process and exit; the tests' tiny ResNet as its network
    # (tests/tiny_resnet_shim.py): the missing table, not ResNet-18, is under test.
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_resnet_shim.py")
    proc = subprocess.run(
        [
            sys.executable,
            shim,
            "resnet",
            f"--model_dir={tmp_path}",
            f"--bigtable_project={PROJECT}",
            f"--bigtable_instance={INSTANCE}",
            "--bigtable_table=no_such_table",
            "--resnet_depth=18",
            "--image_size=32",
            "--train_batch_size=8",
            "--num_cores=1",
            "--train_steps=1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2  # the programs' exit status for a user's setup mistake
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"FATAL: Cloud Bigtable input: projects/{PROJECT}/instances/{INSTANCE}"
        "/tables/no_such_table (emulator at BIGTABLE_EMULATOR_HOST="
    )
    assert "not found" in last and "Traceback" not in proc.stderr
