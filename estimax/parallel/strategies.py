"""How a train step holds its parameters over the replicas: whole on each (``Replicated``, data
parallelism) or split over them (``Sharded``, FSDP), behind one interface (``ParamStrategy``).

The step calls the strategy and does not branch on the layout: the model gets ``gather``'s
whole parameters, the gradients of ``varying``'s come back as this replica's, and
``mean_gradients``, ``clip_by_global_norm``, ``all_finite`` and ``l2_weights`` make them the
replicas' mean, clipped by the whole gradients' norm, checked alike on every replica, and
weighted so the weight decay counts each parameter once. ``for_params`` picks the strategy.

Over several slices (``RunConfig.num_slices``) the replica axis is the pair ``("dcn", "data")``:
the gradients are summed inside each slice (``data``, its ICI) before the slices' sums cross
the data-center network (``dcn``), so DCN carries one slice-reduced gradient per slice, and
FSDP splits parameters over ``data`` only (replicated over ``dcn``: MaxText's rule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import lax

from estimax.parallel import remat
from estimax.parallel.replication import slice_and_dcn

# A step's replica axis: ``data``, ``("dcn", "data")`` over slices, or None on one device.
AxisName = str | tuple[str, str] | None


class ParamStrategy(Protocol):
    """What a train step asks of its parameters' layout (inside ``shard_map`` or on one device)."""

    def gather(self, params: Any) -> Any:
        """The whole parameters for the model, from the ones the step holds."""
        ...

    def varying(self, params: Any) -> Any:
        """``params`` as the function to differentiate takes them: each replica's gradient its
        own (not already summed over replicas by ``shard_map``'s autodiff)."""
        ...

    def mean_gradients(self, grads: Any) -> Any:
        """The gradients' means over the replicas."""
        ...

    def clip_by_global_norm(self, grads: Any, max_norm: float) -> Any:
        """``optax.clip_by_global_norm`` with the norm of the whole gradients."""
        ...

    def all_finite(self, grads: Any) -> jax.Array:
        """A bool scalar: every element of the whole gradients is finite (alike on replicas)."""
        ...

    def l2_weights(self) -> Any:
        """A tree like the parameters of each leaf's weight-decay factor (None: 1 for all)."""
        ...

    def gathering_in_blocks(self, params: Any) -> contextlib.AbstractContextManager[None]:
        """While the model is applied: where a block under ``--remat`` gathers its own
        parameters from ``params`` (``remat.parameters_gathered_in_blocks``)."""
        ...


def all_finite(tree: Any) -> jax.Array:
    """A bool scalar: every element of every leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


class Replicated:
    """Every replica holds the whole parameters (data parallelism; ``axis_name`` None: one
    device, no collectives)."""

    def __init__(self, axis_name: AxisName) -> None:
        self.axis_name = axis_name

    def gather(self, params: Any) -> Any:
        """``params`` themselves: they are whole."""
        return params

    def varying(self, params: Any) -> Any:
        """The replicated parameters marked as varying per replica (or as they are, on one
        device), so each replica's gradient is its own."""
        if self.axis_name is None:
            return params
        return lax.pcast(params, self.axis_name, to="varying")

    def mean_gradients(self, grads: Any) -> Any:
        """``pmean`` over the replicas; over slices in two stages, inside each slice first."""
        if self.axis_name is None:
            return grads
        inner, dcn = slice_and_dcn(self.axis_name)
        grads = lax.pmean(grads, inner)
        return grads if dcn is None else lax.pmean(grads, dcn)

    def clip_by_global_norm(self, grads: Any, max_norm: float) -> Any:
        """``optax.clip_by_global_norm``: every replica holds the whole gradients."""
        clipped, _ = optax.clip_by_global_norm(max_norm).update(grads, None)
        return clipped

    def all_finite(self, grads: Any) -> jax.Array:
        """``all_finite`` of the (whole, already averaged) gradients."""
        return all_finite(grads)

    def l2_weights(self) -> Any:
        """None: each leaf counts once."""
        return None

    def gathering_in_blocks(self, params: Any) -> contextlib.AbstractContextManager[None]:
        """Nothing to gather."""
        return contextlib.nullcontext()


class Sharded:
    """FSDP inside ``shard_map``: the parameters split over ``axis_name`` and their collectives.

    ``dims`` is a pytree like the parameters: the dimension each leaf is split on, -1 for a
    leaf every replica holds whole (``layouts.Layout.param_dims``).
    """

    def __init__(self, dims: Any, axis_name: str | tuple[str, str]) -> None:
        self.dims = dims
        # Split over one slice's replicas (``data``); with slices, replicated over ``dcn``.
        self.axis_name, self.dcn = slice_and_dcn(axis_name)
        self.all_axes = axis_name

    def gather(self, params: Any) -> Any:
        """The whole parameters from this replica's slices (``all_gather``, tiled)."""
        return jax.tree.map(
            lambda p, d: p if d < 0 else lax.all_gather(p, self.axis_name, axis=d, tiled=True),
            params,
            self.dims,
        )

    def varying(self, params: Any) -> Any:
        """The whole leaves marked as varying per replica (as the data-parallel step does);
        split leaves already are (each replica holds its own slice)."""

        def mark(p: Any, d: int) -> Any:
            if d < 0:
                return lax.pcast(p, self.all_axes, to="varying")
            return p if self.dcn is None else lax.pcast(p, self.dcn, to="varying")

        return jax.tree.map(mark, params, self.dims)

    def mean_gradients(self, grads: Any) -> Any:
        """The gradients' means over replicas: ``pmean`` of whole leaves; a split leaf's
        gradient is already the replicas' sum (the transpose of ``all_gather`` is a
        reduce-scatter), so it is divided by the replica count (a parity test checks it).
        Over slices, each slice's result is then averaged over ``dcn``."""
        replicas = lax.axis_size(self.axis_name)
        grads = jax.tree.map(
            lambda g, d: lax.pmean(g, self.axis_name) if d < 0 else g / replicas,
            grads,
            self.dims,
        )
        return grads if self.dcn is None else lax.pmean(grads, self.dcn)

    def l2_weights(self) -> Any:
        """A split leaf's slice counts ``replicas`` times, so this replica's weight-decay term
        needs no collective: the replicas' mean of it (the step's reported loss) is the whole
        parameters' L2, and its gradient, divided by the replica count as ``mean_gradients``
        does, is the whole term's gradient on this slice."""
        replicas = lax.axis_size(self.axis_name)
        return jax.tree.map(lambda d: 1 if d < 0 else replicas, self.dims)

    def _sum_over_leaves(self, tree: Any, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """``sum(fn(leaf))`` over the whole tree: whole leaves once, split ones over replicas."""
        whole, split = jnp.float32(0), jnp.float32(0)
        for leaf, d in zip(jax.tree.leaves(tree), jax.tree.leaves(self.dims), strict=True):
            if d < 0:
                whole = whole + fn(leaf.astype(jnp.float32))
            else:
                split = split + fn(leaf.astype(jnp.float32))
        return whole + lax.psum(split, self.axis_name)

    def clip_by_global_norm(self, grads: Any, max_norm: float) -> Any:
        """``optax.clip_by_global_norm`` with the norm over the whole (unsplit) gradients."""
        norm = jnp.sqrt(self._sum_over_leaves(grads, lambda g: jnp.sum(jnp.square(g))))
        trigger = norm < max_norm
        return jax.tree.map(
            lambda t: lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads
        )

    def all_finite(self, grads: Any) -> jax.Array:
        """Every element of the whole gradients finite: every replica decides alike."""
        bad = self._sum_over_leaves(grads, lambda g: jnp.sum(~jnp.isfinite(g)).astype(jnp.float32))
        return bad == 0

    def gathering_in_blocks(self, params: Any) -> contextlib.AbstractContextManager[None]:
        """Blocks under a ``--remat`` policy gather their own parameters from ``params`` (the
        step's slices) inside their rematerialised region, one block's whole at a time; the
        whole ones ``gather`` gave the model for them go unused (XLA drops their gathers)."""
        return remat.parameters_gathered_in_blocks(params, self.dims, self.axis_name)


def for_params(dims: Any, axis_name: AxisName) -> ParamStrategy:
    """``Sharded`` where ``dims`` (``layouts.Layout.param_dims``; None: every leaf whole) splits
    some leaf over the replica axis ``axis_name``, else ``Replicated`` (exactly the
    data-parallel step)."""
    if dims is not None and axis_name is not None and any(d >= 0 for d in jax.tree.leaves(dims)):
        return Sharded(dims, axis_name)
    return Replicated(axis_name)
