"""``numpy_input_fn``: in-memory arrays as an input_fn, resumable (``tf.estimator.inputs``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


class NumpyIterator:
    """Batches of in-memory arrays with a seeded shuffle per epoch and a savable position."""

    def __init__(
        self,
        x: Any,
        y: Any,
        batch_size: int,
        shuffle: bool,
        num_epochs: int | None,
        seed: int,
        host_index: int,
        num_hosts: int,
    ):
        leaves = [v for v in (x.values() if isinstance(x, dict) else [x])]
        n = len(leaves[0])
        for v in leaves + ([y] if y is not None else []):
            if len(v) != n:
                raise ValueError(
                    f"numpy_input_fn: arrays have different lengths ({len(v)} vs {n})."
                )
        # One global order of the examples (shuffled per epoch), cut into global batches of
        # batch_size x num_hosts; host h reads the h-th block of batch_size of each. Every example
        # is on exactly one host, and the hosts' batches placed side by side (process order, as
        # the devices are) are the global batches one process would read, rows in the same
        # order: the same training whatever the number of hosts.
        self._n = n
        self._mine = (np.arange(n) // batch_size) % num_hosts == host_index
        self._x, self._y = x, y
        self._batch_size = batch_size
        self._shuffle = shuffle
        self._num_epochs = num_epochs
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.flatnonzero(self._mine)
        rng = np.random.default_rng([self._seed, epoch])  # a different order every epoch
        return rng.permutation(self._n)[self._mine]

    def get_state(self) -> dict:
        """Returns the position after the last batch handed out."""
        return {"epoch": self._epoch, "position": self._position}

    def set_state(self, state: dict) -> None:
        """Continues from a position returned by ``get_state``."""
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._order = self._epoch_order(self._epoch)

    def __iter__(self) -> NumpyIterator:
        return self

    def __next__(self) -> tuple[Any, Any]:
        picked: list[np.ndarray] = []
        needed = self._batch_size
        while needed:
            if self._position >= len(self._order):
                if self._num_epochs is not None and self._epoch + 1 >= self._num_epochs:
                    break
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
                if not len(self._order):
                    break
            take = self._order[self._position : self._position + needed]
            picked.append(take)
            self._position += len(take)
            needed -= len(take)
        if not picked:
            raise StopIteration
        idx = np.concatenate(picked)
        x = (
            {k: np.asarray(v)[idx] for k, v in self._x.items()}
            if isinstance(self._x, dict)
            else np.asarray(self._x)[idx]
        )
        if self._y is None:
            return x, None
        return x, np.asarray(self._y)[idx]


def numpy_input_fn(
    x: Any, y: Any = None, shuffle: bool = True, num_epochs: int | None = None, seed: int = 0
) -> Callable[[dict], Iterator]:
    """Returns an input_fn feeding in-memory arrays.

    Args:
      x: an array ``[N, ...]`` or a dict of them (the features).
      y: labels ``[N, ...]`` or None.
      shuffle: shuffle every epoch (seeded: the same seed gives the same batches).
      num_epochs: how many passes; None repeats forever (training). With a finite count the
        last batch may be partial (evaluation counts it exactly).
      seed: the shuffle seed.
    """

    def input_fn(params: dict) -> NumpyIterator:
        context = params.get("context")
        return NumpyIterator(
            x,
            y,
            params["batch_size"],
            shuffle,
            num_epochs,
            seed,
            getattr(context, "host_index", 0),
            getattr(context, "num_hosts", 1),
        )

    return input_fn
