"""``python -m estimax``: the ``estimax`` command (``estimax.command``)."""

from estimax.command import run

run()
