"""Image decoding for the input pipeline: JPEG by libjpeg-turbo (simplejpeg), PNG by OpenCV.

Why simplejpeg (numbers: bench/results/input_pipeline.md): it is a maintained binding that
bundles libjpeg-turbo 3.x, decoded 7-35% faster than ``cv2.imdecode`` and ~1.9x faster than
Pillow here, exposes DCT-domain scaled decoding (``min_height``/``min_width``) and lets us pick
TF's IDCT. What none of the maintained bindings exposes is libjpeg-turbo's *partial* decode
(``tj3SetCroppingRegion``, which TF's ``decode_and_crop_jpeg`` uses): PyTurboJPEG only offers
lossless crops (a re-encode) and its 2.x needs a system libturbojpeg >= 3.0 (Debian has 2.1.5);
simplejpeg and OpenCV have none. So we decode whole images and slice. The benchmark measured
what that costs on ImageNet-sized files: a bench-only ctypes call of libjpeg-turbo 3's partial
decode is ~1.27x faster on the ResNet train windows and ~1.09x on the eval windows (Huffman
decoding of every row above the window's bottom is needed either way), and with full decodes
estimax's per-image cost is already on par with tf.data's (train) or below it (eval).
If a maintained binding gains partial decode, `decode_crop` is the one place to use it.

Decoding matches TensorFlow's ``tf.io.decode_jpeg`` / ``decode_and_crop_jpeg`` defaults bit for
bit: TF's default ``dct_method`` is libjpeg's INTEGER_FAST IDCT with fancy upsampling, which is
``fastdct=True, fastupsample=False`` here. The one difference: TF's crop-decode of a 4:2:0 file
upsamples chroma at the window's right/bottom edge without the neighbour outside the window,
so the last column/row can differ by a few levels (tests/test_preprocessing.py, TF goldens).
"""

from __future__ import annotations

import struct

import cv2
import numpy as np
import simplejpeg

# Each worker process decodes one image at a time; OpenCV's own thread pool would only fight the
# loader's processes for the same cores.
cv2.setNumThreads(1)

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOI = b"\xff\xd8"


# The largest image (height x width) decode() accepts: Pillow's decompression-bomb limit
# (2 x its MAX_IMAGE_PIXELS). A damaged or crafted header can claim 65535 x 65535 pixels (a
# 12 GiB array from a few hundred bytes, which libjpeg fills in); the largest ImageNet image has
# about 12 million. Checked from the header, before any pixel is decoded.
MAX_IMAGE_PIXELS = 178_956_970


class ImageDecodeError(ValueError):
    """The bytes are not a decodable JPEG (or PNG) image. The loader adds file and offset."""


def _check_size(height: int, width: int, image_bytes: bytes) -> None:
    if height * width > MAX_IMAGE_PIXELS:
        raise ImageDecodeError(
            f"image of {height}x{width} pixels claimed by its header is larger than "
            f"estimax.data.jpeg.MAX_IMAGE_PIXELS={MAX_IMAGE_PIXELS} ({_describe(image_bytes)}): "
            "damaged, or a decompression bomb"
        )


def _describe(image_bytes: bytes) -> str:
    return f"{len(image_bytes)} bytes, starting {bytes(image_bytes[:8])!r}"


def is_png(image_bytes: bytes) -> bool:
    """Whether `image_bytes` start with the PNG signature."""
    return bytes(image_bytes[:8]) == _PNG_SIGNATURE


def image_shape(image_bytes: bytes) -> tuple[int, int]:
    """Returns (height, width) of a JPEG or PNG from its header, without decoding pixels.

    This is ``tf.image.extract_jpeg_shape`` (which the original feeds to the box sampler).

    Raises:
      ImageDecodeError: the bytes are neither a JPEG with a readable header nor a PNG.
    """
    if is_png(image_bytes):
        if len(image_bytes) < 24:
            raise ImageDecodeError(f"truncated PNG header ({_describe(image_bytes)})")
        # IHDR is always the first chunk: width, height as big-endian uint32 at bytes 16..24.
        width, height = struct.unpack(">II", bytes(image_bytes[16:24]))
        return int(height), int(width)
    if bytes(image_bytes[:2]) != _JPEG_SOI:
        raise ImageDecodeError(
            f"not a decodable JPEG ({_describe(image_bytes)}): no JPEG "
            "start-of-image marker (FF D8) and not a PNG either"
        )
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(image_bytes)
    except (ValueError, TypeError) as e:
        raise ImageDecodeError(f"not a decodable JPEG ({_describe(image_bytes)}): {e}") from None
    return int(height), int(width)


def _decode_jpeg(image_bytes: bytes, min_height: int = 0, min_width: int = 0) -> np.ndarray:
    """Full (or DCT-scaled) decode to RGB; grayscale and CMYK JPEGs come out as RGB too."""
    if bytes(image_bytes[:2]) != _JPEG_SOI:
        raise ImageDecodeError(
            f"not a decodable JPEG ({_describe(image_bytes)}): no JPEG start-of-image marker"
        )
    kwargs = dict(
        colorspace="RGB",
        fastdct=True,
        fastupsample=False,
        min_height=min_height,
        min_width=min_width,
        min_factor=2 if (min_height or min_width) else 1,
    )
    height, width = image_shape(image_bytes)
    _check_size(height, width, image_bytes)
    try:
        return simplejpeg.decode_jpeg(image_bytes, strict=True, **kwargs)
    except ValueError as e:
        strict_error = str(e)
    # TensorFlow's decoder ignores libjpeg warnings ("N extraneous bytes before marker" and the
    # like, which a few ImageNet files have) but fails on truncated data; do the same.
    if "Premature end" in strict_error:
        raise ImageDecodeError(
            f"not a decodable JPEG: truncated ({_describe(image_bytes)}): {strict_error}"
        )
    try:
        return simplejpeg.decode_jpeg(image_bytes, strict=False, **kwargs)
    except ValueError as e:
        raise ImageDecodeError(f"not a decodable JPEG ({_describe(image_bytes)}): {e}") from None


def _check_png_chunks(image_bytes: bytes) -> None:
    """Rejects a PNG whose chunks run past its end (a truncated or damaged file).

    Why by hand: OpenCV's reader allocates a chunk's declared length before reading it, so a
    damaged 744-byte PNG whose IDAT claims 1 GiB took seconds and a gigabyte (found by
    tests/reliability's fuzzer); the walk over a few chunk headers costs microseconds.
    """
    pos, end = len(_PNG_SIGNATURE), len(image_bytes)
    while pos < end:
        if pos + 8 > end:
            break  # trailing bytes after the last chunk: libpng ignores them
        (length,) = struct.unpack(">I", bytes(image_bytes[pos : pos + 4]))
        chunk_end = pos + 12 + length  # length, type, data, CRC
        if chunk_end > end:
            kind = bytes(image_bytes[pos + 4 : pos + 8])
            raise ImageDecodeError(
                f"not a decodable PNG: truncated ({_describe(image_bytes)}): chunk {kind!r} "
                f"at byte {pos} claims {length} bytes, {end - pos - 12} are left"
            )
        if bytes(image_bytes[pos + 4 : pos + 8]) == b"IEND":
            return
        pos = chunk_end


def _decode_png(image_bytes: bytes) -> np.ndarray:
    # One ImageNet "JPEG" is really a PNG; TF's decode_jpeg rejects it, we decode it (full
    # decode: PNG has no crop/scale decoding). Alpha is dropped, gray becomes RGB.
    height, width = image_shape(image_bytes)
    _check_size(height, width, image_bytes)
    _check_png_chunks(image_bytes)
    img = cv2.imdecode(np.frombuffer(image_bytes, np.uint8), cv2.IMREAD_COLOR_RGB)
    if img is None:
        raise ImageDecodeError(f"not a decodable PNG ({_describe(image_bytes)})")
    return img


def decode(image_bytes: bytes) -> np.ndarray:
    """Decodes a JPEG (or PNG) to RGB.

    Returns:
      [H, W, 3] uint8.

    Raises:
      ImageDecodeError: the bytes are not a decodable JPEG/PNG (including truncated files), or
        the header claims more than ``MAX_IMAGE_PIXELS`` pixels.
    """
    if is_png(image_bytes):
        return _decode_png(image_bytes)
    return _decode_jpeg(image_bytes)


def decode_crop(
    image_bytes: bytes, crop: tuple[int, int, int, int], min_size: int | None = None
) -> np.ndarray:
    """Decodes the window `crop` = (y, x, height, width) (pixels of the full image) to RGB.

    With `min_size`, the JPEG may be decoded at 1/2, 1/4 or 1/8 scale in the DCT domain (libjpeg's
    scaled IDCT, much cheaper than a full decode) when the window still has at least `min_size`
    pixels on its short side at that scale; the window is then returned at that reduced scale,
    rounded to whole decoded pixels (so it may be off by up to half a decoded pixel: fine for
    training augmentation, which is the only caller that passes `min_size`).

    Returns:
      [h, w, 3] uint8; (h, w) == (height, width) unless scaled by `min_size`.

    Raises:
      ImageDecodeError: the bytes are not a decodable JPEG/PNG.
      ValueError: the window is empty or lies outside the image.
    """
    y, x, h, w = (int(v) for v in crop)
    if is_png(image_bytes):
        img = _decode_png(image_bytes)
    else:
        factor = 1
        if min_size:
            # Only powers of two: libjpeg's other scales (3/8, 5/8, ...) cost more than a
            # full decode.
            while factor < 8 and min(h, w) // (2 * factor) >= min_size:
                factor *= 2
        if factor > 1:
            full_h, full_w = image_shape(image_bytes)
            img = _decode_jpeg(image_bytes, -(-full_h // factor), -(-full_w // factor))
            sy, sx = img.shape[0] / full_h, img.shape[1] / full_w
            y, x = int(round(y * sy)), int(round(x * sx))
            h = min(max(int(round(h * sy)), 1), img.shape[0] - y)
            w = min(max(int(round(w * sx)), 1), img.shape[1] - x)
            return img[y : y + h, x : x + w]
        img = _decode_jpeg(image_bytes)
    if h <= 0 or w <= 0 or y < 0 or x < 0 or y + h > img.shape[0] or x + w > img.shape[1]:
        raise ValueError(
            f"crop window (y={y}, x={x}, h={h}, w={w}) is not inside the "
            f"{img.shape[0]}x{img.shape[1]} image"
        )
    return img[y : y + h, x : x + w]
