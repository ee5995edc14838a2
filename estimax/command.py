"""The ``estimax`` command: ``estimax doctor ...`` (``estimax.doctor``), else the serving
commands (``estimax serve``, ``predict``, ``export-check``, ``export-savedmodel``:
``estimax.serving.cli``)."""

from __future__ import annotations

import sys


def run() -> None:
    """Console-script entry point of ``estimax``."""
    if sys.argv[1:2] == ["doctor"]:
        from estimax import doctor

        sys.exit(doctor.main(sys.argv[2:]))
    from estimax.serving import cli

    cli.run()
