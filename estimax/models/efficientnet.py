"""EfficientNet B0-B7 as the original ``tensorflow/tpu`` ``models/official/efficientnet``.

Taken from the original (commit 1e772d2, 2019-06-16: after the drop-connect fix of 2019-06-04;
``efficientnet_builder.py``, ``efficientnet_model.py``, ``utils.py``), and done the same here:
  * the block-args strings of ``efficientnet_builder.efficientnet()``
    (``r1_k3_s11_e1_i32_o16_se0.25``: repeats, kernel, strides, expand ratio, input and output
    filters, squeeze-excitation ratio; ``noskip`` drops the identity skip), decoded as
    ``BlockDecoder._decode_block_string``;
  * ``efficientnet_params``: (width coefficient, depth coefficient, resolution, dropout) per
    variant b0..b7; ``round_filters`` (scaled by the width coefficient, rounded to a multiple
    of 8, never more than 10% down) and ``round_repeats`` (``ceil(depth * repeats)``);
  * MBConv blocks (``MBConvBlock``): 1x1 expansion conv -> BN -> swish (not when the expand
    ratio is 1), depthwise conv ('SAME', the block's stride) -> BN -> swish, squeeze-excitation
    (mean over H, W -> 1x1 conv with bias to ``max(1, int(input_filters * se_ratio))`` -> swish
    -> 1x1 conv with bias back -> sigmoid gate), 1x1 projection conv -> BN (no activation); an
    identity skip when the strides are 1 and input filters == output filters, with
    drop-connect on the block's output before the sum in training;
  * drop-connect (``utils.drop_connect``): each example's block output is kept with
    probability ``1 - rate`` and scaled by ``1 / (1 - rate)``; block ``i`` of ``n`` uses
    ``drop_connect_rate * i / n`` (0.2 for every variant);
  * stem 3x3/2 conv (32 filters, rounded) -> BN -> swish; head 1x1 conv (1280, rounded) ->
    BN -> swish -> global average pool -> dropout -> dense ``num_classes``;
  * batch norm momentum 0.99, epsilon 1e-3 (the TPU cross-replica variant is ``norm``'s
    business: pass one with an ``axis_name``);
  * initialisers: conv kernels ``N(0, sqrt(2 / fan_out))`` with ``fan_out = kh * kw *
    out_filters`` (not truncated; for the depthwise kernel ``out_filters`` is its depth
    multiplier, 1); dense kernel ``U(-1/sqrt(num_classes), 1/sqrt(num_classes))``; biases 0.
Flax names follow the original's attributes (``conv_stem``, ``bn0``, ``blocks_3/expand_conv``,
``se/reduce_conv``, ``project_conv``, ``conv_head``, ``fc``, ...), so a TF name map stays a table.

Convolutions go through ``conv`` (``estimax.ops.FastConv`` by default: its CPU fast path serves
the dense 1x1/3x3 convolutions; the depthwise ones, grouped, fall back to XLA's own).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from estimax import ops
from estimax.models.layers import ModuleDef, conv_and_norm
from estimax.parallel.remat import remat_block

# efficientnet_builder.efficientnet(): GlobalParams.
BATCH_NORM_MOMENTUM = 0.99
BATCH_NORM_EPSILON = 1e-3
DEPTH_DIVISOR = 8
DROP_CONNECT_RATE = 0.2

# efficientnet_builder.efficientnet(): the seven stages of B0.
BLOCKS_ARGS = (
    "r1_k3_s11_e1_i32_o16_se0.25",
    "r2_k3_s22_e6_i16_o24_se0.25",
    "r2_k5_s22_e6_i24_o40_se0.25",
    "r3_k3_s22_e6_i40_o80_se0.25",
    "r3_k5_s11_e6_i80_o112_se0.25",
    "r4_k5_s22_e6_i112_o192_se0.25",
    "r1_k3_s11_e6_i192_o320_se0.25",
)

# efficientnet_model.conv_kernel_initializer: N(0, sqrt(2 / (kh * kw * out_filters))). Flax's
# kernels are [kh, kw, in, out], so that is a 'fan_out' variance scaling with an untruncated
# normal; a depthwise kernel is [kh, kw, 1, C] here but [kh, kw, C, 1] in TF, whose fan_out
# (kh * kw * 1) is our 'fan_in'.
conv_kernel_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
depthwise_kernel_init = nn.initializers.variance_scaling(2.0, "fan_in", "normal")
# efficientnet_model.dense_kernel_initializer: U(-1/sqrt(out), 1/sqrt(out)), i.e.
# variance_scaling(1/3, 'fan_out', 'uniform') on a [in, out] kernel.
dense_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_out", "uniform")


@dataclasses.dataclass(frozen=True)
class BlockArgs:
    """One stage of MBConv blocks (the original's ``BlockArgs`` namedtuple)."""

    kernel_size: int
    num_repeat: int
    input_filters: int
    output_filters: int
    expand_ratio: int
    id_skip: bool
    strides: tuple[int, int]
    se_ratio: float | None


def decode_block_string(block_string: str) -> BlockArgs:
    """The original ``BlockDecoder._decode_block_string``: ``'r1_k3_s11_e1_i32_o16_se0.25'``.

    Raises:
      ValueError: the strides are not a pair of digits, or a field is missing.
    """
    options = {}
    for op in block_string.split("_"):
        splits = re.split(r"(\d.*)", op)
        if len(splits) >= 2:
            key, value = splits[:2]
            options[key] = value
    if "s" not in options or len(options["s"]) != 2:
        raise ValueError(f"block {block_string!r}: strides ('s') must be a pair of digits")
    missing = {"k", "r", "i", "o", "e"} - set(options)
    if missing:
        raise ValueError(f"block {block_string!r}: missing field(s) {sorted(missing)}")
    return BlockArgs(
        kernel_size=int(options["k"]),
        num_repeat=int(options["r"]),
        input_filters=int(options["i"]),
        output_filters=int(options["o"]),
        expand_ratio=int(options["e"]),
        id_skip="noskip" not in block_string,
        se_ratio=float(options["se"]) if "se" in options else None,
        strides=(int(options["s"][0]), int(options["s"][1])),
    )


def round_filters(
    filters: int,
    width_coefficient: float | None,
    depth_divisor: int = DEPTH_DIVISOR,
    min_depth: int | None = None,
) -> int:
    """The original ``round_filters``: ``filters * width_coefficient`` to a multiple of 8.

    Rounded to the nearest multiple of ``depth_divisor`` (at least ``min_depth``, default the
    divisor), then one divisor more if that lost more than 10%. A falsy coefficient keeps
    ``filters``.
    """
    if not width_coefficient:
        return filters
    scaled = filters * width_coefficient
    min_depth = min_depth or depth_divisor
    new_filters = max(min_depth, int(scaled + depth_divisor / 2) // depth_divisor * depth_divisor)
    if new_filters < 0.9 * scaled:
        new_filters += depth_divisor
    return int(new_filters)


def round_repeats(repeats: int, depth_coefficient: float | None) -> int:
    """The original ``round_repeats``: ``ceil(depth_coefficient * repeats)`` (falsy: as is)."""
    if not depth_coefficient:
        return repeats
    return int(math.ceil(depth_coefficient * repeats))


class DropConnect(nn.Module):
    """The original ``utils.drop_connect``: drops whole examples of a residual branch.

    Each example is kept with probability ``1 - rate`` and then scaled by ``1 / (1 - rate)``;
    the draw uses the ``rng_collection`` stream (``'dropout'``, as ``nn.Dropout``: the stream
    the Estimator gives each training step).

    Attributes:
      rate: probability of dropping an example's branch.
      rng_collection: the RNG stream to draw from.
    """

    rate: float
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool) -> jnp.ndarray:
        """``x: [B, ...] -> [B, ...]``; the identity when ``deterministic`` or ``rate == 0``."""
        if deterministic or self.rate == 0.0:
            return x
        keep_prob = 1.0 - self.rate
        rng = self.make_rng(self.rng_collection)
        keep = jax.random.bernoulli(rng, keep_prob, (x.shape[0],) + (1,) * (x.ndim - 1))
        return jnp.where(keep, x / jnp.asarray(keep_prob, x.dtype), jnp.zeros((), x.dtype))


class SqueezeExcitation(nn.Module):
    """The original ``MBConvBlock._call_se``: channels gated by the image's pooled context.

    Attributes:
      reduced: channels of the bottleneck, ``max(1, int(input_filters * se_ratio))``.
      conv: conv factory (bound to dtype and ``conv_kernel_init``; biases are used here).
      act: the activation (swish).
    """

    reduced: int
    conv: ModuleDef
    act: Callable[[jnp.ndarray], jnp.ndarray] = nn.swish

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """``x: [B, H, W, C] -> [B, H, W, C]``."""
        s = jnp.mean(x, axis=(1, 2), keepdims=True)
        s = self.act(self.conv(self.reduced, (1, 1), use_bias=True, name="reduce_conv")(s))
        s = self.conv(x.shape[-1], (1, 1), use_bias=True, name="expand_conv")(s)
        return jax.nn.sigmoid(s) * x


class MBConvBlock(nn.Module):
    """Mobile inverted bottleneck with squeeze-excitation (the original ``MBConvBlock``).

    Attributes:
      args: the block's arguments, filters already rounded by the model.
      conv: conv factory (bound to dtype, ``conv_kernel_init``, ``use_bias=False``).
      norm: batch-norm factory (bound to train/eval, momentum, epsilon, dtype).
      act: the activation (swish).
      drop_connect_rate: this block's drop-connect rate (used only with the identity skip).
    """

    args: BlockArgs
    conv: ModuleDef
    norm: ModuleDef
    act: Callable[[jnp.ndarray], jnp.ndarray] = nn.swish
    drop_connect_rate: float = 0.0

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, train: bool) -> jnp.ndarray:
        """``x: [B, H, W, input_filters] -> [B, H/s, W/s, output_filters]``."""
        a = self.args
        x = inputs
        if a.expand_ratio != 1:
            x = self.conv(a.input_filters * a.expand_ratio, (1, 1), name="expand_conv")(x)
            x = self.act(self.norm(name="bn0")(x))
        k = a.kernel_size
        x = self.conv(
            x.shape[-1],
            (k, k),
            strides=a.strides,
            padding="SAME",
            feature_group_count=x.shape[-1],
            kernel_init=depthwise_kernel_init,
            name="depthwise_conv",
        )(x)
        x = self.act(self.norm(name="bn1")(x))
        if a.se_ratio is not None and 0 < a.se_ratio <= 1:
            reduced = max(1, int(a.input_filters * a.se_ratio))
            x = SqueezeExcitation(reduced, conv=self.conv, act=self.act, name="se")(x)
        x = self.conv(a.output_filters, (1, 1), name="project_conv")(x)
        x = self.norm(name="bn2")(x)
        if a.id_skip and all(s == 1 for s in a.strides) and a.input_filters == a.output_filters:
            x = DropConnect(self.drop_connect_rate, name="drop_connect")(x, not train) + inputs
        return x


def scaled_blocks(
    blocks_args: Sequence[str],
    width_coefficient: float | None,
    depth_coefficient: float | None,
    depth_divisor: int = DEPTH_DIVISOR,
    min_depth: int | None = None,
) -> list[BlockArgs]:
    """Every block of the network in order, as the original ``Model._build`` lays them out.

    Each stage's filters are rounded (``round_filters``) and its repeats scaled
    (``round_repeats``); the first block of a stage takes its stride and filter change, the
    repeats run at stride 1 from ``output_filters`` to ``output_filters``.
    """
    blocks = []
    for string in blocks_args:
        args = decode_block_string(string)
        args = dataclasses.replace(
            args,
            input_filters=round_filters(
                args.input_filters, width_coefficient, depth_divisor, min_depth
            ),
            output_filters=round_filters(
                args.output_filters, width_coefficient, depth_divisor, min_depth
            ),
            num_repeat=round_repeats(args.num_repeat, depth_coefficient),
        )
        blocks.append(args)
        repeat = dataclasses.replace(args, input_filters=args.output_filters, strides=(1, 1))
        blocks.extend([repeat] * (args.num_repeat - 1))
    return blocks


class EfficientNet(nn.Module):
    """EfficientNet as the original ``efficientnet_model.Model`` with the builder's params.

    Attributes:
      width_coefficient: channel multiplier (``round_filters``).
      depth_coefficient: repeat multiplier (``round_repeats``).
      dropout_rate: dropout before the dense head (train only; 0 = none).
      drop_connect_rate: drop-connect rate of the last block (block ``i`` of ``n``: ``rate *
        i / n``).
      num_classes: logits per example (the original's ``num_label_classes``, 1000).
      blocks_args: the stages as block strings (default: B0's ``BLOCKS_ARGS``).
      depth_divisor, min_depth: ``round_filters``' divisor (8) and lower bound (the divisor).
      dtype: compute dtype (``jnp.bfloat16`` for bfloat16 training); params stay float32,
        logits are returned in float32.
      conv: convolution module (``nn.Conv`` signature; default ``estimax.ops.FastConv``).
      norm: batch norm (``nn.BatchNorm`` signature).
      act: the activation (``nn.swish``, the original's ``relu_fn``).
      bn_momentum: batch-norm moving-average decay (0.99). bn_epsilon: batch-norm epsilon (1e-3).
      remat: recompute each MBConv block's activations in the backward pass instead of keeping
        them (``--remat``): ``"none"``, ``"full"`` or a ``jax.checkpoint_policies`` name
        (``remat.REMAT_CHOICES``); the parameters are the same under every choice.
    """

    width_coefficient: float = 1.0
    depth_coefficient: float = 1.0
    dropout_rate: float = 0.2
    drop_connect_rate: float = DROP_CONNECT_RATE
    num_classes: int = 1000
    blocks_args: Sequence[str] = BLOCKS_ARGS
    depth_divisor: int = DEPTH_DIVISOR
    min_depth: int | None = None
    dtype: Any = jnp.float32
    conv: ModuleDef = ops.FastConv
    norm: ModuleDef = nn.BatchNorm
    act: Callable[[jnp.ndarray], jnp.ndarray] = nn.swish
    bn_momentum: float = BATCH_NORM_MOMENTUM
    bn_epsilon: float = BATCH_NORM_EPSILON
    remat: str = "none"

    def _filters(self, filters: int) -> int:
        return round_filters(filters, self.width_coefficient, self.depth_divisor, self.min_depth)

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
        """Logits for a batch of images.

        Args:
          x: ``[B, H, W, 3]`` float, already normalised (the original subtracts MEAN_RGB and
            divides by STDDEV_RGB in ``model_fn``, before the network).
          train: batch statistics (moving averages updated, ``mutable=['batch_stats']``),
            dropout and drop-connect (the ``'dropout'`` RNG stream) when True.

        Returns:
          ``[B, num_classes]`` float32 logits.
        """
        conv, norm = conv_and_norm(self, train, conv_kernel_init)
        x = conv(self._filters(32), (3, 3), strides=(2, 2), padding="SAME", name="conv_stem")(x)
        x = self.act(norm(name="bn0")(x))
        blocks = scaled_blocks(
            self.blocks_args,
            self.width_coefficient,
            self.depth_coefficient,
            self.depth_divisor,
            self.min_depth,
        )
        # train (argument 2, after self and x) is a Python bool: static under remat.
        block_cls = remat_block(MBConvBlock, self.remat, static_argnums=(2,))
        for idx, args in enumerate(blocks):
            x = block_cls(
                args,
                conv=conv,
                norm=norm,
                act=self.act,
                drop_connect_rate=self.drop_connect_rate * idx / len(blocks),
                name=f"blocks_{idx}",
            )(x, train)
        x = conv(self._filters(1280), (1, 1), name="conv_head")(x)
        x = self.act(norm(name="bn1")(x))
        x = jnp.mean(x, axis=(1, 2))
        if self.dropout_rate > 0:
            x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        x = nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=dense_kernel_init, name="fc")(
            x
        )
        return x.astype(jnp.float32)


# efficientnet_builder.efficientnet_params: (width, depth, resolution, dropout) per model name.
EFFICIENTNET_PARAMS: dict[str, tuple[float, float, int, float]] = {
    "efficientnet-b0": (1.0, 1.0, 224, 0.2),
    "efficientnet-b1": (1.0, 1.1, 240, 0.2),
    "efficientnet-b2": (1.1, 1.2, 260, 0.3),
    "efficientnet-b3": (1.2, 1.4, 300, 0.3),
    "efficientnet-b4": (1.4, 1.8, 380, 0.4),
    "efficientnet-b5": (1.6, 2.2, 456, 0.4),
    "efficientnet-b6": (1.8, 2.6, 528, 0.5),
    "efficientnet-b7": (2.0, 3.1, 600, 0.5),
}


def _variant(model_name: str) -> Callable[..., EfficientNet]:
    width, depth, _, dropout = EFFICIENTNET_PARAMS[model_name]
    return functools.partial(
        EfficientNet, width_coefficient=width, depth_coefficient=depth, dropout_rate=dropout
    )


# The variants: the original's model names (--model_name) -> (constructor, input resolution);
# ``EFFICIENTNETS["efficientnet-b0"][0]()`` is B0 (``estimax.models.MODELS["efficientnet_b0"]``).
EFFICIENTNETS: dict[str, tuple[Callable[..., EfficientNet], int]] = {
    name: (_variant(name), params[2]) for name, params in EFFICIENTNET_PARAMS.items()
}
# For tests: B0's first three stages at a quarter of its width (5 blocks: expansion 1 and 6,
# 3x3 and 5x5, strided, identity skips with drop-connect, squeeze-excitation), i.e. the same code
# paths as the full models. Not an original variant.
EfficientNetTiny = functools.partial(
    EfficientNet, width_coefficient=0.25, depth_coefficient=1.0, blocks_args=BLOCKS_ARGS[:3]
)

# The variants ``estimax.models.MODELS`` registers from this file: efficientnet_b0 .. _b7.
MODELS = {
    **{name.replace("-", "_"): variant for name, (variant, _) in EFFICIENTNETS.items()},
    "efficientnet_tiny": EfficientNetTiny,
}

# The tiny variant's name and resolution, for tests and smoke runs of the program.
TINY_NAME = "efficientnet-tiny"
TINY_RESOLUTION = 32
