"""Real TensorFlow reads what estimax writes beside data: the original's input
(``imagenet_input.py``: ``tf.data.Dataset.list_files(file_pattern)`` then ``TFRecordDataset``)
over ``train-*`` and ``validation-*`` of ``estimax-convert``'s output, after
``estimax-convert index --move`` relocated an earlier version's ``<shard>.idx``, and of a bucket
folder after an estimax job indexed it: every record, no ``DataLossError`` on an index file.

Needs TensorFlow: `make test` runs this file in .venv-tf; in the default venv it is skipped.
"""

import os
import struct
import uuid

import pytest

if os.environ.get("ESTIMAX_REQUIRE_TF"):  # `make test` runs this in .venv-tf
    import tensorflow  # noqa: F401
tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow runs in its own venv (`make test` builds .venv-tf)"
)

from estimax.data import sources, tfrecord  # noqa: E402
from estimax.tools import convert  # noqa: E402

TRAIN, VALIDATION = 12, 6


def _tf_count(pattern: str) -> int:
    """The records the original's input reads from the files ``pattern`` matches."""
    files = tf.data.Dataset.list_files(pattern, shuffle=False)
    return sum(1 for _ in tf.data.TFRecordDataset(files))


def test_tensorflow_reads_every_record_of_convert_output_after_estimax_indexed_it(tmp_path):
    out = str(tmp_path / "imagenet")
    argv = ["fake-imagenet", f"--output_dir={out}", f"--train_examples={TRAIN}",
            f"--validation_examples={VALIDATION}", "--train_shards=3", "--validation_shards=2",
            "--min_size=16", "--max_size=24", "--num_workers=1", "--no_progress"]  # fmt: skip
    assert convert.main(argv) == 0
    # An index an earlier estimax wrote beside its shard: moved out of the glob's way.
    shard = f"{out}/train-00000-of-00003"
    os.replace(tfrecord.default_index_path(shard), shard + ".idx")
    assert convert.main(["index", f"{out}/train-*", f"{out}/validation-*", "--move",
                         "--no_progress"]) == 0  # fmt: skip
    # An estimax read of it (the indexes are found and used).
    source = sources.TFRecordSource(tfrecord.list_files(f"{out}/train-*"))
    assert len(source) == TRAIN
    assert all(tfrecord.existing_index_path(f) for f in source.files)
    assert _tf_count(f"{out}/train-*") == TRAIN
    assert _tf_count(f"{out}/validation-*") == VALIDATION


def test_tensorflow_reads_every_record_of_a_bucket_folder_an_estimax_job_indexed(
    gcs_emulator, monkeypatch, tmp_path
):
    """The bucket is read through the GCS emulator by estimax; TensorFlow's own gs:// client
    cannot be pointed at the emulator, so it reads a copy of the folder as the job left it
    (every object in it, the indexes the job wrote included)."""
    from conftest import point_clients_at

    bucket = f"estimax-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(bucket)
    point_clients_at(monkeypatch, "gs", gcs_emulator.url)
    data = f"gs://{bucket}/imagenet"
    counts = {"train": 3 * 4, "validation": 2 * 3}
    for split, num in (("train", 3), ("validation", 2)):
        for s in range(num):
            # As TensorFlow's tools write them: no index.
            with tfrecord.TFRecordWriter(f"{data}/{tfrecord.sharded_name(split, s, num)}") as w:
                for i in range(counts[split] // num):
                    w.write(struct.pack("<q", i) + bytes(64))
    for split in counts:
        files = tfrecord.list_files(f"{data}/{split}-*")
        # The job's own index folder, then (told to) the hidden folder beside the data.
        sources.TFRecordSource(files, index_dir=f"gs://{bucket}/model/shard_indexes")
        source = sources.TFRecordSource(files, index_beside_data=True, keep_copies=False)
        assert len(source) == counts[split]
    fs, _ = tfrecord._fs_and_path(data)  # noqa: SLF001
    fs.invalidate_cache()
    assert fs.ls(f"{bucket}/imagenet/.estimax-index", detail=False)  # the job wrote them
    assert fs.ls(f"{bucket}/model/shard_indexes", detail=False)
    local = str(tmp_path / "copy")
    fs.get(f"{bucket}/imagenet", local, recursive=True)
    assert os.path.isdir(os.path.join(local, ".estimax-index"))
    assert _tf_count(f"{local}/train-*") == counts["train"]
    assert _tf_count(f"{local}/validation-*") == counts["validation"]
