"""``numpy_input_fn``: in-memory arrays as an input_fn, resumable (``tf.estimator.inputs``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from absl import logging

from estimax.data.order import GlobalOrder


class NumpyIterator:
    """Batches of in-memory arrays with a seeded shuffle per epoch and a savable position.

    The order is global (``estimax.data.order``): one stream of the examples over all hosts, cut
    into global batches of ``batch_size x num_hosts``, host ``h`` reading the ``h``-th block of
    each. The hosts' batches side by side are the global batches one process would read, so
    training does not depend on the number of hosts, and the saved position (the stream's, the
    same on every host) resumes on any number of hosts.
    """

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
        self._order = GlobalOrder(
            np.arange(n),
            batch_size,
            num_hosts=num_hosts,
            host_index=host_index,
            shuffle=shuffle,
            seed=seed,
            num_epochs=num_epochs,
            # A finite input keeps its last, partial batch (evaluation counts it exactly).
            drop_remainder=False,
        )
        self._x, self._y = x, y
        self._start = 0  # stream position of the next global batch

    def get_state(self) -> dict:
        """Returns the position after the last batch handed out (the same on every host)."""
        epoch, position = self._order.epoch_position(self._start)
        return {"order": "global", "epoch": epoch, "position": position}

    def set_state(self, state: dict) -> None:
        """Continues from a position returned by ``get_state`` (of any number of hosts).

        A position saved per host by an older estimax (no ``"order": "global"``) is that host's
        own count; with one host it is the same stream position.
        """
        if state.get("order") != "global" and self._order.num_hosts > 1:
            logging.warning(
                "numpy_input_fn: the saved input position is per host (an older checkpoint); "
                "the input restarts from its beginning."
            )
            self._start = 0
            return
        self._start = self._order.stream_position(state["epoch"], state["position"])

    def __iter__(self) -> NumpyIterator:
        return self

    def __next__(self) -> tuple[Any, Any]:
        block = self._order.host_block(self._start, 0)
        if block is None:
            raise StopIteration
        idx, _, self._start = block
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
