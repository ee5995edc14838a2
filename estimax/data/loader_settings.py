"""A :class:`~estimax.data.loader.Loader`'s settings: checked once, read by its parts.

The loader's background thread (``estimax.data.produce``) and its saved position
(``estimax.data.loader_state``) read these; the :class:`~estimax.data.loader.Loader` is this class
with iteration added. Below all three, so that none of them imports another to know the settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from estimax.data.order import GlobalOrder
from estimax.data.sources import RecordSource
from estimax.data.workers import usable_cores, worker_policy

__all__ = ["LoaderSettings"]

# The loader's own logger: its 'input: N workers' line keeps the name it was logged under.
log = logging.getLogger("estimax.data.loader")


class LoaderSettings:
    """What a :class:`~estimax.data.loader.Loader` was given, checked and resolved (``"auto"``
    worker type, default workers and chunk size), and the global order it visits; its arguments
    are the Loader's."""

    def __init__(
        self,
        source: RecordSource,
        transform: Callable[[bytes, np.random.Generator], Any],
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        num_epochs: int | None = None,
        drop_remainder: bool = True,
        num_workers: int | None = None,
        worker_type: str = "auto",
        prefetch: int = 2,
        skip_bad_records: bool = False,
        record_ids: Sequence[int] | np.ndarray | None = None,
        chunk_size: int | None = None,
        num_hosts: int = 1,
        host_index: int = 0,
        order_is_global: bool = True,
    ):
        _check_arguments(batch_size, worker_type, num_epochs)
        self.source = source
        self.transform = transform
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_epochs = num_epochs
        self.drop_remainder = drop_remainder
        self.num_workers = usable_cores() if num_workers is None else int(num_workers)
        self.worker_type = _resolve_worker_type(worker_type, self.num_workers)
        self.prefetch = max(1, int(prefetch))
        self.skip_bad_records = skip_bad_records
        if chunk_size is None:
            # A task's cost in the training process (submit, result, future) is the same for 8
            # records as for 32: process workers get bigger chunks so that it stays far below
            # the pixels' (bench/results/input_pipeline.md, ``host``).
            chunk_size = 32 if self.num_workers > 0 and self.worker_type == "process" else 8
        self.chunk_size = max(1, int(chunk_size))
        ids = (
            np.arange(len(source), dtype=np.int64)
            if record_ids is None
            else np.asarray(record_ids, dtype=np.int64)
        )
        if ids.size == 0:
            raise ValueError("the loader has no records to read (empty source or shard)")
        self.record_ids = ids
        self.num_hosts, self.host_index = int(num_hosts), int(host_index)
        self.order_is_global = order_is_global
        self.global_order = GlobalOrder(
            ids,
            batch_size,
            num_hosts=self.num_hosts,
            host_index=self.host_index,
            shuffle=shuffle,
            seed=self.seed,
            num_epochs=num_epochs,
            drop_remainder=drop_remainder,
        )

    @property
    def num_records(self) -> int:
        """Records per epoch."""
        return int(self.record_ids.size)

    def order(self, epoch: int) -> np.ndarray:
        """The source record ids of ``epoch``, in visiting order: [num_records] int64."""
        return self.global_order.order(epoch)

    def __len__(self) -> int:
        """Batches per pass, for a finite loader (an upper bound if records get skipped)."""
        if self.num_epochs is None:
            raise TypeError("an infinite (num_epochs=None) loader has no len()")
        n = self.num_records * self.num_epochs
        g = self.batch_size * self.num_hosts
        if self.drop_remainder:
            return n // g
        # Global batches whose block for this host is not empty.
        return max(0, -(-(n - self.host_index * self.batch_size) // g))


def _check_arguments(batch_size: int, worker_type: str, num_epochs: int | None) -> None:
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if worker_type not in ("thread", "process", "auto"):
        raise ValueError(f"worker_type must be 'thread', 'process' or 'auto', got {worker_type!r}")
    if num_epochs is not None and num_epochs <= 0:
        raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")


def _resolve_worker_type(worker_type: str, num_workers: int) -> str:
    """``worker_type``, with ``"auto"`` resolved by :func:`worker_policy` (and logged)."""
    if worker_type != "auto":
        return worker_type
    cores = usable_cores()
    worker_type, why = worker_policy(num_workers, cores)
    log.info(
        "input: %d %s workers on %d usable cores (worker_type='auto': %s)",
        num_workers,
        worker_type,
        cores,
        why,
    )
    return worker_type
