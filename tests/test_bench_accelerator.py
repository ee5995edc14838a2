"""``make bench-accelerator``'s script: its dry run and tiny CPU version (``bench/accelerator.py``).

The dry run prints what a GPU or TPU machine would install, run and write. On a machine without
GPU or TPU the script measures a tiny ResNet through the same code as on
an accelerator (bare step, Estimator at two iterations_per_loop, the real TFRecord input) and
writes its table. This checks that it runs and reports every column, not its figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.mark.slow
def test_bench_accelerator_dry_run_shows_the_install_and_runs_the_tiny_cpu_version(tmp_path):
    out = tmp_path / "accelerator_cpu_tiny.json"
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA_FLAGS}".strip()
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "accelerator.py"), "--dry_run",
         "--steps=2", f"--out={out}", f"--venv={tmp_path / 'venv'}"],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
        # XLA's quick compile: the test checks the columns, not the figures, and the tiny
        # ResNet's bfloat16 steps took about half the run's CPU time compiling at full optimisation.
        env={**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": xla_flags},
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The plan for a GPU and a TPU machine: this checkout's extras, installed editable (estimax
    # is not on the package index), then this script again in that venv, and its result file.
    for extra in ("cuda1", "tpu"):
        install = f" -m pip install -q -c {REPO / 'constraints.txt'} -e '{REPO}[{extra}"
        assert install in proc.stdout, proc.stdout
    assert (
        f"{tmp_path / 'venv' / 'bin' / 'python'} {REPO / 'bench' / 'accelerator.py'}" in proc.stdout
    )
    assert "--no_install --device gpu" in proc.stdout and "--device tpu" in proc.stdout
    assert f"and write {REPO / 'bench' / 'results' / 'accelerator'}.md" in proc.stdout
    assert not (tmp_path / "venv").exists()  # a dry run installs nothing
    res = json.loads(out.read_text())
    assert res["tiny"] and res["model"].startswith("tiny ResNet, 32x32, bfloat16")
    (row,) = res["rows"]
    assert row["batch"] == 8 and "error" not in row
    assert row["synthetic"]["images_per_s"] > 0 and row["synthetic"]["compile_s"] > 0
    assert row["estimator ipl=1"]["fixed"]["steps_per_s"] > 0
    assert row["estimator ipl=5"]["real"]["images_per_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert "TINY CPU VERSION" in table and "| 8 |" in table and "ipl=5 steps/s" in table


def test_bench_accelerator_and_its_dry_run_are_make_targets():
    makefile = (REPO / "Makefile").read_text()
    assert "bench-accelerator:" in makefile and "bench/accelerator.py" in makefile
    assert "bench-accelerator-dry-run:" in makefile and "accelerator.py --dry_run" in makefile
