"""One input image -> one tf.Example of the original converter (docs/original.md §8.1).

What the original did per image, and what we do:

* It decoded every image with TensorFlow (``decode_jpeg(channels=3)``) to get its height and
  width and to check it has 3 channels; that decode is most of its ~120 img/s. We read height,
  width and colour space from the JPEG header (libjpeg-turbo via ``simplejpeg``), and check the
  image decodes according to ``check`` (:data:`CHECKS`): by default a DCT-scaled decode, which
  still entropy-decodes every coefficient (so truncated or damaged data is caught exactly as a
  full decode would catch it) but skips most of the inverse DCT and colour conversion.
* It fixed the one PNG named ``.JPEG`` and the 22 CMYK JPEGs from a hard-coded list. We detect
  them by content: the PNG signature / anything that is not a JPEG, and the colour space in the
  JPEG header (CMYK, YCCK, grayscale). Those are re-encoded as RGB JPEG at quality 100 with 4:2:0
  chroma subsampling (the original's ``encode_jpeg(rgb, quality=100)``, whose default
  ``chroma_downsampling=True`` is 4:2:0). Grayscale JPEGs are re-encoded too (the original kept
  them as they were; the reader converts them, but a record's ``image/channels`` should be true).

The re-encode uses Pillow: it reads every format ImageNet-like trees contain (PNG with alpha or
palette, CMYK JPEGs with Adobe's inverted channels, GIF, BMP) and converts to RGB correctly; these
files are rare, so its speed does not matter.
"""

from __future__ import annotations

import dataclasses
import io
import os
import urllib.request

import simplejpeg

from estimax.data.example import encode_example

__all__ = [
    "CHECKS",
    "BadImageError",
    "ConvertedImage",
    "convert_image",
    "make_example",
    "read_image_bytes",
]

# How much of each image is decoded to check it: 'decode' fully (as the original), 'scaled' at
# 1/8 scale in the DCT domain (every coefficient is still entropy-decoded), 'header' not at all.
CHECKS = ("scaled", "decode", "header")

_JPEG_SOI = b"\xff\xd8"
_REENCODE_QUALITY = 100  # the original's encode_jpeg(..., quality=100)
# Colour spaces a JPEG header can report (simplejpeg) that are stored as-is; the rest are
# re-encoded as RGB.
_RGB_JPEG_COLORSPACES = ("YCbCr", "RGB")


class BadImageError(ValueError):
    """An input image cannot be read or decoded; the message names the file."""


@dataclasses.dataclass(frozen=True)
class ConvertedImage:
    """An image ready for a record.

    Attributes:
      encoded: RGB JPEG bytes (the input's own bytes unless it had to be re-encoded).
      height, width: pixels.
      fixed: why it was re-encoded ('png', 'cmyk', 'grayscale', ...), or '' if not.
    """

    encoded: bytes
    height: int
    width: int
    fixed: str = ""


def read_image_bytes(path: str) -> bytes:
    """The bytes of ``path``: a local path, any fsspec URL (``gs://``...) or ``http(s)://``.

    ``fake-imagenet:...`` paths are generated (``estimax.tools.fake_imagenet``).
    """
    if path.startswith("fake-imagenet:"):
        from estimax.tools.fake_imagenet import fake_jpeg

        return fake_jpeg(path)
    if path.startswith(("http://", "https://")):
        # fsspec's HTTP filesystem needs aiohttp; urllib is enough for one GET per image.
        with urllib.request.urlopen(path, timeout=60) as r:
            return r.read()
    if "://" not in path:
        with open(path, "rb") as f:
            return f.read()
    import fsspec  # only for remote paths

    with fsspec.open(path, "rb") as f:
        return f.read()


def _check_decodes(data: bytes, check: str) -> None:
    if check == "header":
        return
    kwargs = dict(colorspace="RGB", fastdct=True, fastupsample=True)
    if check == "scaled":
        kwargs.update(min_height=1, min_width=1, min_factor=8)
    try:
        simplejpeg.decode_jpeg(data, strict=True, **kwargs)
        return
    except ValueError as e:
        strict_error = str(e)
    # As estimax.data.jpeg (and TensorFlow's decoder): libjpeg warnings such as "extraneous
    # bytes before marker" are tolerated, truncated data is not.
    if "Premature end" in strict_error:
        raise BadImageError(f"truncated JPEG: {strict_error}")
    try:
        simplejpeg.decode_jpeg(data, strict=False, **kwargs)
    except ValueError as e:
        raise BadImageError(f"JPEG does not decode: {e}") from None


def _reencode(data: bytes) -> tuple[bytes, int, int, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "unknown").lower()
            mode = img.mode
            rgb = img.convert("RGB")
    except (
        UnidentifiedImageError,
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
    ) as e:
        raise BadImageError(
            f"not a readable image ({len(data)} bytes, starting {data[:8]!r}): {e}"
        ) from None
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=_REENCODE_QUALITY, subsampling=2)
    if fmt == "jpeg":
        reason = {"CMYK": "cmyk", "L": "grayscale", "1": "grayscale"}.get(mode, f"jpeg-{mode}")
    else:
        reason = fmt
    return out.getvalue(), rgb.height, rgb.width, reason


def convert_image(data: bytes, check: str = "scaled") -> ConvertedImage:
    """Makes ``data`` an RGB JPEG: kept if it is one, re-encoded if it is not (see module doc).

    Args:
      data: the file's bytes (any image format Pillow reads).
      check: one of :data:`CHECKS`.

    Raises:
      BadImageError: unreadable, truncated or undecodable.
    """
    if check not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
    if not data:
        raise BadImageError("empty file")
    if data[:2] == _JPEG_SOI:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as e:
            raise BadImageError(f"JPEG header unreadable: {e}") from None
        if colorspace in _RGB_JPEG_COLORSPACES:
            _check_decodes(data, check)
            return ConvertedImage(data, int(height), int(width))
    encoded, height, width, reason = _reencode(data)
    return ConvertedImage(encoded, height, width, reason)


def make_example(image: ConvertedImage, label: int, synset: str, filename: str) -> bytes:
    """The serialized tf.Example of the original converter.

    Fields: image/height, image/width (int64), image/colorspace 'RGB', image/channels 3,
    image/class/label (the 1-based label), image/class/synset, image/format 'JPEG',
    image/filename (the basename), image/encoded.
    """
    return encode_example(
        {
            "image/height": image.height,
            "image/width": image.width,
            "image/colorspace": b"RGB",
            "image/channels": 3,
            "image/class/label": int(label),
            "image/class/synset": synset,
            "image/format": b"JPEG",
            "image/filename": os.path.basename(filename),
            "image/encoded": image.encoded,
        }
    )
