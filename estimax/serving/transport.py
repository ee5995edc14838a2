"""The HTTP port's connection limits: header, body and keep-alive timeouts, a header size limit
and a connection cap, on uvicorn's own HTTP protocol.

uvicorn bounds none of these by itself: its keep-alive timer starts after a first response, so
a connection that never sends a byte, or stops in the middle of its headers or body, is held
for ever (measured before this module: ten clients stalling before the last byte of a 50 MB
body held 490 MB; 300 silent connections against 256 file descriptors refused every good
request for 60 s, until the clients gave up). Each connection is in one phase at a time:

=============================================  =================================  ============
phase                                          limit                              then
=============================================  =================================  ============
connected, or a request's first bytes arrived  ``header_timeout_s``               408, closed
  (headers larger than ``max_header_bytes``)                                      431, closed
headers in, body arriving                      ``body_timeout_s``                 408, closed
request being answered                         ``--rest_api_timeout_in_ms``       504
answered, waiting for the next request         ``keep_alive_timeout_s``           closed
=============================================  =================================  ============

A connection past ``max_connections`` makes room: the connection that has waited longest
without a request being answered on it (silent, idle, then stalled in its headers, then in its
body) is closed; if a request is being answered on every one, the newcomer's request gets 503.
The cap stays below the process's open-file limit (``fitted_max_connections``), so the server
never runs out of file descriptors and stops accepting.

Hand-written because uvicorn offers only the keep-alive timeout and ``limit_concurrency``
(a 503 once headers are in: silent connections never get there); it subclasses uvicorn's
``HttpToolsProtocol`` (pinned in pyproject) and overrides only its parser callbacks. Timers run
on the event loop's clock (``loop.call_later``): tests give the protocol a loop of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import resource
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# The scope key a request's body timeout sets: the app answers 408, not "client went away".
TIMED_OUT = "estimax.timed_out"
# File descriptors kept free of HTTP connections: gRPC, the JSON workers' pipes, version files,
# logs (an idle server holds about 40).
FD_RESERVE = 64
# A cap that would leave fewer connections than this is a mistake to report, not to run with.
MIN_CONNECTIONS = 8

# Closing order at the cap: the phases nobody is waiting on first.
_EVICTION_ORDER = {"new": 0, "idle": 0, "headers": 1, "body": 2}


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The HTTP port's limits (the ``estimax serve`` flags of the same names).

    Attributes:
      header_timeout_s: a request's headers must all arrive within this time of the connection
        (of its first byte, for a connection's later requests).
      body_timeout_s: a request's body must all arrive within this time of its headers.
      keep_alive_timeout_s: an idle connection is closed after this.
      max_connections: open connections at most (module docstring).
      max_header_bytes: the request line and headers of one request, at most.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1000
    max_header_bytes: int = 64 << 10

    def validate(self) -> None:
        """Raises ValueError naming the flag of a limit that is not positive."""
        for flag, value in (
            ("--rest_api_header_timeout_in_ms", self.header_timeout_s),
            ("--rest_api_body_timeout_in_ms", self.body_timeout_s),
            ("--rest_api_keep_alive_timeout_in_ms", self.keep_alive_timeout_s),
            ("--max_connections", self.max_connections),
            ("--max_header_bytes", self.max_header_bytes),
        ):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0")


def fitted_max_connections(wanted: int, ports: int) -> tuple[int, str]:
    """``wanted`` connections per port, lowered to fit the open-file limit (``ulimit -n``).

    Raises the soft limit to the hard one first (as Go's runtime does for its servers).

    Returns:
      (connections per port, a sentence saying why it was lowered, or "").

    Raises:
      ValueError: the limit leaves fewer than ``MIN_CONNECTIONS`` per port.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted * ports + FD_RESERVE + _open_fds()
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit; the cap fits it below
    if soft == resource.RLIM_INFINITY:
        return wanted, ""
    fits = (soft - FD_RESERVE - _open_fds()) // ports
    if fits < MIN_CONNECTIONS:
        raise ValueError(
            f"the open-file limit (ulimit -n: {soft}) leaves {max(fits, 0)} connections per "
            f"port; raise it to at least {MIN_CONNECTIONS * ports + FD_RESERVE + _open_fds()}"
        )
    if fits >= wanted:
        return wanted, ""
    return fits, (
        f"--max_connections={wanted} lowered to {fits} per port to fit the open-file limit "
        f"(ulimit -n: {soft}); raise it to allow more"
    )


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume an idle server's
        return 40


def protocol_class(
    limits: ConnectionLimits,
    on_close: Callable[[str], None] = lambda reason: None,
    refuse_app: Any = None,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with ``limits`` (pass it as ``uvicorn.run(http=...)``).

    Args:
      on_close: called with the reason each time a limit closes a connection
        (``header_timeout``, ``body_timeout``, ``keep_alive_timeout``, ``header_too_large``,
        ``max_connections``): the server's metrics.
      refuse_app: the ASGI app that answers a request arriving past the cap when no connection
        could be closed for it (a 503); default: uvicorn's.
    """
    limits.validate()
    attributes = {
        "limits": limits,
        "on_close": staticmethod(on_close),
        # staticmethod: a plain function stored on the class would be bound to the protocol.
        "refuse_app": staticmethod(refuse_app) if refuse_app is not None else None,
    }
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), attributes)


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """One HTTP connection under ``limits`` (module docstring); made by ``protocol_class``."""

    limits = ConnectionLimits()
    refuse_app: Any = None

    @staticmethod
    def on_close(reason: str) -> None:
        """Told each time a limit closes a connection (see ``protocol_class``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn types it as whole seconds; call_later takes any float.
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._timer: asyncio.TimerHandle | None = None
        self.phase = "new"  # new, headers, body, app, idle (module docstring)
        self.since = self.loop.time()
        self._header_bytes = 0
        self._header_tail = b""  # the last bytes of the headers read so far (at most 3)

    # ------------------------------------------------------------------ timers
    def _arm(self, seconds: float, reason: str) -> None:
        self._cancel()
        self._timer = self.loop.call_later(seconds, self._expired, reason)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, reason: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if reason == "header_timeout" and self.phase == "headers":
            self._reply(408, "Request Timeout", self._late("headers", "header"))
        elif reason == "body_timeout" and self.cycle is not None:
            cast(dict, self.cycle.scope)[TIMED_OUT] = "body"  # read by the app (rest.read_body)
            if not self.cycle.response_started:
                self._reply(408, "Request Timeout", self._late("body", "body"))
        self.close_for(reason)

    def _late(self, part: str, flag: str) -> str:
        seconds = getattr(self.limits, f"{flag}_timeout_s")
        return (
            f"The request's {part} did not all arrive within {seconds * 1000:.0f} ms "
            f"(--rest_api_{flag}_timeout_in_ms)"
        )

    def _reply(self, status: int, reason: str, message: str) -> None:
        self.transport.write(_raw_response(status, reason, message))

    def close_for(self, reason: str) -> None:
        """Closes the connection on a limit (``reason``), counted once."""
        self._cancel()
        if not self.transport.is_closing():
            log.debug("closing %s: %s", self.client, reason)
            self.transport.close()
            self.on_close(reason)

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection: its first request's headers are timed from now; the cap holds."""
        super().connection_made(transport)
        self.since = self.loop.time()
        self._arm(self.limits.header_timeout_s, "header_timeout")
        self._make_room()

    def _make_room(self) -> None:
        mine = [c for c in self.connections if isinstance(c, LimitedHttpToolsProtocol)]
        if len(mine) <= self.limits.max_connections:
            return
        waiting = [c for c in mine if c is not self and c.phase in _EVICTION_ORDER]
        if waiting:
            victim = min(waiting, key=lambda c: (_EVICTION_ORDER[c.phase], c.since))
            victim.close_for("max_connections")
        else:  # every connection is being answered: this one's request gets a 503
            self.on_close("max_connections")
            if self.refuse_app is not None:
                self.app = self.refuse_app
            else:
                self.limit_concurrency = 0  # uvicorn's own 503 for this connection

    def connection_lost(self, exc: Exception | None) -> None:
        """Stops this connection's timer."""
        self._cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Times the next request's headers from its first byte; refuses oversized headers."""
        if self.transport.is_closing():  # refused (431) or closed: what follows is not read
            return
        if self.phase == "idle":
            self.phase, self.since = "headers", self.loop.time()
            self._arm(self.limits.header_timeout_s, "header_timeout")
        if self.phase in ("new", "idle", "headers") and self._headers_too_large(data):
            self._reply(
                431,
                "Request Header Fields Too Large",
                f"The request line and headers are larger than this server accepts "
                f"({self.limits.max_header_bytes} bytes; see --max_header_bytes)",
            )
            self.close_for("header_too_large")
            return
        super().data_received(data)

    def _headers_too_large(self, data: bytes) -> bool:
        """Whether this read takes the request line and headers past the limit, to the byte.

        Counted before the parser sees the read (a read of 100 KB was once parsed, and
        answered, under a 64 KiB limit): up to the blank line that ends the headers when this
        read holds it (what follows is body, or the next request), else the whole read.
        """
        # The blank line may straddle two reads: the end of the last one is searched too.
        seen = self._header_tail + data
        ends = [i + len(m) for m in (b"\r\n\r\n", b"\n\n") if (i := seen.find(m)) >= 0]
        counted = min(ends) - len(self._header_tail) if ends else len(data)
        if self._header_bytes + counted > self.limits.max_header_bytes:
            return True
        # Past the blank line the parser resets the count (on_headers_complete).
        self._header_bytes += counted
        self._header_tail = (self._header_tail + data)[-3:]
        return False

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        """A request's first byte."""
        if self.phase in ("new", "idle"):
            self.phase = "headers"
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        """Headers in: the body is timed from now (unless pipelined behind another request)."""
        super().on_headers_complete()
        self._header_bytes, self._header_tail = 0, b""
        self.phase, self.since = "body", self.loop.time()
        if self.pipeline:  # queued behind a request being answered: reading is paused
            self._cancel()
        else:
            self._arm(self.limits.body_timeout_s, "body_timeout")

    def on_message_complete(self) -> None:
        """The whole request is in: the app's own timeout takes over."""
        super().on_message_complete()
        self._cancel()
        self.phase = "app"

    def on_response_complete(self) -> None:
        """Answered: idle (uvicorn's keep-alive timer), unless the body is still arriving."""
        super().on_response_complete()
        # self.cycle is the newest request: a pipelined one may be starting now.
        if self.phase == "app" and (self.cycle is None or self.cycle.response_complete):
            self.phase, self.since = "idle", self.loop.time()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timer: counted, then closed."""
        if not self.transport.is_closing():
            self.on_close("keep_alive_timeout")
        super().timeout_keep_alive_handler()
