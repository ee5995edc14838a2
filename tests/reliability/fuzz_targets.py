"""The parser fuzzer's child process: runs one target over many generated inputs.

Run by tests/reliability/test_fuzz_parsers.py as
``python tests/reliability/fuzz_targets.py TARGET NUM_INPUTS SEED OUT_DIR MEMORY_LIMIT_MIB
[INPUT_FILE ...]`` (with input files: replays those instead of generating).
A child process, so that a segfault (or abort) in a C extension (crc32c, protobuf's upb,
libjpeg-turbo in simplejpeg, libpng in OpenCV) is seen by the parent as a signal exit, not lost
with the test process; ``RLIMIT_AS`` bounds its memory, so "unbounded memory" shows up as a
``MemoryError`` (an undocumented error: a failure) instead of swapping the machine.

Inputs come from seeded generators that are structure-aware (valid frames, Examples and
images, then damaged): a blind or coverage-guided byte fuzzer (atheris) almost never gets past
a TFRecord's CRC-32C or a JPEG's markers, so it would test little but the first check.

Every input is written to ``OUT_DIR/current.bin`` before it runs (so the parent can name the
input of a crash or a hang); an input that raises anything but the target's documented errors
is written to ``OUT_DIR/failure.bin`` with the traceback in
``failure.txt``. On success the child prints one JSON line: target, inputs, max RSS.
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import signal
import struct
import sys
import tempfile
import traceback
from collections.abc import Callable

# Per-input time limit: the slowest legitimate input (a 64x64 decode, a 100-record file) takes
# milliseconds; a second means a hang.
_INPUT_TIMEOUT_S = 2.0
# Images larger than this (pixels) would be documented as rejected by jpeg.decode; the
# generator makes headers that claim up to 65535 x 65535.
_HEADER_DIMS = [0, 1, 2, 7, 8, 9, 16, 255, 256, 4096, 32768, 65500, 65535]


class Hang(Exception):
    """An input ran longer than _INPUT_TIMEOUT_S."""


def _frame(data: bytes) -> bytes:
    from estimax.data.tfrecord import masked_crc32c

    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _valid_length_header(length: int) -> bytes:
    from estimax.data.tfrecord import masked_crc32c

    raw = struct.pack("<Q", length)
    return raw + struct.pack("<I", masked_crc32c(raw))


# ----------------------------------------------------------------------------------- targets
# Each target takes the input bytes and returns normally or raises one of its documented errors.


def _scratch_file(data: bytes, name: str = "f") -> str:
    path = os.path.join(_SCRATCH, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _target_tfrecord_stream(data: bytes) -> None:
    from estimax.data import tfrecord

    path = _scratch_file(data)
    try:
        for _ in tfrecord.read_records(path):
            pass
    except tfrecord.CorruptRecordError:
        pass
    try:
        for _ in tfrecord.read_records(path, verify_crc=False):
            pass
    except tfrecord.CorruptRecordError:
        pass


def _target_tfrecord_offsets(data: bytes) -> None:
    from estimax.data import tfrecord

    path = _scratch_file(data)
    for verify in (False, True):
        try:
            offsets = tfrecord.record_offsets(path, verify_crc=verify)
        except tfrecord.CorruptRecordError:
            continue
        assert offsets[-1] == len(data), (offsets, len(data))
        rf = tfrecord.RecordFile(path, offsets=offsets)
        for i in range(len(rf)):
            try:
                rf[i]
            except tfrecord.CorruptRecordError:
                pass


_INDEXED_FILE = b""


def _target_tfrecord_index(data: bytes) -> None:
    """``data`` is an index file's text for a fixed three-record TFRecord file."""
    from estimax.data import tfrecord

    path = _scratch_file(_INDEXED_FILE)
    index = _scratch_file(data, "f.idx")
    try:
        rf = tfrecord.RecordFile(path, index_path=index)
    except ValueError:  # read_index: malformed index (documented)
        return
    for i in range(min(len(rf), 64)):
        try:
            rf[i]
        except tfrecord.CorruptRecordError:  # the index does not match the file
            pass


# The version a ``shard_index`` input's trailer names when it stands for "the shard's own":
# replaced by the written shard's mtime, so that the reader trusts the index's lines (the
# index then matches the shard's size and version, whatever its lines say).
_OWN_VERSION = b"@OWN@"


def _target_shard_index(data: bytes) -> None:
    """``data`` is a shard of valid records and an index for it, cut, stale, of another shard
    or damaged (``_gen_shard_index``). An eval pass (``TFRecordSource``, which names an index
    that does not fit in one line and rebuilds it) reads every record of the shard, in order,
    or stops at a documented error; never fewer records. ``RecordFile`` refuses such an index
    in one line naming both files."""
    import logging

    from estimax.data import tfrecord
    from estimax.data.sources import TFRecordSource

    n = struct.unpack_from("<I", data)[0] if len(data) >= 4 else 0
    shard, index = data[4 : 4 + n], data[4 + n :]
    path = _scratch_file(shard, "shard")
    own = f"mtime_ns:{os.stat(path).st_mtime_ns}".replace(":", "%3A").encode()
    index_path = _scratch_file(index.replace(_OWN_VERSION, own), "shard.idx")
    truth = list(tfrecord.read_records(path))  # the generator writes valid frames only
    try:
        tfrecord.RecordFile(path)
    except tfrecord.StaleIndexError as e:
        line = str(e)
        assert "\n" not in line and path in line and index_path in line, line
    except ValueError as e:  # malformed: names the index file
        assert "\n" not in str(e) and index_path in str(e), str(e)
    logging.disable(logging.WARNING)  # its one line per stale index (asserted in test_shard_index)
    try:
        source = TFRecordSource([path])
    finally:
        logging.disable(logging.NOTSET)
    got = []
    for i in range(len(source)):
        try:
            got.append(source[i])
        except tfrecord.CorruptRecordError:
            return  # an index that matches the shard's size and version, lines damaged: loud
    assert got == truth, f"read {len(got)} records of the shard's {len(truth)}"


def _target_example(data: bytes) -> None:
    from estimax.data import example

    try:
        example.decode_example(data)
    except ValueError:
        return
    schema = {
        "image/encoded": example.FixedLenFeature((), "string", default_value=b""),
        "image/class/label": example.FixedLenFeature((), "int64", default_value=-1),
        "image/object/bbox/xmin": example.VarLenFeature("float32"),
        "pair": example.FixedLenFeature((2,), "int64", default_value=[0, 0]),
    }
    try:
        example.parse_example(data, schema)
    except ValueError:
        pass


def _target_jpeg(data: bytes) -> None:
    from estimax.data import jpeg

    try:
        h, w = jpeg.image_shape(data)
    except jpeg.ImageDecodeError:
        h = w = 0
    try:
        img = jpeg.decode(data)
        assert img.ndim == 3 and img.shape[2] == 3 and img.dtype.name == "uint8", img.shape
    except jpeg.ImageDecodeError:
        pass
    if h and w:
        try:
            jpeg.decode_crop(data, (h // 4, w // 4, max(h // 2, 1), max(w // 2, 1)), min_size=1)
        except (jpeg.ImageDecodeError, ValueError):
            pass


def _target_tf_checkpoint(data: bytes) -> None:
    """``data`` is a TensorFlow checkpoint's ``.index``; its data file is ``_TF_DATA``."""
    from estimax.migrate import tf_checkpoint

    prefix = os.path.join(_SCRATCH, "model.ckpt")
    _scratch_file(data, "model.ckpt.index")
    _scratch_file(_TF_DATA, "model.ckpt.data-00000-of-00001")
    try:
        reader = tf_checkpoint.CheckpointReader(prefix)
    except tf_checkpoint.TFCheckpointError:
        return
    with reader:
        for name, info in reader.variables().items():
            assert info.name == name and all(d >= 0 for d in info.shape), info
            try:
                reader.get_tensor(name)
            except tf_checkpoint.TFCheckpointError:
                pass


# The eval directory every ``state_files`` input is read beside: its event files hold these
# accuracies (written once per child), so a record that disagrees can be told from one that is
# sound.
_STATE_ACCURACY = {4: 0.5, 8: 0.6, 12: 0.65, 16: 0.62, 20: 0.63}


def _state_dir() -> str:
    from estimax.estimator import summaries

    eval_dir = os.path.join(_SCRATCH, "model", "eval")
    if not os.path.isdir(eval_dir):
        writer = summaries.Summaries(eval_dir)
        for step, value in _STATE_ACCURACY.items():
            writer.scalars(step, {"accuracy": value, "loss": 1 - value})
        writer.close()
    return eval_dir


def _target_state_files(data: bytes) -> None:
    """``data`` is ``evaluations.json`` and ``early_stopping.json`` at once: each read returns
    (a warning at most), and what it returns agrees with the event files."""
    import math
    import types

    import estimax as ex
    from estimax.estimator import best, summaries

    eval_dir = _state_dir()
    model_dir = os.path.dirname(eval_dir)
    with open(os.path.join(eval_dir, summaries.EVALUATIONS_FILE), "wb") as f:
        f.write(data)
    with open(os.path.join(model_dir, best.EARLY_STOP_FILE), "wb") as f:
        f.write(data)
    found = summaries.read_evaluations(eval_dir)
    for step, results in found.evaluations.items():
        # Never a value the event files contradict: the best is chosen from verified ones.
        assert step in _STATE_ACCURACY, step
        value = results.get("accuracy")
        if isinstance(value, float | int) and not math.isnan(value):
            assert math.isclose(value, _STATE_ACCURACY[step], rel_tol=1e-3), (step, value)
    infos = [types.SimpleNamespace(step=s) for s in (12, 16, 20)]
    kept = best.KeepBest(model_dir, ex.BestCheckpoint("accuracy", "max")).should_preserve(
        infos, context=None
    )
    if found.damage is not None:
        assert kept[0], kept  # the verified best (12) is never rotated away on a damaged record
    record = best.read_early_stop(model_dir)
    if record is not None:
        assert type(record["stopped_at"]) is int and type(record["best_step"]) is int


def _setup_state_files() -> None:
    import estimax as ex  # JAX and the estimator: seconds, once
    from estimax.estimator import best  # noqa: F401

    assert ex.BestCheckpoint  # estimax's names are loaded on first use
    _state_dir()


def _setup_manifest() -> None:
    from estimax.programs import common  # noqa: F401 - JAX and the programs: seconds, once


_SETUP: dict[str, Callable[[], None]] = {
    "state_files": _setup_state_files,
    "manifest": _setup_manifest,
}


def _target_cluster_spec(data: bytes) -> None:
    """``data`` is ``$TF_CONFIG`` (and ``$CLUSTER_SPEC``), then ``$JAX_NUM_PROCESSES`` and
    ``$JAX_PROCESS_ID``: a Launch within the bounds, or one LaunchError line naming the variable
    (issue #54: "²", 5,000 digits and 10**12 were a ValueError or a list sized by the count)."""
    from estimax.parallel import launch

    text = data.decode("utf-8", "replace")
    for var, other, value in (
        ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "0"),
        ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "4"),
    ):
        environ = {"JAX_COORDINATOR_ADDRESS": "h:1", var: text, other: value}
        try:
            found = launch.detect(None, environ=environ)
        except launch.LaunchError as e:
            line = str(e)
            assert "\n" not in line and line.startswith("$JAX_"), line
            assert len(line) < 400, len(line)
        else:
            assert 0 <= found.process_id < found.num_processes <= launch.MAX_PROCESSES, found

    for var, parse in (("TF_CONFIG", launch.parse_tf_config), ("CLUSTER_SPEC", None)):
        environ = {var: text}
        try:
            found = launch.detect(None, environ=environ) if parse is None else parse(text)
        except launch.LaunchError as e:
            line = str(e)
            assert "\n" not in line and line.startswith(f"${var}"), line
            assert len(line) < 400, len(line)
        else:
            assert 0 <= found.process_id < max(found.num_processes, 1), found
        launch.evaluator_task(environ)
        launch.has_evaluator(environ)


def _target_manifest(data: bytes) -> None:
    """``data`` is a converter's ``manifest.json``: names for the model's classes, None (a
    warning), or before training one UsageError line; never a list sized by a label."""
    from estimax.programs import cli, exports

    os.makedirs(os.path.join(_SCRATCH, "data"), exist_ok=True)
    _scratch_file(data, "data/manifest.json")
    for offset in (0, 1):
        names = exports.manifest_class_names(os.path.join(_SCRATCH, "data"), offset, 10)
        assert names is None or len(names) == 10, names
        try:
            exports.manifest_class_names(os.path.join(_SCRATCH, "data"), offset, 10, strict=True)
        except cli.UsageError as e:
            assert "\n" not in str(e) and len(str(e)) < 500, str(e)


def _target_alloc_probe(data: bytes) -> None:
    """Not a parser: tries to allocate 8 GiB, to show that RLIMIT_AS holds (MemoryError)."""
    try:
        bytearray(8 << 30)
    except MemoryError:
        print(json.dumps({"limit_held": True}), flush=True)
        return
    print(json.dumps({"limit_held": False}), flush=True)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "tfrecord_stream": _target_tfrecord_stream,
    "tfrecord_offsets": _target_tfrecord_offsets,
    "tfrecord_index": _target_tfrecord_index,
    "shard_index": _target_shard_index,
    "example": _target_example,
    "jpeg": _target_jpeg,
    "tf_checkpoint": _target_tf_checkpoint,
    "state_files": _target_state_files,
    "cluster_spec": _target_cluster_spec,
    "manifest": _target_manifest,
    "alloc_probe": _target_alloc_probe,
}


# -------------------------------------------------------------------------------- generators
# Seeded ``random.Random`` generators, not Hypothesis strategies: Hypothesis spends ~3 ms of its
# own per example (measured here), which would make 10^5 inputs per target take over an hour;
# these take microseconds. A failing input is kept as is (no shrinking) under corpus/.


def _damage(rng: random.Random, data: bytes) -> bytes:
    """``data`` damaged 0-4 times: bit flips, cuts, inserts, overwrites, duplicated spans."""
    out = bytearray(data)
    for _ in range(rng.randint(0, 4)):
        op = rng.choice(("flip", "cut", "insert", "overwrite", "dup"))
        pos = rng.randint(0, max(len(out), 1))
        if op == "flip" and out:
            out[pos % len(out)] ^= 1 << rng.randint(0, 7)
        elif op == "cut":
            del out[pos:]
        elif op == "insert":
            out[pos:pos] = rng.randbytes(rng.randint(0, 16))
        elif op == "overwrite":
            chunk = rng.choice((b"\xff", b"\x00", b"\xff\xff", b"\x7f\xff\xff\xff"))
            out[pos : pos + len(chunk)] = chunk
        elif op == "dup" and out:
            end = rng.randint(pos, len(out))
            out[pos:pos] = out[pos:end]
    return bytes(out)


def _records(rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 6))]


def _gen_tfrecord(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.15:
        return rng.randbytes(rng.randint(0, 128))
    file = b"".join(_frame(r) for r in _records(rng))
    if kind < 0.3:
        # A header whose CRC is right but whose length is anything (up to 2**64 - 1).
        length = rng.choice((rng.getrandbits(64), rng.getrandbits(rng.randint(1, 64)), 0))
        return file + _valid_length_header(length) + rng.randbytes(rng.randint(0, 32))
    return _damage(rng, file)


def _gen_index(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.1:
        return rng.randbytes(rng.randint(0, 64))
    if kind < 0.4:
        return _damage(rng, b"0 19\n19 21\n40 26\n")
    lines = []
    for _ in range(rng.randint(0, 6)):
        r = rng.random()
        if r < 0.5:
            big = rng.choice((8, 16, 32, 64, 70))
            lines.append(f"{rng.getrandbits(big) - (1 << (big - 1))} {rng.getrandbits(big)}")
        elif r < 0.8:
            lines.append(
                rng.choice(
                    ("0 16", "0 19", "19 21", "40 26", "0", "", "  ", "a b", "0 0x10", "1_9 2")
                )
            )
        else:
            lines.append("".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 8))))
    return "\n".join(lines).encode("utf-8")


def _gen_shard_index(rng: random.Random) -> bytes:
    """A shard and its index (``_target_shard_index``): the index cut to fewer lines, with or
    without its trailer; stale (of the shard before records were appended, or of other records
    of the same or another size); two lines merged into one; of the shard's own version or
    another; damaged bytes; or exact."""
    from estimax.data import tfrecord

    records = _records(rng)
    frames = [_frame(r) for r in records]
    shard = b"".join(frames)
    offsets = [0]
    for f in frames:
        offsets.append(offsets[-1] + len(f))
    kind = rng.choice(("exact", "cut", "appended", "other", "merged", "damaged"))
    indexed = offsets
    if kind == "cut" and len(offsets) > 1:
        indexed = offsets[: rng.randint(1, len(offsets) - 1)]
    elif kind == "appended":  # indexed, then records added to the shard
        indexed = offsets[: rng.randint(1, len(offsets))]
        extra = [_frame(r) for r in _records(rng)] or [_frame(b"x")]
        shard += b"".join(extra)
    elif kind == "other":  # another shard's index (its size may happen to be this one's)
        other = [0]
        for r in _records(rng):
            other.append(other[-1] + len(_frame(r)))
        indexed = other
    elif kind == "merged" and len(offsets) > 2:
        j = rng.randint(1, len(offsets) - 2)
        indexed = offsets[:j] + offsets[j + 1 :]
    size = indexed[-1] if rng.random() < 0.5 or kind == "exact" else len(shard)
    version = rng.choice((_OWN_VERSION.decode(), "mtime_ns%3A1", None))
    lines = "".join(f"{a} {b - a}\n" for a, b in zip(indexed[:-1], indexed[1:], strict=False))
    trailer = tfrecord.index_trailer({"size": size}).rstrip("\n")
    if version is not None:
        trailer += f" version={version}"
    text = (lines + (trailer + "\n" if rng.random() < 0.8 else "")).encode()
    if kind == "damaged":
        text = _damage(rng, text)
    return struct.pack("<I", len(shard)) + shard + text


def _gen_example(rng: random.Random) -> bytes:
    from estimax.data import example

    if rng.random() < 0.15:
        return rng.randbytes(rng.randint(0, 128))
    features = {}
    for _ in range(rng.randint(0, 4)):
        name = rng.choice(
            ("image/encoded", "image/class/label", "pair", "image/object/bbox/xmin", "x", "")
        )
        n = rng.randint(1, 3)
        kind = rng.randint(0, 2)
        if kind == 0:
            features[name] = [rng.randbytes(rng.randint(0, 16)) for _ in range(n)]
        elif kind == 1:
            features[name] = [rng.getrandbits(64) - 2**63 for _ in range(n)]
        else:
            features[name] = [
                rng.choice((rng.uniform(-1e30, 1e30), float("nan"), float("inf"), -0.0))
                for _ in range(n)
            ]
    return _damage(rng, example.encode_example(features))


_SEEDS: list[bytes] = []


def _gen_jpeg(rng: random.Random) -> bytes:
    if not _SEEDS:
        _SEEDS.extend(_image_seeds())
    kind = rng.random()
    if kind < 0.05:
        return rng.randbytes(rng.randint(0, 64))
    data = rng.choice(_SEEDS)
    if kind < 0.35:
        data = _claim_dims(data, rng.choice(_HEADER_DIMS), rng.choice(_HEADER_DIMS))
    return _damage(rng, data)


def _image_seeds() -> list[bytes]:
    import cv2
    import numpy as np
    import simplejpeg

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (13, 17, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, (9, 8, 1), dtype=np.uint8)
    return [
        simplejpeg.encode_jpeg(rgb, quality=80, colorspace="RGB", colorsubsampling="420"),
        simplejpeg.encode_jpeg(rgb, quality=95, colorspace="RGB", colorsubsampling="444"),
        simplejpeg.encode_jpeg(gray, quality=90, colorspace="GRAY"),
        cv2.imencode(".jpg", rgb, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes(),
        cv2.imencode(".png", rgb)[1].tobytes(),
    ]


def _claim_dims(image: bytes, height: int, width: int) -> bytes:
    """The image with its header claiming ``height`` x ``width`` (a memory bomb when large)."""
    data = bytearray(image)
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        i = data.find(marker)
        if i >= 0:  # FFCx, length(2), precision(1), height(2), width(2)
            data[i + 5 : i + 9] = struct.pack(">HH", height, width)
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        data[16:24] = struct.pack(">II", width, height)  # IHDR (its CRC is then wrong)
    return bytes(data)


# ------------------------------------------------------------- TensorFlow checkpoint index
# A LevelDB-format table (tensorflow/core/lib/io/table_format.txt) written here: the reader's
# checks sit behind each block's CRC32C, so damage is made to the fields before the table is
# built (and then, a little, to the bytes after).

_TF_DATA = bytes(range(256)) * 2  # the data file every generated index points into


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _masked(data: bytes) -> bytes:
    import crc32c

    crc = crc32c.crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def table_block(entries: list[tuple[bytes, bytes]], restart_interval: int = 16) -> bytes:
    """One block: prefix-compressed entries, then the restart offsets and their count."""
    out, restarts, previous = bytearray(), [], b""
    for i, (key, value) in enumerate(entries):
        shared = 0
        if i % restart_interval == 0:
            restarts.append(len(out))
        else:
            while shared < min(len(key), len(previous)) and key[shared] == previous[shared]:
                shared += 1
        out += _uvarint(shared) + _uvarint(len(key) - shared) + _uvarint(len(value))
        out += key[shared:] + value
        previous = key
    restarts = restarts or [0]
    return (
        bytes(out)
        + b"".join(struct.pack("<I", r) for r in restarts)
        + struct.pack("<I", len(restarts))
    )


def _with_trailer(block: bytes) -> bytes:
    return block + b"\x00" + _masked(block + b"\x00")  # type 0: not compressed


def table_file(
    blocks: list[bytes], index_keys: list[bytes] | None = None, listings: int = 1
) -> bytes:
    """A table of data ``blocks`` (already built), its index block and footer; the index
    lists each block ``listings`` times."""
    out, handles = bytearray(), []
    for block in blocks:
        handles += [_uvarint(len(out)) + _uvarint(len(block))] * listings
        out += _with_trailer(block)
    keys = index_keys or [i.to_bytes(4, "big") + b"\xff" for i in range(len(handles))]
    meta_handle = _uvarint(len(out)) + _uvarint(len(table_block([])))
    out += _with_trailer(table_block([]))
    index = table_block(list(zip(keys, handles, strict=True)), restart_interval=1)
    index_handle = _uvarint(len(out)) + _uvarint(len(index))
    out += _with_trailer(index)
    footer = (meta_handle + index_handle).ljust(40, b"\x00")
    return bytes(out + footer + struct.pack("<Q", 0xDB4775248B80FB57))


def _pick(rng: random.Random, valid: tuple, absurd: tuple) -> object:
    """A valid value mostly; an absurd one in one case of ten."""
    return rng.choice(absurd if rng.random() < 0.1 else valid)


def _tf_entry(rng: random.Random) -> bytes:
    """A BundleEntryProto, its fields valid or (each one in ten) absurd."""
    from estimax.migrate import tf_checkpoint

    entry = tf_checkpoint._bundle_messages()[1]()
    entry.dtype = _pick(rng, (1, 1, 3, 9, 14, 19), (0, 7, 20, 99, -1))
    rank = _pick(rng, (0, 1, 2, 3), (4, 255, 300))
    for _ in range(rank):
        entry.shape.dim.add(size=_pick(rng, (0, 1, 2, 3, 8), (-1, 2**31, 2**62, -(2**63))))
    entry.shape.unknown_rank = rng.random() < 0.03
    entry.shard_id = _pick(rng, (0,), (1, -1, 2**31 - 1))
    entry.offset = _pick(rng, (0, rng.randint(0, len(_TF_DATA))), (-1, len(_TF_DATA), 2**62))
    itemsize = {1: 4, 3: 4, 9: 8, 14: 2, 19: 2}.get(entry.dtype, 4)
    count = 1
    for d in entry.shape.dim:
        count *= d.size
    size = _pick(rng, (count * itemsize,), (rng.randint(0, 600), 2**62, -5))
    entry.size = max(-(2**63), min(size, 2**63 - 1))  # int64 on the wire
    if rng.random() < 0.8 and 0 <= entry.offset and 0 <= entry.size <= len(_TF_DATA):
        raw = _TF_DATA[entry.offset : entry.offset + entry.size]
        entry.crc32c = struct.unpack("<I", _masked(raw))[0]
    if rng.random() < 0.05:
        entry.slices.add()
    return entry.SerializeToString()


def _tf_header(rng: random.Random) -> bytes:
    from estimax.migrate import tf_checkpoint

    header = tf_checkpoint._bundle_messages()[0]()
    header.num_shards = _pick(rng, (1, 0), (2, -1, 2**31 - 1))
    header.endianness = _pick(rng, (0,), (1, 2))
    return header.SerializeToString()


def _gen_tf_index(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.05:
        return rng.randbytes(rng.randint(0, 96))
    if kind < 0.1:  # the index listing a block again and again
        return block_reuse_bomb(rng.randint(64, 1024), block_bytes=rng.randint(16, 256))
    if kind < 0.15:  # keys that expand past the bound
        return prefix_compression_bomb(rng.randint(1000, 8000), prefix=rng.randint(64, 4096))
    stems = (b"a", b"b/c", b"conv/kernel", b"x" * 40)
    names = {rng.choice(stems) + rng.randbytes(rng.randint(0, 3)) for _ in range(rng.randint(0, 8))}
    entries = [(b"", _tf_header(rng))] * (rng.random() < 0.9)
    entries += [(name, _tf_entry(rng)) for name in sorted(names)]
    if rng.random() < 0.1 and len(entries) > 1:  # out of order, or a key twice
        i, j = rng.randrange(len(entries)), rng.randrange(len(entries))
        entries[i], entries[j] = entries[j], entries[i]
    per_block = rng.choice((1, 2, 16))
    blocks = [
        table_block(entries[i : i + per_block], rng.choice((1, 2, 16)))
        for i in range(0, len(entries), per_block)
    ]
    data = table_file(blocks)
    return _damage(rng, data) if rng.random() < 0.3 else data


def prefix_compression_bomb(size: int, prefix: int = 1 << 16) -> bytes:
    """A sorted index of about ``size`` bytes whose keys share one ``prefix``-byte start, each
    one byte longer than the last: written out, its keys come to ~size/6 * (prefix + ...)."""
    entries = [(b"a" * prefix, b"")]
    body = bytearray(table_block(entries))[:-8]  # its entries, without restarts and count
    key_len = prefix
    while len(body) < size:
        body += _uvarint(key_len) + _uvarint(1) + _uvarint(0) + b"\x01"
        key_len += 1
    block = bytes(body) + struct.pack("<I", 0) + struct.pack("<I", 1)
    return table_file([block], [b"b"])


def block_reuse_bomb(size: int, block_bytes: int = 1 << 20) -> bytes:
    """An index of about ``size`` bytes that lists one ``block_bytes`` data block again and
    again (a reader would check and decode it once per listing)."""
    # Its one entry is a valid BundleEntryProto: an unknown field (15) of block_bytes zeros.
    block = table_block([(b"k", b"\x7a" + _uvarint(block_bytes) + b"\x00" * block_bytes)])
    return table_file([block], listings=max(2, (size - block_bytes) // 12))


# --------------------------------------------------------------------------- JSON state
# State files and cluster specs: valid documents, then damaged bytes, absurd values in the
# fields, or nesting far deeper than any file estimax writes (100,000 levels: RecursionError).


def _nest(rng: random.Random) -> str:
    """JSON nested deep: around estimax's bound (32), Python's limit (~1,000), far past."""
    depth = rng.choice((2, 31, 32, 33, 900, 1000, 5000, 100_000))
    if rng.random() < 0.5:
        key = rng.choice(('"evaluations"', '"cluster"', '"task"', '"label_map"', '"stopped_at"'))
        return ("{" + key + ": ") * depth + "1" + "}" * depth
    return "[" * depth + "1" + "]" * depth


def _absurd(rng: random.Random) -> object:
    return rng.choice(
        (
            10**12,
            -(10**12),
            10**400,
            2**63,
            -1,
            0,
            True,
            None,
            "\u00b2",
            "\u0661",
            "9" * 5000,
            "1e3",
            "",
            1.5,
            float("nan"),
            [],
            {},
        )
    )


def _json_text(rng: random.Random, valid: object) -> bytes:
    kind = rng.random()
    if kind < 0.15:
        return _nest(rng).encode()
    if kind < 0.2:
        return rng.randbytes(rng.randint(0, 64))
    text = json.dumps(valid)
    return _damage(rng, text.encode()) if kind < 0.45 else text.encode()


def _gen_state(rng: random.Random) -> bytes:
    evaluations: dict[str, object] = {}
    for step, value in _STATE_ACCURACY.items():
        if rng.random() < 0.8:
            results = {"accuracy": value, "loss": 1 - value, "global_step": step}
            if rng.random() < 0.2:
                results[rng.choice(("accuracy", "global_step", "loss"))] = _absurd(rng)
            evaluations[str(step) if rng.random() < 0.95 else str(_absurd(rng))] = results
    if rng.random() < 0.5:
        valid: object = {"evaluations": evaluations}
    else:
        valid = {
            "stopped_at": rng.choice((20, _absurd(rng))),
            "best_step": rng.choice((12, _absurd(rng))),
            "metric": "accuracy",
        }
    return _json_text(rng, valid)


def _gen_cluster_spec(rng: random.Random) -> bytes:
    if rng.random() < 0.2:  # a launch variable's number, as a job runner might set it
        numbers = ("2", "0", "\u00b2", "\u0661", "\uff11", "9" * 5000, str(10**12), "-1", "")
        return rng.choice((*numbers, " ", " 3 ", "1e3", "0x10", "1_0", str(2**20 + 1))).encode()
    types = ("chief", "worker", "evaluator", "ps", "workerpool0", "workerpool1", "workerpool3")
    cluster: dict[str, object] = {}
    for kind in rng.sample(types, rng.randint(0, 4)):
        hosts: list[object] = []
        for _ in range(rng.randint(0, 3)):
            port = rng.choice((2222, 1, 65535, 0, 65536, 99999, "\u0662\u0662", "x"))
            host = rng.choice(("h", "10.0.0.1", "[::1]", "", "a b"))
            hosts.append(f"{host}:{port}" if rng.random() < 0.9 else _absurd(rng))
        cluster[kind] = hosts if rng.random() < 0.95 else _absurd(rng)
    task = {"type": rng.choice(types), "index": rng.choice((0, 1, 2, "1", _absurd(rng)))}
    return _json_text(rng, {"cluster": cluster, "task": task if rng.random() < 0.95 else 5})


def _gen_manifest(rng: random.Random) -> bytes:
    label_map: dict[str, object] = {}
    for i in range(rng.randint(0, 12)):
        label_map[rng.choice(("n01440764", "caf\u00e9", "", "x" * 300)) + str(i)] = (
            i + 1 if rng.random() < 0.85 else _absurd(rng)
        )
    fmt = "estimax-convert/1" if rng.random() < 0.9 else "other"
    return _json_text(rng, {"format": fmt, "label_map": label_map})


GENERATORS: dict[str, Callable[[random.Random], bytes]] = {
    "tfrecord_stream": _gen_tfrecord,
    "tfrecord_offsets": _gen_tfrecord,
    "tfrecord_index": _gen_index,
    "shard_index": _gen_shard_index,
    "example": _gen_example,
    "jpeg": _gen_jpeg,
    "tf_checkpoint": _gen_tf_index,
    "state_files": _gen_state,
    "cluster_spec": _gen_cluster_spec,
    "manifest": _gen_manifest,
}


# -------------------------------------------------------------------------------------- main

_SCRATCH = ""


def _on_alarm(signum, frame):
    raise Hang(f"input ran longer than {_INPUT_TIMEOUT_S} s")


def run(target: str, num_inputs: int, seed: int, out_dir: str) -> dict:
    """Runs ``target`` over ``num_inputs`` generated inputs; raises on the first failure."""
    global _INDEXED_FILE
    _INDEXED_FILE = _frame(b"abc") + _frame(b"defgh") + _frame(b"0123456789")
    fn, generate = TARGETS[target], GENERATORS[target]
    _SETUP.get(target, lambda: None)()  # imports and fixtures: not an input's time
    rng = random.Random(seed)
    current = os.open(os.path.join(out_dir, "current.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
    signal.signal(signal.SIGALRM, _on_alarm)
    for count in range(1, num_inputs + 1):
        data = generate(rng)
        os.ftruncate(current, 0)
        os.pwrite(current, data, 0)
        signal.setitimer(signal.ITIMER_REAL, _INPUT_TIMEOUT_S)
        try:
            fn(data)
        except BaseException:
            with open(os.path.join(out_dir, "failure.bin"), "wb") as f:
                f.write(data)
            with open(os.path.join(out_dir, "failure.txt"), "w") as f:
                f.write(f"input {count} of target {target}, seed {seed}:\n")
                f.write(traceback.format_exc())
            raise
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return {"target": target, "inputs": count, "max_rss_mib": _peak_rss_mib()}


def _peak_rss_mib() -> float:
    """This process's own peak resident memory, in MiB."""
    # Not getrusage's ru_maxrss: Linux carries it over exec, so a child started with vfork
    # (subprocess does where it can) reports its parent's peak, a pytest worker's hundreds of MiB.
    # VmHWM belongs to the process's own address space, which exec replaced.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def main(argv: list[str]) -> int:
    global _SCRATCH
    target, num_inputs, seed, out_dir, limit_mib = argv[1:6]
    limit = int(limit_mib) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from estimax.data import jpeg

    # The same check as in production, at a lower number: a 4-megapixel image decodes in
    # milliseconds, a 179-megapixel one (filled in by libjpeg from a damaged file) in seconds.
    jpeg.MAX_IMAGE_PIXELS = 1 << 22
    # Scratch files in memory where there is a tmpfs: two files are written per input.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="estimax-fuzz-", dir=shm) as scratch:
        _SCRATCH = scratch
        if target == "alloc_probe":
            _target_alloc_probe(b"")
            return 0
        if len(argv) > 6:  # replay saved inputs (regression tests); raises on a failure
            for path in argv[6:]:
                with open(path, "rb") as f:
                    TARGETS[target](f.read())
            print(json.dumps({"target": target, "inputs": len(argv) - 6}), flush=True)
            return 0
        try:
            result = run(target, int(num_inputs), int(seed), out_dir)
        except Exception:
            traceback.print_exc(file=sys.stderr)
            return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.stdout = io.TextIOWrapper(sys.stdout.buffer, line_buffering=True)
    sys.exit(main(sys.argv))
