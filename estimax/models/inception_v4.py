"""Inception v4 (Szegedy et al. 1602.07261) as ``tensorflow/tpu``'s ``inception_v4_model.py``
(a copy of TF-slim's ``inception_v4``), which ``inception_v4.py`` trains.

As the original: every conv is conv (no bias) -> batch norm without a learned scale -> ReLU,
kernels ``variance_scaling_initializer()`` (He, truncated normal); BN decay 0.995, epsilon 1e-3
(§6); an auxiliary head on ``Mixed_6h`` (``create_aux_logits=True``; the original's loss weights it
0.4); global average pool, dropout keep 0.8, fully connected logits (slim's default
``xavier_initializer``, i.e. Glorot uniform); 1001 classes by default.
``depth_multiplier``/``min_depth`` are our addition (slim's v4 has none), only for thin test
models; at 1.0 the network is the original's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from estimax import ops
from estimax.models import layers
from estimax.models.inception_v3 import V3_MIXED_6_NAMES, V3_MIXED_7A_NAMES
from estimax.models.layers import (
    InceptionBlock,
    ModuleDef,
    PoolFn,
    same_avg_pool,
)
from estimax.models.tf_names import Entry, TFNames, slim_layer
from estimax.parallel import remat

# The original's constants (inception_v4.py BATCH_NORM_DECAY / BATCH_NORM_EPSILON).
BATCH_NORM_DECAY = 0.995
BATCH_NORM_EPSILON = 1e-3
# Smallest square input whose Mixed_6h map still fits the aux head's 5x5/3 VALID pool.
MIN_IMAGE_SIZE = 107

conv_kernel_init = nn.initializers.variance_scaling(2.0, "fan_in", "truncated_normal")
fc_kernel_init = nn.initializers.glorot_uniform()


class Stem(InceptionBlock):
    """Conv2d_1a..2b, Mixed_3a, Mixed_4a, Mixed_5a: 299x299x3 -> 35x35x384."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 299, 299, 3] -> [B, 35, 35, 384]`` (full width)."""
        x = self.c(32, (3, 3), "Conv2d_1a_3x3", strides=2, padding="VALID")(x)  # 149
        x = self.c(32, (3, 3), "Conv2d_2a_3x3", padding="VALID")(x)  # 147
        x = self.c(64, (3, 3), "Conv2d_2b_3x3")(x)  # 147 x 64
        # Mixed_3a                                                                 73 x 160
        x = jnp.concatenate(
            [
                self.max_pool(x, (3, 3), strides=(2, 2), padding="VALID"),
                self.c(96, (3, 3), "Mixed_3a_branch_3x3", strides=2, padding="VALID")(x),
            ],
            axis=-1,
        )
        # Mixed_4a                                                                 71 x 192
        b0 = self.c(64, (1, 1), "Mixed_4a_branch_3x3_1")(x)
        b0 = self.c(96, (3, 3), "Mixed_4a_branch_3x3_2", padding="VALID")(b0)
        b1 = self.c(64, (1, 1), "Mixed_4a_branch_7x7_1")(x)
        b1 = self.c(64, (1, 7), "Mixed_4a_branch_7x7_2")(b1)
        b1 = self.c(64, (7, 1), "Mixed_4a_branch_7x7_3")(b1)
        b1 = self.c(96, (3, 3), "Mixed_4a_branch_7x7_4", padding="VALID")(b1)
        x = jnp.concatenate([b0, b1], axis=-1)
        # Mixed_5a                                                                 35 x 384
        return jnp.concatenate(
            [
                self.c(192, (3, 3), "Mixed_5a_branch_3x3", strides=2, padding="VALID")(x),
                self.max_pool(x, (3, 3), strides=(2, 2), padding="VALID"),
            ],
            axis=-1,
        )


class InceptionA(InceptionBlock):
    """Inception-A (Mixed_5b..5e, 35x35): 1x1 | 1x1-3x3 | 1x1-3x3-3x3 | avgpool-1x1."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 35, 35, C] -> [B, 35, 35, 384]`` (full width)."""
        b0 = self.c(96, (1, 1), "branch_1x1")(x)
        b1 = self.c(64, (1, 1), "branch_3x3_1")(x)
        b1 = self.c(96, (3, 3), "branch_3x3_2")(b1)
        b2 = self.c(64, (1, 1), "branch_3x3dbl_1")(x)
        b2 = self.c(96, (3, 3), "branch_3x3dbl_2")(b2)
        b2 = self.c(96, (3, 3), "branch_3x3dbl_3")(b2)
        b3 = self.c(96, (1, 1), "branch_pool")(same_avg_pool(x, 3))
        return jnp.concatenate([b0, b1, b2, b3], axis=-1)


class ReductionA(InceptionBlock):
    """Reduction-A (Mixed_6a, 35 -> 17): 3x3/2 | 1x1-3x3-3x3/2 | maxpool 3x3/2."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 35, 35, 384] -> [B, 17, 17, 1024]`` (full width)."""
        b0 = self.c(384, (3, 3), "branch_3x3", strides=2, padding="VALID")(x)
        b1 = self.c(192, (1, 1), "branch_3x3dbl_1")(x)
        b1 = self.c(224, (3, 3), "branch_3x3dbl_2")(b1)
        b1 = self.c(256, (3, 3), "branch_3x3dbl_3", strides=2, padding="VALID")(b1)
        b2 = self.max_pool(x, (3, 3), strides=(2, 2), padding="VALID")
        return jnp.concatenate([b0, b1, b2], axis=-1)


class InceptionB(InceptionBlock):
    """Inception-B (Mixed_6b..6h, 17x17) with factorised 7x7 convs."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 17, 17, C] -> [B, 17, 17, 1024]`` (full width)."""
        b0 = self.c(384, (1, 1), "branch_1x1")(x)
        b1 = self.c(192, (1, 1), "branch_7x7_1")(x)
        b1 = self.c(224, (1, 7), "branch_7x7_2")(b1)
        b1 = self.c(256, (7, 1), "branch_7x7_3")(b1)
        b2 = self.c(192, (1, 1), "branch_7x7dbl_1")(x)
        b2 = self.c(192, (7, 1), "branch_7x7dbl_2")(b2)
        b2 = self.c(224, (1, 7), "branch_7x7dbl_3")(b2)
        b2 = self.c(224, (7, 1), "branch_7x7dbl_4")(b2)
        b2 = self.c(256, (1, 7), "branch_7x7dbl_5")(b2)
        b3 = self.c(128, (1, 1), "branch_pool")(same_avg_pool(x, 3))
        return jnp.concatenate([b0, b1, b2, b3], axis=-1)


class ReductionB(InceptionBlock):
    """Reduction-B (Mixed_7a, 17 -> 8): 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool 3x3/2."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 17, 17, 1024] -> [B, 8, 8, 1536]`` (full width)."""
        b0 = self.c(192, (1, 1), "branch_3x3_1")(x)
        b0 = self.c(192, (3, 3), "branch_3x3_2", strides=2, padding="VALID")(b0)
        b1 = self.c(256, (1, 1), "branch_7x7x3_1")(x)
        b1 = self.c(256, (1, 7), "branch_7x7x3_2")(b1)
        b1 = self.c(320, (7, 1), "branch_7x7x3_3")(b1)
        b1 = self.c(320, (3, 3), "branch_7x7x3_4", strides=2, padding="VALID")(b1)
        b2 = self.max_pool(x, (3, 3), strides=(2, 2), padding="VALID")
        return jnp.concatenate([b0, b1, b2], axis=-1)


class InceptionC(InceptionBlock):
    """Inception-C (Mixed_7b..7d, 8x8): 1x1 | 1x1-(1x3,3x1) | 1x1-3x1-1x3-(1x3,3x1) | pool-1x1."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 8, 8, C] -> [B, 8, 8, 1536]`` (full width)."""
        b0 = self.c(256, (1, 1), "branch_1x1")(x)
        b1 = self.c(384, (1, 1), "branch_3x3_1")(x)
        b1 = jnp.concatenate(
            [self.c(256, (1, 3), "branch_3x3_2a")(b1), self.c(256, (3, 1), "branch_3x3_2b")(b1)],
            axis=-1,
        )
        b2 = self.c(384, (1, 1), "branch_3x3dbl_1")(x)
        b2 = self.c(448, (3, 1), "branch_3x3dbl_2")(b2)
        b2 = self.c(512, (1, 3), "branch_3x3dbl_3")(b2)
        b2 = jnp.concatenate(
            [
                self.c(256, (1, 3), "branch_3x3dbl_4a")(b2),
                self.c(256, (3, 1), "branch_3x3dbl_4b")(b2),
            ],
            axis=-1,
        )
        b3 = self.c(256, (1, 1), "branch_pool")(same_avg_pool(x, 3))
        return jnp.concatenate([b0, b1, b2, b3], axis=-1)


class InceptionV4Aux(InceptionBlock):
    """AuxLogits: avgpool 5x5/3 VALID, 1x1 (128), conv over the whole map VALID (768), fc."""

    num_classes: int = 1001
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, 17, 17, C] -> [B, num_classes]``."""
        x = nn.avg_pool(x, (5, 5), strides=(3, 3), padding="VALID")
        x = self.c(128, (1, 1), "Conv2d_1b_1x1")(x)
        # The original's kernel is the map's own shape (5x5 at 299), so the output is 1x1.
        x = self.c(768, (x.shape[1], x.shape[2]), "Conv2d_2a", padding="VALID")(x)
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(
            self.num_classes, dtype=self.dtype, kernel_init=fc_kernel_init, name="Aux_logits"
        )(x)


class InceptionV4(nn.Module):
    """Inception v4 with the auxiliary head.

    Attributes:
      num_classes: logits per example (1001 as the original: index 0 is background).
      aux_logits: build the auxiliary head and return its logits as well.
      dropout_rate: dropout before the logits (``dropout_keep_prob=0.8``).
      depth_multiplier: channel multiplier (ours, for thin test models; 1.0 is the original).
      min_depth: lower bound on any layer's channels when ``depth_multiplier < 1``.
      dtype: compute dtype; params float32; logits returned float32.
      conv: convolution module (``nn.Conv`` signature; default ``estimax.ops.FastConv``).
        norm: batch norm (``nn.BatchNorm``).
      max_pool: max pool (``nn.max_pool`` signature; default ``estimax.ops.max_pool``).
      bn_momentum: BN moving-average decay. bn_epsilon: BN epsilon.
      bn_scale: learn a BN scale (the original: False; timm's port: True).
      remat: recompute each Inception block's activations (the stem and the ``Mixed_*``
        blocks) in the backward pass instead of keeping them (``--remat``): ``"none"``,
        ``"full"`` or a ``jax.checkpoint_policies`` name (``remat.REMAT_CHOICES``); the
        parameters are the same under every choice.
      block_repeats: how many Inception-A, -B, -C blocks (4, 7, 3 as the paper); fewer only for
        thin test models.
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
    block_repeats: tuple[int, int, int] = (4, 7, 3)
    remat: str = "none"

    @nn.compact
    def __call__(
        self, x: jnp.ndarray, train: bool
    ) -> jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]:
        """Logits (and auxiliary logits) for a batch of images.

        Args:
          x: ``[B, H, W, 3]`` float in [-1, 1], H, W >= 107 (299 as the original).
          train: batch statistics, moving-average updates (``mutable=['batch_stats']``) and
            dropout (needs a ``'dropout'`` rng) when True.

        Returns:
          ``(logits, aux_logits)``, each ``[B, num_classes]`` float32, if ``aux_logits``;
          else ``logits``.
        """
        layers.check_image_size(x, "InceptionV4", MIN_IMAGE_SIZE, "Mixed_6h")
        kw = layers.inception_block_args(self, train, conv_kernel_init)
        # The blocks under --remat (the same class, and so the same names, with "none").
        stem, block_a, reduction_a, block_b, reduction_b, block_c = (
            remat.remat_block(cls, self.remat)
            for cls in (Stem, InceptionA, ReductionA, InceptionB, ReductionB, InceptionC)
        )
        x = stem(**kw, name="stem")(x)  # 35 x 35 x 384
        num_a, num_b, num_c = self.block_repeats
        for i in range(num_a):
            x = block_a(**kw, name=f"Mixed_5{'bcde'[i]}")(x)  # 35 x 35 x 384
        x = reduction_a(**kw, name="Mixed_6a")(x)  # 17 x 17 x 1024
        for i in range(num_b):
            x = block_b(**kw, name=f"Mixed_6{'bcdefgh'[i]}")(x)  # 17 x 17 x 1024
        aux = None
        if self.aux_logits:
            aux = InceptionV4Aux(
                **kw, num_classes=self.num_classes, dtype=self.dtype, name="AuxLogits"
            )(x)
        x = reduction_b(**kw, name="Mixed_7a")(x)  # 8 x 8 x 1536
        for i in range(num_c):
            x = block_c(**kw, name=f"Mixed_7{'bcd'[i]}")(x)  # 8 x 8 x 1536
        x = jnp.mean(x, axis=(1, 2))  # AvgPool_1a over 8x8
        x = nn.Dropout(self.dropout_rate, deterministic=not train, name="Dropout_1b")(x)
        logits = nn.Dense(
            self.num_classes, dtype=self.dtype, kernel_init=fc_kernel_init, name="Logits"
        )(x).astype(jnp.float32)
        if aux is not None:  # self.aux_logits
            return logits, aux.astype(jnp.float32)
        return logits


# For tests: one block of each kind, every layer at min_depth channels; same code paths as the
# full model.
InceptionV4Tiny = functools.partial(
    InceptionV4, depth_multiplier=0.05, min_depth=8, block_repeats=(1, 1, 1)
)

# The variants ``estimax.models.MODELS`` registers from this file (``get_model(name)``).
MODELS = {"inception_v4": InceptionV4, "inception_v4_tiny": InceptionV4Tiny}


# --- The original's TensorFlow names -----------------------------------------------------------
# TF-slim's InceptionV4/...: the stem, Mixed_3a..7d with a table per block kind, AuxLogits and
# Logits/Logits (docs/migration.md §2).

_V4_STEM = {
    "Conv2d_1a_3x3": "Conv2d_1a_3x3",
    "Conv2d_2a_3x3": "Conv2d_2a_3x3",
    "Conv2d_2b_3x3": "Conv2d_2b_3x3",
    "Mixed_3a_branch_3x3": "Mixed_3a/Branch_1/Conv2d_0a_3x3",
    "Mixed_4a_branch_3x3_1": "Mixed_4a/Branch_0/Conv2d_0a_1x1",
    "Mixed_4a_branch_3x3_2": "Mixed_4a/Branch_0/Conv2d_1a_3x3",
    "Mixed_4a_branch_7x7_1": "Mixed_4a/Branch_1/Conv2d_0a_1x1",
    "Mixed_4a_branch_7x7_2": "Mixed_4a/Branch_1/Conv2d_0b_1x7",
    "Mixed_4a_branch_7x7_3": "Mixed_4a/Branch_1/Conv2d_0c_7x1",
    "Mixed_4a_branch_7x7_4": "Mixed_4a/Branch_1/Conv2d_1a_3x3",
    "Mixed_5a_branch_3x3": "Mixed_5a/Branch_0/Conv2d_1a_3x3",
}
_V4_A = {
    "branch_1x1": "Branch_0/Conv2d_0a_1x1",
    "branch_3x3_1": "Branch_1/Conv2d_0a_1x1",
    "branch_3x3_2": "Branch_1/Conv2d_0b_3x3",
    "branch_3x3dbl_1": "Branch_2/Conv2d_0a_1x1",
    "branch_3x3dbl_2": "Branch_2/Conv2d_0b_3x3",
    "branch_3x3dbl_3": "Branch_2/Conv2d_0c_3x3",
    "branch_pool": "Branch_3/Conv2d_0b_1x1",
}
_V4_RA = {
    "branch_3x3": "Branch_0/Conv2d_1a_3x3",
    "branch_3x3dbl_1": "Branch_1/Conv2d_0a_1x1",
    "branch_3x3dbl_2": "Branch_1/Conv2d_0b_3x3",
    "branch_3x3dbl_3": "Branch_1/Conv2d_1a_3x3",
}
_V4_B = V3_MIXED_6_NAMES  # Inception-B of v4 has v3's Mixed_6 branch names
_V4_RB = V3_MIXED_7A_NAMES  # Reduction-B of v4 has v3's Mixed_7a branch names
_V4_C = {
    "branch_1x1": "Branch_0/Conv2d_0a_1x1",
    "branch_3x3_1": "Branch_1/Conv2d_0a_1x1",
    "branch_3x3_2a": "Branch_1/Conv2d_0b_1x3",
    "branch_3x3_2b": "Branch_1/Conv2d_0c_3x1",
    "branch_3x3dbl_1": "Branch_2/Conv2d_0a_1x1",
    "branch_3x3dbl_2": "Branch_2/Conv2d_0b_3x1",
    "branch_3x3dbl_3": "Branch_2/Conv2d_0c_1x3",
    "branch_3x3dbl_4a": "Branch_2/Conv2d_0d_1x3",
    "branch_3x3dbl_4b": "Branch_2/Conv2d_0e_3x1",
    "branch_pool": "Branch_3/Conv2d_0b_1x1",
}


def tf_name_map(variables: Mapping[str, Any]) -> list[Entry]:
    """The map of an estimax ``InceptionV4``'s variables (``InceptionV4/...``)."""
    params = variables["params"]
    root = "InceptionV4"
    entries: list[Entry] = []
    for ours, theirs in _V4_STEM.items():
        entries += slim_layer(("stem", ours), f"{root}/{theirs}")
    tables = {"Mixed_5": _V4_A, "Mixed_6": _V4_B, "Mixed_7": _V4_C}
    for block in sorted(k for k in params if k.startswith("Mixed_")):
        if block == "Mixed_6a":
            table = _V4_RA
        elif block == "Mixed_7a":
            table = _V4_RB
        else:
            table = tables[block[:7]]
        for ours, theirs in table.items():
            entries += slim_layer((block, ours), f"{root}/{block}/{theirs}")
    if "AuxLogits" in params:
        aux = f"{root}/AuxLogits"
        entries += slim_layer(("AuxLogits", "Conv2d_1b_1x1"), f"{aux}/Conv2d_1b_1x1")
        entries += slim_layer(("AuxLogits", "Conv2d_2a"), f"{aux}/Conv2d_2a")
        entries += [
            Entry("params", ("AuxLogits", "Aux_logits", "kernel"), f"{aux}/Aux_logits/weights"),
            Entry("params", ("AuxLogits", "Aux_logits", "bias"), f"{aux}/Aux_logits/biases"),
        ]
    entries += [
        Entry("params", ("Logits", "kernel"), f"{root}/Logits/Logits/weights"),
        Entry("params", ("Logits", "bias"), f"{root}/Logits/Logits/biases"),
    ]
    return entries


TF_NAMES = TFNames("inception_v4", "stem", tf_name_map)
