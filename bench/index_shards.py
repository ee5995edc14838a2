"""Bucket shards without index files (as TensorFlow's tools write them): what a training job pulls
before its first batch and after, with and without ``estimax-convert index``; and the command.

Setup as ``bench/input_pipeline.py --gcs``: fake-gcs-server on loopback behind a loopback proxy
that holds every request 0 or 20 ms and counts the bytes it passes (``PROXY_CHILD`` there).
Data: 8 TFRecord shards of ImageNet-like JPEGs (~70 KB, ~500x375 q90; 128 distinct images reused
with distinct labels), written without index files. Each training run is a child process:
``imagenet.input_fn`` (train, 224 px, batch 64, 2 process workers), timed to its first batch,
then 8 warm-up batches and ``--images`` timed ones.

    /work/main/.venv/bin/python bench/index_shards.py            # from the repository root

Writes bench/results/index_shards.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

import input_pipeline as ip  # noqa: E402 - the emulator, the proxy, the JPEG maker

BATCH = 64
BUCKET_DIR = "gs://bench-data/imagenet"


def make_shards(data_dir: str, shards: int, per_shard: int) -> str:
    """``shards`` TFRecord files of ``per_shard`` tf.Examples, no index files; made once."""
    import glob

    from estimax.data import example, tfrecord

    done = os.path.join(data_dir, f"DONE-{shards}x{per_shard}")
    if os.path.exists(done):
        return data_dir
    jpegs_dir = ip.make_host_data(os.path.join(data_dir, "jpegs"), num_images=128, num_shards=1)
    jpegs = [
        example.decode_example(r)["image/encoded"]
        for f in sorted(glob.glob(os.path.join(jpegs_dir, "train-*")))
        if not f.endswith(".idx")
        for r in tfrecord.read_records(f)
    ]
    for s in range(shards):
        path = os.path.join(data_dir, tfrecord.sharded_name("train", s, shards))
        with tfrecord.TFRecordWriter(path) as w:  # no index: as TensorFlow writes them
            for i in range(per_shard):
                k = s * per_shard + i
                w.write(
                    example.encode_example(
                        {"image/encoded": jpegs[k % len(jpegs)], "image/class/label": 1 + k % 1000}
                    )
                )
    open(done, "w").close()
    return data_dir


def worker(a: argparse.Namespace) -> dict:
    """In a child (STORAGE_EMULATOR_HOST = the proxy): bytes and time to the first batch, then
    images/s and bytes over ``a.images`` images after 8 warm-up batches."""
    import logging

    from estimax.data import imagenet, tfrecord

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    files = tfrecord.list_files(imagenet.file_pattern(a.data_dir, True))
    del files  # the listing, before the counts
    r0, b0 = ip._settled_stats(a.stats)  # noqa: SLF001
    t0 = time.perf_counter()
    fn = imagenet.input_fn(a.data_dir, True, image_size=224, worker_type="process",
                           num_parallel_calls=2, seed=0)  # fmt: skip
    it = iter(fn({"batch_size": BATCH}))
    next(it)
    first_s = time.perf_counter() - t0
    r1, b1 = ip._settled_stats(a.stats)  # noqa: SLF001
    for _ in range(8):
        next(it)
    r2, b2 = ip._settled_stats(a.stats)  # noqa: SLF001
    n, t1 = 0, time.perf_counter()
    while n < a.images:
        n += len(next(it)[0])
    wall = time.perf_counter() - t1
    it.close()
    r3, b3 = ip._settled_stats(a.stats)  # noqa: SLF001
    return {
        "first_batch_s": first_s,
        "first_batch_bytes": b1 - b0,
        "first_batch_requests": r1 - r0,
        "steady_images": n,
        "steady_bytes": b3 - b2,
        "img_per_s": n / wall,
    }


def headers_worker(a: argparse.Namespace) -> dict:
    """In a child: the other way to index a shard, its record headers only, one ranged read of
    12 bytes after another (each header's place is known only from the previous record's
    length): time, requests and bytes for the first shard, against streaming it whole."""
    import struct

    from estimax import storage
    from estimax.data import shard_index, tfrecord

    path = tfrecord.list_files(a.data_dir + "/train-*")[0]
    fs, fs_path = storage.filesystem(path)
    size = int(fs.size(fs_path))
    r0, b0 = ip._settled_stats(a.stats)  # noqa: SLF001
    t0 = time.perf_counter()
    offset, records = 0, 0
    while offset < size:
        (length,) = struct.unpack("<Q", fs.cat_file(fs_path, offset, offset + 8))
        offset += 12 + length + 4
        records += 1
    headers_s = time.perf_counter() - t0
    r1, b1 = ip._settled_stats(a.stats)  # noqa: SLF001
    t0 = time.perf_counter()
    streamed = shard_index.index_shard(path, write=False)
    stream_s = time.perf_counter() - t0
    r2, b2 = ip._settled_stats(a.stats)  # noqa: SLF001
    assert len(streamed.offsets) - 1 == records
    return {
        "shard_bytes": size,
        "records": records,
        "headers_s": headers_s,
        "headers_requests": r1 - r0,
        "headers_bytes": b1 - b0,
        "stream_s": stream_s,
        "stream_requests": r2 - r1,
        "stream_bytes": b2 - b1,
    }


def _headers_run(url: str, delay: int, tag: str) -> dict:
    proxy, purl, stats = _proxy(url, delay, tag)
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, STORAGE_EMULATOR_HOST=purl)
        cmd = [sys.executable, os.path.abspath(__file__), "--headers_worker"]
        cmd += ["--data_dir", BUCKET_DIR, "--stats", stats]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    finally:
        proxy.kill()
        proxy.wait()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _proxy(url: str, delay: int, tag: str) -> tuple[subprocess.Popen, str, str]:
    port = ip._free_port()  # noqa: SLF001
    stats = f"/tmp/estimax-index-proxy-{os.getpid()}-{tag}"
    proxy = subprocess.Popen(
        [sys.executable, "-c", ip.PROXY_CHILD, url, str(port), str(delay), stats],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proxy.stdout is not None and proxy.stdout.readline().strip() == "ready"
    return proxy, f"http://127.0.0.1:{port}", stats


def _train_run(url: str, delay: int, images: int, tag: str) -> dict:
    proxy, purl, stats = _proxy(url, delay, tag)
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, STORAGE_EMULATOR_HOST=purl)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--data_dir", BUCKET_DIR]
        cmd += ["--images", str(images), "--stats", stats]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    finally:
        proxy.kill()
        proxy.wait()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-3000:]}")
    said = [ln for ln in out.stderr.splitlines() if "shards have no usable" in ln]
    return dict(json.loads(lines[-1]), said=said[0] if said else "")


def _index_run(url: str, delay: int, workers: int, tag: str) -> dict:
    proxy, purl, stats = _proxy(url, delay, tag)
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, STORAGE_EMULATOR_HOST=purl)
        cmd = [sys.executable, "-m", "estimax.tools.convert", "index", f"{BUCKET_DIR}/train-*"]
        cmd += ["--no_progress", f"--num_workers={workers}"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        _, nbytes = ip._settled_stats(stats)  # noqa: SLF001
    finally:
        proxy.kill()
        proxy.wait()
    if out.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-3000:]}")
    return {"wall_s": wall, "bytes": nbytes, "line": out.stdout.strip().splitlines()[-1]}


def _drop_indexes(fs) -> None:
    fs.invalidate_cache()  # the children wrote indexes this process's listing has not seen
    for name in fs.ls("bench-data/imagenet"):
        if name.endswith(".idx"):  # written by earlier versions
            fs.rm(name)
    if fs.exists("bench-data/imagenet/.estimax-index"):  # where indexes go now (issue #51)
        fs.rm("bench-data/imagenet/.estimax-index", recursive=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--headers_worker", action="store_true")
    p.add_argument("--data_dir")
    p.add_argument("--stats")
    p.add_argument("--images", type=int, default=640)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--per_shard", type=int, default=352)
    p.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "index_shards"))
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a)), flush=True)
        return
    if a.headers_worker:
        print(json.dumps(headers_worker(a)), flush=True)
        return
    data_dir = make_shards(os.path.join(ROOT, "bench", "data", "unindexed"), a.shards, a.per_shard)
    emulator, url = ip._gcs_emulator()  # noqa: SLF001
    res: dict = {"load": []}
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = url
        from estimax import storage

        fs, _ = storage.filesystem("gs://bench-data")
        total = 0
        for name in sorted(os.listdir(data_dir)):
            if name.startswith("train-") and name.endswith(f"-of-{a.shards:05d}"):
                fs.put_file(os.path.join(data_dir, name), f"bench-data/imagenet/{name}")
                total += os.path.getsize(os.path.join(data_dir, name))
        res["dataset_bytes"] = total
        res["shards"] = a.shards
        res["records"] = a.shards * a.per_shard
        for delay in (0, 20):
            _drop_indexes(fs)
            v = _train_run(url, delay, a.images, f"unindexed-{delay}")
            assert v["said"], "the shards had indexes"
            res[f"unindexed_{delay}"] = v
            res["load"].append(os.getloadavg()[0])
            print(f"unindexed, {delay} ms: {v}", flush=True)
        for workers in (1, 2):
            _drop_indexes(fs)
            v = _index_run(url, 20, workers, f"index-{workers}")
            res[f"index_cmd_{workers}"] = v
            res["load"].append(os.getloadavg()[0])
            print(f"estimax-convert index, {workers} processes, 20 ms: {v}", flush=True)
        v = _train_run(url, 20, a.images, "indexed-20")
        res["indexed_20"] = v
        res["load"].append(os.getloadavg()[0])
        print(f"indexed, 20 ms: {v}", flush=True)
        v = _headers_run(url, 20, "headers-20")
        res["headers_20"] = v
        res["load"].append(os.getloadavg()[0])
        print(f"one shard's headers vs streaming it, 20 ms: {v}", flush=True)
    finally:
        emulator.kill()
        emulator.wait()
    with open(a.output + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.output + ".md", "w") as f:
        f.write(markdown(res, a))
    print(markdown(res, a))


def markdown(res: dict, a: argparse.Namespace) -> str:
    total = res["dataset_bytes"]
    mean = total / res["records"]
    u0, u20, ix = res["unindexed_0"], res["unindexed_20"], res["indexed_20"]

    def steady(v: dict) -> str:
        return f"{v['steady_bytes'] / (v['steady_images'] * mean):.2f}x"

    lines = [
        "# Unindexed bucket shards and `estimax-convert index` "
        f"({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Machine: x86_64, {os.cpu_count()} cores, shared; load average "
        f"{min(res['load']):.1f}-{max(res['load']):.1f}. One run each. {res['shards']} shards of "
        f"{total / res['shards'] / 1e6:.1f} MB ({res['records']} records of ~{mean / 1e3:.0f} KB "
        "JPEG tf.Examples, written without index files as TensorFlow's tools write them"
        + (
            "; scaled down from the issue's 8 x 100 MB for this 2-core machine: ratios are the "
            "measure"
            if total / res["shards"] < 95e6
            else ""
        )
        + ") on "
        "fake-gcs-server behind a proxy holding every request 0 or 20 ms and counting the bytes it "
        "passes. Training: `imagenet.input_fn` (train, 224 px, batch 64, 2 process workers), one "
        f"process; steady state: {a.images} images after 8 warm-up batches. "
        "`python bench/index_shards.py`.",
        "",
        "| run | to first batch: bytes / data set | time | steady: bytes / used | images/s |",
        "|---|---|---|---|---|",
    ]
    for name, v in (("no index, 0 ms", u0), ("no index, 20 ms", u20),
                    ("after `estimax-convert index`, 20 ms", ix)):  # fmt: skip
        lines.append(
            f"| {name} | {v['first_batch_bytes'] / total:.3f}x | {v['first_batch_s']:.1f} s | "
            f"{steady(v)} | {v['img_per_s']:.0f} |"
        )
    lines += [
        "",
        f"No index at 20 ms: images/s {u20['img_per_s'] / u0['img_per_s']:.2f}x the 0 ms rate.",
        "",
        "| `estimax-convert index 'gs://.../train-*'`, 20 ms | wall | bytes / data set |",
        "|---|---|---|",
    ]
    for w in (1, 2):
        v = res[f"index_cmd_{w}"]
        lines.append(f"| {w} process(es) | {v['wall_s']:.1f} s | {v['bytes'] / total:.3f}x |")
    h = res.get("headers_20")
    if h:
        lines += [
            "",
            f"Indexing one shard ({h['shard_bytes'] / 1e6:.1f} MB, {h['records']} records) at "
            "20 ms a request, the two ways:",
            "",
            "| how | wall | requests | bytes pulled |",
            "|---|---|---|---|",
            "| record headers only, one 8-byte read of each length after another | "
            f"{h['headers_s']:.1f} s | {h['headers_requests']} | "
            f"{h['headers_bytes'] / 1e3:.1f} KB |",
            f"| the shard streamed whole in 8 MiB requests (estimax) | {h['stream_s']:.1f} s | "
            f"{h['stream_requests']} | {h['stream_bytes'] / 1e6:.1f} MB |",
        ]
    lines += ["", f"The start-up line of the unindexed run: `{u20['said']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
