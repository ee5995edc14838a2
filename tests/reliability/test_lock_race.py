"""Two trainers taking one model_dir's writer lock at the same instant: never both.

Two child processes (real processes: the lock must hold between them, not only between threads)
each wait for the test's ``go`` on stdin, take ``WriterLock(model_dir)``, say whether they hold
it, and release it on the next line. The test starts each round by writing ``go`` to both, with
no lock present or (every other round) with a stale one (its holder dead: a pid that no longer
runs on this host), and asserts that exactly one of them holds it. Local disk, fake-gcs-server
and moto's S3 (whose preconditions these are: ``ifGenerationMatch``, ``If-None-Match``,
``If-Match``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from estimax.state import lock

from .conftest import scale

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

WORKER = """
import sys
from estimax.state import lock

held = None
for line in sys.stdin:
    if line.strip() == "go":
        held = lock.WriterLock(sys.argv[1])
        try:
            held.acquire()
            print("held", flush=True)
        except lock.LockError as e:
            held = None
            print("refused", e, flush=True)
    else:
        if held is not None:
            held.release()
        held = None
        print("released", flush=True)
"""


def _dead_pid() -> int:
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


def _stale_lock(dead_pid: int) -> bytes:
    """The lock a trainer that was killed leaves: this host, a pid that no longer runs."""
    return json.dumps(
        {
            "host": socket.gethostname(),
            "pid": dead_pid,
            "boot_id": lock.boot_id(),
            "token": "dead",
            "started": time.time(),
            "heartbeat": time.time(),  # fresh: only the process check can call it stale
        }
    ).encode()


def _race(model_dir: str, rounds: int, put_stale, remove) -> tuple[int, list[str]]:
    """Runs ``rounds`` rounds of two workers; (rounds where both held it, refusal messages)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, model_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    both, refusals = 0, []
    try:
        for i in range(rounds):
            if i % 2:
                put_stale()
            for w in workers:
                w.stdin.write("go\n")
                w.stdin.flush()
            answers = [w.stdout.readline().strip() for w in workers]
            held = sum(a == "held" for a in answers)
            both += held == 2
            assert held >= 1, answers  # a dead holder's lock is taken over: someone runs
            refusals += [a for a in answers if a != "held"]
            for w in workers:
                w.stdin.write("release\n")
                w.stdin.flush()
            assert [w.stdout.readline().strip() for w in workers] == ["released"] * 2
            remove()
    finally:
        for w in workers:
            w.stdin.close()
            w.wait(timeout=60)
    return both, refusals


def test_two_trainers_on_local_disk_never_both_hold_the_lock(tmp_path, reliability_record):
    rounds = scale(100, 400)  # half of them with a stale lock
    path = tmp_path / lock.LOCK_FILE
    dead = _dead_pid()
    both, refusals = -1, []
    try:
        both, refusals = _race(
            str(tmp_path),
            rounds,
            put_stale=lambda: path.write_bytes(_stale_lock(dead)),
            remove=lambda: path.unlink(missing_ok=True),
        )
    finally:
        reliability_record("fault", "two trainers racing (local disk)", rounds, both == 0)
    assert both == 0, f"both trainers held the lock in {both} of {rounds} rounds"
    assert all("--model_dir is in use by another trainer" in r for r in refusals), refusals[:3]
    assert not path.exists()


def test_two_trainers_on_an_object_store_never_both_hold_the_lock(object_store, reliability_record):
    base, _ = object_store
    kind = base.split(":")[0]
    rounds = scale(100, 400)  # half of them with a stale lock
    model_dir = f"{base}/run"
    store = lock._store(f"{model_dir}/{lock.LOCK_FILE}")
    dead = _dead_pid()

    def remove():
        found = store.get()
        if found is not None:
            store.delete(found[1])

    both, refusals = -1, []
    try:
        both, refusals = _race(
            model_dir,
            rounds,
            put_stale=lambda: store.create(_stale_lock(dead)),
            remove=remove,
        )
    finally:
        reliability_record("fault", f"two trainers racing ({kind}://)", rounds, both == 0)
    assert both == 0, f"both trainers held the lock in {both} of {rounds} rounds"
    assert all("--model_dir is in use by another trainer" in r for r in refusals), refusals[:3]
    assert store.get() is None


def test_the_stores_refuse_a_stale_version(object_store):
    """The emulators enforce the preconditions the lock relies on (checked, not assumed)."""
    base, _ = object_store
    store = lock._store(f"{base}/run/{lock.LOCK_FILE}")
    first = store.create(b"1")
    assert first is not lock.LOST
    assert store.create(b"2") is lock.LOST  # exists
    second = store.replace(b"3", first)
    assert second is not lock.LOST
    assert store.replace(b"4", first) is lock.LOST  # a version that is gone
    assert store.get() == (b"3", second)
    if base.startswith("s3"):  # fake-gcs-server ignores ifGenerationMatch on DELETE (GCS does
        # not); the lock deletes only an object it has just read back as its own anyway.
        store.delete(first)  # not its version: left
        assert store.get() is not None
    store.delete(second)
    assert store.get() is None
