"""``tensorflow_model_server`` (estimax.serving.tf_serving): TF Serving's flags, gRPC health and
SavedModel-style warm-up records, under KServe's stock TF Serving runtime arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from estimax.serving import tf_serving, warmup
from tests.serving_fixtures import (
    export_dense,
    free_port,
    grpc_predict,
    make_jpegs,
    server_env,
    tf_predict_request,
    wait_until,
)

MODULE = [sys.executable, "-m", "estimax.serving.tf_serving"]


def _non_root_prefix() -> list[str]:
    """``setpriv`` to uid 1000 when running as root and that user can run this interpreter."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    prefix = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True)
    return prefix if probe.returncode == 0 else []


@pytest.fixture(scope="module")
def base():
    root = tempfile.mkdtemp()
    os.chmod(root, 0o755)  # readable by the non-root server
    images, _ = make_jpegs(2, seed=3)
    # Two warm-up requests (one image, two), written by the export itself.
    path = export_dense(root, warmup_requests=[images[:1], images])
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames:
            os.chmod(os.path.join(dirpath, n), 0o755)
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o644)
    yield path
    shutil.rmtree(root, ignore_errors=True)


def test_kserve_runtime_arguments_serve_rest_grpc_and_health(base, tmp_path):
    """KServe's runtime arguments: REST on --rest_api_port, gRPC on --port, health, warm-up.

    Non-root, as KServe's runtime runs it (``runAsUser: 1000``): what is checked depends on who
    runs the suite. As root, the server is started as uid 1000 with ``setpriv`` and its process
    is asserted to be uid 1000; as any other user it runs as that user, and its uid is asserted
    to be that one (not 0). Only as root without ``setpriv`` (or where uid 1000 cannot run this
    interpreter) does it run as root: the non-root part is then not checked, and a warning says
    so. Either way the server needs nothing of root: ports past 1024, files it only reads.
    """
    import warnings

    import grpc
    import requests
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    grpc_port, rest_port = free_port(), free_port()
    prefix = _non_root_prefix()
    # KServe's kserve-tensorflow-serving runtime, unchanged but for the ports.
    command = [
        *prefix,
        *MODULE,
        f"--port={grpc_port}",
        f"--rest_api_port={rest_port}",
        "--model_name=m",
        f"--model_base_path={base}",
        "--rest_api_timeout_in_ms=60000",
    ]
    log_path = tmp_path / "server.log"
    home = tempfile.mkdtemp()
    os.chmod(home, 0o777)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            env={**server_env(), "HOME": home},
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{rest_port}"

        def ready() -> bool:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                return requests.get(url + "/v1/models/m", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        wait_until(ready, "the server's REST port", timeout=240)
        output = log_path.read_text()
        # The warm-up records export_version wrote were replayed before the version was
        # marked available.
        assert "2 warm-up records replayed" in output, output[-3000:]
        status = requests.get(url + "/v1/models/m", timeout=10).json()
        assert status["model_version_status"][0]["state"] == "AVAILABLE"
        assert requests.get(url + "/v2/health/ready", timeout=10).status_code == 200
        uid = os.stat(f"/proc/{proc.pid}").st_uid
        if prefix:
            assert uid == 1000
        elif os.geteuid() != 0:
            assert uid == os.geteuid() != 0
        else:
            warnings.warn(
                "the KServe test ran the server as root (no setpriv, or uid 1000 cannot run "
                f"{sys.executable}): its non-root part was not checked",
                stacklevel=1,
            )

        images, _ = make_jpegs(3, seed=5)
        target = f"127.0.0.1:{grpc_port}"
        response = grpc_predict(target, tf_predict_request("m", images))
        assert list(response.outputs["classes"].tensor_shape.dim)[0].size == 3

        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            for service in ("", "m", "tensorflow.serving.PredictionService"):
                check = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert check.status == serving, service
            with pytest.raises(grpc.RpcError) as e:
                stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            watch.cancel()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(home, ignore_errors=True)


def test_unknown_flag_is_one_line_and_exit_2():
    start = time.monotonic()
    done = subprocess.run(
        [*MODULE, "--port=8500", "--rest_api_prot=8501"],
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rest_api_prot" in lines[0], done.stderr
    assert time.monotonic() - start < 120


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--ssl_config_file=/x"], "--ssl_config_file"),
        (["--rest_api_enable_cors_support"], "--rest_api_enable_cors_support"),
        (["--port=notaport"], "--port"),
        (["--model_base_path"], "needs a value"),
        (["stray"], "unexpected argument"),
        (["--model_config_file_poll_wait_seconds=-1"], ">= 0"),
    ],
)
def test_refused_flags(flags, words, capsys):
    assert tf_serving.main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_kserve_flags_translate_to_serve_options():
    args, warnings = tf_serving.translate(
        [
            "--port=9000",
            "--rest_api_port=8080",
            "--model_name=NAME",
            "--model_base_path=/mnt/models",
            "--rest_api_timeout_in_ms=60000",
            "--tensorflow_session_parallelism=4",
            "--enable_batching=false",
        ]
    )
    assert (args.grpc_port, args.port, args.host) == (9000, 8080, "0.0.0.0")
    assert (args.model_name, args.model_base_path) == ("NAME", "/mnt/models")
    assert args.rest_api_timeout_in_ms == 60000 and not args.enable_batching
    assert len(warnings) == 1 and "--tensorflow_session_parallelism" in warnings[0]
    # TF Serving's defaults: gRPC 8500, no REST.
    args, warnings = tf_serving.translate(["--model_base_path=/m"])
    assert (args.grpc_port, args.port, args.model_name, warnings) == (8500, 0, "default", [])


def test_model_config_file_and_its_poll_pass_to_serve(tmp_path):
    two = tmp_path / "two.config"
    args, warnings = tf_serving.translate(
        [
            f"--model_config_file={two}",
            "--model_config_file_poll_wait_seconds=60",
            "--allow_version_labels_for_unavailable_models",
            "--model_name=ignored",
        ]
    )
    assert (args.model_config_file, args.model_config_file_poll_wait_seconds) == (str(two), 60)
    assert args.allow_version_labels_for_unavailable_models
    assert len(warnings) == 1 and "--model_name" in warnings[0]


def test_batching_parameters_file(tmp_path, capsys):
    params = tmp_path / "batching.config"
    params.write_text(
        "max_batch_size { value: 16 } batch_timeout_micros { value: 500 } "
        "num_batch_threads { value: 2 } max_enqueued_batches { value: 8 } "
        'allowed_batch_sizes: 4 allowed_batch_sizes: 16 thread_pool_name { value: "t" }'
    )
    args, warnings = tf_serving.translate(
        ["--enable_batching", f"--batching_parameters_file={params}", "--model_base_path=/m"]
    )
    assert args.enable_batching
    assert (args.max_batch_size, args.batch_timeout_micros, args.num_batch_threads) == (16, 500, 2)
    assert (args.max_enqueued_batches, args.allowed_batch_sizes) == (8, (4, 16))
    assert len(warnings) == 1 and "thread_pool_name" in warnings[0]
    params.write_text("max_batch_sise { value: 16 }")
    assert tf_serving.main(["--enable_batching", f"--batching_parameters_file={params}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_batch_sise" in err[0], err


def test_warmup_records_round_trip_and_other_kinds_refused(tmp_path):
    images, _ = make_jpegs(1)
    request = tf_predict_request("x", images)
    path = str(tmp_path / "records")
    warmup.write_records(path, [warmup.prediction_log(request)] * 3)
    records = warmup.read_records(path)
    assert len(records) == 3 and warmup.predict_request(records[0]) == request
    with pytest.raises(ValueError, match="more than 2"):
        warmup.read_records(path, limit=2)
    classify_log = b"\x0a\x00"  # PredictionLog { classify_log {} }
    with pytest.raises(ValueError, match="classify_log"):
        warmup.predict_request(classify_log)


def test_thread_and_channel_flags_keep_tf_servings_meaning():
    """--grpc_max_threads, --grpc_channel_arguments, --rest_api_num_threads and
    --per_process_gpu_memory_fraction have estimax counterparts: honoured, no warning. The
    flags with none are one WARNING line each, naming why."""
    from estimax.serving import cli

    args, warnings = tf_serving.translate(
        [
            "--model_base_path=/m",
            "--grpc_max_threads=8",
            "--rest_api_num_threads=3",
            "--grpc_channel_arguments=grpc.max_connection_age_ms=2000,grpc.primary_user_agent=x",
            "--per_process_gpu_memory_fraction=0.5",
            "--num_load_threads=4",
        ]
    )
    assert len(warnings) == 1 and warnings[0].startswith("--num_load_threads has no meaning")
    assert "--version_load_timeout_seconds" in warnings[0]
    options = cli._server_options(args)
    assert options.grpc_max_concurrent_rpcs == 8
    assert options.grpc_arguments == (
        ("grpc.max_connection_age_ms", 2000),
        ("grpc.primary_user_agent", "x"),
    )
    assert options.json_workers == min(3, os.cpu_count() or 1)
    assert args.environment == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    for flags, words in (
        (["--grpc_channel_arguments=grpc.x"], "'grpc.x' is not name=value"),
        (["--grpc_max_threads=-1"], "--grpc_max_threads=-1 must be >= 0"),
        (["--per_process_gpu_memory_fraction=1.5"], "not between 0 and 1"),
    ):
        with pytest.raises(ValueError, match=words):
            cli._server_options(tf_serving.translate(["--model_base_path=/m", *flags])[0])
    for name, why in tf_serving.IGNORED.items():  # every ignored flag says why
        args, warnings = tf_serving.translate([f"--{name}=1"])
        assert warnings == [f"--{name} has no meaning in estimax ({why}); ignored"]


def test_grpc_max_threads_bounds_calls_in_progress_and_channel_arguments_apply():
    """As TF Serving's thread quota: past --grpc_max_threads calls in progress, a call answers
    RESOURCE_EXHAUSTED at once; a --grpc_channel_arguments entry replaces estimax's own."""
    import asyncio
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from estimax.serving import cli, grpc_server
    from estimax.serving.core import ServingCore
    from estimax.serving.manager import ModelManager

    args, _ = tf_serving.translate(
        [
            "--model_base_path=/m",
            "--grpc_max_threads=1",
            "--grpc_channel_arguments=grpc.max_receive_message_length=64",
        ]
    )
    core = ServingCore(ModelManager("m", "/nonexistent", [1]), cli._server_options(args))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()
    server = asyncio.run_coroutine_threadsafe(
        grpc_server.start(core, "127.0.0.1", port), loop
    ).result(60)
    status = health_pb2.HealthCheckResponse
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def check(service: str = "") -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status

            assert check() == status.NOT_SERVING  # never polled: nothing loaded
            with pytest.raises(grpc.RpcError) as e:  # 100 bytes past the 64 given
                check("x" * 100)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(watch).status == status.NOT_SERVING  # in progress: 1 call of 1
            with pytest.raises(grpc.RpcError) as e:
                check()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            watch.cancel()

            def answered() -> bool:
                try:
                    return check() == status.NOT_SERVING
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    return False

            wait_until(answered, "the watch's call to end")
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def test_export_version_publishes_warmup_records_with_the_version():
    """``export_version(warmup_requests=...)``: TF Serving's file in the version's
    assets.extra/, published with it (on an object store too: serving.json last), each record a
    PredictRequest of the request's inputs, CRCs TensorFlow's reader checks; a request the
    export refuses publishes nothing."""
    import uuid

    import fsspec

    from estimax import export
    from estimax.data import tfrecord
    from estimax.export.versions import list_versions
    from tests.serving_fixtures import IMAGE_SIZE, dense_estimator

    root = tempfile.mkdtemp()
    try:
        est, images = dense_estimator(root)
        base = f"memory://warmup-{uuid.uuid4().hex}"
        args = {"preprocessing": export.resnet_eval(IMAGE_SIZE), "platforms": ("cpu",)}
        path = export.export_version(est, base, warmup_requests=[images[:1], images[:3]], **args)
        fs, _ = fsspec.core.url_to_fs(base)
        local = os.path.join(root, "records")
        fs.get_file(f"{path}/{warmup.WARMUP_DIR}/{warmup.WARMUP_FILE}", local)
        records = list(tfrecord.read_records(local))  # CRCs checked
        assert [list(warmup.predict_request(r).inputs) for r in records] == [["image_bytes"]] * 2
        sent = [warmup.predict_request(r).inputs["image_bytes"] for r in records]
        want = [tf_predict_request("", n).inputs["image_bytes"] for n in (images[:1], images[:3])]
        assert sent == want  # the server's own message, field for field
        for bad, words in (
            ([[b"not an image"]], r"warmup_requests\[0\]: .*image"),
            ([images[0]], r"warmup_requests\[0\]: a list of encoded images"),
            ([], "give 1 to 1000"),
            (images[0], "a list of requests"),
        ):
            with pytest.raises(ValueError, match=words):
                export.export_version(est, base, warmup_requests=bad, **args)
        assert list_versions(base) == [1]  # nothing published by a refused export
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_not_ready_until_every_models_versions_are_loaded_and_warmed(base, tmp_path):
    """The readiness gate, with each warm-up held by the test (tests/hold_warmup_shim.py: the
    server reads a FIFO before it replays a version's records).

    At start (as TF Serving) the ports open only once every configured model's versions are
    loaded, checked and warmed: while the first warm-up is held, a connection to either port is
    refused (what Kubernetes' and Knative's probes read as not ready). A model added later to
    --model_config_file: while its warm-up is held, gRPC health is NOT_SERVING for the server
    and for that model (SERVING for the other), /v2/health/ready answers 503, the model's
    /v2/models/NAME/ready 503 and /v1/models/NAME says LOADING; once released, all SERVING,
    200 and AVAILABLE."""
    import socket

    import grpc
    import requests
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    fifo = str(tmp_path / "hold")
    os.mkfifo(fifo)
    for name in ("a", "b"):
        shutil.copytree(base, tmp_path / name)
    config = tmp_path / "models.config"
    one = f'model_config_list {{ config {{ name: "a" base_path: "{tmp_path / "a"}" }} }}\n'
    config.write_text(one)
    rest_port, grpc_port = free_port(), free_port()
    log_path = tmp_path / "server.log"
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hold_warmup_shim.py")
    command = [
        sys.executable,
        shim,
        fifo,
        "serve",
        f"--port={rest_port}",
        f"--grpc_port={grpc_port}",
        f"--model_config_file={config}",
        "--model_config_file_poll_wait_seconds=1",
    ]
    url, target = f"http://127.0.0.1:{rest_port}", f"127.0.0.1:{grpc_port}"
    status = health_pb2.HealthCheckResponse

    def held(path) -> None:
        """Waits until the server holds ``path``'s warm-up (its line in the log)."""
        wait_until(
            lambda: (
                proc.poll() is None
                and f"warm-up held: {path}/1" in log_path.read_text(encoding="utf-8")
            ),
            f"the warm-up of {path}",
        )

    def release() -> None:
        with open(fifo, "wb") as f:  # opens once the server reads; it goes on when closed
            f.write(b"go")

    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, env=server_env(), stdout=log, stderr=subprocess.STDOUT, text=True
        )
    try:
        held(tmp_path / "a")
        for port in (rest_port, grpc_port):  # loaded and checked, not warmed: no port yet
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
        release()

        def up() -> bool:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                return requests.get(url + "/v2/health/ready", timeout=10).status_code == 200
            except requests.ConnectionError:
                return False

        wait_until(up, "the ports to open")
        assert requests.get(url + "/v2/health/ready", timeout=10).status_code == 200
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def health(service: str) -> int:
                request = health_pb2.HealthCheckRequest(service=service)
                return stub.Check(request, timeout=30).status

            assert health("") == health("a") == status.SERVING
            # Model b added to the config: re-read within a second, loaded, then held.
            config.write_text(
                one.rstrip().removesuffix("}")
                + f' config {{ name: "b" base_path: "{tmp_path / "b"}" }} }}\n'
            )
            held(tmp_path / "b")
            assert health("") == health("b") == status.NOT_SERVING
            assert health("a") == status.SERVING
            assert requests.get(url + "/v2/health/ready", timeout=10).status_code == 503
            assert requests.get(url + "/v2/models/b/ready", timeout=10).status_code == 503
            assert requests.get(url + "/v2/models/a/ready", timeout=10).status_code == 200
            states = requests.get(url + "/v1/models/b", timeout=10).json()
            assert [s["state"] for s in states["model_version_status"]] == ["LOADING"]
            release()
            wait_until(lambda: health("") == status.SERVING, "model b's warm-up to end")
            assert health("b") == status.SERVING
        assert requests.get(url + "/v2/health/ready", timeout=10).status_code == 200
        states = requests.get(url + "/v1/models/b", timeout=10).json()
        assert [s["state"] for s in states["model_version_status"]] == ["AVAILABLE"]
        assert log_path.read_text().count("2 warm-up records replayed") == 2
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
