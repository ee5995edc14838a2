"""TFRecord shards -> Cloud Bigtable rows: the layout the ``--bigtable_*`` input reads.

    estimax-convert to-bigtable --data_dir=DIR --bigtable_project=P --bigtable_instance=I \\
        --bigtable_table=imagenet

The original had ``tools/datasets/tfrecords_to_bigtable``. Every record of ``DIR/train-*`` (the
files in name order, records in file order) becomes row ``train_0000000000``, ``train_0000000001``,
... and every record of ``DIR/validation-*`` row ``validation_0000000000`` ..., the record's bytes
(one serialized tf.Example, unchanged) in cell ``tfexample:example``. Row order is therefore file
order, and ``estimax.data.bigtable.BigtableSource`` reads the records back in the order a
``TFRecordSource`` over the same files has them.

The table and the column family are created if absent (the instance must exist). Rows already
under a prefix stop the copy unless ``overwrite``, which deletes them first (a smaller copy over a
larger one would otherwise leave stale rows in the split).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from estimax.data import bigtable as bt
from estimax.data import imagenet, tfrecord

__all__ = ["copy_records", "ensure_table", "tfrecords_to_bigtable"]

log = logging.getLogger(__name__)

# A MutateRows request may carry up to 100,000 mutations; keeping each well under the request
# size limit with 16 MiB lets a few run at once without large memory.
BATCH_ROWS = 1000
BATCH_BYTES = 16 << 20
IN_FLIGHT = 4


def ensure_table(project: str | None, instance: str, table: str, column_family: str) -> None:
    """Creates ``table`` with ``column_family`` (keeping one cell version) if either is absent.

    Raises:
      BigtableError: the instance cannot be reached or does not exist.
    """
    bt.import_bigtable()
    from google.api_core import exceptions as api
    from google.cloud.bigtable import column_family as cf

    path = bt.table_path(project, instance, table)
    try:
        client = bt.admin_client(project, quiet=True)
        handle = client.instance(instance).table(table)
        if not handle.exists():
            log.info("creating table %s with column family %s", path, column_family)
            handle.create(column_families={column_family: cf.MaxVersionsGCRule(1)})
        elif column_family not in handle.list_column_families():
            log.info("creating column family %s in %s", column_family, path)
            handle.column_family(column_family, cf.MaxVersionsGCRule(1)).create()
    except api.GoogleAPIError as e:
        raise bt.explain(e, path, 60) from e


def _batches(
    records: Iterable[bytes], prefix: str, start: int = 0
) -> Iterable[list[tuple[bytes, bytes]]]:
    """(row key, record) pairs in batches of at most BATCH_ROWS rows and about BATCH_BYTES."""
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for index, record in enumerate(records, start):
        batch.append((bt.row_key(prefix, index), record))
        size += len(record)
        if len(batch) >= BATCH_ROWS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def copy_records(
    records: Iterable[bytes],
    table: Any,
    prefix: str,
    column_family: str,
    column_qualifier: str,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Writes ``records`` as rows ``<prefix><10-digit index>``; returns how many.

    Args:
      records: serialized tf.Examples, in index order.
      table: a ``google.cloud.bigtable.data`` Table.
      prefix, column_family, column_qualifier: where each record goes.
      progress: called with the number of rows of each batch written.
    """
    data = bt.import_bigtable()
    qualifier = column_qualifier.encode()

    def write(batch: list[tuple[bytes, bytes]]) -> int:
        table.bulk_mutate_rows(
            [
                data.RowMutationEntry(key, [data.SetCell(column_family, qualifier, value)])
                for key, value in batch
            ]
        )
        return len(batch)

    total = 0
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        pending: list[concurrent.futures.Future] = []
        for batch in _batches(records, prefix):
            pending.append(pool.submit(write, batch))
            if len(pending) >= IN_FLIGHT:
                n = pending.pop(0).result()
                total += n
                if progress:
                    progress(n)
        for future in pending:
            n = future.result()
            total += n
            if progress:
                progress(n)
    return total


def _records(files: Sequence[str]) -> Iterable[bytes]:
    for path in files:
        yield from tfrecord.read_records(path, verify_crc=True)


def _split_files(data_dir: str, splits: Sequence[str]) -> dict[str, list[str]]:
    """The TFRecord shards of each split (``train-*``, ``validation-*``) in ``data_dir``.

    Raises:
      FileNotFoundError: a split has none (naming ``--splits``).
    """
    files = {}
    for split in splits:
        try:
            files[split] = tfrecord.list_files(imagenet.file_pattern(data_dir, split == "train"))
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"no {split}-* TFRecord files in {data_dir} ({e}); pass "
                "--splits to copy only some splits"
            ) from e
    return files


def _log_written(path: str, split: str, rows: int, prefix: str, files: int, took: float) -> None:
    """One line for a split copied: its rows, their keys, the files read and the rate."""
    log.info(
        "%s: wrote %d %s rows (%s%s..) from %d files in %.1f s (%.0f rows/s)",
        path,
        rows,
        split,
        prefix,
        "0" * bt.INDEX_DIGITS,
        files,
        took,
        rows / max(took, 1e-9),
    )


def tfrecords_to_bigtable(
    data_dir: str,
    project: str | None,
    instance: str,
    table: str = "imagenet",
    *,
    train_prefix: str = "train_",
    eval_prefix: str = "validation_",
    column_family: str = "tfexample",
    column_qualifier: str = "example",
    overwrite: bool = False,
    splits: Sequence[str] = ("train", "validation"),
) -> dict[str, int]:
    """Copies ``data_dir``'s ``train-*``/``validation-*`` records into rows of ``table``.

    Returns:
      Rows written per split, e.g. ``{"train": 1281167, "validation": 50000}``.

    Raises:
      FileNotFoundError: ``data_dir`` has no shards of a split.
      BigtableError: the table cannot be created or written, or rows exist under a prefix and
        not ``overwrite``.
    """
    from google.api_core import exceptions as api

    prefixes = {"train": train_prefix, "validation": eval_prefix}
    files = _split_files(data_dir, splits)
    ensure_table(project, instance, table, column_family)
    path = bt.table_path(project, instance, table)
    client = bt.data_client(project)
    written = {}
    try:
        handle = client.get_table(instance, table)
        for split, split_files in files.items():
            prefix = prefixes[split]
            if not prefix:
                raise bt.BigtableError(f"the {split} row prefix is empty: rows need a prefix")
            _clear_prefix(handle, project, instance, table, prefix, overwrite)
            start = time.perf_counter()
            n = copy_records(_records(split_files), handle, prefix, column_family, column_qualifier)
            _log_written(path, split, n, prefix, len(split_files), time.perf_counter() - start)
            written[split] = n
    except api.GoogleAPIError as e:
        raise bt.explain(e, path, 60) from e
    except bt.import_bigtable().MutationsExceptionGroup as e:
        raise bt.BigtableError(
            f"{path}: writing rows failed: {e} First: "
            f"{e.exceptions[0].__cause__ or e.exceptions[0]}"
        ) from e
    finally:
        client.close()
    return written


def _clear_prefix(
    handle: Any, project: str | None, instance: str, table: str, prefix: str, overwrite: bool
) -> None:
    """Refuses (or with ``overwrite`` deletes) existing rows under ``prefix``."""
    data = bt.import_bigtable()
    start = prefix.encode()
    existing = handle.read_rows(
        data.ReadRowsQuery(
            row_ranges=data.RowRange(start_key=start, end_key=bt.prefix_end(start)),
            limit=1,
            row_filter=data.row_filters.StripValueTransformerFilter(True),
        )
    )
    if not existing:
        return
    path = bt.table_path(project, instance, table)
    if not overwrite:
        raise bt.BigtableError(
            f"{path} already has rows under the prefix {prefix!r} (e.g. "
            f"{existing[0].row_key.decode(errors='backslashreplace')}); pass --overwrite to "
            "delete them and copy again"
        )
    log.info("deleting the rows under %r in %s (--overwrite)", prefix, path)
    admin = bt.admin_client(project, quiet=True)
    admin.instance(instance).table(table).drop_by_prefix(start, timeout=600)
