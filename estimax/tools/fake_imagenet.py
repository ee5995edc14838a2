"""``fake_imagenet``, made locally: random JPEGs in the converter's shards, any number of them.

The seeds' ``gs://cloud-tpu-test-datasets/fake_imagenet`` is ImageNet-shaped TFRecords of random
images (``train-00000-of-01024`` ..., ``validation-00000-of-00128``) for trying the programs
without the real data. This writes the same file names and the converter's fields (docs/original.md
§8.1) with labels uniform in ``1..num_classes`` and synthetic synsets ``n%08d % label`` (so the
sorted-synset rule maps them back to the same labels), through the same shard writer, manifest
and ``verify`` as real conversions.

Each image is a function of ``(seed, split, index)`` alone (it is generated inside the worker that
writes its shard), so output is identical for any number of workers and resumable.
"""

from __future__ import annotations

import numpy as np

from estimax.tools.convert_sources import Dataset, Item

__all__ = ["FAKE_PREFIX", "fake_dataset", "fake_jpeg"]

FAKE_PREFIX = "fake-imagenet:"
_SPLIT_IDS = {"train": 0, "validation": 1}


def fake_dataset(
    num_train: int,
    num_validation: int,
    num_classes: int = 1000,
    seed: int = 0,
    min_size: int = 96,
    max_size: int = 320,
) -> Dataset:
    """The fake items: labels drawn with ``seed``; the images are made when shards are written.

    Args:
      num_train, num_validation: examples per split (0 leaves a split out).
      num_classes: labels are uniform in ``1..num_classes``.
      seed: labels and pixels.
      min_size, max_size: image heights and widths are uniform in this range (pixels).
    """
    if not 1 <= min_size <= max_size:
        raise ValueError(f"need 1 <= min_size <= max_size, got {min_size}, {max_size}")
    label_map = {f"n{k:08d}": k for k in range(1, num_classes + 1)}
    splits = {}
    for split, n in (("train", num_train), ("validation", num_validation)):
        if n <= 0:
            continue
        rng = np.random.default_rng([seed, _SPLIT_IDS[split]])
        labels = rng.integers(1, num_classes + 1, size=n)
        splits[split] = [
            Item(
                f"{FAKE_PREFIX}{seed}:{min_size}:{max_size}:{split}/{split}_{i:08d}.JPEG",
                int(lab),
                f"n{int(lab):08d}",
            )
            for i, lab in enumerate(labels)
        ]
    if not splits:
        raise ValueError("fake-imagenet needs --train_examples or --validation_examples > 0")
    return Dataset(splits, label_map)


def fake_jpeg(path: str) -> bytes:
    """The JPEG bytes of a fake item's ``path`` (made by :func:`fake_dataset`).

    A smooth random colour field (8x8 random colours upsampled) plus noise: JPEG sizes and
    decode costs in the range of real photos rather than of flat or pure-noise images.
    """
    import cv2
    import simplejpeg

    seed, min_size, max_size, rest = path[len(FAKE_PREFIX) :].split(":", 3)
    split, name = rest.split("/")
    index = int(name.rsplit("_", 1)[1].split(".")[0])
    rng = np.random.default_rng([int(seed), _SPLIT_IDS[split], index, 1])
    h, w = (int(v) for v in rng.integers(int(min_size), int(max_size) + 1, size=2))
    coarse = rng.integers(0, 256, size=(8, 8, 3)).astype(np.float32)
    img = np.asarray(cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC), np.float32)
    img += rng.normal(0, 8, size=img.shape)
    img = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return simplejpeg.encode_jpeg(img, quality=90, colorspace="RGB", colorsubsampling="420")
