"""Process settings that make XLA:CPU training faster.

XLA:CPU allocates every intermediate buffer of a step with ``malloc`` and frees it
at the end of the step. glibc serves allocations above its mmap threshold (at most
32 MiB with the default dynamic threshold) with a fresh ``mmap``, so each step of a
convnet page-faults its large activations and gradients anew: a 124 MB copy takes
~290 ms instead of ~95 ms on the 2-core bench machine (bench/results/conv_cpu.md).
Raising the mmap threshold and the trim threshold keeps freed memory in the heap,
so the next step reuses already-mapped pages.

Cost: freed memory is kept by the process instead of being returned to the OS
(peak RSS is unchanged; RSS no longer shrinks between steps).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt(3) parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_DEFAULT_MMAP_THRESHOLD = 1 << 30  # 1 GiB: larger than any activation of the models here.
_DEFAULT_TRIM_THRESHOLD = (1 << 31) - 1  # int max: never trim the heap top.


def tune_cpu_allocator(
    mmap_threshold: int = _DEFAULT_MMAP_THRESHOLD, trim_threshold: int = _DEFAULT_TRIM_THRESHOLD
) -> bool:
    """Keeps large freed buffers in glibc's heap so XLA:CPU steps reuse mapped pages.

    Process-wide; call it once when training on the CPU backend (it only concerns
    host memory, so it is harmless but useless on GPU/TPU hosts). Safe to call more
    than once.

    Args:
      mmap_threshold: bytes; allocations below this come from the heap, not mmap.
      trim_threshold: bytes of free heap top kept before returning memory to the OS.

    Returns:
      True if both settings were applied; False on non-glibc platforms (macOS,
      musl), where nothing is changed.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    ok_trim = mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    return ok_mmap and ok_trim


def restore_cpu_allocator() -> bool:
    """Approximates glibc's default steady state again, for A/B benchmarks.

    glibc's dynamic mmap threshold grows to at most 32 MiB (trim threshold twice
    that) once large blocks have been freed; this sets those values explicitly.

    Returns:
      True if applied (see ``tune_cpu_allocator``).
    """
    return tune_cpu_allocator(32 << 20, 64 << 20)


# XLA:CPU (jaxlib 0.10.2) hands most f32 convolutions and dots to YNNPACK unless XLA_FLAGS
# says otherwise; an empty list turns YNNPACK off, "-individual_convolution" only for
# convolutions.
_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def xla_cpu_conv_setting(environ: dict[str, str] | None = None) -> str:
    """One line: how XLA:CPU runs the convolutions estimax's fallback leaves to it.

    The fallback (no oneDNN kernels) keeps jaxlib's default, YNNPACK on: measured per layer
    with it on and off (bench/conv_cpu.py; bench/results/conv_cpu.md, AVX-512 BF16 EPYC), the
    strategies ``cpu_conv._default_strategy`` picks take 5.4 s per ResNet-50 step (batch 16)
    with it and 11.5 s without (its dots are YNNPACK's too), and the same for the MNIST CNN.
    So estimax sets nothing; a user's ``XLA_FLAGS`` still decides, and this line says which.
    """
    flags = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
    values = [f.split("=", 1)[1] for f in flags.split() if f.startswith(_YNN_FLAG + "=")]
    if not values:
        return "XLA's convolutions with YNNPACK (jaxlib's default, measured the faster here)"
    value = values[-1]
    if value == "":
        return f"XLA's convolutions without YNNPACK (XLA_FLAGS has {_YNN_FLAG}=)"
    return f"XLA's convolutions with YNNPACK fusions {value!r} (from XLA_FLAGS)"
