"""``estimax-convert folder`` on names users did not choose (issue #42, item 16): folders and
files named in bytes that are no UTF-8 (Latin-1, a lone continuation byte, an overlong '/', an
encoded surrogate, 0xFF) as a class folder, a file and a subfolder; and names that are UTF-8
but hold control characters (CR/LF, ESC, C1, a line separator).

Each name that is no UTF-8 is refused in one line naming it (escaped, as bytes), exit 2,
nothing written; UTF-8 names with control characters are converted, their names kept exactly in
the manifest (JSON escapes them) and printed escaped. One record (kind ``fault``) each in the
reliability report; short mode tries three byte sequences, `make reliability` all of them.
"""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from .conftest import scale

Image = pytest.importorskip("PIL.Image")

NOT_UTF8 = [b"caf\xe9", b"\x80x", b"\xc0\xaf", b"\xed\xa0\x80", b"\xff\xfe"]
PLACES = ("class folder", "file", "file in a subfolder")
CONTROL = ["a\r\n2026-01-01 00:00:00,000 INFO FORGED", "e\x1b[2Jx", "c1\u009b31m", "ls\u2028x"]


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (40 * i % 256, 90, 200)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _tree(root: bytes, names: list[bytes]) -> None:
    """One JPEG under each relative path of ``names`` (folders made as needed)."""
    for i, name in enumerate(names):
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(_jpeg(i))


def _convert(tmp_path, capsys) -> tuple[int, str, str]:
    from estimax.tools import convert

    command = ["folder", f"--train_dir={tmp_path / 'in'}", "--train_shards=1", "--no_progress"]
    code = convert.main([*command, f"--output_dir={tmp_path / 'out'}"])
    out, err = capsys.readouterr()
    return code, out, err


def test_names_that_are_not_utf8_are_refused_in_one_line(tmp_path, capsys, reliability_record):
    cases = [(raw, place) for raw in NOT_UTF8[: scale(3, len(NOT_UTF8))] for place in PLACES]
    done = 0
    try:
        for i, (raw, place) in enumerate(cases):
            root = os.fsencode(tmp_path / str(i))
            bad = {
                "class folder": raw + b"/0.jpg",
                "file": b"cat/" + raw + b".jpg",
                "file in a subfolder": b"cat/" + raw + b"/0.jpg",
            }[place]
            _tree(os.path.join(root, b"in"), [b"dog/0.jpg", b"cat/1.jpg", bad])
            code, out, err = _convert(tmp_path / str(i), capsys)
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1, (raw, place, code, err)
            shown = os.path.join(root, b"in", bad.split(b"/0.jpg")[0] if place != "file" else bad)
            escaped = shown.decode("latin-1").encode("ascii", "backslashreplace").decode()
            assert escaped in lines[0] and "is not UTF-8" in lines[0], (lines[0], escaped)
            assert lines[0].isascii() and not re.search("[\x00-\x1f\x7f]", lines[0])
            assert not os.path.exists(tmp_path / str(i) / "out"), "something was written"
            done += 1
    finally:
        reliability_record("fault", "convert folder: names not UTF-8", done, done == len(cases))


def test_names_with_control_characters_are_kept_exactly_and_printed_escaped(
    tmp_path, capsys, reliability_record
):
    from estimax.export import record as record_lib

    names = sorted(["dog", *CONTROL])
    _tree(os.fsencode(tmp_path / "in"), [f"{n}/0.jpg".encode() for n in names])
    ok = False
    try:
        code, out, err = _convert(tmp_path, capsys)
        assert code == 0, err
        for line in (out + err).splitlines():
            assert not re.search("[\x00-\x1f\x7f\x9b\u2028]", line), line
        with open(tmp_path / "out" / "manifest.json") as f:
            label_map = json.load(f)["label_map"]
        assert sorted(label_map) == names  # each name exactly, JSON-escaped on disk
        assert record_lib.class_names_from_manifest(str(tmp_path / "out")) == names
        ok = True
    finally:
        reliability_record("fault", "convert folder: control characters", len(CONTROL), ok)
