"""One trainer per model_dir: a writer lock file, on local disk or on an object store.

Two trainers writing the same checkpoints corrupt each other's runs, so a training run holds
``model_dir/writer.lock`` (JSON: host, pid, start and heartbeat times, a random token) until it
ends. A second trainer stops at once with a message naming the first's host and pid.

When is a lock stale (its holder died without removing it)?

* Same host: the holder's pid is not running -- taken over at once.
* Another host, or a holder whose heartbeat stopped: processes cannot be seen across hosts, so
  the holder rewrites its heartbeat every ``heartbeat_secs`` (60 s) and a lock whose heartbeat
  is older than ``stale_secs`` (300 s, wall clock; hosts' clocks are assumed to agree to a
  minute) is taken over. This is how it works on gs:// and s3://, whose objects fsspec reads and
  writes as it does local files.

Creating the lock is exclusive on local disk (``O_EXCL``). Object stores have no exclusive create
through fsspec, so there the lock is written, read back and kept only if it still holds this
run's token: two trainers started within the same second on a bucket can still both pass,
which the check after writing narrows to the store's write latency.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from absl import logging

from estimax.programs.cli import UsageError

LOCK_FILE = "writer.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class WriterLock:
    """``model_dir/writer.lock`` for the time of a training run (a context manager).

    Args:
      model_dir: the run's model directory (any fsspec path).
      heartbeat_secs: how often the holder refreshes its heartbeat.
      stale_secs: a lock whose heartbeat is older than this is taken over.
      clock: wall-clock time source (injectable for tests).
      host, pid: who holds it (default: this process).
      pid_alive: whether a pid runs on this host (injectable for tests).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        heartbeat_secs: float = 60.0,
        stale_secs: float = 300.0,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        pid: int | None = None,
        pid_alive: Callable[[int], bool] = _pid_alive,
    ):
        self.path = posixpath.join(model_dir, LOCK_FILE)
        self._fs, self._fs_path = fsspec.core.url_to_fs(self.path)
        self._local = "file" in self._fs.protocol
        self.heartbeat_secs = heartbeat_secs
        self.stale_secs = stale_secs
        self._clock = clock
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self._pid_alive = pid_alive
        self._token = uuid.uuid4().hex
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def read(self) -> dict[str, Any] | None:
        """The lock's content, or None when there is no (readable) lock."""
        try:
            with self._fs.open(self._fs_path, "r") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return {}  # half-written or unreadable: judged by its age below

    def stale_reason(self, holder: dict[str, Any]) -> str | None:
        """Why ``holder``'s lock may be taken over, or None while it is held."""
        age = self._clock() - float(holder.get("heartbeat", 0.0))
        if holder.get("host") == self.host and "pid" in holder:
            if not self._pid_alive(int(holder["pid"])):
                return f"pid {holder['pid']} no longer runs on {self.host}"
        if age > self.stale_secs:
            return f"its heartbeat is {age:.0f} s old (more than {self.stale_secs:.0f} s)"
        return None

    def acquire(self) -> None:
        """Takes the lock, or raises ``UsageError`` naming the trainer that holds it."""
        self._fs.makedirs(posixpath.dirname(self._fs_path), exist_ok=True)
        holder = self.read()
        if holder is not None:
            reason = self.stale_reason(holder)
            if reason is None:
                raise UsageError(
                    f"--model_dir is in use by another trainer: pid {holder.get('pid')} on host "
                    f"{holder.get('host')} (see {self.path}). Stop it or use another "
                    f"--model_dir; a lock left by a process that died is taken over "
                    f"automatically."
                )
            logging.warning(
                "Taking over %s from pid %s on %s: %s.",
                self.path,
                holder.get("pid"),
                holder.get("host"),
                reason,
            )
            self._fs.rm(self._fs_path)
        self._started = self._clock()
        self._write(exclusive=True)
        now = self.read() or {}
        if now.get("token") != self._token:
            raise UsageError(
                f"--model_dir is in use by another trainer: pid {now.get('pid')} "
                f"on host {now.get('host')} took {self.path} at the same time."
            )
        self._thread = threading.Thread(target=self._beat, name="writer-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stops the heartbeat and removes the lock if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if (self.read() or {}).get("token") == self._token:
            self._fs.rm(self._fs_path)

    def _content(self) -> str:
        return json.dumps(
            {
                "host": self.host,
                "pid": self.pid,
                "token": self._token,
                "started": self._started,
                "heartbeat": self._clock(),
            }
        )

    def _write(self, exclusive: bool = False) -> None:
        if exclusive and self._local:
            try:
                fd = os.open(self._fs_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self.read() or {}
                raise UsageError(
                    f"--model_dir is in use by another trainer: pid {holder.get('pid')} on host "
                    f"{holder.get('host')} took {self.path} at the same time."
                ) from None
            with os.fdopen(fd, "w") as f:
                f.write(self._content())
            return
        self._fs.pipe_file(self._fs_path, self._content().encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_secs):
            try:
                if (self.read() or {}).get("token") != self._token:
                    logging.warning(
                        "%s was taken over by another trainer; this run no longer holds it.",
                        self.path,
                    )
                    return
                self._write()
            except OSError as e:  # a transient store error must not end the training run
                logging.warning("Could not refresh %s: %s", self.path, e)
