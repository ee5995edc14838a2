"""Flax models: ResNet v1 18-200, Inception v3 and v4, EfficientNet B0-B7 (MNIST CNN: ``mnist``).

Every image model is called as ``model.apply(variables, x, train=..., mutable=[...])`` with
``x: [B, H, W, 3]`` float and returns float32 logits ``[B, num_classes]`` -- the Inceptions return
``(logits, aux_logits)`` while ``aux_logits=True`` (their default, as the original).

``MODELS`` is an explicit registry (name -> constructor); ``get_model(name, **kw)`` looks a name up
with a helpful error. The ``*_tiny`` entries are thin variants that exercise the same code for
tests. ``TF_NAMES`` lists the models whose TensorFlow original's checkpoints estimax reads, each
map written beside its model (``estimax.models.tf_names``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from estimax.models import inception_v3, inception_v4, resnet
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
from estimax.models.tf_names import TFNames

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": ResNet18,
    "resnet34": ResNet34,
    "resnet50": ResNet50,
    "resnet101": ResNet101,
    "resnet152": ResNet152,
    "resnet200": ResNet200,
    "resnet_tiny": ResNetTiny,
    "resnet_tiny_bottleneck": ResNetTinyBottleneck,
    "inception_v3": InceptionV3,
    "inception_v3_tiny": InceptionV3Tiny,
    "inception_v4": InceptionV4,
    "inception_v4_tiny": InceptionV4Tiny,
    # efficientnet_b0 .. efficientnet_b7
    **{name.replace("-", "_"): variant for name, (variant, _) in EFFICIENTNETS.items()},
    "efficientnet_tiny": EfficientNetTiny,
}


# The networks whose TensorFlow original's checkpoints estimax reads (warm starts, conversion).
TF_NAMES: tuple[TFNames, ...] = (resnet.TF_NAMES, inception_v3.TF_NAMES, inception_v4.TF_NAMES)


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
