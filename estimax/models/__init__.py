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
from typing import Any

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
from estimax.models.tf_names import TFNames, register_tf_names


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


# Name -> constructor of every registered network; and the networks whose TensorFlow
# original's checkpoints estimax reads (warm starts, conversion), each map beside its model.
MODELS, TF_NAMES = _registry()


def tf_names(name: str) -> TFNames:
    """The TensorFlow names of the original ``name`` (``resnet``, ``inception_v3``...).

    Raises:
      KeyError: no model of that name has a TensorFlow original (the message lists those that do).
    """
    for names in TF_NAMES:
        if names.name == name:
            return names
    raise KeyError(
        f"{name!r} has no TensorFlow original whose checkpoints estimax reads; those that do: "
        f"{', '.join(n.name for n in TF_NAMES)}"
    )


def get_model(name: str, **kwargs: Any) -> nn.Module:
    """Builds a registered model.

    Args:
      name: a key of ``MODELS`` (e.g. ``"resnet50"``, ``"inception_v3"``).
      **kwargs: module fields (``num_classes``, ``dtype``, ``conv``, ``norm``, ...).

    Returns:
      The (unbound) Flax module.
    """
    try:
        constructor = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; registered models: {sorted(MODELS)}") from None
    return constructor(**kwargs)


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
