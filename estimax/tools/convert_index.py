"""``estimax-convert index``: index files for TFRecord shards that have none (TensorFlow's tools
write none), so that a job reading them from a bucket starts in seconds.

Each shard is read once, front to back, in ranged requests of 8 MiB
(``estimax.data.shard_index``), several shards at a time (``--connections``, default 8, over
``--num_workers`` processes), and its index is written in the hidden folder beside it,
``<folder>/.estimax-index/<shard>.idx`` (no glob of the shards, such as TensorFlow's ``train-*``,
matches it; ``--index_dir`` names another folder): DALI's
``<offset> <length>`` lines and one ``# estimax-index size=... version=...`` line naming the
shard's size and generation (GCS), ETag (S3) or mtime (local), so that a reader can tell when the
index no longer fits its shard. Shards whose index is there and fits are skipped: an interrupted
run resumes where it stopped, and a second run does nothing (``--force`` rewrites them all).
``--verify`` checks every record's CRC on the way. ``--runner=DataflowRunner`` (or another Beam
runner) runs the same per-shard work as a Beam pipeline, for many thousands of shards. Shards in
a folder that cannot be written (a read-only bucket of someone else's data set) get their
indexes in ``--index_dir`` instead: give a job the same folder (the programs use
``<model_dir>/shard_indexes``) and it finds them there. ``--move`` first moves the
``<shard>.idx`` files earlier versions wrote beside the shards (which TensorFlow's ``train-*``
matches) into ``.estimax-index/``. A local shard that is not a regular file (a FIFO, whose open
would wait for ever) is refused in one line.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from estimax import storage
from estimax.data import shard_index, tfrecord

__all__ = ["IndexReport", "expand", "index_command", "move_legacy", "shards_to_index"]


@dataclasses.dataclass
class IndexReport:
    """What a run of ``estimax-convert index`` did.

    Attributes:
      indexed: shards indexed by this run.
      skipped: shards that already had an index that fits them.
      moved: earlier versions' ``<shard>.idx`` files moved into ``.estimax-index/`` (``move``).
      records: records in the shards indexed.
      bytes_read: bytes read from the shards indexed.
      problems: one line per shard that could not be indexed (damage; the index is not written).
      seconds: wall time.
    """

    indexed: int = 0
    skipped: int = 0
    moved: int = 0
    records: int = 0
    bytes_read: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


_GLOB = set("*?[")


def expand(patterns: Sequence[str]) -> list[str]:
    """The shards named by ``patterns`` (paths or globs; local, ``gs://``, ``s3://``), sorted,
    without duplicates or index files.

    Raises:
      FileNotFoundError: a pattern matches nothing, or a path is not a file; names it.
      NotRegularFileError: a local shard is a FIFO, device or socket (its open could wait for
        ever); names it.
    """
    found: dict[str, None] = {}
    for pattern in patterns:
        if _GLOB & set(pattern):
            found.update(dict.fromkeys(tfrecord.list_files(pattern)))
            continue
        fs, fs_path = tfrecord._fs_and_path(pattern)  # noqa: SLF001 - the same project
        if fs.exists(fs_path) and not fs.isdir(fs_path):
            tfrecord.check_regular(pattern)  # a FIFO: named, not "no such file"
        if not fs.isfile(fs_path):
            raise FileNotFoundError(f"{pattern}: no such file (give shards, or a glob of them)")
        found[pattern] = None
    for path in found:
        tfrecord.check_regular(path)  # before anything opens one: a FIFO would block (#54)
    return sorted(found)


def move_legacy(paths: Sequence[str]) -> int:
    """Moves the ``<shard>.idx`` files earlier versions wrote beside ``paths`` into the hidden
    folder (``.estimax-index/<shard>.idx``), where TensorFlow's ``train-*`` does not match them;
    one already there wins (the legacy file is removed). Returns how many were moved.

    Raises:
      NotRegularFileError: a legacy index is a FIFO, device or socket.
      OSError, StorageError: the folder cannot be written (a read-only bucket).
    """
    moved = 0
    for path in paths:
        legacy = tfrecord.legacy_index_path(path)
        fs, fs_legacy = tfrecord._fs_and_path(legacy)  # noqa: SLF001 - the same project
        if not fs.exists(fs_legacy):
            continue
        tfrecord.check_regular(legacy)
        hidden = tfrecord.hidden_index_path(path)
        _, fs_hidden = tfrecord._fs_and_path(hidden)  # noqa: SLF001
        with storage.errors_named(legacy, "move it"):
            if not fs.exists(fs_hidden):
                # Written whole under its new name first (a copy, not a rename: one upload on
                # an object store), then the old one removed: never neither.
                tfrecord._put_text(hidden, fs.cat_file(fs_legacy).decode("ascii", "replace"))  # noqa: SLF001
            fs.rm(fs_legacy)
        moved += 1
    return moved


def shards_to_index(
    paths: Sequence[str], force: bool, connections: int, index_dir: str | None = None
) -> list[str]:
    """The shards without an index that fits them (all of them with ``force``), in
    ``index_dir`` or beside them (``shard_index.index_candidates``), looked up ``connections``
    at a time."""
    if force:
        return list(paths)
    with concurrent.futures.ThreadPoolExecutor(max(1, connections)) as pool:
        found = list(
            pool.map(lambda p: shard_index.open_indexed(p, False, explicit_dir=index_dir)[0], paths)
        )
    return [p for p, rf in zip(paths, found, strict=True) if rf is None]


def index_share(
    share: Sequence[str],
    connections: int,
    verify: bool,
    progress: Callable[[int], Any] | None,
    index_dir: str | None = None,
) -> list[tuple[str, int, int, str]]:
    """Indexes ``share`` here, ``connections`` shards at once: per shard ``(path, records,
    bytes_read, problem or "")`` (an engine's task runs it on its part)."""
    out: list[tuple[str, int, int, str]] = []

    def done(r: shard_index.Indexed) -> None:
        problem = str(r.error or r.write_error or "")
        out.append((r.path, len(r.offsets) - 1, r.bytes_read, problem))

    shard_index.index_shards(
        share,
        connections=connections,
        verify_crc=verify,
        keep_partial=True,
        on_bytes=progress,
        on_done=done,
        index_dir=index_dir,
    )
    return out


def _process_share(
    share: list[str], connections: int, verify: bool, progress: Any, index_dir: str | None
) -> list[tuple[str, int, int, str]]:
    """A worker process's share (its progress goes through the queue ``progress``)."""
    return index_share(share, connections, verify, progress.put, index_dir)


def index_command(
    patterns: Sequence[str],
    *,
    verify: bool = False,
    force: bool = False,
    connections: int = shard_index.CONNECTIONS,
    num_workers: int = 1,
    progress: bool = True,
    runner: str = "local",
    pipeline_args: list[str] | None = None,
    index_dir: str | None = None,
    move: bool = False,
    spark_master: str | None = None,
    spark_conf: dict[str, str] | None = None,
) -> IndexReport:
    """Writes the index of every shard ``patterns`` name that has none that fits it.

    Args:
      patterns: shard paths or globs.
      verify: check every record's CRC while indexing.
      force: rewrite indexes that fit too.
      connections: shards read at once, over all worker processes.
      num_workers: processes (local runner); each reads ``connections / num_workers`` shards
        at once.
      progress: show a progress bar of the bytes read.
      runner: ``local``, ``spark`` (``estimax.tools.convert_spark.index_spark`` on
        ``spark_master`` with the options ``spark_conf``) or a Beam runner
        (``estimax.tools.convert_beam.index_beam``).
      index_dir: the folder the indexes go to (``shard_index.index_path_in``); default the
        hidden folder beside each shard, ``<folder>/.estimax-index/<shard>.idx``.
      move: first move earlier versions' ``<shard>.idx`` files into ``.estimax-index/``.

    Raises:
      FileNotFoundError: a pattern matches nothing.
      SparkError: with ``runner="spark"``: see ``convert_spark.index_spark``.
      NotRegularFileError: a local shard or index is a FIFO, device or socket.
    """
    t0 = time.monotonic()
    paths = expand(patterns)
    moved = move_legacy(paths) if move else 0
    todo = shards_to_index(paths, force, connections, index_dir)
    report = IndexReport(skipped=len(paths) - len(todo), moved=moved)
    if not todo:
        report.seconds = time.monotonic() - t0
        return report
    if runner == "spark":
        from estimax.tools import convert_spark

        rows = convert_spark.index_spark(
            todo,
            master=spark_master or "local[*]",
            conf=spark_conf,
            verify=verify,
            index_dir=index_dir,
        )
    elif runner != "local":
        from estimax.tools import convert_beam

        rows = convert_beam.index_beam(
            todo,
            runner,
            pipeline_args or [],
            num_workers=num_workers,
            verify=verify,
            index_dir=index_dir,
        )
    else:
        rows = _index_local(todo, connections, max(1, num_workers), verify, progress, index_dir)
    for path, records, nbytes, problem in rows:
        report.bytes_read += nbytes
        if problem:
            report.problems.append(problem if path in problem else f"{path}: {problem}")
        else:
            report.indexed += 1
            report.records += records
    report.seconds = time.monotonic() - t0
    return report


def _index_local(
    todo: list[str],
    connections: int,
    workers: int,
    verify: bool,
    progress: bool,
    index_dir: str | None = None,
) -> list[tuple[str, int, int, str]]:
    """The shards indexed here: in this process, or in ``workers`` processes."""
    total = sum(shard_index._size(p) for p in todo)  # noqa: SLF001 - the same project
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="indexing", disable=not progress) as bar:
        if workers == 1 or len(todo) == 1:
            return index_share(todo, connections, verify, bar.update, index_dir)
        # Spawned, not forked: the storage clients' threads and event loops do not survive a
        # fork.
        ctx = multiprocessing.get_context("spawn")
        per = max(1, connections // workers)
        with ctx.Manager() as manager:
            q = manager.Queue()
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                futures = [
                    pool.submit(_process_share, todo[k::workers], per, verify, q, index_dir)
                    for k in range(workers)
                ]
                while not all(f.done() for f in futures):
                    try:
                        bar.update(q.get(timeout=0.2))
                    except queue.Empty:
                        pass
                while not q.empty():
                    bar.update(q.get())
                return [row for f in futures for row in f.result()]


def summary(report: IndexReport, patterns: Sequence[str]) -> str:
    """The command's closing line."""
    return (
        f"indexed {report.indexed} shards ({report.records} records, "
        f"{report.bytes_read / 1e6:.1f} MB read in {report.seconds:.1f} s); "
        f"{report.skipped} already had an index that fits them"
        + (
            f"; moved {report.moved} old <shard>.idx files into .estimax-index/"
            if report.moved
            else ""
        )
        + (f"; {len(report.problems)} could not be indexed" if report.problems else "")
        + f" ({' '.join(patterns)})"
    )
