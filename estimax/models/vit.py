"""Vision Transformer (ViT) as big_vision defines it: S/16, B/16, L/16 and a tiny test variant.

Follows ``big_vision/models/vit.py`` (google-research/big_vision, read at commit 0b73d7b0):

* the patch embedding is a ``patch x patch`` convolution with stride ``patch`` (``embedding``);
* position embeddings are added *before* a class token is concatenated: ``posemb="learn"``
  (``pos_embedding``, normal(stddev=1/sqrt(width)) initialiser) or ``"sincos2d"`` (the fixed
  MoCo v3 2-D sine-cosine table, no parameters);
* ``depth`` pre-LayerNorm encoder blocks (``Encoder1DBlock``: LayerNorm, multi-head
  self-attention with Xavier-uniform kernels, dropout, residual; LayerNorm, ``MlpBlock`` (Dense,
  GELU, dropout, Dense; Xavier-uniform kernels, normal(1e-6) biases), dropout, residual), then
  ``encoder_norm``; the module names are big_vision's, so its checkpoints' trees map one to one;
* ``pool_type="gap"`` (mean over the tokens) or ``"tok"`` (a zero-initialised class token,
  ``cls``); ``rep_size`` adds big_vision's ``pre_logits`` Dense + tanh; the ``head`` is
  zero-initialised (``head_zeroinit=True``).

The variants are big_vision's ``decode_variant`` (Table 2 of https://arxiv.org/abs/2106.04560):
S: width 384, depth 12, MLP 1536, 6 heads; B: 768, 12, 3072, 12; L: 1024, 24, 4096, 16; all
with 16x16 patches. Their registry defaults are the head of the big_vision config each comes
with: ViT-S/16 of ``configs/vit_s16_i1k.py`` (``pool_type="gap"``, ``posemb="sincos2d"``,
``rep_size=True``), B/16 and L/16 of ``configs/vit_i1k.py`` (``pool_type="tok"``, learned
posemb, ``rep_size=True``). With ``pool_type="tok", posemb="learn", rep_size=False`` they are
the original paper's / timm's layout, whose published parameter counts tests/test_models.py
checks (22,050,664; 86,567,656; 304,326,632 for 1000 classes).

Not carried over: the ``MAPHead`` pooling and the ``out`` dict of intermediate activations.
The model returns float32 logits ``[B, num_classes]``, as every estimax image model.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from estimax.models.layers import ModuleDef
from estimax.parallel.remat import remat_block

__all__ = ["MODELS", "VIT_VARIANTS", "ViT", "ViTTiny", "posemb_sincos_2d"]

# big_vision's decode_variant: name -> (width, depth, mlp_dim, num_heads).
WIDTHS = {
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
}


def posemb_sincos_2d(
    h: int, w: int, width: int, temperature: float = 10_000.0, dtype: Any = jnp.float32
) -> jnp.ndarray:
    """big_vision's ``posemb_sincos_2d`` (the MoCo v3 table): ``[1, h * w, width]``.

    Raises:
      ValueError: ``width`` is not a multiple of 4.
    """
    if width % 4:
        raise ValueError(f"sincos2d position embeddings need a width divisible by 4, got {width}")
    y, x = np.mgrid[:h, :w]
    omega = np.arange(width // 4) / max(width // 4 - 1, 1)
    omega = 1.0 / (temperature**omega)
    y = np.einsum("m,d->md", y.flatten(), omega)
    x = np.einsum("m,d->md", x.flatten(), omega)
    pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return jnp.asarray(pe, dtype)[None, :, :]


class MlpBlock(nn.Module):
    """Dense, GELU, dropout, Dense (big_vision's ``MlpBlock``)."""

    mlp_dim: int
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
        dense = functools.partial(
            nn.Dense,
            dtype=self.dtype,
            kernel_init=nn.initializers.xavier_uniform(),
            bias_init=nn.initializers.normal(stddev=1e-6),
        )
        d = x.shape[-1]
        x = dense(self.mlp_dim)(x)
        x = nn.gelu(x)
        x = nn.Dropout(rate=self.dropout)(x, deterministic)
        return dense(d)(x)


class Encoder1DBlock(nn.Module):
    """Pre-LayerNorm self-attention and MLP, each with a residual (big_vision's block)."""

    mlp_dim: int
    num_heads: int
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            kernel_init=nn.initializers.xavier_uniform(),
            deterministic=deterministic,
            dtype=self.dtype,
        )(y, y)
        y = nn.Dropout(rate=self.dropout)(y, deterministic)
        x = x + y
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = MlpBlock(mlp_dim=self.mlp_dim, dropout=self.dropout, dtype=self.dtype)(y, deterministic)
        y = nn.Dropout(rate=self.dropout)(y, deterministic)
        return x + y


class Encoder(nn.Module):
    """``depth`` blocks (``encoderblock_{i}``) and the final ``encoder_norm``; ``remat``: the
    blocks' ``--remat`` policy (``remat.REMAT_CHOICES``)."""

    depth: int
    mlp_dim: int
    num_heads: int
    dropout: float = 0.0
    dtype: Any = jnp.float32
    remat: str = "none"

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
        # deterministic (argument 2, after self and x) is a Python bool: static under remat.
        block_cls = remat_block(Encoder1DBlock, self.remat, static_argnums=(2,))
        for i in range(self.depth):
            x = block_cls(
                mlp_dim=self.mlp_dim,
                num_heads=self.num_heads,
                dropout=self.dropout,
                dtype=self.dtype,
                name=f"encoderblock_{i}",
            )(x, deterministic)
        return nn.LayerNorm(name="encoder_norm", dtype=self.dtype)(x)


class ViT(nn.Module):
    """big_vision's ``vit._Model``, returning float32 logits.

    Attributes:
      num_classes: classes of the head.
      patch_size: side of the square patches.
      width, depth, mlp_dim, num_heads: the transformer's (see ``WIDTHS``).
      posemb: ``"learn"`` or ``"sincos2d"``.
      pool_type: ``"gap"`` (mean of the tokens) or ``"tok"`` (class token).
      rep_size: big_vision's ``pre_logits`` Dense + tanh before the head: False (none), True (of
        ``width``) or its size.
      dropout: after the position embeddings, in every block and MLP (0 in big_vision's i1k
        configs).
      head_zeroinit: zero-initialised head kernel (big_vision's default).
      dtype: compute dtype (parameters stay float32; the logits are float32).
      conv: the patch embedding's convolution (``flax.linen.Conv``'s signature).
      remat: recompute each encoder block's activations in the backward pass instead of keeping
        them (``--remat``): ``"none"``, ``"full"`` or a ``jax.checkpoint_policies`` name
        (``remat.REMAT_CHOICES``); the parameters are the same under every choice.
    """

    num_classes: int = 1000
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    mlp_dim: int = 3072
    num_heads: int = 12
    posemb: str = "learn"
    pool_type: str = "gap"
    rep_size: int | bool = False
    dropout: float = 0.0
    head_zeroinit: bool = True
    dtype: Any = jnp.float32
    conv: ModuleDef = nn.Conv
    remat: str = "none"

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        if self.pool_type not in ("gap", "tok"):
            raise ValueError(f"pool_type must be 'gap' or 'tok', got {self.pool_type!r}")
        p = self.patch_size
        if x.shape[1] % p or x.shape[2] % p:
            raise ValueError(
                f"ViT with {p}x{p} patches needs image sides divisible by {p}, got "
                f"{x.shape[1]}x{x.shape[2]}"
            )
        x = jnp.asarray(x, self.dtype)
        x = self.conv(
            self.width, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype, name="embedding"
        )(x)
        n, h, w, c = x.shape
        x = jnp.reshape(x, (n, h * w, c))
        if self.posemb == "learn":
            pe = self.param(
                "pos_embedding",
                nn.initializers.normal(stddev=1 / np.sqrt(c)),
                (1, h * w, c),
                jnp.float32,
            )
        elif self.posemb == "sincos2d":
            pe = posemb_sincos_2d(h, w, c)
        else:
            raise ValueError(f"posemb must be 'learn' or 'sincos2d', got {self.posemb!r}")
        x = x + jnp.asarray(pe, self.dtype)
        if self.pool_type == "tok":
            cls = self.param("cls", nn.initializers.zeros, (1, 1, c), jnp.float32)
            x = jnp.concatenate([jnp.tile(jnp.asarray(cls, self.dtype), (n, 1, 1)), x], axis=1)
        x = nn.Dropout(rate=self.dropout)(x, not train)
        x = Encoder(
            depth=self.depth,
            mlp_dim=self.mlp_dim,
            num_heads=self.num_heads,
            dropout=self.dropout,
            dtype=self.dtype,
            remat=self.remat,
            name="Transformer",
        )(x, deterministic=not train)
        x = jnp.mean(x, axis=1) if self.pool_type == "gap" else x[:, 0]
        if self.rep_size:
            size = self.width if self.rep_size is True else int(self.rep_size)
            x = nn.tanh(nn.Dense(size, dtype=self.dtype, name="pre_logits")(x))
        head_init = nn.initializers.zeros if self.head_zeroinit else nn.initializers.lecun_normal()
        x = nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=head_init, name="head")(x)
        return jnp.asarray(x, jnp.float32)


def _variant(size: str, patch: int, **defaults: Any) -> functools.partial[ViT]:
    width, depth, mlp_dim, num_heads = WIDTHS[size]
    return functools.partial(
        ViT,
        patch_size=patch,
        width=width,
        depth=depth,
        mlp_dim=mlp_dim,
        num_heads=num_heads,
        **defaults,
    )


# The ImageNet heads of big_vision's configs (see the module docstring).
_S16_HEAD: dict[str, Any] = {
    "pool_type": "gap",
    "posemb": "sincos2d",
    "rep_size": True,
}  # vit_s16_i1k.py
_I1K_HEAD: dict[str, Any] = {"pool_type": "tok", "posemb": "learn", "rep_size": True}  # vit_i1k.py
# The original paper's and timm's layout (class token, learned posemb, no pre-logits).
PAPER_LAYOUT: dict[str, Any] = {"pool_type": "tok", "posemb": "learn", "rep_size": False}

# --model_name -> (network, input resolution).
VIT_VARIANTS: dict[str, tuple[functools.partial[ViT], int]] = {
    "vit-s16": (_variant("S", 16, **_S16_HEAD), 224),
    "vit-b16": (_variant("B", 16, **_I1K_HEAD), 224),
    "vit-l16": (_variant("L", 16, **_I1K_HEAD), 224),
}
# For tests and smoke runs: width 32, 2 blocks of 2 heads, 8x8 patches of 32x32 images (16
# tokens), the S/16 recipe's head. Not a big_vision variant.
ViTTiny = functools.partial(
    ViT, patch_size=8, width=32, depth=2, mlp_dim=64, num_heads=2, **_S16_HEAD
)
TINY_NAME = "vit-tiny"
TINY_RESOLUTION = 32


def patch_size(name: str) -> int:
    """The patch side of ``--model_name`` ``name`` (``vit-s16``... or ``vit-tiny``)."""
    return 8 if name == TINY_NAME else int(VIT_VARIANTS[name][0].keywords["patch_size"])


# The variants ``estimax.models.MODELS`` registers from this file: vit_s16 .. vit_l16, vit_tiny.
MODELS = {
    **{name.replace("-", "_"): variant for name, (variant, _) in VIT_VARIANTS.items()},
    "vit_tiny": ViTTiny,
}
