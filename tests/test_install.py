"""``estimax[cuda12]``, ``[cuda13]`` and ``[tpu]`` resolve against estimax's pinned tree.

Each extra, with estimax's own pinned dependencies and ``constraints.txt``, goes through uv's
resolver (``uv pip compile``) for Linux x86-64 (``PLATFORM``) and CPython 3.11. uv reads the index's
per-wheel metadata (PEP 658), so none of the multi-hundred-MB CUDA or TPU wheels is
downloaded: the whole check takes about a second. Without the index (offline CI) the tests
skip and say so; a conflict fails them.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# What each extra must bring, at jax 0.10.2's own releases.
EXPECTED = {
    "cuda12": {"jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda12-plugin": "0.10.2",
               "jax-cuda12-pjrt": "0.10.2", "nvidia-cudnn-cu12": None},
    "cuda13": {"jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda13-plugin": "0.10.2",
               "jax-cuda13-pjrt": "0.10.2", "nvidia-cudnn-cu13": None},
    "tpu": {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"},
    # --compile_for=h100:8 without a GPU: the plugin and ptxas, none of the runtime libraries.
    "gpu-compile": {"jax-cuda12-plugin": "0.10.2", "jax-cuda12-pjrt": "0.10.2",
                    "nvidia-cuda-nvcc-cu12": "12.9.86"},
    # make's oneDNN for the CPU kernels: its runtimes' tree is pinned in constraints.txt too.
    "onednn": {"onednn-devel": "2026.1.0", "onednn": "2026.1.0", "tbb": None},
}  # fmt: skip

# The oldest Linux each extra's wheels install on: libtpu's need glibc 2.31 (TPU VMs run
# Ubuntu 22.04, glibc 2.35); the CUDA plugins' 2.27; estimax's own tree 2.28 (Intel's wheels).
PLATFORM = {
    "cuda12": "x86_64-manylinux_2_28",
    "cuda13": "x86_64-manylinux_2_28",
    "tpu": "x86_64-manylinux_2_31",
    "gpu-compile": "x86_64-manylinux_2_28",
    "onednn": "x86_64-manylinux_2_28",
}

# uv's words when it cannot reach the index (DNS, refused or timed-out connections, proxies).
_OFFLINE = re.compile(
    r"dns error|failed to lookup|tcp connect|connection (refused|reset)|timed out|"
    r"network is unreachable|error sending request|offline",
    re.IGNORECASE,
)


def _uv() -> str:
    uv = pytest.importorskip("uv", reason="uv (the test extra) is not installed")
    return uv.find_uv_bin()


def _certificates() -> dict[str, str]:
    # Where pip is told of a CA bundle (a proxy's own CA), tell uv too.
    bundle = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE")
    return {"SSL_CERT_FILE": bundle} if bundle and "SSL_CERT_FILE" not in os.environ else {}


def _resolve(extra: str, tmp_path: Path) -> dict[str, str]:
    requirements = tmp_path / f"{extra}.in"
    requirements.write_text(
        "\n".join(PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"][extra]) + "\n"
    )
    proc = subprocess.run(
        [
            _uv(),
            "pip",
            "compile",
            "--no-cache",
            "--no-header",
            "--quiet",
            "--python-version=3.11",
            f"--python-platform={PLATFORM[extra]}",
            "-c",
            str(REPO / "constraints.txt"),
            str(requirements),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "UV_HTTP_TIMEOUT": "30", **_certificates()},
    )
    if proc.returncode != 0 and _OFFLINE.search(proc.stderr):
        pytest.skip(f"package index unreachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    pins = {}
    for line in proc.stdout.splitlines():
        if "==" in line and not line.startswith(" "):
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()] = version.strip()
    return pins


@pytest.mark.parametrize("extra", sorted(EXPECTED))
def test_extra_resolves_against_the_pinned_tree(extra, tmp_path):
    pins = _resolve(extra, tmp_path)
    for name, version in EXPECTED[extra].items():
        assert name in pins, f"estimax[{extra}] does not bring {name}: {sorted(pins)}"
        if version is not None:
            assert pins[name] == version, (name, pins[name])
    if extra == "gpu-compile":  # compiling needs none of the 3 GB the CUDA runtime brings
        assert not [p for p in pins if p.startswith("nvidia-") and "nvcc" not in p], pins
    # The rest of estimax's tree keeps its pins (constraints.txt) with the extra installed.
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            key = re.sub(r"[-_.]+", "-", name).lower()
            if key in pins:
                assert pins[key] == version.strip(), (key, pins[key], version)


def test_extras_are_pinned_to_the_jax_release_estimax_pins():
    jax_pin = next(r for r in PYPROJECT["dependencies"] if r.startswith("jax=="))
    release = jax_pin.split("==")[1]
    for extra in ("cuda12", "cuda13"):
        plugin = [r for r in PYPROJECT["optional-dependencies"][extra] if "plugin" in r]
        assert plugin == [f"jax-{extra}-plugin[with-cuda]=={release}"], plugin
