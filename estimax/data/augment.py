"""RandAugment (per image) and Mixup (per batch) on the host, in numpy, as big_vision's recipe.

**RandAugment** follows ``distort_image_with_randaugment`` of tensorflow/tpu's
``models/official/efficientnet/autoaugment.py``, which big_vision forked as
``big_vision/pp/autoaugment.py`` (read at commit 538b8a80; its ``randaug(2,10)`` op is that
function): ``num_layers`` times, one of the 16 ops below is drawn uniformly and applied, always,
at the shared ``magnitude`` (0..10, ``_MAX_LEVEL = 10``), with the original's level-to-argument
maps, constants (``translate_const=100``, ``cutout_const=40``), grey fill (128) for the pixels a
geometric op uncovers, nearest-neighbour sampling, and a random sign for rotate, shear and
translate. The original's quirks are kept, since they are the recipe that was trained:

* ``Contrast`` blends towards ``pixels / 256`` (the original sums the histogram, the pixel count,
  where it meant the mean grey level);
* ``Posterize`` keeps ``int(magnitude / 10 * 4)`` bits, so magnitude 0 makes the image black, and
  ``Solarize``'s threshold is ``int(magnitude / 10 * 256)``, so magnitude 0 inverts every pixel;
* the enhance ops (``Color``, ``Contrast``, ``Brightness``, ``Sharpness``) take the factor
  ``magnitude / 10 * 1.8 + 0.1``: identity at magnitude 5, not 0; blends truncate to uint8.

``Rotate`` turns counter-clockwise by a positive angle about the image centre, as
``tfa.image.rotate``; ``TranslateX`` by ``pixels`` moves the content left (``out[y, x] =
in[y, x + pixels]``, PIL's ``Translate``); ``ShearX`` by ``level`` reads ``in[y, x + level * y]``.

Randomness comes only from the ``numpy.random.Generator`` passed in: in the loader that is the
example's own ``default_rng([seed, epoch, index])``, so an augmentation is the same for the same
seed, different per example and per epoch, and does not depend on workers, hosts or resuming.

**Mixup** follows big_vision's ``utils.get_mixup`` (``big_vision/utils.py``): one ratio per batch,
``a ~ Beta(alpha, alpha)``, ``a = max(a, 1 - a)``, and every image and (one-hot) label becomes
``a * x + (1 - a) * roll(x, 1)`` (its neighbour in the batch). big_vision mixes on the device;
here it is :class:`MixupBatches`, around the input's batches, drawing the ratio from
``default_rng([seed, host, position])`` of the input's saved position, so a resumed run mixes
exactly as an uninterrupted one. As big_vision's ``fold_in=None`` on one host, each host mixes
within its own block of the global batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import cv2
import numpy as np

__all__ = [
    "MAX_LEVEL",
    "OPS",
    "MixupBatches",
    "RandAugment",
    "apply_op",
    "mixup",
    "rotate",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
]

MAX_LEVEL = 10.0
REPLACE = 128  # the grey of uncovered and cut-out pixels (replace_value = [128] * 3)
TRANSLATE_CONST = 100  # distort_image_with_randaugment's HParams
CUTOUT_CONST = 40

# The op list of distort_image_with_randaugment, in its order.
OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Cutout",
    "SolarizeAdd",
)


# --- the ops (uint8 [H, W, 3] in, uint8 out) -------------------------------------------------


def blend(image1: np.ndarray, image2: np.ndarray, factor: float) -> np.ndarray:
    """``image1 + factor * (image2 - image1)`` in float32, truncated to uint8 (clipped first when
    ``factor`` extrapolates), as the original's ``blend``."""
    if factor == 0.0:
        return np.asarray(image1, np.uint8)
    if factor == 1.0:
        return np.asarray(image2, np.uint8)
    a = image1.astype(np.float32)
    temp = a + np.float32(factor) * (image2.astype(np.float32) - a)
    if 0.0 < factor < 1.0:
        return temp.astype(np.uint8)
    return np.clip(temp, 0.0, 255.0).astype(np.uint8)


def _grayscale(image: np.ndarray) -> np.ndarray:
    """``tf.image.rgb_to_grayscale`` of uint8: [H, W] uint8 (TF's convert_image_dtype round trip:
    ``/ 255``, the weighted sum, ``* 255.5`` truncated)."""
    rgb = image.astype(np.float32) * np.float32(1 / 255)
    gray = rgb @ np.array([0.2989, 0.5870, 0.1140], np.float32)
    return (gray * np.float32(255.5)).astype(np.uint8)


def color(image: np.ndarray, factor: float) -> np.ndarray:
    """PIL's Color: blend with the grey version."""
    return blend(np.repeat(_grayscale(image)[..., None], 3, axis=-1), image, factor)


def contrast(image: np.ndarray, factor: float) -> np.ndarray:
    """The original's Contrast: blend with a flat image of ``pixels / 256`` (see the module doc)."""
    mean = np.float32(image.shape[0] * image.shape[1]) / np.float32(256.0)
    level = np.uint8(np.clip(mean, 0.0, 255.0))
    return blend(np.full_like(image, level), image, factor)


def brightness(image: np.ndarray, factor: float) -> np.ndarray:
    """PIL's Brightness: blend with black."""
    return blend(np.zeros_like(image), image, factor)


def sharpness(image: np.ndarray, factor: float) -> np.ndarray:
    """PIL's Sharpness: blend with the image smoothed by ``[[1,1,1],[1,5,1],[1,1,1]] / 13`` (its
    one-pixel border kept)."""
    kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / np.float32(13.0)
    smooth = cv2.filter2D(image.astype(np.float32), -1, kernel, borderType=cv2.BORDER_CONSTANT)
    degenerate = image.copy()
    inner = np.clip(smooth[1:-1, 1:-1], 0.0, 255.0).astype(np.uint8)
    degenerate[1:-1, 1:-1] = inner
    return blend(degenerate, image, factor)


def posterize(image: np.ndarray, bits: int) -> np.ndarray:
    """Keeps the ``bits`` high bits of every value."""
    shift = 8 - bits
    return ((image.astype(np.int32) >> shift) << shift).astype(np.uint8)


def solarize(image: np.ndarray, threshold: int = 128) -> np.ndarray:
    """Inverts the values at or above ``threshold``."""
    return np.where(image < threshold, image, 255 - image).astype(np.uint8)


def solarize_add(image: np.ndarray, addition: int = 0, threshold: int = 128) -> np.ndarray:
    """Adds ``addition`` (clipped to [0, 255]) to the values below ``threshold``."""
    added = np.clip(image.astype(np.int64) + addition, 0, 255).astype(np.uint8)
    return np.where(image < threshold, added, image)


def invert(image: np.ndarray) -> np.ndarray:
    """``255 - image``."""
    return (255 - image).astype(np.uint8)


def autocontrast(image: np.ndarray) -> np.ndarray:
    """Stretches each channel to [0, 255] (unchanged where it is flat)."""
    out = image.copy()
    for c in range(image.shape[-1]):
        ch = image[..., c]
        lo, hi = np.float32(ch.min()), np.float32(ch.max())
        if hi > lo:
            scale = np.float32(255.0) / (hi - lo)
            out[..., c] = np.clip(ch.astype(np.float32) * scale - lo * scale, 0, 255).astype(
                np.uint8
            )
    return out


def equalize(image: np.ndarray) -> np.ndarray:
    """PIL's Equalize per channel, as the original's ``equalize``."""
    out = image.copy()
    for c in range(image.shape[-1]):
        ch = image[..., c]
        histo = np.bincount(ch.ravel(), minlength=256).astype(np.int64)
        nonzero = histo[histo != 0]
        step = (nonzero.sum() - nonzero[-1]) // 255
        if step == 0:
            continue
        lut = (np.cumsum(histo) + step // 2) // step
        lut = np.clip(np.concatenate([[0], lut[:-1]]), 0, 255).astype(np.uint8)
        out[..., c] = lut[ch]
    return out


@functools.lru_cache(maxsize=8)
def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ys, xs)`` float32 pixel coordinates of an ``h x w`` image (read-only, cached)."""
    ys, xs = np.mgrid[:h, :w].astype(np.float32)
    ys.flags.writeable = xs.flags.writeable = False
    return ys, xs


def _transform(image: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``tfa.image.transform`` with NEAREST sampling and the grey fill: output pixel (x, y) reads
    input ``matrix @ (x, y, 1)`` (rounded half away from zero); outside the image: 128."""
    h, w = image.shape[:2]
    ys, xs = _grid(h, w)
    m = matrix.astype(np.float32)
    in_x = m[0, 0] * xs + m[0, 1] * ys + m[0, 2]
    in_y = m[1, 0] * xs + m[1, 1] * ys + m[1, 2]
    # std::round (half away from zero), as TF's nearest-neighbour sampling.
    ix = np.copysign(np.floor(np.abs(in_x) + 0.5), in_x).astype(np.int64)
    iy = np.copysign(np.floor(np.abs(in_y) + 0.5), in_y).astype(np.int64)
    outside = (ix < 0) | (ix >= w) | (iy < 0) | (iy >= h)
    flat = np.clip(iy, 0, h - 1) * w + np.clip(ix, 0, w - 1)
    out = np.take(image.reshape(h * w, -1), flat.ravel(), axis=0).reshape(image.shape)
    out[outside] = REPLACE
    return out


def rotate(image: np.ndarray, degrees: float) -> np.ndarray:
    """Rotates counter-clockwise by ``degrees`` about the centre (``tfa.image.rotate``)."""
    h, w = image.shape[:2]
    theta = math.radians(degrees)
    cos, sin = math.cos(theta), math.sin(theta)
    x_offset = ((w - 1) - (cos * (w - 1) - sin * (h - 1))) / 2.0
    y_offset = ((h - 1) - (sin * (w - 1) + cos * (h - 1))) / 2.0
    return _transform(image, np.array([[cos, -sin, x_offset], [sin, cos, y_offset]]))


def translate_x(image: np.ndarray, pixels: float) -> np.ndarray:
    """``out[y, x] = in[y, x + pixels]`` (PIL's Translate in x)."""
    return _transform(image, np.array([[1.0, 0.0, pixels], [0.0, 1.0, 0.0]]))


def translate_y(image: np.ndarray, pixels: float) -> np.ndarray:
    """``out[y, x] = in[y + pixels, x]`` (PIL's Translate in y)."""
    return _transform(image, np.array([[1.0, 0.0, 0.0], [0.0, 1.0, pixels]]))


def shear_x(image: np.ndarray, level: float) -> np.ndarray:
    """``out[y, x] = in[y, x + level * y]`` (the transform ``[1, level, 0, 0, 1, 0, 0, 0]``)."""
    return _transform(image, np.array([[1.0, level, 0.0], [0.0, 1.0, 0.0]]))


def shear_y(image: np.ndarray, level: float) -> np.ndarray:
    """``out[y, x] = in[y + level * x, x]``."""
    return _transform(image, np.array([[1.0, 0.0, 0.0], [level, 1.0, 0.0]]))


def cutout(image: np.ndarray, pad_size: int, rng: np.random.Generator) -> np.ndarray:
    """A grey square of side up to ``2 * pad_size`` about a uniformly drawn centre."""
    h, w = image.shape[:2]
    cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
    out = image.copy()
    out[
        max(0, cy - pad_size) : min(h, cy + pad_size), max(0, cx - pad_size) : min(w, cx + pad_size)
    ] = REPLACE
    return out


# --- levels to arguments (level_to_arg of the original) -------------------------------------


def _signed(value: float, rng: np.random.Generator) -> float:
    """``value`` or ``-value`` with probability 1/2 (``_randomly_negate_tensor``)."""
    return value if rng.random() >= 0.5 else -value


def _enhance(level: float) -> float:
    return (level / MAX_LEVEL) * 1.8 + 0.1


def apply_op(name: str, image: np.ndarray, level: float, rng: np.random.Generator) -> np.ndarray:
    """Applies op ``name`` of ``OPS`` at ``level`` (0..10) as ``distort_image_with_randaugment``.

    Raises:
      KeyError: ``name`` is not one of ``OPS``.
    """
    if name == "AutoContrast":
        return autocontrast(image)
    if name == "Equalize":
        return equalize(image)
    if name == "Invert":
        return invert(image)
    if name == "Rotate":
        return rotate(image, _signed(level / MAX_LEVEL * 30.0, rng))
    if name == "Posterize":
        return posterize(image, int(level / MAX_LEVEL * 4))
    if name == "Solarize":
        return solarize(image, int(level / MAX_LEVEL * 256))
    if name == "SolarizeAdd":
        return solarize_add(image, int(level / MAX_LEVEL * 110))
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        fn = {"Color": color, "Contrast": contrast, "Brightness": brightness}.get(name, sharpness)
        return fn(image, _enhance(level))
    if name in ("ShearX", "ShearY"):
        return (shear_x if name == "ShearX" else shear_y)(
            image, _signed(level / MAX_LEVEL * 0.3, rng)
        )
    if name in ("TranslateX", "TranslateY"):
        pixels = _signed(level / MAX_LEVEL * float(TRANSLATE_CONST), rng)
        return (translate_x if name == "TranslateX" else translate_y)(image, pixels)
    if name == "Cutout":
        return cutout(image, int(level / MAX_LEVEL * CUTOUT_CONST), rng)
    raise KeyError(f"no RandAugment op {name!r}: one of {', '.join(OPS)}")


@dataclasses.dataclass(frozen=True)
class RandAugment:
    """``distort_image_with_randaugment(image, num_layers, magnitude)`` on a uint8 image.

    Picklable (it runs in the loader's worker processes). ``augment(image, rng)`` returns a new
    uint8 ``[H, W, 3]`` image; all randomness is drawn from ``rng``.

    Attributes:
      num_layers: ops applied one after another (N of the paper; 2 in big_vision's i1k configs).
      magnitude: their shared magnitude, 0..10 (M; 10 in ``vit_s16_i1k.py``).
    """

    num_layers: int = 2
    magnitude: float = 10.0

    def __post_init__(self) -> None:
        if self.num_layers < 0:
            raise ValueError(f"RandAugment num_layers must be >= 0, got {self.num_layers}")
        if not 0 <= self.magnitude <= MAX_LEVEL:
            raise ValueError(f"RandAugment magnitude must be in [0, 10], got {self.magnitude}")

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        image = np.asarray(image)
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(
                f"RandAugment takes uint8 [H, W, 3] images, got {image.dtype} {image.shape}"
            )
        for _ in range(self.num_layers):
            name = OPS[int(rng.integers(len(OPS)))]
            image = apply_op(name, image, float(self.magnitude), rng)
        return image


# --- Mixup ----------------------------------------------------------------------------------


def mixup(
    images: np.ndarray, labels: np.ndarray, ratio: float, num_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """big_vision's mix of a batch with its roll by one: ``ratio * x + (1 - ratio) * roll(x, 1)``.

    Args:
      images: [B, ...] (any numeric dtype).
      labels: [B] integer classes (made one-hot over ``num_classes``) or [B, C] targets.
      ratio: the weight of each example itself.
      num_classes: C, for integer labels.

    Returns:
      ``(images float32, labels float32 [B, C])``; each label row sums to what its inputs'
      rows summed to (1 for one-hot labels).
    """
    labels = np.asarray(labels)
    if labels.ndim == 1:
        if num_classes is None:
            raise ValueError("mixup of integer labels needs num_classes")
        labels = np.eye(num_classes, dtype=np.float32)[labels]
    r = np.float32(ratio)

    def mix(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        return r * x + (np.float32(1) - r) * np.roll(x, 1, axis=0)

    return mix(images), mix(labels)


def _position_key(state: Any) -> list[int] | None:
    """The integers of an input position that name the next batch (None: no usable position)."""
    if not isinstance(state, dict):
        return None
    keys = [k for k in ("epoch", "position", "batch_index") if isinstance(state.get(k), int)]
    return [int(state[k]) for k in keys] if keys else None


class MixupBatches:
    """Mixes every batch of ``batches`` (``(images, labels)``): big_vision's mixup on the host.

    Iterators pass ``get_state``/``set_state``/``num_skipped`` through to the input's, so the
    saved position is the input's own; the ratio of a batch is drawn from
    ``default_rng([seed, host_index, *position])``, the position the input stands at before it,
    so resuming mixes the same batches with the same ratios.

    Args:
      batches: an iterable of ``(images [B, ...], labels [B] int)`` batches (the loader).
      alpha: the Beta distribution's concentration (big_vision's ``mixup.p``; 0.2 for ViT-S/16).
      num_classes: for the one-hot labels.
      seed, host_index: of the ratio's generator.
    """

    def __init__(
        self,
        batches: Iterable[tuple[np.ndarray, np.ndarray]],
        alpha: float,
        num_classes: int,
        *,
        seed: int = 0,
        host_index: int = 0,
    ):
        if alpha <= 0:
            raise ValueError(f"mixup alpha must be > 0, got {alpha}")
        self.batches = batches
        self.alpha = float(alpha)
        self.num_classes = int(num_classes)
        self.seed = int(seed)
        self.host_index = int(host_index)

    def __iter__(self) -> _MixupIterator:
        return _MixupIterator(self, iter(self.batches))

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def ratio(self, key: list[int]) -> float:
        """The mixing ratio of the batch at position ``key``: ``max(a, 1 - a)``, a ~ Beta."""
        rng = np.random.default_rng([self.seed, self.host_index, *key])
        a = float(rng.beta(self.alpha, self.alpha))
        return max(a, 1.0 - a)


class _MixupIterator(Iterator[tuple[np.ndarray, np.ndarray]]):
    def __init__(self, owner: MixupBatches, inner: Iterator[Any]):
        self._owner = owner
        self._inner = inner
        self._count = 0  # batches read, for inputs without a position

    @property
    def num_skipped(self) -> int:
        return int(getattr(self._inner, "num_skipped", 0))

    def get_state(self) -> Any:
        return self._inner.get_state()  # type: ignore[attr-defined]

    def set_state(self, state: Any) -> None:
        self._inner.set_state(state)  # type: ignore[attr-defined]

    def close(self) -> None:
        close: Callable[[], None] | None = getattr(self._inner, "close", None)
        if close is not None:
            close()

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        key = _position_key(self._inner.get_state()) if hasattr(self._inner, "get_state") else None
        images, labels = next(self._inner)
        if key is None:
            key = [self._count]
        self._count += 1
        return mixup(images, labels, self._owner.ratio(key), self._owner.num_classes)
