"""Low-level JAX ops: drop-ins that XLA:CPU runs fast, forward and backward.

Use them in Flax models (GPU/TPU lower to the standard ops unchanged)::

    conv = functools.partial(nn.Conv, conv_general_dilated=ops.conv_general_dilated)
    y = ops.max_pool(x, (2, 2), strides=(2, 2))

They (and estimax's models) also serve in programs of your own: inside ``jax.shard_map`` (with
its default ``check_vma=True``: a replicated weight's gradient is summed over the batch's axes, as
JAX's own ops do), under ``jax.jit`` with ``NamedSharding``s and ``jax.grad``
(``tests/test_ops_in_user_programs.py``).
"""

import functools
from typing import Any

import flax.linen as nn

from estimax.ops.cpu_conv import conv_general_dilated, conv_strategies, conv_with_strategy
from estimax.ops.cpu_pool import max_pool
from estimax.ops.cpu_runtime import restore_cpu_allocator, tune_cpu_allocator

__all__ = [
    "FastConv",
    "conv_general_dilated",
    "conv_strategies",
    "conv_with_strategy",
    "fast_layers",
    "max_pool",
    "restore_cpu_allocator",
    "standard_layers",
    "tune_cpu_allocator",
]

# ``nn.Conv`` that XLA:CPU runs fast (oneDNN where built, forward and gradients); GPU/TPU lower
# to the standard convolution.
FastConv = functools.partial(nn.Conv, conv_general_dilated=conv_general_dilated)


def fast_layers() -> dict[str, Any]:
    """The ``conv``/``max_pool`` keyword arguments that plug these ops into estimax's models.

    They are the models' defaults; this names them for callers that choose explicitly.
    """
    return {"conv": FastConv, "max_pool": max_pool}


def standard_layers() -> dict[str, Any]:
    """``conv``/``max_pool`` keyword arguments for Flax's own ``nn.Conv``/``nn.max_pool``."""
    return {"conv": nn.Conv, "max_pool": nn.max_pool}
