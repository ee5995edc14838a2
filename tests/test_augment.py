"""estimax.data.augment: RandAugment's ops and Mixup, as big_vision/tensorflow/tpu define them.

Expected values are the definitions in tensorflow/tpu ``models/official/efficientnet/
autoaugment.py`` (forked as ``big_vision/pp/autoaugment.py``) and big_vision's
``utils.get_mixup``, worked on small synthetic images; the PIL equivalents the original's ops
name (``PIL.ImageOps``) where they agree exactly. Determinism is checked through the loader:
same seed, same images; a different augmentation per example and per epoch; and resumed from a
saved position, the same mixed batches.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
from PIL import Image, ImageOps

from estimax.data import augment, fake, imagenet, tfrecord
from estimax.data import example as ex


def _image(h: int = 24, w: int = 24, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8)


# --------------------------------------------------------------------------- the ops


def test_geometric_ops_at_magnitude_zero_and_the_other_ops_where_defined_are_identity():
    image = _image()
    rng = np.random.default_rng(0)
    for name in ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY", "Cutout", "SolarizeAdd"):
        np.testing.assert_array_equal(augment.apply_op(name, image, 0.0, rng), image, err_msg=name)
    # The enhance ops' factor is magnitude / 10 * 1.8 + 0.1: 1.0 (identity) at magnitude 5.
    for name in ("Color", "Contrast", "Brightness", "Sharpness"):
        np.testing.assert_array_equal(augment.apply_op(name, image, 5.0, rng), image, err_msg=name)
    # The original's quirks at magnitude 0, kept: Posterize keeps 0 bits, Solarize's threshold
    # is 0 (every pixel inverted).
    assert not augment.apply_op("Posterize", image, 0.0, rng).any()
    np.testing.assert_array_equal(augment.apply_op("Solarize", image, 0.0, rng), 255 - image)
    np.testing.assert_array_equal(augment.apply_op("Solarize", image, 10.0, rng), image)


def test_rotate_by_known_angles_about_the_centre():
    image = _image(9, 9)  # odd side: the centre is a pixel, quarter turns are exact
    np.testing.assert_array_equal(augment.rotate(image, 90.0), np.rot90(image, 1))  # ccw
    np.testing.assert_array_equal(augment.rotate(image, -90.0), np.rot90(image, -1))
    np.testing.assert_array_equal(augment.rotate(image, 180.0), image[::-1, ::-1])
    # 45 degrees: the centre stays, the corners are uncovered and filled with grey 128.
    turned = augment.rotate(image, 45.0)
    np.testing.assert_array_equal(turned[4, 4], image[4, 4])
    for y, x in ((0, 0), (0, 8), (8, 0), (8, 8)):
        assert (turned[y, x] == 128).all()


def test_translate_and_shear_move_pixels_as_pil_and_fill_grey():
    image = _image(10, 12)
    moved = augment.translate_x(image, 3)
    np.testing.assert_array_equal(moved[:, :-3], image[:, 3:])  # content moves left
    assert (moved[:, -3:] == 128).all()
    moved = augment.translate_y(image, -2)
    np.testing.assert_array_equal(moved[2:], image[:-2])
    assert (moved[:2] == 128).all()
    sheared = augment.shear_x(image, 1.0)  # out[y, x] = in[y, x + y]
    for y in range(10):
        np.testing.assert_array_equal(sheared[y, : 12 - y], image[y, y:])
        assert (sheared[y, 12 - y :] == 128).all()
    sheared = augment.shear_y(image, 0.5)  # out[y, x] = in[y + round(x / 2), x]
    assert (sheared[0, 3] == image[2, 3]).all() and (sheared[0, 4] == image[2, 4]).all()


def test_pixel_ops_match_pil_and_the_originals_formulas():
    image = _image(16, 16, seed=3)
    pil = Image.fromarray(image)
    np.testing.assert_array_equal(augment.invert(image), np.asarray(ImageOps.invert(pil)))
    np.testing.assert_array_equal(
        augment.posterize(image, 3), np.asarray(ImageOps.posterize(pil, 3))
    )
    np.testing.assert_array_equal(
        augment.solarize(image, 100), np.asarray(ImageOps.solarize(pil, 100))
    )
    np.testing.assert_array_equal(augment.equalize(image), np.asarray(ImageOps.equalize(pil)))
    # SolarizeAdd: +110 (clipped) below 128 only.
    added = augment.solarize_add(image, 110)
    low = image < 128
    np.testing.assert_array_equal(added[low], np.minimum(image[low].astype(int) + 110, 255))
    np.testing.assert_array_equal(added[~low], image[~low])
    # AutoContrast stretches every channel to 0..255 (float32 and truncation, as TF: the top
    # can land on 254.99998 -> 254).
    dull = (image // 4 + 60).astype(np.uint8)
    lows, highs = (
        augment.autocontrast(dull).reshape(-1, 3).min(0),
        augment.autocontrast(dull).reshape(-1, 3).max(0),
    )
    assert (lows == 0).all() and (highs >= 254).all()
    # Brightness 0: black; blends truncate towards the first image.
    assert not augment.brightness(image, 0.0).any()
    np.testing.assert_array_equal(
        augment.brightness(image, 0.5), (image.astype(np.float32) * 0.5).astype(np.uint8)
    )
    # Color leaves a grey image as it is, whatever the factor (within the grey round trip).
    grey = np.repeat(image[..., :1], 3, axis=-1)
    assert np.abs(augment.color(grey, 1.9).astype(int) - grey).max() <= 2
    # Contrast blends with pixels / 256 (the original's histogram-sum quirk): 16x16 -> 1.
    np.testing.assert_array_equal(augment.contrast(image, 0.0), np.ones_like(image))
    # Cutout: one grey square of side <= 2 * pad_size.
    cut = augment.cutout(np.zeros((32, 32, 3), np.uint8), 4, np.random.default_rng(1))
    ys, xs = np.nonzero(cut[..., 0] == 128)
    assert 0 < len(ys) <= 64 and ys.max() - ys.min() < 8 and xs.max() - xs.min() < 8
    assert len(ys) == (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)


def test_randaugment_is_a_function_of_its_generator_and_pickles():
    ra = augment.RandAugment(num_layers=2, magnitude=10)
    image = _image(32, 32)
    a = ra(image, np.random.default_rng([7, 0, 1]))
    np.testing.assert_array_equal(a, ra(image, np.random.default_rng([7, 0, 1])))
    outs = [ra(image, np.random.default_rng([7, 0, i])) for i in range(12)]
    assert len({o.tobytes() for o in outs}) >= 10  # different per draw
    assert all(o.dtype == np.uint8 and o.shape == image.shape for o in outs)
    assert pickle.loads(pickle.dumps(ra)) == ra  # process workers get a copy
    np.testing.assert_array_equal(
        augment.RandAugment(0, 10)(image, np.random.default_rng(0)), image
    )
    with pytest.raises(ValueError, match="magnitude must be in"):
        augment.RandAugment(2, 11)
    with pytest.raises(ValueError, match="uint8"):
        ra(image.astype(np.float32), np.random.default_rng(0))
    with pytest.raises(KeyError, match="no RandAugment op 'Blur'"):
        augment.apply_op("Blur", image, 5, np.random.default_rng(0))


# --------------------------------------------------------------------------- mixup


def test_mixup_mixes_each_example_with_its_neighbour_and_labels_sum_to_one():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 5, 5, 3)).astype(np.uint8)
    labels = np.array([0, 3, 1, 2], np.int32)
    mixed, targets = augment.mixup(images, labels, 0.7, num_classes=5)
    a, b = images.astype(np.float32), np.roll(images, 1, axis=0).astype(np.float32)
    np.testing.assert_allclose(mixed, 0.7 * a + 0.3 * b, rtol=1e-6)
    np.testing.assert_allclose(targets.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(targets[1], 0.7 * np.eye(5)[3] + 0.3 * np.eye(5)[0], rtol=1e-6)
    assert mixed.dtype == np.float32 and targets.dtype == np.float32


def test_mixup_batches_ratio_is_big_visions_and_resumes_exactly():
    batches = fake.FakeImages(4, 8, kind="random", num_classes=10, seed=0)
    mix = augment.MixupBatches(batches, 0.2, 10, seed=5)
    it = iter(mix)
    out = [next(it) for _ in range(4)]
    ratios = [mix.ratio([i]) for i in range(4)]  # FakeImages' position: batch_index
    assert all(0.5 <= r <= 1 for r in ratios) and len(set(ratios)) == 4
    raw = iter(batches)
    for (images, targets), r in zip(out, ratios, strict=True):
        x, y = next(raw)
        np.testing.assert_allclose(images, r * x + (1 - r) * np.roll(x, 1, axis=0), atol=1e-6)
        np.testing.assert_allclose(targets.sum(1), 1.0, rtol=1e-6)
        np.testing.assert_allclose(targets.max(1), np.where(y == np.roll(y, 1), 1.0, r), rtol=1e-6)
    # A new iterator set to the position after batch 2 mixes batches 3 and 4 the same way.
    it2 = iter(mix)
    resumed = iter(mix)
    next(it2), next(it2)
    resumed.set_state(it2.get_state())
    for want in out[2:]:
        got = next(resumed)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        augment.MixupBatches(batches, 0.0, 10)


# --------------------------------------------------------------------------- through the loader


def _textured_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_image(16, 16, seed=9)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _same_image(image_bytes, is_training, image_size, rng, bbox=None):
    """Decode only: every record's preprocessed image is the same, so what differs is augment's."""
    return np.asarray(Image.open(io.BytesIO(image_bytes)).convert("RGB"))


@pytest.fixture
def data_dir(tmp_path):
    jpeg = _textured_jpeg()
    for split in ("train", "validation"):
        with tfrecord.TFRecordWriter(str(tmp_path / f"{split}-00000-of-00001")) as w:
            for label in range(1, 9):
                w.write(ex.encode_example({"image/encoded": jpeg, "image/class/label": label}))
    return str(tmp_path)


def _batches(data_dir, n, **kw):
    fn = imagenet.input_fn(
        data_dir,
        True,
        image_size=16,
        preprocessing=_same_image,
        num_parallel_calls=0,
        num_classes=10,
        seed=3,
        **kw,
    )
    it = iter(fn({"batch_size": 8}))
    return [next(it) for _ in range(n)]


def test_randaugment_in_the_input_is_deterministic_per_seed_example_and_epoch(data_dir):
    ra = augment.RandAugment(2, 10)
    first = _batches(data_dir, 2, augment=ra)  # two epochs of the 8 records
    again = _batches(data_dir, 2, augment=ra)
    for (a, la), (b, lb) in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    plain = _batches(data_dir, 1)[0][0]
    assert len({x.tobytes() for x in plain}) == 1  # the same image 8 times without augment
    epoch0, epoch1 = first[0], first[1]
    assert len({x.tobytes() for x in epoch0[0]}) >= 6  # per example
    by_label0 = {int(label): img.tobytes() for img, label in zip(*epoch0, strict=True)}
    by_label1 = {int(label): img.tobytes() for img, label in zip(*epoch1, strict=True)}
    assert sum(by_label0[k] != by_label1[k] for k in by_label0) >= 6  # per epoch
    # The eval input is neither augmented nor mixed.
    fn = imagenet.input_fn(
        data_dir,
        False,
        image_size=16,
        preprocessing=_same_image,
        num_parallel_calls=0,
        num_classes=10,
        augment=ra,
        mixup_alpha=0.2,
    )
    images, labels = next(iter(fn({"batch_size": 8})))
    np.testing.assert_array_equal(images, plain)
    assert labels.dtype == np.int32 and labels.shape == (8,)


def test_mixup_in_the_input_resumes_from_the_loaders_position(data_dir):
    ra = augment.RandAugment(2, 10)
    kw = {
        "image_size": 16,
        "preprocessing": _same_image,
        "num_parallel_calls": 0,
        "num_classes": 10,
        "seed": 3,
        "augment": ra,
        "mixup_alpha": 0.2,
    }
    loader = imagenet.input_fn(data_dir, True, **kw)({"batch_size": 4})
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    assert first[0][0].dtype == np.float32 and first[0][1].shape == (4, 10)
    np.testing.assert_allclose(first[0][1].sum(1), 1.0, rtol=1e-6)
    it2 = iter(loader)
    next(it2)
    state = it2.get_state()
    assert state["order"] == "global"  # the loader's own position, passed through
    resumed = iter(imagenet.input_fn(data_dir, True, **kw)({"batch_size": 4}))
    resumed.set_state(state)
    for want in first[1:]:
        got = next(resumed)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    for i in (it, it2, resumed):
        i.close()
