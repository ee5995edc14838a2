"""``bench/results/`` holds one current result per benchmark, and every citation stays inside the
repository.

- Each result file is ``<name>.md`` or ``<name>.json`` of a ``bench/<name>.py`` (a benchmark that
  runs on several machines or in several modes keeps a section per machine or mode in that file).
- ``bench/result_sections.py`` replaces a run's own section and keeps the others and the file's
  head (where earlier runs are summarised).
- No source file or page cites a document outside the repository (``../shared/NOTES.md``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import result_sections  # noqa: E402 - bench/ is not a package


def test_every_result_file_is_the_result_of_one_benchmark():
    benchmarks = {p.stem for p in (ROOT / "bench").glob("*.py")}
    files = sorted(p.name for p in (ROOT / "bench" / "results").iterdir())
    strays = [f for f in files if f.rsplit(".", 1)[0] not in benchmarks]
    assert not strays, f"result files named after no bench/NAME.py: {strays}"
    assert all(f.endswith((".md", ".json")) for f in files), files
    lone_json = [f for f in files if f.endswith(".json") and f[:-5] + ".md" not in files]
    assert not lone_json, f"a JSON result without its report: {lone_json}"


def test_a_run_replaces_its_own_section_and_keeps_the_others_and_the_head(tmp_path):
    def write(key: str, report: str, data: object) -> str:
        path = result_sections.write_section("b", key, report, data, "B (bench/b.py)", tmp_path)
        return path.read_text()

    write("cpu_a", "# CPU A\n\nfirst run: 1.0x\n\n## Notes\n\nnote A", {"x": 1})
    text = write("cpu_b", "# CPU B\n\nfirst run: 2.0x", {"x": 2})
    head = "# B (bench/b.py)\n\nEarlier runs: a summary the next run keeps.\n\n"
    (tmp_path / "b.md").write_text(head + text.split("\n\n", 1)[1])
    text = write("cpu_a", "# CPU A\n\nsecond run: 1.1x\n\n```\n# not a heading\n```", {"x": 3})
    assert text.startswith(head)
    assert "second run: 1.1x" in text and "first run: 1.0x" not in text and "note A" not in text
    assert "## CPU A\n" in text and "### Notes" not in text and "\n# not a heading\n" in text
    assert "## CPU B\n\nfirst run: 2.0x" in text
    assert text.count("<!-- section: cpu_a -->") == 1
    assert text.index("cpu_a -->") < text.index("cpu_b -->")  # replaced in place, not appended
    assert json.loads((tmp_path / "b.json").read_text()) == {"cpu_a": {"x": 3}, "cpu_b": {"x": 2}}


def test_a_section_key_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="one line"):
        result_sections.write_section("b", "a\nb", "# r", {}, "B", tmp_path)
    assert (
        result_sections.slug("AMD EPYC (AVX-512 BF16), float32") == "amd_epyc_avx_512_bf16_float32"
    )


# A document cited by a relative path that climbs out of its directory (``../shared/X.md``), or
# by an absolute path on one machine: unless it names a file of the repository, neither resolves
# in a reader's checkout.
OUTSIDE = re.compile(r"(?<![\w.])(?:\.\./)+[\w./-]+\.md\b|/work/[\w./-]+\.md\b")


def test_no_file_cites_a_document_outside_the_repository():
    paths = ["README.md", "mkdocs.yml", "Makefile", "pyproject.toml", "bench/README.md"]
    for top in ("docs", "estimax", "tests", "bench", "scripts", "examples"):
        for ext in ("md", "py", "sh", "yaml", "cc", "toml"):
            paths += glob.glob(os.path.join(top, "**", f"*.{ext}"), recursive=True, root_dir=ROOT)
    found = {}
    for path in sorted(set(paths) - {"tests/test_bench_results.py"}):
        cited = OUTSIDE.findall((ROOT / path).read_text(errors="replace"))
        for match in cited:  # one that names a file of the repository, from its page or the root
            places = [((ROOT / path).parent / match).resolve(), (ROOT / match).resolve()]
            if not any(p.is_relative_to(ROOT) and p.exists() for p in places):
                found.setdefault(path, []).append(match)
    assert not found, f"citations outside the repository: {found}"
    assert OUTSIDE.findall("``../shared/NOTES.md``, turn 5; /work/shared/NOTES.md") == [
        "../shared/NOTES.md",
        "/work/shared/NOTES.md",
    ]
    assert OUTSIDE.findall("``.../kernel``; docs/design.md") == []
