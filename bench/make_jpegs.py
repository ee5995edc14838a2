"""Makes realistic ImageNet-sized JPEGs for the input-pipeline benchmark.

Runs in the benchmark's TensorFlow venv (bench/.venv-tf: tensorflow-cpu, scikit-learn, pillow),
never in estimax's own environment:

    bench/.venv-tf/bin/python bench/make_jpegs.py --output_dir=bench/data/imagenet

Source pictures: the two real photographs scikit-learn ships (china.jpg, flower.jpg, 640x427).
Each output image is a random crop (40-100% of the side) of one of them, rescaled to an
ImageNet-like size (width 440-500, aspect 0.65-0.85, so ~500x375 at most), randomly flipped, with
sensor-like noise (sigma 14), JPEG quality 90, 4:2:0 (what most ImageNet files are). The noise
is there because rescaled crops are smoother than camera photos and would compress to ~45 KiB
(real ImageNet JPEGs average ~110 KB); entropy-decoding time grows with file size, so too-smooth
files flatter every decoder. With it the files average ~80 KiB at ~470x354.

Writes:
  <output_dir>/jpegs/img_NNNNN.jpg          the raw files (both benchmark sides read these)
  <output_dir>/train-SSSSS-of-NNNNN         tf.Example TFRecord shards in the ImageNet schema
  <output_dir>/validation-SSSSS-of-NNNNN    (seed 004; written by TensorFlow's own writer)
"""

import argparse
import io
import os

import numpy as np
from PIL import Image
from sklearn.datasets import load_sample_images


def make_image(sources: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Returns one [H, W, 3] uint8 picture: crop + rescale + flip + noise of a source photo."""
    src = sources[rng.integers(len(sources))]
    sh, sw = src.shape[:2]
    frac = rng.uniform(0.4, 1.0)
    ch, cw = int(sh * frac), int(sw * frac)
    y, x = rng.integers(0, sh - ch + 1), rng.integers(0, sw - cw + 1)
    crop = Image.fromarray(src[y : y + ch, x : x + cw])
    out_w = int(rng.integers(440, 501))
    out_h = int(round(out_w * rng.uniform(0.65, 0.85)))
    img = np.asarray(crop.resize((out_w, out_h), Image.BICUBIC), dtype=np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = img + rng.normal(0.0, 14.0, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def encode(img: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=quality, subsampling=2)
    return buf.getvalue()


def write_shards(
    output_dir: str, prefix: str, records: list[tuple[bytes, int, int, int, str]], num_shards: int
) -> None:
    """Writes tf.Example shards `prefix-SSSSS-of-NNNNN` with the ImageNet converter's fields."""
    import tensorflow as tf  # only here: the JPEG generation itself does not need TF

    def _bytes(v):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    def _int(v):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))

    def _floats(v):
        return tf.train.Feature(float_list=tf.train.FloatList(value=v))

    per_shard = -(-len(records) // num_shards)
    for s in range(num_shards):
        path = os.path.join(output_dir, f"{prefix}-{s:05d}-of-{num_shards:05d}")
        with tf.io.TFRecordWriter(path) as w:
            for data, label, h, wd, name in records[s * per_shard : (s + 1) * per_shard]:
                feats = {
                    "image/height": _int(h),
                    "image/width": _int(wd),
                    "image/colorspace": _bytes(b"RGB"),
                    "image/channels": _int(3),
                    "image/class/label": _int(label),  # 1-based, as the original converter
                    "image/class/synset": _bytes(b"n%08d" % label),
                    "image/class/text": _bytes(b"synthetic class %d" % label),
                    "image/object/bbox/xmin": _floats([]),
                    "image/object/bbox/ymin": _floats([]),
                    "image/object/bbox/xmax": _floats([]),
                    "image/object/bbox/ymax": _floats([]),
                    "image/object/bbox/label": _int(label),
                    "image/format": _bytes(b"JPEG"),
                    "image/filename": _bytes(name.encode()),
                    "image/encoded": _bytes(data),
                }
                ex = tf.train.Example(features=tf.train.Features(feature=feats))
                w.write(ex.SerializeToString())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default="bench/data/imagenet")
    p.add_argument("--num_images", type=int, default=512)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--num_shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    rng = np.random.default_rng(a.seed)
    sources = list(load_sample_images().images)
    os.makedirs(os.path.join(a.output_dir, "jpegs"), exist_ok=True)
    records = []
    for i in range(a.num_images):
        img = make_image(sources, rng)
        data = encode(img, a.quality)
        name = f"img_{i:05d}.jpg"
        with open(os.path.join(a.output_dir, "jpegs", name), "wb") as f:
            f.write(data)
        records.append((data, int(rng.integers(1, 1001)), img.shape[0], img.shape[1], name))
    sizes = np.array([len(r[0]) for r in records])
    dims = np.array([(r[2], r[3]) for r in records])
    half = len(records) // 2
    write_shards(a.output_dir, "train", records[:half], a.num_shards)
    write_shards(a.output_dir, "validation", records[half:], a.num_shards)
    print(
        f"wrote {len(records)} JPEGs to {a.output_dir}: mean {sizes.mean() / 1024:.1f} KiB, "
        f"mean size {dims.mean(0).round().astype(int).tolist()} (h, w)"
    )


if __name__ == "__main__":
    main()
