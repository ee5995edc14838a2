"""Image preprocessing of the original's ResNet and Inception recipes, on the host, in numpy.

docs/original.md §4 is the specification; each function names the original code it mirrors.
Randomness comes only from the `numpy.random.Generator` passed in, so the loader can make every
example's augmentation a function of (seed, epoch, example index): that is what makes runs
reproducible and resumable.

Resampling: the original used TF1's ``resize_bicubic``/``resize_bilinear`` with
``align_corners=False`` and TF1's legacy sampling (output pixel i reads input ``i * scale``,
bicubic kernel a=-0.75). We resize with OpenCV (``cv2.resize``), which uses half-pixel centres
(input ``(i + 0.5) * scale - 0.5``, the convention of TF2's ``tf.image.resize``, PIL and
PyTorch) with the same a=-0.75 kernel. An affine warp reproducing the legacy mapping costs ~8x
the resize (bench/results/input_pipeline.md: 827 vs 6627 per s), i.e. +1 ms per image, to undo a
shift of ``(scale - 1) / 2`` input pixels (0.23 px for 328 -> 224), which matters to neither
training nor accuracy.
tests/test_preprocessing.py compares against goldens of both conventions and states the
tolerances.

| who owns what | where |
|---|---|
| JPEG/PNG decoding, crop windows, decode errors | `estimax.data.jpeg` |
| box sampling, crops, resize, flip, colour, [-1, 1] scaling | here |
| mean/stddev normalisation | `normalize` here, called on device by the model_fn |
| 1-based -> 0-based labels, batching, workers | the loader / `estimax.data.imagenet` |
"""

from __future__ import annotations

import math
from typing import Any

import cv2
import numpy as np

from estimax.data import jpeg
from estimax.data.jpeg import ImageDecodeError

__all__ = [
    "IMAGE_SIZE",
    "CROP_PADDING",
    "MEAN_RGB",
    "STDDEV_RGB",
    "ImageDecodeError",
    "normalize",
    "sample_distorted_bounding_box",
    "center_crop_window",
    "resnet_preprocess",
    "inception_preprocess",
    "distort_color_fast",
]

# resnet_preprocessing.py
IMAGE_SIZE = 224
CROP_PADDING = 32

# The 2018-08 fix of resnet_main.py: ImageNet statistics scaled to [0, 255] (earlier releases
# mistakenly used the [0, 1] values on [0, 255] images).
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)

_RESIZE_METHODS = (cv2.INTER_LINEAR, cv2.INTER_NEAREST, cv2.INTER_CUBIC, cv2.INTER_AREA)
# tf.image.ResizeMethod order: BILINEAR, NEAREST_NEIGHBOR, BICUBIC, AREA (Inception picks one).


def normalize(images: Any, xp: Any = np, dtype: Any = None) -> Any:
    """Subtracts MEAN_RGB and divides by STDDEV_RGB: the one place the statistics are applied.

    The original does this in model_fn, on the accelerator; so does estimax (pass
    ``xp=jax.numpy`` there), which keeps host->device transfers uint8.

    Args:
      images: [..., 3] in [0, 255] (uint8 or float).
      xp: the array module, ``numpy`` or ``jax.numpy``.
      dtype: result dtype; default float32 for integer input, else the input's float dtype
        (bfloat16 stays bfloat16, as the original's ``features.dtype``).

    Returns:
      [..., 3] of `dtype`.
    """
    images = xp.asarray(images)
    if dtype is None:
        dtype = images.dtype if xp.issubdtype(images.dtype, xp.floating) else xp.float32
    mean = xp.asarray(MEAN_RGB, dtype=dtype)
    std = xp.asarray(STDDEV_RGB, dtype=dtype)
    return (images.astype(dtype) - mean) / std


def _rint(v: float) -> int:
    # C's lrintf: round half to even, as TF's kernel does; Python's round() is the same rule.
    return int(round(v))


def _random_crop_once(
    height: int,
    width: int,
    area_range: tuple[float, float],
    aspect_ratio: float,
    rng: np.random.Generator,
) -> tuple[int, int, int, int] | None:
    """One attempt of TF's GenerateRandomCrop (sample_distorted_bounding_box_op.cc)."""
    min_area = area_range[0] * width * height
    max_area = area_range[1] * width * height
    h = _rint(math.sqrt(min_area / aspect_ratio))
    max_h = _rint(math.sqrt(max_area / aspect_ratio))
    if _rint(max_h * aspect_ratio) > width:
        # The smallest max_h with round(max_h * aspect_ratio) <= width (TF's kEps trick).
        max_h = int((width + 0.5 - 1e-7) / aspect_ratio)
        if _rint(max_h * aspect_ratio) > width:
            max_h -= 1
    max_h = min(max_h, height)
    h = min(h, max_h)
    if h < max_h:
        h += int(rng.integers(0, max_h - h + 1))
    w = _rint(h * aspect_ratio)
    area = w * h
    if area < min_area:
        h += 1
        w = _rint(h * aspect_ratio)
        area = w * h
    if area > max_area:
        h -= 1
        w = _rint(h * aspect_ratio)
        area = w * h
    if area < min_area or area > max_area or w > width or h > height or w <= 0 or h <= 0:
        return None
    y = int(rng.integers(0, height - h + 1)) if h < height else 0
    x = int(rng.integers(0, width - w + 1)) if w < width else 0
    return y, x, h, w


def sample_distorted_bounding_box(
    image_shape: tuple[int, int],
    rng: np.random.Generator,
    bbox: np.ndarray | None = None,
    min_object_covered: float = 0.1,
    aspect_ratio_range: tuple[float, float] = (0.75, 1.33),
    area_range: tuple[float, float] = (0.05, 1.0),
    max_attempts: int = 100,
    use_image_if_no_bounding_boxes: bool = True,
) -> tuple[int, int, int, int]:
    """Samples a crop window as ``tf.image.sample_distorted_bounding_box`` does.

    Up to `max_attempts` times: draw an aspect ratio (width / height) uniformly from
    `aspect_ratio_range`, then a height whose area lies in `area_range` (fractions of the
    image), then a uniform position; accept the first window covering at least
    `min_object_covered` of some box in `bbox`. If none is accepted, the whole image is returned
    (TF's behaviour; the ResNet recipe detects that and falls back to its center crop).

    Args:
      image_shape: (height, width) in pixels.
      rng: the only source of randomness.
      bbox: [N, 4] float boxes (ymin, xmin, ymax, xmax) in [0, 1], e.g. ImageNet's annotated
        boxes; None or empty means the whole image (with `use_image_if_no_bounding_boxes`).

    Returns:
      (y, x, height, width) of the window, in pixels.
    """
    height, width = int(image_shape[0]), int(image_shape[1])
    if height <= 0 or width <= 0:
        raise ValueError(f"image_shape must be positive, got {image_shape}")
    boxes = np.zeros((0, 4), np.float32) if bbox is None else np.asarray(bbox, np.float32)
    boxes = boxes.reshape(-1, 4)
    if len(boxes) == 0:
        if not use_image_if_no_bounding_boxes:
            raise ValueError("no bounding boxes given and use_image_if_no_bounding_boxes=False")
        boxes = np.array([[0.0, 0.0, 1.0, 1.0]], np.float32)
    if np.any(boxes[:, 0] > boxes[:, 2]) or np.any(boxes[:, 1] > boxes[:, 3]):
        raise ValueError(
            f"bounding boxes must be (ymin, xmin, ymax, xmax) with min <= max, got {boxes.tolist()}"
        )
    # TF casts the boxes to integer pixel rectangles (truncating). Plain Python below: there is
    # usually one box, and numpy's per-call overhead would be most of the sampler's cost.
    rects = [
        (int(b[0] * height), int(b[1] * width), int(b[2] * height), int(b[3] * width))
        for b in boxes.tolist()
    ]
    lo, hi = aspect_ratio_range
    for _ in range(max_attempts):
        aspect = rng.random() * (hi - lo) + lo
        window = _random_crop_once(height, width, area_range, aspect, rng)
        if window is None:
            continue
        y, x, h, w = window
        for y0, x0, y1, x1 in rects:
            area = (y1 - y0) * (x1 - x0)
            if area <= 0:
                continue  # a degenerate box is covered by nothing, as in TF
            inter = max(0, min(y + h, y1) - max(y, y0)) * max(0, min(x + w, x1) - max(x, x0))
            if inter / area >= min_object_covered:
                return window
    return 0, 0, height, width


def center_crop_window(
    image_shape: tuple[int, int], image_size: int = IMAGE_SIZE
) -> tuple[int, int, int, int]:
    """The ResNet eval window: a centred square of image_size / (image_size + 32) of the short side.

    Mirrors ``_decode_and_center_crop``: the fraction is computed in float32 as TF did and
    truncated; offsets are ``((dim - crop) + 1) // 2``.

    Returns:
      (y, x, size, size) in pixels.
    """
    height, width = image_shape
    fraction = np.float32(image_size / (image_size + CROP_PADDING))
    crop = int(fraction * np.float32(min(height, width)))
    return ((height - crop) + 1) // 2, ((width - crop) + 1) // 2, crop, crop


def _resize(image: np.ndarray, size: int, interpolation: int) -> np.ndarray:
    # `image` is usually a row-strided view into the decoded picture; OpenCV reads such views
    # in place (no copy of the window needed).
    return cv2.resize(image, (size, size), interpolation=interpolation)


def resnet_preprocess(
    image_bytes: bytes,
    is_training: bool,
    image_size: int = IMAGE_SIZE,
    rng: np.random.Generator | None = None,
    bbox: np.ndarray | None = None,
    scaled_decode: bool | None = None,
) -> np.ndarray:
    """The original's resnet_preprocessing.preprocess_image, returning uint8.

    Train (``_decode_and_random_crop``): a window from `sample_distorted_bounding_box`
    (min_object_covered 0.1, aspect 3/4..4/3, area 0.08..1, 10 attempts) within `bbox` (default
    the whole image, as the original always used); if sampling failed (the window is the whole
    image) the eval center crop instead; decode the window; bicubic resize; random left-right flip.
    Eval (``_decode_and_center_crop``): `center_crop_window`, decode, bicubic resize.

    The original returned float32 in [0, 255]; we round the bicubic output and clip it to
    [0, 255] uint8 (bicubic overshoots by a few levels at edges) so each image crosses to the
    device in 1/4 of the bytes. Mean/stddev are applied on device by `normalize`.

    Args:
      image_bytes: an encoded JPEG (PNG also accepted).
      is_training: train or eval recipe.
      image_size: output side.
      rng: required for training; unused for eval.
      bbox: [N, 4] (ymin, xmin, ymax, xmax) in [0, 1]; None = the whole image.
      scaled_decode: allow DCT-domain downscaled decoding when the window is at least twice
        `image_size` (default: on for training, off for eval so eval matches the reference).

    Returns:
      [image_size, image_size, 3] uint8, RGB.

    Raises:
      ImageDecodeError: `image_bytes` is not a decodable JPEG/PNG.
    """
    shape = jpeg.image_shape(image_bytes)
    if scaled_decode is None:
        scaled_decode = is_training
    if is_training:
        if rng is None:
            raise ValueError(
                "resnet_preprocess(is_training=True) needs rng (a numpy.random.Generator)"
            )
        window = sample_distorted_bounding_box(
            shape,
            rng,
            bbox,
            min_object_covered=0.1,
            aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=(0.08, 1.0),
            max_attempts=10,
        )
        if window[2:] == shape:  # sampling failed: the original's `bad` branch
            window = center_crop_window(shape, image_size)
    else:
        window = center_crop_window(shape, image_size)
    image = jpeg.decode_crop(image_bytes, window, min_size=image_size if scaled_decode else None)
    image = _resize(image, image_size, cv2.INTER_CUBIC)
    if is_training and rng is not None and rng.random() < 0.5:  # rng: checked above
        image = cv2.flip(image, 1)
    return image


def _central_crop_window(
    image_shape: tuple[int, int], fraction: float
) -> tuple[int, int, int, int]:
    # tf.image.central_crop: start = int((dim - dim * fraction) / 2) in float64,
    # size = dim - 2 * start.
    height, width = image_shape
    y = int((height - height * fraction) / 2)
    x = int((width - width * fraction) / 2)
    return y, x, height - 2 * y, width - 2 * x


def inception_preprocess(
    image_bytes: bytes,
    is_training: bool,
    image_size: int = 299,
    rng: np.random.Generator | None = None,
    bbox: np.ndarray | None = None,
    fast_mode: bool = True,
    scaled_decode: bool | None = None,
) -> np.ndarray:
    """The original's inception_preprocessing (TPU r1.8) with its fast colour distortion.

    Train: window from `sample_distorted_bounding_box` (min_object_covered 0.1, aspect
    3/4..4/3, area 0.05..1, 100 attempts) within `bbox` (the annotated boxes when the caller
    uses them, ``--use_annotated_bbox``); resize (bilinear, or with ``fast_mode=False`` one of
    bilinear/nearest/bicubic/area at random); random flip; ``distort_color_fast``: brightness
    delta U(-32/255, 32/255) and Cb/Cr offsets U(-0.1, 0.1) added through the YCbCr->RGB matrix,
    clip to [0, 1]; then (x - 0.5) * 2.
    Eval: ``central_crop(0.875)``, bilinear resize, (x - 0.5) * 2.

    Returns float32 in [-1, 1] (not uint8) because the colour distortion is continuous; the
    [-1, 1] scale is part of the recipe, so the model_fn does not normalise Inception inputs.

    Args:
      image_bytes: an encoded JPEG (PNG also accepted).
      is_training: train or eval recipe.
      image_size: output side (299 for v3 and v4).
      rng: required for training.
      bbox: [N, 4] (ymin, xmin, ymax, xmax) in [0, 1]; None = the whole image.
      fast_mode: as the original (v3 True, v4 False): pick the resize method at random if False.
      scaled_decode: as in `resnet_preprocess` (default: on for training only).

    Returns:
      [image_size, image_size, 3] float32 in [-1, 1], RGB.

    Raises:
      ImageDecodeError: `image_bytes` is not a decodable JPEG/PNG.
    """
    shape = jpeg.image_shape(image_bytes)
    if scaled_decode is None:
        scaled_decode = is_training
    if not is_training:
        window = _central_crop_window(shape, 0.875)
        image = jpeg.decode_crop(
            image_bytes, window, min_size=image_size if scaled_decode else None
        )
        image = _resize(image, image_size, cv2.INTER_LINEAR)
        return image.astype(np.float32) * np.float32(2 / 255) - np.float32(1)

    if rng is None:
        raise ValueError(
            "inception_preprocess(is_training=True) needs rng (a numpy.random.Generator)"
        )
    window = sample_distorted_bounding_box(
        shape,
        rng,
        bbox,
        min_object_covered=0.1,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(0.05, 1.0),
        max_attempts=100,
    )
    image = jpeg.decode_crop(image_bytes, window, min_size=image_size if scaled_decode else None)
    method = _RESIZE_METHODS[0] if fast_mode else _RESIZE_METHODS[int(rng.integers(4))]
    # The original resized floats in [0, 1]; resizing the uint8 window (4x less memory traffic)
    # rounds to 1/255 before the colour shift, far below the augmentation's own noise.
    image = _resize(image, image_size, method)
    if rng.random() < 0.5:
        image = cv2.flip(image, 1)
    out = distort_color_fast(image.astype(np.float32) * np.float32(1 / 255), rng)
    out -= np.float32(0.5)
    out *= np.float32(2.0)
    return out


def distort_color_fast(
    image: np.ndarray,
    rng: np.random.Generator,
    brightness_delta: float = 32 / 255,
    cb_range: float = 0.1,
    cr_range: float = 0.1,
) -> np.ndarray:
    """The original's ``distort_color_fast``: random brightness and chroma shifts.

    Draws brightness ~ U(-brightness_delta, brightness_delta), cb ~ U(-cb_range, cb_range),
    cr ~ U(-cr_range, cr_range) and adds to each channel its YCbCr->RGB offset
    (R += 1.402 cr + b, G += -0.344136 cb - 0.714136 cr + b, B += 1.772 cb + b), then clips.

    Args:
      image: [H, W, 3] float32 in [0, 1]; modified in place and returned.

    Returns:
      [H, W, 3] float32 in [0, 1].
    """
    brightness = rng.uniform(-brightness_delta, brightness_delta)
    cb = rng.uniform(-cb_range, cb_range)
    cr = rng.uniform(-cr_range, cr_range)
    image += np.array(
        [
            1.402 * cr + brightness,
            -0.344136 * cb - 0.714136 * cr + brightness,
            1.772 * cb + brightness,
        ],
        np.float32,
    )
    return np.clip(image, 0.0, 1.0, out=image)


# PIL's resampling filters (Pillow's src/libImaging/Resample.c): (support, kernel). Bicubic is
# Keys' with a = -0.5, as Pillow's and torchvision's antialiased bicubic.
def _triangle(x: np.ndarray) -> np.ndarray:
    return np.maximum(0.0, 1.0 - np.abs(x))


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _box(x: np.ndarray) -> np.ndarray:
    return ((x > -0.5) & (x <= 0.5)).astype(np.float64)


ANTIALIAS_FILTERS = {"bilinear": (1.0, _triangle), "bicubic": (2.0, _cubic), "area": (0.5, _box)}
_PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed-point coefficients


def _pil_weights(in_size: int, out_size: int, method: str) -> np.ndarray:
    """[out_size, in_size] resampling weights as Pillow's ``precompute_coeffs``: the filter
    widened by the downscale factor (the antialiasing), taps outside the image dropped and
    the rest renormalised, then rounded to Pillow's 22-bit fixed point."""
    support, kernel = ANTIALIAS_FILTERS[method]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support *= filterscale
    weights = np.zeros((out_size, in_size), np.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        taps = kernel((np.arange(xmin, xmax) - center + 0.5) / filterscale)
        total = taps.sum()
        weights[xx, xmin:xmax] = taps / total if total != 0 else taps
    fixed = np.where(weights < 0, -0.5, 0.5) + weights * (1 << _PRECISION_BITS)
    return np.trunc(fixed) / (1 << _PRECISION_BITS)


def _resample_axis(image: np.ndarray, weights: np.ndarray, axis: int) -> np.ndarray:
    """One pass of Pillow's separable resize: weighted sums along ``axis``, rounded half up
    and clipped to uint8 (Pillow keeps the intermediate image in 8 bits)."""
    moved = np.moveaxis(image.astype(np.float64), axis, -1)
    out = moved @ weights.T
    out = np.clip(np.floor(out + 0.5), 0, 255).astype(np.uint8)
    return np.moveaxis(out, -1, axis)


def resize_antialias(image: np.ndarray, height: int, width: int, method: str) -> np.ndarray:
    """A uint8 [H, W, C] image resized as Pillow's ``Image.resize(..., BILINEAR/BICUBIC/BOX)``
    (and torchvision's ``Resize``, which calls it, or its ``antialias=True`` tensor path):
    when shrinking, every output pixel averages all the input pixels under the widened filter
    (cv2.resize samples a 2x2 or 4x4 neighbourhood and aliases). Pillow's fixed-point weights
    and 8-bit rounding between the two passes; the pass with the smaller result first (Pillow
    13 measured: it picks the order itself; on ~15% of size pairs it picks the other one,
    where values differ by a level on smooth images, up to 24 on noise).
    """
    if method not in ANTIALIAS_FILTERS:
        raise ValueError(
            f"antialias resizes with {sorted(ANTIALIAS_FILTERS)} (Pillow's filters), not {method!r}"
        )
    in_h, in_w = image.shape[:2]
    passes = [(1, in_w, width), (0, in_h, height)]
    if in_w * height < width * in_h:  # Pillow 13 runs the pass with the smaller result first
        passes.reverse()
    out = image
    for axis, size, target in passes:
        if size != target:
            out = _resample_axis(out, _pil_weights(size, target, method), axis)
    return np.ascontiguousarray(out)
