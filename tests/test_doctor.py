"""``python -m estimax.doctor``: one line per fact, and what is missing with its fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from estimax import doctor
from estimax.data import loader
from estimax.ops import native


def _doctor(**env: str) -> list[str]:
    # Emulator variables that other tests of this process set are not this test's.
    inherited = {k: v for k, v in os.environ.items() if k not in doctor.EMULATOR_VARS}
    proc = subprocess.run(
        [sys.executable, "-m", "estimax.doctor"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**inherited, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout.splitlines()


def _line(lines: list[str], prefix: str) -> str:
    found = [ln for ln in lines if ln.startswith(prefix)]
    assert len(found) == 1, (prefix, lines)
    return found[0]


def test_doctor_reports_devices_kernels_workers_storage_and_emulators():
    lines = _doctor(
        XLA_FLAGS="--xla_force_host_platform_device_count=3",
        STORAGE_EMULATOR_HOST="localhost:4443",
    )
    assert _line(lines, "devices: ").startswith("devices: 3 x cpu (cpu), sharing ")
    assert _line(lines, "jax ").startswith("jax 0.10.2, jaxlib 0.10.2; backend cpu")
    kernels = _line(lines, "CPU convolutions: ")
    if native.available():
        assert kernels.startswith("CPU convolutions: oneDNN 3.") and " kernels)" in kernels
    assert "YNNPACK" in _line(lines, "XLA fallback: ")
    workers = len(os.sched_getaffinity(0))
    kind = "process" if workers >= 4 else "thread"  # worker_type="auto", one worker per core
    assert _line(lines, "input workers: ").startswith(f"input workers: {workers} {kind} workers")
    storage = _line(lines, "storage clients: ")
    assert "gcsfs " in storage and "s3fs " in storage and "missing" not in storage
    assert _line(lines, "emulator variables: ") == (
        "emulator variables: STORAGE_EMULATOR_HOST=localhost:4443"
    )
    assert lines[-1].startswith("missing: ")


def test_doctor_says_what_is_missing_and_how_to_install_it(tmp_path):
    # No kernels (a library that is not there) and no oneDNN 3 where it would look.
    lines = _doctor(
        ESTIMAX_ONEDNN_LIB=str(tmp_path / "none.so"), ESTIMAX_ONEDNN_PREFIX=str(tmp_path)
    )
    assert _line(lines, "CPU convolutions: ").startswith("CPU convolutions: XLA's own on ")
    missing = _line(lines, "missing: oneDNN kernels: ")
    assert "oneDNN 3 not found" in missing and "pip install 'estimax[onednn]'" in missing


def test_doctor_reports_a_backend_that_cannot_start_and_goes_on():
    # A platform asked for that is not installed (as a TPU VM without libtpu): one line, no
    # traceback, and the rest of the report still printed.
    lines = _doctor(JAX_PLATFORMS="tpu")
    assert _line(lines, "devices: ").startswith("devices: JAX could not start its backends")
    assert _line(lines, "input workers: ")
    assert "missing: a working JAX backend (see the devices line)" in lines


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 8, 64])
def test_doctor_reports_the_workers_the_loader_starts(monkeypatch, cores):
    # The host's usable cores as the OS reports them, read by the doctor and the Loader alike.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    (line,) = doctor.input_lines()
    ld = loader.Loader([b"x"] * 8, lambda record, rng: 0, 4, shuffle=False)  # starts nothing
    assert ld.num_workers == cores
    assert line.startswith(f"input workers: {cores} {ld.worker_type} workers (")
    assert ld.worker_type == ("process" if cores >= 4 else "thread")


@pytest.mark.parametrize(("cores", "workers"), [(2, 8), (8, 2), (3, 3), (4, 4), (16, 5)])
def test_auto_workers_follow_the_policy_the_doctor_reports(monkeypatch, cores, workers):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    ld = loader.Loader([b"x"] * 8, lambda r, rng: 0, 4, shuffle=False, num_workers=workers)
    # The rule the loader's docstring states: processes from 4 usable cores and 4 workers on.
    assert ld.worker_type == ("process" if min(cores, workers) >= 4 else "thread")
    assert loader.worker_policy(workers, cores)[0] == ld.worker_type
