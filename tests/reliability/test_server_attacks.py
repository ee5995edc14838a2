"""Hostile clients against a real ``estimax serve`` process: connections that stall or never
speak, bodies that stop before their last byte, numbers, versions and shapes that are no
integers a model could take, repeated outputs, huge JSON, requests that time out mid-decode.

Every attack must be answered 4xx/429/503 (never a 500: no attack is the server's fault), good
clients (``requests``, ``tritonclient``, the TF Serving gRPC client) must keep being answered
meanwhile, connections must be closed within the limits the server was started with (waited
for with deadlines, never slept for), and the server's memory (RSS) must come back to within
10% of where it started. Each attack is one record (kind ``attack``) in the reliability report.

The server runs with short limits so that the test waits seconds, not minutes:
header 4 s, body 6 s, keep-alive 1 s, and an open-file limit of 256 (``ulimit -n``), which
lowers its connection cap to fit.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")
psutil = pytest.importorskip("psutil")
grpc = pytest.importorskip("grpc")
triton_http = pytest.importorskip("tritonclient.http")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import serving_fixtures as fx  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "tiny"
# Long enough that a server busy with the other attacks on a loaded 2-core machine reaches each
# connection's headers before the header timeout (at 1.5 s, CI saw a 408 where the test wanted
# the 431 of oversized headers, and stalled bodies closed for their headers).
HEADER_S, BODY_S, KEEP_ALIVE_S = 4.0, 6.0, 1.0
OPEN_FILES = 256
# A deadline's slack over a stated timeout on a loaded 2-core machine (the timers themselves
# fire on time: tests/test_serving_limits.py checks them on a clock the test moves).
SLACK_S = 10.0


@pytest.fixture(scope="module")
def served(tmp_path_factory, dense_export):
    """The server, under short limits and ``ulimit -n 256``, warmed up; its RSS then."""
    root = tmp_path_factory.mktemp("server_attacks")
    grpc_port = fx.free_port()
    args = fx.serve_flags(
        dense_export(str(root)),
        NAME,
        grpc_port,
        f"--rest_api_header_timeout_in_ms={HEADER_S * 1000:.0f}",
        f"--rest_api_body_timeout_in_ms={BODY_S * 1000:.0f}",
        f"--rest_api_keep_alive_timeout_in_ms={KEEP_ALIVE_S * 1000:.0f}",
        "--rest_api_timeout_in_ms=1000",
        "--metrics_path=/metrics",
    )
    log = root / "server.log"
    with fx.running_server(args, log_path=str(log), open_files=OPEN_FILES) as (url, proc):
        images, _ = fx.make_jpegs(2, seed=4)
        server = Served(url, proc, f"127.0.0.1:{grpc_port}", images, log)
        server.good()  # warm: the JSON workers, the compiled batch sizes, the allocator
        server.good()
        server.rss_start = server.rss()
        yield server


class Served:
    """The running server, its good clients and its memory."""

    def __init__(self, url, proc, grpc_target, images, log):
        self.url, self.proc, self.grpc, self.images, self.log = url, proc, grpc_target, images, log
        self.port = int(url.rsplit(":", 1)[1])
        self.rss_start = 0

    def rss(self) -> int:
        """Its resident anonymous memory (not the code pages it has run: see the fixture)."""
        return fx.anonymous_rss(self.proc.pid)

    def good(self) -> None:
        """One request of each good client, each answered correctly."""
        body = {"instances": [{"b64": base64.b64encode(self.images[0]).decode()}]}
        r = requests.post(f"{self.url}/v1/models/{NAME}:predict", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert np.isclose(sum(r.json()["predictions"][0]["probabilities"]), 1.0, atol=1e-5)
        client = triton_http.InferenceServerClient(self.url.removeprefix("http://"))
        try:
            tensor = triton_http.InferInput("image_bytes", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([self.images[0]], dtype=object))
            result = client.infer(NAME, [tensor])
            assert result.as_numpy("classes").shape == (1,)
        finally:
            client.close()
        reply = fx.grpc_predict(self.grpc, tf_request(self.images[:1]))
        assert np.isclose(sum(reply.outputs["probabilities"].float_val), 1.0, atol=1e-5)

    def raw(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        return s

    def memory_comes_back(self) -> None:
        """Waits (with a deadline) for the anonymous RSS to come back near its start.

        Near: within 32 MiB (or 10%, if more) of it. An attack's bodies were 60 MB and more, and
        what held them (a body, its pickled copy, its parsed lists: 100 MB for the 60 MB one)
        held 70-150 MiB when it failed; what a loaded runner's new threads and arenas add
        (measured: 16 MiB at load 8 on 2 cores) is not a body held.
        """
        limit = self.rss_start + max(32 << 20, self.rss_start // 10)
        what = f"anonymous RSS within {(limit - self.rss_start) >> 20} MiB of its start"
        try:
            fx.wait_until(lambda: self.rss() <= limit, what, timeout=60)
        except AssertionError as e:
            raise AssertionError(
                f"{e}: {self.rss() >> 20} MiB, was {self.rss_start >> 20} MiB"
            ) from None
        assert self.proc.poll() is None, "the server died"


def tf_request(images, dims=None, outputs=()):
    return fx.tf_predict_request(NAME, images, dims, outputs)


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server wrote before closing ``sock``; fails if it is still open by then."""
    sock.settimeout(seconds)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        pytest.fail(f"still open after {seconds} s: {out[:200]!r}")
    except ConnectionResetError:
        pass
    return out


@contextlib.contextmanager
def recorded(reliability_record, target, count):
    """One ``attack`` record, ok if the block passed; the block may add details to it."""
    ok, detail = False, {}
    try:
        yield detail
        ok = True
    finally:
        reliability_record("attack", target, count, ok, **detail)


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return round(time.monotonic() - start, 3)


# ----------------------------------------------------------------------------- connections
def test_silent_connections_past_the_open_file_limit_do_not_lock_out_good_clients(
    served, reliability_record
):
    count = 300  # more than the server has file descriptors
    with recorded(reliability_record, "server: silent connections", count + 20) as detail:
        detail["good_s_before"] = timed(served.good)
        before = _closed_for(served, "max_connections")
        silent = [served.raw() for _ in range(count)]
        # At once, not after the header timeout: the longest-silent connections make room.
        detail["good_s_during"] = timed(served.good)
        cap = int(served.log.read_text().split("lowered to ")[1].split(" ")[0])
        assert cap < count  # the cap fits ulimit -n 256 (the log says so)
        assert _closed_for(served, "max_connections") - before >= count - cap
        for s in silent:
            assert closed_within(s, HEADER_S + SLACK_S) == b""  # nothing asked, nothing said
            s.close()
        # The gRPC port: a connection that never sends HTTP/2's preface is closed at the header
        # timeout too (gRPC's own handshake timeout waits 120 s).
        port = int(served.grpc.rsplit(":", 1)[1])
        grpc_silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for s in grpc_silent:
            closed_within(s, HEADER_S + SLACK_S)  # after gRPC's SETTINGS frame
            s.close()
        served.good()
        served.memory_comes_back()


def _closed_for(served, reason: str) -> float:
    """Connections the server closed so far on a limit (its metrics)."""
    text = requests.get(f"{served.url}/metrics", timeout=30).text
    key = f'estimax_serving_connections_closed_total{{reason="{reason}"}} '
    return float(text.split(key)[1].split()[0]) if key in text else 0.0


def test_stalled_bodies_get_408_and_their_memory_is_returned(served, reliability_record):
    clients, size = 10, 20 << 20
    with recorded(reliability_record, "server: bodies stalled before the end", clients) as detail:
        head = (
            f"POST /v1/models/{NAME}:predict HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
        ).encode()
        # On a loaded machine the server, busy reading the other bodies, can reach a connection's
        # headers only after the header timeout: closed for that limit instead (seen in CI).
        reasons = ("body_timeout", "header_timeout")
        before = sum(_closed_for(served, r) for r in reasons)
        socks = [served.raw() for _ in range(clients)]

        def stall(s):
            with contextlib.suppress(OSError):  # closed first if the server reads too slowly
                s.sendall(head + b"x" * (size - 1))  # all but the last byte

        senders = [threading.Thread(target=stall, args=(s,)) for s in socks]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        detail["rss_mib_held"] = served.rss() >> 20
        detail["good_s_during"] = timed(served.good)  # answered while the bodies are held
        for s in socks:
            # The 408, unless the client's last bytes were still unread when the server
            # closed (the kernel then resets the connection instead of delivering it).
            answer = closed_within(s, BODY_S + SLACK_S)
            assert not answer or answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert not answer or b"_timeout_in_ms" in answer
            s.close()
        assert sum(_closed_for(served, r) for r in reasons) - before == clients
        served.memory_comes_back()


def test_slow_idle_and_oversized_headers_are_closed_at_their_limits(served, reliability_record):
    with recorded(reliability_record, "server: slow, idle, oversized headers", 3):
        slow = served.raw()
        slow.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        answer = closed_within(slow, HEADER_S + SLACK_S)
        assert answer.startswith(b"HTTP/1.1 408") and b"header_timeout_in_ms" in answer
        idle = served.raw()
        idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = closed_within(idle, KEEP_ALIVE_S + SLACK_S)  # answered, then closed idle
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"live":true}')
        big = served.raw()
        big.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Big: " + b"a" * (80 << 10) + b"\r\n")
        with contextlib.suppress(OSError):  # the server may close before all is sent
            big.sendall(b"X-More: a\r\n")
        assert closed_within(big, SLACK_S).startswith(b"HTTP/1.1 431")
        served.good()


# ----------------------------------------------------------------------------- inputs
def _v2_image(shape, data=None, outputs=None):
    image = base64.b64encode(b"x").decode()
    body = {
        "inputs": [
            {"name": "image_bytes", "datatype": "BYTES", "shape": shape, "data": data or [image]}
        ]
    }
    if outputs is not None:
        body["outputs"] = outputs
    return json.dumps(body)


def hostile_http_requests(url):
    """(what, method, path, body text, headers) of every hostile HTTP request."""
    digits = "9" * 5000
    v1, v2 = f"{url}/v1/models/{NAME}", f"{url}/v2/models/{NAME}"
    return [
        ("arabic-indic digit version", "GET", f"{v1}/versions/\u0661/metadata", None, {}),
        ("superscript version", "GET", f"{v1}/versions/\u00b2/metadata", None, {}),
        ("5000-digit version", "GET", f"{v1}/versions/{digits}/metadata", None, {}),
        ("v2 superscript version", "GET", f"{v2}/versions/\u00b2/ready", None, {}),
        ("v2 5000-digit version", "POST", f"{v2}/versions/{digits}/infer", _v2_image([1]), {}),
        ("5000-digit number", "POST", f"{v2}/infer", _v2_image([1]).replace("[1]", digits), {}),
        ("5000-digit instance", "POST", f"{v1}:predict", f'{{"instances": [{digits}]}}', {}),
        ("10000-dimension shape", "POST", f"{v2}/infer", _v2_image([1] * 10000), {}),
        ("2^64 dimension", "POST", f"{v2}/infer", _v2_image([1, 2**64]), {}),
        (
            "output repeated 200,000 times",
            "POST",
            f"{v2}/infer",
            _v2_image([1], outputs=[{"name": "classes"}] * 200_000),
            {},
        ),
        (
            "superscript header length",
            "POST",
            f"{v2}/infer",
            _v2_image([1]),
            {"Inference-Header-Content-Length": "\u00b2"},
        ),
        (
            "5000-digit header length",
            "POST",
            f"{v2}/infer",
            _v2_image([1]),
            {"Inference-Header-Content-Length": digits},
        ),
    ]


def test_hostile_numbers_versions_shapes_and_outputs_get_4xx(served, reliability_record):
    http = hostile_http_requests(served.url)
    grpc_attacks = [
        ("10000-dimension TensorProto", tf_request(served.images[:1], dims=[1] * 10000)),
        ("2^63-1 dimension TensorProto", tf_request(served.images[:1], dims=[1, 2**63 - 1])),
        (
            "output_filter repeated 200,000 times",
            tf_request(served.images[:1], outputs=["classes"] * 200_000),
        ),
    ]
    with recorded(reliability_record, "server: hostile numbers and shapes", len(http) + 4):
        for what, method, url, body, headers in http:
            r = requests.request(method, url, data=body, headers=headers, timeout=60)
            assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
            assert len(r.json()["error"]) < 400, (what, r.text[:300])  # no 10,000-entry echo
        # A Content-Length of 5000 digits, on a raw socket (clients would not send it).
        s = served.raw()
        s.sendall(
            f"POST /v2/models/{NAME}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
            f"{'9' * 5000}\r\n\r\n{{}}".encode()
        )
        assert closed_within(s, SLACK_S).split(b" ")[1].startswith(b"4")
        for what, request in grpc_attacks:
            with pytest.raises(grpc.RpcError) as e:
                fx.grpc_predict(served.grpc, request)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.value)
        served.good()
        served.memory_comes_back()


def test_60mb_of_json_does_not_stall_the_other_requests(served, reliability_record):
    body = json.dumps({"inputs": np.random.default_rng(0).random(3_000_000).tolist()}).encode()
    assert len(body) > 55 << 20
    with recorded(reliability_record, "server: 60 MB of JSON", 1) as detail:
        answered, done = [], threading.Event()

        def health():
            while not done.is_set():
                start = time.monotonic()
                requests.get(f"{served.url}/v2/health/live", timeout=60)
                answered.append((time.monotonic(), time.monotonic() - start))

        checker = threading.Thread(target=health)
        checker.start()
        s = served.raw()
        try:
            s.sendall(
                f"POST /v1/models/{NAME}:predict HTTP/1.1\r\nHost: x\r\nContent-Length: "
                f"{len(body)}\r\n\r\n".encode()
                + body
            )
            sent = time.monotonic()
            answer = s.recv(4096)
            replied = time.monotonic()
        finally:
            done.set()
            checker.join()
            s.close()
        assert answer.startswith(b"HTTP/1.1 400"), answer[:300]  # 3 million instances
        # Health checks kept being answered while the body was parsed (the parse takes
        # seconds; on the event loop, none would have been).
        during = [latency for at, latency in answered if sent < at < replied]
        assert during, (replied - sent, answered[-5:])
        detail.update(
            parse_s=round(replied - sent, 2),
            health_checks=len(during),
            max_health_latency_s=round(max(during), 3),
        )
        served.memory_comes_back()


def test_a_timed_out_request_stops_decoding_its_images(served, reliability_record):
    import simplejpeg

    side = 3000  # about 35 ms to decode, here
    y, x = np.mgrid[0:side, 0:side]
    pixels = np.stack([x * 255 // side, y * 255 // side, (x + y) * 127 // side], -1)
    pixels += np.random.default_rng(1).integers(0, 4, pixels.shape)
    image = simplejpeg.encode_jpeg(pixels.astype(np.uint8), quality=70)
    count = 100  # seconds of decoding, against --rest_api_timeout_in_ms=1000
    body = {"instances": [{"b64": base64.b64encode(image).decode()}] * count}
    with recorded(reliability_record, "server: decode past the timeout", 1):
        r = requests.post(f"{served.url}/v1/models/{NAME}:predict", json=body, timeout=120)
        assert r.status_code == 504, r.text[:300]
        # The decoding thread notices at its next image and says where it stopped.
        stopped = "stopped decoding before image"
        fx.wait_until(lambda: stopped in served.log.read_text(), "the decoding to stop", 60)
        line = next(x for x in served.log.read_text().splitlines() if stopped in x)
        stopped_at = int(line.split(f"{stopped} ")[1].split(" ")[0])
        assert stopped_at < count, line
        served.good()
