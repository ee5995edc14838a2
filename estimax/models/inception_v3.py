"""Inception v3 (Szegedy et al. 1512.00567) as TF-slim's ``inception_v3``, which the original
``tensorflow/tpu`` ``models/experimental/inception/inception_v3.py`` trains.

As slim (and its ``inception_v3_arg_scope``): every conv is conv (no bias) -> batch norm with no
learned scale (``batch_norm_scale=False``) -> ReLU, kernels ``variance_scaling_initializer()``
(He, truncated normal); the original passes BN decay 0.996 and epsilon 1e-3 (§6). The auxiliary
head hangs off ``Mixed_6e`` and its logits are returned too (the original's loss weights them
0.4). 1001 classes by default (ImageNet + background, as the original's ``--num_classes``).
Dropout keep 0.8 before the logits. Branch names follow torchvision/Keras (``branch_3x3dbl_2``),
block names slim (``Mixed_5b``).

Differences from slim, on purpose: the final pool is a global mean (slim pools 8x8 VALID, the
same at the 299x299 the model is made for, but slim fails to squeeze larger inputs);
``depth_multiplier``/``min_depth`` are slim's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from estimax import ops
from estimax.models import layers
from estimax.models.layers import (
    BlockArgs,
    ConvBNReLU,
    InceptionBlock,
    ModuleDef,
    PoolFn,
    same_avg_pool,
    scaled_depth,
)
from estimax.models.tf_names import Entry, TFNames, kernel_hw, slim_layer
from estimax.parallel import remat

# The original's constants (inception_v3.py BATCH_NORM_DECAY / BATCH_NORM_EPSILON).
BATCH_NORM_DECAY = 0.996
BATCH_NORM_EPSILON = 1e-3
# Smallest square input whose Mixed_6e map still fits the aux head's 5x5/3 VALID pool.
MIN_IMAGE_SIZE = 107

# slim.variance_scaling_initializer() defaults: factor 2.0, FAN_IN, truncated normal (He).
conv_kernel_init = nn.initializers.variance_scaling(2.0, "fan_in", "truncated_normal")


class InceptionA(InceptionBlock):
    """Mixed_5b/5c/5d (35x35): 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1(pool_features)."""

    pool_features: int = 32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 35, 35, C] -> [B, 35, 35, 224 + pool_features]`` (full width)."""
        b0 = self.c(64, (1, 1), "branch_1x1")(x)
        b1 = self.c(48, (1, 1), "branch_5x5_1")(x)
        b1 = self.c(64, (5, 5), "branch_5x5_2")(b1)
        b2 = self.c(64, (1, 1), "branch_3x3dbl_1")(x)
        b2 = self.c(96, (3, 3), "branch_3x3dbl_2")(b2)
        b2 = self.c(96, (3, 3), "branch_3x3dbl_3")(b2)
        b3 = self.c(self.pool_features, (1, 1), "branch_pool")(same_avg_pool(x, 3))
        return jnp.concatenate([b0, b1, b2, b3], axis=-1)


class InceptionB(InceptionBlock):
    """Mixed_6a (35 -> 17): 3x3/2 | 1x1-3x3-3x3/2 | maxpool 3x3/2."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 35, 35, C] -> [B, 17, 17, 480 + C]`` (full width)."""
        b0 = self.c(384, (3, 3), "branch_3x3", strides=2, padding="VALID")(x)
        b1 = self.c(64, (1, 1), "branch_3x3dbl_1")(x)
        b1 = self.c(96, (3, 3), "branch_3x3dbl_2")(b1)
        b1 = self.c(96, (3, 3), "branch_3x3dbl_3", strides=2, padding="VALID")(b1)
        b2 = self.max_pool(x, (3, 3), strides=(2, 2), padding="VALID")
        return jnp.concatenate([b0, b1, b2], axis=-1)


class InceptionC(InceptionBlock):
    """Mixed_6b..6e (17x17) with factorised 7x7 convs of width ``channels_7x7``."""

    channels_7x7: int = 128

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 17, 17, C] -> [B, 17, 17, 768]`` (full width)."""
        c7 = self.channels_7x7
        b0 = self.c(192, (1, 1), "branch_1x1")(x)
        b1 = self.c(c7, (1, 1), "branch_7x7_1")(x)
        b1 = self.c(c7, (1, 7), "branch_7x7_2")(b1)
        b1 = self.c(192, (7, 1), "branch_7x7_3")(b1)
        b2 = self.c(c7, (1, 1), "branch_7x7dbl_1")(x)
        b2 = self.c(c7, (7, 1), "branch_7x7dbl_2")(b2)
        b2 = self.c(c7, (1, 7), "branch_7x7dbl_3")(b2)
        b2 = self.c(c7, (7, 1), "branch_7x7dbl_4")(b2)
        b2 = self.c(192, (1, 7), "branch_7x7dbl_5")(b2)
        b3 = self.c(192, (1, 1), "branch_pool")(same_avg_pool(x, 3))
        return jnp.concatenate([b0, b1, b2, b3], axis=-1)


class InceptionD(InceptionBlock):
    """Mixed_7a (17 -> 8): 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool 3x3/2."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 17, 17, C] -> [B, 8, 8, 512 + C]`` (full width)."""
        b0 = self.c(192, (1, 1), "branch_3x3_1")(x)
        b0 = self.c(320, (3, 3), "branch_3x3_2", strides=2, padding="VALID")(b0)
        b1 = self.c(192, (1, 1), "branch_7x7x3_1")(x)
        b1 = self.c(192, (1, 7), "branch_7x7x3_2")(b1)
        b1 = self.c(192, (7, 1), "branch_7x7x3_3")(b1)
        b1 = self.c(192, (3, 3), "branch_7x7x3_4", strides=2, padding="VALID")(b1)
        b2 = self.max_pool(x, (3, 3), strides=(2, 2), padding="VALID")
        return jnp.concatenate([b0, b1, b2], axis=-1)


class InceptionE(InceptionBlock):
    """Mixed_7b/7c (8x8): 1x1 | 1x1-(1x3,3x1) | 1x1-3x3-(1x3,3x1) | avgpool-1x1."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 8, 8, C] -> [B, 8, 8, 2048]`` (full width)."""
        b0 = self.c(320, (1, 1), "branch_1x1")(x)
        b1 = self.c(384, (1, 1), "branch_3x3_1")(x)
        b1 = jnp.concatenate(
            [self.c(384, (1, 3), "branch_3x3_2a")(b1), self.c(384, (3, 1), "branch_3x3_2b")(b1)],
            axis=-1,
        )
        b2 = self.c(448, (1, 1), "branch_3x3dbl_1")(x)
        b2 = self.c(384, (3, 3), "branch_3x3dbl_2")(b2)
        b2 = jnp.concatenate(
            [
                self.c(384, (1, 3), "branch_3x3dbl_3a")(b2),
                self.c(384, (3, 1), "branch_3x3dbl_3b")(b2),
            ],
            axis=-1,
        )
        b3 = self.c(192, (1, 1), "branch_pool")(same_avg_pool(x, 3))
        return jnp.concatenate([b0, b1, b2, b3], axis=-1)


class InceptionAux(InceptionBlock):
    """slim's AuxLogits head: avgpool 5x5/3 VALID, 1x1 (128), kxk VALID (768), 1x1 logits."""

    num_classes: int = 1001
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 17, 17, C] -> [B, num_classes]``."""
        x = nn.avg_pool(x, (5, 5), strides=(3, 3), padding="VALID")
        x = self.c(128, (1, 1), "conv0")(x)
        # slim's _reduced_kernel_size_for_small_input: at most 5x5, at most the map (5x5 at 299).
        kernel = (min(x.shape[1], 5), min(x.shape[2], 5))
        x = ConvBNReLU(
            scaled_depth(768, self.depth_multiplier, self.min_depth),
            kernel,
            conv=functools.partial(self.conv, kernel_init=nn.initializers.truncated_normal(0.01)),
            norm=self.norm,
            padding="VALID",
            name="conv1",
        )(x)
        x = jnp.mean(x, axis=(1, 2))  # [B, 1, 1, 768] at 299; flattens like slim's squeeze
        return nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            kernel_init=nn.initializers.truncated_normal(0.001),
            name="fc",
        )(x)


def _v3_stem(kw: BlockArgs, x: jnp.ndarray) -> jnp.ndarray:
    """InceptionV3's stem, 299 x 299 x 3 -> 35 x 35 x 192 (its convs are the caller's)."""

    def c(
        features: int, kernel: tuple[int, int], name: str, strides: int = 1, padding: str = "VALID"
    ) -> ConvBNReLU:
        # The stem's default padding is VALID in slim (inception_v3_base arg_scope).
        return ConvBNReLU(
            scaled_depth(features, kw["depth_multiplier"], kw["min_depth"]),
            kernel,
            conv=kw["conv"],
            norm=kw["norm"],
            strides=(strides, strides),
            padding=padding,
            name=name,
        )

    x = c(32, (3, 3), "Conv2d_1a_3x3", strides=2)(x)  # 149 x 149 x 32
    x = c(32, (3, 3), "Conv2d_2a_3x3")(x)  # 147 x 147 x 32
    x = c(64, (3, 3), "Conv2d_2b_3x3", padding="SAME")(x)  # 147 x 147 x 64
    x = kw["max_pool"](x, (3, 3), strides=(2, 2), padding="VALID")  # 73 x 73 x 64
    x = c(80, (1, 1), "Conv2d_3b_1x1")(x)  # 73 x 73 x 80
    x = c(192, (3, 3), "Conv2d_4a_3x3")(x)  # 71 x 71 x 192
    return kw["max_pool"](x, (3, 3), strides=(2, 2), padding="VALID")  # 35 x 35 x 192


class InceptionV3(nn.Module):
    """Inception v3 with the auxiliary head.

    Attributes:
      num_classes: logits per example (1001 as the original: index 0 is background).
      aux_logits: build the auxiliary head and return its logits as well.
      dropout_rate: dropout before the logits (slim's ``dropout_keep_prob=0.8``).
      depth_multiplier: slim's channel multiplier (< 1 for thin test models).
      min_depth: slim's lower bound on any layer's channels.
      dtype: compute dtype (``jnp.bfloat16`` for ``--precision=bfloat16``); params float32;
        logits returned float32.
      conv: convolution module (``nn.Conv`` signature; default ``estimax.ops.FastConv``).
        norm: batch norm (``nn.BatchNorm``).
      max_pool: max pool (``nn.max_pool`` signature; default ``estimax.ops.max_pool``).
      bn_momentum: BN moving-average decay. bn_epsilon: BN epsilon.
      bn_scale: learn a BN scale (slim: False; torchvision: True).
      remat: recompute each Inception block's activations (the ``Mixed_*`` blocks) in the
        backward pass instead of keeping them (``--remat``): ``"none"``, ``"full"`` or a
        ``jax.checkpoint_policies`` name (``remat.REMAT_CHOICES``); the parameters are the same
        under every choice.
    """

    num_classes: int = 1001
    aux_logits: bool = True
    dropout_rate: float = 0.2
    depth_multiplier: float = 1.0
    min_depth: int = 16
    dtype: Any = jnp.float32
    conv: ModuleDef = ops.FastConv
    norm: ModuleDef = nn.BatchNorm
    max_pool: PoolFn = ops.max_pool
    bn_momentum: float = BATCH_NORM_DECAY
    bn_epsilon: float = BATCH_NORM_EPSILON
    bn_scale: bool = False
    remat: str = "none"

    @nn.compact
    def __call__(
        self, x: jnp.ndarray, train: bool
    ) -> jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]:
        """Logits (and auxiliary logits) for a batch of images.

        Args:
          x: ``[B, H, W, 3]`` float in [-1, 1] (Inception preprocessing), H, W >= 107 (299 as
            the original).
          train: batch statistics, moving-average updates (``mutable=['batch_stats']``) and
            dropout (needs a ``'dropout'`` rng) when True.

        Returns:
          ``(logits, aux_logits)``, each ``[B, num_classes]`` float32, if ``aux_logits``;
          else ``logits``.
        """
        layers.check_image_size(x, "InceptionV3", MIN_IMAGE_SIZE, "Mixed_6e")
        kw = layers.inception_block_args(self, train, conv_kernel_init)
        x = _v3_stem(kw, x)  # 35 x 35 x 192
        # The Mixed blocks under --remat (the same class, and so the same names, with "none").
        block_a, block_b, block_c, block_d, block_e = (
            remat.remat_block(cls, self.remat)
            for cls in (InceptionA, InceptionB, InceptionC, InceptionD, InceptionE)
        )
        x = block_a(**kw, pool_features=32, name="Mixed_5b")(x)  # 35 x 35 x 256
        x = block_a(**kw, pool_features=64, name="Mixed_5c")(x)  # 35 x 35 x 288
        x = block_a(**kw, pool_features=64, name="Mixed_5d")(x)  # 35 x 35 x 288
        x = block_b(**kw, name="Mixed_6a")(x)  # 17 x 17 x 768
        x = block_c(**kw, channels_7x7=128, name="Mixed_6b")(x)
        x = block_c(**kw, channels_7x7=160, name="Mixed_6c")(x)
        x = block_c(**kw, channels_7x7=160, name="Mixed_6d")(x)
        x = block_c(**kw, channels_7x7=192, name="Mixed_6e")(x)  # 17 x 17 x 768
        aux = None
        if self.aux_logits:
            aux = InceptionAux(
                **kw, num_classes=self.num_classes, dtype=self.dtype, name="AuxLogits"
            )(x)
        x = block_d(**kw, name="Mixed_7a")(x)  # 8 x 8 x 1280
        x = block_e(**kw, name="Mixed_7b")(x)  # 8 x 8 x 2048
        x = block_e(**kw, name="Mixed_7c")(x)  # 8 x 8 x 2048
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(self.dropout_rate, deterministic=not train, name="Dropout_1b")(x)
        # slim's Conv2d_1c_1x1 on the 1x1 map: a dense layer with the conv initializer.
        logits = nn.Dense(
            self.num_classes, dtype=self.dtype, kernel_init=conv_kernel_init, name="Logits"
        )(x).astype(jnp.float32)
        if aux is not None:  # self.aux_logits
            return logits, aux.astype(jnp.float32)
        return logits


# For tests: slim's depth_multiplier at its smallest useful value (every layer min_depth=16
# channels, or fewer with a smaller min_depth); same code paths as the full model.
InceptionV3Tiny = functools.partial(InceptionV3, depth_multiplier=0.05, min_depth=8)

# The variants ``estimax.models.MODELS`` registers from this file (``get_model(name)``).
MODELS = {"inception_v3": InceptionV3, "inception_v3_tiny": InceptionV3Tiny}


# --- The original's TensorFlow names -----------------------------------------------------------
# TF-slim's InceptionV3/<block>/Branch_k/<layer>/weights and .../BatchNorm/{beta,moving_mean,
# moving_variance} (no gamma); estimax's blocks use their own branch names, so each block kind has
# a table. The logits are 1x1 convs in TF (reshaped to Dense kernels).

# estimax branch name -> slim "Branch_k/<layer>", per Inception v3 block kind.
_V3_A = {
    "branch_1x1": "Branch_0/Conv2d_0a_1x1",
    "branch_5x5_1": "Branch_1/Conv2d_0a_1x1",
    "branch_5x5_2": "Branch_1/Conv2d_0b_5x5",
    "branch_3x3dbl_1": "Branch_2/Conv2d_0a_1x1",
    "branch_3x3dbl_2": "Branch_2/Conv2d_0b_3x3",
    "branch_3x3dbl_3": "Branch_2/Conv2d_0c_3x3",
    "branch_pool": "Branch_3/Conv2d_0b_1x1",
}
# slim's Mixed_5c quirk: its 5x5 branch is named differently.
_V3_A_5C = {
    **_V3_A,
    "branch_5x5_1": "Branch_1/Conv2d_0b_1x1",
    "branch_5x5_2": "Branch_1/Conv_1_0c_5x5",
}
_V3_B = {
    "branch_3x3": "Branch_0/Conv2d_1a_1x1",  # slim's name for a 3x3/2 conv (sic)
    "branch_3x3dbl_1": "Branch_1/Conv2d_0a_1x1",
    "branch_3x3dbl_2": "Branch_1/Conv2d_0b_3x3",
    "branch_3x3dbl_3": "Branch_1/Conv2d_1a_1x1",
}
V3_MIXED_6_NAMES = {
    "branch_1x1": "Branch_0/Conv2d_0a_1x1",
    "branch_7x7_1": "Branch_1/Conv2d_0a_1x1",
    "branch_7x7_2": "Branch_1/Conv2d_0b_1x7",
    "branch_7x7_3": "Branch_1/Conv2d_0c_7x1",
    "branch_7x7dbl_1": "Branch_2/Conv2d_0a_1x1",
    "branch_7x7dbl_2": "Branch_2/Conv2d_0b_7x1",
    "branch_7x7dbl_3": "Branch_2/Conv2d_0c_1x7",
    "branch_7x7dbl_4": "Branch_2/Conv2d_0d_7x1",
    "branch_7x7dbl_5": "Branch_2/Conv2d_0e_1x7",
    "branch_pool": "Branch_3/Conv2d_0b_1x1",
}
V3_MIXED_7A_NAMES = {
    "branch_3x3_1": "Branch_0/Conv2d_0a_1x1",
    "branch_3x3_2": "Branch_0/Conv2d_1a_3x3",
    "branch_7x7x3_1": "Branch_1/Conv2d_0a_1x1",
    "branch_7x7x3_2": "Branch_1/Conv2d_0b_1x7",
    "branch_7x7x3_3": "Branch_1/Conv2d_0c_7x1",
    "branch_7x7x3_4": "Branch_1/Conv2d_1a_3x3",
}
_V3_E = {
    "branch_1x1": "Branch_0/Conv2d_0a_1x1",
    "branch_3x3_1": "Branch_1/Conv2d_0a_1x1",
    "branch_3x3_2a": "Branch_1/Conv2d_0b_1x3",
    "branch_3x3_2b": "Branch_1/Conv2d_0b_3x1",
    "branch_3x3dbl_1": "Branch_2/Conv2d_0a_1x1",
    "branch_3x3dbl_2": "Branch_2/Conv2d_0b_3x3",
    "branch_3x3dbl_3a": "Branch_2/Conv2d_0c_1x3",
    "branch_3x3dbl_3b": "Branch_2/Conv2d_0d_3x1",
    "branch_pool": "Branch_3/Conv2d_0b_1x1",
}
# slim's Mixed_7c quirk: Conv2d_0c_3x1 where Mixed_7b has Conv2d_0b_3x1.
_V3_E_7C = {**_V3_E, "branch_3x3_2b": "Branch_1/Conv2d_0c_3x1"}
_V3_BLOCKS = {
    "Mixed_5b": _V3_A,
    "Mixed_5c": _V3_A_5C,
    "Mixed_5d": _V3_A,
    "Mixed_6a": _V3_B,
    "Mixed_6b": V3_MIXED_6_NAMES,
    "Mixed_6c": V3_MIXED_6_NAMES,
    "Mixed_6d": V3_MIXED_6_NAMES,
    "Mixed_6e": V3_MIXED_6_NAMES,
    "Mixed_7a": V3_MIXED_7A_NAMES,
    "Mixed_7b": _V3_E,
    "Mixed_7c": _V3_E_7C,
}
_V3_STEM = ("Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "Conv2d_3b_1x1", "Conv2d_4a_3x3")


def tf_name_map(variables: Mapping[str, Any]) -> list[Entry]:
    """The map of an estimax ``InceptionV3``'s variables (slim's ``InceptionV3/...``)."""
    params = variables["params"]
    root = "InceptionV3"
    entries: list[Entry] = []
    for name in _V3_STEM:
        entries += slim_layer((name,), f"{root}/{name}")
    for block, table in _V3_BLOCKS.items():
        for ours, theirs in table.items():
            entries += slim_layer((block, ours), f"{root}/{block}/{theirs}")
    if "AuxLogits" in params:
        aux = f"{root}/AuxLogits"
        # slim names the aux conv by its kernel, reduced for small inputs (5x5 at 299).
        kh, kw = kernel_hw(params, "AuxLogits", "conv1", "conv", "kernel")
        entries += slim_layer(("AuxLogits", "conv0"), f"{aux}/Conv2d_1b_1x1")
        entries += slim_layer(("AuxLogits", "conv1"), f"{aux}/Conv2d_2a_{kh}x{kw}")
        entries += [
            Entry("params", ("AuxLogits", "fc", "kernel"), f"{aux}/Conv2d_2b_1x1/weights", True),
            Entry("params", ("AuxLogits", "fc", "bias"), f"{aux}/Conv2d_2b_1x1/biases"),
        ]
    entries += [
        Entry("params", ("Logits", "kernel"), f"{root}/Logits/Conv2d_1c_1x1/weights", True),
        Entry("params", ("Logits", "bias"), f"{root}/Logits/Conv2d_1c_1x1/biases"),
    ]
    return entries


TF_NAMES = TFNames("inception_v3", "Conv2d_1a_3x3", tf_name_map)
