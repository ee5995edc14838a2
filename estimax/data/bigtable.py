"""Cloud Bigtable as a record source: one serialized tf.Example per row, rows keyed by prefix.

The layout of the original (``resnet_main.py`` ``--bigtable_*`` flags, 2018-08; it read the
table with ``tf.contrib.cloud``'s ``BigtableClient.parallel_scan_prefix``): each split is the rows
whose keys start with a prefix (``train_``, ``validation_``), followed by a zero-filled index
(``train_0000003892``); the cell ``tfexample:example`` holds the same serialized tf.Example a
TFRecord shard would hold. ``estimax-convert to-bigtable`` (``estimax.tools.tfrecords_to_bigtable``)
loads TFRecord shards into that layout.

:class:`BigtableSource` is a ``loader.RecordSource``: at construction it lists the row keys under
the prefix once (keys only: the server strips the values) and sorts them, so record ``i`` is the
``i``-th row in key order, the order a TFRecord conversion wrote them. The loader's seeded
shuffle, per-host sharding (by record), exact resume and skip-and-count then work as for TFRecord
files. Rows are fetched by key, several per request (``read_many``, which the loader uses for
each chunk of records): one request per row was 3-5x slower on the emulator.

The client is the real one (``google-cloud-bigtable``'s ``BigtableDataClient``), created lazily
in each process that reads, so the source pickles into worker processes. With
``BIGTABLE_EMULATOR_HOST=host:port`` it talks to the emulator (``gcloud beta emulators bigtable
start``), without credentials.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from estimax.data import loader

__all__ = [
    "BigtableError",
    "BigtableSource",
    "BigtableTable",
    "EMULATOR_ENV",
    "admin_client",
    "data_client",
    "explain",
    "import_bigtable",
    "prefix_end",
    "row_key",
    "table_path",
]

log = logging.getLogger(__name__)

EMULATOR_ENV = "BIGTABLE_EMULATOR_HOST"
# The original's layout (the seed's example key is train_0000003892).
INDEX_DIGITS = 10


class BigtableError(loader.SourceError):
    """The table cannot be read at all (unreachable, missing, no rows under the prefix, no
    credentials): not a bad record, so the loader stops even with ``skip_bad_records``."""


@dataclasses.dataclass(frozen=True)
class BigtableTable:
    """Where the ImageNet input reads from, in the original's terms (its ``--bigtable_*`` flags).

    Attributes:
      project, instance, table: the table (``project`` None: the client's default project).
      train_prefix, eval_prefix: row key prefixes of the training and evaluation rows.
      column_family, column_qualifier: the cell holding each serialized tf.Example.
      timeout: seconds per read request (see :class:`BigtableSource`).
    """

    project: str | None
    instance: str
    table: str = "imagenet"
    train_prefix: str = "train_"
    eval_prefix: str = "validation_"
    column_family: str = "tfexample"
    column_qualifier: str = "example"
    timeout: float = 60.0

    def source(self, is_training: bool) -> BigtableSource:
        """The training or evaluation rows as a record source.

        Their keys are listed once per process and kept: ``train_and_eval`` calls the input
        function again for every training segment and evaluation, and the emulator lists only
        ~11k keys/s (ImageNet's 1.28M training keys: about two minutes).
        """
        return _cached_source(self, is_training)


@functools.lru_cache(maxsize=8)
def _cached_source(spec: BigtableTable, is_training: bool) -> BigtableSource:
    return BigtableSource(
        spec.project,
        spec.instance,
        spec.table,
        spec.train_prefix if is_training else spec.eval_prefix,
        spec.column_family,
        spec.column_qualifier,
        timeout=spec.timeout,
    )


def row_key(prefix: str, index: int) -> bytes:
    """The key of record ``index`` of a split: ``prefix`` + the index zero-filled to 10 digits."""
    return f"{prefix}{index:0{INDEX_DIGITS}d}".encode()


def table_path(
    project: str | None, instance: str, table: str, emulator_host: str | None | Literal[True] = True
) -> str:
    """``projects/P/instances/I/tables/T`` plus where it is served, for messages.

    ``emulator_host``: True reads ``BIGTABLE_EMULATOR_HOST``; else the host (None: Cloud).
    """
    emulator = os.environ.get(EMULATOR_ENV) if emulator_host is True else emulator_host
    where = f" (emulator at {EMULATOR_ENV}={emulator})" if emulator else " (Cloud Bigtable)"
    return f"projects/{project or '<default project>'}/instances/{instance}/tables/{table}{where}"


def import_bigtable() -> Any:
    """``google.cloud.bigtable.data``, or an ImportError that says what to install."""
    try:
        from google.cloud.bigtable import data
    except ImportError as e:
        raise ImportError(
            "Cloud Bigtable input needs the google-cloud-bigtable package: "
            "pip install google-cloud-bigtable"
        ) from e
    return data


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _emulator_env(host: str | None) -> Iterator[None]:
    """``BIGTABLE_EMULATOR_HOST=host`` (unset for None) while a client is made."""
    with _ENV_LOCK:
        previous = os.environ.get(EMULATOR_ENV)
        if host is None:
            os.environ.pop(EMULATOR_ENV, None)
        else:
            os.environ[EMULATOR_ENV] = host
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(EMULATOR_ENV, None)
            else:
                os.environ[EMULATOR_ENV] = previous


def data_client(project: str | None, emulator_host: str | None | Literal[True] = True) -> Any:
    """A ``BigtableDataClient`` for ``project``; BigtableError if there are no credentials.

    ``emulator_host``: True follows ``BIGTABLE_EMULATOR_HOST``; a host (or None for Cloud
    Bigtable) overrides it for this client, which reads the variable only when it is made.
    """
    data = import_bigtable()
    from google.auth import exceptions as auth_exceptions

    env = contextlib.nullcontext() if emulator_host is True else _emulator_env(emulator_host)
    try:
        with warnings.catch_warnings(), env:
            # It warns "Connecting to Bigtable emulator at ..." on every construction.
            warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
            return data.BigtableDataClient(project=project)
    except auth_exceptions.DefaultCredentialsError as e:
        raise BigtableError(
            f"no Google Cloud credentials for Cloud Bigtable (project {project!r}): run "
            f"`gcloud auth application-default login`, or set {EMULATOR_ENV}=host:port to use "
            f"the Bigtable emulator. ({e})"
        ) from e


def admin_client(project: str | None, quiet: bool = False) -> Any:
    """A ``google.cloud.bigtable.Client(admin=True)`` (creating tables and families).

    ``quiet``: silence, for this process, the warning it repeats on every emulator connection
    (it makes a data client lazily, outside any ``catch_warnings`` here).
    """
    import_bigtable()
    from google.auth import exceptions as auth_exceptions
    from google.cloud import bigtable

    if quiet:
        warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
            return bigtable.Client(project=project, admin=True)
    except auth_exceptions.DefaultCredentialsError as e:
        raise BigtableError(
            f"no Google Cloud credentials for Cloud Bigtable (project {project!r}): run "
            f"`gcloud auth application-default login`, or set {EMULATOR_ENV}=host:port to use "
            f"the Bigtable emulator. ({e})"
        ) from e


def explain(
    error: Exception, path: str, timeout: float, emulator_host: str | None | Literal[True] = True
) -> BigtableError:
    """A client or server error as a BigtableError saying what to check.

    ``emulator_host``: as for :func:`table_path`.
    """
    from google.api_core import exceptions as api

    if isinstance(error, api.NotFound):
        return BigtableError(
            f"{path}: not found ({error.message}). Check --bigtable_project, "
            "--bigtable_instance and --bigtable_table; load a table with `estimax-convert "
            "to-bigtable`."
        )
    if isinstance(error, (api.DeadlineExceeded, api.ServiceUnavailable, api.RetryError)):
        emulator = os.environ.get(EMULATOR_ENV) if emulator_host is True else emulator_host
        hint = (
            f"is the emulator running at {EMULATOR_ENV}={emulator}?"
            if emulator
            else "check the network, the project and the instance (or set "
            f"{EMULATOR_ENV}=host:port for the emulator)"
        )
        return BigtableError(
            f"{path}: Cloud Bigtable did not answer within {timeout:g} s; "
            f"{hint} ({type(error).__name__}: {error})"
        )
    if isinstance(error, (api.PermissionDenied, api.Unauthenticated)):
        return BigtableError(
            f"{path}: access denied ({error}); the credentials need the "
            "Bigtable Reader role (roles/bigtable.reader) on the instance"
        )
    return BigtableError(f"{path}: {type(error).__name__}: {error}")


class BigtableSource:
    """The rows of a Cloud Bigtable table whose keys start with ``prefix``, in key order.

    Record ``i`` is the value of cell ``column_family:column_qualifier`` (latest version) of the
    ``i``-th row key. Picklable: the client is made lazily in each process.

    Args:
      project, instance, table: the table (``project`` None: the client's default project, or
        the emulator's).
      prefix: row key prefix of the split (``train_``, ``validation_``).
      column_family, column_qualifier: the cell holding the serialized tf.Example.
      timeout: seconds for each read request (retries included) and for the first contact; the
        key listing gets ten times this.
      app_profile_id: Bigtable app profile for the requests (default: the instance's).

    Raises:
      BigtableError: the table cannot be reached or found, or has no rows under ``prefix``.
    """

    def __init__(
        self,
        project: str | None,
        instance: str,
        table: str,
        prefix: str,
        column_family: str = "tfexample",
        column_qualifier: str = "example",
        *,
        timeout: float = 60.0,
        app_profile_id: str | None = None,
    ):
        if not instance or not table or not prefix:
            raise ValueError(
                f"a Bigtable source needs an instance, a table and a row key "
                f"prefix, got instance={instance!r}, table={table!r}, "
                f"prefix={prefix!r}"
            )
        self.project = project
        self.instance = instance
        self.table = table
        self.prefix = prefix
        self.column_family = column_family
        self.column_qualifier = column_qualifier
        self.timeout = float(timeout)
        self.app_profile_id = app_profile_id
        # Worker processes read from the server the keys were listed from: one forked from a
        # forkserver started before BIGTABLE_EMULATOR_HOST was set would not see the variable.
        self.emulator_host = os.environ.get(EMULATOR_ENV)
        self._init_client_state()
        keys = self._list_keys()
        if not keys:
            raise BigtableError(
                f"{self.path}: no rows whose key starts with {prefix!r}. The rows of a split are "
                f"keyed <prefix><index> (e.g. {row_key(prefix, 0).decode()}); load them with "
                "`estimax-convert to-bigtable`, or check the prefix flags."
            )
        # One bytes blob and offsets: 1.28M keys pickle to each worker process in one piece.
        self._key_blob = b"".join(keys)
        self._key_ends = np.cumsum([len(k) for k in keys], dtype=np.int64)

    @property
    def path(self) -> str:
        """The table and where it is served, for messages."""
        return table_path(self.project, self.instance, self.table, self.emulator_host)

    # -- client, created lazily per process -----------------------------------------------------
    def _init_client_state(self) -> None:
        self._lock = threading.Lock()
        self._client: Any = None
        self._table: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_lock", "_client", "_table"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_client_state()

    def _get_table(self) -> Any:
        with self._lock:
            if self._table is None:
                self._client = data_client(self.project, self.emulator_host)
                self._table = self._client.get_table(
                    self.instance, self.table, app_profile_id=self.app_profile_id
                )
            return self._table

    def close(self) -> None:
        """Closes this process's client (it is made again on the next read)."""
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client = self._table = None

    # -- reading --------------------------------------------------------------------------------
    def _cell_filter(self) -> Any:
        f = import_bigtable().row_filters
        qualifier = self.column_qualifier.encode()
        return f.RowFilterChain(
            [
                f.ColumnRangeFilter(self.column_family, qualifier, qualifier),
                f.CellsColumnLimitFilter(1),
            ]
        )

    def _list_keys(self) -> list[bytes]:
        data = import_bigtable()
        f = data.row_filters
        from google.api_core import exceptions as api

        table = self._get_table()
        if self.project is None:  # messages then name the project the client resolved
            self.project = self._client.project
        start = self.prefix.encode()
        rows = data.RowRange(start_key=start, end_key=prefix_end(start))
        # Keys only: one cell per row, its value stripped by the server.
        keys_only = f.RowFilterChain(
            [f.CellsRowLimitFilter(1), f.StripValueTransformerFilter(True)]
        )
        try:
            # A one-row probe first, with the short timeout, so a wrong host fails fast.
            table.read_rows(
                data.ReadRowsQuery(row_ranges=rows, limit=1, row_filter=keys_only),
                operation_timeout=self.timeout,
                attempt_timeout=self.timeout,
            )
            listing = table.read_rows_stream(
                data.ReadRowsQuery(row_ranges=rows, row_filter=keys_only),
                operation_timeout=10 * self.timeout,
                attempt_timeout=None,
            )
            keys = [row.row_key for row in listing]
        except api.GoogleAPIError as e:
            raise explain(e, self.path, self.timeout, self.emulator_host) from e
        keys.sort()  # they come sorted; sorting makes record i = i-th key a stated fact
        return keys

    def __len__(self) -> int:
        return int(self._key_ends.size)

    def row_key(self, i: int) -> bytes:
        """The key of record ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range [0, {len(self)})")
        start = int(self._key_ends[i - 1]) if i else 0
        return self._key_blob[start : int(self._key_ends[i])]

    def describe(self, i: int) -> str:
        """``"<table path>: row <key>"`` for error messages."""
        return f"{self.path}: row {self.row_key(i).decode(errors='backslashreplace')}"

    def read_many(self, indices: Sequence[int]) -> list[bytes | Exception]:
        """Records ``indices`` in one request: each the cell's bytes, or a BadRecordError for a
        row without the cell (or deleted since the listing).

        Raises:
          BigtableError: the request failed (the table as a whole cannot be read).
        """
        data = import_bigtable()
        from google.api_core import exceptions as api

        keys = [self.row_key(int(i)) for i in indices]
        try:
            rows = self._get_table().read_rows(
                data.ReadRowsQuery(
                    row_keys=list(dict.fromkeys(keys)), row_filter=self._cell_filter()
                ),
                operation_timeout=self.timeout,
            )
        except api.GoogleAPIError as e:
            raise explain(e, self.path, self.timeout, self.emulator_host) from e
        values = {}
        for row in rows:
            cells = row.get_cells(self.column_family, self.column_qualifier.encode())
            if cells:
                values[row.row_key] = cells[0].value
        out: list[bytes | Exception] = []
        for i, key in zip(indices, keys, strict=False):
            if key in values:
                out.append(values[key])
            else:
                out.append(
                    loader.BadRecordError(
                        self.describe(int(i)),
                        f"the row has no cell {self.column_family}:{self.column_qualifier} "
                        "(or was deleted after the row keys were listed)",
                    )
                )
        return out

    def __getitem__(self, i: int) -> bytes:
        (record,) = self.read_many([i])
        if isinstance(record, Exception):
            raise record
        return record

    def __repr__(self) -> str:
        return (
            f"BigtableSource({self.path}, prefix={self.prefix!r}, "
            f"column={self.column_family}:{self.column_qualifier}, rows={len(self)})"
        )


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key starting with ``prefix`` (b"" = end of table)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b""
    p[-1] += 1
    return bytes(p)
