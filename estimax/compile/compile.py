"""Compiling an Estimator's steps for a Cloud TPU slice or NVIDIA GPUs on a machine with neither.

XLA's TPU compiler ships in ``libtpu`` (the ``tpu`` extra) and runs on any Linux x86-64 host:
``jax.experimental.topologies.get_topology_desc`` gives the devices of a slice by name
(``v5e:2x4``), a mesh over them lowers the same ``jit`` an Estimator runs, and the compiled
executable says what it needs per device (``memory_analysis()``: arguments, temporaries, code)
and does per step (``cost_analysis()``: flops, bytes accessed). A program that does not fit
fails to compile with the compiler's RESOURCE_EXHAUSTED, as it would on the hardware.

Who owns what:

| piece                                        | owner                  | where              |
|----------------------------------------------|------------------------|--------------------|
| the steps (model_fn, mesh, EMA, donation)    | ``StepBuilder``        | ``step_builder``   |
| the slice's devices, by name                 | libtpu                 | ``slice_devices``  |
| GPU targets: devices, fit verdict, costs     | JAX's CUDA plugin      | ``gpu_compile``    |
| abstract inputs, lowering, compiling         | this module            | ``compile_steps``  |
| per-chip HBM, bandwidth, peak bf16 FLOP/s    | ``TPU_CHIPS``          | ``chips`` (cited)  |
| the largest batch that fits, to 2%           | ``largest_batch``      | compiles, secant   |
| the batch as k micro-batches that fit        | ``accumulated_fit``    | compiles           |

The roofline (``max(flops / peak, bytes / bandwidth)``) is a lower bound on a step's time: it
ignores the overlap XLA cannot get, collectives between chips, the host's input, and the
layout padding of small channel counts. It says which resource bounds a step and how far from
it a measured step is; it is not a prediction of the measured speed.

GPU targets (``h100:8``: ``gpu_compile``) go the same way, with XLA's GPU compiler from JAX's
CUDA plugin, except that a step too big for the card still compiles: it fits if its total is
within the memory JAX may use less a margin for cuDNN's workspace (``gpu_compile.fit_error``),
and its flops and bytes come from XLA's cost analysis through the CPU client.

With gradient accumulation (``RunConfig.gradient_accumulation_steps = k``) the train step
compiled is the one that runs: the whole global batch is its input and its activations are one
micro-batch's (a k-th of it), so the memory reported is that of micro-batch ``b`` (plus the
input batch and a gradient accumulator). When a train step does not fit, the batch search
finds the largest that does and then asks whether the batch asked for fits as k micro-batches
(``accumulated_fit``: it compiles that step to be sure), e.g. "fits as 8 x 512".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimax.compile import gpu_compile
from estimax.compile.topologies import KNOWN_TOPOLOGIES, known_topologies  # noqa: F401 (re-exported)
from estimax.estimator.export import TensorSpec, check_input_specs
from estimax.estimator.step_builder import StepBuilder, Steps, micro_batch
from estimax.estimator.utilization import custom_call_targets  # noqa: F401 (re-exported)
from estimax.parallel import chips as chips_lib
from estimax.parallel import layouts as layouts_lib
from estimax.parallel import replication
from estimax.parallel.chips import TPU_CHIPS, ChipSpec  # noqa: F401 (ChipSpec: re-exported)
from estimax.parallel.replication import REPLICA_AXIS, per_replica_batch

GiB = 1 << 30


INSTALL_HINT = (
    "pip install -e '.[tpu]' in estimax's checkout (it is not on the package index), or run in "
    "the Makefile's .venv-tpu (make .venv-tpu/.installed-stamp)"
)
_TOPOLOGY = re.compile(r"^((?:v|tpu)\d+[a-z]?):(\d+(?:x\d+){1,2})$")


class CompileForError(ValueError):
    """A topology that cannot be used here (unknown, malformed, or no libtpu): one line."""


def check_topology(name: str) -> str:
    """Returns the chip of ``name`` (``v5e`` for ``v5e:2x4``, ``h100`` for ``h100:8``), or
    raises CompileForError."""
    if gpu_compile.is_gpu_target(name):
        try:
            return gpu_compile.check_gpu_target(name)[0]
        except gpu_compile.GpuTargetError as e:
            raise CompileForError(str(e)) from None
    match = _TOPOLOGY.match(name.strip())
    if not match or match.group(1) not in TPU_CHIPS:
        raise CompileForError(f"unknown TPU topology {name!r}: known are {known_topologies()}.")
    return match.group(1)


def slice_devices(name: str, num_slices: int = 1) -> list[Any]:
    """The (compile-only) devices of the TPU slice ``name``, e.g. ``v5e:2x4``: 8 chips; with
    ``num_slices`` S, of S such slices (libtpu's topology takes the count, as MaxText's
    ahead-of-time compile does), each device with its ``slice_index``.

    Raises:
      CompileForError: an unknown name, one libtpu refuses, or no libtpu installed.
    """
    check_topology(name)
    if gpu_compile.is_gpu_target(name):
        try:
            return gpu_compile.gpu_devices(name)
        except gpu_compile.GpuTargetError as e:
            raise CompileForError(str(e)) from None
    from jax.experimental import topologies

    # libtpu takes a lock file so that one process at a time drives a host's TPU chips; a
    # compile-only slice drives none, so processes compiling at once need not wait for it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        extra = {"num_slices": num_slices} if num_slices > 1 else {}
        return list(topologies.get_topology_desc(name.strip(), platform="tpu", **extra).devices)
    except RuntimeError as e:  # JaxRuntimeError is one too
        if "not installed" in str(e):
            raise CompileForError(
                f"compiling for {name} needs XLA's TPU compiler (libtpu): {INSTALL_HINT}."
            ) from None
        first = str(e).strip().splitlines()[0]
        if "lockfile" in first:  # ALLOW_MULTIPLE_LIBTPU_LOAD=0 in the environment
            raise CompileForError(
                f"libtpu is in use by another process ({first}); unset "
                "ALLOW_MULTIPLE_LIBTPU_LOAD or wait for it."
            ) from None
        raise CompileForError(
            f"libtpu refuses the topology {name!r} ({first}); known are {known_topologies()}."
        ) from None


@dataclasses.dataclass
class StepReport:
    """One step compiled for a slice: whether it fits, its memory and work per device.

    Memory and costs are per device (a TensorCore on v2-v4, a chip on v5e/v5p/v6e, a GPU); bytes
    are bytes. ``error`` holds the compiler's message when it did not fit (then the sizes are 0
    on a TPU; a GPU step too big still compiles, and its sizes say by how much).
    ``usable_bytes``: on a GPU, what a step may use of ``hbm_bytes`` (JAX's share less a
    margin for cuDNN's workspace; ``gpu_compile``); None on a TPU, where XLA itself refuses.
    """

    step: str
    topology: str
    device_kind: str
    num_devices: int
    devices_per_chip: int
    global_batch: int
    dtypes: str
    fits: bool
    compile_s: float
    hbm_bytes: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    peak_flops: float = 0.0
    hbm_bandwidth: float = 0.0
    xla_estimate_s: float | None = None
    custom_calls: tuple[str, ...] = ()  # custom-call targets lowered and compiled
    serialized_bytes: int | None = None  # the executable, serialized (loading it needs a TPU)
    serialize_s: float | None = None
    error: str | None = None
    search: BatchSearch | None = None  # when it does not fit and a search was asked for
    accumulation_steps: int = 1  # micro-batches per step (RunConfig.gradient_accumulation_steps)
    usable_bytes: float | None = None
    layout: str = ""  # the run's layout (layouts.Layout), "" for the data-parallel default
    # The compiled step's collectives: op -> [count, bytes of their results] per step.
    collectives: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # Over several slices (--num_slices): each slice named ("slice 0: devices 0-7 (8)"), and
    # the collectives whose replica groups cross slices (over DCN), as ``collectives``.
    slices: tuple[str, ...] = ()
    dcn_collectives: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def micro_batch(self) -> int:
        """The global micro-batch: the rows one pass of the model holds activations for."""
        return self.global_batch // self.accumulation_steps

    @property
    def memory_bytes(self) -> int:
        """Bytes a device holds while the step runs (donated outputs reuse their arguments)."""
        out = self.output_bytes - self.alias_bytes
        return self.argument_bytes + out + self.temp_bytes + self.code_bytes

    @property
    def roofline_s(self) -> float:
        """``max(flops / peak, bytes / bandwidth)``: no step can take less."""
        return max(self.flops / self.peak_flops, self.bytes_accessed / self.hbm_bandwidth)

    @property
    def examples_per_s(self) -> float:
        """Global examples per second at the roofline (an upper bound)."""
        return self.global_batch / self.roofline_s if self.roofline_s else 0.0

    @property
    def peak_source(self) -> str:
        """Where ``peak_flops`` comes from: the chip (by ``device_kind``), its cited page, and
        the per-chip peak it divides when a chip has several devices."""
        found = chips_lib.for_device(self.device_kind)
        if found is None:
            return f"no cited peak for {self.device_kind}"
        name, chip = found
        shared = (
            f": {chip.bf16_tflops:g} per chip / {self.devices_per_chip} devices"
            if self.devices_per_chip > 1
            else ""
        )
        return f"{name}{shared}, {chip.source}"

    def as_dict(self) -> dict[str, Any]:
        """The report with its derived figures, for JSON."""
        out = dataclasses.asdict(self)
        out["micro_batch"] = self.micro_batch
        # The peak the roofline (and a run's MFU) divides by, and where it is cited.
        out["peak_tflops_per_device"] = self.peak_flops / 1e12
        out["peak_source"] = self.peak_source
        if self.search is not None:
            out["search"]["exact"] = self.search.exact
            out["search"]["converged"] = self.search.converged
        if self.fits:
            out.update(
                memory_bytes=self.memory_bytes,
                roofline_s=self.roofline_s,
                examples_per_s=self.examples_per_s,
                examples_per_s_per_device=self.examples_per_s / self.num_devices,
                bound="compute"
                if self.flops / self.peak_flops >= self.bytes_accessed / self.hbm_bandwidth
                else "memory",
            )
        return out

    def line(self) -> str:
        """One line a person reads at a glance."""
        layout = f"; {self.layout}" if self.layout else ""
        head = (
            f"{self.step} step on {self.device_kind} x{self.num_devices} ({self.topology}; "
            f"global batch {self.global_batch:,}{_as_micro_batches(self)}, {self.dtypes}"
            f"{layout})"
        )
        if not self.fits:
            return f"{head}: does not fit: {self.error} (compiled in {self.compile_s:.0f} s)"
        t = self.roofline_s
        of = size_text(self.hbm_bytes)
        if self.usable_bytes is not None:
            of = (
                f"{size_text(self.usable_bytes)} usable ({gpu_compile.mem_fraction():.0%} of {of} "
                f"less {size_text(gpu_compile.CUDNN_WORKSPACE_MARGIN)} for cuDNN)"
            )
        return (
            f"{head}: fits: {size_text(self.memory_bytes)} of {of} per device "
            f"(args {size_text(self.argument_bytes)}, temp {size_text(self.temp_bytes)}, code "
            f"{size_text(self.code_bytes)}); {self.flops / 1e12:.3g} TFLOP, "
            f"{self.bytes_accessed / 1e9:.3g} GB per device per step; roofline >= "
            f"{_duration(t)}/step = {self.examples_per_s:,.0f} examples/s "
            f"({self.examples_per_s / self.num_devices:,.0f} per device) at a dense bf16 peak of "
            f"{self.peak_flops / 1e12:g} TFLOP/s per device ({self.peak_source}); "
            f"{_collectives(self.collectives)}{self._over_slices()}; compiled in "
            f"{self.compile_s:.0f} s"
        )

    def _over_slices(self) -> str:
        """``; 2 slices (slice 0: ..., slice 1: ...), over DCN: ...`` ("" on one slice)."""
        if not self.slices:
            return ""
        dcn = _collectives(self.dcn_collectives).replace("collectives ", "", 1)
        return f"; {len(self.slices)} slices ({', '.join(self.slices)}), over DCN: {dcn}"


def _collectives(found: dict[str, list[int]]) -> str:
    if not found:
        return "no collectives"
    return "collectives " + ", ".join(
        f"{n} {op} ({size_text(b)})" for op, (n, b) in sorted(found.items())
    )


def _as_micro_batches(report: StepReport) -> str:
    k = report.accumulation_steps
    return f" = {k} x {report.micro_batch:,} accumulated" if k > 1 else ""


def size_text(n: float) -> str:
    """Bytes as a report line writes them: ``4.6 GiB``, ``812 MiB``."""
    if n >= GiB / 10:
        return f"{n / GiB:.1f} GiB"
    return f"{n / (1 << 20):.3g} MiB"


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _abstract_batch(specs: Any, rows: int, sharding: Any = None) -> Any:
    """``ShapeDtypeStruct``s of ``rows`` examples of a ``TensorSpec`` pytree (batch dim None)."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((rows, *s.shape[1:]), s.dtype, sharding=sharding),
        specs,
        is_leaf=lambda x: isinstance(x, TensorSpec),
    )


def _placed(tree: Any, sharding: Any) -> Any:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def _inputs(
    steps: Steps, mesh: Mesh, io: tuple[Any, Any], batch: int, init: Callable[..., Any]
) -> tuple[Any, Any, Any, NamedSharding]:
    """(``init``'s output, features, labels, placed as the steps' layout places them (by
    default the state replicated and the batch over the replicas), and a replicated sharding)."""
    features, labels = io
    layout, replicas = steps.layout, layouts_lib.num_replicas(mesh)
    rows = batch // replicas
    replicas = layouts_lib.replicas_per_slice(mesh)  # what FSDP splits over
    sample = (_abstract_batch(features, rows), _abstract_batch(labels, rows))
    replicated = NamedSharding(mesh, P())
    shapes = jax.eval_shape(init, steps.rng, *sample)
    if layout.is_default:
        state = _placed(shapes, replicated)
    else:
        specs = (
            layout.state_specs(shapes, replicas)
            if init is steps.init
            else layout.variables_specs(shapes, replicas)
        )
        state = jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=NamedSharding(mesh, spec)
            ),
            shapes,
            specs,
        )
    batch_features = _abstract_batch(features, batch)
    batch_labels = _abstract_batch(labels, batch)
    f_specs, l_specs = layout.input_specs(batch_features, batch_labels)

    def put(tree: Any, specs: Any) -> Any:
        return jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=NamedSharding(mesh, spec)
            ),
            tree,
            specs,
        )

    return state, put(batch_features, f_specs), put(batch_labels, l_specs), replicated


def train_args(steps: Steps, mesh: Mesh, io: tuple[Any, Any], batch: int) -> tuple[Any, ...]:
    """Abstract ``(state, rng, features, labels)`` of ``steps.train`` at global ``batch``."""
    state, features, labels, replicated = _inputs(steps, mesh, io, batch, steps.init)
    rng = jax.ShapeDtypeStruct(steps.rng.shape, steps.rng.dtype, sharding=replicated)
    return state, rng, features, labels


def eval_args(steps: Steps, mesh: Mesh, io: tuple[Any, Any], batch: int) -> tuple[Any, ...]:
    """Abstract ``(totals, variables, step, features, labels, mask)`` of ``steps.eval``."""
    variables, features, labels, replicated = _inputs(steps, mesh, io, batch, steps.init_eval)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    sharded = NamedSharding(mesh, P(replication.data_axes(mesh)))
    inputs = (features, labels, jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=sharded))
    # The steady state: the running totals (donated) are what the first batch returns.
    totals, _ = jax.eval_shape(steps.eval, None, variables, step, *inputs)
    return (_placed(totals, replicated), variables, step, *inputs)


def lower(step: str, steps: Steps, mesh: Mesh, io: tuple[Any, Any], batch: int) -> Any:
    """``jax.stages.Lowered`` of the ``step`` ('train' or 'eval') on ``mesh`` at ``batch``."""
    if step == "train":
        return steps.train.lower(*train_args(steps, mesh, io, batch))
    return steps.eval.lower(*eval_args(steps, mesh, io, batch))


_MATMUL = re.compile(r"stablehlo\.(?:convolution|dot_general)\b.*->\s*tensor<[^>]*x(\w+)>")


def compute_dtypes(stablehlo: str) -> str:
    """The element types of a program's convolutions and matmuls, most frequent first."""
    counts: dict[str, int] = {}
    for line in stablehlo.splitlines():
        match = _MATMUL.search(line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return "+".join(sorted(counts, key=lambda k: -counts[k])) or "no matmuls"


def devices_per_chip(devices: list[Any]) -> int:
    """How many of a topology's devices share one chip (2 TensorCores on v2/v3/v4, else 1)."""
    chips = {tuple(d.coords) for d in devices}
    return max(1, len(devices) // len(chips))


# ``build(mesh, step, global_batch, accumulation_steps)``: the Estimator's steps on ``mesh``.
Build = Callable[[Mesh, str, int, int], Steps]


def compile_for(
    build: Build,
    topology: str,
    io: tuple[Any, Any],
    batch_sizes: dict[str, int],
    num_shards: int | None = None,
    search: bool = False,
    accumulation_steps: int = 1,
    layout: layouts_lib.Layout | None = None,
) -> list[StepReport]:
    """Compiles each step of ``batch_sizes`` (``{"train": 1024, "eval": 1024}``) for a slice.

    Args:
      build: ``build(mesh, step, global_batch, accumulation_steps) -> Steps``: the
        Estimator's steps on that mesh.
      topology: the slice, e.g. ``v5e:2x4``.
      io: ``(features, labels)``, ``TensorSpec`` pytrees of a batch (batch dimension None).
      batch_sizes: the global batch of each step to compile.
      num_shards: replicas: the first ``num_shards`` devices (default: all of the slice's).
      search: for a step that does not fit, look for the largest batch that does (compiles),
        and for a train step whether its batch fits as more micro-batches
        (``accumulated_fit``).
      accumulation_steps: the train step's micro-batches (``gradient_accumulation_steps``).
      layout: the steps' layout (``layouts.Layout``: a replica's cores, input splits, FSDP);
        the mesh is ``(replicas, *cores)`` over the slice's devices, as in a run.

    Raises:
      CompileForError: the topology cannot be used here, a replica's cores do not divide its
        devices, or a batch does not divide over the replicas or into the micro-batches (the
        message suggests one that does).
    """
    features, labels = io
    check_inputs(features, labels)
    layout = layout or layouts_lib.Layout()
    cores = layout.cores_per_replica
    slices = layout.num_slices
    if slices > 1 and gpu_compile.is_gpu_target(topology):
        raise CompileForError(
            f"--num_slices={slices} is for TPU slices (over DCN); {topology} is a GPU target."
        )
    devices = slice_devices(topology, slices)
    if len(devices) % (cores * slices):
        raise CompileForError(
            f"on {topology}: --num_cores_per_replica={cores} (RunConfig.num_cores_per_replica) "
            f"does not divide its {len(devices) // slices} devices: use a divisor of "
            f"{len(devices) // slices}."
        )
    if num_shards and num_shards * cores < len(devices):
        if slices > 1:  # the same number of replicas from each slice
            try:
                mesh = replication.make_mesh(
                    num_shards, layout.cores, layout.model_axes, slices, devices
                )
            except ValueError as e:
                raise CompileForError(f"on {topology}: {e}") from None
            devices = list(mesh.devices.flat)
        else:
            devices = devices[: num_shards * cores]
    replicas = len(devices) // cores
    reports = []
    for step, batch in batch_sizes.items():
        k = accumulation_steps if step == "train" else 1
        try:
            per_replica_batch(batch, replicas, f"{step}_batch_size")
            micro_batch(batch, replicas, k)
        except ValueError as e:
            raise CompileForError(f"on {topology}: {e}") from None
        compile_one = functools.partial(
            compile_step,
            step,
            build,
            devices,
            topology,
            features=features,
            labels=labels,
            layout=layout,
        )
        report = compile_one(batch=batch, accumulation_steps=k)
        if search and not report.fits:
            probe = functools.partial(_at_batch, compile_one, k)
            report.search = largest_batch(probe, report, replicas * k)
            if step == "train" and report.search.fits:
                report.search = accumulated_fit(compile_one, report, report.search)
        reports.append(report)
    return reports


def _at_batch(compile_one: Callable[..., StepReport], k: int, batch: int) -> StepReport:
    return compile_one(batch=batch, accumulation_steps=k)


def accumulated_fit(
    compile_one: Callable[..., StepReport], failed: StepReport, found: BatchSearch, tries: int = 2
) -> BatchSearch:
    """``found`` with the micro-batch count at which ``failed``'s global batch fits, if any.

    A candidate k splits each replica's batch evenly and makes the global micro-batch at most
    the largest batch found to fit (``found.fits`` at ``failed``'s k). The input batch and a
    gradient accumulator still take memory at the whole batch, so each candidate (the smallest
    first, at most ``tries``) is compiled to be sure.
    """
    assert found.fits is not None
    batch, k = failed.global_batch, failed.accumulation_steps
    per_replica = batch // failed.num_devices
    fitting_micro = found.fits // k
    candidates = [
        d
        for d in range(k + 1, per_replica + 1)
        if per_replica % d == 0 and batch // d <= fitting_micro
    ]
    compiles = found.compiles
    for candidate in candidates[:tries]:
        report = compile_one(batch=batch, accumulation_steps=candidate)
        compiles += 1
        logging.info(
            "batch search: global batch %d as %d x %d %s",
            batch,
            candidate,
            batch // candidate,
            "fits" if report.fits else "does not fit",
        )
        if report.fits:
            return dataclasses.replace(
                found,
                compiles=compiles,
                accumulated=candidate,
                accumulated_bytes=report.memory_bytes,
            )
    return dataclasses.replace(found, compiles=compiles)


def compile_step(
    step: str,
    build: Build,
    devices: list[Any],
    topology: str,
    accumulation_steps: int = 1,
    layout: layouts_lib.Layout | None = None,
    **io: Any,
) -> StepReport:
    """Compiles the ``step`` ('train' or 'eval') at ``io['batch']`` for ``devices``.

    Args:
      step: which step.
      build: ``build(mesh, step, global_batch, accumulation_steps) -> Steps``: the Estimator's
        steps on that mesh.
      devices: the mesh's devices (a slice's, or the first ``num_shards`` of them).
      topology: the slice's name, for the report.
      accumulation_steps: the train step's micro-batches per step.
      layout: the steps' layout (default: data parallel, one device per replica).
      io: ``features``, ``labels`` (``TensorSpec`` pytrees, batch dim None) and ``batch``.
    """
    layout = layout or layouts_lib.Layout()
    if layout.num_slices > 1:  # ("dcn", "data", *model axes): JAX's hybrid mesh
        mesh = replication.make_mesh(
            None, layout.cores, layout.model_axes, layout.num_slices, devices
        )
    else:
        grid = np.array(devices).reshape(len(devices) // layout.cores_per_replica, *layout.cores)
        mesh = Mesh(grid, (REPLICA_AXIS, *layout.model_axes))
    batch = io["batch"]
    gpu = gpu_compile.is_gpu_target(topology)
    name = check_topology(topology)
    chip = gpu_compile.chip(name) if gpu else TPU_CHIPS[name]
    per_chip = 1 if gpu else devices_per_chip(devices)
    report = StepReport(
        step=step,
        topology=topology,
        device_kind=devices[0].device_kind,
        num_devices=len(devices),
        devices_per_chip=per_chip,
        global_batch=batch,
        dtypes="",
        fits=False,
        compile_s=0.0,
        accumulation_steps=accumulation_steps,
        layout=layout.describe(),
        # A GPU's memory as its description gives it to the compiler (chips.py agrees to 1%).
        hbm_bytes=gpu_compile.device_memory_bytes(name) if gpu else chip.hbm_gib * GiB / per_chip,
        peak_flops=chip.bf16_tflops * 1e12 / per_chip,
        hbm_bandwidth=chip.hbm_gbps * 1e9 / per_chip,
    )
    if gpu:
        report.usable_bytes = gpu_compile.usable_bytes(report.hbm_bytes)
    start = time.perf_counter()
    steps = build(mesh, step, batch, accumulation_steps)
    lowered = lower(step, steps, mesh, (io["features"], io["labels"]), batch)
    stablehlo = lowered.as_text()
    report.dtypes = compute_dtypes(stablehlo)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        missing = gpu_compile.compile_error(topology, e) if gpu else None
        if missing:
            raise CompileForError(str(missing)) from None
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        report.compile_s = time.perf_counter() - start
        report.error = " ".join(str(e).replace("RESOURCE_EXHAUSTED:", "").split())
        return report
    report.compile_s = time.perf_counter() - start
    _fill(report, compiled)
    if gpu:
        _judge_gpu_fit(report, lowered, compiled)
    text = compiled.as_text()
    report.custom_calls = custom_call_targets(stablehlo + text)
    report.collectives = collectives(text)
    if layout.num_slices > 1:
        # Replica groups name devices by their place in the mesh (its device assignment).
        slice_of = [d.slice_index for d in mesh.devices.flat]
        report.slices = slice_names(slice_of)
        report.dcn_collectives = collectives(text, slice_of)
    _measure_serialized(report, compiled)
    return report


# XLA's collective ops as compiled HLO names them (async ones as their -start half).
_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute|collective-broadcast)(?:-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def collectives(hlo: str, slice_of: list[int] | None = None) -> dict[str, list[int]]:
    """``{op: [count, bytes]}`` of the collectives in compiled HLO text: each op's count per
    step (a loop body's once) and the bytes of the arrays it produces. With ``slice_of`` (the
    slice of each device, by its id in the replica groups): only those that go over DCN:
    XLA:TPU compiles each slice's program with its collectives inside the slice and hands what
    crosses slices to the Megascale runtime (a ``send`` per collective, its kind and payload
    named), and another compiler's collectives whose groups (or a permute's pairs) cross."""
    found: dict[str, list[int]] = {}
    for line in hlo.splitlines():
        dcn = _MEGASCALE.search(line) if slice_of is not None else None
        if dcn is not None:
            entry = found.setdefault(dcn["kind"].lower().replace("_", "-"), [0, 0])
            entry[0] += 1
            first = _ARRAY.search(dcn["shape"])
            if first is not None:
                dtype, dims = first.groups()
                size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
                entry[1] += size * _dtype_bytes(dtype)
            continue
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        if slice_of is not None and not _crosses_slices(line, slice_of):
            continue
        entry = found.setdefault(m["op"], [0, 0])
        entry[0] += 1
        for dtype, dims in _ARRAY.findall(m["shape"]):
            size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            entry[1] += size * _dtype_bytes(dtype)
    return found


# A DCN collective in XLA:TPU's multi-slice HLO: its payload handed to the Megascale runtime.
_MEGASCALE = re.compile(
    r"=\s*(?P<shape>.*?)\s+send\(.*_xla_megascale_transfer_type=\"(?P<kind>\w+)\""
)
_GROUPS = re.compile(r"replica_groups=(\{[\d,{}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_IOTA = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=(\{[\d,{}]*\})")


def replica_groups(text: str) -> list[list[int]]:
    """HLO's ``replica_groups`` as lists of device ids: ``{{0,1},{2,3}}``, or the iota form
    ``[2,8]<=[16]`` / ``[8,2]<=[2,8]T(1,0)`` (an iota of the bracketed shape, transposed,
    reshaped to groups); ``{}`` (every device in one group) is ``[]``."""
    if text.startswith("{"):
        groups = re.findall(r"\{([\d,]+)\}", text)
        return [[int(i) for i in g.split(",") if i] for g in groups]
    iota = _IOTA.fullmatch(text)
    if iota is None:
        raise ValueError(f"not HLO replica groups: {text[:80]!r}")

    def ints(t: str) -> list[int]:
        return [int(i) for i in t.split(",")]

    ids = np.arange(math.prod(ints(iota["dims"]))).reshape(ints(iota["dims"]))
    if iota["perm"]:
        ids = ids.transpose(ints(iota["perm"]))
    return ids.reshape(ints(iota["shape"])).tolist()


def _crosses_slices(line: str, slice_of: list[int]) -> bool:
    """Whether the collective on ``line`` moves data between slices (over DCN)."""
    pairs = _PAIRS.search(line)
    if pairs:
        return any(slice_of[a] != slice_of[b] for a, b in replica_groups(pairs.group(1)))
    groups = _GROUPS.search(line)
    found = replica_groups(groups.group(1)) if groups else []
    if not found:  # no groups, or {}: one group of every device
        return len(set(slice_of)) > 1
    return any(len({slice_of[i] for i in g}) > 1 for g in found)


def slice_names(slice_of: list[int]) -> tuple[str, ...]:
    """Each slice as a report names it: ``slice 0: devices 0-7 (8)``, by the devices' places in
    the mesh."""
    names = []
    for s in sorted(set(slice_of)):
        ids = [i for i, x in enumerate(slice_of) if x == s]
        span = f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)
        names.append(f"slice {s}: devices {span} ({len(ids)})")
    return tuple(names)


def _dtype_bytes(name: str) -> int:
    if name == "pred":
        return 1
    bits = re.search(r"\d+", name)
    return max(1, int(bits.group()) // 8) if bits else 4


def _measure_serialized(report: StepReport, compiled: Any) -> None:
    """How big the executable is serialized, and how long that takes (None where it cannot)."""
    from jax.experimental import serialize_executable

    start = time.perf_counter()
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
    except (RuntimeError, ValueError, TypeError):  # a backend without serialization
        return
    report.serialize_s = time.perf_counter() - start
    report.serialized_bytes = len(payload)


def _fill(report: StepReport, compiled: Any) -> None:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jaxlibs: one dict per program
    cost = cost or {}  # None on XLA:GPU (UNIMPLEMENTED): _judge_gpu_fit counts instead
    report.fits = True
    report.argument_bytes = int(memory.argument_size_in_bytes)
    report.output_bytes = int(memory.output_size_in_bytes)
    report.alias_bytes = int(memory.alias_size_in_bytes)
    report.temp_bytes = int(memory.temp_size_in_bytes)
    report.code_bytes = int(memory.generated_code_size_in_bytes)
    # XLA's cost analysis counts a loop's body once; an accumulated step runs its micro-batch
    # body k times (the update after the loop, counted k times too, is small beside it).
    k = report.accumulation_steps
    report.flops = k * float(cost.get("flops", 0.0))
    report.bytes_accessed = k * float(cost.get("bytes accessed", 0.0))
    # XLA:TPU's own estimate of the step's time, where its cost model gives one.
    estimate = cost.get("optimal_seconds")
    report.xla_estimate_s = float(estimate) if estimate and estimate > 0 else None


def _judge_gpu_fit(report: StepReport, lowered: Any, compiled: Any) -> None:
    """A GPU step's costs (its executable has no cost analysis) and whether it fits: XLA:GPU
    compiles a step too big for the card (measured: 304 GiB per device on an 80 GB H100)."""
    flops, bytes_accessed = gpu_compile.step_costs(lowered, compiled)
    # As in _fill: the cost analysis counts an accumulation loop's body once.
    report.flops = report.accumulation_steps * flops
    report.bytes_accessed = report.accumulation_steps * bytes_accessed
    report.error = gpu_compile.fit_error(report.memory_bytes, report.hbm_bytes)
    report.fits = report.error is None


def check_inputs(features: Any, labels: Any) -> None:
    """Refuses inputs that are not ``TensorSpec`` pytrees with a None batch dimension."""
    check_input_specs(features)
    if labels is not None:
        check_input_specs(labels)


# The batch search stops once a batch fits and one at most 2% larger does not: 2% of the batch
# is within a step's run-to-run spread, and each try near the limit is a full compile (2 to
# 3 min for ResNet-50 on v5e, 5 min for ResNet-18 at 305,832 examples, on 2 busy CPU cores).
TOLERANCE = 0.02


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """What ``largest_batch`` found: ``fits`` fits (None: no batch tried did), ``fails`` (the
    smallest tried that does not) does not, so the largest batch that fits is in
    ``[fits, fails)``; ``multiple``: the step between batches; ``tolerance``: the relative
    width of that bracket at which the search stops. ``accumulated``: a micro-batch count at
    which the batch asked for fits (``accumulated_fit``; None: none found or not tried), using
    ``accumulated_bytes`` per device."""

    fits: int | None
    fails: int
    multiple: int
    compiles: int
    tolerance: float = TOLERANCE
    accumulated: int | None = None
    accumulated_bytes: int = 0

    @property
    def exact(self) -> bool:
        """Whether ``fits`` is the largest (the next multiple does not fit)."""
        return self.fits is not None and self.fails - self.fits <= self.multiple

    @property
    def converged(self) -> bool:
        """Whether ``fits`` is within ``tolerance`` of the largest batch that fits (or exact)."""
        return self.fits is not None and _narrow(
            self.fits, self.fails, self.multiple, self.tolerance
        )


_SIZE = re.compile(r"([\d.]+)\s*([KMGT])i?B?\b")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def oom_sizes(message: str) -> tuple[float, float] | None:
    """(required, available) bytes from the TPU compiler's out-of-memory message, if it says."""
    sizes = [float(v) * _UNITS[u] for v, u in _SIZE.findall(message)]
    if len(sizes) < 2 or "available" not in message:
        return None
    return sizes[0], sizes[-1]


def largest_batch(
    probe: Callable[[int], StepReport],
    failed: StepReport,
    multiple: int,
    tolerance: float = TOLERANCE,
    max_compiles: int = 16,
) -> BatchSearch:
    """The largest global batch (a multiple of ``multiple``) below ``failed``'s that fits, to
    within ``tolerance``: a batch that fits and one that does not, at most ``tolerance`` (or
    one multiple) larger.

    Each try is where the line through two measurements meets the memory available
    (``_next_guess``), but at least ``tolerance`` of the fitting batch inside the bracket
    ``(fits, fails)``, so no try creeps; where the line proves wrong, the bracket's middle.

    Compiles: never more than ``max_compiles``. Once ``b`` fits and ``B`` does not, every four
    compiles at least halve ``log(fails / fits)`` (every two where the line proves wrong), so
    at most ``4 * ceil(log2(log(B / b) / log(1 + tolerance)))`` more follow (28 from 266,408
    and 1,048,576 at 2%: the cap comes first). On the tests' memory curves: 4 or 5 where
    memory is linear, at most 11 on issue 40's (fits measured above the memory the errors call
    available), 9.8 on average over random linear ones. A failure costs seconds (at memory
    assignment), a fit minutes: most of a search's time is its fits.
    """
    points: dict[int, float] = {}  # batch -> bytes (needed, or used)
    available = failed.hbm_bytes
    sizes = oom_sizes(failed.error or "")
    if sizes:
        points[failed.global_batch], available = sizes
    lo, hi, compiles, fits_in_row, bisect = 0, failed.global_batch, 0, 0, False
    # Line tries in a row that the least step moved and that landed where the line said they
    # would not (a fit above it, a failure below it): the line is wrong on that side, as when
    # fits measure more than the memory the errors call available (issue 40), and that side's
    # least step doubles with each ("grow geometrically").
    undershot = overshot = 0
    slow = 0  # tries in a row that did not halve the bracket
    while compiles < max_compiles and not _narrow(lo, hi, multiple, tolerance):
        line = guess = _middle(lo, hi, multiple)
        if not bisect:
            # Aim 2% low until something fits: a fit is worth minutes of compiling.
            target = available if lo else 0.98 * available
            line = _next_guess(points, target, lo, hi, multiple, hi_weight=0.5**fits_in_row)
            guess = _inside(line, lo, hi, multiple, tolerance, 2**undershot, 2**overshot)
        report = probe(guess)
        compiles += 1
        before = (lo, hi)
        if report.fits:
            lo, points[guess] = guess, float(report.memory_bytes)
            fits_in_row += 1
        else:
            hi, fits_in_row = guess, 0
            sizes = oom_sizes(report.error or "")
            if sizes:
                points[guess] = sizes[0]
        if not bisect:
            undershot = undershot + 1 if report.fits and guess > line else 0
            overshot = overshot + 1 if not report.fits and guess < line else 0
        logging.info(
            "batch search: global batch %d %s (%s); the largest that fits is in [%d, %d)",
            guess,
            "fits" if report.fits else "does not fit",
            size_text(report.memory_bytes) if report.fits else (report.error or "")[:120],
            lo,
            hi,
        )
        # A bisection halves the bracket. It follows a line try that did not, if the line
        # was wrong (moved by the least step, or it failed where it aimed at the limit); a
        # fit where the line aimed is not wrong, only far from a distant failure (the batch
        # asked for), and the next try tests it. Three slow tries in a row: bisect anyway.
        slow = 0 if bisect or _halved(before, (lo, hi)) else slow + 1
        bisect = slow >= 3 or (slow >= 1 and (guess != line or not report.fits))
    return BatchSearch(
        fits=lo or None, fails=hi, multiple=multiple, compiles=compiles, tolerance=tolerance
    )


def _narrow(lo: int, hi: int, k: int, tolerance: float) -> bool:
    """Whether the bracket [lo, hi) is one multiple of ``k`` wide, or ``tolerance`` of ``lo``."""
    return hi - lo <= max(k, tolerance * lo)


def _halved(before: tuple[int, int], after: tuple[int, int]) -> bool:
    """Whether a try halved the bracket: ``log(hi / lo)``, or ``hi`` while nothing fits."""
    (lo0, hi0), (lo1, hi1) = before, after
    if not lo1:
        return hi1 <= hi0 / 2
    if not lo0:
        return True  # the first fit: the bracket is finite now
    return math.log(hi1 / lo1) <= math.log(hi0 / lo0) / 2


def _inside(guess: int, lo: int, hi: int, k: int, tolerance: float, up: int, down: int) -> int:
    """``guess`` kept a least step from both ends of (lo, hi), so that a fit moves ``lo`` and a
    failure moves ``hi`` by that much at least (two fits near the limit whose line points just
    past the last one crept up 8 examples a compile, ~5 min each, from 305,832: issue 40).

    The step is ``tolerance`` of ``lo`` (rounded down to a multiple of ``k``, at least ``k``):
    ``up`` of them above ``lo`` and ``down`` below ``hi``, each cut back to leave one step at
    the other end. Where two steps do not fit in the bracket, its middle.
    """
    step = max(k, int(tolerance * lo) // k * k)
    if lo + step > hi - step:
        return _middle(lo, hi, k)
    low = min(lo + step * up, hi - step)
    high = max(hi - step * down, lo + step)
    return min(high, max(low, guess)) if low <= high else _middle(lo, hi, k)


def _next_guess(
    points: dict[int, float], available: float, lo: int, hi: int, k: int, hi_weight: float = 1.0
) -> int:
    """The batch, a multiple of ``k``, where memory is predicted to reach ``available``.

    Where the line through two measurements reaches ``available``: the two largest batches that
    fit, else those at ``lo`` and ``hi``, else (no fit yet) ``hi``'s and the next larger failed
    one's, else ``hi``'s and zero. The middle of (lo, hi) when nothing is measured. May lie
    outside (lo, hi): the caller keeps it inside (``_inside``).

    Fits are preferred, and ``hi_weight`` scales ``hi``'s excess over ``available`` (the
    Illinois method), because an out-of-memory error states what the step needs before XLA
    rematerialises to fit, which can be many times what a fitting batch uses: the line from it
    then creeps up from ``lo`` a small step per compile (measured: ResNet-50 on v5e from 65,536,
    8 compiles up to 7,192 without ever bracketing the limit).
    """
    fits = sorted(b for b in points if b <= lo)
    if len(fits) >= 2:
        (b1, m1), (b2, m2) = ((b, points[b]) for b in fits[-2:])
        if m2 > m1:
            return _positive(_line_reaches(b1, m1, b2, m2, available, k), lo, hi, k)
    if hi not in points:
        return _middle(lo, hi, k)
    if lo in points:
        b1, m1 = lo, points[lo]
    else:
        above = [b for b in points if b > hi]
        b1, m1 = (min(above), points[min(above)]) if above else (0, 0.0)
    b2, m2 = hi, available + (points[hi] - available) * hi_weight
    if b1 != b2 and (m2 - m1) / (b2 - b1) > 0:
        return _positive(_line_reaches(b1, m1, b2, m2, available, k), lo, hi, k)
    return hi - k


def _positive(guess: int, lo: int, hi: int, k: int) -> int:
    """``guess``, or the middle of (lo, hi) where the line reaches the memory available at no
    batch at all: two errors that overstate the need (weights included) make such a line,
    and a try at one multiple from it is a wasted compile."""
    return guess if guess > 0 else _middle(lo, hi, k)


def _line_reaches(b1: int, m1: float, b2: int, m2: float, target: float, k: int) -> int:
    """The batch (rounded down to a multiple of ``k``) where the line through (b1, m1) and
    (b2, m2) reaches ``target`` bytes."""
    return int(b2 + (target - m2) * (b2 - b1) / (m2 - m1)) // k * k


def _middle(lo: int, hi: int, k: int) -> int:
    """The middle of the bracket (lo, hi), a multiple of ``k`` inside it: geometric (the
    bracket's ratio is what the search narrows), or ``hi / 2`` while nothing fits."""
    middle = math.isqrt(lo * hi) if lo else hi // 2
    return min(hi - k, max(lo + k, middle // k * k))


def needed_bytes(report: StepReport) -> float:
    """Bytes per device the step needs: what it holds, or for a TPU step that does not fit
    (its sizes are 0) what the compiler's message says it needed (0 if it does not say)."""
    if report.memory_bytes:
        return float(report.memory_bytes)
    sizes = oom_sizes(report.error or "")
    return sizes[0] if sizes else 0.0


def describe_failure(report: StepReport) -> str:
    """One line: a step that does not fit, and what the batch search found (if it ran)."""
    head = (
        f"the {report.step} step does not fit on {report.topology} at global batch "
        f"{report.global_batch:,}{_as_micro_batches(report)}"
    )
    search = report.search
    if search is None:
        return f"{head}: {report.error}"
    tries = f"{search.compiles} compile{'s' if search.compiles != 1 else ''}"
    if search.fits is None:
        return (
            f"{head}, nor at {search.fails:,} ({tries}): the model's weights and "
            "state alone may not fit there."
        )
    gap = _percent_up((search.fails - search.fits) / search.fits)
    if search.exact:
        found = (
            f"{head}: the largest global batch that fits is {search.fits:,} ({search.fails:,} "
            f"does not; found in {tries})"
        )
    elif search.converged:
        found = (
            f"{head}: a global batch of {search.fits:,} fits and {search.fails:,} does not "
            f"(within {gap} of the largest that fits; found in {tries})"
        )
    else:
        found = (
            f"{head}: a global batch of {search.fits:,} fits and {search.fails:,} does not (the "
            f"largest is between them, {gap} apart: not narrowed to "
            f"{search.tolerance * 100:g}% in {tries})"
        )
    k = search.accumulated
    if k is None:
        return f"{found}."
    micro = report.global_batch // k
    return (
        f"{found}; {report.global_batch:,} fits as {k} x {micro:,} "
        f"(--gradient_accumulation_steps={k}: {size_text(search.accumulated_bytes)} per device)."
    )


def _percent_up(fraction: float) -> str:
    """``fraction`` as a percentage rounded up to 0.1% (a bound stays true when printed)."""
    return f"{math.ceil(fraction * 1000 - 1e-9) / 10:.1f}%"


def compile_estimator(
    estimator: Any, topology: str, features: Any, labels: Any = None, **options: Any
) -> list[StepReport]:
    """Compiles an Estimator's train and eval steps for a Cloud TPU slice (or a GPU target),
    on any host (``compile_for``, with the Estimator's step builder and batch sizes).

    The steps ``train``/``evaluate`` would run (this ``model_fn``, its EMA and precision,
    the donated state, each batch size's per-replica shapes) on a mesh over the slice's devices.

    Args:
      estimator: the ``Estimator`` whose steps to compile.
      topology: e.g. ``v5e:2x4`` (``KNOWN_TOPOLOGIES``).
      features, labels: ``TensorSpec`` pytrees of a batch (batch dimension None).
      **options: ``num_shards`` (default ``config.num_shards``), ``search`` (look for the
        largest batch that fits when a step does not), ``accumulation_steps`` (default
        ``config.gradient_accumulation_steps``: the train step's memory is a micro-batch's),
        ``layout_config`` (a RunConfig whose ``num_cores_per_replica``,
        ``input_partition_dims`` and ``shard_parameters`` the steps are built under,
        default the Estimator's; the slice's layout need not fit this host's devices).

    Returns:
      a ``StepReport`` per step whose global batch size was given to the Estimator.
    """
    config = estimator.config
    options.setdefault("num_shards", config.num_shards)
    options.setdefault("accumulation_steps", config.gradient_accumulation_steps)
    builder: StepBuilder = estimator.step_builder
    layout_config = options.pop("layout_config", None)
    if layout_config is not None:
        # The slice's layout, which this host's devices need not be able to hold.
        builder = StepBuilder(builder.model_fn, builder.params, layout_config)
    options.setdefault("layout", builder.layout)  # the run's cores, splits, FSDP
    all_sizes = estimator.batch_sizes
    batches = {m: all_sizes[m] for m in ("train", "eval") if all_sizes[m] is not None}

    def build(mesh: Any, mode: str, batch: int, accumulation_steps: int | None = None) -> Steps:
        return builder.build(mesh, {**all_sizes, mode: batch}, accumulation_steps)

    return compile_for(build, topology, (features, labels), batches, **options)
