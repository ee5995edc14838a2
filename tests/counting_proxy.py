"""A loopback HTTP proxy in front of an object-store emulator that counts what it serves.

Tests point the storage clients at it (``STORAGE_EMULATOR_HOST``) to count the bytes of every
object downloaded through it: ``read[name]`` for the object ``name`` (a GCS media download,
``.../o/<name>?alt=media``), whatever client or process asked, and ``requests[name]`` those
downloads. ``read_only_buckets``: buckets it answers every write to (upload, delete, compose)
with GCS's 403, as a bucket of someone else's data set the job may only read.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import threading
import urllib.parse
from typing import Any

# Headers of one connection, not of the request or response forwarded.
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "host"}


class CountingProxy:
    """Forwards every request to ``upstream`` (``http://host:port``); counts media downloads."""

    def __init__(self, upstream: str, delay: float = 0.0, read_only_buckets: tuple[str, ...] = ()):
        parts = urllib.parse.urlsplit(upstream)
        self._read_only = tuple(f"/b/{b}/" for b in read_only_buckets)
        self.refused: list[str] = []  # the writes refused (method and path)
        self._delay = delay  # seconds each request is held: an object store's latency
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.read: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self.ranges: list[tuple[str, str]] = []  # (object, Range header) of every download
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        # A client that hangs up (a loader closed mid-read) is not an error of the proxy's.
        self._server.handle_error = lambda request, address: None  # type: ignore[method-assign]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command not in ("GET", "HEAD") and any(
                    b in urllib.parse.urlsplit(self.path).path + "/" for b in proxy._read_only
                ):
                    with proxy._lock:
                        proxy.refused.append(f"{self.command} {self.path}")
                    denied = b'{"error": {"code": 403, "message": "Forbidden: read-only bucket"}}'
                    self.send_response(403)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(denied)))
                    self.end_headers()
                    self.wfile.write(denied)
                    return
                if proxy._delay:
                    threading.Event().wait(proxy._delay)  # the latency this proxy adds
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                proxy._count(self.path, data, self.headers.get("Range", ""))
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in _HOP | {"content-length"}:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _forward

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def _count(self, path: str, data: bytes, byte_range: str) -> None:
        parts = urllib.parse.urlsplit(path)
        if "/o/" not in parts.path or "alt=media" not in parts.query:
            return
        name = urllib.parse.unquote(parts.path.split("/o/", 1)[1])
        with self._lock:
            self.read[name] += len(data)
            self.requests[name] += 1
            self.ranges.append((name, byte_range))

    def reset(self) -> None:
        with self._lock:
            self.read.clear()
            self.requests.clear()
            self.ranges.clear()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
