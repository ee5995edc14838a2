"""The table `make reliability` prints (tests/reliability/report.py): every family's row, and
each server family's RSS beside its bound."""

from __future__ import annotations

from . import report
from .conftest import write_record


def test_the_report_lists_the_families_and_their_rss_bounds(tmp_path, monkeypatch):
    monkeypatch.setenv("ESTIMAX_RELIABILITY_RESULTS", str(tmp_path))
    write_record("fuzz", "shard_index", 3000, True, max_rss_mib=61.8)
    write_record("fault", "version: FIFO, device, socket, folder", 24, True)
    write_record("fault", "convert folder: names not UTF-8", 9, True)
    write_record("server", "estimax serve (hostile header bytes)", 57, True)
    write_record(
        "server",
        "estimax serve (binary v2 + gRPC, hypothesis)",
        2000,
        True,
        rss_mib=[301.5, 303.0],
        rss_growth_bound_mib=24,
    )
    write_record(
        "attack", "declared-but-unsent bodies", 50, True, rss_growth_mib=3.1, rss_bound_mib=64
    )
    text = report.table(report.load(str(tmp_path)))
    for row in (
        "fuzz inputs tried        shard_index",
        "faults injected          version: FIFO, device, socket, folder       24  ok",
        "faults injected          convert folder: names not UTF-8",
        "server requests fuzzed   estimax serve (hostile header bytes)",
        "RSS 301.5 MiB -> 303.0 MiB (growth bound 24 MiB)",
        "RSS +3.1 MiB (bound 64 MiB)",
    ):
        assert row in text, text
    assert report.main(["report.py", str(tmp_path)]) == 0
    write_record("fault", "convert folder: names not UTF-8", 1, False)
    assert "LOST" in report.table(report.load(str(tmp_path)))
    assert report.main(["report.py", str(tmp_path)]) == 1
