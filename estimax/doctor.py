"""``python -m estimax.doctor``: what estimax would run on here, one line per fact.

Prints the JAX release and the devices JAX sees (kind, count, memory), the accelerator plugins
installed, the CPU convolution kernels in use (oneDNN 3 and its instruction set, or XLA's), the
input workers the input pipeline would start, the storage clients and the emulator variables
they follow, and, last, anything missing (a GPU that JAX does not see, kernels not built, ...)
with the command that fixes it. Exit status 0 (it only reports).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

# Accelerator plugins by distribution name, and the extra that installs each.
_PLUGINS = {
    "jax-cuda12-plugin": "cuda12",
    "jax-cuda13-plugin": "cuda13",
    "libtpu": "tpu",
}
_STORAGE_CLIENTS = ("gcsfs", "s3fs", "google-cloud-storage", "tensorstore", "google-cloud-bigtable")
# The variables estimax.storage and estimax.data.bigtable follow (see their docstrings).
EMULATOR_VARS = (
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "BIGTABLE_EMULATOR_HOST",
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _host_memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return _gib(int(line.split()[1]) * 1024) + " host memory"
    except OSError:
        pass
    return "host memory"


def _accelerator_hardware() -> list[str]:
    """Accelerators the OS shows, whether or not JAX can use them."""
    found = []
    if Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").exists():
        found.append("gpu")
    if list(Path("/dev").glob("accel*")) or list(Path("/dev").glob("vfio/[0-9]*")):
        found.append("tpu")
    return found


def device_lines(missing: list[str]) -> list[str]:
    """The JAX release and one line per kind of device JAX sees (appends to ``missing``)."""
    import jax  # noqa: PLC0415 - the rest of the report does not need JAX

    lines = [f"jax {jax.__version__}, jaxlib {_version('jaxlib')}; backend {jax.default_backend()}"]
    groups: Counter[tuple[str, str, str]] = Counter()
    for d in jax.devices():
        stats = None
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
        limit = (stats or {}).get("bytes_limit")
        memory = f"{_gib(limit)} device memory each" if limit else f"sharing {_host_memory()}"
        groups[(d.platform, d.device_kind, memory)] += 1
    for (platform, kind, memory), count in groups.items():
        lines.append(f"devices: {count} x {platform} ({kind}), {memory}")
    plugins = [f"{d} {v}" for d in _PLUGINS if (v := _version(d))]
    lines.append("accelerator plugins: " + (", ".join(plugins) if plugins else "none installed"))
    platforms = {p for p, _, _ in groups}
    for hw in _accelerator_hardware():
        if hw not in platforms:
            # estimax is not on the package index: the extras install from a checkout.
            extra = "'.[cuda12]' (or '.[cuda13]')" if hw == "gpu" else "'.[tpu]'"
            missing.append(
                f"this machine has a {hw.upper()} that JAX does not see: "
                f"pip install -e {extra} in estimax's checkout"
            )
    return lines


def cpu_kernel_lines(missing: list[str]) -> list[str]:
    """The CPU convolution kernels estimax.ops would use (appends to ``missing``)."""
    from estimax.ops import cpu_runtime, native  # noqa: PLC0415

    lines = [f"CPU convolutions: {native.status()}"]
    lines.append(f"XLA fallback: {cpu_runtime.xla_cpu_conv_setting()}")
    if not native.available() and os.environ.get("ESTIMAX_ONEDNN", "1") != "0":
        try:
            onednn = native.find_onednn()
            if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
                missing.append("a C++ compiler for estimax's oneDNN kernels (install g++)")
            else:
                missing.append(
                    f"estimax's oneDNN kernels are not built (oneDNN {onednn.version} is "
                    f"installed): python -m estimax.ops.native build"
                )
        except RuntimeError as e:
            missing.append(f"oneDNN kernels: {e}")
    return lines


def input_lines() -> list[str]:
    """The input workers ``imagenet.input_fn`` and ``Loader`` would start by default: one per
    usable core, of the kind the loader's ``worker_type="auto"`` picks for them."""
    from estimax.data.loader import usable_cores, worker_policy  # noqa: PLC0415

    cores = usable_cores()
    worker_type, why = worker_policy(cores, cores)
    return [
        f"input workers: {cores} {worker_type} workers (one per usable core; "
        f"worker_type='auto': {why})"
    ]


def storage_lines() -> list[str]:
    """Storage clients installed and the emulator variables set."""
    clients = [f"{c} {_version(c) or 'missing'}" for c in _STORAGE_CLIENTS]
    lines = ["storage clients: " + ", ".join(clients)]
    set_vars = [f"{v}={os.environ[v]}" for v in EMULATOR_VARS if os.environ.get(v)]
    lines.append("emulator variables: " + (", ".join(set_vars) if set_vars else "none set"))
    return lines


def report() -> list[str]:
    """Every line of the report, the missing items last."""
    missing: list[str] = []
    lines = [f"estimax {_version('estimax') or '(not installed)'}, Python {sys.version.split()[0]}"]
    try:
        lines += device_lines(missing)
    except Exception as e:  # noqa: BLE001 - a broken plugin must not hide the rest
        first = str(e).splitlines()[0] if str(e) else ""
        lines.append(f"devices: JAX could not start its backends ({type(e).__name__}: {first})")
        missing.append("a working JAX backend (see the devices line)")
    lines += cpu_kernel_lines(missing)
    lines += input_lines()
    lines += storage_lines()
    lines += [f"missing: {m}" for m in missing] or ["missing: nothing"]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Prints the report; returns the exit status."""
    argparse.ArgumentParser(prog="python -m estimax.doctor", description=__doc__).parse_args(argv)
    for line in report():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
