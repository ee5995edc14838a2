"""One global order of the examples, whatever the number of hosts: which records each host reads.

The input of a job is one stream: epoch ``e`` visits the records in ``permutation(seed, e)`` (file
order without shuffling), epochs follow each other (batches run across epoch boundaries, as the
original's ``repeat()`` before ``batch()``), and position ``s`` of the stream is record
``order(s // N)[s % N]``. Global batch ``k`` after a start position ``S`` is the stream's
``[S + k*G, S + (k+1)*G)`` with ``G = batch_size * num_hosts``; host ``h`` reads the ``h``-th
block of ``batch_size`` of it. The hosts' blocks side by side (process order, as the devices are)
are the global batch one process would read with the same global batch size, rows in the same
order: training does not depend on the number of hosts.

The saved position is the stream's ``(epoch, position)`` after the last global batch: the same on
every host, so a job resumed on another number of hosts (or devices, or a global batch of another
size) continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["GlobalOrder"]


class GlobalOrder:
    """The stream of record ids and each host's share of every global batch.

    Args:
      record_ids: the records the stream visits (ids into a source), in their unshuffled order.
      batch_size: the per-host batch.
      num_hosts: hosts sharing each global batch; ``host_index`` is this one.
      shuffle: a new seeded permutation every epoch (else ``record_ids`` order).
      seed: the permutations' seed.
      num_epochs: ``None``: forever; else the stream ends after that many epochs.
      drop_remainder: a final global batch with fewer than ``G`` records is dropped by every host
        (else each host reads what of its block exists, possibly nothing).
    """

    def __init__(
        self,
        record_ids: Sequence[int] | np.ndarray,
        batch_size: int,
        *,
        num_hosts: int = 1,
        host_index: int = 0,
        shuffle: bool,
        seed: int = 0,
        num_epochs: int | None = None,
        drop_remainder: bool = True,
    ):
        if not 0 <= host_index < num_hosts:
            raise ValueError(f"host_index {host_index} out of range for num_hosts {num_hosts}")
        self.record_ids = np.asarray(record_ids, dtype=np.int64)
        self.batch_size = int(batch_size)
        self.num_hosts = int(num_hosts)
        self.host_index = int(host_index)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_epochs = num_epochs
        self.drop_remainder = drop_remainder
        self._cache: dict[int, np.ndarray] = {}

    @property
    def num_records(self) -> int:
        """Records per epoch, N."""
        return int(self.record_ids.size)

    @property
    def global_batch_size(self) -> int:
        """G: the per-host batch times the number of hosts."""
        return self.batch_size * self.num_hosts

    @property
    def end(self) -> int | None:
        """The stream's length (None: endless)."""
        return None if self.num_epochs is None else self.num_epochs * self.num_records

    def order(self, epoch: int) -> np.ndarray:
        """The record ids of ``epoch`` in visiting order: [N] int64."""
        if not self.shuffle:
            return self.record_ids
        order = self._cache.get(epoch)
        if order is None:
            order = self.record_ids[
                np.random.default_rng([self.seed, epoch]).permutation(self.record_ids.size)
            ]
            # The two epochs a batch can straddle; older ones are never asked for again.
            self._cache = {e: o for e, o in self._cache.items() if e == epoch - 1}
            self._cache[epoch] = order
        return order

    def stream_position(self, epoch: int, position: int) -> int:
        """``(epoch, position)`` -> the stream position ``epoch * N + position``."""
        return int(epoch) * self.num_records + int(position)

    def epoch_position(self, s: int) -> tuple[int, int]:
        """Stream position -> ``(epoch, position)``; the stream's end is ``(last epoch, N)``."""
        n = self.num_records
        end = self.end
        if end is not None and s >= end:
            return int(self.num_epochs or 1) - 1, n
        return s // n, s % n

    def host_block(self, start: int, k: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """This host's share of global batch ``k`` after stream position ``start``.

        Returns:
          ``(record_ids, epochs, next_start)``: the ids of this host's block (fewer than
          ``batch_size`` only in a final batch kept by ``drop_remainder=False``), the epoch each
          was read in (the per-example randomness is keyed by it), and the stream position after
          the whole global batch (the input position once this batch is used). None when the
          stream has no global batch ``k`` for this host.
        """
        g, b = self.global_batch_size, self.batch_size
        first = start + k * g
        end = self.end
        if end is not None:
            if first >= end or (self.drop_remainder and first + g > end):
                return None
        lo = first + self.host_index * b
        hi = lo + b if end is None else min(lo + b, end)
        if lo >= hi:
            return None
        nxt = first + g if end is None else min(first + g, end)
        ids, epochs = self.read(lo, hi)
        return ids, epochs, nxt

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The record ids at stream positions ``[lo, hi)`` and the epoch of each."""
        n = self.num_records
        ids: list[np.ndarray] = []
        epochs: list[np.ndarray] = []
        s = lo
        while s < hi:
            e, p = divmod(s, n)
            take = min(hi - s, n - p)
            ids.append(self.order(e)[p : p + take])
            epochs.append(np.full(take, e, dtype=np.int64))
            s += take
        if not ids:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(ids), np.concatenate(epochs)
