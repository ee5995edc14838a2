"""bench/convert_engines.py's report (#52's check "the benchmark table with the load stated"):
every engine measured is a row, an engine not measured says why, and the machine, the load
during the runs and the command are stated."""

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location(
        "bench_convert_engines", ROOT / "bench/convert_engines.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_convert_engines"] = module
    spec.loader.exec_module(module)
    return module


engines = _load()


def _row(engine: str, wall: float, cpu: float, load: tuple[float, float]) -> dict:
    images = 100
    return {
        "engine": engine,
        "images": images,
        "wall_s": wall,
        "cpu_s": cpu,
        "fixed_wall_s": wall / 4,
        "fixed_cpu_s": cpu / 4,
        "img_per_s": images / wall,
        "marginal_img_per_s": images / (wall * 3 / 4),
        "cpu_s_per_img": cpu / images,
        "marginal_cpu_s_per_img": cpu * 3 / 4 / images,
        "load_before": load[0],
        "load_after": load[1],
    }


def test_the_report_states_each_engine_the_load_and_the_command(monkeypatch):
    rows = [
        _row("local, 1 process", 2.0, 1.0, (3.0, 4.0)),
        _row("Beam FnApiRunner, 2 workers", 9.0, 5.0, (4.0, 6.5)),
        _row("Spark standalone, 2 workers x 1 core", 30.0, 20.0, (5.0, 5.5)),
        {"engine": "Spark on YARN", "missing": "no cluster"},
    ]
    driver = {"files": 10, "shards": 2, "tasks_mb": 1.0, "manifest_mb": 0.1}
    for step in ("listing", "shuffle", "plan", "pickle_tasks", "manifest"):
        driver |= {f"{step}_s": 0.5, f"{step}_cpu_s": 0.25}
    args = argparse.Namespace(images=100, shards=2, beam_python="/venvs/beam/bin/python")
    monkeypatch.setattr(sys, "argv", ["bench/convert_engines.py", "--images=100"])
    text = engines.report(rows, driver, args)
    assert "load average 3.0-6.5 during the runs" in text  # lowest before, highest after
    assert "bench/convert_engines.py --images=100" in text
    assert "(Beam: `/venvs/beam/bin/python`)" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    for row in rows[:3]:
        assert any(line.startswith(f"| {row['engine']} | {row['wall_s']:.1f} |") for line in table)
    assert "| Spark on YARN | not measured: no cluster |" in text
    assert "## Projection" in text  # from the Spark row
