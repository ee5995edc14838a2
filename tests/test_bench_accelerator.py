"""``make bench-accelerator``'s script runs its tiny CPU version (``bench/accelerator.py``).

On a machine without GPU or TPU the script measures a tiny ResNet through the same code as on
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


@pytest.mark.slow
def test_bench_accelerator_tiny_cpu_version_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "accelerator_cpu_tiny.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "accelerator.py"), "--device=cpu",
         "--steps=2", f"--out={out}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tiny"] and res["model"].startswith("tiny ResNet, 32x32, bfloat16")
    (row,) = res["rows"]
    assert row["batch"] == 8 and "error" not in row
    assert row["synthetic"]["images_per_s"] > 0 and row["synthetic"]["compile_s"] > 0
    assert row["estimator ipl=1"]["fixed"]["steps_per_s"] > 0
    assert row["estimator ipl=5"]["real"]["images_per_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert "TINY CPU VERSION" in table and "| 8 |" in table and "ipl=5 steps/s" in table


def test_bench_accelerator_is_a_make_target():
    makefile = (REPO / "Makefile").read_text()
    assert "bench-accelerator:" in makefile and "bench/accelerator.py" in makefile
