"""One result file per benchmark, with a section per machine or mode (not a benchmark itself).

A benchmark that runs on several machines (``conv_cpu.py``, ``train_cpu.py``, ``accelerator.py``)
or in several modes (``overhead.py``'s models, ``input_pipeline.py``'s ``--host`` and ``--gcs``)
keeps its latest run of each in ``bench/results/<name>.md`` and ``<name>.json``: the JSON maps each
section's key to that run's data, and the Markdown holds each run's report under a ``## `` heading
(its own headings one level down). A new run replaces its own section and keeps the others, so
the file always says which figure is current on each machine; earlier runs are git's history.
"""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MARK = "<!-- section: {} -->"
MARK_RE = re.compile(r"^<!-- section: (.+?) -->$", re.M)


def cpu_kind() -> str:
    """This machine's CPU model and its widest vector extension, e.g. 'AMD EPYC (AVX2)': what a
    CPU result's section is keyed by (two machines of one model name can differ in that)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    ext = next(
        (
            name
            for flag, name in (
                ("amx_bf16", "AMX"),
                ("avx512_bf16", "AVX-512 BF16"),
                ("avx512f", "AVX-512"),
                ("avx2", "AVX2"),
            )
            if flag in flags
        ),
        None,
    )
    return f"{model} ({ext})" if ext else model


def slug(text: str) -> str:
    """``text`` as a section key: lower case, runs of other characters as one ``_``."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "default"


def demote(markdown: str) -> str:
    """``markdown`` with each heading one level down (``# T`` -> ``## T``), code blocks kept."""
    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(out)


def sections(text: str) -> dict[str, str]:
    """The sections of a result file's Markdown, by key, each with its marker line, in order."""
    marks = list(MARK_RE.finditer(text))
    return {
        m.group(1): text[m.start() : marks[i + 1].start() if i + 1 < len(marks) else len(text)]
        for i, m in enumerate(marks)
    }


def write_section(
    name: str, key: str, report: str, data: Any, title: str, results: Path = RESULTS
) -> Path:
    """Puts ``report`` (a run's whole Markdown, its ``# `` title first) as section ``key`` of
    ``results/<name>.md`` and ``data`` as ``key`` of ``<name>.json``, replacing that key's earlier
    run and keeping the other sections; ``title`` heads a new file. Returns the Markdown's path."""
    if not key or "\n" in key or "-->" in key:
        raise ValueError(f"a section key is one line without '-->', not {key!r}")
    results.mkdir(parents=True, exist_ok=True)
    md_path, json_path = results / f"{name}.md", results / f"{name}.json"
    store = json.loads(json_path.read_text()) if json_path.exists() else {}
    store[key] = data
    json_path.write_text(json.dumps(store, indent=1) + "\n")
    text = md_path.read_text() if md_path.exists() else ""
    parts, first = sections(text), MARK_RE.search(text)
    head = text[: first.start()] if first else f"# {title}\n\n"
    parts[key] = MARK.format(key) + "\n" + demote(report.strip()) + "\n\n"
    md_path.write_text(head + "".join(parts.values()).rstrip("\n") + "\n")
    return md_path
