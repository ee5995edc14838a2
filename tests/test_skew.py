"""The train/serve skew check compares what the model sees, on check images of every class.

``export_version(..., eval_preprocess=fn)`` refuses an export whose declared preprocessing gives
the model other inputs than the training side's eval preprocessing (shape, dtype, values),
before anything is exported; ``export.check_images`` draws the check images across classes
from an ``estimax-convert`` output.
"""

from __future__ import annotations

import io
import os

import cv2
import numpy as np
import optax
import pytest

import estimax as ex
from estimax import export
from estimax.data import example, jpeg, tfrecord
from estimax.export import skew
from estimax.tools import convert_shards, convert_sources

CLASSES = ("bottles", "lamps", "textiles")


def _jpeg(seed: int) -> bytes:
    noise = np.random.default_rng(seed).integers(0, 256, (30, 36, 3), dtype=np.uint8)
    image = cv2.GaussianBlur(noise, (5, 5), 0)  # texture, so resizes and crops differ
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    return encoded.tobytes()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A class-sorted validation split: 4 images of each class in one shard."""
    root = tmp_path_factory.mktemp("skew")
    for k, name in enumerate(CLASSES):
        os.makedirs(root / "validation" / name)
        for i in range(4):
            (root / "validation" / name / f"{i}.jpg").write_bytes(_jpeg(10 * k + i))
    dataset = convert_sources.folder_source({"validation": str(root / "validation")})
    out = str(root / "out")
    convert_shards.convert_local(dataset, out, {"validation": 1}, num_workers=1, progress=False)
    labels = {}
    for record in tfrecord.read_records(os.path.join(out, "validation-00000-of-00001")):
        parsed = example.decode_example(record)
        labels[parsed["image/encoded"][0]] = int(parsed["image/class/label"][0])
    return out, labels


def trained_side(image_bytes: bytes) -> np.ndarray:
    """A Keras user's eval preprocessing: the whole image, bilinear to 32x32, [0, 1] float32."""
    image = cv2.resize(jpeg.decode(image_bytes), (32, 32), interpolation=cv2.INTER_LINEAR)
    return image.astype(np.float32) * np.float32(1 / 255)


def test_check_images_cover_the_classes_of_a_class_sorted_split(converted):
    out, labels = converted
    assert [labels[b] for b in list(labels)[:3]] == [1, 1, 1]  # the first files: one class
    assert [labels[b] for b in export.check_images(out, 8)] == [1, 2, 3, 1, 2, 3, 1, 2]
    assert [labels[b] for b in export.check_images(out, 2)] == [1, 3]  # spread over labels
    assert [labels[b] for b in export.check_images(out, 3)] == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="train-"):
        export.check_images(out, 3, split="train")


def test_without_a_manifest_check_images_take_new_classes_first(converted, tmp_path):
    out, labels = converted
    copy = tmp_path / "copy"
    copy.mkdir()
    name = "validation-00000-of-00001"
    (copy / name).write_bytes(open(os.path.join(out, name), "rb").read())  # no manifest.json
    drawn = export.check_images(str(copy), 5)
    assert [labels[b] for b in drawn] == [1, 2, 3, 1, 1]


def test_the_model_inputs_are_compared_shape_dtype_and_values(converted):
    out, _ = converted
    images = export.check_images(out, 6)
    same = export.image_preprocessing(32, resize="bilinear", scale=1 / 255)
    assert skew.input_difference(same, trained_side, images) is None

    # ResNet's recipe: crop, bicubic, uint8 0..255. The largest difference is named at its pixel.
    resnet = export.resnet_eval(32)
    found = skew.input_difference(resnet, trained_side, images)
    diff = np.abs(resnet(images[0]).astype(np.float64) - trained_side(images[0]))
    where = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
    assert found == (
        f"check image #0 of 6: dtype uint8 vs float32, values differ by up to {diff.max():.4g} "
        f"at pixel {where} ({resnet(images[0])[where]:.4g} vs "
        f"{trained_side(images[0])[where]:.4g}; tolerance {found.split('tolerance ')[1]}"
    )
    assert found.endswith("tolerance 0.02: 0.02 of [0, 1]) (6 of 6 check images differ)")
    smaller = export.image_preprocessing(28, scale=1 / 255)
    assert skew.input_difference(smaller, trained_side, images) == (
        "check image #0 of 6: shape (28, 28, 3) vs (32, 32, 3) (6 of 6 check images differ)"
    )

    # float64 from the training side reaches the model as float32 (JAX's default): no skew.
    def in_float64(image_bytes: bytes) -> np.ndarray:
        return trained_side(image_bytes).astype(np.float64)

    assert skew.input_difference(same, in_float64, images) is None
    # A shift below the stated tolerance (0.02 of [0, 1]) passes; above it does not.
    small = export.image_preprocessing(32, scale=1 / 255, offset=0.01)
    large = export.image_preprocessing(32, scale=1 / 255, offset=0.05)
    assert skew.input_difference(small, trained_side, images) is None
    assert "values differ by up to 0.05 at pixel" in skew.input_difference(
        large, trained_side, images
    )
    assert skew.input_difference(large, trained_side, images, tolerance=0.06) is None


def _model_fn(features, labels, mode, params):
    import flax.linen as nn
    import jax.numpy as jnp

    logits = nn.Dense(3)(jnp.asarray(features, jnp.float32).reshape(features.shape[0], -1))
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels) if labels is not None else None,
        optimizer=optax.sgd(0.1),
        predictions={"classes": logits.argmax(-1)},
    )


def test_a_skewed_export_is_refused_before_anything_is_exported(converted, tmp_path):
    out, _ = converted
    est = ex.Estimator(_model_fn, ex.RunConfig(model_dir=str(tmp_path / "never_trained")))
    base = tmp_path / "serving"
    with pytest.raises(export.ExportCheckError) as raised:
        export.export_version(
            est,
            str(base),
            preprocessing=export.resnet_eval(32),
            check_inputs=export.check_images(out),
            eval_preprocess=trained_side,
        )
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        "train/serve skew: the export's declared preprocessing {'name': 'resnet_eval', 'version': "
        "1, 'params': {'image_size': 32}} and eval_preprocess (the training side's) give the model "
        "different inputs (served vs eval_preprocess): check image #0 of 8: dtype uint8 vs "
        "float32, values differ by up to "
    )
    assert message.endswith("nothing was published.")
    # Refused from the inputs alone: no checkpoint was needed, nothing was staged or published.
    assert not base.exists()


def _large_jpeg(seed: int) -> bytes:
    noise = np.random.default_rng(seed).integers(0, 256, (96, 120, 3), dtype=np.uint8)
    ok, encoded = cv2.imencode(".jpg", cv2.GaussianBlur(noise, (3, 3), 0))
    assert ok
    return encoded.tobytes()


def _pil_side(resample):
    from PIL import Image

    def preprocess(image_bytes: bytes) -> np.ndarray:
        """A PyTorch user's eval input: PIL's resize((32, 32)) / 255 (torchvision's Resize calls
        the same PIL resize on PIL images)."""
        image = Image.open(io.BytesIO(image_bytes)).convert("RGB")
        return np.asarray(image.resize((32, 32), resample)) / 255

    return preprocess


def test_pils_antialiased_resize_is_declared_and_the_refusal_names_it(tmp_path):
    from PIL import Image

    images = [_large_jpeg(seed) for seed in range(8)]
    bilinear, bicubic = _pil_side(Image.BILINEAR), _pil_side(Image.BICUBIC)
    plain = export.image_preprocessing(32, resize="bilinear", scale=1 / 255)
    found = skew.input_difference(plain, bilinear, images)
    assert found is not None and "8 of 8 check images differ" in found
    worst = {}
    for name, side in (("bilinear", bilinear), ("bicubic", bicubic)):
        declared = export.image_preprocessing(32, resize=name, antialias=True, scale=1 / 255)
        assert skew.input_difference(declared, side, images) is None
        worst[name] = max(np.abs(declared(b) - side(b)).max() for b in images)
    print(f"declared antialias vs PIL, max |diff| of [0, 1]: {worst}")
    est = ex.Estimator(
        _model_fn,
        ex.RunConfig(model_dir=str(tmp_path / "model"), num_shards=1),
        train_batch_size=4,
        predict_batch_size=4,
    )
    pixels = np.stack([bilinear(b) for b in images]).astype(np.float32)
    est.train(ex.numpy_input_fn(pixels, np.arange(8) % 3, num_epochs=None), max_steps=1)
    options = dict(check_inputs=images, eval_preprocess=bilinear)
    with pytest.raises(export.ExportCheckError) as raised:
        export.export_version(est, str(tmp_path / "serving"), preprocessing=plain, **options)
    message = str(raised.value)
    assert "\n" not in message and not (tmp_path / "serving").exists()
    assert (
        "(the closest declaration that agrees: estimax.export.image_preprocessing(32, "
        "antialias=True, scale=0.00392156862745098)); nothing was published." in message
    ), message
    # PIL's own default filter is bicubic: the refusal names that one.
    with pytest.raises(
        export.ExportCheckError, match=r"image_preprocessing\(32, resize='bicubic', antialias=True"
    ):
        export.export_version(
            est,
            str(tmp_path / "serving"),
            preprocessing=plain,
            check_inputs=images,
            eval_preprocess=bicubic,
        )
    declared = export.image_preprocessing(32, antialias=True, scale=1 / 255)
    version = export.export_version(
        est, str(tmp_path / "serving"), preprocessing=declared, **options
    )
    assert os.path.basename(version) == "1"
    est.close()


def _torchvision_eval(resize: int, crop: int, decode=None):
    from PIL import Image

    def preprocess(image_bytes: bytes) -> np.ndarray:
        """torchvision's usual eval input on a PIL image: Resize(resize) (torchvision calls
        PIL's image.resize with the short side to ``resize`` and the long one to
        int(resize * long / short)), CenterCrop(crop) (offsets int(round((side - crop) / 2))),
        ToTensor's / 255. ``decode``: bytes -> uint8 pixels (default PIL's own decoder)."""
        if decode is None:
            image = Image.open(io.BytesIO(image_bytes)).convert("RGB")
        else:
            image = Image.fromarray(decode(image_bytes))
        w, h = image.size
        long = int(resize * max(w, h) / min(w, h))
        w, h = (resize, long) if w <= h else (long, resize)
        pixels = np.asarray(image.resize((w, h), Image.BILINEAR))
        top, left = int(round((h - crop) / 2.0)), int(round((w - crop) / 2.0))
        return pixels[top : top + crop, left : left + crop] / 255

    return preprocess


def test_torchvisions_resize_then_center_crop_is_declared_with_resize_shorter():
    shapes = [(96, 120), (120, 96), (75, 75), (61, 89), (100, 141), (37, 52)]
    images = []
    for seed, shape in enumerate(shapes):
        noise = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
        images.append(cv2.imencode(".jpg", cv2.GaussianBlur(noise, (9, 9), 0))[1].tobytes())
    declared = export.image_preprocessing(32, resize_shorter=36, antialias=True, scale=1 / 255)
    # On the same decoded pixels, torchvision's pipeline and the declaration agree bit for bit.
    decode = lambda b: jpeg.decode_crop(b, (0, 0, *jpeg.image_shape(b)))  # noqa: E731
    same_pixels = _torchvision_eval(36, 32, decode)
    pixels = export.image_preprocessing(32, resize_shorter=36, antialias=True, dtype="uint8")
    for b in images:
        np.testing.assert_array_equal(pixels(b), np.rint(same_pixels(b) * 255).astype(np.uint8))
    # With PIL's own decoder (another IDCT: measured 4 levels apart at most here) the skew
    # check agrees.
    trained = _torchvision_eval(36, 32)
    assert skew.input_difference(declared, trained, images) is None
    # Cropping first (the same fraction of the short side) samples other positions: refused,
    # and the refusal's closest declaration is the resize-then-crop one.
    crop_first = export.image_preprocessing(
        32, crop="center", crop_fraction=32 / 36, antialias=True, scale=1 / 255
    )
    assert skew.input_difference(crop_first, trained, images) is not None
    closest = skew.closest_declaration(crop_first, trained, images)
    assert closest is not None and skew.declaration(closest) == (
        "estimax.export.image_preprocessing(32, resize_shorter=36, antialias=True, "
        "scale=0.00392156862745098)"
    )
    with pytest.raises(ValueError, match="resize_shorter=24 must be at least the size's larger"):
        export.image_preprocessing(32, resize_shorter=24)
    with pytest.raises(ValueError, match="resize_shorter resizes the whole image .* crop='none'"):
        export.image_preprocessing(32, resize_shorter=36, crop="center", crop_fraction=0.9)
