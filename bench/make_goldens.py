"""Produces the golden arrays of tests/test_preprocessing.py with TensorFlow's own ops (run once).

Runs in the benchmark's TensorFlow venv only (TensorFlow is never an estimax dependency):

    bench/.venv-tf/bin/python bench/make_goldens.py --output_dir=tests/data/preprocessing

Source images: small crops of the two real photos scikit-learn ships, re-encoded as JPEG q90
(one 4:2:0 colour landscape, one 4:4:4 colour portrait, one grayscale), committed next to the
goldens. For each, with the original's ops (docs/original.md §4):

  decoded_crop        tf.image.decode_and_crop_jpeg of the ResNet eval window (uint8, exact)
  resnet_legacy       ... + tf.compat.v1.image.resize_bicubic (TF1 legacy sampling, the original)
  resnet_halfpixel    ... + resize_bicubic(half_pixel_centers=True) (TF2-style sampling)
  inception_legacy    decode_jpeg, convert_image_dtype, central_crop(0.875),
                      resize_bilinear(align_corners=False), (x - 0.5) * 2
  inception_halfpixel the same with half_pixel_centers=True

and, in goldens.json, statistics of tf.image.sample_distorted_bounding_box windows (ResNet and
Inception settings) to compare the sampler's distribution with.

ResNet goldens are stored as the original's float output rounded and clipped to uint8 (estimax's
documented output contract); Inception goldens as float16 (resolution 1e-3 in [-1, 1]). Small
output sizes (ResNet 112, Inception 96) keep the folder under 1 MB; the sources are sized so the
eval windows shrink by ~1.4-1.9x, as ImageNet-sized images do at 224 and 299.
"""

import argparse
import io
import json
import os

import numpy as np
import tensorflow as tf
from PIL import Image
from sklearn.datasets import load_sample_images

RESNET_SIZE = 112
INCEPTION_SIZE = 96
CROP_PADDING = 32


def make_sources() -> dict[str, bytes]:
    china, flower = load_sample_images().images  # [427, 640, 3] uint8 each
    out = {}

    def enc(arr, **kw):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=90, **kw)
        return buf.getvalue()

    land = Image.fromarray(china[60:360, 100:500]).resize((280, 210), Image.BICUBIC)
    out["landscape_420"] = enc(np.asarray(land), subsampling=2)
    port = Image.fromarray(flower[20:420, 250:520]).resize((210, 300), Image.BICUBIC)
    out["portrait_444"] = enc(np.asarray(port), subsampling=0)
    gray = Image.fromarray(flower[100:400, 0:300]).convert("L").resize((220, 220), Image.BICUBIC)
    out["gray"] = enc(np.asarray(gray))
    return out


def resnet_eval(data: bytes, half_pixel: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """resnet_preprocessing._decode_and_center_crop, verbatim in TF ops."""
    shape = tf.image.extract_jpeg_shape(data)
    h, w = shape[0], shape[1]
    crop = tf.cast(
        (RESNET_SIZE / (RESNET_SIZE + CROP_PADDING)) * tf.cast(tf.minimum(h, w), tf.float32),
        tf.int32,
    )
    oy = ((h - crop) + 1) // 2
    ox = ((w - crop) + 1) // 2
    window = tf.stack([oy, ox, crop, crop])
    image = tf.image.decode_and_crop_jpeg(data, window, channels=3)
    resized = tf.compat.v1.image.resize_bicubic(
        [image], [RESNET_SIZE, RESNET_SIZE], align_corners=False, half_pixel_centers=half_pixel
    )[0]
    return image.numpy(), resized.numpy(), [int(v) for v in window.numpy()]


def inception_eval(data: bytes, half_pixel: bool) -> np.ndarray:
    """inception_preprocessing.preprocess_for_eval (central_fraction 0.875), in TF ops."""
    image = tf.image.decode_jpeg(data, channels=3)
    image = tf.image.convert_image_dtype(image, tf.float32)
    image = tf.image.central_crop(image, central_fraction=0.875)
    image = tf.compat.v1.image.resize_bilinear(
        [image],
        [INCEPTION_SIZE, INCEPTION_SIZE],
        align_corners=False,
        half_pixel_centers=half_pixel,
    )[0]
    return ((image - 0.5) * 2.0).numpy()


def sampler_stats(
    shape: tuple[int, int], area_range: tuple[float, float], max_attempts: int, n: int = 3000
) -> dict[str, float]:
    """Statistics of tf.image.sample_distorted_bounding_box windows over `n` draws.

    The RNGs differ, so the test compares distributions: mean area fraction, mean aspect ratio
    (w/h) of successful draws and the rate of failed sampling (window == whole image), each
    with its standard error.
    """
    h, w = shape
    boxes = tf.constant([[[0.0, 0.0, 1.0, 1.0]]])
    tf.random.set_seed(0)
    areas, aspects, failed = [], [], 0
    for _ in range(n):
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            [h, w, 3],
            bounding_boxes=boxes,
            min_object_covered=0.1,
            aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=area_range,
            max_attempts=max_attempts,
            use_image_if_no_bounding_boxes=True,
        )
        ch, cw = int(size[0]), int(size[1])
        if (ch, cw) == (h, w):
            failed += 1
            continue
        areas.append(ch * cw / (h * w))
        aspects.append(cw / ch)
    areas, aspects = np.array(areas), np.array(aspects)
    rate = failed / n
    return {
        "shape": [h, w],
        "area_range": list(area_range),
        "max_attempts": max_attempts,
        "n": n,
        "mean_area": float(areas.mean()),
        "se_area": float(areas.std() / np.sqrt(len(areas))),
        "mean_aspect": float(aspects.mean()),
        "se_aspect": float(aspects.std() / np.sqrt(len(aspects))),
        "fail_rate": rate,
        "se_fail_rate": float(np.sqrt(max(rate * (1 - rate), 1e-4) / n)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default="tests/data/preprocessing")
    a = p.parse_args()
    os.makedirs(a.output_dir, exist_ok=True)
    meta = {
        "resnet_image_size": RESNET_SIZE,
        "inception_image_size": INCEPTION_SIZE,
        "tensorflow": tf.__version__,
        "images": {},
    }
    for name, data in make_sources().items():
        with open(os.path.join(a.output_dir, f"{name}.jpg"), "wb") as f:
            f.write(data)
        crop, legacy, window = resnet_eval(data, half_pixel=False)
        _, halfpix, _ = resnet_eval(data, half_pixel=True)
        arrays = {
            "decoded_crop": crop,
            "resnet_legacy": np.clip(np.rint(legacy), 0, 255).astype(np.uint8),
            "resnet_halfpixel": np.clip(np.rint(halfpix), 0, 255).astype(np.uint8),
            "inception_legacy": inception_eval(data, False).astype(np.float16),
            "inception_halfpixel": inception_eval(data, True).astype(np.float16),
        }
        np.savez_compressed(os.path.join(a.output_dir, f"{name}.npz"), **arrays)
        meta["images"][name] = {"window_yxhw": window, "bytes": len(data)}
    meta["sampler"] = [
        sampler_stats((375, 500), (0.08, 1.0), 10),
        sampler_stats((60, 400), (0.08, 1.0), 10),
        sampler_stats((40, 500), (0.08, 1.0), 10),
        sampler_stats((299, 299), (0.05, 1.0), 100),
    ]
    with open(os.path.join(a.output_dir, "goldens.json"), "w") as f:
        json.dump(meta, f, indent=1)
    total = sum(os.path.getsize(os.path.join(a.output_dir, n)) for n in os.listdir(a.output_dir))
    print(f"wrote goldens to {a.output_dir} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
