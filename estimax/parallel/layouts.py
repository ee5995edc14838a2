"""Where a step's arrays lie on the mesh: replicas x cores per replica, and FSDP.

TPUEstimator's model parallelism for activations (``num_cores_per_replica``,
``input_partition_dims``) and today's FSDP, both inside estimax's one ``shard_map``:

| layout            | mesh                          | inside the per-replica ``shard_map``         |
|-------------------|-------------------------------|----------------------------------------------|
| data parallel     | ``('data',)``                 | manual over ``data`` (the default, as before)|
| spatial           | ``('data', 'model0', ...)``:  | manual over ``data`` only; the model axes    |
| (``N`` cores per  | one axis per split input      | are left to XLA, which splits the model's    |
| replica)          | dimension (``[1,2,2,1]``:     | activations as ``with_sharding_constraint``  |
|                   | ``model0`` 2 x ``model1`` 2)  | splits the input (halo exchanges, batch-norm |
|                   |                               | statistics over the replica's cores)         |
| FSDP              | any of the above              | parameters >= ``shard_parameters`` MiB (and  |
|                   |                               | their gradients, optimizer state and EMA)    |
|                   |                               | are slices over ``data``, ``all_gather``-ed  |
|                   |                               | whole before use                             |

The input: each host feeds its replicas' whole examples; the transfer places each core's tile
of a split input on that core (``input_specs``), and the step constrains it the same way (so
a step compiled from abstract inputs splits them on the device too).

FSDP follows big_vision's ``fsdp(axis="data", min_size_to_shard_mb=...)``: a leaf of at least
the size is split on its largest dimension that divides by the replica count; a leaf that has
none stays whole, with a warning naming it (big_vision logs it too); if the rule splits nothing
at all with more than one replica, that is an error naming the flag (the user asked for FSDP
and would silently get none). With one replica there is nothing to split and FSDP is a no-op.
Checkpoints hold whole (global) arrays whatever the layout; restoring places them by the
restoring run's layout, so a run resumes under another layout or device count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import jax
import numpy as np
from absl import logging
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimax.parallel import replication
from estimax.parallel.replication import DCN_AXIS, REPLICA_AXIS

# The mesh axes of a replica's cores: the k-th split dimension of the inputs is split over
# ``model{k}`` (``[1, 2, 2, 1]``: H over model0, W over model1).
MODEL_AXIS_PREFIX = "model"
_MIB = 2**20
# A train state (``estimax.state.train_state.TrainState``: a flax struct, ``replace`` copies).
_State = TypeVar("_State", bound=Any)


class LayoutFields(Protocol):
    """The fields of a ``RunConfig`` that make its layout (``Layout.from_config`` reads them)."""

    @property
    def num_cores_per_replica(self) -> int: ...
    @property
    def input_partition_dims(self) -> Any: ...
    @property
    def shard_parameters(self) -> float | None: ...
    @property
    def num_slices(self) -> int | None: ...


def format_dims(dims: Any) -> str:
    """``[1, 2, 2, 1]`` as the flag writes it (``1,2,2,1``); other structures as Python's."""
    if isinstance(dims, list | tuple) and all(isinstance(d, int) for d in dims):
        return ",".join(map(str, dims))
    return repr(dims)


def partition_lists(dims: Any) -> list[tuple[str, Sequence[int]]]:
    """The int lists of one input's partition dims, each with where it is (``""`` for a
    single array, ``"[key]"`` in a dict); None entries (inputs every core gets whole) left out."""
    if dims is None:
        return []
    if isinstance(dims, Mapping):
        return [(f"[{k!r}]", d) for k, d in dims.items() if d is not None]
    return [("", dims)]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A run's layout (``Layout.from_config``); the default one changes nothing.

    Attributes:
      cores: the sizes of the mesh's model axes, one per split input dimension, in order
        (their product is ``num_cores_per_replica``); () for one core per replica.
      features_dims, labels_dims: ``RunConfig.input_partition_dims``' two entries.
      fsdp_min_bytes: FSDP's threshold in bytes (``shard_parameters`` MiB), or None.
      num_slices: the slices the replicas are spread over (``RunConfig.num_slices``): data
        parallel over a leading ``dcn`` mesh axis; cores and FSDP stay inside a slice.
    """

    cores: tuple[int, ...] = ()
    features_dims: Any = None
    labels_dims: Any = None
    fsdp_min_bytes: int | None = None
    num_slices: int = 1

    @classmethod
    def from_config(cls, config: LayoutFields) -> Layout:
        """The layout of ``config``'s ``num_cores_per_replica``, ``input_partition_dims`` and
        ``shard_parameters`` (checked there already, except what needs the inputs)."""
        dims = list(config.input_partition_dims or [])
        features = dims[0] if dims else None
        labels = dims[1] if len(dims) > 1 else None
        groupings = {}
        for what, entry_dims in (("features", features), ("labels", labels)):
            for where, entry in partition_lists(entry_dims):
                groupings[f"{what}{where} {format_dims(entry)}"] = tuple(d for d in entry if d > 1)
        if len(set(groupings.values())) > 1:
            raise ValueError(
                "RunConfig.input_partition_dims (--input_partition_dims): every split input must "
                "split its dimensions in the same order by the same factors (they share the "
                f"replica's cores, one mesh axis per factor); got {', '.join(groupings)}."
            )
        cores = next(iter(groupings.values()), ())
        if not cores and config.num_cores_per_replica > 1:
            # No input split: one model axis the user's model_fn may constrain arrays over.
            cores = (config.num_cores_per_replica,)
        mb = config.shard_parameters
        fsdp = None if mb is None else int(mb * _MIB)
        return cls(cores, features, labels, fsdp, config.num_slices or 1)

    @property
    def is_default(self) -> bool:
        """One core per replica, no FSDP: the data-parallel steps, exactly as without layouts
        (over one slice or several: the batch split over ``data_axes`` either way)."""
        return not self.cores and self.fsdp_min_bytes is None

    def describe(self) -> str:
        """The layout as its flags write it (``""`` for the default): what a report names."""
        parts = []
        if self.num_slices > 1:
            parts.append(f"--num_slices={self.num_slices}")
        if self.cores:
            parts.append(f"--num_cores_per_replica={self.cores_per_replica}")
        if self.features_dims is not None:
            parts.append(f"--input_partition_dims={format_dims(self.features_dims)}")
        if self.fsdp_min_bytes is not None:
            parts.append(f"--fsdp_min_size_mb={self.fsdp_min_bytes / _MIB:g}")
        return " ".join(parts)

    @property
    def cores_per_replica(self) -> int:
        """``num_cores_per_replica``."""
        return math.prod(self.cores)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The mesh axes of a replica's cores (``model0``, ...)."""
        return tuple(f"{MODEL_AXIS_PREFIX}{k}" for k in range(len(self.cores)))

    @property
    def data_axes(self) -> str | tuple[str, str]:
        """The mesh axes the batch is split over: ``data``, or ``("dcn", "data")`` over slices."""
        return (DCN_AXIS, REPLICA_AXIS) if self.num_slices > 1 else REPLICA_AXIS

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The axes of this layout's mesh: (``dcn``,) ``data``, then the model axes."""
        dcn = (DCN_AXIS,) if self.num_slices > 1 else ()
        return (*dcn, REPLICA_AXIS, *self.model_axes)

    def make_mesh(self, num_shards: int | None) -> Mesh:
        """The mesh of ``num_shards`` replicas (None: all devices / cores) x the model axes
        (over ``num_slices`` slices: a leading ``dcn`` axis, ``replication.hybrid_devices``)."""
        return replication.make_mesh(num_shards, self.cores, self.model_axes, self.num_slices)

    # ------------------------------------------------------------------ inputs

    def input_specs(self, features: Any, labels: Any, *, block: bool = False) -> tuple[Any, Any]:
        """The transfer specs of a host batch ``(features, labels)``: batch over ``data`` and
        each split dimension over its model axis (``block``: batches stacked ``[n, B, ...]``).

        Raises:
          ValueError: one line naming ``--input_partition_dims`` when an input's rank or a
            split dimension's size does not fit its dims.
        """
        lead = (None,) if block else ()
        rows = self.data_axes
        return (
            _spec_tree(features, self.features_dims, "features", self.model_axes, lead, rows),
            _spec_tree(labels, self.labels_dims, "labels", self.model_axes, lead, rows),
        )

    def constrain(self, features: Any, labels: Any) -> tuple[Any, Any]:
        """Inside the per-replica ``shard_map``: the replica's inputs split over its cores."""
        if not self.cores:
            return features, labels

        def constrained(tree: Any, dims: Any, what: str) -> Any:
            specs = _spec_tree(tree, dims, what, self.model_axes, (), None)
            return jax.tree.map(
                lambda x, s: x if s is None else lax.with_sharding_constraint(x, s),
                tree,
                specs,
                is_leaf=lambda x: x is None,
            )

        return (
            constrained(features, self.features_dims, "features"),
            constrained(labels, self.labels_dims, "labels"),
        )

    # ------------------------------------------------------------------ FSDP

    def param_dims(self, params: Any, replicas: int) -> Any:
        """A pytree like ``params``: the dimension each leaf is split on over the replicas, -1
        for whole (no FSDP, one replica, a small leaf, or no dimension divides)."""
        return jax.tree.map(lambda leaf: self._split_dim(leaf, replicas), params)

    def _split_dim(self, leaf: Any, replicas: int) -> int:
        if self.fsdp_min_bytes is None or replicas <= 1 or _nbytes(leaf) < self.fsdp_min_bytes:
            return -1
        shape = tuple(leaf.shape)
        for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
            if shape[d] % replicas == 0:
                return d
        return -1

    def check_fsdp(self, params: Any, replicas: int) -> None:
        """Says what FSDP cannot split: a warning per leaf of the size with no dimension that
        divides by the replicas; a ValueError (one line, naming the flag) when nothing at all
        is split with more than one replica."""
        if self.fsdp_min_bytes is None or replicas <= 1:
            return
        flag = f"--fsdp_min_size_mb={self.fsdp_min_bytes / _MIB:g} (RunConfig.shard_parameters)"
        named = jax.tree_util.tree_flatten_with_path(params)[0]
        split = 0
        for path, leaf in named:
            if _nbytes(leaf) < self.fsdp_min_bytes:
                continue
            if self._split_dim(leaf, replicas) >= 0:
                split += 1
            else:
                logging.warning(
                    "%s: parameter %s %s stays whole on every replica: none of its dimensions "
                    "divides by the %d replicas.",
                    flag,
                    jax.tree_util.keystr(path),
                    list(leaf.shape),
                    replicas,
                )
        if not split:
            largest = max(
                named, key=lambda kv: _nbytes(kv[1]), default=((), np.zeros((0,), np.float32))
            )
            raise ValueError(
                f"{flag}: FSDP splits no parameter of this model over its {replicas} replicas "
                f"(the largest, {jax.tree_util.keystr(largest[0]) or 'none'} "
                f"{list(largest[1].shape)}, is {_nbytes(largest[1]) / _MIB:.3g} MiB): lower "
                "the size, or leave FSDP off."
            )

    def state_specs(self, state: _State, replicas: int) -> _State:
        """The ``PartitionSpec`` of each leaf of a train state (arrays, abstract or traced):
        split parameters, their optimizer state (leaves of the same path and shape) and their
        EMA over ``data``; everything else replicated."""
        dims = self.param_dims(state.params, replicas)
        param_specs = jax.tree.map(_split_spec, dims)
        return state.replace(
            step=cast(Any, P()),  # a TrainState of specs, as shard_map takes them
            params=param_specs,
            model_state=jax.tree.map(lambda _: P(), state.model_state),
            opt_state=_like_params(state.opt_state, state.params, dims),
            ema_params=jax.tree.map(_split_spec, self.param_dims(state.ema_params, replicas)),
        )

    def variables_specs(self, variables: Mapping[str, Any], replicas: int) -> dict[str, Any]:
        """The ``PartitionSpec`` of each leaf of ``{"params": ..., <collection>: ...}``."""
        return {
            name: jax.tree.map(_split_spec, self.param_dims(tree, replicas))
            if name == "params"
            else jax.tree.map(lambda _: P(), tree)
            for name, tree in variables.items()
        }


def num_replicas(mesh: Mesh) -> int:
    """The replicas of ``mesh``: the size of its ``data`` axis (times its slices, ``dcn``)."""
    return int(mesh.shape[REPLICA_AXIS]) * int(dict(mesh.shape).get(DCN_AXIS, 1))


def replicas_per_slice(mesh: Mesh) -> int:
    """The replicas of one slice: what FSDP splits parameters over (never over ``dcn``)."""
    return int(mesh.shape[REPLICA_AXIS])


def shardings(specs: Any, mesh: Mesh) -> Any:
    """``NamedSharding``s on ``mesh`` for a pytree of ``PartitionSpec``s."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _nbytes(leaf: Any) -> int:
    return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def _split_spec(dim: int) -> P:
    return P() if dim < 0 else P(*([None] * dim), REPLICA_AXIS)


def _like_params(opt_state: Any, params: Any, dims: Any) -> Any:
    """Specs of an optimizer state: a leaf whose key path ends with a parameter's path and
    has its shape (optax's ``mu``, ``nu``, ``trace``...) is split as that parameter; others
    (counts, factored statistics of another shape) are replicated."""
    by_path = {
        tuple(path): (tuple(leaf.shape), dim)
        for (path, leaf), dim in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(dims), strict=True
        )
    }
    depths = sorted({len(p) for p in by_path}, reverse=True)

    def spec(path: tuple[Any, ...], leaf: Any) -> P:
        for depth in depths:
            found = by_path.get(tuple(path[-depth:])) if depth <= len(path) else None
            if found is not None and found[0] == tuple(np.shape(leaf)):
                return _split_spec(found[1])
        return P()

    return jax.tree_util.tree_map_with_path(spec, opt_state)


def _spec_tree(
    tree: Any, dims: Any, what: str, axes: tuple[str, ...], lead: tuple[None, ...], data: Any
) -> Any:
    """Each leaf of one input's ``PartitionSpec``: with ``data`` (the batch's mesh axes), the
    batch dimension over the replicas (the transfer's, global); None: the per-replica
    constraint (None where a leaf is not split)."""
    batch: tuple[Any, ...] = (data,) if data is not None else ()
    whole = P(*lead, *batch) if data else None
    if tree is None:
        return None
    if dims is None:
        return jax.tree.map(lambda _: whole, tree)
    if isinstance(dims, Mapping):
        if not isinstance(tree, Mapping):
            raise ValueError(
                f"--input_partition_dims (RunConfig.input_partition_dims): the {what} dims are "
                f"a dict ({sorted(dims)}) but the {what} are not."
            )
        unknown = sorted(set(dims) - set(tree))
        if unknown:
            raise ValueError(
                f"--input_partition_dims (RunConfig.input_partition_dims): the {what} have no "
                f"key(s) {unknown} (they have {sorted(tree)})."
            )
        return {
            k: _spec_tree(v, dims.get(k), f"{what}[{k!r}]", axes, lead, data)
            for k, v in tree.items()
        }
    flag = f"--input_partition_dims={format_dims(dims)} (RunConfig.input_partition_dims)"
    if not hasattr(tree, "shape"):
        raise ValueError(
            f"{flag}: the {what} are a {type(tree).__name__}, not one array; give a dict of "
            "dims, one per key (None: not split)."
        )
    shape = tuple(tree.shape)[len(lead) :]
    if len(shape) != len(dims):
        raise ValueError(
            f"{flag}: the {what} have {len(shape)} dimensions {list(shape)}, the dims "
            f"{len(dims)}: give one entry per dimension (NHWC images: 1,2,2,1)."
        )
    spec: list[Any] = []
    k = 0
    for i, (size, d) in enumerate(zip(shape, dims, strict=True)):
        names: tuple[str, ...] = batch if i == 0 else ()
        if d > 1:
            # The batch dimension is the replica's rows on the device, the host's on transfer.
            if i > 0 and size % d:
                raise ValueError(
                    f"{flag}: dimension {i} of the {what}, {size}, does not divide into {d} "
                    f"equal parts over the replica's cores: use a size divisible by {d} "
                    f"(e.g. {size - size % d or d}) or another split."
                )
            names = (*_flat(names), axes[k])
            k += 1
        spec.append(names[0] if len(names) == 1 else (names or None))
    return P(*lead, *spec)


def _flat(names: tuple[Any, ...]) -> tuple[str, ...]:
    """Mesh axis names with a tuple of them (the batch's ``("dcn", "data")``) spread out."""
    return tuple(n for name in names for n in (name if isinstance(name, tuple) else (name,)))
