"""scripts/test_phases.py, `make test`'s runner: its phases' JUnit files become one table, the 15
slowest tests and a closing line CI reads; it stops at the first failing phase and says so."""

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("test_phases", ROOT / "scripts/test_phases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["test_phases"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


tp = _load()


def _junit(path: Path, cases: list[tuple[str, float, str]]) -> None:
    """A pytest-style JUnit XML file: (name, seconds, outcome) per test case."""
    body = []
    for name, seconds, outcome in cases:
        inner = {"failed": "<failure message='boom'>trace</failure>", "error": "<error/>"}.get(
            outcome, "<skipped message='no'/>" if outcome == "skipped" else ""
        )
        body.append(
            f'<testcase classname="tests.test_x" name="{name}" time="{seconds}">{inner}</testcase>'
        )
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        + "".join(body)
        + "</testsuite></testsuites>"
    )


class FakeRunner:
    """Stands in for subprocess: each pytest phase "writes" the JUnit file given for it and
    returns the given exit status; it records what ran, with which environment."""

    def __init__(self, outcomes: dict[str, tuple[int, list[tuple[str, float, str]] | None]]):
        self.outcomes = outcomes
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, command, env, log=None):
        self.calls.append((list(command), env))
        self.logs = getattr(self, "logs", []) + [log]
        name = command[-1] if command[0] == "phase" else command[1]
        rc, cases = self.outcomes[name]
        junit = [c for c in command if c.startswith("--junitxml=")]
        if junit and cases is not None:
            _junit(Path(junit[0].split("=", 1)[1]), cases)
        return rc


def _plan():
    return [
        tp.Phase("lint", ("phase", "lint")),
        tp.Phase("beam", ("py", "beam", "-k", "beam"), (("ESTIMAX_REQUIRE_BEAM", "1"),), True),
        tp.Phase("tf", ("py", "tf"), (("ESTIMAX_REQUIRE_TF", "1"),), True),
        tp.Phase("main", ("py", "main"), pytest=True),
    ]


def _ticks():
    t = iter(range(0, 10_000, 30))  # each call of the clock 30 s after the last
    return lambda: float(next(t))


def test_table_sums_phases_and_lists_the_slowest_tests_across_them(tmp_path):
    runner = FakeRunner(
        {
            "lint": (0, None),
            "beam": (0, [("test_a", 1.5, "passed"), ("test_b", 0.1, "skipped")]),
            "tf": (0, [("test_c", 40.0, "passed")]),
            "main": (0, [(f"test_m{i}", float(i), "passed") for i in range(20)]),
        }
    )
    results, cases = tp.run(_plan(), tmp_path / "rep", runner=runner, env={}, clock=_ticks())

    assert [r.name for r in results] == ["lint", "beam", "tf", "main"]
    assert all(r.ok for r in results)
    assert [r.seconds for r in results] == [30.0] * 4
    assert (results[1].passed, results[1].skipped) == (1, 1)
    assert tp.totals(results) == (22, 0, 1)
    # Each phase's own variables, and a JUnit file per pytest phase under the report dir.
    assert runner.calls[1][1]["ESTIMAX_REQUIRE_BEAM"] == "1"
    assert "ESTIMAX_REQUIRE_BEAM" not in runner.calls[2][1]
    assert runner.calls[1][0][-1] == f"--junitxml={tmp_path / 'rep' / 'beam.xml'}"
    assert not any(c.startswith("--junitxml") for c in runner.calls[0][0])

    text = tp.table(results, cases)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1].isalpha()}
    assert rows["tf"][:5] == ["tf", "0:30", "1", "0", "0"]
    assert rows["total"][:5] == ["total", "2:00", "22", "0", "1"]
    head, _, tail = text.partition("15 slowest tests")
    assert "test_m0" not in head  # the table itself lists phases only
    slow = [line.split() for line in tail.splitlines()[1:]]
    assert len(slow) == 15
    assert [s[2] for s in slow[:3]] == [
        "tests.test_x::test_c",
        "tests.test_x::test_m19",
        "tests.test_x::test_m18",
    ]
    assert [float(s[0][:-1]) for s in slow] == sorted(
        (float(s[0][:-1]) for s in slow), reverse=True
    )
    assert tp.closing_line(results) == "suite: 22 passed, 0 failed, 1 skipped"


def test_a_failed_phase_stops_the_run_and_the_closing_line_says_failed(tmp_path):
    runner = FakeRunner(
        {
            "lint": (0, None),
            "beam": (1, [("test_a", 1.0, "passed"), ("test_b", 2.0, "failed"), ("e", 1, "error")]),
        }
    )
    results, cases = tp.run(_plan(), tmp_path, runner=runner, env={}, clock=_ticks())

    assert [(r.name, r.ran) for r in results] == [
        ("lint", True),
        ("beam", True),
        ("tf", False),
        ("main", False),
    ]
    assert len(runner.calls) == 2  # nothing after the failing phase ran
    assert (results[1].passed, results[1].failed) == (1, 2)
    assert tp.closing_line(results) == "suite: 1 passed, 2 failed, 0 skipped"
    text = tp.table(results, cases)
    assert "FAILED (exit 1)" in text and text.count("not run") == 2


def test_a_failed_phase_without_failed_tests_still_counts_as_a_failure(tmp_path):
    """Lint failing, or pytest dying before it records a failure: the closing line must not
    read as a clean run."""
    runner = FakeRunner({"lint": (2, None)})
    results, _ = tp.run(_plan(), tmp_path, runner=runner, env={}, clock=_ticks())
    assert tp.closing_line(results) == "suite: 0 passed, 1 failed, 0 skipped"

    runner = FakeRunner({"lint": (0, None), "beam": (3, None)})  # no JUnit file written
    results, _ = tp.run(_plan(), tmp_path, runner=runner, env={}, clock=_ticks())
    assert tp.closing_line(results) == "suite: 0 passed, 1 failed, 0 skipped"


def test_keyword_narrows_every_pytest_phase_and_no_tests_is_not_a_failure(tmp_path):
    runner = FakeRunner(
        {"lint": (0, None), "beam": (5, []), "tf": (5, []), "main": (0, [("t", 1, "passed")])}
    )
    results, _ = tp.run(_plan(), tmp_path, keyword="layouts", runner=runner, env={}, clock=_ticks())
    assert all(r.ok for r in results)
    beam_cmd, tf_cmd = runner.calls[1][0], runner.calls[2][0]
    assert beam_cmd[beam_cmd.index("-k") + 1] == "(beam) and (layouts)"
    assert tf_cmd[tf_cmd.index("-k") + 1] == "layouts"
    # Without a narrowing, pytest's "no tests collected" is a failure.
    runner = FakeRunner({"lint": (0, None), "beam": (5, [])})
    results, _ = tp.run(_plan(), tmp_path, runner=runner, env={}, clock=_ticks())
    assert not results[1].ok


def test_main_prints_the_table_last_line_and_exit_status(tmp_path, monkeypatch, capsys):
    """End to end through main(): real subprocesses (this python), a report.json, the closing
    line last, exit 1 on a failed phase; the shared compilation cache set for every phase and
    removed at the end."""
    seen = tmp_path / "seen"
    ok = tp.Phase("one", (sys.executable, "-c", "pass"))
    record = tp.Phase(
        "two",
        (
            sys.executable,
            "-c",
            f"import os; open({str(seen)!r}, 'w').write(os.environ['JAX_COMPILATION_CACHE_DIR'])",
        ),
    )
    bad = tp.Phase("three", (sys.executable, "-c", "raise SystemExit(4)"))
    monkeypatch.setattr(tp, "phases", lambda *a: [ok, record, bad])
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("ESTIMAX_TEST_COMPILATION_CACHE", "run")  # this run's own, removed

    assert tp.main(["--report_dir", str(tmp_path / "rep")]) == 1
    out = capsys.readouterr().out
    assert out.rstrip("\n").splitlines()[-1] == "suite: 0 passed, 1 failed, 0 skipped"
    cache = Path(seen.read_text())
    assert cache.name.startswith("estimax-test-jax-cache-") and not cache.exists()
    assert f"JAX compilation cache: {cache}, this run's only (cold" in out
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [p["name"] for p in data["phases"]] == ["one", "two", "three"]
    assert data["ok"] is False and data["phases"][2]["returncode"] == 4

    monkeypatch.setattr(tp, "phases", lambda *a: [ok])
    assert tp.main(["--report_dir", str(tmp_path / "rep")]) == 0


def _entry(path: Path, name: str, payload: bytes, age_s: float = 0.0) -> Path:
    """A cache entry as JAX writes one (zlib-compressed, '-cache' suffix), ``age_s`` old."""
    import zlib

    entry = path / f"jit_step-{name}-cache"
    entry.write_bytes(zlib.compress(payload))
    when = time.time() - age_s
    os.utime(entry, (when, when))
    return entry


def test_the_kept_cache_outlives_the_run_and_the_next_run_says_it_is_warm(
    tmp_path, monkeypatch, capsys
):
    seen = tmp_path / "seen"
    kept = tmp_path / "kept"
    write = tp.Phase(
        "one",
        (
            sys.executable,
            "-c",
            "import os; d = os.environ['JAX_COMPILATION_CACHE_DIR']; "
            f"open({str(seen)!r}, 'w').write(d); "
            "open(os.path.join(d, 'jit_f-1-cache'), 'wb').write(__import__('zlib').compress(b'x'))",
        ),
    )
    monkeypatch.setattr(tp, "phases", lambda *a: [write])
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("ESTIMAX_TEST_COMPILATION_CACHE", raising=False)
    monkeypatch.setenv("ESTIMAX_TEST_CACHE_DIR", str(kept))

    assert tp.main(["--report_dir", str(tmp_path / "rep")]) == 0
    assert Path(seen.read_text()) == kept and (kept / "jit_f-1-cache").exists()
    assert f"JAX compilation cache: {kept}, 0 entries, 0 MB at the start (cold)" in (
        capsys.readouterr().out
    )
    assert tp.main(["--report_dir", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert f"JAX compilation cache: {kept}, 1 entries, 0 MB at the start (warm)" in out
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["compilation_cache"]["entries"] == 1


def test_tidying_removes_damaged_entries_then_the_oldest_over_the_limit(tmp_path):
    whole_old = _entry(tmp_path, "old", os.urandom(3 << 20), age_s=300)
    whole_new = _entry(tmp_path, "new", os.urandom(3 << 20))
    cut = _entry(tmp_path, "cut", b"a compiled step" * 1000)
    cut.write_bytes(cut.read_bytes()[:-40])  # a write cut short by a kill
    (tmp_path / "jit_step-cut-atime").write_bytes(b"\0" * 8)
    other = tmp_path / "not-an-entry.txt"
    other.write_text("left alone")

    state = tp.tidy_cache(str(tmp_path), max_mb=5)
    assert (state.removed_damaged, state.removed_oldest, state.entries) == (1, 1, 1)
    assert not cut.exists() and not (tmp_path / "jit_step-cut-atime").exists()
    assert not whole_old.exists() and whole_new.exists() and other.exists()
    assert 2.9 < state.megabytes < 3.1
    assert "removed 1 damaged and 1 oldest entries first" in state.line()


def test_compilation_cache_off_or_chosen_is_left_alone():
    assert tp._compilation_cache({"ESTIMAX_TEST_COMPILATION_CACHE": "0"}) is None
    env = {"JAX_COMPILATION_CACHE_DIR": "/mine"}
    assert tp._compilation_cache(env) is None and env["JAX_COMPILATION_CACHE_DIR"] == "/mine"


def test_only_runs_the_named_phases_and_rejects_unknown_ones(capsys):
    assert tp.main(["--dry_run", "--only", "lint,main"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["lint", "main"]
    assert "-n 3" in lines[1] and "ESTIMAX_REQUIRE_ONEDNN=0" in lines[1]
    with pytest.raises(SystemExit):
        tp.main(["--only", "nope"])


def _laned_plan():
    return [
        tp.Phase("setup", ("phase", "setup")),
        tp.Phase("lint", ("phase", "lint"), lane=1),
        tp.Phase("tf", ("py", "tf"), pytest=True, lane=1),
        tp.Phase("tpu", ("py", "tpu"), pytest=True, lane=2),
        tp.Phase("cuda", ("py", "cuda"), pytest=True, lane=2),
        tp.Phase("main", ("py", "main"), pytest=True),
    ]


def test_blocks_put_consecutive_laned_phases_side_by_side():
    assert tp.blocks(_laned_plan()) == [[[0]], [[1, 2], [3, 4]], [[5]]]
    assert tp.blocks(_plan()) == [[[0]], [[1]], [[2]], [[3]]]
    # The make-test plan: .venv first and main last, each alone; the side phases in two lanes.
    plan = tp.phases("make", "2", "1")
    shape = [[[plan[i].name for i in lane] for lane in block] for block in tp.blocks(plan)]
    assert shape[0] == [["setup .venv"]] and shape[-1] == [["main"]]
    assert len(shape) == 3 and len(shape[1]) == 2
    side = {name for lane in shape[1] for name in lane}
    assert {"lint", "beam", "tf", "libtpu", "cuda"} <= side


class MeetingRunner(FakeRunner):
    """The first phase of each lane waits until the other lane's first phase has started: the
    run finishes only if the lanes really run side by side (one after the other, the first
    would wait its whole timeout and fail)."""

    def __init__(self, outcomes, meet=("lint", "tpu")):
        super().__init__(outcomes)
        self.started = {name: threading.Event() for name in meet}
        self.met: dict[str, bool] = {}

    def __call__(self, command, env, log=None):
        name = command[-1] if command[0] == "phase" else command[1]
        if name in self.started:
            self.started[name].set()
            other = next(n for n in self.started if n != name)
            self.met[name] = self.started[other].wait(timeout=30)
        return super().__call__(command, env, log)


def test_lanes_run_side_by_side_with_their_output_captured(tmp_path):
    ok = [("t", 1.0, "passed")]
    runner = MeetingRunner(
        {
            n: (0, None if n in ("setup", "lint") else ok)
            for n in ["setup", "lint", "tf", "tpu", "cuda", "main"]
        }
    )
    results, cases = tp.run(_laned_plan(), tmp_path, runner=runner, env={})
    assert runner.met == {"lint": True, "tpu": True}
    assert all(r.ok for r in results) and len(cases) == 4
    # Phases in a lane write to a log file; the ones alone stream to the terminal.
    names = [c[0][-1] if c[0][0] == "phase" else c[0][1] for c in runner.calls]
    logs = dict(zip(names, runner.logs, strict=True))
    assert logs["setup"] is None and logs["main"] is None
    assert logs["tpu"] == tmp_path / "tpu.log" and logs["lint"] == tmp_path / "lint.log"
    # main runs only after both lanes ended.
    assert names[-1] == "main"


def test_a_failure_in_one_lane_stops_it_and_the_next_block_but_not_the_phase_beside_it(tmp_path):
    ok = [("t", 1.0, "passed")]
    runner = MeetingRunner(
        {
            "setup": (0, None),
            "lint": (2, None),  # fails while tpu (the other lane) is running
            "tf": (0, ok),
            "tpu": (0, ok),
            "cuda": (0, ok),
            "main": (0, ok),
        }
    )
    results, _ = tp.run(_laned_plan(), tmp_path, runner=runner, env={})
    ran = {r.name: (r.ran, r.ok) for r in results}
    assert ran["lint"] == (True, False) and ran["tpu"] == (True, True)
    assert not ran["tf"][0] and not ran["main"][0]
    # cuda starts only if tpu finished before lint's failure was recorded: either way, never
    # main, and the closing line counts the failure.
    assert tp.closing_line(results).endswith("1 failed, 0 skipped")


def test_main_prints_a_lanes_output_and_the_wall_time(tmp_path, monkeypatch, capsys):
    a = tp.Phase("a", (sys.executable, "-c", "print('from lane one')"), lane=1)
    b = tp.Phase("b", (sys.executable, "-c", "print('from lane two')"), lane=2)
    monkeypatch.setattr(tp, "phases", lambda *_: [a, b])
    assert tp.main(["--report_dir", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "from lane one" in out and "from lane two" in out
    assert "<<< a: exit 0" in out and "(lanes overlap)" in out
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["total_s"] <= data["phases_summed_s"] + 5
    # --serial: every phase alone, its output on the terminal, no log file.
    assert tp.main(["--serial", "--report_dir", str(tmp_path / "rep2")]) == 0
    assert not (tmp_path / "rep2" / "a.log").exists()
    assert tp.main(["--dry_run", "--serial"]) == 0
    assert "[lane" not in capsys.readouterr().out
