"""oneDNN convolutions for XLA:CPU, through XLA's FFI (optional, built on the machine).

XLA:CPU's convolution kernels run 1.3-5x (fp32) and 5-30x (bf16, no AMX) slower than
oneDNN's on the same cores (``bench/results/conv_cpu.md``); oneDNN is what PyTorch and
TensorFlow use there. ``onednn_conv.cc`` (beside this file) is the glue: three FFI handlers,
forward / input gradient / filter gradient, NHWC activations and HWIO filters, fp32 or bf16.

Build it once per machine (needs a C++ compiler and oneDNN's headers and library; Debian and
Ubuntu: ``apt-get install libdnnl-dev``)::

    python -m estimax.ops.native build

``make test`` and ``make demo`` do this themselves. Without the library, estimax.ops uses
its pure-XLA formulations: the same values, slower. ``ESTIMAX_ONEDNN=0`` turns the library
off; ``ESTIMAX_ONEDNN_LIB=/path/lib.so`` loads a library built elsewhere.

Which primitives oneDNN can create depends on the CPU (and on ``ONEDNN_MAX_CPU_ISA``, which
caps the instruction set it uses): oneDNN 2.6 has no bf16 convolutions below AVX-512, as on
AMD Zen 2. ``probe`` asks oneDNN for one convolution's primitive before estimax.ops chooses
the kernel, so a convolution oneDNN cannot serve is never sent to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "CONV_KINDS",
    "available",
    "build",
    "cpu_model",
    "dtype_support",
    "enabled",
    "isa",
    "library_path",
    "load",
    "native_kernels",
    "onednn_version",
    "probe",
    "status",
]

SOURCE = Path(__file__).with_name("onednn_conv.cc")
TARGETS = {
    "forward": "EstimaxConvForward",
    "backward_data": "EstimaxConvBackwardData",
    "backward_weights": "EstimaxConvBackwardWeights",
}
CONV_KINDS = ("forward", "backward_data", "backward_weights")
_DTYPE_CODES = {"float32": 0, "bfloat16": 1}
_lock = threading.Lock()
_state = threading.local()
_load_error: str | None = None


def _source_tag() -> str:
    # The library's file name carries a hash of the source, so an edited source is never
    # served by a stale build.
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


def _candidates() -> list[Path]:
    name = f"libestimax_onednn_{_source_tag()}.so"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "estimax"
    return [Path(__file__).with_name(name), cache / name]


def library_path() -> Path | None:
    """The built library that would be loaded, or None if none is built."""
    override = os.environ.get("ESTIMAX_ONEDNN_LIB")
    if override:
        return Path(override)
    return next((p for p in _candidates() if p.exists()), None)


def build(output: Path | None = None, verbose: bool = False) -> Path:
    """Compiles ``onednn_conv.cc`` against jaxlib's FFI headers and the system's oneDNN.

    Writes into the package directory if it is writable, else into ``~/.cache/estimax``.
    Raises ``RuntimeError`` with the compiler's message (and what to install) on failure.
    """
    import jax.ffi  # noqa: PLC0415 - only the build needs jaxlib's include directory

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("estimax.ops.native build: no C++ compiler found (install g++).")
    targets = [output] if output else _candidates()
    last_error = ""
    for target in targets:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
        except OSError as e:
            last_error = f"{target.parent}: {e}"
            continue
        cmd = [
            compiler,
            "-O2",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-w",
            f"-I{jax.ffi.include_dir()}",
            str(SOURCE),
            "-ldnnl",
            "-o",
            tmp,
        ]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            os.unlink(tmp)
            hint = ""
            if "dnnl.hpp" in proc.stderr or "-ldnnl" in proc.stderr or "ldnnl" in proc.stderr:
                hint = (
                    "\noneDNN's headers or library are missing: install them "
                    "(Debian/Ubuntu: apt-get install libdnnl-dev)."
                )
            raise RuntimeError(f"estimax.ops.native build failed:\n{proc.stderr.strip()}{hint}")
        os.replace(tmp, target)  # atomic: a concurrent loader never sees half a library
        if output is None:
            # Builds of older sources are never loaded again (the name carries the hash).
            for old in target.parent.glob("libestimax_onednn_*.so"):
                if old != target:
                    old.unlink(missing_ok=True)
        return target
    raise RuntimeError(f"estimax.ops.native build: no writable output directory ({last_error}).")


@functools.cache
def _load_library() -> ctypes.CDLL | None:
    global _load_error
    if os.environ.get("ESTIMAX_ONEDNN", "1") == "0":
        _load_error = "disabled by ESTIMAX_ONEDNN=0"
        return None
    path = library_path()
    if path is None:
        _load_error = "not built (python -m estimax.ops.native build; needs libdnnl-dev)"
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        _load_error = f"cannot load {path}: {e}"
        return None
    import jax  # noqa: PLC0415 - keep `import estimax.ops.native` free of JAX until used

    lib.EstimaxOneDnnIsa.restype = ctypes.c_char_p
    lib.EstimaxConvProbe.restype = ctypes.c_int
    lib.EstimaxConvProbe.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(
            f"estimax_onednn_conv_{name}", jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
        )
    return lib


def load() -> bool:
    """Loads the library and registers its FFI targets (once). True if it is usable."""
    with _lock:
        return _load_library() is not None


def available() -> bool:
    """True if the oneDNN library is built, loadable and not disabled."""
    return load()


@functools.cache
def probe(kind: str, dtype: str, dims: tuple[int, ...]) -> str | None:
    """Whether oneDNN can run one convolution on this CPU: None if it can, else its reason.

    Args:
      kind: one of ``CONV_KINDS``.
      dtype: ``"float32"`` or ``"bfloat16"``.
      dims: ``(n, c, h, w, o, kh, kw, ho, wo, sh, sw, pt, pb, pl, pr)``: NHWC input sizes,
        output channels, kernel, output size, strides and pads (top, bottom, left, right).

    A primitive that can be created is cached by the library, so the step that runs it later
    does not create it again.
    """
    lib = _load_library()
    if lib is None:
        return f"oneDNN library {_load_error}"
    if dtype not in _DTYPE_CODES:
        return f"oneDNN kernels take float32 or bfloat16, not {dtype}"
    if kind not in CONV_KINDS or len(dims) != 15:
        raise ValueError(f"probe: kind={kind!r} dims={dims!r}")
    msg = ctypes.create_string_buffer(512)
    c_dims = (ctypes.c_int64 * 15)(*dims)
    with _lock:  # primitive creation mutates the library's cache
        ok = lib.EstimaxConvProbe(CONV_KINDS.index(kind), _DTYPE_CODES[dtype], c_dims, msg, 512)
    return None if ok else msg.value.decode(errors="replace") or "unsupported"


def isa() -> str:
    """The instruction set oneDNN's kernels use on this CPU, e.g. 'avx2', 'avx512_core_amx'.

    oneDNN's own query (``dnnl::get_effective_cpu_isa``), after ``ONEDNN_MAX_CPU_ISA``.
    """
    lib = _load_library()
    return lib.EstimaxOneDnnIsa().decode() if lib is not None else "unavailable"


# A ResNet 3x3 layer: what "oneDNN serves this dtype" means in status lines.
_TYPICAL_CONV = (2, 64, 14, 14, 64, 3, 3, 14, 14, 1, 1, 1, 1, 1, 1)


def dtype_support() -> dict[str, bool]:
    """Which dtypes oneDNN computes natively here, e.g. ``{"float32": True, "bfloat16": False}``.

    Judged on a typical 3x3 convolution in all three directions. Where bf16 is False, bf16
    convolutions run as oneDNN fp32 kernels on bf16 values cast up (estimax.ops does this).
    """
    return {dt: all(probe(k, dt, _TYPICAL_CONV) is None for k in CONV_KINDS) for dt in _DTYPE_CODES}


def cpu_model() -> str:
    """The CPU's model name as the OS reports it (e.g. 'AMD EPYC'), or the platform's."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform  # noqa: PLC0415 - only off Linux

    return platform.processor() or platform.machine() or "unknown CPU"


def status() -> str:
    """One line for logs: the CPU, and which convolution kernels run for fp32 and bf16."""
    if not load():
        return f"XLA's own on {cpu_model()} (oneDNN library {_load_error})"
    support = dtype_support()
    fp32 = "oneDNN" if support["float32"] else "XLA's"
    if support["bfloat16"]:
        bf16 = "oneDNN bf16"
    elif support["float32"]:
        bf16 = "oneDNN fp32 kernels on upcast values (no bf16 convolutions for this ISA)"
    else:
        bf16 = "XLA's"
    return (
        f"oneDNN {onednn_version()} on {cpu_model()} ({isa()} kernels): fp32 {fp32}, "
        f"bf16 {bf16} ({library_path()})"
    )


def onednn_version() -> str:
    """The version of the oneDNN the library was built against, e.g. '2.6.3'."""
    lib = _load_library()
    if lib is None:
        return "unavailable"
    v = lib.EstimaxOneDnnVersion()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def enabled() -> bool:
    """True if convolutions traced now may call oneDNN (available, not turned off)."""
    return getattr(_state, "enabled", True) and available()


@contextlib.contextmanager
def native_kernels(enable: bool) -> Iterator[None]:
    """Turns the oneDNN kernels on or off for computations traced in this block.

    Off is what exports need: a serialized computation must not call a library that the
    serving process may not have. The switch acts when a function is traced: a function that
    ``jax.jit`` already traced keeps its trace, so trace a fresh function inside the block.
    """
    before = getattr(_state, "enabled", True)
    _state.enabled = enable
    try:
        yield
    finally:
        _state.enabled = before
