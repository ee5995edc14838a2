"""The batches of each mode: ``input_fn``'s params, each batch checked or padded and put on the
mesh ahead of use, and the input position a checkpoint saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from estimax.estimator import feeding
from estimax.estimator.spec import InputContext, ModeKeys, RunConfig
from estimax.parallel import layouts, replication
from estimax.state import checkpoints as ckpt_lib


def _is_global(state: Any, num_hosts: int) -> bool:
    """An input position of the global order (estimax.data.order), the same on every host of a
    job of ``num_hosts``: not one whose loader read one host's share (``num_hosts`` 1 of more)."""
    return (
        isinstance(state, Mapping)
        and state.get("order") == "global"
        and state.get("num_hosts", num_hosts) == num_hosts
    )


def _input_state_of_this_process(meta: Mapping[str, Any], current: Any = None) -> Any:
    """This process's input position in a checkpoint's meta (each host saved its own).

    ``current``: the input iterator's own ``get_state()`` before it is restored, if it has one
    (whether this job's input is in the global order too).
    """
    states = meta.get("input_states")
    hosts = jax.process_count()
    carried = current is None or _is_global(current, hosts)
    if states is None:  # written by one process, or before positions were kept per host
        state = meta.get("input_state")
        if hosts > 1 and state is not None and not _is_global(state, 1):
            logging.warning(
                "The checkpoint holds one input position (written by a single process); every "
                "process resumes from it."
            )
        elif hosts > 1 and state is not None and not carried:
            _warn_restart(1, hosts)
            return None
        return state
    if len(states) != hosts and carried and all(_is_global(s, len(states)) for s in states):
        # A position in the global order means the same on any number of hosts.
        return states[0]
    if len(states) != hosts:
        _warn_restart(len(states), hosts)
        return None
    return states[jax.process_index()]


def _warn_restart(saved: int, hosts: int) -> None:
    logging.warning(
        "The checkpoint holds the input positions of %d process(es); this job has %d. The "
        "input restarts from its beginning (the examples seen differ from an uninterrupted "
        "run): it is read per host (each host its own share, e.g. record_ids=host_shard(...)). "
        "estimax.data.Loader(num_hosts=, host_index=) over all the records resumes exactly on "
        "any number of hosts.",
        saved,
        hosts,
    )


def _split_batch(element: Any) -> tuple[Any, Any]:
    if isinstance(element, tuple) and len(element) == 2:
        return element
    return element, None


def _check_rows(features: Any, labels: Any) -> None:
    """One error naming every shape when a batch's arrays disagree on their leading size."""
    # Per batch on the input path: the leading sizes only; names are made for the error.
    sizes = {
        np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves((features, labels))
    }
    if len(sizes) <= 1:
        return
    described = ", ".join(
        f"{part}{jax.tree_util.keystr(path)} {np.shape(leaf)}"
        for part, tree in (("features", features), ("labels", labels))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
    raise ValueError(
        f"input_fn yielded a batch whose arrays differ in batch size: {described}; "
        "features and labels must have the same leading (batch) size."
    )


def _check_train_batch(features: Any, per_host: int) -> None:
    first = features if isinstance(features, np.ndarray) else jax.tree.leaves(features)[0]
    size = int(np.shape(first)[0])
    if size != per_host:
        raise ValueError(
            f"input_fn yielded a training batch of {size} examples; this host must "
            f"feed {per_host} (train_batch_size / number of hosts). Training "
            "batches need a fixed size: repeat the data and drop the remainder."
        )


def restore_input_position(
    feeder: feeding.DevicePrefetcher, checkpointer: ckpt_lib.Checkpointer, step: int
) -> None:
    """Puts the input where it was when the checkpoint at ``step`` was written (if it can)."""
    iterator = feeder.iterator
    current = iterator.get_state() if hasattr(iterator, "get_state") else None
    input_state = _input_state_of_this_process(checkpointer.restore_meta(step), current)
    if input_state is not None and hasattr(iterator, "set_state"):
        iterator.set_state(input_state)
    elif input_state is not None:
        logging.warning(
            "The input iterator has no set_state(): resuming at step %d "
            "restarts the input from its beginning.",
            step,
        )


def _transfer(mesh: Mesh, layout: layouts.Layout, mode: str, block: bool) -> Callable[[Any], Any]:
    """``host batch -> device batch``: rows over the replicas; with cores per replica, each
    core also gets only its tile of a split input (``layouts.Layout.input_specs``)."""
    axes = replication.data_axes(mesh)
    rows = P(None, axes) if block else P(axes)
    if not layout.cores:
        return lambda b: replication.to_device(b, mesh, rows)
    specs: list[Any] = []  # of the first batch: every batch of a run has its structure

    def put(b: Any) -> Any:
        if not specs:
            if mode == ModeKeys.TRAIN:
                specs.append(layout.input_specs(*b, block=block))
            elif mode == ModeKeys.EVAL:
                specs.append((*layout.input_specs(b[0], b[1], block=block), rows))
            else:
                specs.append(layout.input_specs(b, None, block=block)[0])
        return replication.to_device(b, mesh, specs[0])

    return put


def _leading_rows(tree: Any, n: int | None) -> Any:
    """Copies of the first ``n`` (None: all) rows of every leaf (a sample that keeps no batch)."""
    return jax.tree.map(lambda x: np.array(np.asarray(x)[:n]), tree)


def input_params(params: Mapping[str, Any], global_batch: int, num_replicas: int) -> dict:
    """``input_fn``'s params: the user's, this host's ``batch_size`` and the ``context``."""
    params = dict(params)
    params["batch_size"] = replication.per_host_batch(global_batch)
    params["context"] = InputContext(
        host_index=jax.process_index(),
        num_hosts=jax.process_count(),
        num_replicas=num_replicas,
        global_batch_size=global_batch,
    )
    return params


def feeder(
    mode: str,
    input_fn: Callable[[dict], Iterable],
    params: Mapping[str, Any],
    global_batch: int,
    mesh: Mesh,
    config: RunConfig,
    limit: int | None = None,
) -> tuple[feeding.DevicePrefetcher, list[Any]]:
    """The one input set-up of the three modes: ``input_fn`` called with this host's params,
    each batch checked (training: its size) or padded (evaluation, prediction), and put on
    the mesh ahead of use.

    Returns:
      the prefetcher, and a list that holds, once the first batch is read, its first
      per-replica rows ``(features, labels)``: what the model is initialised or restored with.
    """
    per_host = replication.per_host_batch(global_batch)
    replicas = layouts.num_replicas(mesh)
    rows = global_batch // replicas or 1
    iterable = input_fn(input_params(params, global_batch, replicas))
    iterator = iter(iterable)
    sample: list[Any] = []

    def prepare(element: Any) -> tuple[Any, int | None]:
        host: Any
        features, labels = _split_batch(element)
        if mode == ModeKeys.PREDICT:
            labels = None
        _check_rows(features, labels)
        if mode == ModeKeys.TRAIN:
            _check_train_batch(features, per_host)
            host, info = (features, labels), None
        else:
            (features, labels), mask, n = replication.pad_batch((features, labels), per_host)
            host, info = ((features, labels, mask) if mode == ModeKeys.EVAL else features), n
        if not sample:
            sample.append(_leading_rows((features, labels), rows))
        return host, info

    block = config.steps_per_device_call if mode == ModeKeys.TRAIN else 1
    feeder: feeding.DevicePrefetcher
    transfer = _transfer(mesh, config.layout, mode, block > 1)
    if block > 1:
        feeder = feeding.BlockPrefetcher(iterator, prepare, transfer, block, limit=limit)
    else:
        feeder = feeding.DevicePrefetcher(
            iterator, prepare, transfer, size=config.device_prefetch, limit=limit
        )
    with contextlib.suppress(TypeError):  # an infinite input has no len()
        feeder.expected_batches = len(iterable)  # type: ignore[arg-type]
    return feeder, sample
