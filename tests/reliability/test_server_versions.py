"""Versions that must not be served as they are: damaged after the export, copied in out of
order, named past int64 or in other scripts' digits.

A version is served only once its stored check (``export_check.json``: the export's own
examples and predictions) passes on the loaded files; the previous version keeps serving
meanwhile; a refused or incomplete version is retried when its files change, never on every
poll. Each case runs in a real ``estimax serve`` process, asked by real clients (``requests``
and the TF Serving gRPC client), and by the model manager alone where counting its loads says
more. Each is one record (kind ``attack``) in the reliability report.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("grpc")
requests = pytest.importorskip("requests")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import serving_fixtures as fx  # noqa: E402

from estimax import export  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "tiny"
POLL = "--file_system_poll_wait_seconds=0.2"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, dense_export):
    """Version 1 of the small raw-image model (with its stored check) and a few images."""
    root = tmp_path_factory.mktemp("server_versions")
    base = dense_export(str(root))
    images, _ = fx.make_jpegs(4, seed=11)
    return {"version": os.path.join(base, "1"), "images": images}


def flip_a_weight(variables: str) -> None:
    """Flips one bit of ``variables.msgpack`` in place: a weight's top exponent bit."""
    from flax import serialization

    with open(variables, "rb") as f:
        data = bytearray(f.read())
    leaves = []

    def walk(tree):
        for value in tree.values():
            walk(value) if isinstance(value, dict) else leaves.append(np.asarray(value))

    walk(serialization.msgpack_restore(bytes(data)))
    kernel = max(leaves, key=lambda a: a.size)
    assert kernel.dtype == np.float32, kernel.dtype
    at = data.find(kernel.tobytes())
    assert at >= 0
    data[at + 4 * 100 + 3] ^= 0x40  # element 100, little-endian: its exponent's highest bit
    with open(variables, "wb") as f:
        f.write(data)


def publish(source: str, base, version: int, damage=None) -> None:
    """Copies ``source`` to ``base/version`` in one rename (after ``damage(staging)``)."""
    staging = os.path.join(base, f".staging-{version}")
    shutil.copytree(source, staging)
    if damage is not None:
        damage(staging)
    os.rename(staging, os.path.join(base, str(version)))


def states(url):
    body = requests.get(f"{url}/v1/models/{NAME}", timeout=30).json()
    return {
        s["version"]: (s["state"], s["status"]["error_message"])
        for s in body["model_version_status"]
    }


def state(url, version: str) -> str:
    return states(url).get(version, ("",))[0]


def rest_predict(url, images):
    body = {"instances": [{"b64": base64.b64encode(b).decode()} for b in images]}
    r = requests.post(f"{url}/v2/models/{NAME}/infer", json=_v2(images), timeout=60)
    assert r.status_code == 200, r.text
    out = {o["name"]: o["data"] for o in r.json()["outputs"]}
    tf = requests.post(f"{url}/v1/models/{NAME}:predict", json=body, timeout=60)
    assert tf.status_code == 200, tf.text
    return r.json()["model_version"], out["classes"], np.asarray(out["probabilities"])


def _v2(images):
    data = [base64.b64encode(b).decode() for b in images]
    return {
        "inputs": [{"name": "image_bytes", "shape": [len(data)], "datatype": "BYTES", "data": data}]
    }


def with_version_1(exported, tmp_path):
    """A model base path holding version 1, and a free port for the server's gRPC."""
    base = tmp_path / "models"
    publish(exported["version"], base, 1)
    return base, fx.free_port()


def grpc_version(target, images):
    """The version TF Serving's gRPC client is answered by."""
    reply = fx.grpc_predict(target, fx.tf_predict_request(NAME, images))
    return reply.model_spec.version.value


def test_a_damaged_version_is_refused_and_retried_only_when_its_files_change(
    exported, tmp_path, reliability_record
):
    images = exported["images"]
    base, grpc_port = with_version_1(exported, tmp_path)
    log = tmp_path / "server.log"
    # --num_versions=2: version 2 stays wanted while version 3 loads.
    args = fx.serve_flags(base, NAME, grpc_port, POLL, "--num_versions=2")
    ok = False
    try:
        with fx.running_server(args, log_path=str(log)) as (url, _):
            version, classes, probabilities = rest_predict(url, images)
            assert version == "1"
            # A bit flipped in the weights after the export: loads, but its check fails.
            publish(
                exported["version"],
                base,
                2,
                damage=lambda d: flip_a_weight(os.path.join(d, "variables.msgpack")),
            )
            fx.wait_until(lambda: state(url, "2") == "END", "version 2 refused")
            error = states(url)["2"][1]
            assert "ExportCheckError" in error and "differs" in error, error
            # Version 1 keeps answering, the same, on every protocol.
            again = rest_predict(url, images)
            assert again[0] == "1" and again[1] == classes
            np.testing.assert_allclose(again[2], probabilities, rtol=1e-6)
            assert grpc_version(f"127.0.0.1:{grpc_port}", images) == 1
            # Unchanged, it is not loaded again, however many polls (version 3 took some).
            publish(exported["version"], base, 3)
            fx.wait_until(lambda: state(url, "3") == "AVAILABLE", "version 3")
            assert log.read_text().count("version 2 failed to load") == 1
            # Repaired (its files change): retried, checked, served beside version 3.
            shutil.copy(
                os.path.join(exported["version"], "variables.msgpack"),
                base / "2" / "variables.msgpack",
            )
            fx.wait_until(lambda: state(url, "2") == "AVAILABLE", "version 2 loaded")
            assert "its stored check passed" in log.read_text()
            assert rest_predict(url, images)[0] == "3"
        ok = True
    finally:
        reliability_record("attack", "server: bit-flipped version", 1, ok)


def test_a_version_copied_in_out_of_order_is_served_once_complete(
    exported, tmp_path, reliability_record
):
    images = exported["images"]
    base, grpc_port = with_version_1(exported, tmp_path)
    ok = False
    try:
        with fx.running_server(fx.serve_flags(base, NAME, grpc_port, POLL)) as (url, _):
            # A copy that writes serving.json first (the marker), then the rest one by one.
            target = base / "2"
            target.mkdir()
            source = exported["version"]
            shutil.copy(os.path.join(source, "serving.json"), target)
            fx.wait_until(lambda: state(url, "2") == "END", "the incomplete version")
            assert "model.jaxexport is missing" in states(url)["2"][1]
            assert rest_predict(url, images)[0] == "1"
            for name in sorted(os.listdir(source)):
                if name != "serving.json":
                    shutil.copy(os.path.join(source, name), target)
            fx.wait_until(lambda: state(url, "2") == "AVAILABLE", "version 2")
            assert rest_predict(url, images)[0] == "2"
            assert grpc_version(f"127.0.0.1:{grpc_port}", images) == 2
        ok = True
    finally:
        reliability_record("attack", "server: version copied out of order", 1, ok)


def test_folders_that_are_no_int64_version_are_not_served(exported, tmp_path, reliability_record):
    images = exported["images"]
    base, grpc_port = with_version_1(exported, tmp_path)
    names = [str(2**64), str(2**63), "\u0662", "\u00b2", "0" * 30 + "2", "02"]
    ok = False
    try:
        with fx.running_server(fx.serve_flags(base, NAME, grpc_port, POLL)) as (url, _):
            for name in names:
                publish(exported["version"], base, name)  # type: ignore[arg-type]
            publish(exported["version"], base, 2)  # a real one, published after them
            fx.wait_until(lambda: state(url, "2") == "AVAILABLE", "version 2")
            assert set(states(url)) == {"1", "2"}
            assert grpc_version(f"127.0.0.1:{grpc_port}", images) == 2
            assert rest_predict(url, images)[0] == "2"
        assert export.list_versions(str(base)) == [1, 2]
        ok = True
    finally:
        reliability_record("attack", "server: version names past int64", len(names), ok)


def test_the_manager_loads_an_unchanged_failed_version_once(exported, tmp_path):
    """Counted at the manager: an incomplete version is tried once per change of its files."""
    from estimax.export.servable import Servable
    from estimax.serving.manager import ModelManager

    loads = []

    def load(path, version, sizes):
        loads.append(version)
        return Servable(path, version, sizes)

    base = tmp_path / "models"
    base.mkdir()
    target = base / "5"
    target.mkdir()
    source = exported["version"]
    shutil.copy(os.path.join(source, "serving.json"), target)
    manager = ModelManager(NAME, str(base), [1], poll_wait_seconds=0, load=load)
    for _ in range(3):
        manager.poll()
    assert loads == [5] and manager.states()[0].state == "END"
    for name in ("signature.json", "model.jaxexport"):
        shutil.copy(os.path.join(source, name), target)
        manager.poll()
        manager.poll()
    assert loads == [5, 5, 5] and manager.get() is None  # still no variables
    for name in ("variables.msgpack", "export_check.json"):
        shutil.copy(os.path.join(source, name), target)
    manager.poll()
    assert manager.get() is not None and manager.states()[0].state == "AVAILABLE"


def _non_regular(path: str, kind: str) -> None:
    """Puts a file that is no regular file at ``path``: a FIFO (its reader blocks until
    something writes), a device (``/dev/null`` through a symlink), a UNIX socket, a folder."""
    import socket
    import tempfile

    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.symlink("/dev/null", path)
    elif kind == "socket":  # bound where its path is short (108 bytes at most), then moved
        short = tempfile.mkdtemp(dir="/tmp")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(short, "s"))
            os.rename(os.path.join(short, "s"), path)
        os.rmdir(short)
    else:
        os.mkdir(path)


def test_files_that_are_not_regular_are_refused_at_once_and_the_others_load(
    exported, tmp_path, reliability_record
):
    """Each file of a version (the program, the weights, the signature, serving.json, the
    stored check, the warm-up records) as a FIFO, a device, a socket and a folder, one version
    each: a FIFO once blocked the only loading thread for ever. Every such version is refused
    at once, its error naming the file; the good version loads; no load waits for its time
    limit."""
    import threading

    from estimax.export import artifact
    from estimax.export import record as record_lib
    from estimax.export.versions import CHECK_FILE
    from estimax.serving import warmup
    from estimax.serving.core import ServerOptions, ServingCore
    from estimax.serving.manager import ModelManager, VersionPolicy

    files = [
        artifact.MODEL_FILE,
        artifact.VARIABLES_FILE,
        artifact.SIGNATURE_FILE,
        record_lib.SERVING_FILE,
        CHECK_FILE,
        f"{warmup.WARMUP_DIR}/{warmup.WARMUP_FILE}",
    ]
    kinds = ("fifo", "device", "socket", "folder")
    base = tmp_path / "models"
    shutil.copytree(exported["version"], base / "1")
    cases = {}
    for version, (name, kind) in enumerate(((f, k) for f in files for k in kinds), start=2):
        shutil.copytree(exported["version"], base / str(version))
        _non_regular(str(base / str(version) / name), kind)
        cases[version] = (name, kind)
    manager = ModelManager(NAME, str(base), [1], poll_wait_seconds=0, policy=VersionPolicy("all"))
    manager.load_timeout_s = 120.0  # a bound for a broken build; refused in milliseconds
    ServingCore(manager, ServerOptions())  # its warm-up replay, as the server runs it
    ok = False
    try:
        polled = threading.Thread(target=manager.poll, daemon=True)
        polled.start()
        polled.join(600)  # a bound for a broken build, not a wait
        assert not polled.is_alive(), "a version's load blocked"
        states = {s.version: s for s in manager.states()}
        assert states[1].state == "AVAILABLE", states[1].error
        for version, (name, kind) in cases.items():
            state = states[version]
            assert state.state == "END", (name, kind, state.state)
            assert "not a regular file" in state.error, (name, kind, state.error)
            assert f"{version}/{name}" in state.error and "longer than" not in state.error
        ok = True
    finally:
        reliability_record("fault", "version: FIFO, device, socket, folder", len(cases), ok)
