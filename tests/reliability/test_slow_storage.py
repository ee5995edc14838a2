"""Slow and failing object storage: the GCS emulator and the S3 server behind a small
fault-injecting HTTP proxy (503s, 500s, stalled answers). Writes and reads go through (the
clients' retries with backoff, configured by estimax.storage); when the retries run out the
user gets one StorageError naming the path, and nothing half-written is visible.
"""

from __future__ import annotations

import http.client
import http.server
import random
import threading
import time
import urllib.parse

import pytest
from conftest import clear_storage_clients, point_clients_at  # tests/conftest.py

from estimax import storage
from estimax.data import shard_index, tfrecord

from .conftest import scale

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    """An HTTP proxy in front of ``upstream`` that answers some requests with faults.

    Each request draws (from a seeded RNG) ``ok``, ``503``, ``500`` or ``stall`` (hold the
    request ``stall_s`` before forwarding it, longer than the client's read timeout, so the
    client gives up on it and retries). ``fail_all`` answers every request matching it with 503.

    Why hand-written: the fault schedule must be seeded and per request, which generic proxies
    (toxiproxy's toxics act on connections, not requests) do not offer; it is ~60 lines.
    """

    def __init__(self, upstream: str, error_rate: float, stall_rate: float, stall_s: float):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.rng = random.Random(20261123)
        self.error_rate, self.stall_rate, self.stall_s = error_rate, stall_rate, stall_s
        self.fail_all: set[str] = set()  # methods answered 503 every time
        self.stall_at = {5, 12}  # these requests (1-based) stall in any case
        self.faults: dict[str, int] = {"503": 0, "500": 0, "stall": 0}
        self.requests = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if not size:
                            return b"".join(chunks)
                        chunks.append(chunk)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                fault = proxy.draw(self.command)
                if fault in ("503", "500"):
                    payload = b'{"error": {"code": %s, "message": "injected"}}' % fault.encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if fault == "stall":
                    time.sleep(proxy.stall_s)  # the injected stall (the server being slow)
                conn = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=60
                )
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() in _HOP_BY_HOP or (k.lower() == "content-length"):
                        continue
                    self.send_header(k, v)
                length = resp.getheader("Content-Length")
                self.send_header(
                    "Content-Length",
                    length if self.command == "HEAD" and length else str(len(data)),
                )
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def draw(self, method: str) -> str:
        with self.lock:
            self.requests += 1
            if method in self.fail_all:
                fault = "503"
            elif self.requests in self.stall_at and self.stall_s:
                fault = "stall"
            else:
                r = self.rng.random()
                if r < self.error_rate:
                    fault = self.rng.choice(("503", "500"))
                elif r < self.error_rate + self.stall_rate:
                    fault = "stall"
                else:
                    return "ok"
            self.faults[fault] += 1
            return fault

    @property
    def injected(self) -> int:
        return sum(self.faults.values())

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _store(request, monkeypatch, kind: str):
    import uuid

    server = request.getfixturevalue("gcs_emulator" if kind == "gs" else "s3_server")
    bucket = f"estimax-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    return f"{kind}://{bucket}", server


RECORDS = [bytes([i]) * (1000 + 37 * i) for i in range(40)]


@pytest.mark.parametrize("kind", ["gs", "s3"])
def test_writes_and_reads_go_through_injected_faults(
    request, monkeypatch, kind, reliability_record
):
    root, server = _store(request, monkeypatch, kind)
    # gcsfs makes ~300 requests here (listings, ranged reads) and sleeps 1-2 s before its first
    # retry, 2-3 s before its second: fewer faults per request keep the short version short.
    error_rate, stall_rate = (0.2, 0.1) if kind == "s3" else (scale(0.03, 0.1), 0.02)
    proxy = FaultProxy(server.url, error_rate=error_rate, stall_rate=stall_rate, stall_s=1.5)
    monkeypatch.setenv(storage.RETRIES_ENV, "8")
    monkeypatch.setenv(storage.TIMEOUT_ENV, "0.75")  # a stalled answer (1.5 s) times out
    point_clients_at(monkeypatch, kind, proxy.url)
    ok = False
    try:
        shards = scale(1, 4)
        for shard in range(shards):
            path = f"{root}/data/train-{shard:05d}-of-{shards:05d}"
            with tfrecord.TFRecordWriter(path) as w:
                for r in RECORDS:
                    w.write(r)
            shard_index.write_index(path)
        for shard in range(shards):
            path = f"{root}/data/train-{shard:05d}-of-{shards:05d}"
            assert list(tfrecord.read_records(path)) == RECORDS
            rf = tfrecord.RecordFile(path)
            assert [rf[i] for i in (0, 17, 39)] == [RECORDS[0], RECORDS[17], RECORDS[39]]
        assert tfrecord.list_files(f"{root}/data/train-*") == [
            f"{root}/data/train-{s:05d}-of-{shards:05d}" for s in range(shards)
        ]
        ok = True
    finally:
        reliability_record(
            "fault",
            f"{kind} 5xx/stall via proxy",
            proxy.injected,
            ok,
            requests=proxy.requests,
            faults=dict(proxy.faults),
        )
        proxy.stop()
        clear_storage_clients()
    # Faults of both kinds were injected and survived: the retries happened.
    assert proxy.faults["503"] + proxy.faults["500"] > 0, proxy.faults
    assert proxy.faults["stall"] > 0, proxy.faults
    assert proxy.requests > proxy.injected


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_out_of_retries_is_one_clear_error_and_nothing_is_visible(
    request, monkeypatch, kind, reliability_record
):
    if kind == "gs" and scale(0, 1) == 0:
        # gcsfs's 6 attempts with backoff (1, 2, 4, 8, 16 s) are fixed in gcsfs: ~35 s.
        pytest.skip("gcsfs's fixed retries take ~35 s to run out: `make reliability` runs it")
    root, server = _store(request, monkeypatch, kind)
    proxy = FaultProxy(server.url, error_rate=0.0, stall_rate=0.0, stall_s=0.0)
    monkeypatch.setenv(storage.RETRIES_ENV, "2")
    point_clients_at(monkeypatch, kind, proxy.url)
    path = f"{root}/data/train-00000-of-00001"
    proxy.fail_all = {"PUT", "POST"}  # every upload fails; listings and reads still answer
    ok = False
    try:
        with pytest.raises(storage.StorageError) as e:
            with tfrecord.TFRecordWriter(path) as w:
                for r in RECORDS:
                    w.write(r)
        message = str(e.value)
        assert message.startswith(f"{path}: could not ")
        assert "503" in message or "Service Unavailable" in message or "SlowDown" in message
        if kind == "s3":
            # botocore's standard retries, as configured: 1 attempt + 2 retries per request.
            assert proxy.faults["503"] % 3 == 0 and proxy.faults["503"] >= 3, proxy.faults
        proxy.fail_all = set()
        clear_storage_clients()
        assert not storage.exists(path)  # nothing half-written under the final name
        fs, p = storage.filesystem(f"{root}/data")
        assert not fs.exists(p) or fs.ls(p) == []
        ok = True
    finally:
        reliability_record("fault", f"{kind} uploads failing past retries", proxy.injected, ok)
        proxy.stop()
        clear_storage_clients()


def test_bad_retry_setting_is_named(monkeypatch):
    monkeypatch.setenv(storage.RETRIES_ENV, "lots")
    with pytest.raises(ValueError, match="ESTIMAX_STORAGE_RETRIES='lots' must be a non-negative"):
        storage.configure_clients()
