"""oneDNN convolutions for XLA:CPU, through XLA's FFI (optional, built on the machine).

XLA:CPU's convolution kernels run 1.3-5x (fp32) and 5-30x (bf16, no AMX) slower than
oneDNN's on the same cores (``bench/results/conv_cpu.md``); oneDNN is what PyTorch and
TensorFlow use there. ``onednn_conv.cc`` (beside this file) is the glue: three FFI handlers,
forward / input gradient / filter gradient, NHWC activations and HWIO filters, fp32 or bf16.

oneDNN 3 comes from the package index, no root or system package needed::

    pip install 'estimax[onednn]'        # onednn-devel: headers; onednn: libdnnl.so.3
    python -m estimax.ops.native build   # needs a C++ compiler; writes a small .so

``make test`` and ``make demo`` do both. The wheels install into the environment's prefix
(``<prefix>/include/oneapi/dnnl``, ``<prefix>/lib/libdnnl.so.3``); ``find_onednn`` looks
there (``ESTIMAX_ONEDNN_PREFIX`` first, then this Python's prefix, then the user base of
``pip install --user``) and accepts only oneDNN 3 or later, so a system oneDNN 2.x
(Debian's libdnnl-dev) is never used. Without a compiler or the wheels, estimax.ops uses its
pure-XLA formulations: the same values, slower. ``ESTIMAX_ONEDNN=0`` turns the library off;
``ESTIMAX_ONEDNN_LIB=/path/lib.so`` loads a library built elsewhere.

Intel's oneDNN wheels run their CPU kernels through SYCL on Intel's OpenCL CPU runtime (the
``intel-opencl-rt`` wheel, pulled in by ``onednn``), whose loader file in the wheel points at a
path that does not exist; ``load`` names the runtime to the OpenCL loader
(``OCL_ICD_FILENAMES``) before oneDNN creates its engine.

Which primitives oneDNN can create depends on the CPU (and on ``ONEDNN_MAX_CPU_ISA``, which
caps the instruction set it uses): below AVX-512 (AMD Zen 2) oneDNN has no bf16 convolution
kernels but its reference one, tens of times slower. ``probe`` asks oneDNN for one
convolution's primitive before estimax.ops chooses the kernel, and refuses reference kernels,
so a convolution oneDNN cannot serve well is never sent to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from estimax.ops import signals

__all__ = [
    "CONV_KINDS",
    "ONEDNN_REQUIREMENTS",
    "OneDnn",
    "available",
    "build",
    "cpu_model",
    "dtype_support",
    "enabled",
    "find_onednn",
    "implementation",
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
# What `pip install 'estimax[onednn]'` installs (pyproject.toml's extra says the same; a test
# keeps them equal): Intel's oneDNN 3.13 headers, and libdnnl.so.3 with its runtimes.
ONEDNN_REQUIREMENTS = ("onednn-devel==2026.1.0", "onednn==2026.1.0")
_INSTALL_HINT = (
    "pip install 'estimax[onednn]' (or: pip install "
    + " ".join(f"'{r}'" for r in ONEDNN_REQUIREMENTS)
    + ")"
)
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


class OneDnn(NamedTuple):
    """A oneDNN 3 installation: its prefix, headers, shared library and version."""

    prefix: Path
    include_dir: Path
    library: Path
    version: str


def _onednn_at(prefix: Path) -> OneDnn | str:
    """The oneDNN 3 installed under ``prefix``, or why there is none."""
    include = prefix / "include"
    header = include / "oneapi" / "dnnl" / "dnnl_version.h"
    try:
        text = header.read_text()
    except OSError:
        return f"{prefix}: no {header.relative_to(prefix)}"
    found = {
        k: int(v)
        for k, v in re.findall(r"#define\s+DNNL_VERSION_(MAJOR|MINOR|PATCH)\s+(\d+)", text)
    }
    version = ".".join(str(found.get(k, "?")) for k in ("MAJOR", "MINOR", "PATCH"))
    if found.get("MAJOR", 0) < 3:
        return f"{prefix}: oneDNN {version}, estimax needs 3 or later"
    library = prefix / "lib" / "libdnnl.so.3"
    if not library.exists():
        return f"{prefix}: oneDNN {version} headers but no lib/libdnnl.so.3 (pip install onednn)"
    return OneDnn(prefix, include, library, version)


def find_onednn() -> OneDnn:
    """Finds oneDNN 3 where pip installs it, never in the system's directories.

    Looks under ``ESTIMAX_ONEDNN_PREFIX`` if set (and only there), else under this Python's
    prefix (a venv's root) and then the user base (``pip install --user``).
    Raises ``RuntimeError`` saying where it looked and what to install.
    """
    override = os.environ.get("ESTIMAX_ONEDNN_PREFIX")
    prefixes = [Path(override)] if override else [Path(sys.prefix), Path(site.getuserbase())]
    reasons = []
    for prefix in dict.fromkeys(prefixes):
        found = _onednn_at(prefix)
        if isinstance(found, OneDnn):
            return found
        reasons.append(found)
    raise RuntimeError(
        f"oneDNN 3 not found ({'; '.join(reasons)}). Install it from the package index: "
        f"{_INSTALL_HINT}."
    )


def build(output: Path | None = None, verbose: bool = False) -> Path:
    """Compiles ``onednn_conv.cc`` against jaxlib's FFI headers and oneDNN 3 from the index.

    Needs only a C++ compiler (``CXX``, else ``c++``/``g++``) and ``find_onednn``'s oneDNN.
    Writes into the package directory if it is writable, else into ``~/.cache/estimax``.
    Raises ``RuntimeError`` with the compiler's message (and what to install) on failure.
    """
    import jax.ffi  # noqa: PLC0415 - only the build needs jaxlib's include directory

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("estimax.ops.native build: no C++ compiler found (install g++).")
    onednn = find_onednn()
    libdir = onednn.library.parent
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
            # Searched before the system's directories, so a /usr/include/oneapi/dnnl of an
            # older oneDNN is never seen (the source also refuses oneDNN < 3 at compile time).
            f"-I{onednn.include_dir}",
            f"-I{jax.ffi.include_dir()}",
            f'-DESTIMAX_ONEDNN_LIBDIR="{libdir}"',
            str(SOURCE),
            # The file itself, not -ldnnl: the linker must not pick a system libdnnl.so.
            str(onednn.library),
            # RPATH, not RUNPATH: libdnnl.so.3 has no search path of its own, and only an
            # RPATH also serves its dependencies (libtbb, libsycl, ...) beside it.
            f"-Wl,--disable-new-dtags,-rpath,{libdir}",
            "-o",
            tmp,
        ]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"estimax.ops.native build failed:\n{proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent loader never sees half a library
        if output is None:
            # Builds of older sources are never loaded again (the name carries the hash).
            for old in target.parent.glob("libestimax_onednn_*.so"):
                if old != target:
                    old.unlink(missing_ok=True)
        return target
    raise RuntimeError(f"estimax.ops.native build: no writable output directory ({last_error}).")


def _point_opencl_at_cpu_runtime(libdir: str) -> None:
    """Names Intel's OpenCL CPU runtime (beside libdnnl) to the OpenCL loader.

    oneDNN from the index runs CPU kernels through SYCL, whose CPU device is that runtime;
    the loader file the wheel installs (``etc/OpenCL/vendors/intel-cpu.icd``) names a
    placeholder path, so without this oneDNN finds no CPU device ("could not create an
    engine"). The loader reads the variable when oneDNN first asks for devices, after this.
    """
    runtime = Path(libdir) / "libintelocl.so"
    if not runtime.exists():
        return
    current = [p for p in os.environ.get("OCL_ICD_FILENAMES", "").split(":") if p]
    if str(runtime) not in current:
        os.environ["OCL_ICD_FILENAMES"] = ":".join([*current, str(runtime)])


@functools.cache
def _load_library() -> ctypes.CDLL | None:
    global _load_error
    if os.environ.get("ESTIMAX_ONEDNN", "1") == "0":
        _load_error = "disabled by ESTIMAX_ONEDNN=0"
        return None
    path = library_path()
    if path is None:
        _load_error = (
            "not built (python -m estimax.ops.native build; needs a C++ compiler and "
            f"oneDNN 3: {_INSTALL_HINT})"
        )
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        _load_error = f"cannot load {path}: {e}"
        return None
    import jax  # noqa: PLC0415 - keep `import estimax.ops.native` free of JAX until used

    lib.EstimaxOneDnnIsa.restype = ctypes.c_char_p
    try:
        lib.EstimaxOneDnnLibDir.restype = ctypes.c_char_p
        libdir = lib.EstimaxOneDnnLibDir().decode()
    except AttributeError:  # a library built elsewhere without it (ESTIMAX_ONEDNN_LIB)
        libdir = ""
    if libdir:
        _point_opencl_at_cpu_runtime(libdir)
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
    ok, msg = _probe(lib, kind, dtype, dims)
    return None if ok else msg or "unsupported"


@functools.cache
def implementation(kind: str, dtype: str, dims: tuple[int, ...]) -> str | None:
    """oneDNN's name for the kernel it runs for one convolution (e.g.
    ``'brg_conv_fwd:avx512_core_bf16'``), or None if ``probe`` refuses it. Arguments as
    ``probe``'s."""
    lib = _load_library()
    if lib is None or probe(kind, dtype, dims) is not None:
        return None
    return _probe(lib, kind, dtype, dims)[1]


def _probe(lib: ctypes.CDLL, kind: str, dtype: str, dims: tuple[int, ...]) -> tuple[bool, str]:
    if kind not in CONV_KINDS or len(dims) != 15:
        raise ValueError(f"probe: kind={kind!r} dims={dims!r}")
    msg = ctypes.create_string_buffer(512)
    c_dims = (ctypes.c_int64 * 15)(*dims)
    # Primitive creation mutates the library's cache. The first one creates oneDNN's engine,
    # whose CPU runtime installs signal handlers of its own: undone (estimax.ops.signals).
    with _lock, signals.kept("oneDNN's CPU runtime"):
        ok = lib.EstimaxConvProbe(CONV_KINDS.index(kind), _DTYPE_CODES[dtype], c_dims, msg, 512)
    return bool(ok), msg.value.decode(errors="replace")


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
    """The version of the oneDNN the library was built against, e.g. '3.13.2'."""
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
