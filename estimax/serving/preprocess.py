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
from collections.abc import Callable
from typing import Any

import numpy as np

from estimax.data import preprocessing
from estimax.data.jpeg import ImageDecodeError, image_shape

__all__ = ["Preprocessing", "ImageDecodeError", "resnet_eval", "inception_eval", "from_spec"]


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """A named, versioned image preprocessing: encoded bytes -> one model input.

    Attributes:
      name: registry key (``resnet_eval``, ``inception_eval``).
      version: the recipe's version (bumped whenever its output would change).
      params: keyword parameters of the recipe (e.g. ``image_size``).
    """

    name: str
    version: int
    params: dict[str, Any]

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The shape of one preprocessed image, e.g. (224, 224, 3)."""
        size = int(self.params["image_size"])
        return (size, size, 3)

    @property
    def output_dtype(self) -> np.dtype:
        """uint8 for ResNet (normalised on device), float32 in [-1, 1] for Inception."""
        return np.dtype(_RECIPES[self.name][1])

    def __call__(self, image_bytes: bytes) -> np.ndarray:
        """Decodes and preprocesses one encoded JPEG/PNG image.

        Returns:
          [image_size, image_size, 3] array of ``output_dtype``.

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


# name -> (function, output dtype, current version)
_RECIPES: dict[str, tuple[Callable[..., np.ndarray], str, int]] = {
    "resnet_eval": (_resnet, "uint8", 1),
    "inception_eval": (_inception, "float32", 1),
}


def resnet_eval(image_size: int = preprocessing.IMAGE_SIZE) -> Preprocessing:
    """resnet_preprocessing's eval path: centre crop 0.875, bicubic resize, uint8 [0, 255]."""
    return Preprocessing("resnet_eval", _RECIPES["resnet_eval"][2], {"image_size": image_size})


def inception_eval(image_size: int = 299) -> Preprocessing:
    """inception_preprocessing's eval path: central crop 0.875, bilinear resize, [-1, 1]."""
    return Preprocessing(
        "inception_eval", _RECIPES["inception_eval"][2], {"image_size": image_size}
    )


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
