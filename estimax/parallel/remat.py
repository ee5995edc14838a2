"""Rematerialisation per block (``--remat``) and FSDP's gathering inside a block.

``remat_block`` wraps a model's block class in ``nn.remat`` under a named ``jax.checkpoint``
policy. While a train step under FSDP is traced (``parameters_gathered_in_blocks``, which the
sharded layout strategy enters), a block under a policy gathers its own split parameters inside
its rematerialised region, so one block's whole parameters are alive at a time. The models call
``remat_block``; the step enters the gathering: neither knows of the other.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
from jax import lax

# A module class or a functools.partial of one (as ``estimax.models.layers.ModuleDef``).
ModuleDef = Any

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
