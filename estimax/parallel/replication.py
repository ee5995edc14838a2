"""The device mesh, batch-size arithmetic, and moving batches between hosts and devices."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimax.parallel import launch

# The mesh axis replicas are laid along. Pass it as ``axis_name`` to ``nn.BatchNorm`` (or to any
# ``lax`` collective) inside a ``model_fn`` for cross-replica batch norm.
REPLICA_AXIS = "data"
# The mesh axis of a multi-slice job's slices (``RunConfig.num_slices`` > 1): data parallel over
# the data-center network (DCN), ahead of ``data`` (the replicas of one slice, over its ICI).
# The batch is split over both; parameters never are over this one (MaxText's rule: FSDP and
# spatial partitioning stay inside a slice, where the links are fast).
DCN_AXIS = "dcn"


def data_axes(mesh: Mesh) -> str | tuple[str, str]:
    """The axes a batch is split over on ``mesh``: ``data``, or ``("dcn", "data")`` when the
    mesh spans slices (a collective over the pair is over every replica, slice-major)."""
    return (DCN_AXIS, REPLICA_AXIS) if DCN_AXIS in mesh.axis_names else REPLICA_AXIS


def slice_and_dcn(axis_name: Any) -> tuple[Any, str | None]:
    """``(axis inside a slice, DCN axis or None)`` of a step's replica axis name (``data``,
    ``("dcn", "data")`` or None)."""
    if isinstance(axis_name, tuple):
        dcn, inner = axis_name
        return inner, dcn
    return axis_name, None


def make_mesh(
    num_shards: int | None = None,
    cores: tuple[int, ...] = (),
    axes: tuple[str, ...] = (),
    num_slices: int = 1,
    devices: list[Any] | None = None,
) -> Mesh:
    """Returns the mesh of ``num_shards`` replicas (None: as many as the devices make).

    Without ``cores``: 1-D, one device per replica. With ``cores`` (a replica's devices as the
    sizes of the model ``axes``, ``layouts.Layout``): ``(replicas, *cores)``, each replica's
    cores neighbours in device order. With ``num_slices`` S > 1: ``(S, replicas / S, *cores)``
    with a leading ``dcn`` axis (``hybrid_devices``); ``devices`` default to ``jax.devices()``.
    """
    devices = list(jax.devices() if devices is None else devices)
    if num_slices > 1:
        return _hybrid_mesh(num_shards, cores, axes, num_slices, devices)
    per_replica = math.prod(cores)
    if num_shards is None:
        if len(devices) % per_replica:
            raise ValueError(
                f"--num_cores_per_replica={per_replica} (RunConfig.num_cores_per_replica) does "
                f"not divide this job's {len(devices)} {devices[0].platform} devices: use a "
                f"divisor of {len(devices)}."
            )
        num_shards = len(devices) // per_replica
    if not 1 <= num_shards * per_replica <= len(devices):
        cores_note = f" x {per_replica} cores per replica" if cores else ""
        raise ValueError(
            f"num_shards={num_shards}{cores_note} but this job sees {len(devices)} device(s) "
            f"({devices[0].platform}). Use {len(devices) // per_replica} replicas or fewer, or "
            "None for all."
        )
    if not cores:
        return Mesh(np.array(devices[:num_shards]), (REPLICA_AXIS,))
    grid = np.array(devices[: num_shards * per_replica]).reshape(num_shards, *cores)
    return Mesh(grid, (REPLICA_AXIS, *axes))


def _hybrid_mesh(
    num_shards: int | None,
    cores: tuple[int, ...],
    axes: tuple[str, ...],
    num_slices: int,
    devices: list[Any],
) -> Mesh:
    """The ``("dcn", "data", *axes)`` mesh of ``num_slices`` slices (``make_mesh``)."""
    grid = hybrid_devices(num_slices, cores, devices)
    per_slice = grid.shape[1]
    if num_shards is not None:
        if num_shards % num_slices or not 1 <= num_shards // num_slices <= per_slice:
            raise ValueError(
                f"num_shards={num_shards} (--num_shards) over --num_slices={num_slices} "
                f"(RunConfig.num_slices): use a multiple of {num_slices} up to "
                f"{per_slice * num_slices} replicas (the same number in every slice)."
            )
        grid = grid[:, : num_shards // num_slices]
    return Mesh(grid, (DCN_AXIS, REPLICA_AXIS, *axes))


def hybrid_devices(num_slices: int, cores: tuple[int, ...], devices: list[Any]) -> np.ndarray:
    """``devices`` as a ``(slices, replicas per slice, *cores)`` array: ICI inside a slice,
    DCN across (``mesh_utils.create_hybrid_device_mesh``).

    TPU devices of a multi-slice job carry their ``slice_index``; JAX's hybrid mesh lays each
    slice's devices out by its physical ICI topology. Other devices (CPU processes, GPUs: a
    multi-process CPU job's all say slice 0) are grouped into simulated slices: the processes
    in order, ``processes / slices`` hosts to a slice (one process, as in tests: its devices
    in order, ``devices / slices`` to a slice).

    Raises:
      ValueError: one line naming ``--num_slices`` when it does not divide the processes (a
        host belongs to one slice) or the devices into slices of whole replicas.
    """
    per_replica = math.prod(cores)
    flag = f"--num_slices={num_slices} (RunConfig.num_slices)"
    processes = len({d.process_index for d in devices})
    if processes > 1 and processes % num_slices:
        raise ValueError(
            f"{flag} does not divide this job's {processes} processes: every slice has the "
            f"same number of hosts; use a divisor of {processes}."
        )
    if len(devices) % (num_slices * per_replica):
        cores_note = f" x {per_replica} cores per replica" if cores else ""
        raise ValueError(
            f"{flag}{cores_note} does not divide this job's {len(devices)} "
            f"{devices[0].platform} devices into equal slices of whole replicas."
        )
    per_slice = len(devices) // num_slices // per_replica
    # Only TPU slices are real ones: CPU devices of a multi-process job say slice_index 0.
    if devices[0].platform == "tpu":
        slices = {d.slice_index for d in devices}
        if len(slices) != num_slices:
            raise ValueError(
                f"{flag} but this job's devices are in {len(slices)} TPU slice(s) "
                "($MEGASCALE_NUM_SLICES): give the number of slices the job has."
            )
        ones = (1,) * len(cores)
        return np.asarray(
            mesh_utils.create_hybrid_device_mesh(
                (1, per_slice, *cores), (num_slices, 1, *ones), devices
            )
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    if processes > 1:
        check_slice_id(jax.process_index() // (processes // num_slices))
    return np.array(ordered, dtype=object).reshape(num_slices, per_slice, *cores)


def num_slices_from(requested: int | None, environ: Mapping[str, str] | None = None) -> int:
    """The job's slices: ``requested`` (``--num_slices`` / ``RunConfig.num_slices``), else
    ``$MEGASCALE_NUM_SLICES`` (what a multi-slice TPU job's hosts get: xpk, GKE, queued
    resources), else 1.

    Raises:
      ValueError: one line when ``requested`` is not a positive count, a ``MEGASCALE_*`` value
        is not a number in range, or ``$MEGASCALE_NUM_SLICES`` disagrees with ``requested``.
    """
    environ = os.environ if environ is None else environ
    if requested is not None and (isinstance(requested, bool) or not requested >= 1):
        raise ValueError(
            f"--num_slices={requested} (RunConfig.num_slices) must be a count of slices >= 1."
        )
    raw = (environ.get("MEGASCALE_NUM_SLICES") or "").strip()
    found = None
    if raw:
        found = launch.slice_number("MEGASCALE_NUM_SLICES", raw, 1, "the TPU slices")
    slices = requested or found or 1
    if found is not None and found != slices:
        raise ValueError(
            f"--num_slices={slices} (RunConfig.num_slices) disagrees with this job's "
            f"$MEGASCALE_NUM_SLICES={found}: leave the flag out or give the job's number."
        )
    raw_id = (environ.get("MEGASCALE_SLICE_ID") or "").strip()
    if raw_id:
        slice_id = launch.slice_number("MEGASCALE_SLICE_ID", raw_id, 0, "this TPU slice's index")
        if slice_id >= slices:
            raise ValueError(
                f"$MEGASCALE_SLICE_ID={slice_id} is not a slice of --num_slices={slices} "
                f"(RunConfig.num_slices): slices are 0 .. {slices - 1}."
            )
    return slices


def check_slice_id(slice_of_process: int, environ: Mapping[str, str] | None = None) -> None:
    """Simulated slices: ``$MEGASCALE_SLICE_ID``, where set, names this process's slice
    (processes in order, an equal share per slice), else one ValueError line."""
    environ = os.environ if environ is None else environ
    raw = (environ.get("MEGASCALE_SLICE_ID") or "").strip()
    if raw and launch.slice_number("MEGASCALE_SLICE_ID", raw, 0, "") != slice_of_process:
        raise ValueError(
            f"$MEGASCALE_SLICE_ID={raw} but process {jax.process_index()} of "
            f"{jax.process_count()} is in slice {slice_of_process} (processes in order, an "
            "equal share to each slice): give each host its own slice's id."
        )


class BatchSplitError(ValueError):
    """A global batch does not split evenly over this job's replicas or hosts (a batch size, or
    a run resumed on another number of hosts or devices that does not divide it)."""


def per_replica_batch(global_batch: int, num_replicas: int, what: str) -> int:
    """Returns the per-replica batch size, or raises naming the batch size and replica count."""
    if global_batch is None or global_batch < 1:
        raise ValueError(f"{what} must be a positive global batch size, got {global_batch}.")
    if global_batch % num_replicas:
        raise BatchSplitError(
            f"{what}={global_batch} is not divisible by the number of replicas "
            f"({num_replicas}): each replica must get the same number of examples. "
            f"Use a multiple of {num_replicas}, e.g. "
            f"{global_batch - global_batch % num_replicas or num_replicas}."
        )
    return global_batch // num_replicas


def per_host_batch(global_batch: int) -> int:
    """Returns how many examples of a global batch this host's input_fn must produce."""
    hosts = jax.process_count()
    if global_batch % hosts:
        raise BatchSplitError(
            f"Global batch size {global_batch} is not divisible by the {hosts} hosts."
        )
    return global_batch // hosts


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of values every replica holds whole (parameters, optimizer state)."""
    return NamedSharding(mesh, P())


def to_device(tree: Any, mesh: Mesh, spec: Any) -> Any:
    """Assembles global arrays from this host's numpy pieces, sharded by ``spec`` on ``mesh``
    (one ``PartitionSpec`` for every leaf, or a pytree of them: a prefix of ``tree``)."""
    if mesh.size == 1 and jax.process_count() == 1:
        return _to_one_device(mesh.devices.flat[0])(tree)
    if isinstance(spec, P):
        sharding: Any = NamedSharding(mesh, spec)
    else:
        sharding = jax.tree.map(
            lambda s: NamedSharding(mesh, s), spec, is_leaf=lambda x: isinstance(x, P)
        )
    if jax.process_count() == 1:
        # This host's pieces are the whole arrays: one batched transfer of every leaf (per leaf,
        # make_array_from_process_local_data cost ~40 us more per step, bench/overhead.py).
        return jax.device_put(tree, sharding)
    if isinstance(sharding, NamedSharding):
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda x: jax.make_array_from_process_local_data(s, x), sub),
        sharding,
        tree,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


@functools.cache
def _to_one_device(device: jax.Device) -> Callable[[Any], Any]:
    """``host tree -> device tree`` on one device: a jitted identity.

    jit moves numpy arguments in its C++ dispatch, where ``jax.device_put`` runs Python per
    call (jax-ml/jax#16905): a batch of two small arrays took a quarter of the time (28 us
    against 116 us on one CPU device under load; ``device_put`` took 49 us on a quiet one).
    Nothing is computed: the outputs are the transferred arguments, placed as plainly as a bare
    loop's (a NamedSharding cost ~12 us more per transfer). Over many devices the same identity
    was slower than ``device_put``.
    """
    placed = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(lambda tree: tree, in_shardings=placed, out_shardings=placed)


def to_local_numpy(x: jax.Array) -> np.ndarray:
    """Returns this host's rows of a batch-sharded array, in order (all rows on one host)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    pieces: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        pieces.setdefault(start, np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=0)


def pad_batch(tree: Any, size: int) -> tuple[Any, np.ndarray, int]:
    """Pads a host batch to ``size`` rows by repeating its first row.

    Returns:
      (padded tree, mask [size] float32 with 1 for real rows, number of real rows). Repeating a
      real row (instead of zeros) keeps padded rows valid inputs (no NaN, labels in range).
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError("The input batch has no arrays.")
    n = int(np.shape(leaves[0])[0])
    for leaf in leaves:
        if np.shape(leaf)[0] != n:
            raise ValueError(
                "All arrays of a batch must have the same leading (batch) size; got "
                f"{[np.shape(leaf) for leaf in leaves]}."
            )
    if n > size:
        raise ValueError(
            f"input_fn yielded a batch of {n} examples, more than the per-host batch size {size}."
        )
    mask = np.zeros([size], np.float32)
    mask[:n] = 1.0
    if n == size:
        return tree, mask, n

    def pad(x: Any) -> np.ndarray:
        x = np.asarray(x)
        fill = np.repeat(x[:1], size - n, axis=0)
        return np.concatenate([x, fill], axis=0)

    return jax.tree.map(pad, tree), mask, n


# XLA:CPU's LLVM passes spend minutes on the unrolled threefry hashing of a large model's
# initialisers (Inception v3: 133 s at the default level, 24 s at level 0, measured on 2 shared
# cores). The function runs once, so its speed does not matter. Other backends keep their
# defaults (their compilers do not know these options).
_CPU_INIT_COMPILER_OPTIONS: dict[str, str | bool] = {"xla_backend_optimization_level": "0"}


def run_init(fn: Callable[..., Any], mesh: Mesh, *args: Any, out_shardings: Any = None) -> Any:
    """Compiles and runs ``fn(*args)`` once with outputs replicated over ``mesh`` (or placed
    by ``out_shardings``: FSDP's slices are initialised where they live).

    For initialisers: on CPU it compiles at a low optimisation level. The random bits are the
    same; float rounding of the initialisers' transforms may differ in the last bit from a
    default-level compile, and is the same on every run.
    """
    placed = replicated(mesh) if out_shardings is None else out_shardings
    lowered = jax.jit(fn, out_shardings=placed).lower(*args)
    options = _CPU_INIT_COMPILER_OPTIONS if mesh.devices.flat[0].platform == "cpu" else None
    return lowered.compile(compiler_options=options)(*args)
