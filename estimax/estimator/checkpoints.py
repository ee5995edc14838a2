"""Checkpoints in ``model_dir``: Orbax, async, atomic, the input position saved beside the model.

Layout: ``<model_dir>/checkpoints/<step>/state`` (the train state: step, params, mutable
collections, optimizer state, EMA) and ``.../<step>/input`` (the input iterator's position, JSON),
so a resumed run sees exactly the examples an uninterrupted run would have seen.

Orbax writes each checkpoint under a temporary name and renames it when complete, so a process
killed during a save leaves no directory that ``latest_step`` would pick up. On ``gs://`` and
``s3://`` (no rename) it writes in place and writes ``commit_success.txt`` last; only steps with
it count (see ``estimax.storage``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from estimax import storage

CHECKPOINT_SUBDIR = "checkpoints"


def checkpoint_dir(model_dir: str) -> str:
    """Returns the directory holding the step checkpoints of ``model_dir``."""
    if "://" not in model_dir:
        # Orbax (tensorstore) refuses relative paths; users pass `--model_dir=runs/x`.
        model_dir = os.path.abspath(model_dir)
    return os.path.join(model_dir, CHECKPOINT_SUBDIR)


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
    ):
        self.model_dir = model_dir
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_checkpoint_max,
            create=not read_only,
            read_only=read_only,
            enable_async_checkpointing=async_save,
            # Leftovers of a save that was killed half-way are removed, never read.
            cleanup_tmp_directories=not read_only,
            # s3://: commit-file protocol (S3 has no rename); emulator endpoints for TensorStore.
            **storage.orbax_manager_options(model_dir),
        )
        self._manager = ocp.CheckpointManager(
            checkpoint_dir(model_dir),
            options=options,
            item_names=("model", "optimizer", "ema", "meta"),
        )

    def latest_step(self) -> int | None:
        """Returns the newest complete checkpoint's step, or None if there is none."""
        storage.refresh(checkpoint_dir(self.model_dir))  # see another process's new steps
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Returns the steps of all complete checkpoints, oldest first."""
        storage.refresh(checkpoint_dir(self.model_dir))  # see another process's new steps
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        model: Any,
        optimizer: Any,
        ema: Any,
        input_state: dict | None,
        input_states: list | None = None,
    ) -> None:
        """Starts saving a checkpoint at ``step``; ``wait_until_finished`` makes it durable.

        Args:
          step: the global step.
          model: pytree of arrays: step, params, mutable collections.
          optimizer: the optimizer state pytree (may be empty).
          ema: moving averages of params, or an empty pytree.
          input_state: the input iterator's JSON-serialisable position, or None.
          input_states: with many processes, every process's position in process order (each
            host reads its own shard; only the primary host writes ``meta``), or None.
        """
        items = {"model": ocp.args.StandardSave(model)}
        has_optimizer = bool(jax.tree.leaves(optimizer))
        has_ema = bool(jax.tree.leaves(ema))
        if has_optimizer:
            items["optimizer"] = ocp.args.StandardSave(optimizer)
        if has_ema:
            items["ema"] = ocp.args.StandardSave(ema)
        items["meta"] = ocp.args.JsonSave(
            {
                "input_state": input_state,
                **({"input_states": input_states} if input_states is not None else {}),
                "has_ema": has_ema,
                "has_optimizer": has_optimizer,
                "step": int(step),
            }
        )
        with storage.errors_named(checkpoint_dir(self.model_dir), f"save checkpoint {step}"):
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore_meta(self, step: int) -> dict:
        """Returns the JSON metadata saved at ``step``."""
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored.meta or {})

    def restore(self, step: int, **abstract_items: Any) -> dict[str, Any]:
        """Restores the named items at ``step``, each laid out like its abstract pytree."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{name: ocp.args.StandardRestore(item) for name, item in abstract_items.items()}
            ),
        )
        return {name: restored[name] for name in abstract_items}

    def restore_numpy(self, step: int, name: str = "model") -> Any:
        """Restores item ``name`` at ``step`` as host numpy arrays, whatever devices saved it."""
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

    def wait_until_finished(self) -> None:
        """Blocks until pending async saves are durable."""
        with storage.errors_named(checkpoint_dir(self.model_dir), "finish saving a checkpoint"):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases Orbax's background resources."""
        self._manager.close()


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
    stops when none appears for ``timeout`` seconds (``None``: waits forever). Checkpoints
    written while the caller was busy with the last one are skipped for the newest, with a log
    line naming them.

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
