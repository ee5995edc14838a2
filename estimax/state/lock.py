"""One trainer per model_dir: a writer lock, taken atomically on local disk or an object store.

Two trainers writing the same checkpoints corrupt each other's runs, so a training run holds
``model_dir/writer.lock`` until it ends. A second trainer stops at once with one line naming the
first's host and pid. Taking the lock is one atomic step wherever model_dir is, so of two
trainers started at the same instant exactly one runs:

| where                 | taken by                                 | a dead holder's lock          |
|-----------------------|------------------------------------------|-------------------------------|
| local disk, NFS       | ``flock`` on ``writer.lock``             | released by the kernel when   |
|                       |                                          | its process ends, however     |
| ``gs://``             | create only if absent                    | replaced only if it is still  |
|                       | (``ifGenerationMatch=0``)                | the object judged stale       |
|                       |                                          | (``ifGenerationMatch=<gen>``) |
| ``s3://``             | create only if absent                    | the same (``If-Match: ETag``) |
|                       | (``If-None-Match: *``)                   |                               |
| ``memory://``         | the same, under a lock of this process   |                               |

On local disk the kernel knows whether the holder lives: a lock left by a process that was
killed, or by a container that was restarted (same host name, pid 1 again), is taken over at
once. The file's content (JSON: who holds it) only names the holder for the second trainer's
message. Where ``flock`` is refused (some network file systems), the lock is created with
``O_EXCL`` and judged as on an object store (not atomic when two trainers take over one stale
lock at the same instant; said in a warning).

An object store cannot see processes, so its lock says who holds it (host, kernel boot id, pid,
the process's start time) and when the holder last beat (``heartbeat_secs``: 60 s). It is stale:

* when it was written on this machine (same host name and boot id) by a process that no longer
  runs: no process has its pid, or the one that has it started at another time (a restarted
  container's new pid 1). Processes sharing a host name are assumed to share a PID namespace,
  except a restarted container's earlier self;
* when it was written on this host name before the machine restarted (another boot id);
* otherwise when its heartbeat is older than ``stale_secs`` (300 s, wall clock; hosts' clocks
  are assumed to agree to a minute).

The holder rewrites its heartbeat conditionally on its own last write, so it notices (and
warns) when another trainer took the lock over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from absl import logging

from estimax import storage


class LockError(ValueError):
    """The model_dir is another live trainer's, or cannot be written: one line saying what to
    do (the programs show it as a usage error, without a traceback)."""


LOCK_FILE = "writer.lock"
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


# ------------------------------------------------------------------ who holds it


def boot_id() -> str | None:
    """The running kernel's boot id (Linux; changes when the machine restarts), or None."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), or None if there is none.

    On systems without ``/proc`` a running process gives 0 (unknown start: alive by pid only).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0 if _pid_alive(pid) else None
    # Field 22 (starttime), counted after the command name's closing parenthesis.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


# A conditional write that found the object in another state than expected (another trainer
# wrote it) returns LOST instead of a version.
LOST = None


def _not_writable(model_dir: str, e: OSError) -> Exception:
    """The one error for a model_dir the lock cannot be written in."""
    if e.errno in _DISK_FULL:
        return storage.StorageError(
            f"Could not write the writer lock {posixpath.join(model_dir, LOCK_FILE)}: "
            f"{e.strerror or e} (the disk is full or a file size limit was reached; free "
            "space and run again)."
        )
    if e.errno in _NOT_WRITABLE:
        return LockError(
            f"--model_dir={model_dir} is not writable ({e.strerror or e}): a training run "
            "writes its checkpoints there. Give a writable --model_dir (copy this one to "
            "continue its training), or --mode=eval to evaluate it."
        )
    return storage.StorageError(
        f"Could not write the writer lock in {model_dir}: {type(e).__name__}: {e}"
    )


# ------------------------------------------------------------------ object stores


class _Store:
    """One small object read and written conditionally on its version (compare-and-swap).

    ``version`` is what the store's precondition takes: a GCS generation, an S3 ETag; here the
    bytes themselves (atomic only under ``_MEMORY_LOCK``, for ``memory://``).
    """

    atomic = False

    def __init__(self, path: str):
        self.path = path
        self.fs, self.key = storage.filesystem(path)

    def get(self) -> tuple[bytes, Any] | None:
        """``(content, version)``, or None when there is no object."""
        try:
            data = self.fs.cat_file(self.key)
        except FileNotFoundError:
            return None
        return data, data

    def create(self, data: bytes) -> Any:
        """Writes ``data`` if there is no object; its version, or ``LOST`` if there is one."""
        if self.fs.exists(self.key):
            return LOST
        self.fs.pipe_file(self.key, data)
        return data

    def replace(self, data: bytes, version: Any) -> Any:
        """Writes ``data`` if the object is still at ``version``; else ``LOST``."""
        found = self.get()
        if found is None or found[1] != version:
            return LOST
        self.fs.pipe_file(self.key, data)
        return data

    def delete(self, version: Any) -> None:
        """Deletes the object if it is still at ``version`` (else leaves it)."""
        found = self.get()
        if found is not None and found[1] == version:
            self.fs.rm_file(self.key)


_MEMORY_LOCK = threading.Lock()


class _MemoryStore(_Store):
    """``memory://`` lives in this process: one lock makes its check-and-write atomic."""

    atomic = True

    def create(self, data: bytes) -> Any:
        with _MEMORY_LOCK:
            return super().create(data)

    def replace(self, data: bytes, version: Any) -> Any:
        with _MEMORY_LOCK:
            return super().replace(data, version)

    def delete(self, version: Any) -> None:
        with _MEMORY_LOCK:
            super().delete(version)


class _GcsStore(_Store):
    """GCS's generation preconditions, through gcsfs's own authenticated, retrying client.

    A multipart upload rather than a media one: fake-gcs-server (the emulator the tests run)
    honours ``ifGenerationMatch`` only there; GCS honours it on both.
    """

    atomic = True

    def __init__(self, path: str):
        super().__init__(path)
        self.bucket, self.name = self.key.split("/", 1)

    def get(self) -> tuple[bytes, Any] | None:
        try:
            headers, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.name, alt="media")
        except FileNotFoundError:
            return None
        return data, headers.get("X-Goog-Generation") or headers.get("x-goog-generation")

    def _upload(self, data: bytes, generation: Any) -> Any:
        meta = json.dumps({"name": self.name, "contentType": "application/json"})
        body = (
            (
                f"--lock\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--lock\n"
                "Content-Type: application/json\n\n"
            ).encode()
            + data
            + b"\n--lock--"
        )
        try:
            reply = self.fs.call(
                "POST",
                f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o",  # noqa: SLF001
                uploadType="multipart",
                ifGenerationMatch=str(generation),
                headers={"Content-Type": 'multipart/related; boundary="lock"'},
                data=body,
                json_out=True,
            )
        except FileExistsError:  # gcsfs's name for 412 Precondition Failed
            return LOST
        return reply["generation"]

    def create(self, data: bytes) -> Any:
        return self._upload(data, 0)

    def replace(self, data: bytes, version: Any) -> Any:
        return self._upload(data, version)

    def delete(self, version: Any) -> None:
        with contextlib.suppress(FileNotFoundError, FileExistsError):
            self.fs.call(
                "DELETE", "b/{}/o/{}", self.bucket, self.name, ifGenerationMatch=str(version)
            )


def _s3_conflict(e: BaseException) -> bool:
    """Whether s3fs's error is S3's 412 (precondition) or 409 (a concurrent conditional write)."""
    if isinstance(e, FileExistsError):
        return True
    cause = e.__cause__ or e.__context__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code")
    return code in ("PreconditionFailed", "ConditionalRequestConflict")


class _S3Store(_Store):
    """S3's conditional writes (``If-None-Match: *``, ``If-Match: <ETag>``), through s3fs."""

    atomic = True

    def __init__(self, path: str):
        super().__init__(path)
        self.bucket, self.name = self.key.split("/", 1)

    def get(self) -> tuple[bytes, Any] | None:
        import fsspec.asyn

        async def read() -> tuple[bytes, Any]:
            # The reply's body is read in s3fs's own loop: the coroutine has no public twin.
            call = self.fs._call_s3  # noqa: SLF001
            reply = await call("get_object", Bucket=self.bucket, Key=self.name)
            async with reply["Body"] as body:
                return await body.read(), reply["ETag"]

        try:
            return fsspec.asyn.sync(self.fs.loop, read)
        except FileNotFoundError:
            return None

    def _put(self, data: bytes, **condition: str) -> Any:
        try:
            reply = self.fs.call_s3(
                "put_object", Bucket=self.bucket, Key=self.name, Body=data, **condition
            )
        except OSError as e:
            if _s3_conflict(e):
                return LOST
            raise
        return reply["ETag"]

    def create(self, data: bytes) -> Any:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, version: Any) -> Any:
        return self._put(data, IfMatch=version)

    def delete(self, version: Any) -> None:
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.name, IfMatch=version)
        except OSError as e:
            if not (isinstance(e, FileNotFoundError) or _s3_conflict(e)):
                raise


def _store(path: str) -> _Store:
    kinds = {"gs": _GcsStore, "gcs": _GcsStore, "s3": _S3Store, "memory": _MemoryStore}
    return kinds.get(storage.scheme(path), _Store)(path)


# ------------------------------------------------------------------ the lock


class WriterLock:
    """``model_dir/writer.lock`` for the time of a training run (a context manager).

    Args:
      model_dir: the run's model directory (local, ``gs://``, ``s3://``, any fsspec path).
      heartbeat_secs: how often a holder on an object store refreshes its heartbeat.
      stale_secs: an object-store lock whose heartbeat is older than this is taken over.
      clock: wall-clock time source (injectable for tests).
      host, pid: who holds it (default: this process).
      process_start: when a pid of this machine started, None if none runs (injectable).
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
        process_start: Callable[[int], int | None] = process_start,
    ):
        self.model_dir = model_dir
        self.path = storage.join(model_dir, LOCK_FILE)
        self._local = not storage.is_remote(model_dir) or storage.scheme(model_dir) == "file"
        self.heartbeat_secs = heartbeat_secs
        self.stale_secs = stale_secs
        self._clock = clock
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self._process_start = process_start
        self._start = process_start(self.pid) if pid is None else None
        self._boot = boot_id()
        self._token = uuid.uuid4().hex
        self._started = 0.0
        self._fd: int | None = None  # local: the flock'ed file
        self._store: _Store | None = None  # elsewhere: the object and its version
        self._version: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def read(self) -> dict[str, Any] | None:
        """The lock's content, or None when there is no lock ({} when it is unreadable)."""
        try:
            if self._local:
                with open(self._local_path, "rb") as f:
                    data = f.read()
            else:
                found = _store(self.path).get()
                if found is None:
                    return None
                data = found[0]
            return json.loads(data)
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return {}  # half-written or unreadable

    def stale_reason(self, holder: dict[str, Any]) -> str | None:
        """Why ``holder``'s object-store lock may be taken over, or None while it is held."""
        if holder.get("host") == self.host and "pid" in holder:
            pid = int(holder["pid"])
            theirs = holder.get("boot_id")
            if theirs and self._boot and theirs != self._boot:
                return f"{self.host} has restarted since pid {pid} took it (another boot id)"
            if not theirs or theirs == self._boot:
                start = self._process_start(pid)
                if start is None:
                    return f"pid {pid} no longer runs on {self.host}"
                if holder.get("process_start") not in (None, 0, start) and start:
                    return (
                        f"pid {pid} on {self.host} is another process now (the holder's "
                        "container or process was restarted)"
                    )
        age = self._clock() - float(holder.get("heartbeat", 0.0))
        if age > self.stale_secs:
            return f"its heartbeat is {age:.0f} s old (more than {self.stale_secs:.0f} s)"
        return None

    def acquire(self) -> None:
        """Takes the lock, or raises ``LockError`` naming the trainer that holds it.

        Raises:
          LockError: another trainer holds it, or model_dir is read-only (one line each).
          StorageError: the disk is full, or the object store failed (one line).
        """
        self._started = self._clock()
        if self._local and self._acquire_flock():
            return
        self._acquire_conditional()
        self._thread = threading.Thread(target=self._beat, name="writer-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stops the heartbeat and removes the lock if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == os.stat(self._local_path).st_ino:
                    os.unlink(self._local_path)  # while holding it: see _acquire_flock
            os.close(fd)  # releases the flock
        elif self._store is not None and self._version is not None:
            store, self._store = self._store, None
            with contextlib.suppress(OSError):
                store.delete(self._version)

    # -------------------------------------------------------------- local disk

    @property
    def _local_path(self) -> str:
        return self.path[len("file://") :] if self.path.startswith("file://") else self.path

    def _content(self) -> bytes:
        return json.dumps(
            {
                "host": self.host,
                "pid": self.pid,
                "boot_id": self._boot,
                "process_start": self._start,
                "token": self._token,
                "started": self._started,
                "heartbeat": self._clock(),
            }
        ).encode()

    def _in_use(self, holder: dict[str, Any] | None, at_once: bool = False) -> LockError:
        if not holder or "pid" not in holder:
            return LockError(
                f"--model_dir is in use by another trainer that is starting now (see "
                f"{self.path}). Stop it or use another --model_dir."
            )
        if at_once:
            return LockError(
                f"--model_dir is in use by another trainer: pid {holder.get('pid')} "
                f"on host {holder.get('host')} took {self.path} at the same time."
            )
        return LockError(
            f"--model_dir is in use by another trainer: pid {holder.get('pid')} on host "
            f"{holder.get('host')} (see {self.path}). Stop it or use another "
            f"--model_dir; a lock left by a process that died is taken over "
            f"automatically."
        )

    @contextlib.contextmanager
    def _writable(self) -> Iterator[None]:
        """A read-only model_dir or a full disk: one error (see ``_not_writable``)."""
        try:
            yield
        except OSError as e:
            if isinstance(e, storage.StorageError) or e.errno is None:
                raise
            raise _not_writable(self.model_dir, e) from None

    def _acquire_flock(self) -> bool:
        """Takes the local lock with ``flock``; False where the file system refuses flock.

        The file may be replaced between our open and our flock (its holder removing it as it
        ends): the lock counts only if the path still names the file we locked.
        """
        import fcntl

        path = self._local_path
        with self._writable():
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        while True:
            with self._writable():
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise self._in_use(self.read()) from None
                if e.errno in _NO_FLOCK:
                    logging.warning(
                        "%s: this file system refuses file locks (%s); the lock is an "
                        "exclusive file instead, not atomic if two trainers take over one "
                        "stale lock at the same instant.",
                        path,
                        e.strerror,
                    )
                    return False
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        self._took_over(self.read())
        try:
            with self._writable():
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._content(), 0)
                os.fsync(fd)
        except BaseException:
            self.release()
            raise
        return True

    def _took_over(self, previous: dict[str, Any] | None) -> None:
        if previous and previous.get("token") != self._token and "pid" in previous:
            logging.warning(
                "Took over %s from pid %s on %s, which no longer holds it.",
                self.path,
                previous.get("pid"),
                previous.get("host"),
            )

    # -------------------------------------------------------------- object stores

    def _acquire_conditional(self) -> None:
        """Takes the lock by a create-if-absent, or by replacing the very stale object found."""
        store = self._store = _ExclusiveFile(self._local_path) if self._local else _store(self.path)
        for _ in range(3):  # each miss means another trainer wrote between our read and write
            with self._io():
                found = store.get()
            holder = _parse(found[0]) if found is not None else {}
            if found is not None and holder.get("token") == self._token:
                self._version = found[1]  # our own write, whose reply a retry lost
                return
            if found is not None:
                reason = self.stale_reason(holder)
                if reason is None:
                    self._store = None
                    raise self._in_use(holder)
                logging.warning(
                    "Taking over %s from pid %s on %s: %s.",
                    self.path,
                    holder.get("pid"),
                    holder.get("host"),
                    reason,
                )
            with self._io():
                if found is None:
                    self._version = store.create(self._content())
                else:
                    self._version = store.replace(self._content(), found[1])
            if self._version is not LOST:
                return
        self._store = None
        raise self._in_use(self.read(), at_once=True)

    @contextlib.contextmanager
    def _io(self) -> Iterator[None]:
        """The store's errors as one line each."""
        with self._writable(), storage.errors_named(self.path, "take the writer lock"):
            yield

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_secs):
            store = self._store
            if store is None:
                return
            try:
                version = store.replace(self._content(), self._version)
            # Any client error (gcsfs's and aiobotocore's are not all OSErrors): a transient
            # store error must not end the training run.
            except Exception as e:
                logging.warning("Could not refresh %s: %s", self.path, e)
                continue
            if version is LOST:
                logging.warning(
                    "%s was taken over by another trainer; this run no longer holds it.",
                    self.path,
                )
                self._version = None
                return
            self._version = version


def _parse(data: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(data)
    except ValueError:
        return {}  # half-written: judged by its (missing) heartbeat, i.e. stale
    return holder if isinstance(holder, dict) else {}


class _ExclusiveFile(_Store):
    """A local file created with ``O_EXCL`` (where flock is refused): creating is atomic,
    taking over a stale one is not."""

    def __init__(self, path: str):
        self.path = self.key = path

    def get(self) -> tuple[bytes, Any] | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, data

    def create(self, data: bytes) -> Any:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return LOST
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return data

    def replace(self, data: bytes, version: Any) -> Any:
        found = self.get()
        if found is None or found[1] != version:
            return LOST
        tmp = f"{self.path}.{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path)
        return data

    def delete(self, version: Any) -> None:
        found = self.get()
        if found is not None and found[1] == version:
            os.unlink(self.path)
