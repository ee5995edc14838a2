"""The whole test suite's time on the machine at hand, one figure per CPU kind.

    python3 bench/suite.py                              # runs `make test`'s phases, then records
    python3 bench/suite.py --report runs/test-report/report.json   # records a `make test` run

Runs scripts/test_phases.py (what `make test` runs: set-up, lint, the Beam, Spark, TF, libtpu, CUDA
and main test phases, each timed) or takes the report.json an earlier run wrote, and keeps its
figures in ``bench/results/suite.json``, one row per CPU kind and compilation cache (warm: the
run found the JAX compilation cache that `make test` keeps between runs filled; cold: empty, or
a run of its own with ``ESTIMAX_TEST_COMPILATION_CACHE=run``): the CPU's model (with its family
and model numbers: VMs often name only "AMD EPYC"), its widest vector ISA (AVX2, AVX-512,
AVX512-BF16, AMX) and its core count. A new kind adds a row; a rerun on a kind replaces its row.
``bench/results/suite.md`` is rewritten from the JSON each time: per kind, each phase's wall
time, the test counts, the load average at the start, the command, and the 15 slowest tests.

Arguments after ``--`` go to scripts/test_phases.py (e.g. ``-- --only main -k layouts``); a run
narrowed so is recorded with its command and marked as a subset, never as the suite's figure.
Stdlib only, like the runner: it runs under any python3.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNNER = ROOT / "scripts" / "test_phases.py"
# The table's columns: set-up phases are summed into one, the others shown as they are.
PHASE_COLUMNS = ("lint", "beam", "spark", "tf", "libtpu", "cuda", "main")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def isa(flags: set[str]) -> str:
    """The widest vector ISA among a CPU's flags, as the suite's figures depend on it."""
    if {"amx_tile", "amx_bf16"} & flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return platform.machine() or "unknown"


def machine() -> dict[str, Any]:
    """This machine's CPU kind: model (family/model numbers where the OS gives them), ISA, cores."""
    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in info and "model" in info:
        model += f" (family {info['cpu family']} model {info['model']})"
    return {
        "cpu": model,
        "isa": isa(set(info.get("flags", "").split())),
        "cores": os.cpu_count() or 0,
    }


def kind(row: dict[str, Any]) -> tuple[str, str, int, str]:
    """What one row stands for: a rerun with the same CPU kind and cache state replaces it."""
    return (row["cpu"], row["isa"], row["cores"], row.get("cache", "cold"))


def cache_state(report: dict[str, Any]) -> str:
    """ "warm" when the run started with the kept compilation cache holding entries, else
    "cold" (an empty or per-run cache; reports from before the kept cache had a per-run one)."""
    cache = report.get("compilation_cache") or {}
    return "warm" if cache.get("kept") and cache.get("entries") else "cold"


def merge(rows: list[dict[str, Any]], row: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows`` with ``row`` in place of any row of its CPU kind, sorted by kind."""
    kept = [r for r in rows if kind(r) != kind(row)]
    return sorted([*kept, row], key=kind)


def row_from_report(report: dict[str, Any], command: str, subset: bool) -> dict[str, Any]:
    """One result row: this machine's kind, the report's phase times, counts and slowest tests."""
    phases = {p["name"]: p for p in report["phases"]}
    return {
        **machine(),
        "cache": cache_state(report),
        "load_start": report.get("load_start"),
        "date": report.get("date") or datetime.date.today().isoformat(),
        "command": command,
        "subset": subset,
        "ok": report["ok"],
        "total_s": report["total_s"],
        "setup_s": sum(p["seconds"] for n, p in phases.items() if n.startswith("setup")),
        "phases": {n: {"seconds": p["seconds"], "ran": p["ran"]} for n, p in phases.items()},
        "passed": report["passed"],
        "failed": report["failed"],
        "skipped": report["skipped"],
        "slowest": report["slowest"],
    }


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return ""
    m, s = divmod(round(seconds), 60)
    return f"{m}:{s:02d}"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """suite.md: the table of phase times per CPU kind, then each kind's slowest tests."""
    out = [
        "# The test suite's time per CPU kind",
        "",
        "`bench/suite.py`: `make test`'s phases (scripts/test_phases.py), wall time m:ss, fresh "
        "or existing environments as the command says (set-up is the environments' build; near "
        "0 when their stamps are current). One row per CPU kind and compilation cache (warm: the "
        "JAX compilation cache `make test` keeps between runs was filled at the start; cold: "
        "empty); a rerun of both replaces its row. "
        "A subset row (`--only`, `-k`) is not the suite's figure.",
        "",
        "| CPU | ISA | cores | cache | load at start | total | set-up | "
        + " | ".join(PHASE_COLUMNS)
        + " | passed / failed / skipped | date | command |",
        "|---|---|---|---|---|---|---|" + "---|" * len(PHASE_COLUMNS) + "---|---|---|",
    ]
    for r in rows:
        phases = r["phases"]
        cells = [
            _clock(phases[p]["seconds"]) if phases.get(p, {}).get("ran") else ""
            for p in PHASE_COLUMNS
        ]
        load = "" if r["load_start"] is None else f"{r['load_start']:.2f}"
        note = " (subset)" if r["subset"] else ("" if r["ok"] else " (failed)")
        out.append(
            f"| {r['cpu']} | {r['isa']} | {r['cores']} | {r.get('cache', 'cold')} | {load} | "
            f"{_clock(r['total_s'])}{note} | "
            f"{_clock(r['setup_s'])} | "
            + " | ".join(cells)
            + f" | {r['passed']} / {r['failed']} / {r['skipped']} | {r['date']} | "
            f"`{r['command']}` |"
        )
    for r in rows:
        out += [
            "",
            f"## Slowest tests: {r['cpu']}, {r['isa']}, {r['cores']} cores, "
            f"{r.get('cache', 'cold')} cache",
            "",
        ]
        out += ["| s | phase | test |", "|---|---|---|"]
        out += [f"| {c['seconds']:.1f} | {c['phase']} | `{c['nodeid']}` |" for c in r["slowest"]]
    return "\n".join(out) + "\n"


def save(path: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Merges ``row`` into the JSON at ``path`` and rewrites it and its .md; the rows."""
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = merge(rows, row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(rows))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Runs (or reads) one suite run and records it; the runner's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    runner_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, help="a report.json to record instead of running")
    parser.add_argument("--command", help="the command to record (default: what ran)")
    parser.add_argument("--out", type=Path, default=RESULTS / "suite.json")
    args = parser.parse_args(own)

    status = 0
    if args.report is None:
        report_dir = ROOT / "runs" / "test-report"
        command = [sys.executable, str(RUNNER.relative_to(ROOT)), *runner_args]
        status = subprocess.run(command, cwd=ROOT, check=False).returncode
        args.report = report_dir / "report.json"
        recorded = shlex.join(["python3", *command[1:]])
    else:
        recorded = "make test"
    report = json.loads(args.report.read_text())
    subset = bool({"--only", "-k"} & set(runner_args)) or bool(report.get("subset"))
    row = row_from_report(report, args.command or report.get("command") or recorded, subset)
    save(args.out, row)
    print(
        f"bench/suite.py: {row['cpu']}, {row['isa']}, {row['cores']} cores, {row['cache']} "
        f"cache -> {args.out}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
