"""bench/suite.py's results: one row per CPU kind in suite.json, a rerun on a kind replacing its
row, and suite.md rewritten from them."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("bench_suite", ROOT / "bench/suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_suite"] = module
    spec.loader.exec_module(module)
    return module


suite = _load()


def _report(main_s: float, passed: int, *, ok: bool = True) -> dict:
    """A report.json as scripts/test_phases.py writes it."""
    phases = [
        {"name": "setup .venv", "ran": True, "returncode": 0, "seconds": 300.0},
        {"name": "lint", "ran": True, "returncode": 0, "seconds": 90.0},
        {"name": "setup .venv-tf", "ran": True, "returncode": 0, "seconds": 60.0},
        {"name": "tf", "ran": True, "returncode": 0, "seconds": 200.0},
        {"name": "main", "ran": True, "returncode": 0 if ok else 1, "seconds": main_s},
    ]
    return {
        "phases": phases,
        "slowest": [{"phase": "main", "nodeid": "tests.test_a::test_slow", "seconds": 61.5}],
        "total_s": sum(p["seconds"] for p in phases),
        "passed": passed,
        "failed": 0 if ok else 1,
        "skipped": 3,
        "ok": ok,
        "load_start": 1.25,
        "date": "2026-12-05",
        "command": "make test",
    }


def _as(monkeypatch, cpu: str, isa: str, cores: int = 2) -> None:
    monkeypatch.setattr(suite, "machine", lambda: {"cpu": cpu, "isa": isa, "cores": cores})


def test_rows_are_kept_per_cpu_kind_and_a_rerun_replaces_its_kind(tmp_path, monkeypatch):
    out = tmp_path / "suite.json"
    _as(monkeypatch, "AMD EPYC (family 23 model 49)", "AVX2")
    suite.save(out, suite.row_from_report(_report(900.0, 1300), "make test", subset=False))
    _as(monkeypatch, "AMD EPYC (family 26 model 2)", "AVX512-BF16")
    suite.save(out, suite.row_from_report(_report(500.0, 1300), "make test", subset=False))
    _as(monkeypatch, "AMD EPYC (family 23 model 49)", "AVX2")
    rows = suite.save(out, suite.row_from_report(_report(800.0, 1310), "make test", False))

    assert rows == json.loads(out.read_text())
    assert [(r["isa"], r["phases"]["main"]["seconds"], r["passed"]) for r in rows] == [
        ("AVX2", 800.0, 1310),  # the rerun replaced the first AVX2 row
        ("AVX512-BF16", 500.0, 1300),
    ]
    assert rows[0]["setup_s"] == 360.0  # the set-up phases summed

    md = out.with_suffix(".md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| AMD")]
    assert len(table) == 2
    avx2 = [c.strip() for c in table[0].split("|")]
    assert avx2[1:8] == [
        "AMD EPYC (family 23 model 49)",
        "AVX2",
        "2",
        "cold",
        "1.25",
        "24:10",
        "6:00",
    ]
    assert avx2[8:10] == ["1:30", ""]  # lint; beam did not run in this report
    assert "13:20" in avx2 and "1310 / 0 / 3" in avx2
    assert md.count("tests.test_a::test_slow") == 2


def test_a_warm_cache_run_is_a_row_of_its_own_beside_the_cold_one(tmp_path, monkeypatch):
    out = tmp_path / "suite.json"
    _as(monkeypatch, "AMD EPYC (family 23 model 49)", "AVX2")
    cold = {**_report(2000.0, 1500), "compilation_cache": {"kept": True, "entries": 0}}
    warm = {**_report(900.0, 1500), "compilation_cache": {"kept": True, "entries": 812}}
    per_run = {**_report(1900.0, 1500), "compilation_cache": {"kept": False, "entries": 0}}
    suite.save(out, suite.row_from_report(cold, "make test", subset=False))
    suite.save(out, suite.row_from_report(warm, "make test", subset=False))
    rows = suite.save(out, suite.row_from_report(per_run, "make test", subset=False))
    # The per-run cache's run replaced the cold row; the warm one stands beside it.
    assert [(r["cache"], r["phases"]["main"]["seconds"]) for r in rows] == [
        ("cold", 1900.0),
        ("warm", 900.0),
    ]
    md = out.with_suffix(".md").read_text()
    assert "| AVX2 | 2 | warm | 1.25 | 25:50 |" in md and "| AVX2 | 2 | cold | 1.25 | 42:30 |" in md
    assert "## Slowest tests: AMD EPYC (family 23 model 49), AVX2, 2 cores, warm cache" in md


def test_subset_and_failed_runs_are_labelled(tmp_path, monkeypatch):
    out = tmp_path / "suite.json"
    _as(monkeypatch, "Intel Xeon", "AMX", 4)
    suite.save(out, suite.row_from_report(_report(10.0, 5), "x --only main", subset=True))
    assert "(subset)" in out.with_suffix(".md").read_text()
    suite.save(out, suite.row_from_report(_report(10.0, 5, ok=False), "make test", False))
    md = out.with_suffix(".md").read_text()
    assert "(failed)" in md and "(subset)" not in md


def test_isa_names_the_widest_vector_extension():
    assert suite.isa({"avx2", "avx512f", "avx512_bf16", "amx_tile"}) == "AMX"
    assert suite.isa({"avx2", "avx512f", "avx512_bf16"}) == "AVX512-BF16"
    assert suite.isa({"avx2", "avx512f"}) == "AVX-512"
    assert suite.isa({"sse2", "avx2"}) == "AVX2"


def test_main_records_a_report_file(tmp_path, monkeypatch, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report(100.0, 7)))
    out = tmp_path / "res" / "suite.json"
    _as(monkeypatch, "Some CPU", "AVX2")
    assert suite.main(["--report", str(report), "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["cpu"], row["command"], row["passed"], row["subset"]) == (
        "Some CPU",
        "make test",
        7,
        False,
    )
