"""``estimax doctor`` (``python -m estimax.doctor``): what estimax would run on here, one line
per fact.

Prints the JAX release and the devices JAX sees (kind, count, memory), the accelerator plugins
installed, the CPU convolution kernels in use (oneDNN 3 and its instruction set, or XLA's), the
input workers the input pipeline would start, the storage clients and the emulator variables
they follow, and, last, anything missing (a GPU that JAX does not see, kernels not built, ...)
with the command that fixes it. Exit status 0 (it only reports).

``--launch``, run on every process of a job as the job would run the program: the cluster kind
found, the coordinator, this process's index and the count; then a check with every other
process, bounded by ``--timeout`` (default 20 s); then the local devices and the global mesh.
A process that disagrees, or a coordinator not reached, is one ``FATAL:`` line on every process
and exit status 1 -- never a hang.
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


def launch_report(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    timeout: float,
) -> int:
    """``--launch``: prints what this process is in its job, checks it with the others within
    ``timeout`` seconds, joins, and prints the devices; returns the exit status.

    A malformed spec, a disagreement or a coordinator not reached is one ``FATAL:`` line on
    stderr (the same on every process that reached the coordinator) and status 1.
    """
    from estimax.parallel import (
        distributed,  # noqa: PLC0415
        launch,
    )

    try:
        found = launch.detect(coordinator_address, num_processes, process_id, timeout=timeout)
        print(f"launch: {found.describe()}", flush=True)
        if not found.joins:
            return 0
        views = launch.rendezvous(found, timeout)
    except launch.LaunchError as e:
        print(f"FATAL: {e}", file=sys.stderr, flush=True)
        return 1
    hosts = sorted({str(v.get("host")) for v in views})
    print(f"launch: all {len(views)} processes agree (hosts: {', '.join(hosts)})", flush=True)
    import jax  # noqa: PLC0415 - after the check: JAX must not start before it joins

    jax.distributed.initialize(
        found.coordinator,
        found.num_processes,
        found.process_id,
        initialization_timeout=max(10, int(timeout)),
    )
    per_process = Counter(d.process_index for d in jax.devices())
    print(f"launch: local devices: {distributed.describe_devices(jax.local_devices())}")
    print(
        f"launch: global mesh: {jax.device_count()} devices over {jax.process_count()} "
        f"processes ({', '.join(f'process {p}: {n}' for p, n in sorted(per_process.items()))}), "
        f"one data axis of {jax.device_count()} replicas"
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="estimax doctor", description=__doc__)
    p.add_argument(
        "--launch",
        action="store_true",
        help="a launch dry-run: the cluster this process finds ($CLUSTER_SPEC, $TF_CONFIG, "
        "$JAX_COORDINATOR_ADDRESS with $JAX_NUM_PROCESSES and $JAX_PROCESS_ID (Kubeflow), "
        "JAX's detection, or the flags below), a check with every other process of the job "
        "within --timeout, then its devices and the global mesh",
    )
    p.add_argument("--coordinator_address", default="auto", help="HOST:PORT, or auto")
    p.add_argument("--num_processes", type=int, default=None)
    p.add_argument("--process_id", type=int, default=None)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds for the check (default 20)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Prints the report (or, with ``--launch``, the launch dry-run); returns the exit status."""
    args = _parser().parse_args(argv)
    if args.launch:
        return launch_report(
            args.coordinator_address, args.num_processes, args.process_id, args.timeout
        )
    for line in report():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
