"""The manual (README.md and docs/) says what the code does, and every document cited exists.

- Every ``python`` block of a page runs: the blocks of one page in order, in one namespace (so a
  page's examples build on each other), in a fresh directory; every page in one process. A block
  preceded by ``<!-- skip: REASON -->`` (the reason naming the test that runs the same thing)
  cannot run here: it is compiled and its imports are run, nothing else. Keep such skips rare.
- After some blocks the suite checks what they did (``CHECKS``), as a reader would.
- Every ``python -m estimax...`` a page names is a module that exists.
- Every page is in mkdocs.yml's nav (``mkdocs build --strict`` in ``make lint`` also fails on a
  broken link or anchor).
- A source file, ``pyproject.toml``, the Makefile or a page that cites a document
  (``docs/design.md §2``, ``DESIGN.md``, ``bench/results/serving.md``) cites one that exists.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
SKIP = re.compile(r"^<!-- skip: (.+?) -->$")


def _blocks(page: str) -> list[tuple[str, int, str, str | None]]:
    """(language, line of the opening fence, code, skip reason or None) of each fenced block."""
    lines = open(os.path.join(ROOT, page)).read().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = re.match(r"^```(\w*)\s*$", lines[i])
        if not match:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: a code block is never closed"
        skip = SKIP.match(lines[start - 1]) if start else None
        code = "\n".join(lines[start + 1 : i]) + "\n"
        blocks.append((match.group(1), start + 1, code, skip.group(1) if skip else None))
        i += 1
    return blocks


def _python_pages() -> list[str]:
    return [p for p in PAGES if any(lang == "python" for lang, *_ in _blocks(p))]


# Checks run right after a block, in its namespace: (page, index among the page's python
# blocks) -> code. What the block promises, asserted.
CHECKS = {
    # The contract: 600 steps trained, every held-out digit evaluated once, one prediction per
    # example (10, not a batch), an export written.
    ("docs/contract.md", 0): """
        r = est.evaluate(eval_input_fn)
        assert (r["global_step"], r["num_examples"]) == (600, 1000), r
        assert r["accuracy"] > 0.5, r  # 10 classes: chance is 0.1
        assert len(list(est.predict(predict_input_fn))) == 10
        assert os.listdir("exports")
    """,
    # The best model: the best checkpoint kept, the best and final exports published.
    ("docs/contract.md", 3): """
        assert est.best_checkpoint() and os.path.exists(est.best_checkpoint())
        assert os.listdir("best_run/export/best") and os.listdir("best_run/export/final")
    """,
    ("README.md", 0): """
        r = est.evaluate(ex.numpy_input_fn(eval_x, eval_y.astype("int32"), False, num_epochs=1))
        assert (r["global_step"], r["num_examples"]) == (300, 1000) and r["accuracy"] > 0.5, r
        assert os.listdir("readme_exports")
    """,
}

# One process runs every page (one import of JAX and estimax, not one per page): each page in
# a fresh directory and a fresh namespace; a page that fails prints its traceback and the next
# page runs.
RUNNER = """
import ast, json, os, sys, traceback
for page in json.load(open(sys.argv[1])):
    os.chdir(page["dir"])
    namespace = {"__name__": "__main__"}
    try:
        for b in page["blocks"]:
            code = compile(b["code"], b["where"], "exec")
            if b["skip"] is not None:
                body = ast.parse(b["code"]).body
                imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
                exec(compile(ast.Module(imports, []), b["where"], "exec"), {})
            else:
                exec(code, namespace)
            if b["check"]:
                check = compile("import os\\n" + b["check"], b["where"] + " (check)", "exec")
                exec(check, namespace)
            skipped = "(skipped: imports only)" if b["skip"] is not None else ""
            print("ran", b["where"], skipped, flush=True)
    except BaseException:
        print("FAILED", page["page"], flush=True)
        traceback.print_exc(file=sys.stdout)
        print("END", page["page"], flush=True)
"""


@pytest.mark.slow
def test_the_python_blocks_of_every_page_run_as_written(tmp_path):
    import json

    pages = []
    for page in _python_pages():
        python = [b for b in _blocks(page) if b[0] == "python"]
        for _, line, code, skip in python:
            if skip is None:
                assert "..." not in code, f"{page}:{line}: something left for the reader to fill in"
        cwd = tmp_path / page.replace("/", "_")  # a fresh directory for each page
        cwd.mkdir()
        blocks = [
            {
                "where": f"{page}:{line}",
                "code": code,
                "skip": skip,
                "check": textwrap.dedent(CHECKS.get((page, k), "")),
            }
            for k, (_, line, code, skip) in enumerate(python)
        ]
        pages.append({"page": page, "dir": str(cwd), "blocks": blocks})
    (tmp_path / "pages.json").write_text(json.dumps(pages))
    (tmp_path / "runner.py").write_text(RUNNER)
    # One CPU device, as on a reader's machine: on the suite's eight virtual devices each of the
    # contract page's thousands of tiny steps is a cross-device all-reduce, and the page took
    # twice the CPU time (47 s against 22, measured); replication has the Estimator's tests.
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "XLA_FLAGS": re.sub(
            r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
        ),
    }
    out = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "pages.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for page in pages:
        # Every block of every page ran (a failed page names itself, its traceback after it).
        failed = re.search(
            rf"^FAILED {re.escape(page['page'])}$(.*?)^END {re.escape(page['page'])}$",
            out.stdout,
            re.M | re.S,
        )
        assert failed is None, f"{page['page']} failed:{failed.group(1)[-4000:]}"
        ran = re.findall(rf"^ran {re.escape(page['page'])}:\d+ ", out.stdout, re.M)
        assert len(ran) == len(page["blocks"]), (page["page"], out.stdout[-2000:])


def test_the_checks_name_python_blocks_that_exist():
    for page, k in CHECKS:
        python = [b for b in _blocks(page) if b[0] == "python"]
        assert k < len(python) and python[k][3] is None, (page, k)


def test_a_skipped_block_says_why_and_which_test_runs_it_instead():
    skips = [(p, line, why) for p in PAGES for lang, line, _, why in _blocks(p) if why]
    for page, line, why in skips:
        tests = re.findall(r"tests/[\w/]+\.py", why)
        assert tests, f"{page}:{line}: a skip names the test that runs the same thing: {why!r}"
        for test in tests:
            assert os.path.exists(os.path.join(ROOT, test)), f"{page}:{line}: {test}"
    assert len(skips) <= 6, f"skips are for blocks that cannot run here, kept rare: {skips}"


def test_the_skip_marker_sits_before_a_code_block():
    for page in PAGES:
        lines = open(os.path.join(ROOT, page)).read().split("\n")
        for i, line in enumerate(lines):
            if line.lstrip().startswith("<!-- skip"):
                assert SKIP.match(line), f"{page}:{i + 1}: write <!-- skip: REASON -->"
                assert lines[i + 1].startswith("```python"), f"{page}:{i + 1}: not before a block"


@pytest.mark.parametrize("page", PAGES)
def test_the_modules_a_page_runs_with_python_m_exist(page):
    # In the commands of its code blocks (the release notes' table names removed modules).
    text = "".join(code for lang, _, code, _ in _blocks(page) if lang != "python")
    for module in sorted(set(re.findall(r"python -m (estimax[\w.]*)", text))):
        assert importlib.util.find_spec(module) is not None, f"{page}: python -m {module}"


def test_every_page_is_in_the_nav_and_the_nav_names_only_pages():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        config = yaml.safe_load(f)

    def files(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from files(value) if isinstance(value, list) else [value]

    listed = sorted(f"docs/{p}" for p in files(config["nav"]))
    assert listed == sorted(p for p in PAGES if p.startswith("docs/"))
    assert config["strict"] is True and config["theme"]["font"] is False  # offline build


def test_the_readme_keeps_what_it_is_short():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) < 250
    assert "make demo" in readme and "make test" in readme
    for page in PAGES[1:]:
        if page != "docs/index.md":
            assert f"({page}" in readme, f"README.md does not link {page}"


# Where documents are cited: source files, build files and the pages themselves.
CITING = [
    "pyproject.toml",
    "Makefile",
    "mkdocs.yml",
    *PAGES,
    "bench/README.md",
    *(
        os.path.relpath(p, ROOT)
        for top in ("estimax", "tests", "bench", "scripts", "examples")
        for ext in ("py", "sh", "yaml", "cc", "toml")
        for p in glob.glob(os.path.join(ROOT, top, "**", f"*.{ext}"), recursive=True)
    ),
]
TOP_DIRS = ("docs", "estimax", "tests", "bench", "scripts", "examples")
# A path into this repository (``docs/design.md``, ``bench/results/train_cpu*.md``), or a bare
# document name in capitals (``DESIGN.md``, ``README.md``: beside the file or at the root).
CITATION = re.compile(
    r"(?<![\w./-])((?:" + "|".join(TOP_DIRS) + r")/[\w./*<>-]+?\.md|[A-Z][A-Z0-9_]*\.md)(?![\w-])"
)


def missing_citations(path: str, text: str) -> list[str]:
    """The documents ``text`` (of the file at ``path``, relative to the root) cites that do not
    exist."""
    missing = []
    for cited in sorted(set(CITATION.findall(text))):
        if "<" in cited:  # a template (bench/results/accelerator_<device>.md): written later
            continue
        places = [os.path.join(ROOT, cited)]
        if "/" not in cited:
            places.append(os.path.join(ROOT, os.path.dirname(path), cited))
        if not any(glob.glob(place) for place in places):
            missing.append(cited)
    return missing


def test_every_cited_document_exists():
    missing = {}
    for path in sorted(set(CITING) - {"tests/test_docs.py"}):  # its own cites missing ones
        with open(os.path.join(ROOT, path), errors="replace") as f:
            if found := missing_citations(path, f.read()):
                missing[path] = found
    assert not missing, f"documents cited that do not exist: {missing}"


def test_a_citation_of_a_missing_document_is_found():
    text = "The layers (DESIGN.md §2, docs/design.md §2); STYLE.md; docs/nope.md; README.md"
    assert missing_citations("estimax/data/x.py", text) == ["DESIGN.md", "STYLE.md", "docs/nope.md"]
    assert missing_citations("pyproject.toml", "bench/results/train_cpu*.md, docs/style.md") == []
    # Not citations: a file a benchmark writes (its own name), another project's path.
    assert missing_citations("bench/x.py", '"serving.md", tensorflow/docs_src/using_tpu.md') == []


def test_the_python_blocks_parse_as_the_runner_reads_them():
    for page in PAGES:
        for lang, line, code, _ in _blocks(page):
            if lang == "python":
                ast.parse(code, f"{page}:{line}")
