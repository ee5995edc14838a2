"""Small building blocks shared by the image models (ResNet, Inception).

Every model takes its convolution, normalisation and max-pool as module fields so a faster
implementation (e.g. ``estimax.ops``' CPU convolution, or cross-replica batch norm) is plugged in
without editing any block:

    ResNet50(conv=functools.partial(nn.Conv, conv_general_dilated=my_conv))
    ResNet50(norm=functools.partial(nn.BatchNorm, axis_name="batch"))   # cross-replica stats

Contracts of the injectables (the blocks only call them like this):
  * ``conv(features, kernel_size, strides=..., padding=..., use_bias=..., dtype=...,
    kernel_init=..., name=...)`` -> a module mapping ``[B, H, W, Cin] -> [B, H', W', features]``
    (``flax.linen.Conv``'s signature; ``padding`` is ``'SAME'`` or ``'VALID'``).
  * ``norm(use_running_average=..., momentum=..., epsilon=..., dtype=..., use_scale=...,
    scale_init=..., name=...)`` -> a module normalising the last axis (``flax.linen.BatchNorm``).
  * ``max_pool(x, window_shape, strides, padding)`` -> pooled ``x`` (``flax.linen.max_pool``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import flax.linen as nn
import jax.numpy as jnp

# The values of every image model's ``remat`` field (and of --remat), for the programs' flags:
# the policies of ``estimax.parallel.remat``, which the models wrap their blocks under.
from estimax.parallel.remat import REMAT_CHOICES  # noqa: F401 (re-exported)

# A module class or a functools.partial of one (flax examples/imagenet uses the same alias).
ModuleDef = Any
PoolFn = Callable[..., jnp.ndarray]


def fixed_padding(x: jnp.ndarray, kernel_size: int) -> jnp.ndarray:
    """Pads H and W independently of the input size, as the original ``fixed_padding``.

    With ``padding='SAME'`` a strided convolution's padding depends on whether H is even; the
    original pads ``k - 1`` in total (``(k-1)//2`` before, the rest after) and then runs a VALID
    convolution, so the output grid is the same for every input size. We do the same.

    Args:
      x: ``[B, H, W, C]``.
      kernel_size: the convolution's (square) kernel size ``k``.

    Returns:
      ``[B, H + k - 1, W + k - 1, C]``.
    """
    pad_total = kernel_size - 1
    pad_beg = pad_total // 2
    pad_end = pad_total - pad_beg
    return jnp.pad(x, ((0, 0), (pad_beg, pad_end), (pad_beg, pad_end), (0, 0)))


def same_avg_pool(x: jnp.ndarray, window: int) -> jnp.ndarray:
    """3x3-style stride-1 average pool with TensorFlow's ``'SAME'`` semantics.

    TF's ``avg_pool(padding='SAME')`` divides by the number of *valid* inputs under the window
    (padding is not counted), whereas ``flax.linen.avg_pool`` counts padding by default.

    Args:
      x: ``[B, H, W, C]``.
      window: square window size.

    Returns:
      ``[B, H, W, C]``.
    """
    return nn.avg_pool(x, (window, window), strides=(1, 1), padding="SAME", count_include_pad=False)


class ConvBNReLU(nn.Module):
    """slim's ``conv2d`` inside the Inception ``arg_scope``: conv (no bias) -> batch norm -> ReLU.

    Attributes:
      features: output channels.
      kernel_size: ``(kh, kw)``.
      conv: convolution module factory (already bound to dtype, kernel_init, use_bias=False).
      norm: batch-norm module factory (already bound to train/eval, momentum, epsilon, dtype).
      strides: ``(sh, sw)``.
      padding: ``'SAME'`` or ``'VALID'``.
    """

    features: int
    kernel_size: Sequence[int]
    conv: ModuleDef
    norm: ModuleDef
    strides: Sequence[int] = (1, 1)
    padding: str = "SAME"

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, H, W, Cin] -> [B, H', W', features]``."""
        x = self.conv(
            self.features,
            tuple(self.kernel_size),
            strides=tuple(self.strides),
            padding=self.padding,
            name="conv",
        )(x)
        x = self.norm(name="bn")(x)
        return nn.relu(x)


def scaled_depth(depth: int, multiplier: float, min_depth: int) -> int:
    """slim's ``depth(d) = max(int(d * depth_multiplier), min_depth)`` for thinner Inceptions.

    Args:
      depth: the channel count of the full-width network.
      multiplier: ``depth_multiplier`` (> 0).
      min_depth: lower bound on the result.

    Returns:
      The channel count to use.
    """
    if multiplier <= 0:
        raise ValueError(f"depth_multiplier must be > 0, got {multiplier}")
    return max(int(depth * multiplier), min_depth)


class BlockArgs(TypedDict):
    """The fields every ``InceptionBlock`` takes from its model, passed as ``**block_args``."""

    conv: ModuleDef
    norm: ModuleDef
    max_pool: PoolFn
    depth_multiplier: float
    min_depth: int


def conv_and_norm(
    model: Any, train: bool, kernel_init: Any, **norm_kwargs: Any
) -> tuple[ModuleDef, ModuleDef]:
    """A network's conv and batch-norm factories, bound to its fields.

    Args:
      model: the network (``conv``, ``norm``, ``dtype``, ``bn_momentum``, ``bn_epsilon``).
      train: batch statistics (and their moving averages updated) when True.
      kernel_init: the convolutions' initializer (they have no bias: a batch norm follows).
      **norm_kwargs: more batch-norm arguments (``use_scale``).
    """
    conv = functools.partial(model.conv, use_bias=False, dtype=model.dtype, kernel_init=kernel_init)
    norm = functools.partial(
        model.norm,
        use_running_average=not train,
        momentum=model.bn_momentum,
        epsilon=model.bn_epsilon,
        dtype=model.dtype,
        **norm_kwargs,
    )
    return conv, norm


def inception_block_args(model: Any, train: bool, kernel_init: Any) -> BlockArgs:
    """The factories an Inception network ``model`` gives its blocks, from its fields.

    Args:
      model: the network (``conv_and_norm``'s fields, ``bn_scale``, ``max_pool``,
        ``depth_multiplier``, ``min_depth``).
      train: batch statistics (and their moving averages updated) when True.
      kernel_init: the convolutions' initializer.
    """
    conv, norm = conv_and_norm(model, train, kernel_init, use_scale=model.bn_scale)
    return BlockArgs(
        conv=conv,
        norm=norm,
        max_pool=model.max_pool,
        depth_multiplier=model.depth_multiplier,
        min_depth=model.min_depth,
    )


def check_image_size(x: jnp.ndarray, network: str, min_size: int, aux_source: str) -> None:
    """Refuses images smaller than ``min_size`` (the aux head pools ``aux_source`` 5x5/3)."""
    if x.shape[1] < min_size or x.shape[2] < min_size:
        raise ValueError(
            f"{network} needs images of at least {min_size}x{min_size} (the aux head pools "
            f"{aux_source} 5x5/3), got {x.shape[1]}x{x.shape[2]}; the original uses 299x299"
        )


class InceptionBlock(nn.Module):
    """Base of the Inception blocks: the conv/norm/pool factories and slim's width multiplier.

    Attributes:
      conv: conv factory (bound to dtype, kernel_init, ``use_bias=False``).
      norm: batch-norm factory (bound to train/eval, momentum, epsilon, dtype, scale).
      max_pool: ``nn.max_pool``-like function.
      depth_multiplier: multiplies every layer's channels (slim's ``depth_multiplier``).
      min_depth: lower bound on the scaled channels (slim's ``min_depth``).
    """

    conv: ModuleDef
    norm: ModuleDef
    max_pool: PoolFn
    depth_multiplier: float = 1.0
    min_depth: int = 16

    def c(
        self,
        features: int,
        kernel: Sequence[int],
        name: str,
        strides: int = 1,
        padding: str = "SAME",
    ) -> ConvBNReLU:
        """A conv-BN-ReLU with ``features`` scaled by ``depth_multiplier``."""
        return ConvBNReLU(
            scaled_depth(features, self.depth_multiplier, self.min_depth),
            tuple(kernel),
            conv=self.conv,
            norm=self.norm,
            strides=(strides, strides),
            padding=padding,
            name=name,
        )
