"""The production of batches: the loader's background thread, from the global order to batches.

Steps, in the order a batch takes them: this host's block of the next global batch
(``estimax.data.order``) gets a batch slot (``estimax.data.slots``) and is cut into chunks for
the workers (``estimax.data.workers``), which write its elements into the slot's rows; when its
last chunk is back, its bad records are replaced or dropped (:func:`_settle_bad`) and the slot's
rows go to the consumer as a batch, with the stream's position after it. The first block, before
the elements' shapes are known, comes back as elements and sets the slots' layout.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from typing import Any, NamedTuple

import numpy as np

from estimax.data import read_ahead, slots
from estimax.data.chunks import BadElement, ChunkTask, FillChunk, TransformChunk
from estimax.data.loader_settings import LoaderSettings
from estimax.data.sources import BadRecordError
from estimax.data.workers import Pending, Workers

__all__ = ["End", "Produced", "produce"]

log = logging.getLogger(__name__)


class Produced(NamedTuple):
    """A batch for the consumer, and the stream's position and bad records after it."""

    batch: Any
    epoch: int
    position: int
    num_skipped: int


class End(NamedTuple):
    """The producer's last item: the input has ended, after ``num_skipped`` bad records."""

    num_skipped: int


def produce(
    ld: LoaderSettings,
    epoch: int,
    position: int,
    num_skipped: int,
    stop: threading.Event,
    out: queue.Queue,
    workers: Workers,
    pools: list[slots.SlotPool],
) -> None:
    """The background thread: queues on ``out`` the batches from (``epoch``, ``position``) on,
    then :class:`End`, or the exception that ended the input; returns early once ``stop`` is set.

    The slot pool it makes is appended to ``pools`` (the caller closes it).
    """
    start = ld.global_order.stream_position(epoch, position)
    producer = _Producer(ld, start, num_skipped, workers, out, stop)
    try:
        producer.run(pools)
    except BaseException as e:  # noqa: BLE001 - delivered to the consumer's next()
        producer.put(e)
    finally:
        producer.drop_pending()


@dataclasses.dataclass(eq=False)
class _Block:
    """One host block of a global batch on its way into a slot (``slot`` None: the first block,
    before the layout is known; its ``elements`` come back themselves)."""

    slot: int | None
    size: int
    next_start: int  # the stream position after this global batch
    bad: dict[int, BadElement] = dataclasses.field(default_factory=dict)
    elements: list[Any] = dataclasses.field(default_factory=list)


class _Chunk(NamedTuple):
    """A chunk handed to the workers."""

    block: _Block
    last: bool  # the block's last chunk
    pending: Pending


def _blocks_in_flight(ld: LoaderSettings) -> int:
    """Blocks started at once: enough chunks queued to keep every worker busy twice over."""
    busy = max(2, -(-2 * max(1, ld.num_workers) * ld.chunk_size // ld.batch_size) + 1)
    return read_ahead.blocks_in_flight(ld.source, busy)


class _Producer:
    """The state of one run of :func:`produce`."""

    def __init__(
        self,
        ld: LoaderSettings,
        start: int,
        num_skipped: int,
        workers: Workers,
        out: queue.Queue,
        stop: threading.Event,
    ):
        self.ld, self.order, self.start = ld, ld.global_order, start
        self.workers, self.out, self.stop = workers, out, stop
        self.max_blocks = _blocks_in_flight(ld)
        self.pool: slots.SlotPool | None = None
        self.pending: collections.deque[_Chunk] = collections.deque()
        self.blocks_in_flight = 0
        self.next_batch = 0  # the next global batch to start
        self.skipped = num_skipped
        self.exhausted = False

    def run(self, pools: list[slots.SlotPool]) -> None:
        """Starts blocks, collects chunks, delivers batches, then :class:`End`."""
        while not self.stop.is_set():
            self.start_blocks()
            if not self.pending:
                if self.exhausted:
                    break
                continue  # waiting for a slot the consumer still holds
            block = self.collect_chunk()
            if block is None:
                continue
            if block.slot is None:
                self.pool = self.first_block_into_slot(block)
                if self.pool is not None:
                    pools.append(self.pool)
            if not self.deliver(block):
                return
        if not self.stop.is_set():
            self.put(End(self.skipped))

    def put(self, item: Any) -> bool:
        """Queues ``item`` for the consumer; False when stopped first."""
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def start_blocks(self) -> None:
        """Starts blocks while there are slots (before the layout is known: one block)."""
        limit = 1 if self.pool is None else self.max_blocks
        while not self.exhausted and self.blocks_in_flight < limit:
            slot: int | None = None
            if self.pool is not None:
                slot = self.pool.acquire(lambda: self.out.empty() and not self.pending)
                if slot is None:
                    return
            hb = self.order.host_block(self.start, self.next_batch)
            if hb is None:
                self.exhausted = True
                if self.pool is not None and slot is not None:
                    self.pool.release(slot)
                return
            ids, epochs, next_start = hb
            self.next_batch += 1
            self.blocks_in_flight += 1
            self.submit_chunks(_Block(slot, ids.size, next_start), ids, epochs)

    def submit_chunks(self, block: _Block, ids: np.ndarray, epochs: np.ndarray) -> None:
        """Hands the block's chunks to the workers."""
        chunk = self.ld.chunk_size
        for c in range(0, ids.size, chunk):
            id_list = ids[c : c + chunk].tolist()
            ep_list = epochs[c : c + chunk].tolist()
            task: ChunkTask
            if block.slot is None or self.pool is None:
                task = TransformChunk(ep_list, id_list)
            else:
                dest: str | list[np.ndarray] = (
                    self.pool.name(block.slot)
                    if self.workers.shared_memory
                    else self.pool.arrays(block.slot)
                )
                task = FillChunk(ep_list, id_list, c, dest, self.pool.layout)
            self.pending.append(_Chunk(block, c + chunk >= ids.size, self.workers.submit(task)))

    def collect_chunk(self) -> _Block | None:
        """Waits for the oldest chunk; returns its block when that was the block's last chunk."""
        chunk = self.pending.popleft()
        got = chunk.pending.result()
        if chunk.block.slot is None:
            chunk.block.elements.extend(got)
        else:
            chunk.block.bad.update(got)
        if not chunk.last:
            return None
        self.blocks_in_flight -= 1
        return chunk.block

    def deliver(self, block: _Block) -> bool:
        """Settles a finished block's bad records and queues its batch; False when stopped."""
        skip, fixed_size = self.ld.skip_bad_records, self.ld.drop_remainder
        if block.slot is None or self.pool is None:  # nothing good in it: no layout yet
            _, num_bad = _settle_bad(block.elements, skip, fixed_size)
            self.skipped += num_bad
            return True
        rows, num_bad = _settle_bad_rows(self.pool, block, skip, fixed_size)
        self.skipped += num_bad
        if rows == 0:  # a one-pass input's block of nothing but skipped records
            self.pool.release(block.slot)
            return True
        batch = self.pool.batch(block.slot, rows)
        epoch, position = self.order.epoch_position(block.next_start)
        return self.put(Produced(batch, epoch, position, self.skipped))

    def first_block_into_slot(self, block: _Block) -> slots.SlotPool | None:
        """Makes the slot pool from the first good element and moves the block into a slot."""
        good = [el for el in block.elements if not isinstance(el, BadElement)]
        if not good:
            return None
        layout = slots.Layout(good[0], self.ld.batch_size)
        limit = self.max_blocks + self.ld.prefetch + 1
        pool = slots.SlotPool(layout, self.workers.shared_memory, limit=limit)
        slot = pool.acquire(lambda: True)
        assert slot is not None  # a new pool has room
        dests = pool.arrays(slot)
        for row, el in enumerate(block.elements):
            if isinstance(el, BadElement):
                block.bad[row] = el
            else:
                try:
                    slots.write_rows(dests, layout, row, el)
                except ValueError as e:  # a ragged element: say where it is
                    pool.close()
                    raise ValueError(f"example {row} of the first batch: {e}") from None
        block.slot, block.elements = slot, []
        return pool

    def drop_pending(self) -> None:
        """Work not yet done is dropped (the slots are the iterator's pool's, closed with it)."""
        for chunk in self.pending:
            chunk.pending.cancel()


def _settle_bad_rows(
    pool: slots.SlotPool, block: _Block, skip: bool, fixed_size: bool
) -> tuple[int, int]:
    """:func:`_settle_bad` on a slot's rows: returns (rows in the batch, bad records)."""
    if not block.bad:
        return block.size, 0
    assert block.slot is not None
    # A row's own index where it is good.
    marks: list[Any] = [block.bad.get(row, row) for row in range(block.size)]
    settled, num_bad = _settle_bad(marks, skip, fixed_size)
    arrays = pool.arrays(block.slot)
    for leaf in arrays:
        # Rows move only towards the front or copy a good row: gather then write.
        leaf[: len(settled)] = leaf[np.asarray(settled, dtype=np.int64)]
    return len(settled), num_bad


def _settle_bad(elements: list[Any], skip: bool, fixed_size: bool) -> tuple[list[Any], int]:
    """A block's elements with its bad records dealt with; and how many there were.

    Without ``skip`` the first bad record raises. With it, a one-pass input (``fixed_size``
    False: evaluation) drops them, and its batch is smaller. A training input must keep
    ``batch_size`` elements on every host, in the global order, with no host knowing about the
    others' bad records: each bad element is replaced by the nearest good one before it in this
    host's block (after it, for the first), deterministically. A block with no good record at all
    cannot be filled and raises.
    """
    bad = [k for k, el in enumerate(elements) if isinstance(el, BadElement)]
    if not bad:
        return elements, 0
    if not skip:
        first = elements[bad[0]]
        raise BadRecordError(first.where, first.problem)
    for k in bad:
        log.warning("skipping bad record (skip_bad_records): %s", elements[k].message)
    if not fixed_size:
        return [el for el in elements if not isinstance(el, BadElement)], len(bad)
    good_at = [k for k, el in enumerate(elements) if not isinstance(el, BadElement)]
    if not good_at:
        first = elements[bad[0]]
        raise BadRecordError(
            first.where,
            f"{first.problem} (and every other record of this host's block of the global batch "
            "is bad: nothing to fill the batch with)",
        )
    filled = list(elements)
    for k in bad:
        before = [g for g in good_at if g < k]
        filled[k] = elements[before[-1] if before else good_at[0]]
    return filled, len(bad)
