"""The container image (Containerfile; `make image`), started as KServe and Kubeflow start it.

It runs where an image is built: ``$ESTIMAX_IMAGE`` names it and ``$ESTIMAX_PODMAN`` is the
podman command (with the options a machine needs); ``make image-test`` builds the CPU image and
sets both. Elsewhere the tests skip, unless ``ESTIMAX_REQUIRE_IMAGE=1`` (then a missing podman or
image fails). Each container runs with host networking, as the machine's own processes:

* the image itself: a non-root user, ``estimax`` and ``tensorflow_model_server`` on PATH, no C
  compiler;
* KServe's stock TF Serving runtime as it is: ``tensorflow_model_server --port=9000
  --rest_api_port=8080 --model_name=NAME --model_base_path=/mnt/models
  --rest_api_timeout_in_ms=60000`` as user 1000, on a small export made here
  (tests/serving_fixtures.py): TF Serving REST ``/v1/models/NAME`` and ``:predict``, a gRPC
  ``Predict`` and the ``grpc.health.v1`` probe (the server and the model), all from outside the
  container on the host's address (ports 8080 and 9000 where free on the host, else two free
  ones, with a warning that says so);
* in an accelerator image (``cuda12``, ``tpu``), a training step compiled for its accelerator
  (``--compile_for=h100:8``, ``v5e:2x4``) on this machine, which has neither;
* two containers given only Kubeflow Trainer's variables (``$JAX_COORDINATOR_ADDRESS``,
  ``$JAX_NUM_PROCESSES``, ``$JAX_PROCESS_ID``) and ``--coordinator_address=auto``: one 2-process
  ResNet-18 job on fake data, one checkpoint in their shared ``--model_dir``.
"""

from __future__ import annotations

import base64
import os
import shlex
import shutil
import socket
import subprocess
import tomllib
import warnings

import multihost_helpers as mh
import pytest
import serving_fixtures as sf

IMAGE = os.environ.get("ESTIMAX_IMAGE", "")
PODMAN = shlex.split(os.environ.get("ESTIMAX_PODMAN", "podman"))
REQUIRED = os.environ.get("ESTIMAX_REQUIRE_IMAGE") == "1"
# podman run as these machines need it (docs/install.md): host networking, limits root may set.
RUN = [
    *PODMAN,
    "run",
    "--rm",
    "--network=host",
    "--ulimit=nofile=20000:20000",
    "--ulimit=nproc=32768:32768",
]


def _why_not() -> str | None:
    if not IMAGE:
        return "no $ESTIMAX_IMAGE: `make image-test` builds the image and runs these tests"
    if shutil.which(PODMAN[0]) is None:
        return f"{PODMAN[0]} is not installed (apt-get install -y podman runc)"
    found = subprocess.run([*PODMAN, "image", "exists", IMAGE], capture_output=True, timeout=600)
    return None if found.returncode == 0 else f"no image {IMAGE}: make image"


_REASON = _why_not()
if _REASON is not None and REQUIRED:
    raise RuntimeError(f"ESTIMAX_REQUIRE_IMAGE=1 but {_REASON}")
needs_image = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_image_without_podman_says_in_one_line_how_to_install_it(tmp_path):
    # make installs no system package: a PATH without podman stops at once, with the command.
    proc = subprocess.run(
        [shutil.which("make") or "make", "-s", "-C", mh.ROOT, "image"],
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stdout.splitlines() == [
        "make image: podman is not installed; install podman, runc and mmdebstrap with the "
        "system package manager (docs/install.md; make installs no system package)"
    ]


def _console_scripts() -> set[str]:
    with open(os.path.join(mh.ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["scripts"])


@needs_image
def test_the_image_runs_as_a_user_with_estimax_on_path_and_no_compiler():
    probe = (
        "id -u; id -un; for c in estimax resnet python; do command -v $c; done; "
        "for c in gcc cc c++ g++ clang; do command -v $c; done; echo --; "
        "command -v tensorflow_model_server; echo --; "
        "python -c 'import estimax, jax; print(jax.__version__, jax.devices()[0].platform)'"
    )
    proc = subprocess.run(
        [*RUN, IMAGE, "sh", "-c", probe], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found, server, versions = proc.stdout.split("--\n")
    uid, user, *paths = found.split()
    assert (uid, user) == ("1000", "estimax")
    assert paths == [
        "/opt/estimax/bin/estimax",
        "/opt/estimax/bin/resnet",
        "/opt/estimax/bin/python",
    ]
    # TF Serving's binary name, as the package declares it (KServe's runtime runs that name).
    assert "tensorflow_model_server" in _console_scripts()
    assert server.split() == ["/opt/estimax/bin/tensorflow_model_server"], server
    assert versions.split() == ["0.10.2", "cpu"]


# An accelerator image holds XLA's compiler for its accelerator: where there is none (here),
# a step is compiled for one (``--compile_for``), as a job would be checked before it is sent.
# The plugin's distribution -> the slice compiled for and the environment it needs.
COMPILE_FOR = {
    # No GPU and no variable set: --compile_for keeps JAX off CUDA itself (issue #51).
    "jax-cuda12-plugin": ("h100:8", []),
    "libtpu": ("v5e:2x4", []),
}


@needs_image
def test_an_accelerator_image_compiles_a_step_for_its_accelerator_without_one():
    listed = subprocess.run(
        [
            *RUN,
            IMAGE,
            "python",
            "-c",
            "import importlib.metadata as m; "
            "print(*sorted(d.metadata['Name'] for d in m.distributions()))",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    plugins = [name for name in COMPILE_FOR if name in listed.stdout.split()]
    if not plugins:
        pytest.skip(f"{IMAGE} holds no accelerator plugin (the CPU image)")
    (plugin,) = plugins
    target, env = COMPILE_FOR[plugin]
    proc = subprocess.run(
        [*RUN, *env, IMAGE, "estimax-mnist", f"--compile_for={target}", "--batch_size=1024"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    report = [line for line in output.splitlines() if line.startswith("train step on ")]
    assert len(report) == 1 and f"({target}; global batch 1,024" in report[0], output[-3000:]
    assert ": fits: " in report[0], report


def _kserve_ports() -> tuple[int, int, str]:
    """KServe's ports (REST 8080, gRPC 9000), or two free ones where this host has those taken
    (host networking: the container's ports are the host's); the third value says which."""
    taken = []
    for port in (8080, 9000):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                taken.append(port)
    if not taken:
        return 8080, 9000, "KServe's ports 8080 and 9000"
    rest, grpc_port = sf.free_port(), sf.free_port()
    return rest, grpc_port, f"ports {rest} and {grpc_port} ({taken} taken on this host)"


@needs_image
def test_kserve_tf_serving_arguments_run_unchanged_answer_rest_grpc_and_health(tmp_path):
    import grpc
    import requests
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    base = sf.export_dense(str(tmp_path))
    for root, dirs, files in os.walk(tmp_path):  # the container's user reads the export
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755)
    os.chmod(tmp_path, 0o755)
    rest, grpc_port, which = _kserve_ports()
    if (rest, grpc_port) != (8080, 9000):
        warnings.warn(f"KServe's arguments run on {which}", stacklevel=1)
    name = f"estimax-image-test-{os.getpid()}"
    # KServe's stock TF Serving runtime (config/runtimes/kserve-tensorflow-serving.yaml): its
    # command and arguments as they are, as user 1000 (its securityContext), the model at
    # /mnt/models (the storage initializer's folder).
    server = subprocess.Popen(
        [
            *RUN,
            f"--name={name}",
            "--user=1000",
            f"--volume={base}:/mnt/models:ro",
            IMAGE,
            "tensorflow_model_server",
            f"--port={grpc_port}",
            f"--rest_api_port={rest}",
            "--model_name=dense",
            "--model_base_path=/mnt/models",
            "--rest_api_timeout_in_ms=60000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # From outside the container, on the host's address (TF Serving binds every interface).
    host = _host_address()
    url = f"http://{host}:{rest}"
    try:

        def ready() -> bool:
            assert server.poll() is None, server.communicate()[0][-3000:]
            try:
                return requests.get(f"{url}/v1/models/dense", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        sf.wait_until(ready, "the container's server to be ready", timeout=300)
        top = subprocess.run(
            [*PODMAN, "top", name, "user", "args"], capture_output=True, text=True, timeout=60
        )
        assert top.returncode == 0, top.stderr
        assert any("tensorflow_model_server" in line for line in top.stdout.splitlines()[1:])
        users = {line.split()[0] for line in top.stdout.splitlines()[1:] if line.strip()}
        assert users == {"1000"} or users == {"estimax"}, top.stdout
        status = requests.get(f"{url}/v1/models/dense", timeout=30).json()
        assert status["model_version_status"][0]["state"] == "AVAILABLE", status
        images, _ = sf.make_jpegs(2)
        body = {"instances": [{"b64": base64.b64encode(i).decode()} for i in images]}
        answer = requests.post(f"{url}/v1/models/dense:predict", json=body, timeout=60)
        assert answer.status_code == 200, answer.text[:500]
        assert len(answer.json()["predictions"]) == 2
        target = f"{host}:{grpc_port}"
        reply = sf.grpc_predict(target, sf.tf_predict_request("dense", images))
        assert list(reply.outputs["classes"].tensor_shape.dim)[0].size == 2
        assert reply.model_spec.name == "dense"
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "dense"):  # the server, and the model by its name
                check = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
                assert check.status == health_pb2.HealthCheckResponse.SERVING, service
    finally:
        subprocess.run([*PODMAN, "stop", "--time=10", name], capture_output=True, timeout=120)
        server.wait(timeout=120)


def _host_address() -> str:
    """This host's own non-loopback address (where a pod's network would reach it), else the
    loopback one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: it picks the route's address
            address = s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
    return address if not address.startswith("127.") else "127.0.0.1"


@needs_image
def test_two_containers_given_kubeflow_jax_variables_train_one_job(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    os.chmod(model_dir, 0o777)  # the containers' user writes the shared --model_dir
    port = sf.free_port()
    names = [f"estimax-image-test-{os.getpid()}-{i}" for i in (0, 1)]
    try:
        procs = _train_together(model_dir, port, names)
    finally:  # a killed `podman run` leaves its container: remove it
        subprocess.run([*PODMAN, "rm", "--force", *names], capture_output=True, timeout=120)
    for i, p in enumerate(procs):
        assert p.returncode == 0, p.stderr[-4000:]
        log = p.stdout + p.stderr
        assert (
            "Launch: jax_env ($JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID): "
            f"process {i} of 2, coordinator 127.0.0.1:{port}."
        ) in log, log[-4000:]
        assert f"Joined a JAX job of 2 processes as process {i}; 1 of its 2 devices" in log
    # One job, one checkpoint at its last step (written by both processes together).
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["2"], os.listdir(model_dir)


def _train_together(model_dir, port: int, names: list[str]) -> list[mh.Proc]:
    return mh.finish(
        [
            subprocess.Popen(
                [
                    *RUN,
                    f"--name={names[i]}",
                    f"--volume={model_dir}:/job/model",
                    "--env=JAX_PLATFORMS=cpu",
                    "--env=XLA_FLAGS=--xla_force_host_platform_device_count=1",
                    f"--env=JAX_COORDINATOR_ADDRESS=127.0.0.1:{port}",
                    "--env=JAX_NUM_PROCESSES=2",
                    f"--env=JAX_PROCESS_ID={i}",
                    IMAGE,
                    "estimax",
                    "train",
                    "--family=resnet",
                    "--coordinator_address=auto",
                    "--data_dir=fake",
                    "--model_dir=/job/model",
                    "--mode=train",
                    "--resnet_depth=18",
                    "--image_size=32",
                    "--train_batch_size=8",
                    "--train_steps=2",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in (0, 1)
        ],
        timeout=900,
    )
