"""estimax's version: the one place it is written.

``pyproject.toml`` reads it (``dynamic = ["version"]``), and so does everything that reports it
(``estimax.__version__``, the server's metadata answers, ``tensorflow_model_server --version``).
A module of its own, importing nothing, so that reading it loads no other part of estimax.
"""

__version__ = "0.1.0"
