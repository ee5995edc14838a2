"""The model families, listed once: each program's ``FAMILY`` (``estimax.programs.family``).

``estimax-convert tf-checkpoint --model=NAME``, the TF-checkpoint conversion and anything else
that needs "the program called NAME" looks it up here. Adding a family: its model file, its
program file (ending with its ``FAMILY``), and one line below.
"""

from __future__ import annotations

from estimax.programs import efficientnet, inception_v3, inception_v4, mnist, resnet, vit
from estimax.programs.cli import UsageError
from estimax.programs.family import Family

__all__ = ["FAMILIES", "get", "with_tf_original"]

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        mnist.FAMILY,
        resnet.FAMILY,
        inception_v3.FAMILY,
        inception_v4.FAMILY,
        efficientnet.FAMILY,
        vit.FAMILY,
    )
}


def get(name: str) -> Family:
    """The family called ``name``.

    Raises:
      UsageError: no family has that name (the message lists them).
    """
    try:
        return FAMILIES[name]
    except KeyError:
        raise UsageError(
            f"no program called {name!r}: one of {', '.join(sorted(FAMILIES))}"
        ) from None


def with_tf_original() -> list[str]:
    """The families whose TensorFlow original's checkpoints estimax converts, by name."""
    return [name for name, family in FAMILIES.items() if family.tf_names is not None]
