"""estimax-convert's engines on one machine: images/s and CPU-seconds per image for the local
process pool, Beam's FnApiRunner (1 and 2 SDK worker processes, run with .venv-beam's Python:
Beam's pins and JAX's do not share one environment) and Spark (a standalone cluster on
127.0.0.1 of 1 and 2 workers, 1 core each); the driver's own cost (plan, fingerprint, manifest,
the tasks Spark ships) at ImageNet's 1.28 M files from a synthetic listing; and from these a
projection of ImageNet's wall time on N workers.

Each engine converts the same folder of ImageNet-sized JPEGs (~470x354, q90, with sensor-like
noise as bench/make_jpegs.py makes them) twice: a tiny run (2 images) gives the engine's fixed
cost (Python and JVM start-up, executors, scheduling), the full run its total; the marginal rate
is images / (full - tiny). CPU is every process the benchmark starts (driver, pool or JVMs,
Python workers), sampled from /proc every 0.1 s (each process's own user+system time, its last
<0.1 s missed).

    .venv-spark/bin/python bench/convert_engines.py          # from the repository root
    # Beam's interpreter: --beam_python (default .venv-beam/bin/python; `make venv-beam`)

Writes bench/results/convert_engines.json and .md (a section per CPU kind).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import result_sections  # noqa: E402

IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000
_TICK = os.sysconf("SC_CLK_TCK")


def make_images(root: Path, n: int, classes: int = 8) -> None:
    """``n`` JPEGs in ``classes`` folders (made once)."""
    import numpy as np
    from PIL import Image

    done = root / f"DONE-{n}"
    if done.exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    for i in range(n):
        w = int(rng.integers(440, 501))
        h = int(round(w * rng.uniform(0.65, 0.85)))
        img = np.asarray(Image.fromarray(np.roll(base, i, axis=1)).resize((w, h)), np.int16)
        img = np.clip(img + rng.normal(0, 14, img.shape), 0, 255).astype(np.uint8)
        d = root / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(d / f"img_{i:05d}.jpg", quality=90)
    done.touch()


class CpuSampler:
    """CPU seconds of this process's descendants (each one's own utime+stime, its latest
    sample), while ``with`` runs."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, str], float] = {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        parents, cpu = {}, {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(d)] = int(stat[1])
            cpu[int(d)] = ((int(stat[11]) + int(stat[12])) / _TICK, stat[19])  # utime, stime
        me = os.getpid()
        for pid, (secs, start) in cpu.items():
            p = pid
            while p > 1 and p != me:
                p = parents.get(p, 1)
            if p == me and pid != me:
                self.seen[(pid, start)] = secs

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._sample()
        self.before = dict(self.seen)  # processes already running (a cluster's daemons)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def seconds(self) -> float:
        return sum(v - self.before.get(k, 0.0) for k, v in self.seen.items())


class Cluster:
    """A standalone Spark master and ``workers`` workers of 1 core, on 127.0.0.1."""

    def __init__(self, workers: int, tmp: Path):
        import pyspark

        home = os.path.dirname(pyspark.__file__)
        self.env = {
            **os.environ,
            "SPARK_HOME": home,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_SCALA_VERSION": "2.13",
            "PYSPARK_PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT),
        }
        self.cp = os.path.join(home, "jars", "*")
        self.procs: list[subprocess.Popen] = []
        log = self._start(tmp / "master.log", "org.apache.spark.deploy.master.Master")
        self.url = self._wait(log, r"Starting Spark master at (spark://\S+)")[1]
        for w in range(workers):
            work = tmp / f"work{w}"
            work.mkdir()
            self._start(
                tmp / f"worker{w}.log",
                "org.apache.spark.deploy.worker.Worker",
                "--cores",
                "1",
                "--memory",
                "640m",
                "--work-dir",
                str(work),
                self.url,
            )
            self._wait(log, "Registering worker", count=w + 1)

    def _start(self, log: Path, cls: str, *args: str) -> Path:
        with open(log, "w") as out:
            self.procs.append(
                subprocess.Popen(
                    [
                        "java",
                        "-Xmx256m",
                        "-Dspark.master.rest.enabled=false",  # a fixed port (6066)
                        "-cp",
                        self.cp,
                        cls,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        "0",
                        "--webui-port",
                        "0",
                        *args,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            )
        return log

    @staticmethod
    def _wait(log: Path, pattern: str, count: int = 1):
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            found = list(re.finditer(pattern, log.read_text()))
            if len(found) >= count:
                return found[-1]
            time.sleep(0.1)
        raise RuntimeError(f"{log}: no {pattern!r}")

    def stop(self) -> None:
        for p in self.procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def convert(python: str, images: Path, out: Path, engine: list[str], shards: int, env=None):
    """One conversion command; returns (wall s, CPU s of the processes it started)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        python,
        "-m",
        "estimax.tools.convert",
        "folder",
        f"--train_dir={images}",
        f"--output_dir={out}",
        f"--train_shards={shards}",
        "--no_progress",
        *engine,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with CpuSampler() as cpu:
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return wall, cpu.seconds


def engine_rows(args, tmp: Path) -> list[dict]:
    images, tiny = tmp / "images", tmp / "tiny"
    make_images(images, args.images)
    make_images(tiny, 2, classes=1)
    spark_conf = [
        f"--spark_conf={c}"
        for c in (
            "spark.driver.memory=512m",
            "spark.executor.memory=512m",
            "spark.ui.enabled=false",
            "spark.driver.host=127.0.0.1",
            "spark.driver.bindAddress=127.0.0.1",
            f"spark.pyspark.python={sys.executable}",
        )
    ]
    beam_py = Path(args.beam_python)
    runs = [
        ("local, 1 process", sys.executable, ["--num_workers=1"], None),
        ("local, 2 processes", sys.executable, ["--num_workers=2"], None),
    ]
    if beam_py.exists():
        beam = ["--engine=beam", "--runner=DirectRunner"]
        runs += [
            (
                f"Beam FnApiRunner, {w} worker{'s' * (w > 1)}",
                str(beam_py),
                [*beam, f"--num_workers={w}"],
                None,
            )
            for w in (1, 2)
        ]
    runs += [
        (
            f"Spark standalone, {w} worker{'s' * (w > 1)} x 1 core",
            sys.executable,
            ["--engine=spark", *spark_conf],
            w,
        )
        for w in (1, 2)
    ]
    rows = []
    for name, python, engine, workers in runs:
        cluster = Cluster(workers, Path(tempfile.mkdtemp(dir=tmp))) if workers else None
        try:
            extra = [f"--spark_master={cluster.url}"] if cluster else []
            load = os.getloadavg()[0]
            fixed = convert(python, tiny, tmp / "out", [*engine, *extra], 2)
            full = convert(python, images, tmp / "out", [*engine, *extra], args.shards)
        finally:
            if cluster:
                cluster.stop()
        marginal_s = max(full[0] - fixed[0], 1e-9)
        rows.append(
            {
                "engine": name,
                "images": args.images,
                "wall_s": full[0],
                "cpu_s": full[1],
                "fixed_wall_s": fixed[0],
                "fixed_cpu_s": fixed[1],
                "img_per_s": args.images / full[0],
                "marginal_img_per_s": args.images / marginal_s,
                "cpu_s_per_img": full[1] / args.images,
                "marginal_cpu_s_per_img": max(full[1] - fixed[1], 0.0) / args.images,
                "load_before": load,
                "load_after": os.getloadavg()[0],
            }
        )
        print(rows[-1], flush=True)
    if not beam_py.exists():
        rows.append({"engine": "Beam FnApiRunner", "missing": f"no {beam_py} (make venv-beam)"})
    return rows


def driver_cost(tmp: Path, train_shards: int = 1024, val_shards: int = 128) -> dict:
    """The driver's work for ImageNet's file count, from a synthetic listing (no files)."""
    import pickle

    from estimax.tools import convert_shards, convert_sources

    synsets = [f"n{k:08d}" for k in range(1000)]
    label_map = {s: k + 1 for k, s in enumerate(synsets)}
    steps: dict[str, float] = {}

    def step(name: str, t: tuple[float, float]) -> None:
        steps[f"{name}_s"] = time.perf_counter() - t[0]
        steps[f"{name}_cpu_s"] = time.process_time() - t[1]

    t = _now()
    train = [
        convert_sources.Item(
            f"gs://bucket/raw/train/{synsets[i % 1000]}/{synsets[i % 1000]}_{i}.JPEG",
            i % 1000 + 1,
            synsets[i % 1000],
        )
        for i in range(IMAGENET_TRAIN)
    ]
    val = [
        convert_sources.Item(
            f"gs://bucket/raw/validation/ILSVRC2012_val_{i + 1:08d}.JPEG",
            i % 1000 + 1,
            synsets[i % 1000],
        )
        for i in range(IMAGENET_VAL)
    ]
    step("listing", t)
    t = _now()
    train = convert_sources.shuffle_train(train, 0)
    step("shuffle", t)
    ds = convert_sources.Dataset({"train": train, "validation": val}, label_map)
    out = tmp / "driver"
    t = _now()
    plan = convert_shards.plan_conversion(
        ds, str(out), {"train": train_shards, "validation": val_shards}
    )
    step("plan", t)
    t = _now()
    shipped = len(pickle.dumps(plan.todo, protocol=pickle.HIGHEST_PROTOCOL))
    step("pickle_tasks", t)
    results = [
        {
            "name": task.name,
            "split": task.split,
            "index": task.index,
            "num_examples": len(task.items),
            "bytes": 140 << 20,
            "sha256": "0" * 64,
            "skipped": [],
            "fixed": [],
            "classes": convert_shards.written_classes(task.items, []),
        }
        for task in plan.todo
    ]
    t = _now()
    convert_shards.finish_manifest(results, plan.manifest.to_json(), str(out), len(plan.tasks))
    step("manifest", t)
    return {
        "files": IMAGENET_TRAIN + IMAGENET_VAL,
        "shards": len(plan.tasks),
        "tasks_mb": shipped / 1e6,
        "manifest_mb": (out / "manifest.json").stat().st_size / 1e6,
        **steps,
    }


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def report(rows: list[dict], driver: dict, args) -> str:
    measured = [r for r in rows if "missing" not in r]
    beam = any(r["engine"].startswith("Beam") for r in measured)
    lines = [
        f"# estimax-convert engines: {args.images} JPEGs (~470x354 q90) into {args.shards} shards",
        "",
        f"Machine: {result_sections.cpu_kind()}, {os.cpu_count()} cores shared with other jobs; "
        f"load average {min(r['load_before'] for r in measured):.1f}-"
        f"{max(r['load_after'] for r in measured):.1f} during the runs. One run each; the "
        "default check (`--check=scaled`).",
        "",
        f"Command: `{_command()}`" + (f" (Beam: `{_shown(args.beam_python)}`)" if beam else ""),
        "",
        "| engine | wall s | img/s | fixed cost s (2 images) | marginal img/s | CPU s | "
        "CPU s per image | marginal CPU s per image |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['engine']} | not measured: {r['missing']} | | | | | | |")
            continue
        rate = f"{r['marginal_img_per_s']:.0f}" if _resolved(r, "wall_s") else "n/a (noise)"
        cpu = (
            f"{r['marginal_cpu_s_per_img'] * 1e3:.1f} ms"
            if _resolved(r, "cpu_s")
            else "n/a (noise)"
        )
        lines.append(
            f"| {r['engine']} | {r['wall_s']:.1f} | {r['img_per_s']:.0f} | "
            f"{r['fixed_wall_s']:.1f} | {rate} | {r['cpu_s']:.1f} | "
            f"{r['cpu_s_per_img'] * 1e3:.1f} ms | {cpu} |"
        )
    lines += [
        "",
        "Marginal: (full run - 2-image run) / images. n/a (noise): the 2-image run cost as much "
        "as the full one or more, i.e. the start-up's run-to-run spread (JVMs starting at this "
        "load) exceeds the images' own work; a run with many more images resolves it.",
    ]
    d = driver
    lines += [
        "",
        f"## The driver at ImageNet's size ({d['files']:,} files, {d['shards']} shards, "
        "synthetic listing)",
        "",
        "CPU seconds of the driver's process, and wall seconds on this loaded machine:",
        "",
        "| step | CPU s | wall s |",
        "|---|---|---|",
    ]
    for key, what in (
        ("listing", "the listing as Items (in place of listing a bucket)"),
        ("shuffle", "the seeded shuffle of the training list"),
        ("plan", "plan: files -> shards, fingerprint, manifest prepared and saved"),
        ("pickle_tasks", f"the shard tasks pickled, as Spark ships them ({d['tasks_mb']:.0f} MB)"),
        ("manifest", f"the final manifest from {d['shards']} results ({d['manifest_mb']:.1f} MB)"),
    ):
        lines.append(f"| {what} | {d[key + '_cpu_s']:.1f} | {d[key + '_s']:.1f} |")
    lines += [
        "",
        "Listing a real bucket adds its own time (fsspec listing: one request per page of each "
        "class folder).",
        "",
    ]
    spark = [r for r in measured if r["engine"].startswith("Spark")]
    if spark:
        resolved = [r for r in spark if _resolved(r, "cpu_s")] or spark
        worst = max(resolved, key=lambda r: r["marginal_cpu_s_per_img"])
        per_core = worst["marginal_cpu_s_per_img"]
        lines += [
            "## Projection: ImageNet (1.33 M images) on N Spark workers",
            "",
            "A projection, not a measurement: from Spark's marginal CPU-seconds per image "
            f"({worst['engine']}: {per_core * 1e3:.1f} ms, the Python workers' and the JVMs' "
            "CPU; the local engine's is the lower bound; this machine's cores, these ~470x354 "
            "JPEGs; ImageNet's average ~110 KB file is somewhat larger), assuming workers "
            "scale linearly (shards are independent; inputs and output on a bucket that keeps "
            "up), plus the driver's CPU above and the shortest Spark start-up measured here "
            "(wall, at this load).",
            "",
            "| worker cores (1 task each) | projected wall |",
            "|---|---|",
        ]
        total = (IMAGENET_TRAIN + IMAGENET_VAL) * per_core
        driver_cpu = sum(v for k, v in d.items() if k.endswith("_cpu_s"))
        start = min(r["fixed_wall_s"] for r in spark) + driver_cpu
        for n in (1, 8, 64, 256, 1024):
            secs = total / n + start
            lines.append(f"| {n} | {_hm(secs)} |")
    return "\n".join(lines) + "\n"


def _command() -> str:
    """This run's command line, its Python named by its environment (``.venv-spark/...``)."""
    python = Path(sys.executable)
    return shlex.join([f"{python.parent.parent.name}/bin/{python.name}", *sys.argv])


def _shown(path: str) -> str:
    """``path`` relative to the repository when it is inside it (``.venv-beam/bin/python``)."""
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return path


def _resolved(row: dict, key: str) -> bool:
    """Whether the full run cost more than the 2-image run (else the marginal is noise)."""
    return row[key] > row["fixed_" + key]


def _hm(secs: float) -> str:
    h, rest = divmod(round(secs), 3600)
    return f"{h} h {rest // 60:02d} min" if h else f"{rest // 60} min {rest % 60:02d} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument(
        "--reuse_engines",
        action="store_true",
        help="measure the driver again, keep this machine's last engine rows",
    )
    p.add_argument(
        "--beam_python",
        default=str(ROOT / ".venv-beam" / "bin" / "python"),
        help="the Python of an environment with apache-beam (`make venv-beam`)",
    )
    args = p.parse_args()
    key = result_sections.slug(result_sections.cpu_kind())
    with tempfile.TemporaryDirectory(prefix="convert_engines-") as d:
        tmp = Path(d)
        driver = driver_cost(tmp)
        print(driver, flush=True)
        if args.reuse_engines:  # the engines' rows of this machine's last run
            store = json.loads((result_sections.RESULTS / "convert_engines.json").read_text())
            rows = store[key]["rows"]
            args.images, args.shards = store[key]["images"], store[key]["shards"]
        else:
            rows = engine_rows(args, tmp)
    text = report(rows, driver, args)
    print(text)
    path = result_sections.write_section(
        "convert_engines",
        key,
        text,
        {"rows": rows, "driver": driver, "images": args.images, "shards": args.shards},
        "estimax-convert's engines",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
