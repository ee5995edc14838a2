"""Shards: planning, writing, the manifest, resuming, and verification.

A conversion is a list of shards (:class:`ShardTask`), each the unit of work: a worker reads its
images, writes ``<split>-SSSSS-of-NNNNN`` through :class:`~estimax.data.tfrecord.TFRecordWriter`
(temporary name, renamed when complete: a shard is never half-written under its final name) with
its index file ``.estimax-index/<shard>.idx`` (in a hidden folder that TensorFlow's ``train-*``
never matches; in place before the shard is: training hosts read a shard's
records through it, never the whole shard to find them) and returns its count and SHA-256. The
parent records finished shards in ``manifest.json``::

    {"format": "estimax-convert/1",
     "fingerprint": "<sha256 of the plan: every shard's inputs, labels and the options>",
     "source": {...}, "options": {...}, "complete": true,
     "label_map": {"n01440764": 1, ...},
     "splits": {"train": {"num_shards": 1024, "num_inputs": 1281167, "num_examples": ...,
                          "classes": {"n01440764": 1300, ...}}},   # examples per class
     "shards": {"train-00000-of-01024": {"split": "train", "index": 0, "num_examples": 1252,
                                          "bytes": ..., "sha256": "...",
                                          "skipped": [{"file", "reason"}], "fixed": [...],
                                          "classes": {"n01440764": 2, ...}}},
     "skipped": [{"file": ..., "reason": ...}]}   # inputs left out before any shard ran

Resuming (the default): shards listed in the manifest whose file still has the recorded SHA-256
are kept, the rest are (re)written. A manifest from a different plan (other inputs, shard counts,
seed or options) is refused, so resumed output always equals an uninterrupted run's.

Shard sizes: shard ``s`` of ``k`` gets items ``[s*n//k, (s+1)*n//k)``, so sizes differ by at
most one and every image is written. The original used ``ceil(n/k)`` per shard (under Python 2
``int(n/k)``, which dropped 143 training images), which can also leave trailing shards empty.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import multiprocessing
import os
import posixpath
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from estimax import storage
from estimax.data import shard_index, tfrecord
from estimax.data.worker_exit import exit_with_parent
from estimax.tools.convert_images import (
    BadImageError,
    convert_image,
    make_example,
    read_image_bytes,
)
from estimax.tools.convert_sources import Dataset, InputError, Item

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "Plan",
    "ShardTask",
    "convert_local",
    "finish_manifest",
    "plan_conversion",
    "plan_shards",
    "index_problems",
    "prepare_manifest",
    "sha256_file",
    "verify",
    "write_shard",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "estimax-convert/1"
_SHARD_RE = re.compile(r"^(?P<split>.+)-(?P<index>\d{5})-of-(?P<num>\d{5})$")
# Rewriting the manifest after every shard costs O(shards) each time; this bounds how often.
_MANIFEST_SAVE_SECS = 2.0


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """One shard to write: ``items`` to ``<output_dir>/<split>-SSSSS-of-NNNNN``."""

    output_dir: str
    split: str
    index: int
    num_shards: int
    items: tuple[Item, ...]
    check: str = "scaled"
    skip_bad: bool = False

    @property
    def name(self) -> str:
        return tfrecord.sharded_name(self.split, self.index, self.num_shards)

    @property
    def path(self) -> str:
        return posixpath.join(self.output_dir, self.name)


def plan_shards(
    dataset: Dataset,
    num_shards: dict[str, int],
    output_dir: str,
    check: str = "scaled",
    skip_bad: bool = False,
) -> list[ShardTask]:
    """Splits every split's items into its shards (sizes differ by at most one).

    Raises:
      InputError: a split has fewer images than shards (which would write empty shards).
    """
    tasks = []
    for split, items in dataset.splits.items():
        k = num_shards[split]
        n = len(items)
        if k < 1:
            raise InputError(f"--{split}_shards must be >= 1, got {k}")
        if n < k:
            raise InputError(
                f"{split}: {n} images cannot fill {k} shards without writing empty "
                f"shards; pass --{split}_shards={n} or fewer"
            )
        for s in range(k):
            chunk = tuple(items[s * n // k : (s + 1) * n // k])
            tasks.append(ShardTask(output_dir, split, s, k, chunk, check, skip_bad))
    return tasks


def fingerprint(tasks: list[ShardTask], label_map: dict[str, int], options: dict) -> str:
    """SHA-256 of everything that decides the output bytes (not of the output dir)."""
    h = hashlib.sha256()
    h.update(json.dumps({"label_map": label_map, "options": options}, sort_keys=True).encode())
    for t in tasks:
        h.update(f"\n{t.name}\t{t.check}\t{t.skip_bad}".encode())
        for it in t.items:
            h.update(f"\n{it.path}\t{it.label}\t{it.synset}".encode())
    return h.hexdigest()


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file (any fsspec path)."""
    h = hashlib.sha256()
    with storage.open_file(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_shard(task: ShardTask) -> dict[str, Any]:
    """Writes one shard; runs in a worker process.

    Returns:
      The shard's manifest entry (plus 'name').

    Raises:
      BadImageError: an image cannot be read/decoded (naming the file) unless ``skip_bad``; or
        every image of the shard was bad (an empty shard is never written).
      OSError: the shard could not be written (disk full...): names the shard's path; nothing
        is left under its final name or its temporary one.
    """
    try:
        return _write_shard(task)
    except OSError as e:
        if isinstance(e, storage.StorageError):
            raise  # already names the path (object stores)
        _remove_shard_temporaries(task)  # the writer's own clean-up fails too on a full disk
        raise storage.StorageError(
            e.errno,
            f"{task.path}: could not write the shard: {e.strerror or e}"
            + (
                " (the disk is full or a file size limit was reached; free space and rerun: "
                "the shards already written are kept)"
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
                else ""
            ),
        ) from e


def _temporary_dirs(output_dir: str) -> list[str]:
    """The folders a shard's writer leaves temporaries in: the output folder and its index
    folder (``shard_index.index_path_for``)."""
    probe = shard_index.index_path_for(os.path.join(output_dir, "x"))
    return [output_dir, os.path.dirname(probe)]


def _remove_shard_temporaries(task: ShardTask) -> None:
    """Deletes the ``.<shard>[.idx].tmp-*`` files of one shard whose write failed (local only)."""
    if "://" in task.output_dir or not os.path.isdir(task.output_dir):
        return
    for folder in _temporary_dirs(task.output_dir):
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if name.startswith((f".{task.name}.tmp-", f".{task.name}{tfrecord.INDEX_SUFFIX}.tmp-")):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))


def _write_shard(task: ShardTask) -> dict[str, Any]:
    skipped, fixed = [], []
    with tfrecord.TFRecordWriter(task.path, index=True) as writer:
        for item in task.items:
            try:
                image = convert_image(read_image_bytes(item.path), task.check)
            except (BadImageError, OSError) as e:
                problem = f"{item.path}: {e}"
                if not task.skip_bad:
                    raise BadImageError(
                        f"{problem} (--skip_bad skips bad images and lists them in the manifest)"
                    ) from None
                skipped.append({"file": item.path, "reason": problem})
                continue
            if image.fixed:
                fixed.append({"file": item.path, "reason": image.fixed})
            writer.write(make_example(image, item.label, item.synset, item.path))
        if writer.num_records == 0:
            raise BadImageError(
                f"{task.name}: all {len(task.items)} of its images are bad "
                f"(first: {skipped[0]['reason'] if skipped else 'none'}); "
                "refusing to write an empty shard"
            )
        num_examples = writer.num_records
    return {
        "name": task.name,
        "split": task.split,
        "index": task.index,
        "num_examples": num_examples,
        "bytes": writer.num_bytes,
        "sha256": sha256_file(task.path),
        "skipped": skipped,
        "fixed": fixed,
        "classes": written_classes(task.items, skipped),
    }


def written_classes(items: Iterable[Item], skipped: list[dict[str, str]]) -> dict[str, int]:
    """``{class: examples}`` of a shard: its items less those skipped as unreadable."""
    left_out = {s["file"] for s in skipped}
    counts: dict[str, int] = {}
    for item in items:
        if item.path not in left_out:
            counts[item.synset] = counts.get(item.synset, 0) + 1
    return counts


@dataclasses.dataclass
class Manifest:
    """The contents of ``manifest.json`` (module docstring)."""

    fingerprint: str
    label_map: dict[str, int]
    splits: dict[str, dict[str, int]]
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    shards: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    complete: bool = False

    def class_counts(self) -> dict[str, dict[str, int]]:
        """``{split: {class: examples written}}``, every class of ``label_map`` in label order
        (0 for a class without examples in a split), over the shards finished so far."""
        counts = {split: dict.fromkeys(self.label_map, 0) for split in self.splits}
        for entry in self.shards.values():
            for name, n in entry.get("classes", {}).items():
                counts[entry["split"]][name] += n
        return counts

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d = {"format": MANIFEST_FORMAT, **d}
        classes = self.class_counts()
        for split, info in d["splits"].items():
            info["num_examples"] = sum(
                s["num_examples"] for s in self.shards.values() if s["split"] == split
            )
            info["classes"] = classes[split]
        d["shards"] = dict(sorted(d["shards"].items()))
        return json.dumps(d, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, path: str) -> Manifest:
        d = json.loads(text)
        if d.get("format") != MANIFEST_FORMAT:
            raise InputError(
                f"{path}: not an estimax-convert manifest "
                f"(format {d.get('format')!r}, expected {MANIFEST_FORMAT!r})"
            )
        for info in d["splits"].values():
            info.pop("num_examples", None)
            info.pop("classes", None)
        d.pop("format")
        return cls(**d)

    def add_shard(self, result: dict[str, Any]) -> None:
        entry = dict(result)
        self.shards[entry.pop("name")] = entry

    def expected_shards(self) -> list[str]:
        return [
            tfrecord.sharded_name(split, s, info["num_shards"])
            for split, info in self.splits.items()
            for s in range(info["num_shards"])
        ]

    def save(self, output_dir: str) -> None:
        """Writes the manifest (locally via a temporary name and an atomic rename)."""
        path = posixpath.join(output_dir, MANIFEST_NAME)
        fs, fs_path = storage.filesystem(path)
        text = self.to_json()
        if "://" in path and not path.startswith("file://"):
            with fs.open(fs_path, "w") as f:  # object stores: an upload is atomic already
                f.write(text)
            return
        fs.makedirs(os.path.dirname(fs_path) or ".", exist_ok=True)
        tmp = fs_path + f".tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, fs_path)


def load_manifest(output_dir: str) -> Manifest | None:
    path = posixpath.join(output_dir, MANIFEST_NAME)
    fs, fs_path = storage.filesystem(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "r") as f:
        return Manifest.from_json(f.read(), path)


def _existing_shards(output_dir: str, splits: Iterable[str]) -> list[str]:
    fs, fs_dir = storage.filesystem(output_dir)
    if not fs.exists(fs_dir):
        return []
    names = [posixpath.basename(p) for p in fs.ls(fs_dir, detail=False)]
    return sorted(n for n in names if (m := _SHARD_RE.match(n)) and m["split"] in set(splits))


def _remove_stale_temporaries(output_dir: str) -> None:
    """Deletes ``.<shard>[.idx].tmp-*`` files a killed run's writers left (local dirs only)."""
    if "://" in output_dir or not os.path.isdir(output_dir):
        return
    for folder in _temporary_dirs(output_dir):
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            base = name[1:].split(".tmp-")[0].removesuffix(tfrecord.INDEX_SUFFIX)
            if name.startswith(".") and ".tmp-" in name and _SHARD_RE.match(base):
                os.remove(os.path.join(folder, name))


def prepare_manifest(
    tasks: list[ShardTask],
    dataset: Dataset,
    output_dir: str,
    source: dict,
    options: dict,
    overwrite: bool = False,
) -> Manifest:
    """The manifest to continue from: the existing one (its intact shards kept) or a new one.

    Raises:
      InputError: ``output_dir`` holds a manifest of a different conversion, or shards without
        a manifest, and ``overwrite`` is False.
    """
    fp = fingerprint(tasks, dataset.label_map, options)
    splits = {
        s: {
            "num_shards": next(t.num_shards for t in tasks if t.split == s),
            "num_inputs": len(items),
        }
        for s, items in dataset.splits.items()
    }
    fresh = Manifest(fp, dataset.label_map, splits, source, options, skipped=list(dataset.skipped))
    old = load_manifest(output_dir)
    existing = _existing_shards(output_dir, dataset.splits)
    if old is not None and old.fingerprint != fp and not overwrite:
        raise InputError(
            f"{posixpath.join(output_dir, MANIFEST_NAME)} is from a different conversion (its "
            "inputs, labels, shard counts, seed or options differ); use another --output_dir "
            "or --overwrite to replace it"
        )
    if old is None and existing and not overwrite:
        raise InputError(
            f"--output_dir {output_dir} already has shards ({existing[0]}, ...) but "
            f"no {MANIFEST_NAME}; use another --output_dir or --overwrite"
        )
    _remove_stale_temporaries(output_dir)
    if overwrite or old is None:
        fs, fs_dir = storage.filesystem(output_dir)
        for name in existing:
            fs.rm(posixpath.join(fs_dir, name))
            shard = posixpath.join(fs_dir, name)
            for index in (shard_index.index_path_for(shard), tfrecord.legacy_index_path(shard)):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(index)
        return fresh
    for name, entry in old.shards.items():
        path = posixpath.join(output_dir, name)
        fs, fs_path = storage.filesystem(path)
        if fs.exists(fs_path) and sha256_file(path) == entry["sha256"]:
            fresh.shards[name] = entry
            if index_problems(path):  # a shard of an older estimax, or its index lost
                log.info("%s: writing its index file", path)
                shard_index.write_index(path)
        else:
            log.warning("%s: missing or changed since the manifest recorded it; rewriting", path)

    # Shards an older estimax wrote have no per-class counts: the plan and their skips give them.
    items = {t.name: t.items for t in tasks}
    for name, entry in fresh.shards.items():
        entry.setdefault("classes", written_classes(items[name], entry["skipped"]))
    return fresh


@dataclasses.dataclass
class Plan:
    """A conversion as the driver plans it, once, before any engine runs: every shard
    (``tasks``), the manifest to continue from (already saved: shards still intact from an
    earlier run are in it) and the shards left to write (``todo``), in plan order."""

    tasks: list[ShardTask]
    manifest: Manifest
    todo: list[ShardTask]


def plan_conversion(
    dataset: Dataset,
    output_dir: str,
    num_shards: dict[str, int],
    check: str = "scaled",
    skip_bad: bool = False,
    *,
    overwrite: bool = False,
    source: dict | None = None,
) -> Plan:
    """The driver's half of every engine: files -> shards, the manifest prepared and saved,
    complete shards dropped. An engine then only distributes :func:`write_shard` over
    ``plan.todo`` and hands the results to :func:`finish_manifest` (or ``Manifest.add_shard``).

    Raises:
      InputError: see :func:`plan_shards` and :func:`prepare_manifest`.
    """
    tasks = plan_shards(dataset, num_shards, output_dir, check, skip_bad)
    options = {"check": check, "skip_bad": skip_bad}
    manifest = prepare_manifest(tasks, dataset, output_dir, source or {}, options, overwrite)
    todo = [t for t in tasks if t.name not in manifest.shards]
    if len(todo) < len(tasks):
        done = len(tasks) - len(todo)
        log.info("resuming: %d of %d shards already complete in %s", done, len(tasks), output_dir)
    manifest.save(output_dir)
    return Plan(tasks, manifest, todo)


def finish_manifest(
    results: Iterable[dict[str, Any]], base_json: str, output_dir: str, num_tasks: int
) -> int:
    """Writes the final manifest: ``base_json`` (the plan's, :meth:`Manifest.to_json`) plus the
    gathered :func:`write_shard` results, complete when every one of ``num_tasks`` shards is in
    it. Runs wherever the engine gathers results (the driver, or a pipeline's last step).

    Returns:
      The number of shards the manifest lists.
    """
    manifest = Manifest.from_json(base_json, "<driver manifest>")
    for r in results:
        manifest.add_shard(r)
    manifest.complete = len(manifest.shards) == num_tasks
    manifest.save(output_dir)
    return len(manifest.shards)


def _mp_context() -> multiprocessing.context.BaseContext:
    """fork when it is safe, else spawn.

    fork starts workers in milliseconds with the modules already imported (spawn re-imports
    numpy, protobuf, ... in every worker: about a CPU-second each). It is unsafe when other threads
    exist (JAX's, in a test run or a notebook; tqdm's monitor), whose locks the child would
    inherit in an undefined state; then spawn.
    """
    if (
        "fork" in multiprocessing.get_all_start_methods()
        and threading.active_count() == 1
        and "jax" not in sys.modules
    ):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _pool(num_workers: int) -> cf.ProcessPoolExecutor:
    """Worker processes that exit when this process does, even when it is SIGKILLed."""
    return cf.ProcessPoolExecutor(
        num_workers,
        mp_context=_mp_context(),
        initializer=exit_with_parent,
        initargs=(os.getpid(),),
    )


def _progress(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="img",
        disable=not enabled,
        desc="converting",
        smoothing=0.1,
    )


def _write_shards(
    todo: list[ShardTask],
    manifest: Manifest,
    output_dir: str,
    num_workers: int,
    progress: tuple[int, int, bool],
    on_shard: Callable[[dict[str, Any]], None] | None,
    save_secs: float,
) -> None:
    """Writes ``todo`` (in a process pool when there are several), recording each finished shard
    in ``manifest``, saved at most every ``save_secs`` and at the end (an error's too)."""
    last_save = time.monotonic()
    pool, futures = None, {}
    if num_workers > 1 and len(todo) > 1:
        # Started (and, with fork, forked) before the progress bar starts tqdm's monitor thread.
        pool = _pool(min(num_workers, len(todo)))
        futures = {pool.submit(write_shard, t): t for t in todo}
    try:
        with _progress(*progress) as bar:

            def finished(result: dict[str, Any], task: ShardTask) -> None:
                nonlocal last_save
                manifest.add_shard(result)
                bar.update(len(task.items))
                if on_shard:
                    on_shard(result)
                if time.monotonic() - last_save >= save_secs:
                    manifest.save(output_dir)
                    last_save = time.monotonic()

            if pool is None:
                for task in todo:
                    finished(write_shard(task), task)
            else:
                for fut in cf.as_completed(futures):
                    finished(fut.result(), futures[fut])
    finally:
        if pool is not None:
            for f in futures:
                f.cancel()
            pool.shutdown(wait=True)
        manifest.save(output_dir)


def convert_local(
    dataset: Dataset,
    output_dir: str,
    num_shards: dict[str, int],
    *,
    num_workers: int | None = None,
    check: str = "scaled",
    skip_bad: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    source: dict | None = None,
    on_shard: Callable[[dict[str, Any]], None] | None = None,
    manifest_save_secs: float = _MANIFEST_SAVE_SECS,
) -> Manifest:
    """Converts ``dataset`` to shards in ``output_dir`` with a process pool; resumes by default.

    Args:
      dataset: the inputs (``convert_sources``).
      output_dir: any fsspec directory (``gs://`` included).
      num_shards: split -> number of shards.
      num_workers: processes; default: the usable cores. 1 runs in this process.
      check: how images are checked (``convert_images.CHECKS``).
      skip_bad: skip unreadable images (listed in the manifest) instead of failing.
      overwrite: replace a manifest/shards of a different conversion in ``output_dir``.
      progress: show a progress bar (images).
      source: description stored in the manifest.
      on_shard: called with each finished shard's entry (tests, logging).
      manifest_save_secs: rewrite the manifest at most this often while shards finish (a killed
        run redoes the shards finished since the last save).

    Returns:
      The final manifest (also written to ``output_dir/manifest.json``).

    Raises:
      InputError, BadImageError: see :func:`plan_shards`, :func:`prepare_manifest`,
        :func:`write_shard`. Shards finished before the error stay recorded, so rerunning the
        same command resumes.
    """
    plan = plan_conversion(
        dataset, output_dir, num_shards, check, skip_bad, overwrite=overwrite, source=source
    )
    tasks, manifest, todo = plan.tasks, plan.manifest, plan.todo
    total = sum(len(t.items) for t in tasks)
    done_items = total - sum(len(t.items) for t in todo)
    _write_shards(
        todo,
        manifest,
        output_dir,
        num_workers or len(os.sched_getaffinity(0)),
        (total, done_items, progress),
        on_shard,
        manifest_save_secs,
    )
    manifest.complete = len(manifest.shards) == len(tasks)
    manifest.save(output_dir)
    return manifest


# ---------------------------------------------------------------------------------- verify

_REQUIRED = (
    "image/height",
    "image/width",
    "image/colorspace",
    "image/channels",
    "image/class/label",
    "image/class/synset",
    "image/format",
    "image/filename",
    "image/encoded",
)


def verify_shard(
    path: str, entry: dict[str, Any], label_map: dict[str, int], decode: bool = False
) -> list[str]:
    """Problems of one shard against its manifest entry (empty list: none).

    Checks: SHA-256 and size; every record's CRC; the record count; the index file (``.idx``)
    lists the shard's records; every record is a tf.Example with the converter's fields, 3
    channels, an RGB JPEG, a label in ``1..len(label_map)`` that ``label_map`` gives its synset.
    With ``decode``, every image is decoded and its height/width compared with the record's.
    """
    fs, fs_path = storage.filesystem(path)
    if not fs.exists(fs_path):
        return [f"{path}: missing (the manifest lists it with {entry['num_examples']} examples)"]
    problems = []
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        problems.append(
            f"{path}: SHA-256 {digest[:16]}... differs from the manifest's "
            f"{entry['sha256'][:16]}... (the file changed since it was written)"
        )
    count = 0
    offsets = [0]  # where each record starts, then where the last ends (as an index lists them)
    try:
        for count, (offset, record) in enumerate(tfrecord.read_records_with_offsets(path), 1):
            offsets[-1:] = [offset, offset + _FRAME_OVERHEAD + len(record)]
            problems += _record_problems(f"{path}: record {count - 1}", record, label_map, decode)
    except tfrecord.CorruptRecordError as e:
        problems.append(str(e))
        offsets = []
    if count != entry["num_examples"]:
        problems.append(f"{path}: {count} records, the manifest says {entry['num_examples']}")
    return problems + (index_problems(path, offsets) if offsets else [])


def _record_problems(
    where: str, record: bytes, label_map: dict[str, int], decode: bool
) -> list[str]:
    """What is wrong with one converted record (``verify_shard``'s checks), ``where`` first."""
    from estimax.data.example import decode_example

    try:
        ex = decode_example(record)
    except ValueError as e:
        return [f"{where}: {e}"]
    missing = [k for k in _REQUIRED if k not in ex or len(ex[k]) != 1]
    if missing:
        return [f"{where}: missing or repeated fields {missing}"]
    problems = []
    label, synset = int(ex["image/class/label"][0]), ex["image/class/synset"][0].decode()
    if label_map.get(synset) != label:
        problems.append(
            f"{where}: label {label} for synset {synset!r}, but the label "
            f"map gives {label_map.get(synset)}"
        )
    if (
        int(ex["image/channels"][0]) != 3
        or ex["image/colorspace"][0] != b"RGB"
        or ex["image/format"][0] != b"JPEG"
    ):
        problems.append(f"{where}: not a 3-channel RGB JPEG record")
    if decode:
        from estimax.data import jpeg

        try:
            h, w = jpeg.decode(ex["image/encoded"][0]).shape[:2]
        except ValueError as e:
            return [*problems, f"{where}: image does not decode: {e}"]
        if (h, w) != (int(ex["image/height"][0]), int(ex["image/width"][0])):
            problems.append(
                f"{where}: image is {h}x{w} but the record says "
                f"{int(ex['image/height'][0])}x{int(ex['image/width'][0])}"
            )
    return problems


# A record's bytes in the file besides its data: the length, its CRC, the data's CRC.
_FRAME_OVERHEAD = 16


def index_problems(path: str, offsets: list[int] | None = None) -> list[str]:
    """What is wrong with a shard's index file (``.estimax-index/<shard>.idx``, or an earlier
    version's ``<shard>.idx``): missing, unreadable, or not the shard's record offsets
    (``offsets``, [N + 1]; default: scanned from the shard)."""
    index = tfrecord.existing_index_path(path) or shard_index.index_path_for(path)
    fs, fs_path = storage.filesystem(index)
    fix = "rerun the same convert command to rewrite it"
    if not fs.exists(fs_path):
        return [f"{index}: missing (the shard's index, which training hosts read); {fix}"]
    try:
        listed = tfrecord.read_index(index).tolist()
    except ValueError as e:
        return [f"{e}; {fix}"]
    if offsets is None:
        offsets = tfrecord.record_offsets(path, verify_crc=False).tolist()
    if listed == offsets:
        return []
    if len(listed) != len(offsets):
        return [
            f"{index}: lists {len(listed) - 1} records, the shard has {len(offsets) - 1}; {fix}"
        ]
    i = next(i for i, (a, b) in enumerate(zip(listed, offsets, strict=True)) if a != b)
    return [
        f"{index}: record {i} starts at byte {listed[i]} in the index, at {offsets[i]} in the "
        f"shard; {fix}"
    ]


def verify(output_dir: str, decode: bool = False, num_workers: int | None = None) -> list[str]:
    """Checks every shard of ``output_dir`` against its manifest; returns the problems found.

    Also reports shards the manifest expects but does not list (an unfinished conversion) and
    shard files it does not know.
    """
    manifest = load_manifest(output_dir)
    if manifest is None:
        return [
            f"{posixpath.join(output_dir, MANIFEST_NAME)}: no manifest (not written by "
            "estimax-convert, or the conversion never started)"
        ]
    problems = []
    expected = manifest.expected_shards()
    unfinished = [n for n in expected if n not in manifest.shards]
    if unfinished:
        problems.append(
            f"{output_dir}: conversion incomplete: {len(unfinished)} of "
            f"{len(expected)} shards not finished ({unfinished[0]}, ...); rerun the "
            "same convert command to resume"
        )
    extra = sorted(set(_existing_shards(output_dir, manifest.splits)) - set(expected))
    if extra:
        problems.append(f"{output_dir}: shard files not in the manifest: {extra[:5]}")
    names = sorted(manifest.shards)
    args = [
        (posixpath.join(output_dir, n), manifest.shards[n], manifest.label_map, decode)
        for n in names
    ]
    num_workers = num_workers or len(os.sched_getaffinity(0))
    if num_workers == 1 or len(args) <= 1:
        results = [verify_shard(*a) for a in args]
    else:
        with _pool(min(num_workers, len(args))) as pool:
            results = list(pool.map(verify_shard, *zip(*args, strict=False)))
    for r in results:
        problems.extend(r)
    return problems
