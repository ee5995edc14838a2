"""ResNet v1 (post-activation) as the original ``tensorflow/tpu`` ``resnet_model.py``.

What the original does, and so do we (docs/original.md §3):
  * post-activation units (conv -> BN -> ReLU), He et al. 1512.03385;
  * basic (two 3x3) blocks for depth 18/34, bottleneck blocks for >= 50 with the stride on the
    3x3 conv (the "v1.5" placement);
  * a projection shortcut (1x1 conv + BN, no ReLU) in the *first block of every group* -- also in
    group 1 of ResNet-18/34, where torchvision uses an identity (so those two have 4,224 more
    parameters than torchvision's; ``always_project=False`` gives torchvision's layout);
  * "fixed padding": strided convs pad ``k-1`` explicitly then run VALID;
  * batch norm momentum 0.9 (the original's BATCH_NORM_DECAY), epsilon 1e-5, with a learned scale;
    the last BN of every block starts with gamma = 0;
  * conv kernels ``tf.variance_scaling_initializer()`` (scale 1, fan_in, truncated normal); the
    dense head N(0, 0.01) with zero bias;
  * stem 7x7/2 conv (64) -> BN -> ReLU -> 3x3/2 max-pool 'SAME'; groups of 64/128/256/512 filters
    with strides 1/2/2/2; global average pool; dense ``num_classes``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from estimax import ops
from estimax.models.layers import ModuleDef, PoolFn, conv_and_norm, fixed_padding
from estimax.models.tf_names import Entry, TFNames, has_path, numbered
from estimax.parallel.remat import remat_block

# The original's constants (resnet_model.py BATCH_NORM_DECAY / BATCH_NORM_EPSILON).
BATCH_NORM_DECAY = 0.9
BATCH_NORM_EPSILON = 1e-5

# tf.variance_scaling_initializer() defaults: scale=1.0, mode='fan_in', truncated normal.
conv_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
dense_kernel_init = nn.initializers.normal(stddev=0.01)


def _conv_fixed_padding(
    conv: ModuleDef, x: jnp.ndarray, filters: int, kernel_size: int, strides: int, name: str
) -> jnp.ndarray:
    """The original's ``conv2d_fixed_padding``: explicit pad + VALID when strided, else SAME."""
    if strides > 1:
        x = fixed_padding(x, kernel_size)
    return conv(
        filters,
        (kernel_size, kernel_size),
        strides=(strides, strides),
        padding="VALID" if strides > 1 else "SAME",
        name=name,
    )(x)


class ResidualBlock(nn.Module):
    """Basic block (ResNet-18/34): 3x3(s) BN ReLU, 3x3 BN(gamma=0), + shortcut, ReLU.

    Attributes:
      filters: channels of both convs (and of the output).
      conv: conv factory (bound to dtype, kernel_init, ``use_bias=False``).
      norm: batch-norm factory (bound to train/eval, momentum, epsilon, dtype).
      strides: stride of the first conv and of the projection shortcut.
      use_projection: 1x1 conv + BN on the shortcut (first block of each group).
    """

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    strides: int = 1
    use_projection: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, H, W, C] -> [B, H/s, W/s, filters]``."""
        shortcut = x
        if self.use_projection:
            shortcut = _conv_fixed_padding(self.conv, x, self.filters, 1, self.strides, "proj_conv")
            shortcut = self.norm(name="proj_bn")(shortcut)
        y = _conv_fixed_padding(self.conv, x, self.filters, 3, self.strides, "conv1")
        y = nn.relu(self.norm(name="bn1")(y))
        y = _conv_fixed_padding(self.conv, y, self.filters, 3, 1, "conv2")
        y = self.norm(scale_init=nn.initializers.zeros, name="bn2")(y)
        return nn.relu(y + shortcut)


class BottleneckBlock(nn.Module):
    """Bottleneck block (ResNet-50+): 1x1 BN ReLU, 3x3(s) BN ReLU, 1x1(4f) BN(gamma=0), +, ReLU.

    Attributes:
      filters: channels of the 1x1 and 3x3 convs; the output has ``4 * filters``.
      conv: conv factory (bound to dtype, kernel_init, ``use_bias=False``).
      norm: batch-norm factory (bound to train/eval, momentum, epsilon, dtype).
      strides: stride of the 3x3 conv (the original's placement) and of the projection.
      use_projection: 1x1 conv (4f) + BN on the shortcut (first block of each group).
    """

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    strides: int = 1
    use_projection: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, H, W, C] -> [B, H/s, W/s, 4 * filters]``."""
        shortcut = x
        if self.use_projection:
            shortcut = _conv_fixed_padding(
                self.conv, x, 4 * self.filters, 1, self.strides, "proj_conv"
            )
            shortcut = self.norm(name="proj_bn")(shortcut)
        y = _conv_fixed_padding(self.conv, x, self.filters, 1, 1, "conv1")
        y = nn.relu(self.norm(name="bn1")(y))
        y = _conv_fixed_padding(self.conv, y, self.filters, 3, self.strides, "conv2")
        y = nn.relu(self.norm(name="bn2")(y))
        y = _conv_fixed_padding(self.conv, y, 4 * self.filters, 1, 1, "conv3")
        y = self.norm(scale_init=nn.initializers.zeros, name="bn3")(y)
        return nn.relu(y + shortcut)


class BlockGroup(nn.Module):
    """``num_blocks`` blocks at one resolution; only the first strides and projects.

    Attributes:
      block_cls: ``ResidualBlock`` or ``BottleneckBlock``.
      num_blocks: blocks in the group.
      filters: the blocks' ``filters``.
      strides: stride of the first block.
      conv: conv factory. norm: batch-norm factory.
      project_first: give the first block a projection shortcut.
    """

    block_cls: ModuleDef
    num_blocks: int
    filters: int
    strides: int
    conv: ModuleDef
    norm: ModuleDef
    project_first: bool = True

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, H, W, C] -> [B, H/strides, W/strides, C']``."""
        for i in range(self.num_blocks):
            x = self.block_cls(
                filters=self.filters,
                conv=self.conv,
                norm=self.norm,
                strides=self.strides if i == 0 else 1,
                use_projection=i == 0 and self.project_first,
                name=f"block{i}",
            )(x)
        return x


class ResNet(nn.Module):
    """ResNet v1 as the original ``resnet_v1(resnet_depth, num_classes)``.

    Attributes:
      stage_sizes: blocks per group, e.g. ``(3, 4, 6, 3)``.
      block_cls: ``ResidualBlock`` (18/34) or ``BottleneckBlock`` (>= 50).
      num_classes: logits per example (the original's ``num_label_classes``, 1000).
      num_filters: filters of the stem and of group 1; doubles per group (64 as the original).
      dtype: compute dtype (``jnp.bfloat16`` for ``--precision=bfloat16``); params stay float32,
        logits are returned in float32.
      conv: convolution module (``nn.Conv`` signature; default ``estimax.ops.FastConv``,
        whose CPU lowering is fast and whose GPU/TPU lowering is ``nn.Conv``'s).
      norm: batch norm (``nn.BatchNorm`` signature).
      max_pool: the stem's max pool (``nn.max_pool`` signature; default ``estimax.ops.max_pool``).
      bn_momentum: batch-norm moving-average decay. bn_epsilon: batch-norm epsilon.
      always_project: projection shortcut in the first block of *every* group, as the original.
        ``False`` skips it where the shapes already match (torchvision's ResNet-18/34 layout).
      remat: recompute each residual block's activations in the backward pass instead of
        keeping them (``--remat``): ``"none"``, ``"full"`` or a ``jax.checkpoint_policies``
        name (``remat.REMAT_CHOICES``); the parameters are the same under every choice.
    """

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int = 1000
    num_filters: int = 64
    dtype: Any = jnp.float32
    conv: ModuleDef = ops.FastConv
    norm: ModuleDef = nn.BatchNorm
    max_pool: PoolFn = ops.max_pool
    bn_momentum: float = BATCH_NORM_DECAY
    bn_epsilon: float = BATCH_NORM_EPSILON
    always_project: bool = True
    remat: str = "none"

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        """Logits for a batch of images.

        Args:
          x: ``[B, H, W, 3]`` float, already normalised (the original subtracts the ImageNet
            mean and divides by the std in ``model_fn``, before the network).
          train: batch statistics (and their moving averages updated, ``mutable=['batch_stats']``)
            when True; moving averages when False.

        Returns:
          ``[B, num_classes]`` float32 logits.
        """
        conv, norm = conv_and_norm(self, train, conv_kernel_init)
        x = _conv_fixed_padding(conv, x, self.num_filters, 7, 2, "initial_conv")
        x = nn.relu(norm(name="initial_bn")(x))
        x = self.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        block_cls = remat_block(self.block_cls, self.remat)
        for g, num_blocks in enumerate(self.stage_sizes):
            filters = self.num_filters * 2**g
            # Group 1 of a basic-block ResNet keeps the stem's width at stride 1, so its shortcut
            # needs no projection; the original adds one anyway (always_project).
            needs_projection = g > 0 or self.block_cls is not ResidualBlock
            x = BlockGroup(
                block_cls=block_cls,
                num_blocks=num_blocks,
                filters=filters,
                strides=1 if g == 0 else 2,
                conv=conv,
                norm=norm,
                project_first=self.always_project or needs_projection,
                name=f"block_group{g + 1}",
            )(x)
        # The original pools over the whole final feature map (7x7 at 224).
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(
            self.num_classes, dtype=self.dtype, kernel_init=dense_kernel_init, name="final_dense"
        )(x)
        return x.astype(jnp.float32)


# The original's depths (resnet_model.resnet_v1 model_params).
ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), block_cls=ResidualBlock)
ResNet34 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=ResidualBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=BottleneckBlock)
ResNet101 = functools.partial(ResNet, stage_sizes=(3, 4, 23, 3), block_cls=BottleneckBlock)
ResNet152 = functools.partial(ResNet, stage_sizes=(3, 8, 36, 3), block_cls=BottleneckBlock)
ResNet200 = functools.partial(ResNet, stage_sizes=(3, 24, 36, 3), block_cls=BottleneckBlock)
# For tests: two groups of one block each, 8 stem filters; same code paths as the full models.
ResNetTiny = functools.partial(ResNet, stage_sizes=(1, 1), block_cls=ResidualBlock, num_filters=8)
ResNetTinyBottleneck = functools.partial(
    ResNet, stage_sizes=(1, 1), block_cls=BottleneckBlock, num_filters=8
)

# The variants ``estimax.models.MODELS`` registers from this file (``get_model(name)``).
MODELS = {
    "resnet18": ResNet18,
    "resnet34": ResNet34,
    "resnet50": ResNet50,
    "resnet101": ResNet101,
    "resnet152": ResNet152,
    "resnet200": ResNet200,
    "resnet_tiny": ResNetTiny,
    "resnet_tiny_bottleneck": ResNetTinyBottleneck,
}

RESNET_DEPTHS: dict[int, Callable[..., ResNet]] = {
    18: ResNet18,
    34: ResNet34,
    50: ResNet50,
    101: ResNet101,
    152: ResNet152,
    200: ResNet200,
}


def resnet_v1(resnet_depth: int, num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """The original's ``resnet_model.resnet_v1(resnet_depth, num_classes)``.

    Args:
      resnet_depth: one of 18, 34, 50, 101, 152, 200 (the ``--resnet_depth`` flag).
      num_classes: logits per example.
      **kwargs: other ``ResNet`` fields (``dtype``, ``conv``, ``norm``, ...).

    Returns:
      An (unbound) ``ResNet`` module.
    """
    if resnet_depth not in RESNET_DEPTHS:
        raise ValueError(
            f"--resnet_depth={resnet_depth} is not supported; choose one of {sorted(RESNET_DEPTHS)}"
        )
    return RESNET_DEPTHS[resnet_depth](num_classes=num_classes, **kwargs)


# --- The original's TensorFlow names -----------------------------------------------------------
# resnet_model.py's tf.layers at the root scope, numbered in creation order: conv2d[_N]/kernel,
# batch_normalization[_N]/{gamma,beta,moving_mean,moving_variance}, dense/{kernel,bias}. Per block:
# the projection conv/BN first (first block of a group), then the block's convs.


def tf_name_map(variables: Mapping[str, Any]) -> list[Entry]:
    """The map of an estimax ``ResNet``'s variables (``{"params": ..., "batch_stats": ...}``)."""
    params = variables["params"]
    entries: list[Entry] = []
    counts = {"conv": 0, "bn": 0}

    def conv(*path: str) -> None:
        entries.append(
            Entry("params", (*path, "kernel"), f"{numbered('conv2d', counts['conv'])}/kernel")
        )
        counts["conv"] += 1

    def bn(*path: str) -> None:
        name = numbered("batch_normalization", counts["bn"])
        counts["bn"] += 1
        entries.extend(
            [
                Entry("params", (*path, "scale"), f"{name}/gamma"),
                Entry("params", (*path, "bias"), f"{name}/beta"),
                Entry("batch_stats", (*path, "mean"), f"{name}/moving_mean"),
                Entry("batch_stats", (*path, "var"), f"{name}/moving_variance"),
            ]
        )

    conv("initial_conv")
    bn("initial_bn")
    groups = sorted(
        (k for k in params if k.startswith("block_group")),
        key=lambda k: int(k[len("block_group") :]),
    )
    for group in groups:
        blocks = sorted(params[group], key=lambda k: int(k[len("block") :]))
        for block in blocks:
            if has_path(params, group, block, "proj_conv"):
                conv(group, block, "proj_conv")
                bn(group, block, "proj_bn")
            for i in (1, 2, 3):
                if has_path(params, group, block, f"conv{i}"):
                    conv(group, block, f"conv{i}")
                    bn(group, block, f"bn{i}")
    entries.append(Entry("params", ("final_dense", "kernel"), "dense/kernel"))
    entries.append(Entry("params", ("final_dense", "bias"), "dense/bias"))
    return entries


TF_NAMES = TFNames("resnet", "initial_conv", tf_name_map)
