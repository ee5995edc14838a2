"""One path type for local disk, ``gs://`` and ``s3://``: data, checkpoints, summaries, exports.

Who talks to the object store, and how each is pointed at an emulator:

- TFRecords, manifests, index files, exports, event files: fsspec (``gcsfs``, ``s3fs``);
  endpoint from ``STORAGE_EMULATOR_HOST`` (gcsfs) or ``AWS_ENDPOINT_URL`` (botocore).
- Checkpoint arrays: Orbax -> TensorStore's ``gcs`` / ``s3`` kvstore; endpoint from
  ``TENSORSTORE_GCS_HTTP_URL`` (set here from ``STORAGE_EMULATOR_HOST``) or the kvstore spec's
  ``endpoint`` (set here from ``AWS_ENDPOINT_URL``).
- Checkpoint directories and commit files: Orbax -> ``etils.epath`` -> fsspec, as above.
- Deleting old checkpoints on GCS: Orbax -> ``google-cloud-storage`` (``STORAGE_EMULATOR_HOST``).

So a user sets only ``STORAGE_EMULATOR_HOST`` (the variable Google's own clients honour) or
``AWS_ENDPOINT_URL`` (the one AWS's SDKs honour) and every part follows: :func:`configure`
maps them for the clients that read other names. TensorStore reads neither (checked: its gcs
driver's endpoint variable is ``TENSORSTORE_GCS_HTTP_URL``; its s3 driver, without an
``endpoint`` in the spec, asks AWS for the bucket's region and hangs without a network).

Atomicity: object stores have no rename. A TFRecord shard or an index file is one upload, which
becomes visible only when it completes (gcsfs: a single or resumable upload finalised on close;
s3fs: a put or a multipart upload completed on close); a failed write is discarded, never
closed, so nothing appears under the final name. An export directory is uploaded file by file
with ``signature.json`` last: a loader that waits for it never reads half an export. Orbax
commits a checkpoint on GCS by writing ``commit_success.txt`` last and counting only steps that
have it; ``estimax.state.orbax_storage`` asks for the same on S3 (Orbax would otherwise
pick its rename protocol there, which S3 cannot do atomically).

Retries and timeouts: the clients' own, configured here (:func:`configure_clients`), never a
second loop of ours over theirs (that would multiply the waits). S3: botocore's "standard" retry
mode (exponential backoff with jitter on 5xx, throttling, timeouts and connection errors) with
``ESTIMAX_STORAGE_RETRIES`` retries (default 5) and connect/read timeouts of
``ESTIMAX_STORAGE_TIMEOUT_S`` (default 60 s); s3fs retries on top of that only timeouts and
connection or parse errors (its fixed 5 attempts, not configurable per filesystem). GCS:
gcsfs retries 429, 5xx and connection errors 6 times with exponential backoff (a number fixed
in gcsfs), and a request whose connection or any one read stalls longer than
``ESTIMAX_STORAGE_TIMEOUT_S`` is one of those errors.
TensorStore (checkpoint arrays) retries per ``gcs_request_retries`` / ``s3_request_retries``.
What is left after the retries becomes one :class:`StorageError` that names the path and says
what to check.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from typing import IO, Any

import fsspec

REMOTE_SCHEMES = ("gs", "s3")
_EMULATOR_TEST_TOKEN = "estimax-emulator"  # any token: emulators do not check it


class StorageError(OSError):
    """A storage operation failed after the client's retries; the message names the path."""


def scheme(path: str) -> str:
    """Returns the URL scheme of ``path`` (``"gs"``, ``"s3"``, ...), or ``""`` for local paths."""
    head, sep, _ = str(path).partition("://")
    return head.lower() if sep else ""


def is_remote(path: str) -> bool:
    """True for paths on an object store (``gs://``, ``s3://``) or any other non-local URL."""
    return scheme(path) not in ("", "file", "local")


def join(path: str, *parts: str) -> str:
    """Joins path parts with ``/`` for URLs (``os.path.join`` for local paths)."""
    return posixpath.join(path, *parts) if is_remote(path) else os.path.join(path, *parts)


def _with_http(host: str) -> str:
    return host if "://" in host else "http://" + host


_mapped: dict[int, str] = {}  # the TENSORSTORE_GCS_HTTP_URL value configure() set, per environ


def configure(environ: dict[str, str] | None = None) -> None:
    """Points every client at the emulators named by the standard variables (idempotent).

    ``STORAGE_EMULATOR_HOST=host:port`` (or ``http://host:port``) becomes TensorStore's
    ``TENSORSTORE_GCS_HTTP_URL`` and, since an emulator takes any token, its
    ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` (so no Google credentials are looked up). For S3,
    ``AWS_ENDPOINT_URL`` is read by botocore (s3fs) itself and put into TensorStore's kvstore
    specs by ``estimax.state.orbax_storage``; an emulator also needs some credentials and a
    region, so for a loopback endpoint with no credentials configured dummy keys are set, and
    ``us-east-1`` when no region is. Variables already set are left alone.

    Args:
      environ: the environment to update; ``os.environ`` by default.
    """
    env = os.environ if environ is None else environ
    gcs = env.get("STORAGE_EMULATOR_HOST")
    if gcs:
        # Follows STORAGE_EMULATOR_HOST when it changes, unless the user set the URL themself.
        if env.get("TENSORSTORE_GCS_HTTP_URL") in (None, _mapped.get(id(env))):
            env["TENSORSTORE_GCS_HTTP_URL"] = _mapped[id(env)] = _with_http(gcs)
        env.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", _EMULATOR_TEST_TOKEN)
        # gcsfs >= 2026.10 asks the Storage Control API (which emulators lack) for every
        # bucket's layout and logs a warning each time; the plain client is what they serve.
        env.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    endpoint = env.get("AWS_ENDPOINT_URL")
    if endpoint:
        credentials_file = os.path.expanduser(
            env.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
        )
        has_credentials = (
            env.get("AWS_ACCESS_KEY_ID")
            or env.get("AWS_PROFILE")
            or env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
            or os.path.exists(credentials_file)
        )
        # Dummy keys only for a server on this machine (an emulator): a real S3-compatible
        # store without credentials must fail with its own "no credentials" error.
        loopback = urllib.parse.urlsplit(_with_http(endpoint)).hostname in (
            "localhost",
            "127.0.0.1",
            "::1",
        )
        if loopback and not has_credentials:
            env.setdefault("AWS_ACCESS_KEY_ID", "emulator")
            env.setdefault("AWS_SECRET_ACCESS_KEY", "emulator")
        if not env.get("AWS_REGION"):
            env.setdefault("AWS_DEFAULT_REGION", "us-east-1")


RETRIES_ENV = "ESTIMAX_STORAGE_RETRIES"
TIMEOUT_ENV = "ESTIMAX_STORAGE_TIMEOUT_S"
_DEFAULT_RETRIES = 5
_DEFAULT_TIMEOUT_S = 60.0
_configured_clients: dict[str, tuple[int, float]] = {}


def _env_number(environ: Any, name: str, default: float, kind: type) -> Any:
    raw = environ.get(name, "")
    if not raw:
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if value < 0 or (kind is float and value == 0):
        raise ValueError(
            f"{name}={raw!r} must be a {'positive' if kind is float else 'non-negative'} "
            f"{'number' if kind is float else 'integer'}"
        )
    return value


def configure_clients(environ: dict[str, str] | None = None) -> tuple[int, float]:
    """Sets the retries and timeouts of the s3fs and gcsfs clients (fsspec's defaults for them).

    Read from ``ESTIMAX_STORAGE_RETRIES`` (retries after the first attempt, default 5) and
    ``ESTIMAX_STORAGE_TIMEOUT_S`` (connect and read timeout of one request, default 60). They
    apply to filesystem instances created afterwards (instances are cached by their options,
    so a change of the variables gives new instances). Options a user put in fsspec's config
    themselves are left alone.

    Returns:
      ``(retries, timeout_s)`` in force.

    Raises:
      ValueError: a variable is not a number (names it).
    """
    env = os.environ if environ is None else environ
    retries = _env_number(env, RETRIES_ENV, _DEFAULT_RETRIES, int)
    timeout = _env_number(env, TIMEOUT_ENV, _DEFAULT_TIMEOUT_S, float)
    for protocol in ("s3", "gs"):
        conf = fsspec.config.conf.setdefault(protocol, {})
        previous = _configured_clients.get(protocol)
        ours = _client_options(protocol, retries, timeout)
        mine_before = _client_options(protocol, *previous) if previous else {}
        for key, value in ours.items():
            # Ours are replaced when the variables change; a user's own settings never.
            if key not in conf or conf[key] == mine_before.get(key):
                conf[key] = value
        _configured_clients[protocol] = (retries, timeout)
    return retries, timeout


def _client_options(protocol: str, retries: int, timeout: float) -> dict[str, Any]:
    if protocol == "s3":
        return {
            "config_kwargs": {
                "connect_timeout": timeout,
                "read_timeout": timeout,
                "retries": {"mode": "standard", "total_max_attempts": retries + 1},
            },
        }
    import aiohttp  # gcsfs's HTTP client

    # Per connect and per socket read, not in total: a stalled read then raises aiohttp's
    # ServerTimeoutError, a ClientError that gcsfs retries; a total timeout raises a bare
    # asyncio.TimeoutError, which gcsfs does not retry (a stalled request failed at once,
    # found by tests/reliability/test_slow_storage.py). No total limit: a large upload may
    # take long while every read and write makes progress.
    return {"requests_timeout": aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)}


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``path`` and the path within it.

    Raises:
      StorageError: the client for the scheme is not installed (names the package).
    """
    configure()
    if scheme(path) in REMOTE_SCHEMES:
        configure_clients()
    try:
        return fsspec.core.url_to_fs(path)
    except ImportError as e:
        raise StorageError(f"{path}: cannot open {scheme(path)}:// paths ({e}).") from e


def _error(path: str, action: str, e: BaseException) -> StorageError:
    where = scheme(path)
    hint = ""
    if where == "gs":
        hint = (
            " Check the bucket exists and the credentials can reach it "
            "(STORAGE_EMULATOR_HOST for an emulator)."
        )
    elif where == "s3":
        hint = (
            " Check the bucket exists and the credentials can reach it "
            "(AWS_ENDPOINT_URL for an S3-compatible server)."
        )
    return StorageError(f"{path}: could not {action}: {type(e).__name__}: {e}.{hint}")


@contextlib.contextmanager
def errors_named(path: str, action: str) -> Iterator[None]:
    """Turns a client's final failure (after its retries) into one :class:`StorageError`.

    Only for remote paths: local errors (``OSError`` with its own path) pass unchanged.
    """
    if not is_remote(path):
        yield
        return
    try:
        yield
    except (
        StorageError,
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        NotADirectoryError,
    ):
        raise
    except Exception as e:  # gcsfs HttpError, botocore ClientError, aiohttp errors, OSError...
        raise _error(path, action, e) from e


def exists(path: str) -> bool:
    """True if ``path`` names a file or a directory (on object stores: any object under it)."""
    if not is_remote(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    with errors_named(path, "look it up"):
        fs.invalidate_cache(p)
        return fs.exists(p)


def isdir(path: str) -> bool:
    """True if ``path`` is a directory (on object stores: a prefix with objects under it)."""
    if not is_remote(path):
        return os.path.isdir(path)
    fs, p = filesystem(path)
    with errors_named(path, "look it up"):
        # Listings are cached per filesystem instance; a follower must see new objects.
        fs.invalidate_cache(p)
        return fs.isdir(p)


def refresh(path: str) -> None:
    """Drops cached listings under ``path`` so the next listing asks the store.

    fsspec caches directory listings per filesystem instance, without expiry; a process that
    follows another's writes (``--mode=eval`` polling a training job's checkpoints) would never
    see a new object. Orbax lists through ``etils.epath``, which holds its own gcsfs/s3fs
    instances, so both are refreshed. No-op for local paths.
    """
    if not is_remote(path):
        return
    fs, _ = filesystem(path)
    filesystems = [fs]
    try:
        from etils.epath import backend
    except ImportError:
        pass
    else:
        filesystems.append(backend.fsspec_backend.fs(path))
    for f in filesystems:
        prefix = f._strip_protocol(path).rstrip("/")  # noqa: SLF001 (no public twin)
        f.invalidate_cache(prefix)  # the prefix and its parents
        # ...and everything below it: a step listed while its save was still running must
        # not stay without its commit marker in the cache.
        for key in [k for k in list(f.dircache) if k.startswith(prefix + "/")]:
            f.dircache.pop(key, None)


def makedirs(path: str) -> None:
    """Creates a local directory and its parents; object stores have no directories (no-op)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def open_file(path: str, mode: str = "rb", **kwargs: Any) -> IO:
    """Opens ``path`` (any fsspec URL) for reading or writing."""
    if not is_remote(path):
        return open(path, mode, **kwargs)
    fs, p = filesystem(path)
    with errors_named(path, "open it"):
        return fs.open(p, mode, **kwargs)


def discard(f: IO) -> None:
    """Drops a remote file being written without making it visible (no commit of a partial)."""
    drop = getattr(f, "discard", None)
    if drop is not None:
        drop()
        f.closed = True  # type: ignore[misc]  # fsspec's buffered files: close() is now a no-op
    else:
        f.close()


def upload_file(local_path: str, path: str) -> None:
    """Copies one local file to ``path`` (one upload: visible only when complete)."""
    if not is_remote(path):
        shutil.copyfile(local_path, path)
        return
    fs, p = filesystem(path)
    with errors_named(path, "upload it"):
        fs.put_file(local_path, p)


def staging_dir(final: str) -> str:
    """A directory to build ``final`` in before :func:`publish_dir`.

    Local: ``final + '.tmp'`` beside it (then renamed). Remote: a local temporary directory.
    """
    if is_remote(final):
        return tempfile.mkdtemp(prefix="estimax-staging-")
    os.makedirs(final + ".tmp", exist_ok=True)
    return final + ".tmp"


def publish_dir(staging: str, final: str, last: str | None = None) -> None:
    """Makes the files of ``staging`` appear under ``final``, complete, then removes ``staging``.

    Local: one rename. Remote: one upload per file, ``last`` (a file name in ``staging``)
    uploaded after all the others, so a reader that waits for ``last`` never sees a partial
    directory.

    Raises:
      StorageError: an upload failed after the client's retries (names the path).
    """
    if not is_remote(final):
        shutil.move(staging, final)
        return
    names = sorted(os.listdir(staging))
    if last in names:
        names.remove(last)
        names.append(last)
    try:
        for name in names:
            upload_file(os.path.join(staging, name), join(final, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --- TensorBoard event files --------------------------------------------------------------------


class _SpooledRecordWriter:
    """A tensorboardX record writer for object stores: appends to a local spool file and uploads
    the whole file on ``flush``.

    Object stores cannot append; TensorFlow's GCS writer does the same (local temp file,
    re-uploaded on flush). tensorboardX's own gs:// / s3:// writers hold the whole event file in
    memory and use clients that ignore the emulator variables, hence this one.
    """

    def __init__(self, path: str):
        self.path = path
        fd, self._spool = tempfile.mkstemp(prefix="estimax-events-")
        self._file = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def flush(self) -> None:
        self._file.flush()
        upload_file(self._spool, self.path)

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()
            os.remove(self._spool)


class _SpooledWriterFactory:
    def open(self, path: str) -> _SpooledRecordWriter:
        return _SpooledRecordWriter(path)

    def directory_check(self, path: str) -> None:
        pass  # object stores have no directories


# The cloud clients tensorboardX's record_writer imports, at its import, for writers of its own
# that estimax replaces (below): importing them cost 0.5 of the 0.8 CPU-s of importing
# tensorboardX (2-core EPYC, measured with and without), in every process that writes summaries.
_TENSORBOARDX_UNUSED_CLIENTS = ("boto3", "google.cloud.storage")


def register_summary_writers() -> None:
    """Makes tensorboardX write ``gs://`` and ``s3://`` event files through fsspec (idempotent).

    Call it before a process's first tensorboardX import: it imports tensorboardX without the
    S3 and GCS clients its own writers for those schemes would use (never used here).
    """
    import sys

    if "tensorboardX.record_writer" not in sys.modules:
        # A None entry makes `import boto3` raise ImportError, which tensorboardX takes as
        # "no S3 writer" (its try/except); the entries are gone again once it is imported.
        hidden = [name for name in _TENSORBOARDX_UNUSED_CLIENTS if name not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]
        try:
            import tensorboardX  # noqa: F401 (its package imports record_writer)
        finally:
            for name in hidden:
                if name in sys.modules and sys.modules[name] is None:
                    del sys.modules[name]
    from tensorboardX import record_writer

    for prefix in REMOTE_SCHEMES:
        if not isinstance(record_writer.REGISTERED_FACTORIES.get(prefix), _SpooledWriterFactory):
            record_writer.register_writer_factory(prefix, _SpooledWriterFactory())


# --- JSON state files ---------------------------------------------------------------------------

# Deeper than any file estimax writes (evaluations.json: 4 levels with a confusion matrix;
# manifest.json: 4; a cluster spec: 3), far below Python's recursion limit: a file nested
# deeper is damaged (or hostile), and is refused before anything walks it recursively.
MAX_JSON_DEPTH = 32


class JSONNestingError(ValueError):
    """JSON nested deeper than ``load_json``'s ``max_depth``."""


def load_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` parsed as JSON, nested at most ``max_depth`` levels deep.

    ``json.loads`` raises ``RecursionError`` on input nested deeper than Python's recursion
    limit (about 1,000 levels), and a structure just under it makes every later recursive walk
    (``repr``, ``json.dumps``, ``copy.deepcopy``) fail the same way. Both become a ValueError,
    which every reader of a state file already turns into its warning or its one-line error.

    Raises:
      ValueError: not UTF-8 JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``), or nested
        deeper than ``max_depth`` (``JSONNestingError``).
    """
    import json

    try:
        value = json.loads(data)
    except RecursionError:
        raise JSONNestingError(f"nested deeper than {max_depth} levels") from None
    # Iterative, so that the check itself cannot run out of stack.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > max_depth:
            raise JSONNestingError(f"nested deeper than {max_depth} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return value
