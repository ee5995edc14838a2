"""Custom VJPs that keep ``jax.shard_map``'s types: the varying manual axes (``check_vma``).

Inside ``jax.shard_map`` (its default ``check_vma=True``) every value is typed with the mesh
axes it varies over. JAX's own transpose of a computation mixing a varying value (a batch shard)
with an invariant one (replicated weights) sums the invariant one's cotangent over the axes it
does not vary over (the transpose of the implicit ``pvary`` is ``psum``), so ``jax.grad`` of a
replicated weight is the same on every device. A ``custom_vjp`` backward must do the same, and
the branches of ``lax.platform_dependent`` must agree on their types: here every operand is cast
to vary over all the axes any of them varies over (no implicit ``psum`` inside a branch, the
same types out of every branch), and each cotangent is then summed down to its primal's axes.
Outside ``shard_map`` no value varies and each of these is the identity.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

__all__ = ["reduce_to", "vary", "varying"]


def varying(*values: Any) -> frozenset[str]:
    """The manual mesh axes any of ``values`` (arrays) varies over."""
    axes: frozenset[str] = frozenset()
    for v in values:
        axes |= jax.typeof(v).manual_axis_type.varying
    return axes


def vary(value: Any, axes: frozenset[str]) -> Any:
    """``value`` (an array, or a tree of them) cast to vary over ``axes`` too."""

    def one(x: Any) -> Any:
        missing = axes - varying(x)
        return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree.map(one, value)


def reduce_to(cotangent: Any, primal: Any) -> Any:
    """``cotangent`` summed over the axes it varies over and ``primal`` does not (the transpose
    of casting ``primal`` to vary), so it has ``primal``'s type."""
    extra = varying(cotangent) - varying(primal)
    return lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent
