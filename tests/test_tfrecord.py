"""TFRecord framing: writer, reader, CRC and truncation errors, names, patterns, index files.

Fixtures are built by hand here from the format's definition (TensorFlow's record_writer.cc:
uint64 length, masked CRC-32C of it, data, masked CRC-32C of the data) with an independent
bit-by-bit CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), not with the code under test.
"""

import os
import pickle
import struct

import numpy as np
import pytest

from estimax.data import shard_index, tfrecord
from estimax.data.tfrecord import CorruptRecordError


def _crc32c_bitwise(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c_bitwise(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _frame(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked(length)) + data + struct.pack("<I", _masked(data))


RECORDS = [b"", b"a", b"hello tfrecord", bytes(range(256)) * 5]


def test_crc32c_check_value():
    # The published CRC-32C check value of "123456789" is 0xE3069283 (RFC 3720 B.4 family).
    assert _crc32c_bitwise(b"123456789") == 0xE3069283
    assert tfrecord.masked_crc32c(b"123456789") == _masked(b"123456789")


def test_writer_bytes_equal_hand_built_framing(tmp_path):
    path = str(tmp_path / "f.tfrecord")
    with tfrecord.TFRecordWriter(path) as w:
        for r in RECORDS:
            w.write(r)
    with open(path, "rb") as f:
        assert f.read() == b"".join(_frame(r) for r in RECORDS)
    assert w.num_records == len(RECORDS)


def test_reads_hand_built_file(tmp_path):
    path = tmp_path / "hand"
    path.write_bytes(b"".join(_frame(r) for r in RECORDS))
    assert list(tfrecord.read_records(str(path))) == RECORDS
    offsets = [o for o, _ in tfrecord.read_records_with_offsets(str(path))]
    assert offsets == list(np.cumsum([0] + [16 + len(r) for r in RECORDS[:-1]]))


def test_reads_memory_filesystem():
    path = "memory://estimax-test-tfrecord/train-00000-of-00001"
    with tfrecord.TFRecordWriter(path) as w:
        for r in RECORDS:
            w.write(r)
    assert list(tfrecord.read_records(path)) == RECORDS
    assert tfrecord.list_files("memory://estimax-test-tfrecord/train-*") == [
        "memory:///estimax-test-tfrecord/train-00000-of-00001"
    ]


def _bad_file(tmp_path, blob: bytes) -> str:
    path = tmp_path / "train-00003-of-00010"
    path.write_bytes(blob)
    return str(path)


def test_wrong_data_crc_names_file_and_offset(tmp_path):
    good = _frame(b"first")
    bad = bytearray(_frame(b"second record"))
    bad[-1] ^= 0xFF  # flip the stored data CRC
    path = _bad_file(tmp_path, good + bytes(bad))
    it = tfrecord.read_records(path)
    assert next(it) == b"first"
    with pytest.raises(CorruptRecordError) as e:
        next(it)
    msg = str(e.value)
    assert "train-00003-of-00010: record at byte offset 21: data CRC mismatch" in msg
    assert e.value.offset == len(good) == 21
    # verify_crc=False reads it anyway
    assert list(tfrecord.read_records(path, verify_crc=False))[1] == b"second record"


def test_corrupted_payload_detected(tmp_path):
    blob = bytearray(_frame(b"payload bytes"))
    blob[14] ^= 0x01  # inside the data
    path = _bad_file(tmp_path, bytes(blob))
    with pytest.raises(CorruptRecordError, match="byte offset 0: data CRC mismatch"):
        list(tfrecord.read_records(path))


def test_wrong_length_crc(tmp_path):
    blob = bytearray(_frame(b"x"))
    blob[9] ^= 0x10
    path = _bad_file(tmp_path, bytes(blob))
    with pytest.raises(CorruptRecordError, match="byte offset 0: length CRC mismatch"):
        list(tfrecord.read_records(path))


@pytest.mark.parametrize(
    "cut, problem",
    [
        (3, "truncated data CRC (1 of 4 bytes)"),  # tail CRC cut
        (10, "truncated data (4 of 10 bytes)"),  # 26-byte frame cut to 12 + 4
        (18, "truncated length header (8 of 12 bytes)"),  # inside the header
    ],
)
def test_truncated_tail(tmp_path, cut, problem):
    first = _frame(b"ok")
    path = _bad_file(tmp_path, first + _frame(b"0123456789")[:-cut])
    records = []
    with pytest.raises(CorruptRecordError) as e:
        for r in tfrecord.read_records(path):
            records.append(r)
    assert records == [b"ok"]  # everything before the damage is delivered
    assert str(e.value) == f"{path}: record at byte offset {len(first)}: {problem}"


def test_writer_is_atomic_on_error(tmp_path):
    path = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with tfrecord.TFRecordWriter(str(path)) as w:
            w.write(b"abc")
            # the final name does not exist while writing
            assert not path.exists()
            raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


def test_writer_writes_the_index_with_the_file_and_neither_on_error(tmp_path, monkeypatch):
    path = str(tmp_path / "train-00000-of-00001")
    records = [b"x" * n for n in (0, 5, 300)]
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(b), replace(a, b)))
    with tfrecord.TFRecordWriter(path, index=True) as w:
        for r in records:
            w.write(r)
    # The same index a scan writes, in place before the file takes its name, in the hidden
    # folder beside it: no glob of the shards (TensorFlow's train-*) matches it.
    idx = str(tmp_path / ".estimax-index" / "train-00000-of-00001.idx")
    assert renamed == [idx, path]
    indexed = open(idx).read()
    assert indexed == "0 16\n16 21\n37 316\n# estimax-index size=353\n"
    assert tfrecord.RecordFile(path).index_path == idx
    os.remove(idx)
    # A scan also records the version it indexed (here the file's mtime).
    rescanned = open(shard_index.write_index(path)).read()
    assert rescanned.startswith(indexed.rstrip("\n") + " version=mtime_ns%3A")
    # A file that cannot be finished takes its index with it; a failed block leaves neither.
    monkeypatch.setattr(os, "replace", lambda a, b: replace(a, b) if b.endswith(".idx") else 1 / 0)
    other = str(tmp_path / "train-00000-of-00002")
    with pytest.raises(ZeroDivisionError):
        with tfrecord.TFRecordWriter(other, index=True) as w:
            w.write(b"r")
    assert not os.path.exists(tfrecord.default_index_path(other)) and not os.path.exists(other)
    with pytest.raises(RuntimeError):
        with tfrecord.TFRecordWriter(other, index=True) as w:
            w.write(b"r")
            raise RuntimeError("crash")
    assert sorted(os.listdir(tmp_path)) == [".estimax-index", "train-00000-of-00001"]
    assert os.listdir(tmp_path / ".estimax-index") == ["train-00000-of-00001.idx"]


def test_sharded_name_and_list_files(tmp_path):
    assert tfrecord.sharded_name("train", 3, 10) == "train-00003-of-00010"
    assert tfrecord.sharded_name("gs://b/validation", 127, 128) == (
        "gs://b/validation-00127-of-00128"
    )
    with pytest.raises(ValueError, match="shard 10 out of range"):
        tfrecord.sharded_name("train", 10, 10)
    for i in reversed(range(3)):
        with tfrecord.TFRecordWriter(str(tmp_path / tfrecord.sharded_name("train", i, 3))) as w:
            w.write(b"r%d" % i)
    shard_index.write_index(str(tmp_path / "train-00000-of-00003"))
    files = tfrecord.list_files(str(tmp_path / "train-*"))
    # sorted, and index files are not shards
    assert [os.path.basename(f) for f in files] == [
        "train-00000-of-00003",
        "train-00001-of-00003",
        "train-00002-of-00003",
    ]
    with pytest.raises(FileNotFoundError, match="validation-\\*"):
        tfrecord.list_files(str(tmp_path / "validation-*"))


def test_index_and_random_access(tmp_path):
    path = str(tmp_path / "data")
    records = [b"rec%d" % i * (i + 1) for i in range(20)]
    with tfrecord.TFRecordWriter(path) as w:
        for r in records:
            w.write(r)
    index = shard_index.write_index(path)
    lines = open(index).read().splitlines()
    # DALI tfrecord2idx format: "<offset> <framed size>", then what it indexes.
    assert lines[0] == f"0 {16 + len(records[0])}"
    assert len(lines) == 21 and lines[-1].startswith(
        f"# estimax-index size={os.path.getsize(path)}"
    )
    rf = tfrecord.RecordFile(path)
    assert rf.index_path == index
    assert len(rf) == 20
    assert [rf[i] for i in (5, 0, 19, -1)] == [records[5], records[0], records[19], records[19]]
    with pytest.raises(IndexError, match="record index 20 out of range"):
        rf[20]
    # Without an index the offsets are found by scanning, and agree.
    os.remove(index)
    rf2 = tfrecord.RecordFile(path)
    assert rf2.index_path is None
    np.testing.assert_array_equal(rf2.offsets, rf.offsets)
    # Picklable (sent to worker processes); reopens its file.
    rf3 = pickle.loads(pickle.dumps(rf))
    assert rf3[7] == records[7]


def test_random_access_detects_corruption(tmp_path):
    path = tmp_path / "train-00003-of-00010"
    good = _frame(b"one")
    bad = bytearray(_frame(b"two"))
    bad[13] ^= 0xFF
    path.write_bytes(good + bytes(bad))
    rf = tfrecord.RecordFile(str(path))
    assert rf[0] == b"one"
    with pytest.raises(CorruptRecordError, match=r"train-00003-of-00010: record at byte offset 19"):
        rf[1]


def _idx(path: object) -> str:
    return tfrecord.default_index_path(str(path))


def test_index_mismatch_reported(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(_frame(b"abc"))
    idx = tmp_path / "f.idx"
    idx.write_text("0 19\n25 10\n")
    with pytest.raises(ValueError, match=r"f.idx: line 2: record offset 25 does not follow"):
        tfrecord.RecordFile(str(path))


def test_random_access_on_memory_filesystem():
    path = "memory://estimax-test-tfrecord/ra"
    with tfrecord.TFRecordWriter(path) as w:
        for r in RECORDS:
            w.write(r)
    shard_index.write_index(path)
    rf = tfrecord.RecordFile(path)
    assert rf.index_path == "memory://estimax-test-tfrecord/.estimax-index/ra.idx"
    assert [rf[i] for i in (3, 1, 0)] == [RECORDS[3], RECORDS[1], RECORDS[0]]


def test_stale_index_on_truncated_file(tmp_path):
    path = tmp_path / "train-00000-of-00001"
    path.write_bytes(_frame(b"first") + _frame(b"0123456789"))
    shard_index.write_index(str(path))
    path.write_bytes((_frame(b"first") + _frame(b"0123456789"))[:-6])  # cut after the index
    # Found stale when opened, naming both files ...
    with pytest.raises(tfrecord.StaleIndexError, match=r"\.idx does not index .*: it indexes a "
                       r"shard of 47 bytes, the shard has 41"):  # fmt: skip
        tfrecord.RecordFile(str(path))
    # ... and a file read with those offsets anyway names the damage.
    rf = tfrecord.RecordFile(str(path), offsets=tfrecord.read_index(_idx(path)))
    assert rf[0] == b"first"
    with pytest.raises(CorruptRecordError, match=r"byte offset 21: truncated data \(8 of 10"):
        rf[1]


def test_index_of_other_file_detected(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(_frame(b"abc") + _frame(b"defgh"))
    (tmp_path / "f.idx").write_text("0 20\n20 21\n")  # says 20 bytes; the frame has 19
    with pytest.raises(tfrecord.StaleIndexError, match=r"records end at byte 41, the shard has 40"):
        tfrecord.RecordFile(str(path))
    (tmp_path / "f.idx").write_text("0 20\n20 20\n")  # ends at the file's end, frames wrong
    with pytest.raises(CorruptRecordError, match=r"record of 19 bytes where the index says 20"):
        tfrecord.RecordFile(str(path))[0]


def test_scan_reports_truncation_like_the_reader(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(_frame(b"abc") + _frame(b"0123456789")[:-2])
    with pytest.raises(
        CorruptRecordError, match=r"byte offset 19: truncated data CRC \(2 of 4 bytes\)"
    ):
        tfrecord.record_offsets(str(path), verify_crc=False)


def _every_read_path(path: str, index_text: str) -> dict[str, str]:
    """The CorruptRecordError message of each read path: stream, offsets, scan, indexed."""
    (open(path + ".alt-idx", "w")).write(index_text)
    readers = {
        "stream": lambda: list(tfrecord.read_records(path)),
        "stream_no_crc": lambda: list(tfrecord.read_records(path, verify_crc=False)),
        "offsets": lambda: tfrecord.record_offsets(path, verify_crc=False),
        "offsets_crc": lambda: tfrecord.record_offsets(path, verify_crc=True),
        "scanned": lambda: tfrecord.RecordFile(path)[0],
        # The offsets of an index that does not fit the file (opening it would say so first).
        "indexed": lambda: tfrecord.RecordFile(
            path, offsets=tfrecord.read_index(path + ".alt-idx")
        )[0],
    }
    messages = {}
    for name, read in readers.items():
        with pytest.raises(CorruptRecordError) as e:
            read()
        messages[name] = str(e.value)
    return messages


@pytest.mark.parametrize(
    "content, problem",
    [
        # A gzip-compressed TFRecord file: its first 12 bytes are no length header.
        (b"\x1f\x8b\x08\x00" + bytes(40), "length CRC mismatch"),
        # A text file.
        (b"image,label\nfoo.jpg,3\n" * 3, "length CRC mismatch"),
        # Shorter than one header.
        (b"\x00" * 7, "truncated length header (7 of 12 bytes)"),
    ],
)
def test_not_a_tfrecord_same_hint_on_every_read_path(tmp_path, content, problem):
    path = str(tmp_path / "train-00000-of-00001")
    with open(path, "wb") as f:
        f.write(content)
    messages = _every_read_path(path, f"0 {max(len(content), 16)}\n")
    assert set(messages.values()) == {next(iter(messages.values()))}, messages
    msg = messages["stream"]
    assert msg.startswith(f"{path}: record at byte offset 0: {problem}")
    assert msg.endswith("; not a TFRecord file, compressed, or damaged")


def test_truncation_same_message_on_every_read_path(tmp_path):
    path = str(tmp_path / "f")
    frame = _frame(b"0123456789")
    with open(path, "wb") as f:
        f.write(frame[:-6])  # 26 - 6 = 20 bytes: the header and 8 of the 10 data bytes
    messages = _every_read_path(path, f"0 {len(frame)}\n")
    assert set(messages.values()) == {
        f"{path}: record at byte offset 0: truncated data (8 of 10 bytes)"
    }


def test_huge_length_with_valid_crc_is_truncation_not_memory_error(tmp_path):
    # A header whose CRC matches a length of 2**62: a reader must not try to allocate it.
    path = str(tmp_path / "f")
    length = struct.pack("<Q", 2**62)
    with open(path, "wb") as f:
        f.write(length + struct.pack("<I", _masked(length)) + b"abc")
    messages = _every_read_path(path, f"0 {2**40}\n")
    assert set(messages.values()) == {
        f"{path}: record at byte offset 0: truncated data (3 of {2**62} bytes)"
    }


@pytest.mark.parametrize(
    "index_text, problem",
    [
        ("0 3\n", "line 1: record length 3 is not a TFRecord frame's"),
        ("0 -20\n", "line 1: record length -20 is not a TFRecord frame's"),
        (f"0 {2**62}\n{2**62} {2**62}\n", f"line 2: record length {2**62} is not"),
        ("0 19 \x00\nx\n", "line 2: expected '<offset> <length>'"),
        ("0 19\n\xff", "f.idx: not an index file \\(byte 5 is not ASCII\\)"),
    ],
)
def test_malformed_index_is_value_error(tmp_path, index_text, problem):
    idx = tmp_path / "f.idx"
    idx.write_bytes(index_text.encode("latin-1"))
    with pytest.raises(ValueError, match=problem):
        tfrecord.read_index(str(idx))
