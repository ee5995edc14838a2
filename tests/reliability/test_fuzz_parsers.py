"""Fuzzing the parsers of data users did not write: TFRecord framing, index files, tf.Example,
JPEG/PNG decoding, TensorFlow checkpoint indexes, and the JSON state read before or while
training (evaluations.json and early_stopping.json beside TensorBoard's event files, $TF_CONFIG and
$CLUSTER_SPEC, a converter's manifest.json: damaged, lying, nested 100,000 deep). Only the
documented errors, no hang, no crash in a C extension, bounded memory.

Each target runs in a child process (tests/reliability/fuzz_targets.py) under ``RLIMIT_AS``, so
a segfault is a signal exit the test names, a hang is a timeout, and a memory bomb is a
``MemoryError``. Short mode: a few thousand inputs per target; `make reliability`: 10^5.
Inputs that once failed are kept under corpus/ and replayed every run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from . import fuzz_targets
from .conftest import scale

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHILD = os.path.join(HERE, "fuzz_targets.py")
MEMORY_LIMIT_MIB = 1536
# Corpus file name prefixes replayed against each target.
CORPUS = {
    "tfrecord_stream": "tfrecord-",
    "tfrecord_offsets": "tfrecord-",
    "tfrecord_index": "tfrecord_index-",
    # A shard with a cut, stale, foreign or damaged index (issue #42 item 11): never fewer
    # records read.
    "shard_index": "shard_index-",
    "example": "example-",
    "jpeg": "jpeg-",
    "tf_checkpoint": "tf_checkpoint-",
    # JSON state read before or while training (issue #42): evaluations.json and
    # early_stopping.json, $TF_CONFIG / $CLUSTER_SPEC, a converter's manifest.json.
    "state_files": "state_files-",
    "cluster_spec": "cluster_spec-",
    "manifest": "manifest-",
}


def _run_child(args: list[str], out_dir: str, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, CHILD, *args[:2], args[2], out_dir, str(MEMORY_LIMIT_MIB), *args[3:]]
    current = os.path.join(out_dir, "current.bin")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[0]}: hang (no result in {timeout:.0f} s); last input in {current}")
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(
            f"{args[0]}: the child died of {name} (a crash in a C extension?); the input is in "
            f"{current}; keep it under tests/reliability/corpus/. stderr:\n{proc.stderr[-3000:]}"
        )
    if proc.returncode != 0:
        failure = os.path.join(out_dir, "failure.txt")
        detail = open(failure).read() if os.path.exists(failure) else proc.stderr
        pytest.fail(
            f"{args[0]}: an undocumented error; input in {out_dir}/failure.bin (keep it under "
            f"tests/reliability/corpus/):\n{detail[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def out_dir(tmp_path_factory):
    # In memory where there is a tmpfs: the child rewrites its current input there each time.
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    import tempfile

    d = tempfile.mkdtemp(prefix="estimax-fuzz-out-", dir=base)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("target", sorted(CORPUS))
def test_fuzz_parser(target, out_dir, reliability_record):
    num_inputs = scale(3000, 100_000)
    result = {}
    try:
        result = _run_child([target, str(num_inputs), "20261123"], out_dir, 120 + num_inputs / 50)
    finally:
        reliability_record(
            "fuzz",
            target,
            result.get("inputs", 0),
            result.get("inputs") == num_inputs,
            max_rss_mib=result.get("max_rss_mib"),
        )
    assert result["inputs"] == num_inputs
    # Memory stayed bounded: well under the limit (and the limit itself holds: next test).
    assert result["max_rss_mib"] < MEMORY_LIMIT_MIB / 2, result


def test_memory_limit_holds_in_the_child(out_dir):
    """The child's RLIMIT_AS is real: an 8 GiB allocation there fails with MemoryError."""
    assert _run_child(["alloc_probe", "1", "0"], out_dir, 60) == {"limit_held": True}


@pytest.mark.parametrize("target", sorted(set(CORPUS) - {"example"}))  # none for it yet
def test_corpus_regressions(target, out_dir):
    """Inputs that once failed (MemoryError from a crafted length or index, decompression
    bombs, a non-ASCII index) now give only documented errors."""
    files = sorted(glob.glob(os.path.join(HERE, "corpus", CORPUS[target] + "*.bin")))
    if target == "tfrecord_stream":  # the tfrecord- prefix would also match tfrecord_index-
        files = [f for f in files if "tfrecord_index-" not in f]
    if target == "tfrecord_offsets":
        files = [f for f in files if "tfrecord_index-" not in f]
    if not files:
        pytest.skip(f"no corpus inputs for {target} yet")
    assert _run_child([target, "0", "0", *files], out_dir, 120) == {
        "target": target,
        "inputs": len(files),
    }


def test_decompression_bomb_rejected_from_its_header():
    """An 850-byte JPEG claiming 65500 x 65500 pixels (12 GiB decoded; libjpeg's maximum):
    one clear error, raised before any pixel is allocated, naming the limit."""
    from estimax.data import jpeg

    with open(os.path.join(HERE, "corpus", "jpeg-sof-claims-65500x65500.bin"), "rb") as f:
        bomb = f.read()
    with pytest.raises(
        jpeg.ImageDecodeError,
        match=r"65500x65500 pixels claimed by its header is larger than "
        r"estimax.data.jpeg.MAX_IMAGE_PIXELS",
    ):
        jpeg.decode(bomb)
    with pytest.raises(jpeg.ImageDecodeError, match="decompression bomb"):
        jpeg.decode_crop(bomb, (0, 0, 8, 8), min_size=4)
    with open(os.path.join(HERE, "corpus", "jpeg-png-ihdr-claims-65535x65535.bin"), "rb") as f:
        with pytest.raises(jpeg.ImageDecodeError, match="65535x65535 pixels"):
            jpeg.decode(f.read())


@pytest.mark.parametrize(
    ("bomb", "refusal"),
    [
        (
            fuzz_targets.prefix_compression_bomb,
            "its prefix-compressed keys expand to more than 32 times the file's",
        ),
        (fuzz_targets.block_reuse_bomb, "its index names a block at byte 0, which overlaps"),
    ],
)
def test_tf_index_bombs_are_refused_in_proportion_to_their_size(
    bomb, refusal, tmp_path, reliability_record
):
    """4 MB .index files whose table expands (keys sharing a 64 KiB prefix, each one byte longer;
    one 1 MiB block listed 300,000 times): listing took 20 s to hours and gigabytes. The reader
    stops once the work passes its bound (32 times the file's size), with its own error."""
    from estimax.migrate import tf_checkpoint

    (tmp_path / "model.ckpt.index").write_bytes(bomb(4 << 20))
    refused = False
    try:
        with pytest.raises(tf_checkpoint.TFCheckpointError, match=f"damaged table \\({refusal}"):
            tf_checkpoint.CheckpointReader(str(tmp_path / "model.ckpt"))
        refused = True
    finally:
        reliability_record("fault", "TF index bombs", 1, refused)


def test_every_absurd_tf_entry_field_is_named(tmp_path):
    """Each corpus index holds one tensor with one absurd field (they gave MemoryError,
    ValueError, OSError, FileNotFoundError before): one TFCheckpointError naming the field."""
    from estimax.migrate import tf_checkpoint

    expected = {
        "negative-dim": "damaged entry w: a negative dimension in its shape [-1, -1]",
        "size-2e62": "needs bytes 0..4611686018427387904, the file has 512",
        "zero-by-2e62": "damaged entry w: its shape [0, 4611686018427387904] is larger than any",
        "offset-negative": "damaged entry w: offset -8, size 8 (negative)",
        "shard-2e31": "damaged entry w: shard 2147483647, of a checkpoint of 1 shards",
    }
    (tmp_path / "model.ckpt.data-00000-of-00001").write_bytes(fuzz_targets._TF_DATA)
    for name, message in expected.items():
        with open(os.path.join(HERE, "corpus", f"tf_checkpoint-{name}.bin"), "rb") as f:
            (tmp_path / "model.ckpt.index").write_bytes(f.read())
        with pytest.raises(tf_checkpoint.TFCheckpointError, match=re.escape(message)):
            with tf_checkpoint.CheckpointReader(str(tmp_path / "model.ckpt")) as reader:
                reader.get_tensor("w")
