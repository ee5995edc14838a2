"""Conversion throughput: ``estimax-convert imagenet`` vs a TensorFlow port of imagenet_to_gcs.py.

Input: the realistic ImageNet-sized JPEGs of ``bench/make_jpegs.py`` (``bench/data/imagenet/
jpegs``, ~80 KiB, ~470x354), laid out as a raw ImageNet tree under ``bench/data/convert_raw``
(hard links, each picture twice under two names to reach a few thousand files): ``train/<16
synsets>/*.JPEG``, ``validation/*.JPEG``, ``synset_labels.txt``.

Sides, each run as a fresh process, timed wall-clock (process start to exit, imports included):

* ``tf``: what ``imagenet_to_gcs.py`` (TPU r1.8, its Python 3 port) does, in bench/.venv-tf:
  one process, a ``tf.compat.v1.Session`` ``ImageCoder`` decoding every image with
  ``decode_jpeg(channels=3)`` for its height/width, tf.Example built with ``tf.train``, written
  with ``tf.io.TFRecordWriter``, shards in sequence (``chunksize = ceil(n / num_shards)``).
  It also prints its own time without imports/session setup (``tf_core``).
* ``estimax-<check>``: ``python -m estimax.tools.convert imagenet --num_workers=2`` with
  ``--check=scaled`` (default), ``decode`` (full decode, as the original) and ``header``.

Rounds are interleaved; medians and ratios to ``tf`` go to ``bench/results/convert.{json,md}``.

    .venv/bin/python bench/convert.py [--rounds=3] [--copies=2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JPEGS = os.path.join(REPO, "bench/data/imagenet/jpegs")
RAW = os.path.join(REPO, "bench/data/convert_raw")
OUT = "/tmp/estimax_bench_convert"
TF_PYTHON = os.path.join(REPO, "bench/.venv-tf/bin/python")
NUM_SYNSETS = 16
TRAIN_SHARDS, VALIDATION_SHARDS = 16, 4

# --------------------------------------------------------------- the TensorFlow side (.venv-tf)

TF_SCRIPT = r"""
import math, os, random, sys, time
t_start = time.perf_counter()
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
raw, out, train_shards, val_shards = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

class ImageCoder:  # imagenet_to_gcs.py's, TF1 graph + session
    def __init__(self):
        v1 = tf.compat.v1
        self._sess = v1.Session()
        self._png_data = v1.placeholder(dtype=tf.string)
        image = tf.image.decode_png(self._png_data, channels=3)
        self._png_to_jpeg = tf.image.encode_jpeg(image, format="rgb", quality=100)
        self._cmyk_data = v1.placeholder(dtype=tf.string)
        image = tf.image.decode_jpeg(self._cmyk_data, channels=0)
        self._cmyk_to_rgb = tf.image.encode_jpeg(image, format="rgb", quality=100)
        self._decode_jpeg_data = v1.placeholder(dtype=tf.string)
        self._decode_jpeg = tf.image.decode_jpeg(self._decode_jpeg_data, channels=3)
    def png_to_jpeg(self, d): return self._sess.run(self._png_to_jpeg, {self._png_data: d})
    def cmyk_to_rgb(self, d): return self._sess.run(self._cmyk_to_rgb, {self._cmyk_data: d})
    def decode_jpeg(self, d): return self._sess.run(self._decode_jpeg, {self._decode_jpeg_data: d})

def _is_png(f): return "n02105855_2933.JPEG" in f
def _is_cmyk(f): return os.path.basename(f) in ()  # the original's 22-name list; none here

def _int64(v): return tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))
def _bytes(v): return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

def _convert_to_example(filename, image_buffer, label, synset, height, width):
    return tf.train.Example(features=tf.train.Features(feature={
        "image/height": _int64(height), "image/width": _int64(width),
        "image/colorspace": _bytes(b"RGB"), "image/channels": _int64(3),
        "image/class/label": _int64(label), "image/class/synset": _bytes(synset.encode()),
        "image/format": _bytes(b"JPEG"),
        "image/filename": _bytes(os.path.basename(filename).encode()),
        "image/encoded": _bytes(image_buffer)}))

def _process_image(filename, coder):
    with tf.io.gfile.GFile(filename, "rb") as f:
        image_data = f.read()
    if _is_png(filename):
        image_data = coder.png_to_jpeg(image_data)
    elif _is_cmyk(filename):
        image_data = coder.cmyk_to_rgb(image_data)
    image = coder.decode_jpeg(image_data)
    assert len(image.shape) == 3
    height, width = image.shape[0], image.shape[1]
    assert image.shape[2] == 3
    return image_data, height, width

def _process_dataset(filenames, synsets, labels, output_directory, prefix, num_shards, coder):
    chunksize = int(math.ceil(len(filenames) / num_shards))
    for shard in range(num_shards):
        chunk_files = filenames[shard * chunksize:(shard + 1) * chunksize]
        chunk_synsets = synsets[shard * chunksize:(shard + 1) * chunksize]
        output_file = os.path.join(
            output_directory, "%s-%.5d-of-%.5d" % (prefix, shard, num_shards))
        with tf.io.TFRecordWriter(output_file) as writer:
            for filename, synset in zip(chunk_files, chunk_synsets):
                image_buffer, height, width = _process_image(filename, coder)
                ex = _convert_to_example(
                    filename, image_buffer, labels[synset], synset, height, width)
                writer.write(ex.SerializeToString())

train_files = tf.io.gfile.glob(os.path.join(raw, "train", "*", "*.JPEG"))
train_synsets = [os.path.basename(os.path.dirname(f)) for f in train_files]
idx = list(range(len(train_files))); random.seed(0); random.shuffle(idx)  # (we shuffle for real)
train_files = [train_files[i] for i in idx]; train_synsets = [train_synsets[i] for i in idx]
val_files = sorted(tf.io.gfile.glob(os.path.join(raw, "validation", "*.JPEG")))
val_synsets = open(os.path.join(raw, "synset_labels.txt")).read().split()
labels = {v: k + 1 for k, v in enumerate(sorted(set(val_synsets + train_synsets)))}
os.makedirs(out, exist_ok=True)
coder = ImageCoder()
t_core = time.perf_counter()
_process_dataset(train_files, train_synsets, labels, out, "train", train_shards, coder)
_process_dataset(val_files, val_synsets, labels, out, "validation", val_shards, coder)
print("TF_CORE_SECONDS", time.perf_counter() - t_core, len(train_files) + len(val_files))
"""


def make_raw_tree(copies: int) -> int:
    """Hard-links the benchmark JPEGs into a raw ImageNet tree; returns the image count."""
    names = sorted(n for n in os.listdir(JPEGS) if n.endswith(".jpg"))
    if not names:
        sys.exit(
            f"no JPEGs in {JPEGS}: run bench/.venv-tf/bin/python bench/make_jpegs.py "
            "--output_dir=bench/data/imagenet --num_images=2048 first"
        )
    shutil.rmtree(RAW, ignore_errors=True)
    files = [(n, c) for c in range(copies) for n in names]
    num_val = len(files) // 8
    val_synsets = []
    for i, (n, c) in enumerate(files):
        synset = f"n{1000 + i % NUM_SYNSETS:08d}"
        if i < num_val:
            dst = os.path.join(RAW, "validation", f"ILSVRC2012_val_{i + 1:08d}.JPEG")
            val_synsets.append(synset)
        else:
            dst = os.path.join(RAW, "train", synset, f"{synset}_{c}{n[3:-4]}.JPEG")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(os.path.join(JPEGS, n), dst)
        except OSError:
            shutil.copy(os.path.join(JPEGS, n), dst)
    with open(os.path.join(RAW, "synset_labels.txt"), "w") as f:
        f.write("\n".join(val_synsets) + "\n")
    return len(files)


def run_side(side: str, out: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    if side == "tf":
        cmd = [TF_PYTHON, "-c", TF_SCRIPT, RAW, out, str(TRAIN_SHARDS), str(VALIDATION_SHARDS)]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    else:
        check = side.split("-", 1)[1]
        cmd = [
            sys.executable,
            "-m",
            "estimax.tools.convert",
            "imagenet",
            f"--raw_data_dir={RAW}",
            f"--output_dir={out}",
            f"--train_shards={TRAIN_SHARDS}",
            f"--validation_shards={VALIDATION_SHARDS}",
            "--num_workers=2",
            f"--check={check}",
            "--no_progress",
        ]
        env = dict(os.environ, PYTHONPATH=REPO)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{proc.stderr[-3000:]}")
    # CPU seconds of the side's processes (workers included): what it costs independent of how
    # much of the shared machine it got.
    result = {"seconds": seconds, "cpu_seconds": cpu}
    for line in proc.stdout.splitlines():
        if line.startswith("TF_CORE_SECONDS"):
            result["core_seconds"] = float(line.split()[1])
    return result


def check_same_examples(n: int) -> None:
    """Both sides wrote the same (filename, label, synset, bytes) set: same work was timed."""
    sys.path.insert(0, REPO)
    from estimax.data import tfrecord
    from estimax.data.example import decode_example

    def examples(d):
        out = set()
        for p in tfrecord.list_files(os.path.join(d, "*-of-*")):
            for r in tfrecord.read_records(p):
                e = decode_example(r)
                out.add(
                    (
                        e["image/filename"][0],
                        int(e["image/class/label"][0]),
                        e["image/class/synset"][0],
                        int(e["image/height"][0]),
                        int(e["image/width"][0]),
                        e["image/encoded"][0],
                    )
                )
        return out

    a, b = examples(OUT + "-tf"), examples(OUT + "-estimax-scaled")
    assert len(a) == n and a == b, f"the sides wrote different examples ({len(a)}, {len(b)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--copies", type=int, default=2, help="each JPEG appears this many times")
    p.add_argument("--sides", default="tf,estimax-scaled,estimax-decode,estimax-header")
    a = p.parse_args()
    if not os.path.exists(TF_PYTHON):
        sys.exit(
            f"{TF_PYTHON} missing: python3 -m venv bench/.venv-tf && "
            "bench/.venv-tf/bin/pip install tensorflow-cpu pillow scikit-learn"
        )
    n = make_raw_tree(a.copies)
    sides = a.sides.split(",")
    times: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(a.rounds):
        for s in sides if r % 2 == 0 else sides[::-1]:
            res = run_side(s, f"{OUT}-{s}")
            times[s].append(res)
            print(
                f"round {r} {s}: {res['seconds']:.1f} s ({n / res['seconds']:.0f} img/s), "
                f"cpu {res['cpu_seconds']:.1f} s"
                + (f", core {res['core_seconds']:.1f} s" if "core_seconds" in res else ""),
                flush=True,
            )
    if "tf" in sides and "estimax-scaled" in sides:
        check_same_examples(n)
    med = {s: statistics.median(t["seconds"] for t in ts) for s, ts in times.items()}
    results = {
        "images": n,
        "train_shards": TRAIN_SHARDS,
        "validation_shards": VALIDATION_SHARDS,
        "rounds": a.rounds,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "note": "2 cores shared with 4 other agents (noisy); wall-clock per process, imports "
        "included; medians of interleaved rounds",
        "median_seconds": med,
        "median_images_per_sec": {s: n / v for s, v in med.items()},
        "all_seconds": {s: [t["seconds"] for t in ts] for s, ts in times.items()},
        "median_cpu_seconds": {
            s: statistics.median(t["cpu_seconds"] for t in ts) for s, ts in times.items()
        },
    }
    if "tf" in times:
        core = statistics.median(t["core_seconds"] for t in times["tf"])
        results["tf_core_median_seconds"] = core
        results["tf_core_images_per_sec"] = n / core
        results["speedup_vs_tf"] = {s: med["tf"] / v for s, v in med.items() if s != "tf"}
        results["speedup_vs_tf_core"] = {s: core / v for s, v in med.items() if s != "tf"}
    os.makedirs(os.path.join(REPO, "bench/results"), exist_ok=True)
    with open(os.path.join(REPO, "bench/results/convert.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [
        f"# Conversion throughput ({n} ImageNet-sized JPEGs, {TRAIN_SHARDS}+"
        f"{VALIDATION_SHARDS} shards; machine shared, load avg "
        f"{results['load_average_at_end'][0]:.1f})",
        "",
        "| side | median s | img/s | vs tf (wall) | vs tf core (no imports) | CPU s "
        "(all processes) | img per CPU-s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sides:
        sp = results.get("speedup_vs_tf", {}).get(s)
        spc = results.get("speedup_vs_tf_core", {}).get(s)
        lines.append(
            f"| {s} | {med[s]:.1f} | {n / med[s]:.0f} | "
            f"{f'{sp:.2f}x' if sp else '-'} | {f'{spc:.2f}x' if spc else '-'} | "
            f"{results['median_cpu_seconds'][s]:.1f} | "
            f"{n / results['median_cpu_seconds'][s]:.0f} |"
        )
    if "tf" in times:
        lines.append(
            f"\ntf core (without TF import and session setup): "
            f"{results['tf_core_median_seconds']:.1f} s, "
            f"{results['tf_core_images_per_sec']:.0f} img/s"
        )
    with open(os.path.join(REPO, "bench/results/convert.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
