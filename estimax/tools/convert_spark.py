"""The conversion as an Apache Spark job: ``estimax-convert ... --engine=spark``.

Same plan, shard writer and manifest as the local engine (``convert_shards``), so the output is
the same bytes. The driver (this process) lists the inputs, assigns them to shards and drops the
shards already complete (:func:`~estimax.tools.convert_shards.plan_conversion`); Spark only
distributes the shard tasks, one partition each::

    sc.parallelize(todo, len(todo)).map(write one shard).collect()

and the driver writes the manifest from the gathered results. A task whose executor is lost
(a machine gone, a JVM killed) is rerun by Spark on another one; :func:`write_shard` writes
through a temporary name and renames, so a rerun shard replaces, never duplicates, its file. A
bad image is not retried (it fails the same way each time): its task returns the error, the
shards written are recorded in the manifest (a rerun resumes) and the job fails naming the file.

``--spark_master`` is any Spark master URL: ``local[N]``, ``spark://HOST:PORT`` (a standalone
cluster; checked before the JVM starts, so a wrong address fails in seconds, not after Spark's
registration retries), ``yarn`` or ``k8s://https://HOST:PORT``; ``--spark_conf key=value``
passes Spark options through (``spark.executor.memory=4g``, ``spark.pyspark.python=...``). The
workers must import estimax (installed in their Python, or shipped with ``spark-submit
--py-files``) and read the inputs and write ``--output_dir`` (``gs://``, ``s3://`` or a shared
file system at scale). The Spark UI runs on the driver as usual (its address is logged).

The executors get the driver's object-store settings: each of :data:`FORWARDED_ENV` set in the
driver's environment (the endpoint of a GCS emulator or an S3-compatible store, AWS keys and
region, estimax's storage retries) is passed on as ``spark.executorEnv.NAME``, unless a
``--spark_conf spark.executorEnv.NAME=...`` sets it. A job on Dataproc writing to ``gs://`` or
on EMR writing to ``s3://`` sets none of them and needs nothing: the executors use their
machines' own credentials. Spark's UI hides the secret ones (``spark.redaction.regex``).

Requires the optional extra ``estimax[spark]`` (``pyspark``) and Java 17 or newer.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from typing import Any

from estimax.tools.convert_images import BadImageError
from estimax.tools.convert_shards import (
    Manifest,
    ShardTask,
    finish_manifest,
    load_manifest,
    plan_conversion,
    write_shard,
)
from estimax.tools.convert_sources import Dataset

__all__ = [
    "FORWARDED_ENV",
    "SparkError",
    "check_master",
    "convert_spark",
    "executor_env",
    "parse_conf",
]

log = logging.getLogger(__name__)

# Seconds to wait for a standalone master to accept a connection before giving up on it.
_CONNECT_TIMEOUT = 10.0
_MASTER_RE = re.compile(
    r"^(local(\[(\*|\d+)(,\d+)?\])?|local-cluster\[\d+,\d+,\d+\]|yarn|k8s://\S+|"
    r"spark://[^/\s]+)$"
)
# A test-only hold: with this set to a directory, the first attempt at the first shard waits
# there for a file named "release" (tests/test_convert_spark.py kills its worker meanwhile).
_HOLD_ENV = "ESTIMAX_CONVERT_TEST_HOLD"
# What the driver's environment passes on to the executors (spark.executorEnv.*): where the
# object stores are and how to reach them (estimax.storage.configure derives the rest, such as
# TensorStore's variables, from these on each executor). Paths to files (GOOGLE_APPLICATION_
# CREDENTIALS, AWS_SHARED_CREDENTIALS_FILE) are not: the executors' machines have their own.
FORWARDED_ENV = (
    "STORAGE_EMULATOR_HOST",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "ESTIMAX_STORAGE_RETRIES",
    "ESTIMAX_STORAGE_TIMEOUT_S",
)


class SparkError(RuntimeError):
    """Spark cannot run the job (no pyspark, no Java, a master that cannot be reached, a job
    that failed); the message is one line saying what to install or fix."""


def parse_conf(pairs: list[str]) -> dict[str, str]:
    """``["key=value", ...]`` (``--spark_conf``) -> a dict.

    Raises:
      SparkError: an item without ``=``.
    """
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SparkError(f"--spark_conf {pair!r}: expected key=value, e.g. spark.cores.max=64")
        conf[key.strip()] = value
    return conf


def check_master(master: str, timeout: float = _CONNECT_TIMEOUT) -> None:
    """Fails fast on a master URL Spark would hang on or reject late.

    ``spark://`` masters (one or several ``HOST:PORT``, comma-separated for a standby) are
    connected to: at least one must accept within ``timeout`` seconds.

    Raises:
      SparkError: the URL is not a Spark master URL, or no standalone master answers.
    """
    if not _MASTER_RE.match(master):
        raise SparkError(
            f"--spark_master {master!r} is not a Spark master URL: use local[N], "
            "spark://HOST:PORT, yarn or k8s://https://HOST:PORT"
        )
    if not master.startswith("spark://"):
        return
    problems = []
    for hostport in master[len("spark://") :].split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit():
            raise SparkError(f"--spark_master {master!r}: expected spark://HOST:PORT")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return
        except OSError as e:
            problems.append(f"{hostport}: {e.strerror or e}")
    raise SparkError(
        f"--spark_master {master}: no Spark master answers ({'; '.join(problems)}); start it "
        "($SPARK_HOME/sbin/start-master.sh) or fix the address"
    )


def _pyspark() -> Any:
    """``pyspark``, or a SparkError naming the extra to install."""
    try:
        import pyspark
    except ImportError as e:
        raise SparkError(
            f"--engine=spark needs pyspark: pip install 'estimax[spark]' (pyspark==4.3.0); {e}"
        ) from None
    return pyspark


def _check_java() -> None:
    """Spark's driver is a JVM: a SparkError naming the package when there is no ``java``."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        where = f"JAVA_HOME={home} has no bin/java" if home else "no `java` on PATH"
        raise SparkError(
            f"--engine=spark needs Java 17 or newer ({where}): install a JDK or JRE, e.g. "
            "apt-get install openjdk-17-jre-headless, and put it on PATH or in JAVA_HOME"
        )


def _write_task(task: ShardTask) -> dict[str, Any]:
    """One Spark task: :func:`write_shard`, a bad image returned as ``{"error": ...}``.

    Other errors (a lost connection, a full disk) raise, so that Spark retries the task.
    """
    hold = os.environ.get(_HOLD_ENV)
    if hold and task.index == 0:
        _hold(hold)
    try:
        return write_shard(task)
    except BadImageError as e:
        return {"error": str(e), "name": task.name}


def _hold(folder: str) -> None:
    """Test-only: the first caller marks itself (its pid) and waits for ``folder/release``."""
    try:
        fd = os.open(os.path.join(folder, "held"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # a retry: go on
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    import time

    deadline = time.monotonic() + 300  # never forever, should the test die first
    while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)


def executor_env(conf: dict[str, str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``spark.executorEnv.NAME`` options the driver adds: each of :data:`FORWARDED_ENV`
    set (non-empty) in ``environ`` (``os.environ`` by default), except those ``conf`` sets."""
    env = os.environ if environ is None else environ
    options = {f"spark.executorEnv.{name}": env[name] for name in FORWARDED_ENV if env.get(name)}
    return {key: value for key, value in options.items() if key not in conf}


def _spark_conf(pyspark: Any, master: str, conf: dict[str, str]) -> Any:
    defaults = {
        "spark.app.name": "estimax-convert",
        # One shard per task: never run two attempts of a shard at once on purpose.
        "spark.speculation": "false",
    }
    if master.startswith("local"):
        # Executors are this machine's: the Python that runs this driver runs them.
        defaults["spark.pyspark.python"] = sys.executable
    forwarded = executor_env(conf)
    if forwarded:
        log.info(
            "Spark: the executors get %s from this environment",
            ", ".join(k.removeprefix("spark.executorEnv.") for k in forwarded),
        )
    spark_conf = pyspark.SparkConf()
    settings = {**defaults, **forwarded, **conf, "spark.master": master}
    for key, value in settings.items():
        spark_conf.set(key, value)
    return spark_conf


def _run_tasks(pyspark: Any, master: str, conf: dict[str, str], todo: list[ShardTask]) -> list:
    """Runs ``todo`` on Spark; each task's result in plan order."""
    return _run(pyspark, master, conf, todo, _write_task, f"writing {len(todo)} shards")


def _run(
    pyspark: Any,
    master: str,
    conf: dict[str, str],
    items: list,
    task: Callable[[Any], Any],
    what: str,
) -> list:
    """Runs ``task`` on each of ``items`` as one Spark task each; the results in order."""
    spark_conf = _spark_conf(pyspark, master, conf)
    python = spark_conf.get("spark.pyspark.python")
    saved = os.environ.get("PYSPARK_PYTHON")
    try:
        if python:
            # A driver started from Python (not spark-submit) tells the executors which Python
            # to run from PYSPARK_PYTHON only, read when the context starts; spark-submit would
            # set it from this option.
            os.environ["PYSPARK_PYTHON"] = python
        sc = pyspark.SparkContext(conf=spark_conf)
    except Exception as e:  # py4j/JVM start-up failures come as several exception types
        raise SparkError(f"Spark did not start on {master}: {_last_line(e)}") from None
    finally:
        if saved is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = saved
    try:
        sc.setLogLevel(conf.get("spark.log.level", "WARN"))
        log.info(
            "Spark: %s on %s (application %s, Spark UI %s)",
            what,
            master,
            sc.applicationId,
            sc.uiWebUrl or "off",
        )
        sc.setJobDescription(f"estimax-convert: {what}")
        try:
            return sc.parallelize(items, len(items)).map(task).collect()
        except Exception as e:  # Py4JJavaError: a task failed spark.task.maxFailures times
            raise SparkError(f"the Spark job failed: {_task_error(e)}") from None
    finally:
        sc.stop()


def _index_task(job: tuple[str, bool, str | None]) -> tuple[str, int, int, str]:
    """One Spark task of ``index``: one shard's index, as ``convert_index`` reports it."""
    from estimax.tools import convert_index

    path, verify, index_dir = job
    rows = convert_index.index_share([path], 1, verify, None, index_dir)
    return rows[0] if rows else (path, 0, 0, "")


def index_spark(
    todo: list[str],
    *,
    master: str,
    conf: dict[str, str] | None = None,
    verify: bool = False,
    index_dir: str | None = None,
) -> list[tuple[str, int, int, str]]:
    """Indexes the shards ``todo`` on Spark, one task per shard (``estimax-convert index
    --engine=spark``); per shard ``(path, records, bytes_read, problem or "")``.

    The index file is written whole under its final name by ``shard_index`` (a retried task
    rewrites the same bytes), so a lost executor leaves no partial index.

    Raises:
      SparkError: no pyspark, no Java, a master that cannot be reached, a failed job.
    """
    check_master(master)
    pyspark = _pyspark()
    _check_java()
    jobs = [(p, verify, index_dir) for p in todo]
    return _run(pyspark, master, conf or {}, jobs, _index_task, f"indexing {len(todo)} shards")


def _last_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def _task_error(e: BaseException) -> str:
    """The Python error a failed Spark task raised (the last ``...Error: ...`` line of the
    traceback Spark forwards), else the first line of Spark's message."""
    text = str(e)
    found = re.findall(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$", text, re.M)
    python = [f"{name}: {msg.strip()}" for name, msg in found if "Py4J" not in name]
    if python:
        return python[-1]
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return first[:500]


def convert_spark(
    dataset: Dataset,
    output_dir: str,
    num_shards: dict[str, int],
    *,
    master: str,
    conf: dict[str, str] | None = None,
    check: str = "scaled",
    skip_bad: bool = False,
    overwrite: bool = False,
    source: dict | None = None,
) -> Manifest:
    """Converts ``dataset`` on Spark; same arguments and output as ``convert_local``.

    Args:
      master: a Spark master URL (``local[N]``, ``spark://HOST:PORT``, ``yarn``, ``k8s://...``).
      conf: Spark options (``spark.executor.memory`` ...), passed through.

    Raises:
      SparkError: no pyspark, no Java, a master that cannot be reached, a failed job.
      BadImageError: an image cannot be read (naming the file), unless ``skip_bad``; the shards
        written before it are in the manifest, so the same command resumes.
      InputError: see ``plan_conversion``.
    """
    check_master(master)  # first: a typo in the URL is named even where pyspark is missing
    pyspark = _pyspark()
    _check_java()
    plan = plan_conversion(
        dataset, output_dir, num_shards, check, skip_bad, overwrite=overwrite, source=source
    )
    results = _run_tasks(pyspark, master, conf or {}, plan.todo) if plan.todo else []
    written = [r for r in results if "error" not in r]
    finish_manifest(written, plan.manifest.to_json(), output_dir, len(plan.tasks))
    failed = [r for r in results if "error" in r]
    if failed:
        more = f" (and {len(failed) - 1} more shards failed)" if len(failed) > 1 else ""
        raise BadImageError(f"{failed[0]['error']}{more}")
    final = load_manifest(output_dir)
    assert final is not None
    log.info("Spark: wrote %d shards on %s", len(written), master)
    return final
