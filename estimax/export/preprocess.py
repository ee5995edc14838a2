"""Preprocessing recorded with an export and applied by the server: estimax's own eval recipes.

JPEG decoding cannot live inside the StableHLO artifact, so an export for raw images records
which of these to apply (name, version, parameters) in its ``serving.json``; the server and
``estimax predict`` apply exactly the function the eval input pipeline uses
(``estimax.data.preprocessing``), so served predictions equal ``evaluate``'s for the same image.
A version number changes whenever a recipe's output would change, so an old export never gets
silently different pixels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import cv2
import numpy as np

from estimax.data import jpeg, preprocessing
from estimax.data.jpeg import ImageDecodeError, image_shape

__all__ = [
    "ImageDecodeError",
    "Preprocessing",
    "from_spec",
    "image_preprocessing",
    "inception_eval",
    "resnet_eval",
]


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """A named, versioned image preprocessing: encoded bytes -> one model input.

    Attributes:
      name: registry key: ``image`` (declared as data, :func:`image_preprocessing`), or one of
        estimax's own recipes, ``resnet_eval`` and ``inception_eval``.
      version: the recipe's version (bumped whenever its output would change).
      params: keyword parameters of the recipe (e.g. ``image_size``).
    """

    name: str
    version: int
    params: dict[str, Any]

    def __post_init__(self) -> None:
        if self.name not in _RECIPES:
            raise ValueError(
                f"unknown preprocessing {self.name!r} (known: {sorted(_RECIPES)}); declare a "
                "custom one with estimax.export.image_preprocessing(size=..., crop=..., ...)"
            )
        if self.name == "image":
            _check_image_params(self.params)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The shape of one preprocessed image, e.g. (224, 224, 3)."""
        if self.name == "image":
            height, width = _size_hw(self.params["size"])
            return (height, width, 1 if self.params.get("channels") == "gray" else 3)
        size = int(self.params["image_size"])
        return (size, size, 3)

    @property
    def output_dtype(self) -> np.dtype:
        """uint8 for ResNet (normalised on device), float32 in [-1, 1] for Inception; as
        declared for ``image``."""
        if self.name == "image":
            return np.dtype(self.params.get("dtype", "float32"))
        return np.dtype(_RECIPES[self.name][1])

    def __call__(self, image_bytes: bytes) -> np.ndarray:
        """Decodes and preprocesses one encoded JPEG/PNG image.

        Returns:
          ``output_shape`` array of ``output_dtype``.

        Raises:
          ImageDecodeError: the bytes are not a decodable JPEG/PNG.
        """
        return _RECIPES[self.name][0](image_bytes, **self.params)

    def to_json(self) -> dict[str, Any]:
        """The record written into ``serving.json``."""
        return {"name": self.name, "version": self.version, "params": dict(self.params)}


def _resnet(image_bytes: bytes, image_size: int) -> np.ndarray:
    return preprocessing.resnet_preprocess(image_bytes, is_training=False, image_size=image_size)


def _inception(image_bytes: bytes, image_size: int) -> np.ndarray:
    return preprocessing.inception_preprocess(image_bytes, is_training=False, image_size=image_size)


# The declared recipe's vocabulary. Each value names what a user's own (TF or numpy) eval
# preprocessing did, so that serving can repeat it exactly without the user's code.
CROPS = ("none", "center", "central")
RESIZE_METHODS = {
    "bilinear": cv2.INTER_LINEAR,
    "bicubic": cv2.INTER_CUBIC,
    "nearest": cv2.INTER_NEAREST,
    "area": cv2.INTER_AREA,
}
GRIDS = ("half_pixel", "align_corners", "asymmetric")
CHANNELS = ("rgb", "bgr", "gray")
_IMAGE_KEYS = {
    "size",
    "crop",
    "crop_fraction",
    "crop_padding",
    "resize_shorter",
    "resize",
    "antialias",
    "grid",
    "channels",
    "dtype",
    "scale",
    "offset",
    "mean",
    "stddev",
}


def _size_hw(size: Any) -> tuple[int, int]:
    if isinstance(size, int | np.integer) and not isinstance(size, bool):
        return int(size), int(size)
    if isinstance(size, list | tuple) and len(size) == 2:
        return int(size[0]), int(size[1])
    raise ValueError(f"image preprocessing: size must be an int or [height, width], got {size!r}")


def _check_image_params(p: dict[str, Any]) -> None:
    """Raises ValueError naming the first parameter of a declared recipe that is not valid."""
    unknown = set(p) - _IMAGE_KEYS
    if unknown:
        raise ValueError(
            f"image preprocessing: unknown parameter(s) {sorted(unknown)} "
            f"(known: {sorted(_IMAGE_KEYS)})"
        )
    if "size" not in p:
        raise ValueError("image preprocessing: size (the model's input side) is required")
    height, width = _size_hw(p["size"])
    if height <= 0 or width <= 0:
        raise ValueError(f"image preprocessing: size must be positive, got {p['size']!r}")
    _check_crop(p, height, width)
    _check_resize(p, height, width)
    _check_output(p)


def _check_crop(p: dict[str, Any], height: int, width: int) -> None:
    """Raises ValueError naming the first crop parameter that is not valid for the size."""
    crop = p.get("crop", "none")
    if crop not in CROPS:
        raise ValueError(f"image preprocessing: crop must be one of {CROPS}, got {crop!r}")
    fraction, padding = p.get("crop_fraction"), p.get("crop_padding")
    if crop == "none" and (fraction is not None or padding is not None):
        raise ValueError(
            "image preprocessing: crop_fraction/crop_padding need crop='center'/'central'"
        )
    if crop == "central" and (fraction is None or padding is not None):
        raise ValueError("image preprocessing: crop='central' takes crop_fraction (e.g. 0.875)")
    if crop == "center" and (fraction is None) == (padding is None):
        raise ValueError(
            "image preprocessing: crop='center' takes exactly one of crop_fraction (of the short "
            "side) or crop_padding (ResNet's size / (size + padding))"
        )
    if fraction is not None and not 0 < float(fraction) <= 1:
        raise ValueError(f"image preprocessing: crop_fraction must be in (0, 1], got {fraction!r}")
    if padding is not None and int(padding) < 0:
        raise ValueError(f"image preprocessing: crop_padding must be >= 0, got {padding!r}")
    if padding is not None and height != width:
        raise ValueError("image preprocessing: crop_padding needs a square size")


def _check_resize(p: dict[str, Any], height: int, width: int) -> None:
    """Raises ValueError naming the first resize parameter (resize_shorter, resize, antialias,
    grid) that is not valid."""
    crop = p.get("crop", "none")
    shorter = p.get("resize_shorter")
    if shorter is not None:
        if isinstance(shorter, bool) or not isinstance(shorter, int | np.integer):
            raise ValueError(f"image preprocessing: resize_shorter must be an int, got {shorter!r}")
        if shorter < max(height, width):
            raise ValueError(
                f"image preprocessing: resize_shorter={shorter} must be at least the size's "
                f"larger side, {max(height, width)} (the centre crop is taken after the resize)"
            )
        if crop != "none":
            raise ValueError(
                "image preprocessing: resize_shorter resizes the whole image and then crops "
                "its centre (torchvision's Resize + CenterCrop): it takes crop='none'"
            )
    if p.get("resize", "bilinear") not in RESIZE_METHODS:
        raise ValueError(
            f"image preprocessing: resize must be one of {sorted(RESIZE_METHODS)}, "
            f"got {p.get('resize')!r}"
        )
    grid = p.get("grid", "half_pixel")
    if p.get("antialias", False) not in (True, False):
        raise ValueError(
            f"image preprocessing: antialias must be True or False, got {p['antialias']!r}"
        )
    if p.get("antialias") and (p.get("resize", "bilinear") == "nearest" or grid != "half_pixel"):
        raise ValueError(
            "image preprocessing: antialias=True (Pillow's and torchvision's resampling) takes "
            "resize='bilinear', 'bicubic' or 'area' (Pillow's BOX) on grid='half_pixel'"
        )
    if grid not in GRIDS:
        raise ValueError(f"image preprocessing: grid must be one of {GRIDS}, got {grid!r}")
    if grid != "half_pixel" and p.get("resize", "bilinear") == "area":
        raise ValueError("image preprocessing: resize='area' has no grid other than half_pixel")


def _check_output(p: dict[str, Any]) -> None:
    """Raises ValueError naming the first output parameter (channels, dtype, the scaling) that is
    not valid."""
    if p.get("channels", "rgb") not in CHANNELS:
        raise ValueError(
            f"image preprocessing: channels must be one of {CHANNELS}, got {p.get('channels')!r}"
        )
    dtype = p.get("dtype", "float32")
    if dtype not in ("uint8", "float32"):
        raise ValueError(f"image preprocessing: dtype must be 'uint8' or 'float32', got {dtype!r}")
    scaled = any(p.get(k) is not None for k in ("mean", "stddev")) or (
        float(p.get("scale", 1.0)),
        float(p.get("offset", 0.0)),
    ) != (1.0, 0.0)
    if dtype == "uint8" and scaled:
        raise ValueError(
            "image preprocessing: scale/offset/mean/stddev need dtype='float32' (uint8 output "
            "is the resized pixels; normalise on the device)"
        )
    channels = 1 if p.get("channels") == "gray" else 3
    for key in ("mean", "stddev"):
        value = p.get(key)
        if value is not None and np.asarray(value, dtype=np.float64).size not in (1, channels):
            raise ValueError(
                f"image preprocessing: {key} must have 1 or {channels} values, got {value!r}"
            )
    if p.get("stddev") is not None and (np.asarray(p["stddev"], dtype=np.float64) == 0).any():
        raise ValueError("image preprocessing: stddev must not be 0")


def _crop_window(shape: tuple[int, int], p: dict[str, Any]) -> tuple[int, int, int, int]:
    height, width = shape
    crop = p.get("crop", "none")
    if crop == "central":  # tf.image.central_crop, as inception_preprocess's eval path
        fraction = float(p["crop_fraction"])
        y = int((height - height * fraction) / 2)
        x = int((width - width * fraction) / 2)
        return y, x, height - 2 * y, width - 2 * x
    if crop == "center":
        if p.get("crop_padding") is not None:  # the ResNet eval window
            side = _size_hw(p["size"])[0]
            return _center(shape, np.float32(side / (side + int(p["crop_padding"]))))
        return _center(shape, np.float32(p["crop_fraction"]))
    return 0, 0, height, width


def _center(shape: tuple[int, int], fraction: np.float32) -> tuple[int, int, int, int]:
    # As resnet_preprocessing's _decode_and_center_crop: float32 fraction, truncated side.
    height, width = shape
    side = max(1, int(fraction * np.float32(min(height, width))))
    return ((height - side) + 1) // 2, ((width - side) + 1) // 2, side, side


def _resize_grid(image: np.ndarray, height: int, width: int, method: int, grid: str) -> np.ndarray:
    if grid == "half_pixel":  # OpenCV's own grid (TF2, and TF1 with half_pixel_centers=True)
        return cv2.resize(image, (width, height), interpolation=method)
    # TF1's resize_images grids, which cv2.resize does not offer: sample by an explicit map.
    in_h, in_w = image.shape[:2]

    def coords(out: int, size: int) -> np.ndarray:
        i = np.arange(out, dtype=np.float32)
        if grid == "align_corners":
            return i * np.float32((size - 1) / (out - 1) if out > 1 else 0.0)
        return i * np.float32(size / out)  # asymmetric: TF1's default (align_corners=False)

    map_x = np.broadcast_to(coords(width, in_w)[None, :], (height, width))
    map_y = np.broadcast_to(coords(height, in_h)[:, None], (height, width))
    return cv2.remap(
        image,
        np.ascontiguousarray(map_x),
        np.ascontiguousarray(map_y),
        method,
        borderMode=cv2.BORDER_REPLICATE,
    )


def _shorter_side(shape: tuple[int, int], shorter: int) -> tuple[int, int]:
    """The (height, width) of torchvision's ``Resize(shorter)``: the short side to ``shorter``,
    the long one to ``int(shorter * long / short)`` (torchvision's
    ``_compute_resized_output_size``)."""
    height, width = shape
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shorter * long / short)
    return (new_long, shorter) if width <= height else (shorter, new_long)


def _resize(image: np.ndarray, height: int, width: int, p: dict[str, Any]) -> np.ndarray:
    if p.get("antialias"):
        return preprocessing.resize_antialias(image, height, width, p.get("resize", "bilinear"))
    return _resize_grid(
        image,
        height,
        width,
        RESIZE_METHODS[p.get("resize", "bilinear")],
        p.get("grid", "half_pixel"),
    )


def _image(image_bytes: bytes, **p: Any) -> np.ndarray:
    shape = image_shape(image_bytes)
    height, width = _size_hw(p["size"])
    if p.get("resize_shorter") is not None:
        # torchvision's eval pipeline: Resize(shorter) on the whole image, then CenterCrop(size)
        # with its offsets, int(round((resized - size) / 2)) (Python's round, half to even).
        image = jpeg.decode_crop(image_bytes, (0, 0, *shape))
        new_h, new_w = _shorter_side(shape, int(p["resize_shorter"]))
        if (new_h, new_w) != shape:
            image = _resize(image, new_h, new_w, p)
        top, left = int(round((new_h - height) / 2.0)), int(round((new_w - width) / 2.0))
        image = np.ascontiguousarray(image[top : top + height, left : left + width])
    else:
        image = jpeg.decode_crop(image_bytes, _crop_window(shape, p))
        image = _resize(image, height, width, p)
    channels = p.get("channels", "rgb")
    if channels == "bgr":
        image = image[..., ::-1]
    elif channels == "gray":
        image = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)[..., None]
    if p.get("dtype", "float32") == "uint8":
        return np.ascontiguousarray(image)
    out = image.astype(np.float32)
    scale, offset = np.float32(p.get("scale", 1.0)), np.float32(p.get("offset", 0.0))
    if scale != 1:
        out *= scale
    if offset != 0:
        out += offset
    if p.get("mean") is not None:
        out -= np.asarray(p["mean"], dtype=np.float32)
    if p.get("stddev") is not None:
        out /= np.asarray(p["stddev"], dtype=np.float32)
    return out


# name -> (function, output dtype (None: declared), current version)
_RECIPES: dict[str, tuple[Callable[..., np.ndarray], str | None, int]] = {
    "resnet_eval": (_resnet, "uint8", 1),
    "inception_eval": (_inception, "float32", 1),
    "image": (_image, None, 1),
}


def resnet_eval(image_size: int = preprocessing.IMAGE_SIZE) -> Preprocessing:
    """resnet_preprocessing's eval path: centre crop 0.875, bicubic resize, uint8 [0, 255]."""
    return Preprocessing("resnet_eval", _RECIPES["resnet_eval"][2], {"image_size": image_size})


def inception_eval(image_size: int = 299) -> Preprocessing:
    """inception_preprocessing's eval path: central crop 0.875, bilinear resize, [-1, 1]."""
    return Preprocessing(
        "inception_eval", _RECIPES["inception_eval"][2], {"image_size": image_size}
    )


def image_preprocessing(
    size: int | tuple[int, int],
    *,
    crop: str = "none",
    crop_fraction: float | None = None,
    crop_padding: int | None = None,
    resize_shorter: int | None = None,
    resize: str = "bilinear",
    antialias: bool = False,
    grid: str = "half_pixel",
    channels: str = "rgb",
    dtype: str = "float32",
    scale: float = 1.0,
    offset: float = 0.0,
    mean: float | Sequence[float] | None = None,
    stddev: float | Sequence[float] | None = None,
) -> Preprocessing:
    """A model's own serving preprocessing, declared as data (no code is exported).

    The server decodes the image (JPEG or PNG, to RGB), crops, resizes (with
    ``resize_shorter``: resizes, then crops), orders the channels and scales the values, in that
    order, with the functions estimax's input pipeline uses:
    ``out = ((pixels * scale + offset) - mean) / stddev``.

    Args:
      size: the model's input side, or ``(height, width)``.
      crop: ``"none"`` (the whole image), ``"center"`` (a centred square: ``crop_fraction`` of
        the short side, or ResNet's ``size / (size + crop_padding)``), or ``"central"``
        (``tf.image.central_crop(crop_fraction)``: that fraction of each side, as Inception).
      crop_fraction: see ``crop``.
      crop_padding: see ``crop`` (ResNet: 32).
      resize_shorter: resize the whole image first, its short side to this (the long side to
        ``int(resize_shorter * long / short)``), then take the centred ``size`` from it:
        torchvision's ``Resize(resize_shorter)`` then ``CenterCrop(size)`` (its usual eval
        pipeline: 256 then 224, with ``antialias=True``). Takes ``crop="none"``.
      resize: ``"bilinear"``, ``"bicubic"``, ``"nearest"`` or ``"area"``.
      antialias: resize as Pillow's ``Image.resize`` (and torchvision's ``Resize``, which
        antialiases by default): the filter widens with the downscale factor, so a shrinking
        resize averages every input pixel (``area`` is Pillow's ``BOX``; bicubic is Pillow's,
        a = -0.5). False: OpenCV's ``cv2.resize`` (TF's ``tf.image.resize`` without antialias),
        which samples a fixed 2x2/4x4 neighbourhood. Pillow's own defaults: ``Image.resize``
        is bicubic, torchvision's ``Resize`` bilinear.
      grid: where output pixels sample the input: ``"half_pixel"`` (TF2, OpenCV, PIL; TF1 with
        ``half_pixel_centers=True``), ``"align_corners"`` (TF1 ``align_corners=True``) or
        ``"asymmetric"`` (TF1's default, ``align_corners=False``).
      channels: ``"rgb"``, ``"bgr"`` or ``"gray"`` (one channel, ITU-R 601 luma).
      dtype: ``"uint8"`` (the resized pixels; normalise on the device) or ``"float32"``.
      scale, offset, mean, stddev: float32 value scaling (per channel for mean/stddev).

    Returns:
      A ``Preprocessing`` to pass to ``export_version(preprocessing=...)``.

    Raises:
      ValueError: a parameter is not valid (the message names it).
    """
    params: dict[str, Any] = {
        "size": list(size) if isinstance(size, tuple | list) else int(size),
        "crop": crop,
        "resize": resize,
        "grid": grid,
        "channels": channels,
        "dtype": dtype,
        "scale": float(scale),
        "offset": float(offset),
    }
    if antialias:  # absent when False: records written before it keep their meaning
        params["antialias"] = True
    if crop_fraction is not None:
        params["crop_fraction"] = float(crop_fraction)
    if crop_padding is not None:
        params["crop_padding"] = int(crop_padding)
    if resize_shorter is not None:  # absent when not asked: older records keep their meaning
        params["resize_shorter"] = resize_shorter
    for key, value in (("mean", mean), ("stddev", stddev)):
        if value is not None:
            params[key] = [float(v) for v in np.atleast_1d(np.asarray(value, dtype=np.float64))]
    return Preprocessing("image", _RECIPES["image"][2], params)


def from_spec(spec: dict[str, Any]) -> Preprocessing:
    """The ``Preprocessing`` a ``serving.json`` records; refuses unknown names and versions."""
    name, version = spec.get("name"), spec.get("version")
    if name not in _RECIPES:
        raise ValueError(
            f"the export asks for preprocessing {name!r}, which this estimax does "
            f"not have (known: {sorted(_RECIPES)}); serve it with the estimax "
            "version that exported it."
        )
    if version != _RECIPES[name][2]:
        raise ValueError(
            f"the export asks for {name} version {version}, this estimax has "
            f"version {_RECIPES[name][2]}; serve it with the estimax version that "
            "exported it, or export it again."
        )
    return Preprocessing(name, int(version), dict(spec.get("params", {})))


def check_image_size(image_bytes: bytes, max_pixels: int) -> tuple[int, int]:
    """Reads an image's (height, width) from its header and refuses more than ``max_pixels``.

    Raises:
      ImageDecodeError: not a JPEG/PNG.
      ValueError: too many pixels (decoding it could exhaust memory).
    """
    height, width = image_shape(image_bytes)
    if height * width > max_pixels or height <= 0 or width <= 0:
        raise ValueError(
            f"image of {height}x{width} pixels is larger than this server accepts "
            f"({max_pixels} pixels; see --max_image_pixels)"
        )
    return height, width
