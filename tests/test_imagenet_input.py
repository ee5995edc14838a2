"""The ImageNet input_fn: schema, 1-based labels, eval exactness, fake data, host shards, errors.

Shards are written here like the original converter (imagenet_to_gcs.py fields, 1-based labels)
with tiny PNG-free JPEGs made by Pillow. The preprocessing is a small Pillow stand-in with the
signature of estimax.data.preprocessing, so these tests check the input's plumbing and not the
other module's image maths (tests/test_preprocessing.py does that).
"""

import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from estimax.data import example as ex
from estimax.data import imagenet, tfrecord
from estimax.data.loader import BadRecordError

SIZE = 8  # output image side


def _jpeg(value: int, h: int = 12, w: int = 10) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), value, np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _record(
    label_1based: int,
    value: int | None = None,
    image: bytes | None = None,
    bbox: list | None = None,
) -> bytes:
    feats = {
        "image/encoded": image if image is not None else _jpeg(value or 0),
        "image/format": b"JPEG",
        "image/colorspace": b"RGB",
        "image/channels": 3,
        "image/height": 12,
        "image/width": 10,
        "image/class/synset": b"n01440764",
        "image/filename": b"n01440764_10026.JPEG",
        "image/class/label": label_1based,
    }
    if bbox:
        b = np.asarray(bbox, np.float32)
        feats.update(
            {
                "image/object/bbox/ymin": b[:, 0],
                "image/object/bbox/xmin": b[:, 1],
                "image/object/bbox/ymax": b[:, 2],
                "image/object/bbox/xmax": b[:, 3],
            }
        )
    return ex.encode_example(feats)


def pil_preprocess(image_bytes, is_training, image_size, rng, bbox=None):
    """Stand-in preprocessing: decode, nearest resize; train adds a flip chosen by ``rng``."""
    img = np.asarray(
        Image.open(io.BytesIO(image_bytes))
        .convert("RGB")
        .resize((image_size, image_size), Image.NEAREST)
    )
    if is_training and rng.random() < 0.5:
        img = img[:, ::-1]
    return img


def _write_split(directory, split, labels_per_file):
    """labels_per_file: list (per shard) of 1-based labels; pixel value = 10 * label."""
    n = len(labels_per_file)
    for s, labels in enumerate(labels_per_file):
        with tfrecord.TFRecordWriter(str(directory / tfrecord.sharded_name(split, s, n))) as w:
            for label in labels:
                w.write(_record(label, value=10 * label))


@pytest.fixture
def data_dir(tmp_path):
    _write_split(tmp_path, "train", [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    _write_split(tmp_path, "validation", [[1, 2, 3, 4], [5, 6, 7]])
    return str(tmp_path)


@dataclasses.dataclass
class Ctx:
    host_index: int = 0
    num_hosts: int = 1


def _fn(data_dir, is_training, **kw):
    kw.setdefault("preprocessing", pil_preprocess)
    kw.setdefault("image_size", SIZE)
    kw.setdefault("num_parallel_calls", 0)
    kw.setdefault("num_classes", 10)
    return imagenet.input_fn(data_dir, is_training, **kw)


def _pixel_labels(images):
    """The 1-based label written into a test image's pixels (10 * label, JPEG-rounded)."""
    return np.round(images[:, 0, 0, 0].astype(np.float64) / 10).astype(int)


def test_eval_pass_exact_labels_zero_based(data_dir):
    batches = list(_fn(data_dir, False)({"batch_size": 3}))
    assert [b[1].shape for b in batches] == [(3,), (3,), (1,)]  # 7 records: last batch of 1
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    assert images.shape == (7, SIZE, SIZE, 3) and images.dtype == np.uint8
    assert labels.dtype == np.int32
    assert labels.tolist() == [0, 1, 2, 3, 4, 5, 6]  # files hold 1..7: minus one, file order
    np.testing.assert_array_equal(_pixel_labels(images), labels + 1)


def test_train_fixed_shapes_repeats_and_resumes(data_dir):
    ds = _fn(data_dir, True, seed=5)({"batch_size": 4, "context": Ctx()})
    it = iter(ds)
    first = [next(it) for _ in range(6)]  # 24 examples > 9 records: crosses epochs
    assert all(b[0].shape == (4, SIZE, SIZE, 3) for b in first)
    seen = np.concatenate([b[1] for b in first[:2]] + [first[2][1][:1]])
    assert sorted(seen.tolist()) == list(range(9))  # the first 9 = one epoch
    state = json.loads(json.dumps(it.get_state()))
    ref = [next(it) for _ in range(3)]
    it2 = iter(_fn(data_dir, True, seed=5)({"batch_size": 4, "context": Ctx()}))
    it2.set_state(state)
    for want in ref:
        got = next(it2)
        np.testing.assert_array_equal(want[0], got[0])
        np.testing.assert_array_equal(want[1], got[1])


@pytest.mark.parametrize(
    "num_hosts, shard_by", [(2, "file"), (3, "file"), (4, "file"), (2, "record"), (3, "global")]
)
def test_hosts_read_disjoint_shards_covering_all(data_dir, num_hosts, shard_by):
    all_labels = []
    for h in range(num_hosts):
        ds = _fn(data_dir, False, shard_by=shard_by)(
            {"batch_size": 2, "context": Ctx(h, num_hosts)}
        )
        all_labels += np.concatenate([b[1] for b in ds]).tolist()
    assert sorted(all_labels) == list(range(7))  # every validation record exactly once


def test_label_out_of_range(tmp_path):
    with tfrecord.TFRecordWriter(str(tmp_path / "validation-00000-of-00001")) as w:
        w.write(_record(3, value=30))
        w.write(_record(11, value=40))  # > num_classes=10
        w.write(ex.encode_example({"image/encoded": _jpeg(5)}))  # no label
    first_len = 16 + len(_record(3, value=30))
    with pytest.raises(BadRecordError) as e:
        list(_fn(str(tmp_path), False)({"batch_size": 2}))
    assert str(e.value) == (
        f"{tmp_path}/validation-00000-of-00001: record at byte offset {first_len}: ValueError: "
        "label out of range: image/class/label = 11; the files' labels are 1-based and must be "
        "in [1, 10]"
    )
    it = iter(_fn(str(tmp_path), False, skip_bad_records=True)({"batch_size": 2}))
    assert [b[1].tolist() for b in it] == [[2]]
    assert it.num_skipped == 2


def test_undecodable_jpeg_named(tmp_path):
    with tfrecord.TFRecordWriter(str(tmp_path / "train-00000-of-00001")) as w:
        w.write(_record(1, image=b"\xff\xd8 this is not a jpeg"))
    with pytest.raises(
        BadRecordError,
        match=r"train-00000-of-00001: record at byte offset 0: "
        r"UnidentifiedImageError",
    ):
        next(iter(_fn(str(tmp_path), True)({"batch_size": 1})))


def test_empty_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no files match the pattern '.*/train-\*'"):
        _fn(str(tmp_path), True)({"batch_size": 1})


@pytest.mark.parametrize("data_dir", [None, "", "null"])
def test_null_input_as_original(data_dir):
    it = iter(imagenet.input_fn(data_dir, True)({"batch_size": 2}))
    images, labels = next(it)
    assert images.shape == (2, 224, 224, 3) and not images.any()
    assert labels.tolist() == [0, 0]


def test_fake_random_eval_finite_and_resumable():
    fn = imagenet.input_fn(
        "gs://unused",
        False,
        use_fake_data=True,
        fake_data="random",
        image_size=16,
        preprocessing="inception",
        fake_eval_examples=5,
    )
    batches = list(fn({"batch_size": 2}))
    assert [b[0].shape[0] for b in batches] == [2, 2, 1]
    assert batches[0][0].dtype == np.float32 and batches[0][0].std() > 0.5
    it = iter(fn({"batch_size": 2}))
    next(it)
    it2 = iter(fn({"batch_size": 2}))
    it2.set_state(it.get_state())
    np.testing.assert_array_equal(next(it2)[0], batches[1][0])


def test_annotated_bbox_reaches_preprocessing(tmp_path):
    seen = []

    def spy(image_bytes, is_training, image_size, rng, bbox=None):
        seen.append(bbox)
        return pil_preprocess(image_bytes, is_training, image_size, rng)

    with tfrecord.TFRecordWriter(str(tmp_path / "train-00000-of-00001")) as w:
        w.write(_record(1, value=10, bbox=[[0.1, 0.2, 0.6, 0.9], [0.0, 0.0, 1.0, 0.5]]))
        w.write(_record(2, value=20))
    ds = _fn(str(tmp_path), True, preprocessing=spy, use_annotated_bbox=True, shard_by="file")
    it = iter(ds({"batch_size": 2}))
    next(it)
    it.close()
    first_epoch = seen[:2]  # (prefetch runs on into the next epochs)
    boxes = [b for b in first_epoch if b is not None]
    assert len(boxes) == 1
    np.testing.assert_allclose(boxes[0], [[0.1, 0.2, 0.6, 0.9], [0.0, 0.0, 1.0, 0.5]])


def test_schema_parses_converter_record():
    p = ex.parse_example(_record(7, value=70), imagenet.IMAGENET_SCHEMA)
    assert p["image/class/label"] == 7 and imagenet.label_from_example(p) == 6
    assert p["image/class/synset"] == b"n01440764" and p["image/height"] == 12
    assert p["image/class/text"] == b"" and p["image/format"] == b"JPEG"
    assert p["image/object/bbox/xmin"].shape == (0,)


def test_bad_arguments():
    with pytest.raises(
        ValueError, match="preprocessing must be 'resnet', 'inception' or a callable, got 'vgg'"
    ):
        imagenet.input_fn("/d", True, preprocessing="vgg")
    with pytest.raises(ValueError, match="shard_by must be 'global', 'file' or 'record'"):
        imagenet.input_fn("/d", True, shard_by="host")


@pytest.mark.parametrize("preprocessing, dtype", [("resnet", np.uint8), ("inception", np.float32)])
def test_default_preprocessing_functions_plug_in(tmp_path, preprocessing, dtype):
    """The named preprocessing of estimax.data.preprocessing runs inside the loader."""
    pytest.importorskip("estimax.data.preprocessing")
    with tfrecord.TFRecordWriter(str(tmp_path / "train-00000-of-00001")) as w:
        for label in (1, 2, 3):
            w.write(_record(label, image=_jpeg(40 * label, h=48, w=64)))
    fn = imagenet.input_fn(
        str(tmp_path),
        True,
        image_size=24,
        preprocessing=preprocessing,
        num_parallel_calls=1,
        num_classes=10,
    )
    it = iter(fn({"batch_size": 3}))
    images, labels = next(it)
    it.close()
    assert images.shape == (3, 24, 24, 3) and images.dtype == dtype
    assert sorted(labels.tolist()) == [0, 1, 2]


# --- With the Estimator: the input contract end to end. ------------------------------------


def _tiny_image_model_fn(features, labels, mode, params):
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    import estimax as estx

    x = features.astype(jnp.float32) / 255.0
    logits = nn.Dense(10)(
        jnp.concatenate([x.mean(axis=(1, 2)), x[:, ::4, ::4, 0].reshape(x.shape[0], -1)], axis=-1)
    )
    return estx.EstimatorSpec(
        mode=mode,
        loss=estx.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.5, momentum=0.9),
        eval_metrics={"accuracy": estx.metrics.accuracy(labels, logits)},
    )


def _estimator(tmp_path, name):
    import estimax as estx

    return estx.Estimator(
        _tiny_image_model_fn,
        estx.RunConfig(
            model_dir=str(tmp_path / name), iterations_per_loop=1, save_checkpoints_steps=1
        ),
        train_batch_size=8,
        eval_batch_size=8,
    )


def test_estimator_resume_with_imagenet_input_is_exact(data_dir, tmp_path):
    import jax

    train = _fn(data_dir, True, seed=1)
    straight = _estimator(tmp_path, "straight")
    straight.train(train, max_steps=4)
    resumed = _estimator(tmp_path, "resumed")
    resumed.train(train, max_steps=2)  # 16 of 9 records: the resume point is in epoch 1
    resumed = _estimator(tmp_path, "resumed")
    resumed.train(train, max_steps=4)
    for a, b in zip(
        jax.tree_util.tree_leaves(straight.get_variables()),
        jax.tree_util.tree_leaves(resumed.get_variables()),
        strict=False,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Eval: 7 validation records, one ragged batch, each counted once.
    assert straight.evaluate(_fn(data_dir, False))["num_examples"] == 7


def test_fake_resnet_input_feeds_estimator(tmp_path):
    est = _estimator(tmp_path, "fake")
    est.train(imagenet.input_fn(None, True, image_size=32), max_steps=2)
    assert est.get_global_step() == 2
    result = est.evaluate(imagenet.input_fn("null", False, image_size=32, fake_eval_examples=12))
    assert result["num_examples"] == 12
    assert result["accuracy"] in (0.0, 1.0)  # every fake label is 0 and every image the same
