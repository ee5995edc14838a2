"""A hostile client against `estimax serve` (issue #42, server items 1-10): each attack ends in a
clear answer or one line naming the cause, the server serving on, nothing lost or echoed whole.

Most run against one real server process (``tests/serving_fixtures.py``) with real clients
(requests, raw sockets, grpcio); the rest call the piece that was wrong directly (the body
reader, the version loader, the class-name check), where a server would only add time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_fixtures as fx  # noqa: E402

from estimax.export import record as record_lib  # noqa: E402
from estimax.serving import core as core_lib  # noqa: E402
from estimax.serving import rest, tracking  # noqa: E402

NAME = "hostile"
CLASSES = ["cat", "dog", "bird"]
# A line a client tries to forge in the server's logs (after a CR/LF of its own).
FORGED = "2026-01-01 00:00:00,000 INFO estimax.serving.manager: FORGED"


# ----------------------------------------------------------------------------- in process
def test_class_names_are_checked_in_linear_time():
    """ImageNet-21k's 21,841 names took 11 s (each counted against the whole list)."""
    names = [f"n{i:08d}" for i in range(21_841)]
    outputs = {"probabilities": {"shape": [None, len(names)]}, "classes": {"shape": [None]}}
    start = time.perf_counter()
    assert record_lib.check_class_names(names, outputs, "x") == tuple(names)
    assert time.perf_counter() - start < 1.0  # linear: milliseconds; quadratic: seconds
    with pytest.raises(ValueError, match=r"repeat \['n00000007'\]"):
        record_lib.check_class_names([*names[:-1], "n00000007"], outputs, "x")


def test_class_names_that_are_not_unicode_are_refused_in_one_line():
    """A lone surrogate (``"\\udc80"`` in serving.json) has no UTF-8: every answer carrying it
    failed (gRPC INTERNAL, v2 binary 500). Refused when exported and when loaded."""
    outputs = {"probabilities": {"shape": [None, 3]}, "classes": {"shape": [None]}}
    with pytest.raises(ValueError) as e:
        record_lib.check_class_names(["cat", "\udc80", "bird"], outputs, "export_version")
    assert "class_names[1]" in str(e.value) and "not valid Unicode" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_fifo_in_a_version_is_refused_at_once(tmp_path):
    """Opening a FIFO blocks until something writes to it: the loader refuses it unopened."""
    from estimax.export import artifact

    version = tmp_path / "1"
    version.mkdir()
    for name in (artifact.VARIABLES_FILE, artifact.SIGNATURE_FILE):
        (version / name).write_bytes(b"")
    os.mkfifo(version / artifact.MODEL_FILE)
    os.mkfifo(version / record_lib.SERVING_FILE)
    errors: list = []

    def load(fn):
        try:
            fn(str(version))
        except ValueError as e:
            errors.append(str(e))

    for fn in (artifact.load, record_lib.read):
        thread = threading.Thread(target=load, args=(fn,), daemon=True)
        thread.start()
        thread.join(60)  # a bound for a broken build, not a wait: refused in microseconds
        assert not thread.is_alive(), f"{fn.__name__} blocked on a FIFO"
    assert len(errors) == 2 and all("not a regular file" in e for e in errors), errors


class _Fake:
    """A loaded version, as far as the manager looks at one."""

    def __init__(self, version: int):
        self.version = version
        self.model = self
        self.closed = False

    def warm(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def retire(self) -> None:
        pass


def test_a_version_whose_load_blocks_is_set_aside_and_the_others_load(tmp_path, caplog):
    """A load stuck for ever (a hung mount) once stopped the only loading thread: later versions
    never loaded, nothing was logged. Now it is set aside after the timeout, logged, the next
    versions load, and it is tried again once its load ends."""
    from estimax.serving.manager import ModelManager

    release = threading.Event()
    calls: list[int] = []

    def load(path, version, sizes):
        calls.append(version)
        if version == 2 and calls.count(2) == 1:
            release.wait()  # the hung mount, until the test lets go
        return _Fake(version)

    def publish(version: int) -> None:
        os.makedirs(tmp_path / str(version))
        (tmp_path / str(version) / record_lib.SERVING_FILE).write_text("{}")

    manager = ModelManager(NAME, str(tmp_path), [1], num_versions=3, poll_wait_seconds=0, load=load)
    manager.load_timeout_s = 0.5
    publish(1)
    manager.poll()
    publish(2)
    publish(3)
    polled = threading.Thread(target=manager.poll, daemon=True)
    polled.start()
    polled.join(60)  # a bound for a broken build: the poll ends after the 0.5 s load timeout
    assert not polled.is_alive(), "a blocking version stopped the loading thread"
    states = {s.version: s.state for s in manager.states()}
    assert states == {1: "AVAILABLE", 2: "END", 3: "AVAILABLE"}
    assert manager.get().version == 3
    (line,) = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    assert f"version 2 from {tmp_path}/2" in line and "set aside" in line
    manager.poll()  # still stuck: not loaded a second time beside it
    assert calls.count(2) == 1
    release.set()
    fx.wait_until(lambda: 2 not in manager._stuck, "the stuck load to end")
    manager.poll()
    assert {s.version: s.state for s in manager.states()}[2] == "AVAILABLE"
    assert calls.count(2) == 2


def _request(headers: dict[str, str], chunks: list[bytes], complete: bool = True):
    """A Starlette request whose body arrives as ``chunks`` (then, unless ``complete``, the
    client leaves)."""
    from starlette.requests import Request

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if complete:
        messages[-1]["more_body"] = False
    else:
        messages.append({"type": "http.disconnect"})

    async def receive():
        return messages.pop(0)

    return Request(scope, receive)


def test_a_declared_body_is_not_allocated_before_it_arrives():
    """64 MiB declared, one byte sent: the reader held a 64 MiB buffer (40 connections: 2 GiB)."""
    request = _request({"Content-Length": str(64 << 20)}, [b"{"], complete=False)
    tracemalloc.start()
    try:
        with pytest.raises(core_lib.ApiError) as e:
            asyncio.run(rest.read_body(request, 64 << 20, core_lib.BodyBudget(1 << 30)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.status == 499
    assert peak < 1 << 20, f"{peak} bytes held for a 1-byte body"


def test_bodies_in_flight_are_bounded_by_a_budget():
    """Past the budget a body answers 503 with Retry-After, and closes its connection; what a
    request held is given back when it is answered (ServingCore.track)."""
    from estimax.serving.manager import ModelManager

    core = core_lib.ServingCore(
        ModelManager(NAME, "/nonexistent", [1]),
        core_lib.ServerOptions(max_body_bytes=100, max_body_bytes_in_flight=150),
    )
    budget = core.bodies_in_flight
    first = tracking.RequestRecord("http", "/a")
    with core.track(first):
        body = asyncio.run(rest.read_body(_request({}, [b"a" * 60, b"b" * 40]), 100, budget))
        assert bytes(body) == b"a" * 60 + b"b" * 40 and budget.held == 100
        second = _request({}, [b"c" * 30, b"d" * 30])
        with core.track(tracking.RequestRecord("http", "/b")):
            with pytest.raises(core_lib.ApiError) as e:
                asyncio.run(rest.read_body(second, 100, budget))
        assert e.value.status == 503 and "--max_body_bytes_in_flight=150" in e.value.message
        assert second.scope[rest.BODY_UNREAD] and budget.held == 100  # the 503's 30 given back
    assert budget.held == 0
    # The app's answer past the budget: 503, Retry-After (as a full queue's 429), and the
    # connection closed (the rest of the body was never read).
    import contextlib

    from estimax.serving import bodies

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield

    app = rest.build_app(core, bodies.JsonWorkers(), lifespan)
    assert budget.take(150)  # other requests' bodies hold the whole budget
    for path in (f"/v1/models/{NAME}:predict", f"/v2/models/{NAME}/infer"):
        status, headers = _asgi(app, path, "POST", b'{"instances": [1]}')
        assert status == 503, (path, status)
        assert headers["retry-after"] == str(core_lib.RETRY_AFTER_SECONDS) == "1", headers
        assert headers["connection"] == "close", headers
    assert budget.held == 150  # nothing charged for the bodies refused
    budget.give(150)
    with pytest.raises(ValueError, match="--max_body_bytes_in_flight=10 is less than"):
        core_lib.ServerOptions(max_body_bytes=100, max_body_bytes_in_flight=10).validate()


def test_log_text_is_one_line_escaped_and_bounded():
    nasty = f"/v1/models/x\r\n{FORGED}\x1b[31m\x9b2J\u2028\udc80" + "y" * 5000
    for json_lines in (False, True):
        line = tracking.RequestRecord("http", nasty, model="m\nFORGED").access_line(json_lines)
        assert len(line.splitlines()) == 1 and len(line) < 3000
        assert not re.search("[\x00-\x1f\x9b\u2028\ud800-\udfff]", line), line[:200]
        line.encode("utf-8")
    text = tracking.printable(nasty)
    assert text.startswith("/v1/models/x\\r\\n2026") and "\\x1b[31m\\x9b2J\\u2028\\udc80" in text
    assert text.endswith(f"... ({len(nasty)} chars)")


def test_echoed_input_is_cut_with_its_length():
    message = core_lib.ApiError(400, f"x {core_lib.echo('s' * 10**6)} y").message
    assert len(message) < 300 and "(1000000 chars)" in message
    names = core_lib.echo_names([f"k{i}" * 1000 for i in range(50)])
    assert len(names) < 2600 and "and 40 more" in names
    assert len(core_lib.ApiError(400, "z" * 10**6).message) < core_lib.MESSAGE_CHARS + 40
    # A JSON null where a string belongs (`"signature_name": null`, found by schemathesis) is
    # quoted, not a 500.
    assert core_lib.cut(None) == "None" and core_lib.cut("a" * 300).endswith("(300 chars)")


def _asgi(app, path: str, method: str = "GET", body: bytes = b"") -> tuple[int, dict]:
    """The status and headers ``app`` answers a request with (no server: the app's answer
    only)."""
    sent: list = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"localhost"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    headers = {k.decode().lower(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers


def _asgi_get(app, path: str) -> int:
    """The status ``app`` answers a GET of ``path`` with."""
    return _asgi(app, path)[0]


def test_api_docs_are_served_only_when_asked_for():
    """Swagger UI and ReDoc load scripts from a public CDN: off by default (--api_docs)."""
    import contextlib

    from estimax.serving import bodies
    from estimax.serving.manager import ModelManager

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield

    for docs, status in ((False, 404), (True, 200)):
        core = core_lib.ServingCore(
            ModelManager(NAME, "/nonexistent", [1]), core_lib.ServerOptions(api_docs=docs)
        )
        app = rest.build_app(core, bodies.JsonWorkers(), lifespan)
        assert (_asgi_get(app, "/docs"), _asgi_get(app, "/redoc")) == (status, status)
        assert _asgi_get(app, "/openapi.json") == 200


# ----------------------------------------------------------------------------- one server
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    base = fx.export_dense(str(root), class_names=CLASSES)
    grpc_port = fx.free_port()
    log_path, access = str(root / "server.log"), str(root / "access.log")
    args = fx.serve_flags(base, NAME, grpc_port, f"--access_log_file={access}")
    with fx.running_server(args, log_path=log_path) as (url, proc):
        yield {
            "url": url,
            "proc": proc,
            "grpc": f"127.0.0.1:{grpc_port}",
            "log": log_path,
            "access": access,
            "base": base,
            "root": root,
        }


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return f.read()


def _raw(url: str, data: bytes) -> bytes:
    """One request on a raw socket; the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_declared_but_unsent_bodies_do_not_grow_the_server(served):
    url, proc = served["url"], served["proc"]
    host, port = url.removeprefix("http://").split(":")
    ps = psutil.Process(proc.pid)
    requests.get(url + "/v2/health/ready", timeout=30)
    before = ps.memory_info().rss
    cancelled = _read(served["access"]).count("status=499")
    socks = []
    try:
        for _ in range(12):
            s = socket.create_connection((host, int(port)), timeout=60)
            s.sendall(
                f"POST /v1/models/{NAME}:predict HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {64 << 20}\r\n\r\n{{".encode()
            )
            socks.append(s)
        # Answers on another connection: the loop has run every stalled body's reader by then.
        for _ in range(3):
            assert requests.get(url + "/v2/health/live", timeout=30).status_code == 200
        grown = (ps.memory_info().rss - before) / 2**20
    finally:
        for s in socks:
            s.close()
    # Each left request is one access line (499), written once the server sees it leave.
    fx.wait_until(
        lambda: _read(served["access"]).count("status=499") >= cancelled + len(socks), "499s"
    )
    # 12 declared 64 MiB bodies held 768 MiB; a byte each holds nothing measurable.
    assert grown < 48, f"{grown:.0f} MiB for 12 one-byte bodies"
    assert proc.poll() is None


def test_client_strings_never_forge_or_break_a_log_line(served):
    import grpc

    from estimax.serving.protos.tensorflow_serving.apis import (
        get_model_status_pb2,
        model_management_pb2,
        model_service_pb2_grpc,
    )
    from estimax.serving.protos.tensorflow_serving.config import model_server_config_pb2

    url = served["url"]
    lines_before = len(_read(served["access"]).splitlines())
    forged = "x%0D%0A" + FORGED.replace(" ", "%20") + "%1B%5B2J%0Dz"
    for path in (f"/v1/models/{forged}", f"/v2/models/{forged}/ready"):
        r = requests.get(url + path, timeout=30)
        assert r.status_code == 404 and "error" in r.json()
    with grpc.insecure_channel(served["grpc"]) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelStatus(
                get_model_status_pb2.GetModelStatusRequest(
                    model_spec={"name": f"x\r\n{FORGED}\x1b]0;owned\x07"}
                ),
                timeout=30,
            )
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    fx.wait_until(
        lambda: len(_read(served["access"]).splitlines()) >= lines_before + 3, "access lines"
    )
    access = _read(served["access"]).splitlines()[lines_before:]
    assert len(access) == 3, access  # one request, one line
    # A model named with CR/LF/ESC in HandleReloadConfigRequest (issue #54, cause 7): refused,
    # the served model kept (listed too, so nothing else would change were it taken).
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.config.add(name=NAME, base_path=served["base"])
    config.model_config_list.config.add(name=f"x\r\n{FORGED}\x1b[2J", base_path=served["base"])
    with grpc.insecure_channel(served["grpc"]) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.HandleReloadConfigRequest(
                model_management_pb2.ReloadConfigRequest(config=config), timeout=60
            )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "control character" in e.value.details() and e.value.details().isprintable()
    assert requests.get(f"{url}/v1/models/{NAME}", timeout=30).status_code == 200
    for text in (_read(served["log"]), _read(served["access"])):
        assert not any(line.startswith(FORGED[:23]) for line in text.splitlines())
        assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert "FORGED" in _read(served["log"])  # written, escaped, on the request's own line


def test_echoed_input_is_cut_in_answers_and_log_lines(served):
    import grpc

    from estimax.serving.protos.tensorflow.core.framework import tensor_pb2

    url, big = served["url"], "s" * (20 << 20)
    log_size = os.path.getsize(served["log"])
    answers = [
        requests.post(
            f"{url}/v1/models/{NAME}:predict",
            data=json.dumps({"signature_name": big, "instances": [1]}),
            timeout=60,
        ),
        requests.post(
            f"{url}/v1/models/{NAME}:predict",
            data=json.dumps({"instances": [{big[: 1 << 20]: 1}]}),
            timeout=60,
        ),
        requests.post(
            f"{url}/v1/models/{NAME}:classify",
            data=json.dumps({"examples": [{big[: 1 << 20]: [1.0]}]}),
            timeout=60,
        ),
    ]
    for r in answers:
        assert r.status_code == 400 and len(r.content) < 1000, r.content[:300]
        assert "chars)" in r.json()["error"]
    request = fx.tf_predict_request(NAME, [b"x"])
    request.inputs[big[: 1 << 20]].CopyFrom(tensor_pb2.TensorProto(dtype=7))
    with pytest.raises(grpc.RpcError) as e:
        fx.grpc_predict(served["grpc"], request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 1000
    fx.wait_until(lambda: os.path.getsize(served["log"]) > log_size, "the warnings")
    with open(served["log"], "rb") as f:
        f.seek(log_size)
        written = f.read()
    assert max(len(line) for line in written.splitlines()) < 8000
    assert len(written) < 64 << 10


def test_no_redirect_is_built_from_the_host_header(served):
    url = served["url"]
    for path in ("/v2/health/live/", f"/v1/models/{NAME}/"):
        r = requests.get(
            url + path, headers={"Host": "evil.example"}, allow_redirects=False, timeout=30
        )
        assert r.status_code == 404 and "location" not in r.headers, (path, r.headers)
    assert requests.get(url + "/v2/health/live", timeout=30).status_code == 200
    assert requests.get(url + "/docs", timeout=30).status_code == 404
    assert requests.get(url + "/redoc", timeout=30).status_code == 404


def test_a_version_with_names_that_are_not_unicode_is_refused_at_load(served, tmp_path):
    from estimax.export.servable import Servable

    version = tmp_path / "1"
    shutil.copytree(os.path.join(served["base"], "1"), version)
    path = version / record_lib.SERVING_FILE
    data = json.loads(path.read_text())
    data["class_names"][1] = "\udc80"
    path.write_text(json.dumps(data))  # written as the escape "\udc80", valid JSON
    with pytest.raises(ValueError, match=r"class_names\[1\] = '\\udc80' is not valid Unicode"):
        Servable(str(version))


def test_the_access_log_is_reopened_after_rotation_and_sighup_never_ends_the_server(served):
    url, proc, access = served["url"], served["proc"], served["access"]
    requests.get(url + "/v2/health/live", timeout=30)
    rotated = access + ".1"
    os.rename(access, rotated)  # logrotate's default: move, then the server writes a new file
    assert requests.get(url + "/v2/health/ready", timeout=30).status_code == 200
    fx.wait_until(lambda: os.path.exists(access) and "/v2/health/ready" in _read(access), "new")
    assert "/v2/health/ready" not in _read(rotated).splitlines()[-1]
    os.rename(access, rotated + "2")
    proc.send_signal(signal.SIGHUP)  # logrotate's postrotate, as for nginx
    fx.wait_until(lambda: "SIGHUP" in _read(served["log"]), "the SIGHUP line")
    assert proc.poll() is None, "SIGHUP ended the server"
    assert os.path.exists(access)  # reopened at once, before any line
    assert requests.get(url + "/v2/health/live", timeout=30).status_code == 200
    fx.wait_until(lambda: "/v2/health/live" in _read(access), "a line in the reopened file")
    image = base64.b64encode(fx.make_jpegs(1)[0][0]).decode()
    r = requests.post(
        f"{url}/v1/models/{NAME}:predict", json={"instances": [{"b64": image}]}, timeout=60
    )
    assert r.status_code == 200 and np.isclose(
        sum(r.json()["predictions"][0]["probabilities"]), 1.0, atol=1e-5
    )
