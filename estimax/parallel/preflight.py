"""The pre-flight check: before step 0 every process of a job must agree on what it runs.

Processes started by hand or by a job template can differ silently: one host with an old checkout,
another flag, another data directory, another batch size. Training then hangs in a collective or,
worse, trains something nobody asked for. Each process gathers a small JSON of what must be
equal (flags, config, dataset files and sizes, batch sizes, parameter shapes, code version), all
processes exchange them (``distributed.allgather_json``), and any difference stops every process
with one line naming the field and each process's value.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from estimax.parallel import distributed


class PreflightError(RuntimeError):
    """The processes of a multi-process job disagree (the message names the field and values)."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key in sorted(tree, key=str):
            out.update(_flatten(tree[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


@functools.cache
def code_version() -> str:
    """A digest of estimax's own Python sources (what runs, whatever the version string says)."""
    # The package's folder from this file's place (estimax/parallel/preflight.py), rather than
    # importing the package, which lists every layer.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:16]


def compare(facts_by_process: list[Mapping[str, Any]]) -> None:
    """Raises ``PreflightError`` naming the first field whose value differs between processes.

    Args:
      facts_by_process: each process's facts (nested dicts of JSON values), in process order.
    """
    flat = [_flatten(dict(facts)) for facts in facts_by_process]
    fields = sorted(set().union(*flat))
    for field in fields:
        values = [f.get(field, "<missing>") for f in flat]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"process {i}: {v!r}" for i, v in enumerate(values))
            raise PreflightError(
                f"pre-flight check: the {len(values)} processes disagree on {field} ({shown}). "
                "Start every process with the same code, flags, config and data."
            )


def check(facts: Mapping[str, Any]) -> None:
    """Compares ``facts`` across all processes; every process raises on a difference.

    A collective: every process must call it at the same point. With one process it returns at
    once.

    Args:
      facts: JSON-serialisable, nested by topic (``{"flags": {...}, "batch_sizes": {...}}``);
        field names in the error are the dotted paths (``flags.learning_rate``).

    Raises:
      PreflightError: the processes' facts differ.
    """
    gathered = distributed.allgather_json({"code_version": code_version(), **facts})
    compare(gathered)


def check_training(
    config: Any, batch_sizes: Mapping[str, int | None], params: Any, start: int
) -> None:
    """With many processes, before training: all must train the same ``RunConfig``, batch
    sizes and parameter shapes from the same step (``check``); with one it returns at once."""
    if jax.process_count() == 1:
        return
    check(
        {
            "config": {k: repr(v) for k, v in dataclasses.asdict(config).items()},
            "batch_sizes": dict(batch_sizes),
            "params": {
                jax.tree_util.keystr(path): list(np.shape(leaf))
                for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            },
            "start_step": start,
        }
    )
