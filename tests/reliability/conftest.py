"""Shared set-up of the reliability suite: its mode (short in CI, long under `make reliability`)
and the one record format every reliability test writes its counts in.

Modes: ``ESTIMAX_RELIABILITY=long`` (set by `make reliability`) makes every test search longer
(10^5 fuzz inputs per parser, 100 kills); unset, the suite runs its short CI version.

Records: with ``ESTIMAX_RELIABILITY_RESULTS=<dir>`` set, each test appends one JSON line per
thing it counted to ``<dir>/results.jsonl``::

    {"kind": "fuzz", "target": "tfrecord_stream", "count": 100000, "ok": true,
     "detail": {"max_rss_mib": 88.1}, "test": "tests/reliability/test_fuzz_parsers.py::..."}

``kind`` is one of ``fuzz`` (count = inputs tried), ``kill`` (count = kills survived; detail
``where`` = {place: kills landed there}), ``server`` (count = requests sent), ``fault`` (count =
faults injected), ``attack`` (count = hostile requests, connections or versions the server
refused); ``ok`` says whether nothing was lost. ``tests/reliability/report.py`` reads the
file and prints the table. Use the ``reliability_record`` fixture rather than writing lines by
hand, so the report can rely on the format.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

RESULTS_ENV = "ESTIMAX_RELIABILITY_RESULTS"
MODE_ENV = "ESTIMAX_RELIABILITY"
KINDS = ("fuzz", "kill", "server", "fault", "attack")


def long_mode() -> bool:
    """Whether the suite runs its long version (`make reliability`)."""
    return os.environ.get(MODE_ENV, "") == "long"


def scale(short: Any, long: Any) -> Any:
    """``long`` under `make reliability`, else ``short`` (the CI version)."""
    return long if long_mode() else short


def write_record(
    kind: str, target: str, count: int, ok: bool, test: str = "", **detail: Any
) -> dict[str, Any]:
    """Appends one record to ``$ESTIMAX_RELIABILITY_RESULTS/results.jsonl`` (if set); returns it."""
    if kind not in KINDS:
        raise ValueError(f"reliability record kind {kind!r} is not one of {KINDS}")
    record = {
        "kind": kind,
        "target": target,
        "count": int(count),
        "ok": bool(ok),
        "detail": detail,
        "test": test,
    }
    results = os.environ.get(RESULTS_ENV)
    if results:
        os.makedirs(results, exist_ok=True)
        # One write of one line in append mode: lines of concurrent writers do not interleave.
        with open(os.path.join(results, "results.jsonl"), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
    return record


@pytest.fixture
def reliability_record(request) -> Callable[..., dict[str, Any]]:
    """``reliability_record(kind, target, count, ok, **detail)``: records one count (see module)."""

    def record(kind: str, target: str, count: int, ok: bool, **detail: Any) -> dict[str, Any]:
        return write_record(kind, target, count, ok, test=request.node.nodeid, **detail)

    return record


@pytest.fixture
def reliability_long() -> bool:
    """True under `make reliability` (long mode)."""
    return long_mode()


# The single-fault tests (one fault each, its assertions checking what was kept and what the
# user was told) count as "faults injected" in the table, under these targets; a failed test is
# recorded as not ok (something lost or misreported).
_FAULT_TARGETS = {
    "test_checkpoints.py": "checkpoint damaged or torn",
    "test_disk_full.py": "disk full while writing",
    "test_evaluations.py": "kill around an evaluation",
    "test_input_faults.py": "input: record, shard, worker",
    "test_nonfinite.py": "non-finite loss",
    "test_signals.py": "signals, oneDNN loaded",
    "test_writer_lock.py": "lock: restart, read-only, full",
}


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Records each single-fault test's outcome (see ``_FAULT_TARGETS``)."""
    target = _FAULT_TARGETS.get(os.path.basename(report.nodeid.split("::")[0]))
    # Under pytest-xdist the controller sees each worker's report again (with ``node`` set):
    # only the worker that ran the test records it.
    if target is None or report.skipped or getattr(report, "node", None) is not None:
        return
    if report.when == "call" or (report.when == "setup" and report.failed):
        write_record("fault", target, 1, report.passed, test=report.nodeid)
