"""estimax-convert --engine=spark on a standalone Spark cluster of processes on 127.0.0.1.

The cluster (a master and two workers of one core each, JVMs started from the pyspark wheel's
jars) is shared by this module's tests; `make test` runs them in .venv-spark (the `spark`
phase). It writes to local folders and to the session's GCS emulator and S3 server
(tests/conftest.py), its workers started without their endpoints (the driver passes them on).
The command-line errors (a bad master, no pyspark, no Java) need no JVM and run in every venv.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from estimax.data import tfrecord
from estimax.data.example import decode_example
from estimax.tools import convert, convert_shards, convert_spark

REPO = Path(__file__).resolve().parent.parent
# A few hundred tiny images: 10 shards, so two workers share them and one can be lost mid-job.
FAKE = [
    "fake-imagenet",
    "--train_examples=240",
    "--validation_examples=60",
    "--num_classes=6",
    "--min_size=12",
    "--max_size=20",
    "--train_shards=8",
    "--validation_shards=2",
    "--no_progress",
]
# Small JVMs (2 cores shared by everything); no driver UI in tests.
CONF = [
    "spark.driver.memory=512m",
    "spark.executor.memory=512m",
    "spark.ui.enabled=false",
    "spark.driver.host=127.0.0.1",
    "spark.driver.bindAddress=127.0.0.1",
    f"spark.pyspark.python={sys.executable}",
]
_DEADLINE = 120.0  # seconds any wait for the cluster may take before the test fails


def _require_spark():
    if os.environ.get("ESTIMAX_REQUIRE_SPARK"):  # `make test` runs this in .venv-spark
        import pyspark  # noqa: F401
    return pytest.importorskip(
        "pyspark", reason="pyspark runs in its own venv (`make test` builds .venv-spark)"
    )


def _wait_for(what: str, condition, proc_logs=()):
    """Polls ``condition`` until it is true (a cluster start or a task reaching a point)."""
    deadline = time.monotonic() + _DEADLINE
    while not (result := condition()):
        if time.monotonic() > deadline:
            logs = "\n".join(Path(p).read_text()[-3000:] for p in proc_logs)
            pytest.fail(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.05)
    return result


class Cluster:
    """A standalone master and its workers (each a JVM, started as Spark's sbin scripts do)."""

    def __init__(self, home: str, tmp: Path):
        self.home, self.tmp = home, tmp
        self.env = {
            **os.environ,
            "SPARK_HOME": home,
            "SPARK_LOCAL_IP": "127.0.0.1",
            # What Spark's scripts (load-spark-env.sh) set: a worker's launcher needs it to
            # build an executor's command outside a Spark source tree.
            "SPARK_SCALA_VERSION": "2.13",
            "PYSPARK_PYTHON": sys.executable,
            # The executors' Python imports this tree's estimax.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        # No object-store settings in the workers' own environment: their executors get them
        # from the driver (spark.executorEnv.*), as on a cluster started without them.
        for name in (*convert_spark.FORWARDED_ENV, "TENSORSTORE_GCS_HTTP_URL"):
            self.env.pop(name, None)
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        log = self._start("master", "org.apache.spark.deploy.master.Master", "--port", "0")
        found = _wait_for(
            "the Spark master",
            lambda: re.search(r"Starting Spark master at (spark://\S+)", log.read_text()),
            [log],
        )
        self.url = found[1]
        self.master_log = log

    def _start(self, name: str, cls: str, *args: str) -> Path:
        log = self.tmp / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [
                    "java",
                    "-Xmx256m",
                    "-Dspark.master.rest.enabled=false",  # it binds a fixed port (6066)
                    "-cp",
                    os.path.join(self.home, "jars", "*"),
                    cls,
                    "--host",
                    "127.0.0.1",
                    "--webui-port",
                    "0",
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.logs.append(log)
        return log

    def add_worker(self) -> None:
        n = sum("Worker" in " ".join(p.args) for p in self.procs)
        work = self.tmp / f"work{n}"
        work.mkdir()
        self._start(
            f"worker{n}",
            "org.apache.spark.deploy.worker.Worker",
            "--port",
            "0",
            "--cores",
            "1",
            "--memory",
            "640m",
            "--work-dir",
            str(work),
            self.url,
        )
        _wait_for(
            f"worker {n} to register",
            lambda: self.master_log.read_text().count("Registering worker") > n,
            self.logs,
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its executors and Python workers too
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pyspark = _require_spark()
    c = Cluster(os.path.dirname(pyspark.__file__), tmp_path_factory.mktemp("spark"))
    try:
        c.add_worker()
        c.add_worker()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def local_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    assert convert.main([*FAKE, f"--output_dir={out}", "--num_workers=1"]) == 0
    return out


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (shards, indexes wherever they are written, manifest)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _spark(cluster, out: Path | str, *args: str) -> list[str]:
    conf = [f"--spark_conf={c}" for c in CONF]
    return [*args, f"--output_dir={out}", "--engine=spark", f"--spark_master={cluster.url}", *conf]


def test_spark_cluster_writes_the_local_engines_bytes(cluster, local_output, tmp_path):
    out = tmp_path / "spark"
    assert convert.main(_spark(cluster, out, *FAKE)) == 0
    local, spark = _files(local_output), _files(out)
    assert sorted(spark) == sorted(local)
    assert sum(n.endswith(tfrecord.INDEX_SUFFIX) for n in spark) == 10  # an index per shard
    different = [name for name in local if local[name] != spark[name]]
    assert different == []
    assert convert_shards.verify(str(out), num_workers=1) == []


# Fewer images for the object stores (each object a request to a local server).
SMALL = [
    "fake-imagenet",
    "--train_examples=24",
    "--validation_examples=8",
    "--num_classes=3",
    "--min_size=12",
    "--max_size=16",
    "--train_shards=2",
    "--validation_shards=1",
    "--no_progress",
]


@pytest.fixture(scope="module")
def small_local_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "out"
    assert convert.main([*SMALL, f"--output_dir={out}", "--num_workers=1"]) == 0
    return out


def test_spark_cluster_writes_the_local_engines_bytes_to_gs_and_s3(
    cluster, small_local_output, object_store
):
    """The driver's STORAGE_EMULATOR_HOST / AWS_ENDPOINT_URL reach the executors, whose own
    environment has neither; every object equals the local engine's file of the same name."""
    root, _ = object_store
    out = f"{root}/spark"
    assert convert.main(_spark(cluster, out, *SMALL)) == 0
    from estimax import storage

    fs, base = storage.filesystem(out)
    remote = {
        path.removeprefix(base.rstrip("/") + "/"): fs.cat_file(path) for path in fs.find(base)
    }
    local = _files(small_local_output)
    assert sorted(remote) == sorted(local)
    assert sum(n.endswith(tfrecord.INDEX_SUFFIX) for n in remote) == 3  # an index per shard
    assert "manifest.json" in remote
    assert [n for n in local if local[n] != remote[n]] == []


def test_index_on_the_cluster_writes_the_local_engines_indexes(cluster, local_output, tmp_path):
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(local_output, shards, ignore=shutil.ignore_patterns(".estimax-index"))
    pattern = str(shards / "*-of-*")
    conf = [f"--spark_conf={c}" for c in CONF]
    args = ["index", pattern, "--engine=spark", f"--spark_master={cluster.url}", "--verify"]
    assert convert.main([*args, "--no_progress", *conf]) == 0
    # The local engine on the same files (an index records its shard's size and version).
    here = tmp_path / "local-index"
    assert convert.main(["index", pattern, f"--index_dir={here}", "--force", "--no_progress"]) == 0
    spark = {p.name: p.read_bytes() for p in (shards / ".estimax-index").iterdir()}
    # --index_dir names each index after its shard's folder too (a hash before the name).
    local = {re.sub(r"^[0-9a-f]{16}-", "", p.name): p.read_bytes() for p in here.iterdir()}
    assert len(spark) == 10 and sorted(spark) == sorted(local)
    assert [n for n in local if local[n] != spark[n]] == []
    # Indexes that fit are kept: a second run has nothing to do and asks no master for workers.
    closed = f"--spark_master=spark://127.0.0.1:{_closed_port()}"
    assert convert.main(["index", pattern, "--engine=spark", closed, "--no_progress"]) == 0


def test_a_failed_file_is_named_and_the_job_exits_non_zero(cluster, tmp_path, capsys):
    from PIL import Image

    for label in ("cat", "dog"):
        (tmp_path / "in" / label).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 90, 20)).save(tmp_path / "in" / label / f"{i}.jpg")
    bad = tmp_path / "in" / "dog" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    args = ["folder", f"--train_dir={tmp_path / 'in'}", "--train_shards=2", "--no_progress"]
    assert convert.main(_spark(cluster, tmp_path / "out", *args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "--skip_bad" in err[0], err
    # The shard without the bad file is written and recorded: the same command resumes.
    manifest = convert_shards.load_manifest(str(tmp_path / "out"))
    assert manifest is not None and not manifest.complete and len(manifest.shards) == 1


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        chain.append(pid)
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return chain


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_worker_killed_mid_job_still_leaves_every_shard_once(cluster, local_output, tmp_path):
    """SIGKILL the worker (its JVM, executor and Python processes) whose task is mid-shard:
    Spark reruns the task on the other worker and the output equals the local engine's."""
    hold = tmp_path / "hold"
    hold.mkdir()
    out = tmp_path / "spark"
    args = _spark(cluster, out, *FAKE)
    args.append(f"--spark_conf=spark.executorEnv.ESTIMAX_CONVERT_TEST_HOLD={hold}")
    rc: list[int] = []
    driver = threading.Thread(target=lambda: rc.append(convert.main(args)))
    driver.start()
    try:
        held = _wait_for(
            "a task to reach the hold",
            lambda: (hold / "held").exists() and (hold / "held").read_text(),
            cluster.logs,
        )
        chain = _ancestors(int(held))
        worker = next(p for p in chain if "deploy.worker.Worker" in _cmdline(p))
        mine = chain[: chain.index(worker) + 1]  # the Python worker up to the Worker JVM
        for pid in reversed(mine):  # the Worker first: it restarts no executor
            os.kill(pid, signal.SIGKILL)
        os.killpg(worker, signal.SIGKILL)  # and whatever else it started
        # Nothing of it may run on: the retried task must be the shard's only writer.
        _wait_for(
            "the worker's processes to go",
            lambda: (
                not any(
                    Path(f"/proc/{p}").exists() and "<defunct>" not in _cmdline(p) and _cmdline(p)
                    for p in mine
                )
            ),
            cluster.logs,
        )
    finally:
        (hold / "release").touch()
        driver.join(timeout=_DEADLINE * 2)
    assert rc == [0]
    spark, local = _files(out), _files(local_output)
    assert [n for n in local if spark.get(n) != local[n]] == []
    names = []  # every record once: 300 distinct images
    for name in spark:
        if re.fullmatch(r"(train|validation)-\d{5}-of-\d{5}", name):
            for record in tfrecord.read_records(str(out / name)):
                names.append(decode_example(record)["image/filename"][0])
    assert len(names) == len(set(names)) == 300
    cluster.add_worker()  # leave the cluster as it was for later tests


# ------------------------------------------------------------- errors that need no cluster


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "master, expected",
    [
        ("spark://127.0.0.1:{port}", "no Spark master answers"),
        ("sprak://host:7077", "is not a Spark master URL"),
    ],
)
def test_a_bad_master_fails_fast_in_one_line(tmp_path, capsys, master, expected):
    master = master.format(port=_closed_port())
    args = [*FAKE, f"--output_dir={tmp_path}", "--engine=spark", f"--spark_master={master}"]
    assert convert.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and master in err[0], err
    assert not (tmp_path / "manifest.json").exists()  # nothing planned or written


def test_no_pyspark_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark raises ImportError
    args = [*FAKE, f"--output_dir={tmp_path}", "--engine=spark", "--spark_master=local[2]"]
    assert convert.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'estimax[spark]'" in err[0], err


def test_no_java_names_the_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyspark", types.ModuleType("pyspark"))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it
    args = [*FAKE, f"--output_dir={tmp_path}", "--engine=spark", "--spark_master=local[2]"]
    assert convert.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "openjdk-17-jre-headless" in err[0] and "Java 17" in err[0], err


def test_index_on_a_bad_master_fails_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert convert.main([*FAKE, f"--output_dir={out}", "--num_workers=1"]) == 0
    for idx in (out / ".estimax-index").iterdir():
        idx.unlink()
    master = f"spark://127.0.0.1:{_closed_port()}"
    args = ["index", str(out / "*-of-*"), "--engine=spark", f"--spark_master={master}"]
    assert convert.main([*args, "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Spark master answers" in err[0] and master in err[0], err
    assert list((out / ".estimax-index").iterdir()) == []  # nothing written
    with pytest.raises(SystemExit) as e:
        convert.main([*args, "--num_workers=2"])
    assert e.value.code == 2 and "--num_workers is for local and Beam" in capsys.readouterr().err


def test_the_executors_get_the_drivers_object_store_settings():
    env = {
        "STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
        "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_REGION": "",  # unset in effect: not passed on
        "HOME": "/home/me",  # not a storage setting
    }
    conf = {"spark.executorEnv.AWS_ENDPOINT_URL": "http://minio.internal:9000"}  # theirs wins
    assert convert_spark.executor_env(conf, env) == {
        "spark.executorEnv.STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
        "spark.executorEnv.AWS_SECRET_ACCESS_KEY": "s",
    }


def test_spark_options_are_checked_before_anything_runs(tmp_path, capsys):
    base = [*FAKE, f"--output_dir={tmp_path}", "--engine=spark", "--spark_master=local[1]"]
    with pytest.raises(SystemExit) as e:
        convert.main([*base, "--num_workers=2"])
    assert e.value.code == 2 and "--num_workers is for local and Beam" in capsys.readouterr().err
    assert convert.main([*base, "--spark_conf=novalue"]) == 2
    assert "expected key=value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main([*base, "--runner=DirectRunner"])
    assert "--engine=beam" in capsys.readouterr().err
