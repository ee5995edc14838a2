"""Compiling an Estimator's steps for a Cloud TPU slice on a machine that has none.

XLA's TPU compiler ships in ``libtpu`` (the ``tpu`` extra) and runs on any Linux x86-64 host:
``jax.experimental.topologies.get_topology_desc`` gives the devices of a slice by name
(``v5e:2x4``), a mesh over them lowers the same ``jit`` an Estimator runs, and the compiled
executable says what it needs per device (``memory_analysis()``: arguments, temporaries, code)
and does per step (``cost_analysis()``: flops, bytes accessed). A program that does not fit
fails to compile with the compiler's RESOURCE_EXHAUSTED, as it would on the hardware.

Who owns what:

| piece                                        | owner                  | where              |
|----------------------------------------------|------------------------|--------------------|
| the steps (model_fn, mesh, EMA, donation)    | ``Estimator``          | ``compile_for``    |
| the slice's devices, by name                 | libtpu                 | ``slice_devices``  |
| abstract inputs, lowering, compiling         | this module            | ``compile_steps``  |
| per-chip HBM, bandwidth, peak bf16 FLOP/s    | ``TPU_CHIPS``          | below (cited)      |
| the largest batch that fits                  | ``largest_batch``      | compiles, secant   |

The roofline (``max(flops / peak, bytes / bandwidth)``) is a lower bound on a step's time: it
ignores the overlap XLA cannot get, collectives between chips, the host's input, and the
layout padding of small channel counts. It says which resource bounds a step and how far from
it a measured step is; it is not a prediction of the measured speed.
"""

from __future__ import annotations

import dataclasses
import functools
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

from estimax.estimator.export import TensorSpec, check_input_specs
from estimax.estimator.replication import REPLICA_AXIS, per_replica_batch

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One TPU generation's published per-chip figures.

    Attributes:
      hbm_gib: HBM per chip (GiB).
      hbm_gbps: HBM bandwidth per chip (GB/s, 1e9 bytes).
      bf16_tflops: peak bfloat16 compute per chip (1e12 FLOP/s).
      source: the public page the figures come from.
    """

    hbm_gib: float
    hbm_gbps: float
    bf16_tflops: float
    source: str


# Per chip, as Google publishes them. A "device" of a topology is a TensorCore on v2/v3/v4
# (two per chip: libtpu's v4:2x2x1 has 8 devices) and a chip on v5e/v5p/v6e; per-device figures
# divide by the devices per chip, counted from the topology itself.
TPU_CHIPS: dict[str, ChipSpec] = {
    # The v2 page links its figures to Jouppi et al., "A Domain-Specific Supercomputer for
    # Training Deep Neural Networks", CACM 63(7), 2020, Table 3: 46 TFLOPS, 16 GiB, 700 GB/s.
    "v2": ChipSpec(16, 700, 46, "https://cloud.google.com/tpu/docs/v2"),
    "v3": ChipSpec(32, 900, 123, "https://cloud.google.com/tpu/docs/v3"),
    "v4": ChipSpec(32, 1200, 275, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": ChipSpec(16, 819, 197, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipSpec(95, 2765, 459, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": ChipSpec(32, 1638, 918, "https://cloud.google.com/tpu/docs/v6e"),
}
# One single-host slice of each generation (libtpu takes any GEN:AxB[xC] it knows).
KNOWN_TOPOLOGIES = ("v2:2x2", "v3:2x2", "v4:2x2x1", "v5e:2x4", "v5p:2x2x1", "v6e:2x4")
INSTALL_HINT = (
    "pip install -e '.[tpu]' in estimax's checkout (it is not on the package index), or run in "
    "the Makefile's .venv-tpu (make .venv-tpu/.installed-stamp)"
)
_TOPOLOGY = re.compile(r"^(v\d+[a-z]?):(\d+(?:x\d+){1,2})$")


class CompileForError(ValueError):
    """A topology that cannot be used here (unknown, malformed, or no libtpu): one line."""


def known_topologies() -> str:
    """The topology names to offer a user, as one phrase."""
    return (
        f"{', '.join(KNOWN_TOPOLOGIES)} (or any GEN:AxB[xC] slice of "
        f"{', '.join(TPU_CHIPS)} that libtpu knows)"
    )


def check_topology(name: str) -> str:
    """Returns the generation of ``name`` (``v5e`` for ``v5e:2x4``), or raises CompileForError."""
    match = _TOPOLOGY.match(name.strip())
    if not match or match.group(1) not in TPU_CHIPS:
        raise CompileForError(f"unknown TPU topology {name!r}: known are {known_topologies()}.")
    return match.group(1)


def slice_devices(name: str) -> list[Any]:
    """The (compile-only) devices of the TPU slice ``name``, e.g. ``v5e:2x4``: 8 chips.

    Raises:
      CompileForError: an unknown name, one libtpu refuses, or no libtpu installed.
    """
    check_topology(name)
    from jax.experimental import topologies

    # libtpu takes a lock file so that one process at a time drives a host's TPU chips; a
    # compile-only slice drives none, so processes compiling at once need not wait for it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(name.strip(), platform="tpu").devices)
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


@dataclasses.dataclass(frozen=True)
class Steps:
    """What an Estimator runs, built on a given mesh (``Estimator.compile_for`` makes it).

    Attributes:
      init: ``(rng, features, labels) -> TrainState`` on one replica's rows (for shapes only).
      train: the jitted train step ``(state, rng, features, labels) -> (state, metrics)``.
      init_eval: ``(rng, features, labels) -> variables`` in EVAL mode (shapes only).
      eval: the jitted eval step ``(totals, variables, step, features, labels, mask)``.
      rng: the run's base key.
    """

    init: Callable[..., Any]
    train: Any
    init_eval: Callable[..., Any]
    eval: Any
    rng: jax.Array


@dataclasses.dataclass
class StepReport:
    """One step compiled for a slice: whether it fits, its memory and work per device.

    Memory and costs are per device (a TensorCore on v2-v4, a chip on v5e/v5p/v6e); bytes are
    bytes. ``error`` holds the compiler's message when it did not fit (then the sizes are 0).
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

    def as_dict(self) -> dict[str, Any]:
        """The report with its derived figures, for JSON."""
        out = dataclasses.asdict(self)
        if self.search is not None:
            out["search"]["exact"] = self.search.exact
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
        head = (
            f"{self.step} step on {self.device_kind} x{self.num_devices} ({self.topology}; "
            f"global batch {self.global_batch:,}, {self.dtypes})"
        )
        if not self.fits:
            return f"{head}: does not fit: {self.error} (compiled in {self.compile_s:.0f} s)"
        t = self.roofline_s
        return (
            f"{head}: fits: {_size(self.memory_bytes)} of {_size(self.hbm_bytes)} per device "
            f"(args {_size(self.argument_bytes)}, temp {_size(self.temp_bytes)}, code "
            f"{_size(self.code_bytes)}); {self.flops / 1e12:.3g} TFLOP, "
            f"{self.bytes_accessed / 1e9:.3g} GB per device per step; roofline >= "
            f"{_duration(t)}/step = {self.examples_per_s:,.0f} examples/s "
            f"({self.examples_per_s / self.num_devices:,.0f} per device); compiled in "
            f"{self.compile_s:.0f} s"
        )


def _size(n: float) -> str:
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
    """(``init``'s output placed replicated, features, labels sharded over ``mesh``, replicated)."""
    features, labels = io
    rows = batch // mesh.size
    sample = (_abstract_batch(features, rows), _abstract_batch(labels, rows))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(REPLICA_AXIS))
    state = _placed(jax.eval_shape(init, steps.rng, *sample), replicated)
    features, labels = (_abstract_batch(x, batch, sharded) for x in io)
    return state, features, labels, replicated


def train_args(steps: Steps, mesh: Mesh, io: tuple[Any, Any], batch: int) -> tuple[Any, ...]:
    """Abstract ``(state, rng, features, labels)`` of ``steps.train`` at global ``batch``."""
    state, features, labels, replicated = _inputs(steps, mesh, io, batch, steps.init)
    rng = jax.ShapeDtypeStruct(steps.rng.shape, steps.rng.dtype, sharding=replicated)
    return state, rng, features, labels


def eval_args(steps: Steps, mesh: Mesh, io: tuple[Any, Any], batch: int) -> tuple[Any, ...]:
    """Abstract ``(totals, variables, step, features, labels, mask)`` of ``steps.eval``."""
    variables, features, labels, replicated = _inputs(steps, mesh, io, batch, steps.init_eval)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    sharded = NamedSharding(mesh, P(REPLICA_AXIS))
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


Build = Callable[[Mesh, str, int], Steps]


def compile_for(
    build: Build,
    topology: str,
    io: tuple[Any, Any],
    batch_sizes: dict[str, int],
    num_shards: int | None = None,
    search: bool = False,
) -> list[StepReport]:
    """Compiles each step of ``batch_sizes`` (``{"train": 1024, "eval": 1024}``) for a slice.

    Args:
      build: ``build(mesh, step, global_batch) -> Steps``: the Estimator's steps on that mesh.
      topology: the slice, e.g. ``v5e:2x4``.
      io: ``(features, labels)``, ``TensorSpec`` pytrees of a batch (batch dimension None).
      batch_sizes: the global batch of each step to compile.
      num_shards: replicas: the first ``num_shards`` devices (default: all of the slice's).
      search: for a step that does not fit, look for the largest batch that does (compiles).

    Raises:
      CompileForError: the topology cannot be used here, or a batch does not divide over the
        replicas (the message suggests one that does).
    """
    features, labels = io
    check_inputs(features, labels)
    devices = slice_devices(topology)
    if num_shards and num_shards < len(devices):
        devices = devices[:num_shards]
    reports = []
    for step, batch in batch_sizes.items():
        try:
            per_replica_batch(batch, len(devices), f"{step}_batch_size")
        except ValueError as e:
            raise CompileForError(f"on {topology}: {e}") from None
        compile_one = functools.partial(
            compile_step, step, build, devices, topology, features=features, labels=labels
        )
        report = compile_one(batch=batch)
        if search and not report.fits:
            probe = functools.partial(_at_batch, compile_one)
            report.search = largest_batch(probe, report, len(devices))
        reports.append(report)
    return reports


def _at_batch(compile_one: Callable[..., StepReport], batch: int) -> StepReport:
    return compile_one(batch=batch)


def compile_step(
    step: str, build: Build, devices: list[Any], topology: str, **io: Any
) -> StepReport:
    """Compiles the ``step`` ('train' or 'eval') at ``io['batch']`` for ``devices``.

    Args:
      step: which step.
      build: ``build(mesh, step, global_batch) -> Steps``: the Estimator's steps on that mesh.
      devices: the mesh's devices (a slice's, or the first ``num_shards`` of them).
      topology: the slice's name, for the report.
      io: ``features``, ``labels`` (``TensorSpec`` pytrees, batch dim None) and ``batch``.
    """
    mesh = Mesh(np.array(devices), (REPLICA_AXIS,))
    batch = io["batch"]
    chip = TPU_CHIPS[check_topology(topology)]
    per_chip = devices_per_chip(devices)
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
        hbm_bytes=chip.hbm_gib * GiB / per_chip,
        peak_flops=chip.bf16_tflops * 1e12 / per_chip,
        hbm_bandwidth=chip.hbm_gbps * 1e9 / per_chip,
    )
    start = time.perf_counter()
    lowered = lower(step, build(mesh, step, batch), mesh, (io["features"], io["labels"]), batch)
    stablehlo = lowered.as_text()
    report.dtypes = compute_dtypes(stablehlo)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        report.compile_s = time.perf_counter() - start
        report.error = " ".join(str(e).replace("RESOURCE_EXHAUSTED:", "").split())
        return report
    report.compile_s = time.perf_counter() - start
    _fill(report, compiled)
    report.custom_calls = custom_call_targets(stablehlo + compiled.as_text())
    _measure_serialized(report, compiled)
    return report


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


_CUSTOM_CALL = re.compile(r'custom_call @([\w.$-]+)|custom_call_target="([^"]+)"')


def custom_call_targets(text: str) -> tuple[str, ...]:
    """The custom-call targets named in StableHLO (``custom_call @t``) or HLO text, sorted."""
    return tuple(sorted({a or b for a, b in _CUSTOM_CALL.findall(text)}))


def _fill(report: StepReport, compiled: Any) -> None:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jaxlibs: one dict per program
    report.fits = True
    report.argument_bytes = int(memory.argument_size_in_bytes)
    report.output_bytes = int(memory.output_size_in_bytes)
    report.alias_bytes = int(memory.alias_size_in_bytes)
    report.temp_bytes = int(memory.temp_size_in_bytes)
    report.code_bytes = int(memory.generated_code_size_in_bytes)
    report.flops = float(cost.get("flops", 0.0))
    report.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    # XLA:TPU's own estimate of the step's time, where its cost model gives one.
    estimate = cost.get("optimal_seconds")
    report.xla_estimate_s = float(estimate) if estimate and estimate > 0 else None


def check_inputs(features: Any, labels: Any) -> None:
    """Refuses inputs that are not ``TensorSpec`` pytrees with a None batch dimension."""
    check_input_specs(features)
    if labels is not None:
        check_input_specs(labels)


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """What ``largest_batch`` found: ``fits`` fits (None: no batch tried did), ``fails`` (the
    smallest tried that does not) does not; ``multiple``: the step between batches."""

    fits: int | None
    fails: int
    multiple: int
    compiles: int

    @property
    def exact(self) -> bool:
        """Whether ``fits`` is the largest (the next multiple does not fit)."""
        return self.fits is not None and self.fails - self.fits <= self.multiple


_SIZE = re.compile(r"([\d.]+)\s*([KMGT])i?B?\b")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def oom_sizes(message: str) -> tuple[float, float] | None:
    """(required, available) bytes from the TPU compiler's out-of-memory message, if it says."""
    sizes = [float(v) * _UNITS[u] for v, u in _SIZE.findall(message)]
    if len(sizes) < 2 or "available" not in message:
        return None
    return sizes[0], sizes[-1]


def largest_batch(
    probe: Callable[[int], StepReport], failed: StepReport, multiple: int, max_compiles: int = 12
) -> BatchSearch:
    """The largest global batch (a multiple of ``multiple``) below ``failed``'s that fits.

    Memory grows about linearly with the batch: each try is where the line through two
    measurements (a fit's memory, an out-of-memory's required bytes) meets the memory available
    (aiming 2% low until something fits), halving the bracket instead after a try that moved it
    by one step only. At most ``max_compiles`` compiles; exact once a fitting batch and the next
    multiple, which does not fit, are both known. (12: a batch that does not fit fails in
    seconds, at memory assignment, and most late tries are those; ResNet-50 on v5e: 8 s a
    failure, 2 to 3 min a fit, on 2 CPU cores.)
    """
    points: dict[int, float] = {}  # batch -> bytes (needed, or used)
    available = failed.hbm_bytes
    sizes = oom_sizes(failed.error or "")
    if sizes:
        points[failed.global_batch], available = sizes
    lo, hi, compiles, halve, kept = 0, failed.global_batch, 0, False, 0
    while compiles < max_compiles and hi - lo > multiple:
        target = available if lo else 0.98 * available
        guess = _next_guess(points, target, lo, hi, multiple, hi_weight=0.5**kept)
        if halve or not lo < guess < hi:
            guess = _middle(lo, hi, multiple)
        report = probe(guess)
        compiles += 1
        logging.info(
            "batch search: global batch %d %s (%s)",
            guess,
            "fits" if report.fits else "does not fit",
            _size(report.memory_bytes) if report.fits else (report.error or "")[:120],
        )
        halve = not report.fits and hi - guess <= multiple
        if report.fits:
            lo, points[guess] = guess, float(report.memory_bytes)
            kept += 1
        else:
            hi, kept = guess, 0
            sizes = oom_sizes(report.error or "")
            if sizes:
                points[guess] = sizes[0]
    return BatchSearch(fits=lo or None, fails=hi, multiple=multiple, compiles=compiles)


def _next_guess(
    points: dict[int, float], available: float, lo: int, hi: int, k: int, hi_weight: float = 1.0
) -> int:
    """The next batch to try in (lo, hi), a multiple of ``k``.

    Where the line through two measurements reaches ``available``: the two largest batches that
    fit, else those at ``lo`` and ``hi``, else (no fit yet) ``hi``'s and the next larger failed
    one's, else ``hi``'s and zero. Kept inside the bracket; the middle when nothing is measured.

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
            # At or past ``hi`` (known not to fit) the line is wrong: the caller halves.
            return max(lo + k, _line_reaches(b1, m1, b2, m2, available, k))
    if hi not in points:
        return _middle(lo, hi, k)
    if lo in points:
        b1, m1 = lo, points[lo]
    else:
        above = [b for b in points if b > hi]
        b1, m1 = (min(above), points[min(above)]) if above else (0, 0.0)
    b2, m2 = hi, available + (points[hi] - available) * hi_weight
    guess = hi - k
    if b1 != b2 and (m2 - m1) / (b2 - b1) > 0:
        guess = _line_reaches(b1, m1, b2, m2, available, k)
    return min(hi - k, max(lo + k, guess))


def _line_reaches(b1: int, m1: float, b2: int, m2: float, target: float, k: int) -> int:
    """The batch (rounded down to a multiple of ``k``) where the line through (b1, m1) and
    (b2, m2) reaches ``target`` bytes."""
    return int(b2 + (target - m2) * (b2 - b1) / (m2 - m1)) // k * k


def _middle(lo: int, hi: int, k: int) -> int:
    """The middle of the bracket (lo, hi), a multiple of ``k`` above ``lo``."""
    return max(lo + k, (lo + hi) // 2 // k * k)


def describe_failure(report: StepReport) -> str:
    """One line: a step that does not fit, and what the batch search found (if it ran)."""
    head = (
        f"the {report.step} step does not fit on {report.topology} at global batch "
        f"{report.global_batch:,}"
    )
    search = report.search
    if search is None:
        return f"{head}: {report.error}"
    tries = f"{search.compiles} compile{'s' if search.compiles != 1 else ''}"
    if search.fits is None:
        return (
            f"{head}, nor at {search.fails:,} ({tries}): the model's weights and state alone "
            "may not fit there."
        )
    if search.exact:
        return (
            f"{head}: the largest global batch that fits is {search.fits:,} ({search.fails:,} "
            f"does not; found in {tries})."
        )
    return (
        f"{head}: a global batch of {search.fits:,} fits and {search.fails:,} does not (the "
        f"largest is between them; {tries})."
    )
