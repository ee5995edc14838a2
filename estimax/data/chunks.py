"""The work of one chunk of records: read, transform, write into a batch slot's rows.

The loader hands its workers (threads, processes, or its own thread) chunks of a block of a
batch as one of two tasks, named messages that also cross the pipe to a worker process:
:class:`TransformChunk` (give the elements back: the first block, before the batch layout is
known) and :class:`FillChunk` (write them into rows of a slot; give back only the bad records).
A :class:`ChunkWorker` holds what every task needs — the source, the transform, the seed — so a
task carries only record ids; a record that fails becomes a :class:`BadElement`, never an
exception, so the chunk's order and the other records survive it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from estimax.data import slots, tfrecord
from estimax.data.sources import BadRecordError, RecordSource, SourceError

__all__ = ["BadElement", "ChunkTask", "ChunkWorker", "FillChunk", "TransformChunk"]


@dataclasses.dataclass(frozen=True, slots=True)
class BadElement:
    """A worker's report that one record failed (picklable, as an exception may not be)."""

    record_id: int
    where: str
    problem: str

    @property
    def message(self) -> str:
        return f"{self.where}: {self.problem}"


@dataclasses.dataclass(frozen=True, slots=True)
class TransformChunk:
    """Task: transform records ``record_ids`` (record ``k`` of epoch ``epochs[k]``) and give back
    their elements, a :class:`BadElement` in place of each that failed."""

    epochs: list[int]
    record_ids: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class FillChunk:
    """Task: transform records ``record_ids`` into rows ``row, row + 1, ...`` of a batch slot and
    give back only the bad ones, as ``(row, BadElement)``: the pixels never travel back.

    ``slot`` is the slot's shared-memory name (process workers) or its arrays (threads).
    """

    epochs: list[int]
    record_ids: list[int]
    row: int
    slot: str | list[np.ndarray]
    layout: slots.Layout


ChunkTask = TransformChunk | FillChunk


class ChunkWorker:
    """Runs chunk tasks over ``source`` with ``transform``; record ``i`` of epoch ``e`` gets
    ``np.random.default_rng([seed, e, i])``.

    Picklable when the source and transform are: a worker process receives one at start-up.
    """

    def __init__(
        self,
        source: RecordSource,
        transform: Callable[[bytes, np.random.Generator], Any],
        seed: int,
    ):
        self.source, self.transform, self.seed = source, transform, seed

    def run(self, task: ChunkTask, read: Callable[[], list] | None = None) -> list[Any]:
        """Runs ``task``; ``read`` gives its records when they are already being read ahead.

        Raises:
          SourceError: the source as a whole cannot be read (not a bad record).
          ValueError: an element of another shape than the batch's (names its record).
        """
        if isinstance(task, FillChunk):
            return self._fill(task, read)
        return self._transform(task.epochs, task.record_ids, read)

    def _read(self, record_ids: list[int], read: Callable[[], list] | None) -> list | None:
        """The records (a failed read as its exception), or None to read each one as it comes."""
        if read is not None:
            return read()
        read_many = getattr(self.source, "read_many", None)
        # A SourceError from read_many propagates: the whole source is unreadable, not a record.
        return read_many(record_ids) if read_many is not None else None

    def _transform(
        self, epochs: list[int], record_ids: list[int], read: Callable[[], list] | None
    ) -> list[Any]:
        """The elements of the records, in order; a failure becomes a :class:`BadElement`."""
        records = self._read(record_ids, read)
        out: list[Any] = []
        for k, rid in enumerate(record_ids):
            try:
                if records is None:
                    record = self.source[rid]
                elif isinstance(records[k], Exception):
                    raise records[k]
                else:
                    record = records[k]
                rng = np.random.default_rng([self.seed, epochs[k], rid])
                out.append(self.transform(record, rng))
            except tfrecord.CorruptRecordError as e:
                out.append(
                    BadElement(rid, f"{e.path}: record at byte offset {e.offset}", e.problem)
                )
            except (SourceError, tfrecord.ShardChangedError):  # not a record: the input stops
                raise
            except BadRecordError as e:
                out.append(BadElement(rid, e.where, e.problem))
            except Exception as e:  # noqa: BLE001 - any transform failure is a bad record
                out.append(BadElement(rid, self.source.describe(rid), f"{type(e).__name__}: {e}"))
        return out

    def _fill(self, task: FillChunk, read: Callable[[], list] | None) -> list[Any]:
        """Writes the chunk's elements into its slot's rows; returns ``[(row, BadElement)]``."""
        dests = slots.attach(task.slot, task.layout) if isinstance(task.slot, str) else task.slot
        bad: list[tuple[int, BadElement]] = []
        elements = self._transform(task.epochs, task.record_ids, read)
        for k, element in enumerate(elements):
            row = task.row + k
            if isinstance(element, BadElement):
                bad.append((row, element))
                continue
            try:
                slots.write_rows(dests, task.layout, row, element)
            except ValueError as e:  # a ragged element: name the record it came from
                raise ValueError(f"{self.source.describe(task.record_ids[k])}: {e}") from None
        return bad
