"""gs:// and s3:// against real servers (fake-gcs-server, moto): shards, checkpoints, summaries,
exports, the emulator variables, and faults (a proxy that fails requests) -> retries, then one
clear error, and nothing half-written under a final name."""

from __future__ import annotations

import http.client
import http.server
import os
import threading

import numpy as np
import pytest
from conftest import clear_storage_clients, point_clients_at

from estimax import storage
from estimax.data import tfrecord
from estimax.state import orbax_storage


def test_configure_maps_the_standard_variables_for_tensorstore():
    env = {
        "STORAGE_EMULATOR_HOST": "127.0.0.1:4443",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:5",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }
    storage.configure(env)
    assert env["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:4443"
    assert env["GOOGLE_AUTH_TOKEN_FOR_TESTING"]  # no credential lookup against an emulator
    assert env["AWS_DEFAULT_REGION"] == "us-east-1" and env["AWS_ACCESS_KEY_ID"]
    env["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"  # the emulator moved: follow it
    storage.configure(env)
    assert env["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:9"
    mine = {
        "STORAGE_EMULATOR_HOST": "h:1",
        "TENSORSTORE_GCS_HTTP_URL": "http://other:2",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_REGION": "eu-west-1",
        "AWS_ENDPOINT_URL": "http://x",
    }
    storage.configure(mine)  # what the user set explicitly wins
    assert mine["TENSORSTORE_GCS_HTTP_URL"] == "http://other:2" and mine["AWS_ACCESS_KEY_ID"] == "k"
    assert "AWS_DEFAULT_REGION" not in mine
    remote = {"AWS_ENDPOINT_URL": "https://s3.example.com", "AWS_SHARED_CREDENTIALS_FILE": "/no"}
    storage.configure(remote)  # a real store: no dummy keys that would hide missing ones
    assert "AWS_ACCESS_KEY_ID" not in remote
    assert orbax_storage.manager_options("/local/dir") == {}


def test_paths():
    assert storage.is_remote("gs://b/x") and storage.is_remote("s3://b/x")
    assert not storage.is_remote("/tmp/x") and not storage.is_remote("runs/x")
    assert storage.join("gs://b/run", "checkpoints", "3") == "gs://b/run/checkpoints/3"


def test_shards_round_trip_and_a_failed_write_leaves_nothing(object_store):
    root, _ = object_store
    records = [os.urandom(n) for n in (1, 100, 5000)]
    with tfrecord.TFRecordWriter(f"{root}/data/train-00000-of-00001") as w:
        for r in records:
            w.write(r)
    with (
        pytest.raises(RuntimeError, match="boom"),
        tfrecord.TFRecordWriter(f"{root}/data/train-00000-of-00002") as w,
    ):
        w.write(b"partial")
        raise RuntimeError("boom")
    assert tfrecord.list_files(f"{root}/data/train-*") == [f"{root}/data/train-00000-of-00001"]
    assert list(tfrecord.read_records(f"{root}/data/train-00000-of-00001")) == records
    assert storage.isdir(f"{root}/data") and not storage.isdir(f"{root}/nothing")


def test_checkpoints_summaries_and_exports_on_the_object_store(object_store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from estimax.estimator import export, summaries
    from estimax.state import checkpoints

    root, _ = object_store
    model_dir = f"{root}/run"
    seen = []
    follower = checkpoints.checkpoints_iterator(
        model_dir, timeout=0, sleep=seen.append, clock=lambda: 0.0
    )
    assert list(follower) == []  # nothing yet: stops at the timeout, no error
    ckpt = checkpoints.Checkpointer(model_dir, keep_checkpoint_max=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": np.full(3, float(step))}, {}, {}, {"position": step})
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [2, 3]  # keep_checkpoint_max removed step 1 from the bucket
    assert not storage.exists(f"{model_dir}/checkpoints/1")
    assert storage.exists(f"{model_dir}/checkpoints/3/commit_success.txt")  # the commit marker
    ckpt.close()
    # A new process (a sidecar evaluator) sees the checkpoints and the input position.
    assert list(checkpoints.checkpoints_iterator(model_dir, timeout=0)) == [3]
    reader = checkpoints.Checkpointer(model_dir, read_only=True)
    np.testing.assert_array_equal(reader.restore_numpy(3)["w"], [3.0, 3.0, 3.0])
    assert reader.restore_meta(3)["input_state"] == {"position": 3}
    # Without its commit marker (a save that died before the end) a step is not a checkpoint,
    # on S3 too (estimax asks Orbax for its GCS commit protocol there).
    fs, marker = storage.filesystem(f"{model_dir}/checkpoints/3/commit_success.txt")
    fs.rm(marker)
    assert reader.all_steps() == [2] and reader.latest_step() == 2
    reader.close()

    writer = summaries.Summaries(f"{model_dir}/eval")
    writer.scalars(5, {"loss": 0.25})
    writer.close()
    (event_file,) = [
        p
        for p in storage.filesystem(f"{model_dir}/eval")[0].ls(
            storage.filesystem(f"{model_dir}/eval")[1]
        )
        if "tfevents" in p
    ]
    local = tmp_path / "events" / os.path.basename(event_file)
    local.parent.mkdir()
    storage.filesystem(model_dir)[0].get_file(event_file, str(local))
    acc = EventAccumulator(str(local.parent))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(5, 0.25)]

    staging = storage.staging_dir(f"{root}/export/1")
    for name in ("a.bin", export.SIGNATURE_FILE):
        with open(os.path.join(staging, name), "w") as f:
            f.write(name)
    storage.publish_dir(staging, f"{root}/export/1", last=export.SIGNATURE_FILE)
    assert not os.path.exists(staging)
    with storage.open_file(f"{root}/export/1/{export.SIGNATURE_FILE}", "r") as f:
        assert f.read() == export.SIGNATURE_FILE


# ------------------------------------------------------------------------------- faults


class FaultProxy:
    """An HTTP proxy on loopback in front of an emulator that fails chosen requests.

    ``fail(predicate, times)``: the next ``times`` requests for which ``predicate(method, path)``
    holds get a 503 (``times=None``: all of them). ``log`` records (method, path, status).
    """

    def __init__(self, upstream_port: int):
        proxy = self
        self.rules: list[list] = []
        self.log: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                # Each request is logged before its answer goes out: the client may act on the
                # answer (and the test read the log) before this thread runs again.
                if proxy._should_fail(self.command, self.path):
                    proxy._record(self.command, self.path, 503)
                    payload = b'{"error": {"code": 503, "message": "injected"}}'
                    self.send_response(503)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                proxy._record(self.command, self.path, resp.status)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _handle_quietly(self):
                try:
                    self._handle()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this connection (it retries on a new one)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _handle_quietly

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail(self, predicate, times: int | None) -> None:
        with self.lock:
            self.rules.append([predicate, times])

    def _should_fail(self, method: str, path: str) -> bool:
        with self.lock:
            for rule in self.rules:
                if rule[0](method, path) and (rule[1] is None or rule[1] > 0):
                    if rule[1] is not None:
                        rule[1] -= 1
                    return True
        return False

    def _record(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.log.append((method, path, status))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def faulty_gcs(gcs_emulator, monkeypatch):
    """(bucket URL, proxy): the clients talk to the GCS emulator through a FaultProxy.

    gcsfs's backoff between its retries is cut 50-fold (1, 2, 4, 8, 16 s -> 20-320 ms): the
    tests check how many times it retries and what is left after, not how long it waits.
    """
    import asyncio
    import types
    import uuid

    import gcsfs.retry

    real_sleep = asyncio.sleep
    monkeypatch.setattr(
        gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=lambda s: real_sleep(s / 50))
    )
    bucket = f"estimax-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(bucket)
    proxy = FaultProxy(gcs_emulator.port)
    point_clients_at(monkeypatch, "gs", proxy.url)
    yield f"gs://{bucket}", proxy
    proxy.stop()
    clear_storage_clients()


def _uploads(method: str, path: str) -> bool:
    return method in ("POST", "PUT") and "/upload/" in path


@pytest.mark.slow  # gcsfs retries 6 times before it gives up (its backoff cut in faulty_gcs)
def test_shard_upload_retries_then_fails_clearly_and_leaves_no_shard(faulty_gcs):
    root, proxy = faulty_gcs
    proxy.fail(_uploads, times=2)  # transient: two 503s, then the emulator answers
    with tfrecord.TFRecordWriter(f"{root}/data/train-00000-of-00002") as w:
        w.write(b"first")
    statuses = [s for m, p, s in proxy.log if _uploads(m, p)]
    assert statuses == [503, 503, 200]  # retried with backoff, then written
    assert list(tfrecord.read_records(f"{root}/data/train-00000-of-00002")) == [b"first"]

    proxy.fail(_uploads, times=None)  # the store keeps failing
    with (
        pytest.raises(storage.StorageError) as e,
        tfrecord.TFRecordWriter(f"{root}/data/train-00001-of-00002") as w,
    ):
        w.write(b"second")
    message = str(e.value)
    assert message.startswith(f"{root}/data/train-00001-of-00002: could not finish writing it")
    assert "STORAGE_EMULATOR_HOST" in message and "\n" not in message
    assert sum(1 for m, p, s in proxy.log if _uploads(m, p) and s == 503) >= 6  # gcsfs retried
    proxy.rules.clear()
    assert tfrecord.list_files(f"{root}/data/train-*") == [f"{root}/data/train-00000-of-00002"]


@pytest.mark.slow  # gcsfs retries 6 times before it gives up (its backoff cut in faulty_gcs)
def test_checkpoint_whose_commit_fails_is_never_listed(faulty_gcs):
    from estimax.state import checkpoints

    root, proxy = faulty_gcs
    model_dir = f"{root}/run"
    ckpt = checkpoints.Checkpointer(model_dir, async_save=False)

    def array_upload(method: str, path: str) -> bool:  # TensorStore writing Orbax's OCDBT files
        return _uploads(method, path) and "ocdbt" in path

    proxy.fail(array_upload, times=2)  # transient: TensorStore retries with backoff
    ckpt.save(1, {"w": np.ones(4)}, {}, {}, None)
    ckpt.wait_until_finished()
    statuses = [s for m, p, s in proxy.log if array_upload(m, p)]
    assert statuses[:2] == [503, 503] and statuses.count(200) >= 1

    def commit_of_step_2(method: str, path: str) -> bool:
        return _uploads(method, path) and "checkpoints%2F2%2Fcommit_success" in path.replace(
            "/", "%2F"
        )

    proxy.fail(commit_of_step_2, times=None)  # everything of step 2 is written but its commit
    with pytest.raises(storage.StorageError) as e:
        ckpt.save(2, {"w": np.full(4, 2.0)}, {}, {}, None)
        ckpt.wait_until_finished()
    assert f"{model_dir}/checkpoints" in str(e.value)
    assert any(s == 503 for m, p, s in proxy.log if commit_of_step_2(m, p))
    proxy.rules.clear()
    # The arrays of step 2 are in the bucket, but no reader takes it for a checkpoint.
    assert storage.exists(f"{model_dir}/checkpoints/2")
    assert not storage.exists(f"{model_dir}/checkpoints/2/commit_success.txt")
    reader = checkpoints.Checkpointer(model_dir, read_only=True)
    assert reader.all_steps() == [1] and reader.latest_step() == 1
    np.testing.assert_array_equal(reader.restore_numpy(1)["w"], np.ones(4))
    reader.close()
    assert list(checkpoints.checkpoints_iterator(model_dir, timeout=0)) == [1]


# One writer process for both saves (one JAX import, not two): it saves each step it reads
# from stdin and says so on stdout.
_WRITER = """
import sys
import numpy as np
from estimax.state import checkpoints
w = checkpoints.Checkpointer(sys.argv[1], async_save=False)
for line in sys.stdin:
    w.save(int(line), {"w": np.ones(2)}, {}, {}, None)
    w.wait_until_finished()
    print("saved", int(line), flush=True)
w.close()
"""


def test_a_follower_sees_checkpoints_another_process_writes(object_store, tmp_path):
    """--mode=eval beside a training job: fsspec's listing cache must not hide new steps."""
    import subprocess
    import sys

    from estimax.state import checkpoints

    root, _ = object_store
    model_dir = f"{root}/run"
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root_dir, "JAX_PLATFORMS": "cpu"}
    # Its log goes to a file: a pipe nobody reads would stop a chatty writer.
    log = open(tmp_path / "writer.log", "w+")
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, model_dir],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )

    def train_job_saves(step: int) -> None:
        writer.stdin.write(f"{step}\n")
        writer.stdin.flush()
        said = writer.stdout.readline()  # returns once saved ("" if the writer died)
        assert said == f"saved {step}\n", said + (tmp_path / "writer.log").read_text()[-3000:]

    try:
        train_job_saves(1)
        polls = []
        follower = checkpoints.checkpoints_iterator(
            model_dir, timeout=3, sleep=polls.append, clock=lambda: len(polls)
        )
        assert next(follower) == 1
        train_job_saves(2)
        assert list(follower) == [2]
    finally:
        writer.stdin.close()
        writer.wait(timeout=300)
        log.close()
    assert writer.returncode == 0, (tmp_path / "writer.log").read_text()[-3000:]
