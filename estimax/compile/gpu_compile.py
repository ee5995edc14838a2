"""Compiling an Estimator's steps for NVIDIA GPUs on a machine that has none.

XLA's GPU compiler ships in JAX's CUDA plugin (the ``gpu-compile`` extra) and runs without a GPU
or driver: ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=TEXT,
topology="1x1x8")`` gives compile-only devices described by ``TEXT``, a
``stream_executor.GpuTargetConfigProto``. The descriptions are data files beside this module
(``gpu_specs/NAME.txtpb``): XLA's own (``xla/backends/gpu/target_config/specs/``), each naming
the commit it was copied from, and one written here for the L4, each figure with its source.

What differs from a TPU slice, and what this module does about it (measured with jax 0.10.2 and
``jax-cuda12-plugin`` 0.10.2 on a 2-core CPU-only machine: ``docs/accelerators.md``, "Compiling
for NVIDIA GPUs without one", has the figures, e.g. ResNet-50 at a global batch of 65,536
compiling to 304 GiB per device for an 80 GB H100; ``tests/test_gpu_compile.py`` compiles every
program's steps so and a step too big for the card; the last row is what ``jax.devices()`` does
with the plugin installed and no driver: ``cuInit(0) failed: Unknown CUDA error 303``, logged
with a traceback, before it falls back to the CPU):

| on a GPU target                                  | so                                       |
|--------------------------------------------------|------------------------------------------|
| a step too big for the card still compiles       | ``fit_verdict`` compares the total with   |
| (XLA rematerialises what it can and warns)       | the card's memory JAX may use, less a     |
|                                                  | margin for cuDNN's workspace              |
| ``compiled.cost_analysis()`` is None             | ``step_costs``: XLA's HLO cost analysis   |
| (UNIMPLEMENTED)                                  | through the CPU client                    |
| convolution algorithms are chosen at run time    | the margin above                          |
| JAX starts CUDA when it first looks for devices  | ``use_cpu_backend`` before that: as the   |
| (``cuInit`` error 303 and a traceback, no GPU);  | programs parse ``--compile_for``, and in  |
| before that, JAX's CUDA plugin checks the CUDA   | ``gpu_devices`` where no NVIDIA device is |
| runtime's version and, without one, does not     | visible. The plugin skips its check when  |
| load ("Unable to load CUDA. Is it installed?"),  | CUDA is not among JAX's platforms, and    |
| so its compiler is gone too                      | still registers its compiler              |

Installing the plugin: ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` (182 MB of wheels, 480 MB
installed) and ``nvidia-cuda-nvcc-cu12`` for ``ptxas`` (40 MB; a CUDA toolkit's ptxas on the
PATH or in /usr/local/cuda serves as well). cuDNN, cuBLAS, NCCL and the rest of
``jax-cuda12-plugin[with-cuda]`` (3.2 GB of wheels) are needed to run, not to compile.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.resources
import logging
import os
import re
from typing import Any

import jax
import numpy as np

from estimax.parallel.chips import GPU_CHIPS, ChipSpec

GiB = 1 << 30

# The cards with a description in gpu_specs/, by GPU_CHIPS's names.
KNOWN_GPUS = ("h100", "h200", "a100-80gb", "a100-40gb", "l4", "b200", "gb200")
# One host's GPUs at most: a larger count is that many hosts of 8 (an HGX/DGX board's 8).
GPUS_PER_HOST = 8
GPU_INSTALL_HINT = (
    "pip install -e '.[gpu-compile]' in estimax's checkout (JAX's CUDA plugin and ptxas: "
    "220 MB of wheels), or run in the Makefile's .venv-cuda (make .venv-cuda/.installed-stamp)"
)
_GPU = re.compile(r"^([a-z][a-z0-9-]*):(.*)$")

# JAX preallocates this fraction of a GPU's memory for its allocator, which holds every buffer
# a step uses (https://docs.jax.dev/en/latest/gpu_memory_allocation.html);
# XLA_PYTHON_CLIENT_MEM_FRACTION changes it. The rest is the CUDA context's, cuBLAS's, cuDNN's.
DEFAULT_MEM_FRACTION = 0.75
# Deviceless, XLA leaves each convolution's algorithm to run time ("algorithm -1", no workspace
# in the temporaries); on the card, autotuning picks one whose workspace (from the same
# allocator) may be up to XLA's redzone scratch limit, 4 GiB by default
# (xla/debug_options_flags.cc: xla_gpu_redzone_scratch_max_megabytes = 4096).
CUDNN_WORKSPACE_MARGIN = 4 * GiB


class GpuTargetError(ValueError):
    """A GPU target that cannot be used here (unknown, malformed, no plugin): one line."""


def known_gpus() -> str:
    """The GPU target names to offer a user, as one phrase."""
    return f"{', '.join(KNOWN_GPUS)} as NAME:COUNT (e.g. h100:8)"


def is_gpu_target(name: str) -> bool:
    """Whether ``name`` is meant as a GPU target (``NAME:COUNT`` with NAME not a TPU's ``vN``
    or ``tpuN``: ``tpu7x:2x2x1`` is libtpu's name for TPU7x)."""
    match = _GPU.match(name.strip())
    return match is not None and not re.match(r"^(v|tpu)\d", match.group(1))


def check_gpu_target(name: str) -> tuple[str, int]:
    """``("h100", 8)`` for ``h100:8``, or raises GpuTargetError naming the known GPUs."""
    match = _GPU.match(name.strip())
    if not match or match.group(1) not in KNOWN_GPUS:
        raise GpuTargetError(f"unknown GPU {name!r}: known are {known_gpus()}.")
    count = match.group(2)
    if not count.isdigit() or int(count) < 1:
        raise GpuTargetError(
            f"malformed GPU count in {name!r}: a positive number of GPUs, e.g. "
            f"{match.group(1)}:8 (known are {known_gpus()})."
        )
    gpus = int(count)
    if gpus > GPUS_PER_HOST and gpus % GPUS_PER_HOST:
        raise GpuTargetError(
            f"{name!r}: more than {GPUS_PER_HOST} GPUs are hosts of {GPUS_PER_HOST}; give a "
            f"multiple of {GPUS_PER_HOST} (e.g. {match.group(1)}:{gpus // GPUS_PER_HOST * 8 + 8})."
        )
    return match.group(1), gpus


def target_config(gpu: str) -> str:
    """The ``GpuTargetConfigProto`` text of ``gpu`` (a ``KNOWN_GPUS`` name)."""
    files = importlib.resources.files("estimax.compile") / "gpu_specs"
    return (files / f"{gpu}.txtpb").read_text()


def device_memory_bytes(gpu: str) -> int:
    """The device memory the description gives (what a process sees: the card's less the
    driver's reserve; 84,942,979,072 bytes on an H100 SXM)."""
    match = re.search(r"^\s*device_memory_size:\s*(\d+)", target_config(gpu), re.MULTILINE)
    assert match, gpu
    return int(match.group(1))


def chip(gpu: str) -> ChipSpec:
    """The card's published peak and bandwidth (``chips.GPU_CHIPS``)."""
    return GPU_CHIPS[gpu]


class _PluginErrors(logging.Handler):
    """Keeps what JAX logged when a plugin failed to load (JAX logs it and goes on without the
    plugin), so that a compile without XLA's GPU compiler can say why it is missing."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.causes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "plugin configuration error" in str(record.msg) and record.exc_info:
            error = record.exc_info[1]
            self.causes.append(" ".join(str(error).split())[:200] or type(error).__name__)


# Installed when this module is imported, which is before JAX looks for its plugins (at the
# first device lookup) in every path to a GPU compile.
_PLUGIN_ERRORS = _PluginErrors()
logging.getLogger("jax._src.xla_bridge").addHandler(_PLUGIN_ERRORS)


def use_cpu_backend() -> bool:
    """Keeps JAX from starting CUDA where nothing will run (``--compile_for`` runs nothing).

    With JAX's CUDA plugin installed and no GPU, JAX at its first device lookup (1) runs the
    plugin's check of the CUDA runtime's version, which fails without the CUDA libraries (the
    ``gpu-compile`` extra has none: "Unable to load CUDA. Is it installed?"), and then JAX drops
    the plugin and with it XLA's GPU compiler; with them (the full ``cuda12`` extra) it (2)
    starts CUDA, which fails at ``cuInit`` (error 303) with a logged traceback. With ``cpu`` as
    JAX's only platform the plugin skips (1) (jax_plugins/xla_cuda12 ``initialize``: the check
    runs only when "cuda" is among ``jax_platforms``) and still registers its compiler, and (2)
    never happens. ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` skips (1) too, should a user's
    ``JAX_PLATFORMS`` name CUDA.

    Returns:
      whether it took effect: not once JAX's backends are up, nor over a ``JAX_PLATFORMS`` the
      user set.
    """
    from jax._src import xla_bridge

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if xla_bridge.backends_are_initialized() or getattr(jax.config, "jax_platforms", None):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


def keep_cuda_out(name: str, platforms: str | None = None) -> None:
    """``--compile_for=name`` with a GPU ``name``, before JAX's first device lookup: nothing runs,
    so JAX is kept on its CPU backend (``use_cpu_backend``), with or without a GPU here.

    Args:
      name: the target (``h100:8``).
      platforms: JAX's ``jax_platforms`` (None: read from JAX's config, i.e. ``JAX_PLATFORMS``).

    Raises:
      GpuTargetError: ``JAX_PLATFORMS`` names CUDA and this machine shows no GPU (JAX would stop
        with a traceback when it fails to start CUDA); one line saying to unset it.
    """
    if platforms is None:
        platforms = getattr(jax.config, "jax_platforms", None) or ""
    if {p.strip() for p in platforms.split(",")} & {"cuda", "gpu"} and not _gpu_visible():
        raise GpuTargetError(
            f"JAX_PLATFORMS={platforms} asks JAX to start CUDA, which needs a GPU and its driver "
            f"(this machine shows none); compiling for {name} needs neither: unset JAX_PLATFORMS."
        )
    use_cpu_backend()


def _gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU (its device files: ``/dev/nvidia0``...)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _cuda_plugin() -> str | None:
    """The installed CUDA plugin's distribution and version (``jax-cuda12-plugin 0.10.2``)."""
    for dist in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def no_compiler(
    name: str, plugin: str | None, cause: str | None, platforms: str | None
) -> GpuTargetError:
    """Why XLA's GPU compiler is missing, one line: not installed, or installed (``plugin``, its
    distribution and version) but not loaded, with what JAX logged (``cause``) and what to
    change given ``platforms`` (JAX's ``jax_platforms``)."""
    if plugin is None:
        return GpuTargetError(
            f"compiling for {name} needs XLA's GPU compiler (JAX's CUDA plugin): "
            f"{GPU_INSTALL_HINT}."
        )
    cause = cause or "no error was logged"
    if platforms and platforms != "cpu":
        fix = (
            f"JAX_PLATFORMS={platforms} asks JAX to start CUDA, which needs a GPU and its "
            "driver; a compile for a GPU needs neither: unset JAX_PLATFORMS"
        )
    elif platforms == "cpu":
        fix = (
            f"reinstall the gpu-compile extra (the plugin's version must be jaxlib's, "
            f"{jax.__version__})"
        )
    else:
        fix = (
            "JAX looked for its devices before estimax could keep CUDA out (it does so when "
            "--compile_for names a GPU); in your own code, call "
            "estimax.compile.gpu_compile.use_cpu_backend() before JAX's first device lookup"
        )
    return GpuTargetError(
        f"compiling for {name}: JAX's CUDA plugin ({plugin}) is installed but did not load "
        f"({cause}): {fix}."
    )


def gpu_devices(name: str) -> list[Any]:
    """The compile-only devices of ``name`` (``h100:8``: 8 x "NVIDIA H100 80GB HBM3").

    Raises:
      GpuTargetError: an unknown name, a malformed count, or no CUDA plugin installed.
    """
    gpu, count = check_gpu_target(name)
    if not _gpu_visible():
        use_cpu_backend()  # nothing runs here: JAX's CUDA plugin must not look for CUDA
    hosts, per_host = (
        (count // GPUS_PER_HOST, GPUS_PER_HOST) if count > GPUS_PER_HOST else (1, count)
    )
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            target_config=target_config(gpu),
            # Partitions x hosts x devices per host (xla/pjrt/c/pjrt_c_api_gpu_internal.cc).
            topology=f"1x{hosts}x{per_host}",
        )
    except NotImplementedError:  # "topology not implemented for cuda": no plugin loaded
        causes = _PLUGIN_ERRORS.causes
        platforms = getattr(jax.config, "jax_platforms", None)
        raise no_compiler(name, _cuda_plugin(), causes[-1] if causes else None, platforms) from None
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise GpuTargetError(f"JAX's CUDA plugin refuses {name!r} ({first}).") from None
    return list(topology.devices)


def compile_error(name: str, error: Exception) -> GpuTargetError | None:
    """One line for a GPU compile that failed for want of a tool (ptxas), else None."""
    if "No PTX compilation provider" in str(error):
        return GpuTargetError(
            f"compiling for {name} needs NVIDIA's ptxas (nvidia-cuda-nvcc-cu12, or a CUDA "
            f"toolkit on the PATH): {GPU_INSTALL_HINT}."
        )
    return None


def mem_fraction() -> float:
    """JAX's preallocated fraction of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION, or 0.75)."""
    try:
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
    except ValueError:
        return DEFAULT_MEM_FRACTION
    return fraction if 0 < fraction <= 1 else DEFAULT_MEM_FRACTION


def usable_bytes(device_memory: float) -> float:
    """What a step may use of ``device_memory``: JAX's share less the cuDNN workspace margin."""
    return device_memory * mem_fraction() - CUDNN_WORKSPACE_MARGIN


def fit_error(needed: float, device_memory: float) -> str | None:
    """None if ``needed`` bytes per device fit, else the reason, one line.

    The sizes are in the order ``compile.oom_sizes`` reads them: needed first, available last.
    """
    usable = usable_bytes(device_memory)
    if needed <= usable:
        return None
    return (
        f"needs {needed / GiB:.2f}G per device (XLA compiles it all the same; JAX may use "
        f"{mem_fraction():.0%} of the card's {device_memory / GiB:.1f}G, less "
        f"{CUDNN_WORKSPACE_MARGIN / GiB:.0f}G for cuDNN's workspace), more than the available "
        f"{usable / GiB:.2f}G"
    )


def step_costs(lowered: Any, compiled: Any) -> tuple[float, float]:
    """(flops, bytes accessed) per device per step, by XLA's HLO cost analysis on the CPU client.

    The GPU executable has no cost analysis of its own. Flops come from the unoptimised module
    (the step is one ``shard_map``, so its shapes are a replica's): on the optimised one,
    cuDNN's convolutions are custom calls and count nothing. Bytes come from the optimised
    module, after fusion (the unoptimised module's count every intermediate: an overestimate
    that would overstate the roofline), plus what each custom call (cuDNN's convolutions,
    cuBLAS's matmuls) reads and writes, which the analysis counts as unknown.
    (0.0, 0.0) without a CPU backend.
    """
    from jax._src.lib import _jax

    try:
        cpu = jax.local_devices(backend="cpu")[0].client
    except RuntimeError:
        return 0.0, 0.0
    before = _jax.hlo_module_cost_analysis(cpu, lowered.compiler_ir("hlo").get_hlo_module())
    bytes_accessed = 0.0
    for module in compiled.runtime_executable().hlo_modules():
        cost = _jax.hlo_module_cost_analysis(cpu, module)
        calls = custom_call_bytes(module.to_string())
        # Each custom call counted -1 ("unknown") in the analysis's sum.
        bytes_accessed += max(0.0, float(cost.get("bytes accessed", 0.0))) + sum(calls) + len(calls)
    return max(0.0, float(before.get("flops", 0.0))), bytes_accessed


# `%name = TYPE opcode(operands), ...` in HLO text; TYPE may be a tuple: `(bf16[8]{0}, u8[0]{0})`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+) = (.+?) ([a-z][\w-]*)\((.*?)\)")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+\w*)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    """Bytes of the arrays an HLO type names (``bf16[8,32]{1,0}``: 512; tuples summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))  # type: ignore[union-attr]
        total += int(np.prod([int(d) for d in dims.split(",") if d])) * bits // 8
    return total


def custom_call_bytes(hlo_text: str) -> list[int]:
    """Bytes each custom call of an HLO module reads and writes (its operands and results)."""
    sizes: dict[str, int] = {}
    calls: list[tuple[str, str]] = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, opcode, operands = match.groups()
        sizes[name] = _shape_bytes(shape)
        if opcode == "custom-call":
            calls.append((name, operands))
    return [
        sizes[name] + sum(sizes.get(o.strip().lstrip("%"), 0) for o in operands.split(","))
        for name, operands in calls
    ]
