"""Low-level JAX ops: drop-ins whose gradients XLA:CPU runs fast.

Use them in Flax models (GPU/TPU lower to the standard ops unchanged)::

    conv = functools.partial(nn.Conv, conv_general_dilated=ops.conv_general_dilated)
    y = ops.max_pool(x, (2, 2), strides=(2, 2))
"""

from estimax.ops.cpu_conv import conv_general_dilated
from estimax.ops.cpu_conv import conv_with_strategy
from estimax.ops.cpu_pool import max_pool
from estimax.ops.cpu_runtime import restore_cpu_allocator
from estimax.ops.cpu_runtime import tune_cpu_allocator

__all__ = ["conv_general_dilated", "conv_with_strategy", "max_pool", "restore_cpu_allocator",
           "tune_cpu_allocator"]
