"""The HTTP port's connection limits (estimax.serving.transport) on a clock the test moves.

Each test drives uvicorn's real protocol (the server's, with the limits) on a real asyncio loop
whose ``time()`` is the test's: timers fire when the test advances the clock, never after a
sleep. The transport is a stand-in that records what the server writes and whether it closed
the connection. The same limits in a real server process, against real sockets and clients:
tests/reliability/test_server_attacks.py.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json

import pytest

pytest.importorskip("uvicorn")

import uvicorn  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from estimax.serving import transport  # noqa: E402

# Timeouts of 10, 30 and 5 s (header, body, keep-alive); 3 connections, 1 KiB of headers.
LIMITS = transport.ConnectionLimits(10.0, 30.0, 5.0, max_connections=3, max_header_bytes=1024)


class FakeTransport:
    """What the protocol writes, and whether it closed; closing tells the protocol, as asyncio's."""

    def __init__(self, loop: asyncio.AbstractEventLoop, port: int):
        self.loop = loop
        self.port = port
        self.written = bytearray()
        self.closing = False
        self.protocol: asyncio.Protocol | None = None

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", self.port), "sockname": ("127.0.0.1", 8501)}.get(
            name, default
        )

    def write(self, data: bytes) -> None:
        assert not self.closing, "written after close"
        self.written += data

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            assert self.protocol is not None
            self.loop.call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def status(self) -> int | None:
        """The status code of the first answer written, if any."""
        if not self.written:
            return None
        return int(self.written.split(b" ", 2)[1])


class Server:
    """uvicorn's protocol with ``limits``, on a loop whose clock is ``now``."""

    def __init__(self, app, limits=LIMITS, refuse_app=None):
        self.loop = asyncio.new_event_loop()
        self.now = 1000.0
        self.loop.time = lambda: self.now  # type: ignore[method-assign]
        self.config = uvicorn.Config(app, lifespan="off", log_level="warning")
        self.config.load()
        self.state = ServerState()
        self.closed: list[str] = []
        self.cls = transport.protocol_class(
            limits, on_close=self.closed.append, refuse_app=refuse_app
        )
        self.ports = iter(range(40000, 50000))

    def connect(self):
        protocol = self.cls(
            config=self.config, server_state=self.state, app_state={}, _loop=self.loop
        )
        fake = FakeTransport(self.loop, next(self.ports))
        fake.protocol = protocol
        protocol.connection_made(fake)
        self.run()
        return protocol, fake

    def send(self, protocol, data: bytes) -> None:
        """Bytes from the client; then whatever they set off runs."""
        protocol.data_received(data)
        self.run()

    def run(self) -> None:
        for _ in range(5):  # let tasks and callbacks that are due run
            self.loop.run_until_complete(asyncio.sleep(0))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.run()

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.run()
        self.loop.close()


async def echo_app(scope, receive, send):
    """Reads the whole body, answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"size": size}).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server():
    s = Server(echo_app)
    yield s
    s.close()


def test_a_silent_connection_is_closed_at_the_header_timeout(server):
    _, conn = server.connect()
    server.advance(9.9)
    assert not conn.closing
    server.advance(0.2)
    assert conn.closing and conn.written == b""  # nothing asked: nothing answered
    assert server.closed == ["header_timeout"]


def test_headers_that_stop_coming_get_408_at_the_header_timeout(server):
    protocol, conn = server.connect()
    server.advance(6)
    server.send(protocol, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
    server.advance(3.9)  # the timeout counts from the connection, not from the last byte
    assert not conn.closing
    server.advance(0.2)
    assert conn.closing and conn.status() == 408
    assert b"--rest_api_header_timeout_in_ms" in conn.written


def test_a_body_that_stops_coming_gets_408_at_the_body_timeout_and_the_app_learns_why(server):
    protocol, conn = server.connect()
    server.send(protocol, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    server.advance(9)  # past the header timeout: the headers are in, the body is timed now
    server.send(protocol, b"0123456789")
    server.advance(20.9)
    assert not conn.closing
    server.advance(0.2)
    assert conn.closing and conn.status() == 408
    assert b"--rest_api_body_timeout_in_ms" in conn.written
    assert protocol.cycle.scope[transport.TIMED_OUT] == "body"
    assert server.closed == ["body_timeout"]


def test_an_answered_connection_is_closed_at_the_keep_alive_timeout(server):
    protocol, conn = server.connect()
    server.send(protocol, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    assert conn.status() == 200 and conn.written.endswith(b'{"size": 3}')
    assert protocol.phase == "idle"
    server.advance(4.9)
    assert not conn.closing
    server.advance(0.2)
    assert conn.closing and server.closed == ["keep_alive_timeout"]


def test_the_next_requests_headers_are_timed_from_its_first_byte(server):
    protocol, conn = server.connect()
    server.send(protocol, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    answered = len(conn.written)
    server.advance(4)
    server.send(protocol, b"GET /x HTTP/1.1\r\nX-Slow: ")  # then a byte every 2 s
    for _ in range(4):
        server.advance(2)
        server.send(protocol, b"a")
    assert not conn.closing
    server.advance(2.1)  # 10 s after the first byte
    assert conn.closing and conn.written[answered:].startswith(b"HTTP/1.1 408")


def test_headers_larger_than_the_limit_get_431(server):
    protocol, conn = server.connect()
    server.send(protocol, b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1100)
    server.send(protocol, b"aaaa")
    assert conn.closing and conn.status() == 431
    assert b"--max_header_bytes" in conn.written
    assert server.closed == ["header_too_large"]


@pytest.mark.parametrize("reads", [1, 3])
def test_the_header_limit_holds_to_the_byte_in_any_number_of_reads(server, reads):
    """Headers of exactly the limit are answered; one byte more gets 431, even when it all
    arrives in one read (it was once parsed and answered 200: the check ran one read late),
    and a body in the same read is not counted as headers."""
    limit = LIMITS.max_header_bytes
    start = b"GET /x HTTP/1.1\r\nHost: x\r\nX-Pad: "
    end = b"\r\n\r\n"
    for extra, status in ((0, 200), (1, 431)):
        head = start + b"a" * (limit - len(start) - len(end) + extra) + end
        assert len(head) == limit + extra
        protocol, conn = server.connect()
        cuts = [len(head) * k // reads for k in range(reads + 1)]
        for a, b in itertools.pairwise(cuts):
            server.send(protocol, head[a:b])
        assert conn.status() == status, conn.written[:200]
    # A body sent with the headers in one read is the body's, not the headers'.
    protocol, conn = server.connect()
    body = b"b" * (limit * 2)
    head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    server.send(protocol, head + body)
    assert conn.status() == 200 and json.loads(conn.written.split(b"\r\n\r\n", 1)[1]) == {
        "size": len(body)
    }


def test_past_the_cap_the_longest_waiting_connection_makes_room(server):
    first, first_conn = server.connect()
    server.advance(1)
    second, second_conn = server.connect()
    server.send(second, b"GET /x HTTP/1.1\r\n")  # stalled in its headers
    server.advance(1)
    third, third_conn = server.connect()
    server.send(third, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, now idle
    server.advance(1)
    _, fourth_conn = server.connect()
    # Silent and idle go before stalled; the longest waiting of them first.
    assert first_conn.closing and not second_conn.closing and not third_conn.closing
    server.advance(1)
    _, fifth_conn = server.connect()
    assert third_conn.closing and not second_conn.closing
    server.advance(1)
    _, sixth_conn = server.connect()
    assert fourth_conn.closing and not second_conn.closing and not fifth_conn.closing
    assert server.closed == ["max_connections"] * 3
    assert not sixth_conn.closing


def test_past_the_cap_with_every_connection_busy_the_newcomer_gets_503():
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        if scope["type"] == "http":
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"done"})

    async def refuse(scope, receive, send):
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"full"})

    server = Server(slow_app, refuse_app=refuse)
    try:
        busy = []
        for _ in range(3):
            protocol, conn = server.connect()
            server.send(protocol, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            busy.append(conn)
        newcomer, conn = server.connect()
        server.send(newcomer, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.status() == 503 and b"full" in conn.written
        assert not any(c.closing for c in busy)
        release.set()
        server.run()
        assert all(c.status() == 200 for c in busy)
    finally:
        server.close()


def test_limits_that_are_not_positive_name_their_flag():
    with pytest.raises(ValueError, match="--rest_api_body_timeout_in_ms must be > 0"):
        transport.ConnectionLimits(body_timeout_s=0).validate()
    with pytest.raises(ValueError, match="--max_connections must be > 0"):
        transport.protocol_class(transport.ConnectionLimits(max_connections=0))


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "text", ["\u0661", "\u00b2", "\uff11", "-1", "+1", " 1", "1.0", "", "9" * 5000, str(2**63)]
)
def test_a_requests_numbers_are_ascii_integers_within_bounds(text):
    from estimax.serving.core import ApiError, ServingCore, ascii_int

    with pytest.raises(ApiError) as e:
        ascii_int(text, "Inference-Header-Content-Length", 2**63 - 1)
    assert e.value.status == 400 and "integer from 0 to" in e.value.message
    assert len(e.value.message) < 200  # a 5000-digit number is not echoed whole
    with pytest.raises(ApiError) as e:
        ServingCore.parse_version(text)
    assert e.value.status == 400 and "versions are integers" in e.value.message


def test_versions_in_requests_and_on_disk():
    from estimax.export.versions import version_number
    from estimax.serving.core import ServingCore

    assert ServingCore.parse_version("7") == 7 and ServingCore.parse_version("007") == 7
    assert ServingCore.parse_version("0" * 5000) == 0
    assert ServingCore.parse_version(str(2**63 - 1)) == 2**63 - 1
    # A folder is a version only as str(version) writes it.
    assert [version_number(n) for n in ("7", "0", str(2**63 - 1))] == [7, 0, 2**63 - 1]
    for name in ("07", "\u0661", "\u00b2", str(2**63), str(2**64), "1e3", ".tmp-2"):
        assert version_number(name) is None, name


def test_shapes_are_bounded_in_rank_and_size():
    from estimax.serving import v2
    from estimax.serving.core import ApiError

    assert v2.check_shape([2, 3], "inputs[0]") == [2, 3]
    for shape, message in (
        ([1] * 33, "has 33 dimensions; at most 32"),
        ([1, 2**63], "integers from 0 to"),
        ([1, -1], "integers from 0 to"),
        ([True], "integers from 0 to"),
        ([], "non-empty list"),
    ):
        with pytest.raises(ApiError, match=message):
            v2.check_shape(shape, "inputs[0]")


def test_a_repeated_output_is_refused_as_it_is_counted():
    from estimax.serving.core import ApiError, refuse_repeated

    refuse_repeated(["classes", "probabilities"])
    with pytest.raises(ApiError, match=r"outputs \['classes'\] are asked for more than once"):
        refuse_repeated(iter(["classes"] * 200_000))


# ----------------------------------------------------------------------------- bodies
def test_json_errors_are_400s_and_numbers_pack_as_their_consumers_would_make_them():
    import numpy as np

    from estimax.serving import bodies
    from estimax.serving.core import ApiError

    for text, message in (
        (b'{"a": %s}' % (b"9" * 5000), "more than 4300 digits"),
        (b"{nope", "JSON Parse error"),
        (b"[" * 100_000, "JSON Parse error"),
        (b"\xff", "JSON Parse error"),
    ):
        with pytest.raises(ApiError, match=message) as e:
            bodies.parse(text)
        assert e.value.status == 400
    floats, ints = [[0.5] * 8] * 8, list(range(100))
    tree = {
        "rows": floats,
        "ints": ints,
        "flags": [True, False] * 40,
        "few": [1, 2, 3],
        "words": ["a"] * 100,
        "ragged": [list(range(70)), [1]],
        "huge": [2**70] * 100,
        "nested": [{"x": ints}],
    }
    packed = bodies.pack(tree)
    assert isinstance(packed["rows"], np.ndarray) and packed["rows"].shape == (8, 8)
    assert packed["ints"].dtype == np.asarray(ints).dtype and packed["flags"].dtype == bool
    assert packed["few"] == [1, 2, 3] and packed["words"] == ["a"] * 100
    assert isinstance(packed["ragged"][0], np.ndarray) and packed["ragged"][1] == [1]
    assert packed["huge"] == [2**70] * 100  # past 64 bits: kept as Python integers
    assert isinstance(packed["nested"][0]["x"], np.ndarray)
    assert json.loads(bodies.encode(packed)) == tree  # arrays written back as lists


def test_large_bodies_are_parsed_in_a_worker_process_and_its_refusals_arrive_as_4xx():
    import numpy as np

    from estimax.serving import bodies, v2
    from estimax.serving.core import ApiError

    workers = bodies.JsonWorkers(workers=1)
    loop = asyncio.new_event_loop()
    try:
        data = np.arange(100_000, dtype=np.float64) / 7
        raw = json.dumps({"inputs": data.tolist()}).encode()
        assert len(raw) > bodies.INLINE_BYTES
        tree = loop.run_until_complete(workers.loads(raw, v2.check_infer_body))
        np.testing.assert_array_equal(tree["inputs"], data)
        repeated = {"inputs": [], "outputs": [{"name": "classes"}] * 100_000}
        with pytest.raises(ApiError, match="asked for more than once") as e:
            loop.run_until_complete(
                workers.loads(json.dumps(repeated).encode(), v2.check_infer_body)
            )
        assert e.value.status == 400
        text = loop.run_until_complete(workers.dumps({"outputs": data}, numbers=data.size))
        np.testing.assert_array_equal(json.loads(text)["outputs"], data)
    finally:
        workers.close()
        loop.close()


def test_bodies_of_a_few_base64_images_are_parsed_in_place_and_numbers_in_a_worker():
    # A request of one 470 KB image is past INLINE_BYTES, but its parse costs less than the
    # process hop (bodies' docstring): it never starts a worker. As many bytes of numbers do.
    import base64
    import os

    from estimax.serving import bodies

    image = {"b64": base64.b64encode(os.urandom(350_000)).decode()}
    one = json.dumps({"instances": [image]}).encode()
    too_big = json.dumps({"instances": [image] * 6}).encode()  # past INLINE_TEXT_BYTES
    numbers = json.dumps({"instances": [0.25] * 120_000}).encode()
    assert bodies.INLINE_BYTES < len(one) and len(numbers) < bodies.INLINE_TEXT_BYTES
    assert bodies.light(one) and not bodies.light(too_big) and not bodies.light(numbers)
    assert bodies.light(b'{"instances": [1, 2]}')
    workers = bodies.JsonWorkers(workers=1)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(workers.loads(one)) == {"instances": [image]}
        assert workers._pool is None  # no worker was started for it
        tree = loop.run_until_complete(workers.loads(numbers))
        assert workers._pool is not None and tree["instances"].shape == (120_000,)
    finally:
        workers.close()
        loop.close()


# ----------------------------------------------------------------------------- work
class _Recorded:
    """A servable that notes the thread each request is decoded and run on; a run of a request
    in ``hold`` waits for ``go``."""

    version = 1

    def __init__(self, hold: str = ""):
        import threading

        self.threads: list[tuple[str, str, str]] = []
        self.hold, self.held, self.go = hold, threading.Event(), threading.Event()
        self.prepared = threading.Event()  # a request other than ``hold`` was decoded

    def _note(self, step: str, name: str) -> None:
        import threading

        self.threads.append((step, name, threading.current_thread().name.split("_")[0]))

    def prepare(self, columns, max_pixels, cancelled):
        import numpy as np

        self._note("prepare", columns["name"])
        if columns["name"] != self.hold:
            self.prepared.set()
        return {"name": np.asarray([columns["name"]])}

    def run(self, features):
        name = str(features["name"][0])
        self._note("run", name)
        if name == self.hold:
            self.held.set()
            assert self.go.wait(60)
        return {"y": features["name"]}

    def executions(self, n):
        return [(n, n)]


def test_an_unbatched_request_is_decoded_on_a_free_run_thread_else_on_a_decoding_thread():
    # One hand-off from the event loop when a run thread is free (core._prepare_and_run);
    # while the only one runs a request, the next decodes on a decoding thread meanwhile.
    from estimax.serving import core as core_lib
    from estimax.serving import tracking
    from estimax.serving.manager import ModelManager

    core = core_lib.ServingCore(ModelManager("m", "/nonexistent", [1]), core_lib.ServerOptions())
    servable = _Recorded(hold="a")

    async def ask(name: str):
        tracking.CURRENT.set(tracking.RequestRecord("http", "/", model="m"))
        return (await core.infer(servable, {"name": name}))["y"].tolist()

    async def main():
        first = asyncio.create_task(ask("a"))
        await asyncio.to_thread(servable.held.wait, 60)  # "a" holds the only run thread
        second = asyncio.create_task(ask("b"))
        await asyncio.to_thread(servable.prepared.wait, 60)  # "b" decoded while "a" runs
        servable.go.set()
        return await first, await second, await ask("c")

    assert asyncio.run(main()) == (["a"], ["b"], ["c"])
    assert servable.threads == [
        ("prepare", "a", "run"),
        ("run", "a", "run"),
        ("prepare", "b", "decode"),
        ("run", "b", "run"),
        ("prepare", "c", "run"),
        ("run", "c", "run"),
    ]
    assert core._unbatched == 0  # every run given back its thread


def test_an_unbatched_request_given_up_while_it_waits_for_the_run_thread_never_runs():
    # Its place among the unbatched runs is given back though its run never started (the
    # next lone request decodes on the run thread again).
    from estimax.serving import core as core_lib
    from estimax.serving import tracking
    from estimax.serving.manager import ModelManager

    core = core_lib.ServingCore(ModelManager("m", "/nonexistent", [1]), core_lib.ServerOptions())
    servable = _Recorded(hold="a")

    async def ask(name: str):
        tracking.CURRENT.set(tracking.RequestRecord("http", "/", model="m"))
        return (await core.infer(servable, {"name": name}))["y"].tolist()

    async def main():
        first = asyncio.create_task(ask("a"))
        await asyncio.to_thread(servable.held.wait, 60)
        second = asyncio.create_task(ask("b"))
        await asyncio.to_thread(servable.prepared.wait, 60)
        for _ in range(100_000):  # until "b" is queued for the run thread (no clock involved)
            if core._unbatched == 2:
                break
            await asyncio.sleep(0)
        assert core._unbatched == 2
        second.cancel()  # as the request's timeout or a closed connection does
        with pytest.raises(asyncio.CancelledError):
            await second
        servable.go.set()
        return await first, await ask("c")

    assert asyncio.run(main()) == (["a"], ["c"])
    assert [t for t in servable.threads if t[0] == "run"] == [
        ("run", "a", "run"),
        ("run", "c", "run"),
    ]
    assert ("prepare", "c", "run") in servable.threads and core._unbatched == 0


def _doubled(ran: list, features: dict) -> dict:
    """A model run: twice its input; ``ran`` gets each batch's size."""
    ran.append(len(features["x"]))
    return {"y": features["x"] * 2}


def test_a_request_given_up_while_it_waits_for_its_batch_is_not_run():
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from estimax.serving.batching import Batcher, BatchingOptions

    ran: list[int] = []
    run = functools.partial(_doubled, ran)

    async def main():
        batcher = Batcher(BatchingOptions(8, batch_timeout_micros=200_000), executor)
        given_up = asyncio.create_task(batcher.submit("v1", run, {"x": np.zeros((3, 1))}))
        kept = asyncio.create_task(batcher.submit("v1", run, {"x": np.ones((2, 1))}))
        await asyncio.sleep(0)  # both queued, the batch still filling
        given_up.cancel()  # as asyncio.wait_for does at --rest_api_timeout_in_ms
        out = await kept
        await batcher.close()
        return out, batcher.queued

    with ThreadPoolExecutor(1) as executor:
        out, queued = asyncio.run(main())
    assert ran == [2] and out["y"].tolist() == [[2.0], [2.0]] and queued == 0
