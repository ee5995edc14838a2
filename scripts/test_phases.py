#!/usr/bin/env python3
"""`make test`'s runner: the phases, timed, then one table of the run's budget.

The phases are the environments' set-up (each `make` target of the Makefile; a no-op once its
stamp is current), `make lint`, and the six pytest runs (Beam, Spark, TF, libtpu, CUDA in their
own venvs, then the main suite in .venv). After .venv's set-up the side phases run in two lanes
side by side, one process each (lint, Beam, Spark and TF in one; libtpu and CUDA in the other),
so a 2-core machine has both cores busy; then the main suite, alone, with its xdist workers. A
phase run in a lane writes its output to runs/test-report/NAME.log, printed whole when it ends.

Every pytest writes JUnit XML under runs/test-report/; at the end the runner prints each
phase's wall time and passed/failed/skipped counts, the run's wall time, the 15 slowest tests
across all phases, and, as its very last line, the sums in pytest's closing form:
``suite: N passed, N failed, N skipped``. It stops at the first failing phase (a lane beside it
finishes the phase it is in; the table is still printed) and exits non-zero on any failure.
``--serial`` runs every phase alone, in order. It writes the same figures to
runs/test-report/report.json for bench/suite.py.

Stdlib only: it runs under any python3, before any venv exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path

REPORT_DIR = Path("runs/test-report")
SLOWEST = 15
# Eight virtual CPU devices so replication is tested on one machine (tests/conftest.py sets the
# same default; the phases get it explicitly, as the Makefile always gave them).
XLA_FLAGS = "--xla_force_host_platform_device_count=8"


@dataclasses.dataclass(frozen=True)
class Phase:
    """One step of the run: a command, the variables it adds to the environment, whether it is
    a pytest run (then it gets --junitxml and -k narrowing), and its lane: 0 runs alone; a run
    of consecutive phases with lanes above 0 runs as one block, each lane's phases in order and
    the lanes side by side."""

    name: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    pytest: bool = False
    lane: int = 0


@dataclasses.dataclass
class Result:
    """What one phase did: its exit status, wall time and test counts (zeros for a non-pytest
    phase); ``ran`` is False for a phase after the first failure."""

    name: str
    ran: bool
    returncode: int = 0
    seconds: float = 0.0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    pytest: bool = False

    @property
    def ok(self) -> bool:
        return self.ran and self.returncode == 0


@dataclasses.dataclass(frozen=True)
class Case:
    """One test case from a JUnit file: its phase, id and time (setup + call + teardown)."""

    phase: str
    nodeid: str
    seconds: float
    outcome: str  # "passed" | "failed" | "skipped"


def _pytest(name: str, python: str, args: Sequence[str], lane: int = 0, **env: str) -> Phase:
    return Phase(
        name,
        (python, "-m", "pytest", "-q", *args),
        tuple(env.items()),
        pytest=True,
        lane=lane,
    )


# The side phases' two lanes, balanced by the last full run on the 2-core AVX2 EPYC
# (bench/results/suite.md): lint, Beam and TF about 7:10 with their set-ups, libtpu and CUDA
# 7:40; Spark (newer) goes with the first.
# Each is one process, so the two lanes keep two cores busy where the phases one after another
# kept one (14:50 then); the main suite runs after them, alone, so its figure stays its own.
SIDE_A, SIDE_B = 1, 2


def phases(make: str, workers: str, require_onednn: str) -> list[Phase]:
    """The run, in order. Each venv is set up (by its Makefile target) just before its tests."""
    return [
        Phase("setup .venv", (make, "--no-print-directory", "venv", "native", "test-bytecode")),
        Phase("lint", (make, "--no-print-directory", "lint"), lane=SIDE_A),
        Phase("setup .venv-beam", (make, "--no-print-directory", "venv-beam"), lane=SIDE_A),
        _pytest(
            "beam",
            ".venv-beam/bin/python",
            [
                "-p",
                "no:cacheprovider",
                "tests/test_convert.py",
                "tests/test_shard_index.py",
                "-k",
                "beam",
            ],
            lane=SIDE_A,
            ESTIMAX_REQUIRE_BEAM="1",
        ),
        Phase("setup .venv-spark", (make, "--no-print-directory", "venv-spark"), lane=SIDE_A),
        # A standalone Spark cluster (master + 2 workers, JVMs) on 127.0.0.1; in .venv the
        # cluster tests skip (no pyspark) and only the command-line errors run.
        _pytest(
            "spark",
            ".venv-spark/bin/python",
            ["-p", "no:cacheprovider", "tests/test_convert_spark.py"],
            lane=SIDE_A,
            ESTIMAX_REQUIRE_SPARK="1",
        ),
        Phase("setup .venv-tf", (make, "--no-print-directory", "venv-tf"), lane=SIDE_A),
        _pytest(
            "tf",
            ".venv-tf/bin/python",
            [
                "-p",
                "no:cacheprovider",
                "tests/test_migrate_tf.py",
                "tests/test_savedmodel_tf.py",
                "tests/test_tf_reads_estimax_data.py",
            ],
            lane=SIDE_A,
            XLA_FLAGS=XLA_FLAGS,
            ESTIMAX_REQUIRE_TF="1",
        ),
        Phase("setup .venv-tpu", (make, "--no-print-directory", "venv-tpu"), lane=SIDE_B),
        _pytest(
            "libtpu",
            ".venv-tpu/bin/python",
            [
                "-p",
                "no:cacheprovider",
                "tests/test_tpu_compile.py",
                "tests/test_tpu_compile_slices.py",
                "-k",
                "tpu_slice or does_not_fit",
            ],
            lane=SIDE_B,
            XLA_FLAGS=XLA_FLAGS,
            ESTIMAX_REQUIRE_LIBTPU="1",
        ),
        Phase("setup .venv-cuda", (make, "--no-print-directory", "venv-cuda"), lane=SIDE_B),
        _pytest(
            "cuda",
            ".venv-cuda/bin/python",
            [
                "-p",
                "no:cacheprovider",
                "tests/test_gpu_compile.py",
                "-k",
                # mnist: the documented command line, in its own process; no JAX_PLATFORMS.
                "(gpus and resnet) or does_not_fit or documented_command",
            ],
            lane=SIDE_B,
            XLA_FLAGS=XLA_FLAGS,
            ESTIMAX_REQUIRE_CUDA="1",
        ),
        _pytest(
            "main",
            ".venv/bin/python",
            ["--durations=15", "-n", workers, "--dist", "worksteal"],
            XLA_FLAGS=XLA_FLAGS,
            # Fast compiles (tests/conftest.py's default too; it says why and what they do not
            # change). The side phases keep XLA's defaults: libtpu's and CUDA's compilers are
            # what they check.
            JAX_DISABLE_MOST_OPTIMIZATIONS="1",
            ESTIMAX_REQUIRE_ONEDNN=require_onednn,
        ),
    ]


def narrowed(command: Sequence[str], keyword: str) -> list[str]:
    """``command`` with ``-k keyword`` added: and-ed with its own -k expression if it has one
    (pytest keeps only the last -k)."""
    out = list(command)
    if "-k" in out:
        i = out.index("-k") + 1
        out[i] = f"({out[i]}) and ({keyword})"
    else:
        out += ["-k", keyword]
    return out


def read_junit(path: Path, phase: str) -> list[Case]:
    """The test cases of one pytest JUnit XML file (pytest-xdist's controller writes one for
    all workers). An error or failure counts as failed; a skip or xfail as skipped."""
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in tc}
        if tags & {"failure", "error"}:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        classname, name = tc.get("classname", ""), tc.get("name", "")
        nodeid = f"{classname}::{name}" if classname else name
        cases.append(Case(phase, nodeid, float(tc.get("time") or 0.0), outcome))
    return cases


def count(result: Result, cases: Sequence[Case]) -> None:
    """Fills ``result``'s counts from its cases. A failed phase with no failed case (a crash, a
    collection error pytest did not record, a failed set-up or lint) counts as one failure, so
    the closing line never reads as a clean run when a phase failed."""
    result.passed = sum(c.outcome == "passed" for c in cases)
    result.failed = sum(c.outcome == "failed" for c in cases)
    result.skipped = sum(c.outcome == "skipped" for c in cases)
    if result.ran and result.returncode != 0 and result.failed == 0:
        result.failed = 1


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}:{s:02d}"


def table(
    results: Sequence[Result],
    cases: Sequence[Case],
    slowest: int = SLOWEST,
    wall: float | None = None,
) -> str:
    """The run's budget as text: one row per phase (wall time, counts, status), the total (the
    run's ``wall`` time when given: phases in lanes overlap, so it is less than their sum), and
    the ``slowest`` test cases across all phases, slowest first."""
    rows = [("phase", "wall", "passed", "failed", "skipped", "status")]
    for r in results:
        status = "ok" if r.ok else ("not run" if not r.ran else f"FAILED (exit {r.returncode})")
        counts = ("", "", "")
        if r.ran and r.pytest:
            counts = (str(r.passed), str(r.failed), str(r.skipped))
        elif r.ran and r.returncode != 0:
            counts = ("", "1", "")  # what the closing line counts for it
        rows.append((r.name, _clock(r.seconds) if r.ran else "", *counts, status))
    summed = sum(r.seconds for r in results)
    total = summed if wall is None else wall
    p, f, s = totals(results)
    note = "" if wall is None else f"phases summed: {_clock(summed)} (lanes overlap)"
    rows.append(("total", _clock(total), str(p), str(f), str(s), note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["", "=" * 20 + " make test: time per phase " + "=" * 20]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:5], widths[1:5], strict=True)
        ]
        lines.append("  ".join([*cells, row[5]]).rstrip())
        if i == 0 or i == len(rows) - 2:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    top = sorted(cases, key=lambda c: c.seconds, reverse=True)[:slowest]
    if top:
        lines += ["", f"{len(top)} slowest tests (setup + call + teardown):"]
        lines += [f"{c.seconds:8.2f}s  {c.phase:<7} {c.nodeid}" for c in top]
    return "\n".join(lines)


def totals(results: Sequence[Result]) -> tuple[int, int, int]:
    """Passed, failed and skipped summed over the phases."""
    return (
        sum(r.passed for r in results),
        sum(r.failed for r in results),
        sum(r.skipped for r in results),
    )


def closing_line(results: Sequence[Result]) -> str:
    """The last line of the run, in pytest's closing form (CI reads it)."""
    p, f, s = totals(results)
    return f"suite: {p} passed, {f} failed, {s} skipped"


def report(
    results: Sequence[Result],
    cases: Sequence[Case],
    slowest: int = SLOWEST,
    wall: float | None = None,
) -> dict:
    """The figures of the table as JSON-able data (runs/test-report/report.json); ``total_s``
    is the run's wall time when given, else the phases' sum."""
    top = sorted(cases, key=lambda c: c.seconds, reverse=True)[:slowest]
    p, f, s = totals(results)
    return {
        "phases": [dataclasses.asdict(r) for r in results],
        "slowest": [dataclasses.asdict(c) for c in top],
        "total_s": sum(r.seconds for r in results) if wall is None else wall,
        "phases_summed_s": sum(r.seconds for r in results),
        "passed": p,
        "failed": f,
        "skipped": s,
        "ok": all(r.ok for r in results),
    }


Runner = Callable[[Sequence[str], dict[str, str], "Path | None"], int]


def _subprocess_run(command: Sequence[str], env: dict[str, str], log: Path | None) -> int:
    if log is None:
        return subprocess.run(list(command), env=env, check=False).returncode
    with log.open("wb") as out:
        return subprocess.run(
            list(command), env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode


def blocks(plan: Sequence[Phase]) -> list[list[list[int]]]:
    """``plan``'s phases (by index) as the run takes them: a list of blocks, each a list of
    lanes, each the indices of its phases in order. A lane-0 phase is a block of its own."""
    out: list[list[list[int]]] = []
    lanes: dict[int, list[int]] = {}
    for i, phase in enumerate(plan):
        if phase.lane == 0:
            if lanes:
                out.append(list(lanes.values()))
                lanes = {}
            out.append([[i]])
        else:
            lanes.setdefault(phase.lane, []).append(i)
    if lanes:
        out.append(list(lanes.values()))
    return out


def run(
    plan: Sequence[Phase],
    report_dir: Path = REPORT_DIR,
    keyword: str | None = None,
    runner: Runner = _subprocess_run,
    env: dict[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[Result], list[Case]]:
    """Runs ``plan`` (lanes side by side, see ``blocks``) until a phase fails: its lane stops
    there, the other lanes finish the phase they are in and start no other, and no later block
    runs. Returns the results of all phases (those never started marked not run) and every test
    case the JUnit files recorded, in the plan's order."""
    env = dict(os.environ if env is None else env)
    shutil.rmtree(report_dir, ignore_errors=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    results = [Result(p.name, ran=False, pytest=p.pytest) for p in plan]
    found: list[list[Case]] = [[] for _ in plan]
    failed = threading.Event()
    printing = threading.Lock()

    def one(i: int, captured: bool) -> None:
        phase, result = plan[i], results[i]
        stem = phase.name.replace(" ", "_")
        command = list(phase.command)
        junit = report_dir / f"{stem}.xml"
        if phase.pytest:
            if keyword:
                command = narrowed(command, keyword)
            command.append(f"--junitxml={junit}")
        log = report_dir / f"{stem}.log" if captured else None
        with printing:
            where = f" (in a lane; output to {log} when it ends)" if log else ""
            print(f"\n>>> {phase.name}{where}: {shlex.join(command)}", flush=True)
        result.ran = True
        start = clock()
        result.returncode = runner(command, {**env, **dict(phase.env)}, log)
        result.seconds = clock() - start
        if log is not None:
            with printing:
                print(
                    f"\n<<< {phase.name}: exit {result.returncode} after {_clock(result.seconds)}"
                )
                print(log.read_text(errors="replace") if log.exists() else "", end="", flush=True)
        phase_cases = read_junit(junit, phase.name) if junit.exists() else []
        # pytest's exit 5 is "no tests collected": what a -k narrowing leaves of some phases.
        if keyword and phase.pytest and result.returncode == 5:
            result.returncode = 0
        count(result, phase_cases)
        found[i] = phase_cases
        if not result.ok:
            failed.set()

    def lane(indices: Sequence[int], captured: bool) -> None:
        for i in indices:
            if failed.is_set():
                return
            one(i, captured)

    for block in blocks(plan):
        if failed.is_set():
            break
        if len(block) == 1:
            lane(block[0], captured=False)
            continue
        threads = [threading.Thread(target=lane, args=(ix, True)) for ix in block]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results, [c for cs in found for c in cs]


# The compilation cache of `make test`, kept between runs (like uv's wheel cache): most of the
# suite's CPU time is XLA compiling the same tiny programs, run after run, and JAX's persistent
# cache keys each executable by its HLO, the compile options and flags, the backend and
# jax/jaxlib's versions, so a changed program, flag or jaxlib only misses, never gets a stale
# executable. Measured on the 2-core AVX2 EPYC (tests/test_programs.py + tests/test_layouts.py,
# 2 workers): 231 CPU-s with an empty cache, 110 with the last run's.
CACHE_MAX_MB = 2048
# JAX stores an entry zlib- or zstd-compressed (its compilation_cache.py picks by what is
# installed): a write cut short (a test kills a process while it writes) fails to decompress.
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CACHE_SUFFIX = "-cache"


@dataclasses.dataclass
class CacheState:
    """The run's compilation cache: where, and what it held when the run started (``kept``:
    whether it is kept after the run) and what tidying removed."""

    path: str
    kept: bool
    entries: int = 0
    megabytes: float = 0.0
    removed_damaged: int = 0
    removed_oldest: int = 0

    def line(self) -> str:
        """The table's line about it: warm or cold, so every run's figure says which."""
        if not self.kept:
            return f"JAX compilation cache: {self.path}, this run's only (cold; removed after)"
        state = "warm" if self.entries else "cold"
        tidied = ""
        if self.removed_damaged or self.removed_oldest:
            tidied = (
                f"; removed {self.removed_damaged} damaged and {self.removed_oldest} oldest "
                "entries first"
            )
        return (
            f"JAX compilation cache: {self.path}, {self.entries} entries, "
            f"{self.megabytes:.0f} MB at the start ({state}{tidied}); "
            "ESTIMAX_TEST_COMPILATION_CACHE=run for a cold run"
        )


def kept_cache_dir(env: dict[str, str]) -> str:
    """Where the kept cache lives: ESTIMAX_TEST_CACHE_DIR, else $XDG_CACHE_HOME (~/.cache)
    /estimax/test-jax-cache."""
    if env.get("ESTIMAX_TEST_CACHE_DIR"):
        return env["ESTIMAX_TEST_CACHE_DIR"]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "estimax", "test-jax-cache")


def _decompresses(data: bytes) -> bool:
    """Whether a cache entry is whole. An entry in a format this Python cannot read (zstd
    without a zstd module) counts as whole: it is JAX's to judge."""
    try:
        if data.startswith(_ZSTD_MAGIC):
            try:
                from compression import zstd  # Python 3.14+
            except ImportError:
                return True
            zstd.decompress(data)
        else:
            import zlib

            zlib.decompress(data)
    except Exception:  # noqa: BLE001 (any decoder error is a damaged entry)
        return False
    return True


def tidy_cache(path: str, max_mb: float = CACHE_MAX_MB) -> CacheState:
    """Removes the kept cache's damaged entries (JAX would warn on each read and never write
    them again), then its oldest entries while it holds more than ``max_mb``; what it holds."""
    state = CacheState(path, kept=True)
    os.makedirs(path, exist_ok=True)
    entries = []
    for entry in os.scandir(path):
        if not entry.name.endswith(_CACHE_SUFFIX) or not entry.is_file():
            continue
        try:
            with open(entry.path, "rb") as f:
                whole = _decompresses(f.read())
            stat = entry.stat()
        except OSError:
            continue
        if not whole:
            _remove_entry(entry.path)
            state.removed_damaged += 1
            continue
        entries.append((stat.st_mtime, stat.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    for _, size, entry_path in sorted(entries):
        if total <= max_mb * 2**20:
            break
        _remove_entry(entry_path)
        total -= size
        state.removed_oldest += 1
    state.entries = len(entries) - state.removed_oldest
    state.megabytes = total / 2**20
    return state


def _remove_entry(entry_path: str) -> None:
    """An entry and JAX's access-time file beside it (written where eviction is on)."""
    for p in (entry_path, entry_path[: -len(_CACHE_SUFFIX)] + "-atime"):
        try:
            os.remove(p)
        except OSError:
            pass


def _compilation_cache(env: dict[str, str]) -> CacheState | None:
    """One JAX persistent compilation cache for every phase (keys carry jax/jaxlib's versions
    and the backend, so phases with another jaxlib or compiler only miss): the kept one,
    tidied (``tidy_cache``), or with ESTIMAX_TEST_COMPILATION_CACHE=run a new one for this run
    only, removed after it. None when the caller chose one or turned it off
    (ESTIMAX_TEST_COMPILATION_CACHE=0, tests/conftest.py)."""
    mode = env.get("ESTIMAX_TEST_COMPILATION_CACHE", "1")
    if mode == "0" or env.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    if mode == "run":
        state = CacheState(tempfile.mkdtemp(prefix="estimax-test-jax-cache-"), kept=False)
    else:
        state = tidy_cache(kept_cache_dir(env))
    env["JAX_COMPILATION_CACHE_DIR"] = state.path
    return state


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the phases; prints the table and the closing line; 0 only if every phase passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", default="make", help="the make to call for set-up and lint")
    parser.add_argument("--workers", default="3", help="pytest-xdist workers for the main phase")
    parser.add_argument("--require_onednn", default="0", help="ESTIMAX_REQUIRE_ONEDNN for main")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated phase names to run (e.g. 'setup .venv,main'); default all",
    )
    parser.add_argument("-k", dest="keyword", help="narrow every pytest phase by this -k")
    parser.add_argument("--report_dir", default=str(REPORT_DIR))
    parser.add_argument("--dry_run", action="store_true", help="print the phases, run nothing")
    parser.add_argument(
        "--serial", action="store_true", help="every phase alone, in order (no lanes side by side)"
    )
    args = parser.parse_args(argv)

    plan = phases(args.make, args.workers, args.require_onednn)
    if args.serial:
        plan = [dataclasses.replace(p, lane=0) for p in plan]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = sorted(set(wanted) - {p.name for p in plan})
        if unknown:
            parser.error(f"unknown phase(s) {unknown}; phases: {[p.name for p in plan]}")
        plan = [p for p in plan if p.name in wanted]
    if args.dry_run:
        for p in plan:
            env = " ".join(f"{k}={v}" for k, v in p.env)
            lane = f" [lane {p.lane}]" if p.lane else ""
            print(f"{p.name}: {env + ' ' if env else ''}{shlex.join(p.command)}{lane}")
        return 0

    meta = {
        "command": ("make test: " if os.environ.get("MAKELEVEL") else "")
        + shlex.join(
            ["python3", "scripts/test_phases.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "subset": bool(args.only or args.keyword),
        "load_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date": time.strftime("%Y-%m-%d"),
    }
    env = dict(os.environ)
    cache = _compilation_cache(env)
    if cache:
        print(cache.line(), flush=True)
        meta["compilation_cache"] = dataclasses.asdict(cache)
    start = time.monotonic()
    try:
        results, cases = run(plan, Path(args.report_dir), args.keyword, env=env)
    finally:
        if cache and not cache.kept:
            shutil.rmtree(cache.path, ignore_errors=True)
    wall = time.monotonic() - start
    Path(args.report_dir, "report.json").write_text(
        json.dumps({**meta, **report(results, cases, wall=wall)}, indent=1) + "\n"
    )
    print(table(results, cases, wall=wall))
    if cache:
        print(cache.line())
    print(closing_line(results), flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
