"""The MNIST CNN of the Cloud TPU "Using the Estimator API with TPUs" guide (seed 002)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from estimax import ops

ModuleDef = Any


class MnistCNN(nn.Module):
    """conv 5x5x32 -> max-pool 2 -> conv 5x5x64 -> max-pool 2 -> dense -> dropout -> dense.

    Attributes:
      num_classes: output classes.
      dense_units: width of the hidden dense layer (128 in the guide; the later mnist_tpu.py
        used 1024).
      dropout_rate: dropout before the logits, in training only.
      dtype: compute dtype (parameters stay float32; logits are returned as float32).
      conv: the convolution module (default: ``nn.Conv`` with estimax's CPU-fast gradients).
      max_pool: the max-pool function, with ``nn.max_pool``'s signature (same default).
    """

    num_classes: int = 10
    dense_units: int = 128
    dropout_rate: float = 0.4
    dtype: Any = jnp.float32
    conv: ModuleDef = ops.FastConv
    max_pool: Callable[..., jax.Array] = ops.max_pool

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        """Maps images ``[B, 784]`` or ``[B, 28, 28(, 1)]`` to logits ``[B, num_classes]``."""
        x = jnp.asarray(x, self.dtype).reshape(-1, 28, 28, 1)
        x = nn.relu(self.conv(32, (5, 5), padding="SAME", dtype=self.dtype, name="conv1")(x))
        x = self.max_pool(x, (2, 2), strides=(2, 2), padding="VALID")
        x = nn.relu(self.conv(64, (5, 5), padding="SAME", dtype=self.dtype, name="conv2")(x))
        x = self.max_pool(x, (2, 2), strides=(2, 2), padding="VALID")
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.dense_units, dtype=self.dtype, name="dense")(x))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        x = nn.Dense(self.num_classes, dtype=self.dtype, name="logits")(x)
        return x.astype(jnp.float32)
