"""estimax's version is written once (estimax/version.py); everything else reads it."""

from __future__ import annotations

import pathlib

import estimax
from estimax.serving import tf_serving
from estimax.version import __version__

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_package_and_the_server_report_the_one_version(capsys):
    assert estimax.__version__ == __version__
    assert tf_serving.main(["--version"]) == 0
    assert capsys.readouterr().out == f"tensorflow_model_server (estimax {__version__})\n"


def test_pyproject_reads_the_version_from_the_package():
    from setuptools.config.pyprojecttoml import read_configuration

    project = read_configuration(ROOT / "pyproject.toml", expand=True)["project"]
    assert project["version"] == __version__


def test_no_other_file_writes_the_version():
    quoted = {f'"{__version__}"', f"'{__version__}'"}
    files = [ROOT / "pyproject.toml", *(ROOT / "estimax").rglob("*.py")]
    writers = [
        str(f.relative_to(ROOT))
        for f in files
        if "protos" not in f.parts and any(q in f.read_text() for q in quoted)
    ]
    assert writers == ["estimax/version.py"]
