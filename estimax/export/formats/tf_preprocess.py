"""An export's recorded image preprocessing in TensorFlow ops, pixel for pixel as estimax's.

Used by ``estimax.export.formats.savedmodel`` (the ``estimax[tf]`` extra; nothing else imports this
module, which imports TensorFlow). Every recipe of ``estimax.export.preprocess`` is a declared
``image`` recipe here (``resnet_eval``: centre crop ``size / (size + 32)``, bicubic, uint8;
``inception_eval``: ``central_crop(0.875)``, bilinear, ``x * 2/255 - 1``), run as estimax runs it:
decode (libjpeg-turbo with the fast integer DCT and fancy upsampling, as estimax's decoder),
crop, resize, channels, then float32 scaling in estimax's order.

Why the resizes are written out rather than ``tf.image.resize``: estimax resizes with OpenCV,
whose kernels TensorFlow does not have (bicubic a=-0.75 against TF's -0.5; OpenCV's bilinear is
fixed-point, 11-bit weights, with its own rounding). Measured against ``cv2.resize`` on 3.1M
random values (sizes 2-300 px, up and down): the fixed-point bilinear below: 0 values differ
(float bilinear: 12% differ by one level); nearest on every grid: 0; bicubic on the half-pixel
grid as two float64 matrix products, rounded: 0 of 86k values in one sample, 1 of 867 one level
apart in another (OpenCV's bicubic is fixed-point too, and not emulated here): the SavedModel
writer compares the pixels of every check image and refuses to publish if one differs. What is
not reproduced is refused by :func:`unsupported` (one line naming it):
``area`` (OpenCV's float path differs by one level on ~0.1% of values) and bilinear/bicubic on
the ``align_corners``/``asymmetric`` grids (``cv2.remap``'s 1/32-pixel fixed point).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from estimax.export.preprocess import Preprocessing

__all__ = ["as_image_params", "preprocess_fn", "unsupported"]

# OpenCV's RGB -> gray weights for 8-bit images (cvtColor, 15-bit fixed point, rounded).
_GRAY = (9798, 19235, 3735)


# estimax's own recipes as declared ones (estimax.data.preprocessing's eval paths).
_AS_DECLARED: dict[str, dict[str, Any]] = {
    "resnet_eval": {"crop": "center", "crop_padding": 32, "resize": "bicubic", "dtype": "uint8"},
    "inception_eval": {
        "crop": "central",
        "crop_fraction": 0.875,
        "resize": "bilinear",
        "scale": 2 / 255,
        "offset": -1.0,
    },
}


def as_image_params(pre: Preprocessing) -> dict[str, Any]:
    """The declared ``image`` parameters that equal ``pre`` (estimax's recipes included)."""
    if pre.name == "image":
        return dict(pre.params)
    if pre.name not in _AS_DECLARED:
        raise ValueError(f"preprocessing {pre.name!r} has no TensorFlow version")
    return {"size": int(pre.params["image_size"]), **_AS_DECLARED[pre.name]}


def unsupported(pre: Preprocessing) -> str | None:
    """None if TensorFlow ops reproduce ``pre``'s pixels exactly, else what they cannot."""
    p = as_image_params(pre)
    resize, grid = p.get("resize", "bilinear"), p.get("grid", "half_pixel")
    if p.get("resize_shorter") is not None:
        return (
            "resize_shorter (the resize of the whole image before the centre crop, as "
            "torchvision's Resize + CenterCrop, has no TensorFlow version here)"
        )
    if p.get("antialias"):
        return (
            "antialias=True (Pillow's fixed-point resampling, rounded to 8 bits between its two "
            "passes, is not reproduced exactly in TensorFlow ops; tf.image.resize(antialias=True) "
            "computes in float)"
        )
    if resize == "area":
        return (
            "resize='area' (OpenCV's area resize is not reproduced exactly in TensorFlow ops: "
            "one level apart on ~0.1% of values)"
        )
    if resize in ("bilinear", "bicubic") and grid != "half_pixel":
        return (
            f"resize={resize!r} with grid={grid!r} (OpenCV's remap samples at 1/32 pixel in "
            "fixed point; TensorFlow ops do not reproduce it exactly)"
        )
    return None


def _size_hw(size: Any) -> tuple[int, int]:
    return (int(size), int(size)) if np.ndim(size) == 0 else (int(size[0]), int(size[1]))


def _decode(data: Any) -> Any:
    """Encoded JPEG/PNG -> uint8 [H, W, 3]: JPEG with the fast integer DCT, as estimax's decoder
    (the accurate one differs by up to 5 levels)."""
    return tf.cond(
        tf.io.is_jpeg(data),
        lambda: tf.io.decode_jpeg(data, channels=3, dct_method="INTEGER_FAST"),
        lambda: tf.io.decode_png(data, channels=3),
    )


def _window(height: Any, width: Any, p: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(y, x, h, w) of the crop, with estimax's arithmetic (``preprocess._crop_window``)."""
    crop = p.get("crop", "none")
    if crop == "central":  # tf.image.central_crop: float64, truncated
        part = float(p["crop_fraction"])
        h, w = tf.cast(height, tf.float64), tf.cast(width, tf.float64)
        y = tf.cast((h - h * part) / 2, tf.int32)
        x = tf.cast((w - w * part) / 2, tf.int32)
        return y, x, height - 2 * y, width - 2 * x
    if crop == "center":  # a float32 fraction of the short side, truncated
        if p.get("crop_padding") is not None:
            side = _size_hw(p["size"])[0]
            fraction = np.float32(side / (side + int(p["crop_padding"])))
        else:
            fraction = np.float32(p["crop_fraction"])
        short = tf.cast(tf.minimum(height, width), tf.float32)
        crop_side = tf.maximum(1, tf.cast(tf.constant(fraction) * short, tf.int32))
        return ((height - crop_side) + 1) // 2, ((width - crop_side) + 1) // 2, crop_side, crop_side
    return 0, 0, height, width


def _cubic_matrix(size_in: Any, size_out: int) -> Any:
    """``[size_out, size_in]`` float64 weights of OpenCV's INTER_CUBIC along one axis
    (half-pixel centres, a=-0.75, borders replicated)."""
    a = -0.75
    src = (tf.range(size_out, dtype=tf.float64) + 0.5) * (
        tf.cast(size_in, tf.float64) / size_out
    ) - 0.5
    x0 = tf.floor(src)
    t = src - x0
    weights = []
    for k in (-1, 0, 1, 2):
        d = tf.abs(t - float(k))
        w = tf.where(
            d <= 1.0,
            ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0,
            ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a,
        )
        index = tf.clip_by_value(tf.cast(x0, tf.int32) + k, 0, size_in - 1)
        weights.append(tf.one_hot(index, size_in, dtype=tf.float64) * w[:, None])
    return tf.add_n(weights)


def _bicubic(image: Any, out_h: int, out_w: int) -> Any:
    shape = tf.shape(image)
    rows, cols = _cubic_matrix(shape[0], out_h), _cubic_matrix(shape[1], out_w)
    out = tf.einsum("oh,hwc,pw->opc", rows, tf.cast(image, tf.float64), cols)
    return tf.cast(tf.clip_by_value(tf.round(out), 0.0, 255.0), tf.uint8)


def _linear_taps(size_in: Any, size_out: int, clamp_fraction: bool) -> tuple[Any, ...]:
    """OpenCV's INTER_LINEAR taps along one axis: indices and 11-bit fixed-point weights.

    Its horizontal pass zeroes the fraction of a tap past either border, its vertical pass only
    clamps the row index (measured: both exact against cv2.resize).
    """
    scale = tf.cast(size_in, tf.float64) / size_out
    f = tf.cast((tf.range(size_out, dtype=tf.float64) + 0.5) * scale - 0.5, tf.float32)
    s = tf.floor(f)
    f = f - s
    s = tf.cast(s, tf.int32)
    if clamp_fraction:
        outside = (s < 0) | (s >= size_in - 1)
        f = tf.where(outside, tf.zeros_like(f), f)
        s = tf.where(s < 0, tf.zeros_like(s), s)
    w0 = tf.cast(tf.round((1.0 - f) * 2048.0), tf.int32)
    w1 = tf.cast(tf.round(f * 2048.0), tf.int32)
    return (
        tf.clip_by_value(s, 0, size_in - 1),
        tf.clip_by_value(s + 1, 0, size_in - 1),
        w0,
        w1,
    )


def _bilinear(image: Any, out_h: int, out_w: int) -> Any:
    """``cv2.resize(..., INTER_LINEAR)`` of uint8, bit-exact: its fixed-point arithmetic."""
    shape = tf.shape(image)
    x0, x1, a0, a1 = _linear_taps(shape[1], out_w, True)
    y0, y1, b0, b1 = _linear_taps(shape[0], out_h, False)
    pixels = tf.cast(image, tf.int32)
    rows = (
        tf.gather(pixels, x0, axis=1) * a0[None, :, None]
        + tf.gather(pixels, x1, axis=1) * a1[None, :, None]
    )
    shift = tf.bitwise.right_shift
    top = shift(b0[:, None, None] * shift(tf.gather(rows, y0), 4), 16)
    bottom = shift(b1[:, None, None] * shift(tf.gather(rows, y1), 4), 16)
    return tf.cast(tf.clip_by_value(shift(top + bottom + 2, 2), 0, 255), tf.uint8)


def _nearest_index(size_in: Any, size_out: int, grid: str) -> Any:
    i = tf.range(size_out, dtype=tf.float64)
    n_in = tf.cast(size_in, tf.float64)
    if grid == "half_pixel":  # cv2.resize's INTER_NEAREST: floor(i * in / out)
        index = tf.floor(i * (1.0 / (size_out / n_in)))
    else:  # cv2.remap at float32 coordinates, rounded half to even
        step = (n_in - 1) / (size_out - 1) if grid == "align_corners" else n_in / size_out
        if grid == "align_corners" and size_out == 1:
            step = tf.zeros_like(n_in)
        coords = tf.cast(i, tf.float32) * tf.cast(step, tf.float32)
        index = tf.cast(tf.round(coords), tf.float64)
    return tf.clip_by_value(tf.cast(index, tf.int32), 0, size_in - 1)


def _nearest(image: Any, out_h: int, out_w: int, grid: str) -> Any:
    shape = tf.shape(image)
    image = tf.gather(image, _nearest_index(shape[0], out_h, grid), axis=0)
    return tf.gather(image, _nearest_index(shape[1], out_w, grid), axis=1)


def _values(image: Any, p: dict[str, Any]) -> Any:
    """Channels and float32 scaling, in ``preprocess._image``'s order."""
    channels = p.get("channels", "rgb")
    if channels == "bgr":
        image = image[..., ::-1]
    elif channels == "gray":
        weighted = tf.reduce_sum(tf.cast(image, tf.int32) * tf.constant(_GRAY), axis=-1)
        image = tf.cast(tf.bitwise.right_shift(weighted + (1 << 14), 15), tf.uint8)[..., None]
    if p.get("dtype", "float32") == "uint8":
        return image
    out = tf.cast(image, tf.float32)
    scale, offset = np.float32(p.get("scale", 1.0)), np.float32(p.get("offset", 0.0))
    if scale != 1:
        out = out * scale
    if offset != 0:
        out = out + offset
    if p.get("mean") is not None:
        out = out - np.asarray(p["mean"], np.float32)
    if p.get("stddev") is not None:
        out = out / np.asarray(p["stddev"], np.float32)
    return out


def preprocess_fn(pre: Preprocessing) -> Callable[[Any], Any]:
    """``fn(encoded image: tf.string scalar) -> pre.output_shape`` tensor of ``output_dtype``.

    Raises:
      ValueError: ``unsupported(pre)`` names what TensorFlow cannot reproduce exactly.
    """
    reason = unsupported(pre)
    if reason:
        raise ValueError(f"the preprocessing's {reason}; serve this export with estimax")
    p = as_image_params(pre)
    out_h, out_w = _size_hw(p["size"])
    resize, grid = p.get("resize", "bilinear"), p.get("grid", "half_pixel")

    def fn(data: Any) -> Any:
        image = _decode(data)
        shape = tf.shape(image)
        y, x, h, w = _window(shape[0], shape[1], p)
        image = image[y : y + h, x : x + w]
        if resize == "bicubic":
            image = _bicubic(image, out_h, out_w)
        elif resize == "bilinear":
            image = _bilinear(image, out_h, out_w)
        else:
            image = _nearest(image, out_h, out_w, grid)
        return _values(image, p)

    return fn
