"""The loader's saved position: what ``LoaderIterator.get_state`` writes and ``set_state`` checks.

The state is JSON: ``{"version", "order", "num_hosts", "epoch", "position", "num_skipped",
"seed", "shuffle", "num_records"}``. ``epoch``/``position`` are the global stream's position after
the last batch the caller received, the same on every host (``"order": "global"``), so it resumes
on any number of hosts. ``num_hosts`` is the loader's: a job of more processes whose loaders say
1 gave each its own share (``record_ids=host_shard(...)``), so the Estimator does not carry that
position to another host count (its input restarts, with a warning). ``seed``, ``shuffle`` and
``num_records`` are there to refuse a position that belongs to other data or settings. Version 1
(older estimax) counted each host's own records.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from estimax.data.loader_settings import LoaderSettings

__all__ = ["STATE_VERSION", "Position", "restore", "state_of"]

log = logging.getLogger(__name__)

STATE_VERSION = 2


class Position(NamedTuple):
    """Where an iterator stands: the stream's epoch and position in it, bad records so far."""

    epoch: int
    position: int
    num_skipped: int


def state_of(ld: LoaderSettings, at: Position) -> dict[str, Any]:
    """The JSON-serialisable state of an iterator over ``ld`` standing at ``at``."""
    return {
        "version": STATE_VERSION,
        **({"order": "global"} if ld.order_is_global else {}),
        "num_hosts": ld.num_hosts,
        "epoch": at.epoch,
        "position": at.position,
        "num_skipped": at.num_skipped,
        "seed": ld.seed,
        "shuffle": ld.shuffle,
        "num_records": ld.num_records,
    }


def restore(ld: LoaderSettings, state: dict[str, Any]) -> Position:
    """Where an iterator over ``ld`` given ``state`` continues from.

    Raises:
      ValueError: the state belongs to a different dataset (record count) or seed/shuffle, or to
        an unknown version.
    """
    version = state.get("version")
    if version == 1 and ld.num_hosts > 1:
        # A per-host position of an older estimax: it counted this host's own records, which
        # the global order does not have. Restart, as a changed host count did then.
        log.warning(
            "the saved input position is per host (loader state version 1); with the global "
            "order of %d hosts the input restarts from its beginning",
            ld.num_hosts,
        )
        return Position(0, 0, int(state.get("num_skipped", 0)))
    if version not in (1, STATE_VERSION):
        raise ValueError(
            f"unknown loader state version {version!r} (expected {STATE_VERSION}): {state}"
        )
    for key, mine in (
        ("num_records", ld.num_records),
        ("seed", ld.seed),
        ("shuffle", ld.shuffle),
    ):
        if state[key] != mine:
            raise ValueError(
                f"loader state has {key}={state[key]!r} but this loader has {key}={mine!r}: "
                "the saved input position belongs to other data or settings"
                + (
                    " (a Loader given one host's share, record_ids=host_shard(...), cannot "
                    "resume on another number of hosts: give every host all the record_ids with "
                    "num_hosts= and host_index=, the global order, which resumes on any)"
                    if key == "num_records"
                    else ""
                )
            )
    position = int(state["position"])
    if not 0 <= position <= ld.num_records:
        raise ValueError(f"loader state position {position} outside [0, {ld.num_records}]")
    return Position(int(state["epoch"]), position, int(state["num_skipped"]))
