"""Serving preprocessing declared as data (``estimax.export.image_preprocessing``)."""

from __future__ import annotations

import glob
import os

import cv2
import numpy as np
import pytest

from estimax.data import preprocessing
from estimax.export import preprocess

IMAGES = sorted(
    glob.glob(os.path.join(os.path.dirname(__file__), "data", "preprocessing", "*.jpg"))
)


def _png(pixels: np.ndarray) -> bytes:
    ok, encoded = cv2.imencode(".png", pixels[..., ::-1])  # OpenCV writes BGR
    assert ok
    return encoded.tobytes()


@pytest.mark.parametrize("path", IMAGES, ids=os.path.basename)
def test_declared_recipes_reproduce_resnet_and_inception_eval_exactly(path):
    data = open(path, "rb").read()
    resnet = preprocess.image_preprocessing(
        224, crop="center", crop_padding=32, resize="bicubic", dtype="uint8"
    )
    np.testing.assert_array_equal(resnet(data), preprocessing.resnet_preprocess(data, False, 224))
    inception = preprocess.image_preprocessing(
        299, crop="central", crop_fraction=0.875, resize="bilinear", scale=2 / 255, offset=-1
    )
    np.testing.assert_array_equal(
        inception(data), preprocessing.inception_preprocess(data, False, 299)
    )
    assert inception.output_shape == (299, 299, 3) and inception.output_dtype == np.float32


@pytest.mark.parametrize(
    "grid, row",
    [
        ("half_pixel", [0, 25, 75, 100]),  # TF2 / OpenCV: (i + 0.5) * in / out - 0.5
        ("align_corners", [0, 33, 67, 100]),  # TF1 align_corners=True: i * (in - 1) / (out - 1)
        ("asymmetric", [0, 50, 100, 100]),  # TF1's default: i * in / out
    ],
)
def test_resize_grids_sample_where_tensorflow_does(grid, row):
    pixels = np.zeros((2, 2, 3), np.uint8)
    pixels[:, 1] = 100
    recipe = preprocess.image_preprocessing((2, 4), resize="bilinear", grid=grid, dtype="uint8")
    out = recipe(_png(pixels))
    assert out.shape == (2, 4, 3)
    np.testing.assert_array_equal(out[0, :, 0], row)


def test_channels_and_scaling_are_applied_in_order():
    pixels = np.zeros((4, 4, 3), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = 10, 20, 30
    data = _png(pixels)
    bgr = preprocess.image_preprocessing(4, channels="bgr", dtype="uint8")(data)
    assert bgr[0, 0].tolist() == [30, 20, 10]
    scaled = preprocess.image_preprocessing(
        4, scale=0.5, offset=1.0, mean=[1, 2, 3], stddev=[2, 4, 8]
    )(data)
    np.testing.assert_allclose(scaled[0, 0], [(5 + 1 - 1) / 2, (10 + 1 - 2) / 4, (15 + 1 - 3) / 8])
    gray = preprocess.image_preprocessing(4, channels="gray")
    assert gray(data).shape == gray.output_shape == (4, 4, 1)


def test_the_recipe_round_trips_through_serving_json():
    recipe = preprocess.image_preprocessing(
        (24, 32), crop="center", crop_fraction=0.9, resize="area", mean=0.5, stddev=0.25
    )
    again = preprocess.from_spec(recipe.to_json())
    assert again == recipe and again.output_shape == (24, 32, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"crop": "middle"}, "crop must be one of"),
        ({"crop": "center"}, "exactly one of crop_fraction"),
        ({"crop": "central", "crop_fraction": 1.5}, r"crop_fraction must be in \(0, 1\]"),
        ({"resize": "lanczos"}, "resize must be one of"),
        ({"resize": "area", "grid": "align_corners"}, "resize='area' has no grid"),
        ({"dtype": "uint8", "scale": 2.0}, "need dtype='float32'"),
        ({"mean": [1, 2]}, "mean must have 1 or 3 values"),
        ({"stddev": 0}, "stddev must not be 0"),
        ({"channels": "cmyk"}, "channels must be one of"),
    ],
)
def test_a_bad_declaration_is_one_error_naming_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        preprocess.image_preprocessing(32, **kwargs)


def test_an_unknown_recipe_names_the_known_ones_and_the_way_to_declare_one():
    with pytest.raises(ValueError, match=r"unknown preprocessing 'mine'.*image_preprocessing"):
        preprocess.Preprocessing("mine", 1, {})
    with pytest.raises(ValueError, match="unknown parameter"):
        preprocess.from_spec({"name": "image", "version": 1, "params": {"size": 8, "zoom": 2}})


def test_antialias_is_recorded_only_when_asked_and_refused_where_pillow_has_no_filter():
    from estimax import export
    from estimax.export import preprocess

    assert "antialias" not in export.image_preprocessing(8).params  # old records unchanged
    declared = export.image_preprocessing(8, resize="bicubic", antialias=True)
    assert preprocess.from_spec(declared.to_json()).params["antialias"] is True
    for bad in (dict(resize="nearest"), dict(grid="align_corners")):
        with pytest.raises(ValueError, match="antialias=True .* takes resize="):
            export.image_preprocessing(8, antialias=True, **bad)


def test_antialias_resize_equals_pillows():
    from PIL import Image

    from estimax.data.preprocessing import resize_antialias

    rng = np.random.default_rng(3)
    image = cv2.GaussianBlur(rng.integers(0, 256, (90, 70, 3), dtype=np.uint8), (5, 5), 0)
    for method, pil in (
        ("bilinear", Image.BILINEAR),
        ("bicubic", Image.BICUBIC),
        ("area", Image.BOX),
    ):
        for size in ((30, 20), (32, 32), (120, 100)):
            want = np.asarray(Image.fromarray(image).resize(size[::-1], pil)).astype(int)
            got = resize_antialias(image, *size, method)
            assert np.abs(got - want).max() <= 1, (method, size)
