"""Flax models: ResNet v1 18-200, Inception v3 and v4, EfficientNet B0-B7 (MNIST CNN: ``mnist``).

Every image model is called as ``model.apply(variables, x, train=..., mutable=[...])`` with
``x: [B, H, W, 3]`` float and returns float32 logits ``[B, num_classes]`` -- the Inceptions return
``(logits, aux_logits)`` while ``aux_logits=True`` (their default, as the original).

``MODELS`` is the registry (name -> constructor), made of each model file's own ``MODELS``;
``get_model(name, **kw)`` looks a name up with a helpful error. The ``*_tiny`` entries are thin
variants that exercise the same code for tests. ``TF_NAMES`` lists the models whose TensorFlow
original's checkpoints estimax reads, each map written beside its model as that file's
``TF_NAMES`` (``estimax.models.tf_names``); ``register_tf_names`` adds a map of one's own.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from estimax.models.tf_names import TFNames, register_tf_names

if TYPE_CHECKING:
    import flax.linen as nn

    from estimax.models.efficientnet import EFFICIENTNETS, EfficientNet, EfficientNetTiny
    from estimax.models.inception_v3 import InceptionV3, InceptionV3Tiny
    from estimax.models.inception_v4 import InceptionV4, InceptionV4Tiny
    from estimax.models.resnet import (
        BottleneckBlock,
        ResidualBlock,
        ResNet,
        ResNet18,
        ResNet34,
        ResNet50,
        ResNet101,
        ResNet152,
        ResNet200,
        ResNetTiny,
        ResNetTinyBottleneck,
        resnet_v1,
    )

    MODELS: dict[str, Callable[..., nn.Module]]
    TF_NAMES: tuple[TFNames, ...]

# Public name -> the model file that defines it, imported on first use: a program imports only
# its own network's file (the MNIST program's processes leave ResNet, the Inceptions and
# EfficientNet out; tests/test_import_cost.py), and the registry is read when first asked for.
_EXPORTS = {
    **dict.fromkeys(("EFFICIENTNETS", "EfficientNet", "EfficientNetTiny"), "efficientnet"),
    **dict.fromkeys(("InceptionV3", "InceptionV3Tiny"), "inception_v3"),
    **dict.fromkeys(("InceptionV4", "InceptionV4Tiny"), "inception_v4"),
    **dict.fromkeys(
        (
            "BottleneckBlock",
            "ResidualBlock",
            "ResNet",
            "ResNet18",
            "ResNet34",
            "ResNet50",
            "ResNet101",
            "ResNet152",
            "ResNet200",
            "ResNetTiny",
            "ResNetTinyBottleneck",
            "resnet_v1",
        ),
        "resnet",
    ),
}


def _registry() -> tuple[dict[str, Callable[..., nn.Module]], tuple[TFNames, ...]]:
    """Every model file's ``MODELS`` and ``TF_NAMES``, so that a new model file registers itself.

    A family is its model file, its program file and one line in ``estimax.programs.families``:
    no list here to keep in step (the files are read in name order).
    """
    found: dict[str, Callable[..., nn.Module]] = {}
    names: list[TFNames] = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, constructor in getattr(module, "MODELS", {}).items():
            if name in found:
                raise ImportError(f"estimax.models.{info.name} registers {name!r} a second time")
            found[name] = constructor
        if isinstance(getattr(module, "TF_NAMES", None), TFNames):
            names.append(module.TF_NAMES)
    return found, tuple(names)


def _registered() -> tuple[dict[str, Callable[..., nn.Module]], tuple[TFNames, ...]]:
    """``MODELS`` and ``TF_NAMES`` (name -> constructor of every registered network; the
    networks whose TensorFlow original's checkpoints estimax reads, each map beside its model),
    found the first time either is asked for; later assignments (``register_tf_names``) stand."""
    if "MODELS" not in globals():
        found, names = _registry()
        globals().update(MODELS=found, TF_NAMES=names)
    return globals()["MODELS"], globals()["TF_NAMES"]


def __getattr__(name: str) -> Any:
    if name in ("MODELS", "TF_NAMES"):
        models, names = _registered()
        return names if name == "TF_NAMES" else models
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tf_names(name: str) -> TFNames:
    """The TensorFlow names of the original ``name`` (``resnet``, ``inception_v3``...).

    Raises:
      KeyError: no model of that name has a TensorFlow original (the message lists those that do).
    """
    registered = _registered()[1]
    for names in registered:
        if names.name == name:
            return names
    raise KeyError(
        f"{name!r} has no TensorFlow original whose checkpoints estimax reads; those that do: "
        f"{', '.join(n.name for n in registered)}"
    )


def get_model(name: str, **kwargs: Any) -> nn.Module:
    """Builds a registered model.

    Args:
      name: a key of ``MODELS`` (e.g. ``"resnet50"``, ``"inception_v3"``).
      **kwargs: module fields (``num_classes``, ``dtype``, ``conv``, ``norm``, ...).

    Returns:
      The (unbound) Flax module.
    """
    registered = _registered()[0]
    try:
        constructor = registered[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; registered models: {sorted(registered)}"
        ) from None
    return constructor(**kwargs)


# A literal list, though _EXPORTS holds the model files' names too: linters and type checkers
# read __all__ statically to see the TYPE_CHECKING imports above as re-exports.
__all__ = [
    "MODELS",
    "TF_NAMES",
    "TFNames",
    "get_model",
    "register_tf_names",
    "tf_names",
    "resnet_v1",
    "ResNet",
    "ResidualBlock",
    "BottleneckBlock",
    "ResNet18",
    "ResNet34",
    "ResNet50",
    "ResNet101",
    "ResNet152",
    "ResNet200",
    "ResNetTiny",
    "ResNetTinyBottleneck",
    "InceptionV3",
    "InceptionV3Tiny",
    "InceptionV4",
    "InceptionV4Tiny",
    "EFFICIENTNETS",
    "EfficientNet",
    "EfficientNetTiny",
]
