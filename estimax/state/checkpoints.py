"""Checkpoints in ``model_dir``: Orbax, async, atomic, the input position saved beside the model.

Layout: ``<model_dir>/checkpoints/<step>/`` (``step_path``) holds the items ``model`` (step,
params, mutable collections), ``optimizer``, ``ema`` (each only when not empty) and ``meta``
(JSON: the input iterator's position, and which items exist), so a resumed run sees exactly the
examples an uninterrupted run would have seen. ``state_items`` and ``state_from_items`` map a
``TrainState`` to the items and back: the one place that layout is written.

Orbax writes each checkpoint under a temporary name and renames it when complete, so a process
killed during a save leaves no directory that ``latest_step`` would pick up. On ``gs://`` and
``s3://`` (no rename) it writes in place and writes ``commit_success.txt`` last; only steps with
it count (see ``estimax.storage``).

Once Orbax has finalised a step (for async saves: when the save completes), the chief writes
``<step>/estimax_manifest.json``: every file's size and CRC32C. ``latest_step`` checks the
newest checkpoints against their manifests, so a truncated, emptied, deleted or bit-flipped file
is found before Orbax reads garbage (or fails deep inside TensorStore): the bad step is moved
aside to ``<step>.corrupt-<unix time>`` (which Orbax no longer lists; kept for inspection) with a
warning naming the file and what was wrong, and the previous checkpoint is used.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from estimax import storage
from estimax.state import goodput, orbax_storage
from estimax.state.train_state import TrainState

CHECKPOINT_SUBDIR = "checkpoints"
MANIFEST_NAME = "estimax_manifest.json"
MANIFEST_FORMAT = "estimax.checkpoint_manifest/1"
_READ_CHUNK = 8 << 20
# How TensorStore/Orbax report a failed write (their errors are ValueErrors with the OS error).
_WRITE_FAILURE_MARKS = ("os_error_code", "Error writing", "Failed writing", "Failed to write")
_DISK_FULL_MARKS = (
    "os_error_code='27'",
    "os_error_code='28'",
    "os_error_code='122'",
    "File too large",
    "No space left",
    "Disk quota",
)


_UNRAISABLE_HOOKED = False
_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


# Orbax splits each replicated array's save across its replicas. Each distinct slice shape is
# a compiled slice program and a dispatch per replica: for the many small arrays of an image
# model (biases, norms, small kernels) that costs more than the transfer it splits (ResNet-18
# at 8 devices: first save 5.1 s -> 0.6 s, later ones 0.59 s -> 0.35 s on this project's CPU).
# Arrays whose per-replica slice is at least this big are still split.
_MIN_REPLICA_SLICE_BYTES = 1 << 20


@functools.cache  # once per process
def _split_only_large_arrays() -> None:
    """Has Orbax split only arrays of at least ``_MIN_REPLICA_SLICE_BYTES`` per replica across
    replicas when saving (the on-disk format is unchanged)."""
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES
        ),
        override=True,
    )


def _quiet_late_tensorstore_callbacks() -> None:
    """Sends the unraisable noise of a failed save or restore to the debug log.

    When a save fails (a full disk), Orbax closes its asyncio loop while TensorStore still
    completes the other writes; each completion's ``call_soon_threadsafe`` then raises into
    ``sys.unraisablehook`` and prints a traceback after estimax's own error. A restore that
    fails (``ModelMismatchError``) closes Orbax's other pending reads, each printing one too.
    Nothing is lost (the failure was already reported), so only those are taken out.
    """
    global _UNRAISABLE_HOOKED
    if _UNRAISABLE_HOOKED:
        return
    _UNRAISABLE_HOOKED = True
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        tb = unraisable.exc_traceback
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = tb.tb_frame.f_code.co_filename if tb is not None else ""
        late_callback = (
            isinstance(value, RuntimeError)
            and str(value) == "Event loop is closed"
            and where.endswith(os.path.join("asyncio", "base_events.py"))
        )
        # A failed restore (another model's checkpoint) closes Orbax's other reads mid-way.
        closed_read = isinstance(value.__cause__, GeneratorExit) and _ORBAX_DIR in where
        if late_callback or closed_read:
            logging.debug("After a failed checkpoint save or restore: %s", value)
            return
        previous(unraisable)

    sys.unraisablehook = hook


class ModelMismatchError(ValueError):
    """A checkpoint in ``model_dir`` was written by a different model than the one restoring."""


def _leaves_by_path(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{"params/Dense_0/kernel": shape}`` for every array leaf of a pytree or its metadata."""

    def name(key: Any) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return {
        "/".join(name(k) for k in path): tuple(getattr(leaf, "shape", ()))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def first_difference(saved: Any, wanted: Any) -> str | None:
    """Names the first parameter whose presence or shape differs, or None if all agree.

    Args:
      saved: the checkpoint's tree (its Orbax metadata).
      wanted: the restoring model's abstract tree.
    """
    have, want = _leaves_by_path(saved), _leaves_by_path(wanted)
    for path in sorted(set(have) | set(want)):
        if path not in have:
            return f"{path} {want[path]} is not in the checkpoint"
        if path not in want:
            return f"the checkpoint's {path} {have[path]} is not in this model"
        if have[path] != want[path]:
            return f"{path} has shape {have[path]} in the checkpoint, {want[path]} in this model"
    return None


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files do not match its manifest, or Orbax could not read them."""


def checkpoint_dir(model_dir: str) -> str:
    """Returns the directory holding the step checkpoints of ``model_dir``."""
    if "://" not in model_dir:
        # Orbax (tensorstore) refuses relative paths; users pass `--model_dir=runs/x`.
        model_dir = os.path.abspath(model_dir)
    return os.path.join(model_dir, CHECKPOINT_SUBDIR)


def step_path(model_dir: str, step: int) -> str:
    """The directory of the checkpoint at ``step``: ``<model_dir>/checkpoints/<step>``.

    What ``Estimator.evaluate(checkpoint_path=...)`` takes; ``step_from_checkpoint_path``
    splits it again.
    """
    return storage.join(checkpoint_dir(model_dir), str(int(step)))


# --- The train state's layout in a checkpoint ---------------------------------------------------
# Item names are part of the file format: model_dirs written by earlier versions must restore.
MODEL_ITEM, OPTIMIZER_ITEM, EMA_ITEM, META_ITEM = "model", "optimizer", "ema", "meta"


def state_items(state: TrainState) -> dict[str, Any]:
    """A train state as checkpoint items: ``model`` (step, params, mutable collections),
    ``optimizer`` (its state) and ``ema`` (moving averages of the params, or empty)."""
    return {
        MODEL_ITEM: {"step": state.step, "params": state.params, "model_state": state.model_state},
        OPTIMIZER_ITEM: state.opt_state,
        EMA_ITEM: state.ema_params,
    }


def state_from_items(items: dict[str, Any], like: TrainState) -> TrainState:
    """The train state of restored ``items`` (``state_items``' inverse).

    An item not restored takes ``like``'s value for the optimizer state, None for the EMA.
    """
    model = items[MODEL_ITEM]
    return TrainState(
        step=model["step"],
        params=model["params"],
        model_state=model["model_state"],
        opt_state=items.get(OPTIMIZER_ITEM, like.opt_state),
        ema_params=items.get(EMA_ITEM),
    )


def variables_of(model_item: dict[str, Any]) -> dict[str, Any]:
    """``{"params": ..., <collection>: ...}`` of a restored ``model`` item."""
    return {"params": model_item["params"], **model_item.get("model_state", {})}


# --- Manifests: what a complete checkpoint holds, checked before it is read ---------------------
# Orbax and TensorStore keep no checksum of a step's files (OCDBT data files are zstd streams
# without one), so a damaged file is found only as a decode error deep in a restore, or not at
# all. crc32c (hardware-accelerated) over every byte is cheap next to writing them.


def _step_files(step_dir: str) -> dict[str, str]:
    """``{path relative to step_dir: full path}`` of every file under ``step_dir``."""
    fs, root = storage.filesystem(step_dir)
    root = root.rstrip("/")
    found = fs.find(root) if fs.exists(root) else []
    return {
        full[len(root) + 1 :]: full
        for full in found
        if full[len(root) + 1 :] not in (MANIFEST_NAME, MANIFEST_NAME + ".tmp")
    }


def _digest(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    """(size, CRC32C as 8 hex digits) of one file."""
    value, size = 0, 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            value = crc32c.crc32c(chunk, value)
            size += len(chunk)
    return size, f"{value:08x}"


def write_manifest(step_dir: str) -> dict[str, Any]:
    """Writes ``step_dir/estimax_manifest.json`` (each file's size and CRC32C); returns it.

    Local paths: written beside, fsynced and renamed into place, so a reader sees the whole
    manifest or none. Object stores: one upload (visible only when complete).
    """
    fs, _ = storage.filesystem(step_dir)
    files = {}
    for rel, full in sorted(_step_files(step_dir).items()):
        size, crc = _digest(fs, full)
        files[rel] = {"size": size, "crc32c": crc}
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    final = storage.join(step_dir, MANIFEST_NAME)
    if storage.is_remote(step_dir):
        with storage.errors_named(final, "write the checkpoint manifest"):
            fs.pipe_file(storage.filesystem(final)[1], data)
        return manifest
    tmp = final + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(step_dir)
    return manifest


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_manifest(step_dir: str) -> str | None:
    """Checks ``step_dir`` against its manifest.

    Returns:
      None when every file matches; ``"no manifest"`` when there is none (a step written by an
      older estimax, or whose writer was killed between Orbax's finalisation and the manifest);
      else what is wrong, naming the file and the expected vs found size or CRC32C.
    """
    fs, _ = storage.filesystem(step_dir)
    manifest_path = storage.filesystem(storage.join(step_dir, MANIFEST_NAME))[1]
    try:
        if not fs.exists(manifest_path):
            return "no manifest"
        with fs.open(manifest_path, "rb") as f:
            manifest = json.loads(f.read())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST_NAME} is unreadable ({type(e).__name__}: {e})"
    present = _step_files(step_dir)
    for rel, want in sorted(files.items()):
        if rel not in present:
            return f"{rel} is missing (expected {want['size']} bytes)"
        size, crc = _digest(fs, present[rel])
        if size != want["size"]:
            return f"{rel} has {size} bytes, expected {want['size']}"
        if crc != want["crc32c"]:
            return f"{rel} has CRC32C {crc}, expected {want['crc32c']} (same size: bytes changed)"
    extra = sorted(set(present) - set(files))
    if extra:
        return f"{extra[0]} was not in the checkpoint when it was written"
    return None


def step_problem(step_dir: str, step: int) -> str | None:
    """What makes ``step_dir`` not the checkpoint of ``step``, or None when nothing does.

    Checked beside the manifest (which only says that the files are the ones written): an empty
    or incomplete directory (a copy that was interrupted, a directory made by hand), and one
    whose ``meta`` item records another step (a checkpoint copied or renamed under another
    step's name). A ``meta`` that cannot be parsed is left to Orbax's read (it fails, and the
    step is set aside then).
    """
    files = _step_files(step_dir)
    if not files:
        return "it is empty (a copy that was interrupted, or a directory made by hand)"
    meta_file = f"{META_ITEM}/metadata"  # what Orbax's JsonSave writes
    if meta_file not in files:
        return f"it is incomplete: {meta_file} is missing (a copy that was interrupted?)"
    fs, _ = storage.filesystem(step_dir)
    try:
        with fs.open(files[meta_file], "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    items = (
        [MODEL_ITEM]
        + [OPTIMIZER_ITEM] * bool(meta.get("has_optimizer"))
        + [EMA_ITEM] * bool(meta.get("has_ema"))
    )
    for item in items:
        if not any(rel.startswith(item + "/") for rel in files):
            return f"it is incomplete: its {item} item is missing (a copy that was interrupted?)"
    recorded = meta.get("step")
    if isinstance(recorded, int) and recorded != step:
        return (
            f"it holds the checkpoint of step {recorded}, not of step {step} (a checkpoint "
            "copied or renamed under another step's name)"
        )
    return None


class Checkpointer:
    """Saves and restores training checkpoints by step in ``model_dir``.

    Each step holds up to four items, so evaluation and prediction read only what they need:
    ``model`` (step, params, mutable collections such as batch_stats), ``optimizer`` (its state),
    ``ema`` (moving averages of the params, when the spec asks for them) and ``meta`` (JSON: the
    input iterator's position and which items exist).
    """

    def __init__(
        self,
        model_dir: str,
        keep_checkpoint_max: int | None = 5,
        async_save: bool = True,
        read_only: bool = False,
        keep_also: Any = None,
    ):
        """Opens (or creates) the checkpoints of ``model_dir``.

        Args:
          model_dir: the model directory.
          keep_checkpoint_max: how many of the newest checkpoints to keep (None: all).
          async_save: write in the background.
          read_only: never write or delete.
          keep_also: an Orbax ``PreservationPolicy`` whose checkpoints are kept too, beside
            the newest ones (the best one: ``best.KeepBest``).
        """
        self.model_dir = model_dir
        self._read_only = read_only
        if not read_only:
            # A training writer opens this process's goodput record, so the restore before
            # the first step is in it (a read-only reader records into one only if open).
            goodput.recorder(model_dir)
        _quiet_late_tensorstore_callbacks()
        _split_only_large_arrays()
        self._unsealed: list[int] = []  # saved by us, manifest not yet written
        self._verified: set[int] = set()
        self._bad: dict[int, str] = {}
        self._failed_writes: set[int] = set()  # steps whose save failed (partials removed)
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_checkpoint_max if keep_also is None else None,
            preservation_policy=None
            if keep_also is None
            else policies.AnyPreservationPolicy([policies.LatestN(keep_checkpoint_max), keep_also]),
            create=not read_only,
            read_only=read_only,
            enable_async_checkpointing=async_save,
            # Leftovers of a save that was killed half-way are removed, never read.
            cleanup_tmp_directories=not read_only,
            # s3://: commit-file protocol (S3 has no rename); emulator endpoints for TensorStore.
            **orbax_storage.manager_options(model_dir),
        )
        self._manager = ocp.CheckpointManager(
            checkpoint_dir(model_dir),
            options=options,
            item_names=(MODEL_ITEM, OPTIMIZER_ITEM, EMA_ITEM, META_ITEM),
        )

    def latest_step(self) -> int | None:
        """Returns the newest complete and intact checkpoint's step, or None if there is none.

        A newer checkpoint whose files do not match its manifest is set aside with a warning
        (see the module docstring) and the next older one is checked.
        """
        storage.refresh(checkpoint_dir(self.model_dir))  # see another process's new steps
        self._manager.reload()
        for step in sorted(self._manager.all_steps(), reverse=True):
            if self.verify(step):
                return step
        return None

    def all_steps(self) -> list[int]:
        """Returns the steps of all complete checkpoints, oldest first (known-bad ones left out).

        Listing does not read the files; ``verify(step)`` checks one against its manifest.
        """
        storage.refresh(checkpoint_dir(self.model_dir))  # see another process's new steps
        self._manager.reload()
        return sorted(s for s in self._manager.all_steps() if s not in self._bad)

    def step_dir(self, step: int) -> str:
        """The directory of the checkpoint at ``step``."""
        return step_path(self.model_dir, step)

    def verify(self, step: int) -> bool:
        """True if the checkpoint at ``step`` matches its manifest (checked once per process).

        A step without a manifest (an older estimax's, or one whose writer was killed right
        after Orbax finished it) counts as intact; a restore error then sets it aside. A bad
        step is set aside with a warning (see ``_set_aside``) and False returned.
        """
        if step in self._verified or step in self._unsealed:
            return True
        if step in self._bad:
            return False
        path = self.step_dir(step)
        with storage.errors_named(path, "check the checkpoint's files"):
            problem = verify_manifest(path)
        if problem == "no manifest":
            logging.info("Checkpoint %s has no %s: not checked.", path, MANIFEST_NAME)
            problem = None
        if problem is None:
            with storage.errors_named(path, "check the checkpoint's files"):
                problem = step_problem(path, step)
        if problem is None:
            self._verified.add(step)
            return True
        if self._read_only and not storage.exists(path):
            # Deleted (keep_checkpoint_max) by the training job while we read it: not damage.
            self._bad[step] = "deleted"
            return False
        self._set_aside(step, problem)
        return False

    def _set_aside(self, step: int, problem: str) -> str:
        """Warns that ``step`` is damaged; a writer renames it so that no later run reads it.

        Returns:
          what became of it, in words (for the warning and errors).
        """
        path = self.step_dir(step)
        self._bad[step] = problem
        if self._read_only or storage.is_remote(path) or not os.path.isdir(path):
            fate = "It is skipped (left in place: this process does not own model_dir)."
            if storage.is_remote(path) and not self._read_only:
                fate = "It is skipped (left in place on the object store: delete it by hand)."
        else:
            aside = f"{path}.corrupt-{int(time.time())}"
            os.rename(path, aside)
            fate = f"It was moved aside to {aside} (delete it when done looking)."
        logging.warning(
            "Checkpoint %s is damaged: %s. %s Using the previous checkpoint.", path, problem, fate
        )
        self._manager.reload()
        return fate

    def _seal(self) -> None:
        """Writes the manifests of our saves that Orbax has finished (call after a wait)."""
        for step in self._unsealed:
            path = self.step_dir(step)
            if jax.process_index() == 0 and storage.exists(path):
                with storage.errors_named(path, "write the checkpoint manifest"):
                    write_manifest(path)
                self._verified.add(step)
        self._unsealed = []

    def save(
        self,
        step: int,
        model: Any,
        optimizer: Any,
        ema: Any,
        input_state: dict | None,
        input_states: list | None = None,
    ) -> None:
        """Starts saving a checkpoint's items at ``step`` (``save_state`` saves a train state).

        ``wait_until_finished`` makes it durable.

        Args:
          step: the global step.
          model: pytree of arrays: step, params, mutable collections.
          optimizer: the optimizer state pytree (may be empty).
          ema: moving averages of params, or an empty pytree.
          input_state: the input iterator's JSON-serialisable position, or None.
          input_states: with many processes, every process's position in process order (each
            host reads its own shard; only the primary host writes ``meta``), or None.
        """
        items = {MODEL_ITEM: ocp.args.StandardSave(model)}
        has_optimizer = bool(jax.tree.leaves(optimizer))
        has_ema = bool(jax.tree.leaves(ema))
        if has_optimizer:
            items[OPTIMIZER_ITEM] = ocp.args.StandardSave(optimizer)
        if has_ema:
            items[EMA_ITEM] = ocp.args.StandardSave(ema)
        items[META_ITEM] = ocp.args.JsonSave(
            {
                "input_state": input_state,
                **({"input_states": input_states} if input_states is not None else {}),
                "has_ema": has_ema,
                "has_optimizer": has_optimizer,
                "step": int(step),
            }
        )
        # Orbax would wait for the previous async save here anyway; waiting first lets us seal it.
        self.wait_until_finished()
        with (
            storage.errors_named(checkpoint_dir(self.model_dir), f"save checkpoint {step}"),
            self._write_errors(step),
            goodput.phase(self.model_dir, "save"),  # the blocking part; the write is async
        ):
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._unsealed.append(step)

    def save_state(
        self,
        step: int,
        state: TrainState,
        input_state: dict | None,
        input_states: list | None = None,
    ) -> None:
        """Starts saving ``state`` at ``step`` (see ``save`` for the input positions)."""
        items = state_items(state)
        self.save(
            step,
            items[MODEL_ITEM],
            items[OPTIMIZER_ITEM],
            items[EMA_ITEM],
            input_state,
            input_states=input_states,
        )

    def restore_state(self, step: int, abstract: TrainState) -> TrainState:
        """The train state at ``step``, laid out like ``abstract``.

        Only the items ``abstract`` has leaves for and the checkpoint holds are read (evaluation
        asks for no optimizer state); ``ema_params`` is None when the checkpoint has no EMA.

        Raises:
          CorruptCheckpointError: Orbax could not read it (the step is set aside).
          ModelMismatchError: it holds another model's variables.
        """
        meta = self.restore_meta(step)
        wanted = state_items(abstract)
        items = {MODEL_ITEM: wanted[MODEL_ITEM]}
        if meta.get("has_optimizer", True) and jax.tree.leaves(wanted[OPTIMIZER_ITEM]):
            items[OPTIMIZER_ITEM] = wanted[OPTIMIZER_ITEM]
        if meta.get("has_ema") and jax.tree.leaves(wanted[EMA_ITEM]):
            items[EMA_ITEM] = wanted[EMA_ITEM]
        return state_from_items(self.restore(step, **items), abstract)

    def restore_meta(self, step: int) -> dict:
        """Returns the JSON metadata saved at ``step``.

        Raises:
          CorruptCheckpointError: Orbax could not read it (the step is set aside).
        """
        with self._readable(step), goodput.phase(self.model_dir, "restore"):
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
            )
            meta = restored[META_ITEM]
            if meta is not None and not isinstance(meta, dict):
                raise ValueError(f"the meta item is a {type(meta).__name__}, not a JSON object")
        return dict(meta or {})

    def restore(self, step: int, **abstract_items: Any) -> dict[str, Any]:
        """Restores the named items at ``step``, each laid out like its abstract pytree.

        Raises:
          CorruptCheckpointError: Orbax could not read it (the step is set aside).
        """
        try:
            with self._readable(step), goodput.phase(self.model_dir, "restore"):
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            name: ocp.args.StandardRestore(item)
                            for name, item in abstract_items.items()
                        }
                    ),
                )
        except ValueError as e:
            mismatch = self._mismatch(step, abstract_items)
            if mismatch is None:
                raise
            # Orbax's own message is a tree dump with advice (partial_restore, strict=False)
            # that an estimax user cannot act on: keep it for the debug log only.
            logging.debug("Orbax's restore error for %s: %s", self.step_dir(step), e)
            raise ModelMismatchError(
                f"{self.model_dir} holds a different model: {mismatch} (checkpoint "
                f"{self.step_dir(step)}). Train this model in a new --model_dir, or start it "
                "from that checkpoint's weights with warm_start_from (--warm_start_from)."
            ) from None
        return {name: restored[name] for name in abstract_items}

    def _mismatch(self, step: int, abstract_items: dict[str, Any]) -> str | None:
        """The first difference between the checkpoint's items and ``abstract_items``, if any."""
        for name, item in abstract_items.items():
            try:
                metadata = ocp.StandardCheckpointer().metadata(
                    os.path.join(self.step_dir(step), name)
                )
            except Exception:  # no readable metadata: not a mismatch this can name
                return None
            tree = getattr(metadata, "item_metadata", metadata)
            difference = first_difference(getattr(tree, "tree", tree), item)
            if difference is not None:
                return difference if name == MODEL_ITEM else f"{name}: {difference}"
        return None

    @contextlib.contextmanager
    def _readable(self, step: int) -> Iterator[None]:
        """Turns Orbax's failure to read a damaged step (no manifest caught it) into one error.

        Shape or structure mismatches (a different model) are the caller's error and pass.
        """
        try:
            yield
        except (ValueError, OSError) as e:
            if isinstance(e, FileNotFoundError) and not storage.exists(self.step_dir(step)):
                raise  # removed (keep_checkpoint_max) while we read it
            if "shape" in str(e).lower() and "mismatch" in str(e).lower():
                raise
            if not self._unreadable(e):
                raise
            problem = f"Orbax could not read it: {type(e).__name__}: {str(e).splitlines()[0]}"
            fate = self._set_aside(step, problem)
            raise CorruptCheckpointError(
                f"Checkpoint {self.step_dir(step)} is damaged ({problem}). {fate}"
            ) from e

    @staticmethod
    def _unreadable(e: BaseException) -> bool:
        """True for the errors a torn or damaged file gives (JSON, TensorStore, zstd, IO)."""
        text = f"{type(e).__name__}: {e}"
        return isinstance(e, (json.JSONDecodeError, OSError)) or any(
            mark in text
            for mark in (
                "FAILED_PRECONDITION",
                "DATA_LOSS",
                "Truncated",
                "Error reading",
                "corrupt",
            )
        )

    def restore_numpy(self, step: int, name: str = MODEL_ITEM) -> Any:
        """Restores item ``name`` at ``step`` as host numpy arrays, whatever devices saved it."""
        with self._readable(step), goodput.phase(self.model_dir, "restore"):
            metadata = self._manager.item_metadata(step)[name]
            tree = getattr(metadata, "tree", metadata)
            # numpy leaves in the target make the standard handler restore host arrays.
            target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
            # A checkpoint written by many processes names devices this process does not have:
            # whatever Orbax cannot place as saved goes to this process's first device.
            fallback = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{name: ocp.args.StandardRestore(target, fallback_sharding=fallback)}
                ),
            )
        return restored[name]

    def intact(self) -> str:
        """Once pending saves are durable: "the latest checkpoint (step N) in DIR is intact",
        for errors that stop training without saving the loop that failed."""
        self.wait_until_finished()
        saved = self.latest_step()
        return (
            f"the latest checkpoint ({'step ' + str(saved) if saved is not None else 'none'}) in "
            f"{self.model_dir} is intact"
        )

    def wait_until_finished(self) -> None:
        """Blocks until pending async saves are durable, then writes their manifests."""
        pending = self._unsealed[-1] if self._unsealed else None
        # The loop waits for an async write here, then for its manifest: checkpoint time.
        with goodput.phase(self.model_dir, "save"):
            with (
                storage.errors_named(checkpoint_dir(self.model_dir), "finish saving a checkpoint"),
                self._write_errors(pending),
            ):
                self._manager.wait_until_finished()
            self._seal()

    @contextlib.contextmanager
    def _write_errors(self, step: int | None) -> Iterator[None]:
        """Turns a failed local write (disk full...) into one error naming the checkpoint.

        The partial ``<step>.orbax-checkpoint-tmp*`` directory is removed (it was never under
        the final name, and on a full disk its space is wanted back).
        """
        try:
            yield
        except storage.StorageError:
            raise
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            if storage.is_remote(self.model_dir) or not (
                isinstance(e, OSError) or any(m in text for m in _WRITE_FAILURE_MARKS)
            ):
                raise
            self._unsealed = [s for s in self._unsealed if s != step]
            where = checkpoint_dir(self.model_dir)
            if step is not None:
                self._failed_writes.add(step)
            self._remove_partial_writes()
            self._manager.reload()
            previous = [s for s in self._manager.all_steps() if s != step and s not in self._bad]
            full = any(m in text for m in _DISK_FULL_MARKS)
            # The cause (Orbax's and TensorStore's tracebacks) is for the debug log; the user
            # gets this one error with the path and what to do.
            logging.debug("Writing checkpoint %s failed:", step, exc_info=e)
            raise storage.StorageError(
                getattr(e, "errno", None) or (errno.ENOSPC if full else errno.EIO),
                f"Could not write checkpoint {step} in {where}: "
                + (
                    "the disk is full or a file size limit was reached"
                    if full
                    else text.splitlines()[0][:300]
                )
                + ". The partial checkpoint was removed; the previous one ("
                + (f"step {max(previous)}" if previous else "none")
                + ") is intact. Free space and run again to resume from it.",
            ) from None

    def _remove_partial_writes(self) -> None:
        """Removes the ``<step>.orbax-checkpoint-tmp*`` directories of failed saves."""
        where = checkpoint_dir(self.model_dir)
        for step in self._failed_writes:
            for partial in glob.glob(os.path.join(where, f"{step}.orbax-checkpoint-tmp*")):
                shutil.rmtree(partial, ignore_errors=True)

    def close(self) -> None:
        """Finishes pending saves (and their manifests) and releases Orbax's resources."""
        try:
            self.wait_until_finished()
        finally:
            self._manager.close()
            # TensorStore's writes still in flight when a save failed can create its
            # temporary directory again after it was removed; they are done once Orbax is.
            self._remove_partial_writes()


def step_from_checkpoint_path(path: str) -> tuple[str, int]:
    """Splits ``<model_dir>/checkpoints/<step>`` into (model_dir, step), with a clear error."""
    path = path.rstrip("/")
    base = os.path.basename(path)
    parent = os.path.dirname(path)
    if not base.isdigit() or os.path.basename(parent) != CHECKPOINT_SUBDIR:
        raise ValueError(
            f"checkpoint_path={path!r} is not a checkpoint: expected "
            f"'<model_dir>/{CHECKPOINT_SUBDIR}/<step>' as written by estimax."
        )
    return os.path.dirname(parent), int(base)


def checkpoints_iterator(
    model_dir: str,
    timeout: float | None = None,
    poll_secs: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[int]:
    """Yields the step of the newest checkpoint in ``model_dir`` each time a newer one appears.

    Like ``tf.train.checkpoints_iterator``: it waits for checkpoints a training job writes and
    stops when none appears for ``timeout`` seconds (``None``: waits forever). It yields the
    newest only: checkpoints written while the caller was busy with the last one are skipped,
    with a log line naming them. A checkpoint whose files do not match its manifest is skipped
    with a warning saying what was wrong (``Checkpointer.verify``).

    Args:
      model_dir: the training job's model_dir.
      timeout: seconds to wait for a new checkpoint before stopping.
      poll_secs: how often to look.
      clock, sleep: injectable for tests.
    """
    last: int | None = None
    checkpointer: Checkpointer | None = None
    waited_since = clock()
    while True:
        if checkpointer is None and storage.isdir(checkpoint_dir(model_dir)):
            checkpointer = Checkpointer(model_dir, keep_checkpoint_max=None, read_only=True)
        steps = checkpointer.all_steps() if checkpointer else []
        new = [s for s in steps if last is None or s > last]
        while new and checkpointer is not None and not checkpointer.verify(new[-1]):
            new.pop()  # damaged (warned, with what was wrong): an older new one, or wait
        if new:
            if len(new) > 1 and last is None:
                logging.info(
                    "Found checkpoints %s in %s; evaluating the newest, %d.",
                    new,
                    checkpoint_dir(model_dir),
                    new[-1],
                )
            elif len(new) > 1:
                logging.info(
                    "Checkpoints %s were written while step %d was evaluated; "
                    "evaluating the newest, %d.",
                    new,
                    last,
                    new[-1],
                )
            last = new[-1]
            waited_since = clock()
            yield last
            continue
        if timeout is not None and clock() - waited_since >= timeout:
            logging.info("No new checkpoint in %s for %.0f s; stopping.", model_dir, timeout)
            return
        sleep(poll_secs)
