"""Prints the table of `make reliability` from the JSON lines the reliability tests wrote.

Usage: ``python tests/reliability/report.py <results dir>`` (the dir of
``ESTIMAX_RELIABILITY_RESULTS``; format in tests/reliability/conftest.py). Exits 1 when a record
says something was lost (``ok`` false) or there are no records.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from typing import Any

_HEADINGS = {
    "kill": "kills survived",
    "fuzz": "fuzz inputs tried",
    "server": "server requests fuzzed",
    "fault": "faults injected",
    "attack": "server attacks refused",
}


def load(results_dir: str) -> list[dict[str, Any]]:
    """The records of ``results_dir/results.jsonl`` (empty if the file does not exist)."""
    path = os.path.join(results_dir, "results.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(records: list[dict[str, Any]]) -> str:
    """The report: one row per (kind, target), counts summed, and where the kills landed."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        row = rows.setdefault(
            (r["kind"], r["target"]),
            {"count": 0, "ok": True, "where": collections.Counter(), "runs": 0, "rss": []},
        )
        row["count"] += r["count"]
        row["ok"] = row["ok"] and r["ok"]
        row["runs"] += 1
        row["where"].update(r.get("detail", {}).get("where", {}))
        detail = r.get("detail", {})
        if "rss_growth_mib" in detail:  # a bounded family: its growth against its bound
            row["rss"].append(
                f"RSS +{detail['rss_growth_mib']} MiB (bound {detail.get('rss_bound_mib')} MiB)"
            )
        elif detail.get("rss_mib"):  # two passes: flat when the second grew by noise only
            bound = detail.get("rss_growth_bound_mib")
            row["rss"].append(
                "RSS "
                + " -> ".join(f"{m} MiB" for m in detail["rss_mib"])
                + (f" (growth bound {bound} MiB)" if bound is not None else "")
            )
    lines = [f"{'what':<24} {'target':<34} {'count':>8}  {'result':<6}", "-" * 76]
    order = list(_HEADINGS)
    for kind, target in sorted(
        rows, key=lambda k: (order.index(k[0]) if k[0] in order else 9, k[1])
    ):
        row = rows[(kind, target)]
        result = "ok" if row["ok"] else "LOST"
        lines.append(f"{_HEADINGS.get(kind, kind):<24} {target:<34} {row['count']:>8}  {result:<6}")
        if row["rss"]:
            lines.append(f"{'':<24}   {'; '.join(row['rss'])}")
        if row["where"]:
            landed = ", ".join(f"{k} {v}" for k, v in sorted(row["where"].items()))
            lines.append(f"{'':<24}   landed: {landed}")
    totals = collections.Counter()
    for (kind, _), row in rows.items():
        totals[kind] += row["count"]
    lines.append("-" * 76)
    lines.append(
        "totals: " + ", ".join(f"{_HEADINGS.get(k, k)} {v}" for k, v in sorted(totals.items()))
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: report.py <results dir>", file=sys.stderr)
        return 2
    records = load(argv[1])
    if not records:
        print(f"no reliability records in {argv[1]}/results.jsonl", file=sys.stderr)
        return 1
    print(table(records))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
