"""Small building blocks shared by the image models (ResNet, Inception), and ``remat_block``.

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

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

# A module class or a functools.partial of one (flax examples/imagenet uses the same alias).
ModuleDef = Any
PoolFn = Callable[..., jnp.ndarray]

# --remat's policies by name: which of a block's intermediate values the backward pass keeps
# (the rest it recomputes from the block's input). "full" is jax.checkpoint without a policy
# (keep nothing but the input); the others are jax.checkpoint_policies' own names, written out
# rather than looked up with getattr so that the flag's choices are this table. The policies
# that take arguments (save_only_these_names...) need names the models do not give.
REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "full": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "checkpoint_dots_with_no_batch_dims": (
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    ),
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}
# The values of --remat (and of every image model's ``remat`` field): "none" keeps every
# activation, as a model without remat.
REMAT_CHOICES: tuple[str, ...] = ("none", *REMAT_POLICIES)


def remat_block(block: ModuleDef, policy: str, static_argnums: tuple[int, ...] = ()) -> ModuleDef:
    """``block`` (a module class) rematerialised under ``policy``, or ``block`` itself for "none".

    ``nn.remat`` returns a subclass whose instances keep the name they are given, so a model's
    parameter tree (and the checkpoints and TensorFlow name maps that follow its paths) is the
    same under every policy; values and gradients are too, up to the recomputation's rounding.

    Called with a policy while a train step under FSDP is traced
    (``parameters_gathered_in_blocks``), the block gathers its own split parameters inside its
    rematerialised region, under ``policy`` less the gathers: the backward pass gathers them
    again, so one block's whole parameters are alive at a time instead of the model's. With
    "none" the step gathers them all before the model, as before: a region that keeps every
    value but the gathers (``everything_saveable`` less them) held 40.2 GiB of temporaries
    for ViT-L/16 at batch 512 on v5e:2x4 against 14.2 GiB without it (measured with
    ``--compile_for``): the region's boundary stops XLA's own fusion and rematerialisation.

    Args:
      block: the block's module class (``ResidualBlock``, ``MBConvBlock``, ``Encoder1DBlock``...).
      policy: one of ``REMAT_CHOICES`` (``--remat``).
      static_argnums: the block's ``__call__`` arguments that are Python values (``train``,
        ``deterministic``), counting ``self`` as 0, as ``nn.remat`` does.

    Raises:
      ValueError: an unknown ``policy`` (one line naming ``--remat`` and the valid names).
    """
    if policy != "none" and policy not in REMAT_POLICIES:
        raise ValueError(f"--remat={policy!r}: must be one of {', '.join(REMAT_CHOICES)}.")
    if policy == "none":
        return block
    if _GATHERING.get() is not None:
        return _gathering_block(block, policy, static_argnums)
    return nn.remat(block, policy=REMAT_POLICIES[policy], static_argnums=static_argnums)


@dataclasses.dataclass(frozen=True)
class _Gathering:
    """What a block needs to gather its parameters: the replica's parameters as the step holds
    them (split leaves as this replica's slices), the dimension each is split on (-1: whole)
    and the replica axis."""

    params: Any
    dims: Any
    axis_name: str


_GATHERING: contextvars.ContextVar[_Gathering | None] = contextvars.ContextVar(
    "estimax_fsdp_gathering", default=None
)
# The path (module names from the root) of the gathering block being applied: map_variables
# hands its function the block's variables but not where they sit in the parameter tree.
_BLOCK_PATH: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "estimax_fsdp_block_path", default=()
)


@contextlib.contextmanager
def parameters_gathered_in_blocks(params: Any, dims: Any, axis_name: str) -> Iterator[None]:
    """While a train step under FSDP is traced: ``remat_block``'s blocks under a ``--remat``
    policy gather their split parameters themselves, from ``params`` (the step's, split leaves
    as this replica's slices, the values being differentiated), instead of using the whole ones
    the step passes to the model (which then go unused and are not computed).

    Args:
      params: the parameters as the step holds them, keyed as the model's parameter tree.
      dims: a tree like ``params``: the dimension each leaf is split on, -1 for whole.
      axis_name: the replica axis (``shard_map``'s) the leaves are split over.
    """
    token = _GATHERING.set(_Gathering(params, dims, axis_name))
    try:
        yield
    finally:
        _GATHERING.reset(token)


def _without_gathers(policy: Callable[..., Any] | None) -> Callable[..., bool]:
    """``policy`` (``jax.checkpoint``'s; None: nothing saved) that never saves a gather's output.

    Naming the gathered values (``checkpoint_name``) is not enough: the gather's own output,
    the name's input, would be saved in their place. (``save_anything_except_these_names`` is
    no help either: in jax 0.10 it saves everything, names included.)
    """
    base = policy or jax.checkpoint_policies.nothing_saveable

    def saveable(prim: Any, *avals: Any, **params: Any) -> bool:
        return not prim.name.startswith("all_gather") and bool(base(prim, *avals, **params))

    return saveable


def _gather_block_params(variables: dict[str, Any]) -> dict[str, Any]:
    """The block's whole parameters, gathered from the step's slices (``map_variables``' in)."""
    gathering, path = _GATHERING.get(), _BLOCK_PATH.get()
    assert gathering is not None  # only _gathering_block's classes map with this
    params, dims = gathering.params, gathering.dims
    for name in path:
        if not isinstance(params, dict) or name not in params:
            raise ValueError(
                f"FSDP: block {'/'.join(path)} has no parameters at that path of the step's "
                "parameter tree; is the model applied under another root?"
            )
        params, dims = params[name], dims[name]
    mine = variables.get("params", {})
    if set(mine) != set(params):
        raise ValueError(f"FSDP: block {'/'.join(path)}'s parameters are not the step's.")
    whole = jax.tree.map(
        lambda p, d: p if d < 0 else lax.all_gather(p, gathering.axis_name, axis=d, tiled=True),
        params,
        dims,
    )
    return {**variables, "params": whole}


def _gathering_block(block: ModuleDef, policy: str, static_argnums: tuple[int, ...]) -> ModuleDef:
    """``block`` gathering its split parameters inside ``nn.remat`` (``remat_block``)."""
    mapped = nn.map_variables(block, "params", trans_in_fn=_gather_block_params)
    remat = nn.remat(
        mapped,
        policy=_without_gathers(REMAT_POLICIES[policy]),
        static_argnums=static_argnums,
    )

    class Gathering(remat):  # type: ignore[misc,valid-type]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            token = _BLOCK_PATH.set(tuple(self.scope.path))
            try:
                return super().__call__(*args, **kwargs)
            finally:
                _BLOCK_PATH.reset(token)

    # Auto-named instances (no name=) are named after the class: keep the plain block's name.
    Gathering.__name__ = Gathering.__qualname__ = getattr(block, "__name__", "Block")
    return Gathering


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
