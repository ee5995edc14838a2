"""The train/serve skew check: what the model sees when served vs when evaluated.

``export_version(..., eval_preprocess=fn)`` runs the same check images through the export's
declared preprocessing and through the training side's own eval preprocessing, and compares the
two model inputs (:func:`input_difference`) before anything is exported: shape, dtype and values.
Comparing only the model's predictions (still done, second) passes any preprocessing when the
check images are all of one class and the probabilities saturate, which a model trained on a
few classes does readily; the model's inputs have no such blind spot.

The check images are drawn across classes (:func:`check_images`): from an ``estimax-convert``
output, its ``manifest.json`` says which classes each shard holds, so the images cover as many
classes as there are images, spread over the label range. The first N files of a class-sorted
validation split are usually all one class.
"""

from __future__ import annotations

import inspect
import itertools
import json
import posixpath
from collections.abc import Callable, Iterator, Sequence

import fsspec
import numpy as np

from estimax.data import example, tfrecord
from estimax.export import preprocess

__all__ = ["DEFAULT_PIXEL_TOLERANCE", "check_images", "closest_declaration", "input_difference"]

# Of the training side's value range: 5.1 for 0..255 pixels, 0.02 for [0, 1], 0.04 for
# [-1, 1]. Decoders and resize implementations that agree round differently by a level or two
# (OpenCV's fixed-point bilinear vs TF's float one); another crop, method or scale differs by
# tens of levels over most of the image.
DEFAULT_PIXEL_TOLERANCE = 0.02

# The value ranges images are usually scaled to, smallest first: the training side's range is
# the first that holds all its values (else their own span, e.g. mean/stddev-normalised), so a
# dark or low-contrast check image does not tighten the tolerance.
_RANGES = ((0.0, 1.0), (-1.0, 1.0), (0.0, 255.0))

# Without JAX's 64-bit mode (the default) a float64 batch reaches the model as float32, an int64
# one as int32: training code that computes in float64 feeds the model what serving does.
_AS_FED = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32)}

MANIFEST = "manifest.json"  # estimax-convert's (estimax.tools.convert_shards)


def input_difference(
    served: Callable[[bytes], np.ndarray],
    trained: Callable[[bytes], np.ndarray],
    images: Sequence[bytes],
    tolerance: float = DEFAULT_PIXEL_TOLERANCE,
) -> str | None:
    """How ``served(image)`` and ``trained(image)`` differ on ``images``; None if they agree.

    Args:
      served: the export's declared preprocessing (a ``Preprocessing``).
      trained: the training side's eval preprocessing of one encoded image.
      images: encoded check images.
      tolerance: the largest difference of one value accepted, as a fraction of the range of
        ``trained``'s values: its integer dtype's (0..255 for uint8), else [0, 1], [-1, 1] or
        [0, 255], the first that holds all of them, else their own span.

    Returns:
      For the first image that differs: its shape, else its dtype and the largest value
      difference with the pixel where it is (``"check image #2 of 8: dtype uint8 vs float32,
      values differ by up to 171.0 at pixel (0, 3, 1) (...)"``), and how many images differ.
    """
    pairs = [(np.asarray(served(bytes(b))), np.asarray(trained(bytes(b)))) for b in images]
    low, high = _value_range([t for _, t in pairs])
    limit = tolerance * (high - low)
    problems = [_difference(s, t, limit, f"{tolerance:g} of [{low:g}, {high:g}]") for s, t in pairs]
    bad = [i for i, p in enumerate(problems) if p]
    if not bad:
        return None
    return (
        f"check image #{bad[0]} of {len(images)}: {problems[bad[0]]} "
        f"({len(bad)} of {len(images)} check images differ)"
    )


# What image_preprocessing declares when not told (a declaration is written without them).
_DEFAULTS = {
    "crop": "none",
    "resize": "bilinear",
    "antialias": False,
    "grid": "half_pixel",
    "channels": "rgb",
    "dtype": "float32",
    "scale": 1.0,
    "offset": 0.0,
}


def declaration(pre: preprocess.Preprocessing) -> str:
    """``pre`` as the call that declares it: ``image_preprocessing(32, antialias=True, ...)``."""
    params = dict(pre.params)
    size = params.pop("size")
    said = [repr(tuple(size) if isinstance(size, list) else size)]
    order = list(inspect.signature(preprocess.image_preprocessing).parameters)
    said += [
        f"{k}={params[k]!r}"
        for k in sorted(params, key=lambda k: order.index(k) if k in order else len(order))
        if _DEFAULTS.get(k, None) != params[k]
    ]
    return f"estimax.export.image_preprocessing({', '.join(said)})"


def closest_declaration(
    served: preprocess.Preprocessing,
    trained: Callable[[bytes], np.ndarray],
    images: Sequence[bytes],
    tolerance: float = DEFAULT_PIXEL_TOLERANCE,
) -> preprocess.Preprocessing | None:
    """The declared preprocessing nearest ``served`` (fewest changes of the resize method,
    ``antialias`` and, for a centre crop of ``crop_fraction``, torchvision's resize-then-crop
    ``resize_shorter``: the parameters that differ between OpenCV, TF, Pillow and torchvision)
    whose inputs agree with ``trained``'s on ``images``; None if none does (or ``served`` is one
    of estimax's own recipes)."""
    if served.name != "image":
        return None
    base = dict(served.params)
    crops = [base]
    if base.get("crop") == "center" and base.get("crop_fraction") is not None:
        # torchvision's Resize(S) + CenterCrop(size) for a centre crop of size / S: 224 / 256.
        side = max(served.output_shape[:2])
        torchvision = {k: v for k, v in base.items() if k not in ("crop", "crop_fraction")}
        torchvision["resize_shorter"] = int(round(side / float(base["crop_fraction"])))
        crops.append(torchvision)
    candidates = []
    for crop in crops:
        for resize in preprocess.RESIZE_METHODS:
            for antialias in (False, True):
                if antialias and resize == "nearest":
                    continue
                params = {**crop, "resize": resize, "grid": "half_pixel"}
                params.pop("antialias", None)
                if antialias:
                    params["antialias"] = True
                changes = sum(
                    params.get(k, _DEFAULTS.get(k)) != base.get(k, _DEFAULTS.get(k))
                    for k in set(params) | set(base)
                )
                if changes:
                    candidates.append(
                        (changes, preprocess.Preprocessing("image", served.version, params))
                    )
    for _, candidate in sorted(candidates, key=lambda c: c[0]):
        if input_difference(candidate, trained, images, tolerance) is None:
            return candidate
    return None


def _value_range(arrays: list[np.ndarray]) -> tuple[float, float]:
    """The training side's value range: its integer dtype's, else the first of ``_RANGES`` that
    holds every value, else the values' own."""
    if arrays and np.issubdtype(arrays[0].dtype, np.integer):
        info = np.iinfo(arrays[0].dtype)
        return float(info.min), float(info.max)
    values = np.concatenate([a.astype(np.float64).ravel() for a in arrays])
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
    return next(((a, b) for a, b in _RANGES if a <= low and high <= b), (low, high))


def _difference(served: np.ndarray, trained: np.ndarray, limit: float, stated: str) -> str:
    """What differs between one image's two model inputs ('' if nothing)."""
    if served.shape != trained.shape:
        return f"shape {served.shape} vs {trained.shape}"
    found = []
    if served.dtype != _AS_FED.get(trained.dtype, trained.dtype):
        found.append(f"dtype {served.dtype} vs {trained.dtype}")
    if served.size:
        diff = np.abs(served.astype(np.float64) - trained.astype(np.float64))
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        if diff[worst] > limit:
            found.append(
                f"values differ by up to {diff[worst]:.4g} at pixel "
                f"{tuple(int(i) for i in worst)} ({served[worst]:.4g} vs {trained[worst]:.4g}; "
                f"tolerance {limit:.3g}: {stated})"
            )
    return ", ".join(found)


def check_images(data_dir: str, count: int = 8, split: str = "validation") -> list[bytes]:
    """``count`` encoded images of ``<data_dir>/<split>-*`` drawn across classes.

    With an ``estimax-convert`` ``manifest.json``, one image of each of ``count`` classes spread
    evenly over the label order (every class, and more than one of some, when there are fewer
    classes than ``count``), read from the shards that hold them. Without one (TFRecords of the
    original's converters), the shards are read in turn, one record of each, and images of a
    class not yet drawn are taken first.

    Raises:
      FileNotFoundError: no ``<split>-*`` shards in ``data_dir``.
    """
    files = tfrecord.list_files(posixpath.join(data_dir, f"{split}-*"))
    quotas, holders = _manifest_plan(data_dir, split, count)
    if holders is not None:
        files = [f for f in files if posixpath.basename(f) in holders]
    picked: dict[int | None, list[bytes]] = {}
    spare: list[bytes] = []
    wanted = sum(quotas.values()) if quotas else count
    # Bounds the reading where nothing says where the classes are.
    limit = None if quotas else max(1000, 100 * count)
    for n, record in enumerate(_round_robin(files), start=1):
        parsed = example.decode_example(record)
        label = int(parsed["image/class/label"][0]) if "image/class/label" in parsed else None
        image = parsed["image/encoded"][0]
        taken = picked.setdefault(label, [])
        if len(taken) < (quotas.get(label, 0) if quotas else 1):
            taken.append(image)
        elif len(spare) < count:
            spare.append(image)
        if sum(map(len, picked.values())) == wanted or n == limit:
            break
    order = sorted(picked, key=lambda k: (k is None, k))
    drawn = [
        image
        for group in itertools.zip_longest(*(picked[k] for k in order))
        for image in group
        if image is not None
    ]  # one of each class in label order, then a second of each...
    return (drawn + spare)[:count]


def _manifest_plan(
    data_dir: str, split: str, count: int
) -> tuple[dict[int | None, int], set[str] | None]:
    """``({label: images to draw}, names of the shards holding them)`` from the converter's
    manifest; ``({}, None)`` without one (or one without per-shard class counts)."""
    fs, root = fsspec.core.url_to_fs(posixpath.join(data_dir, MANIFEST))
    if not fs.exists(root):
        return {}, None
    with fs.open(root, "r") as f:
        manifest = json.load(f)
    shards = {n: s for n, s in manifest.get("shards", {}).items() if s.get("split") == split}
    if not shards or any("classes" not in s for s in shards.values()):
        return {}, None
    label_map = manifest["label_map"]
    present = sorted(
        {name for s in shards.values() for name, n in s["classes"].items() if n},
        key=lambda name: label_map[name],
    )
    if not present:
        return {}, None
    if len(present) > count:  # spread over the label order, first and last included
        present = [present[int(i)] for i in np.linspace(0, len(present) - 1, count).round()]
    quotas: dict[int | None, int] = {
        int(label_map[name]): count // len(present) + (k < count % len(present))
        for k, name in enumerate(present)
    }
    holders = {n for n, s in shards.items() if any(s["classes"].get(c) for c in present)}
    return quotas, holders


def _round_robin(files: list[str]) -> Iterator[bytes]:
    """The records of ``files``, one of each in turn (each file opened when first read)."""
    readers: list[Iterator[bytes]] = [iter(tfrecord.read_records(f)) for f in files]
    while readers:
        for reader in list(readers):
            record = next(reader, None)
            if record is None:
                readers.remove(reader)
            else:
                yield record
