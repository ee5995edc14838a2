"""Name maps: the original models' TensorFlow variable names <-> estimax's Flax variables.

Each map lives beside its model (``estimax.models.resnet``, ``inception_v3``, ``inception_v4``:
``tf_name_map`` and ``TF_NAMES``; the vocabulary is ``estimax.models.tf_names``). This module
looks them up by the original's name for the loader (``estimax.migrate.load``):

* ResNet v1 (``resnet_model.py``): ``tf.layers`` at the root scope, numbered in creation order:
  ``conv2d[_N]/kernel``, ``batch_normalization[_N]/{gamma,beta,moving_mean,moving_variance}``,
  ``dense/{kernel,bias}``.
* Inception v3/v4 (TF-slim): ``InceptionV3/<block>/Branch_k/<layer>/weights`` and
  ``.../BatchNorm/{beta,moving_mean,moving_variance}`` (no gamma).
"""

from __future__ import annotations

from estimax import models
from estimax.models import inception_v3, inception_v4, resnet
from estimax.models.tf_names import Entry, TFNames

__all__ = [
    "Entry",
    "MODEL_MAPS",
    "TFNames",
    "inception_v3_map",
    "inception_v4_map",
    "lookup",
    "resnet_map",
]

resnet_map = resnet.tf_name_map
inception_v3_map = inception_v3.tf_name_map
inception_v4_map = inception_v4.tf_name_map

# The original's name -> its map (``MODEL_MAPS["resnet"](variables)``).
MODEL_MAPS = {names.name: names.entries for names in models.TF_NAMES}


def lookup(model: str | TFNames) -> TFNames:
    """``model``'s TensorFlow names, given as the original's name or as the names themselves.

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    return model if isinstance(model, TFNames) else models.tf_names(model)
