"""Max-pool whose backward pass XLA:CPU runs fast.

``jax.grad`` of a max-pool lowers to ``select_and_scatter_add``; XLA:CPU runs it as
a scalar loop nest (about 100 ms of a 330 ms MNIST CNN step, while the forward pool
takes 1 ms; bench/results/conv_cpu.md). Here the backward, on the CPU backend only,
picks the first maximum of each window with elementwise compares over the KH*KW
shifted views of the input and scatters the cotangent back with interior pads:
all elementwise, so XLA fuses it into a few loops. Ties go to the first maximum in
row-major window order, exactly as ``select_and_scatter_add`` with ``ge`` does, so
the gradient equals ``jax.grad`` of ``flax.linen.max_pool`` (relu outputs make
all-zero windows common, so ties matter).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from estimax.ops import manual_axes

Array = jax.Array

# Above this many window elements the unrolled compares stop paying off and the
# reference is kept (no model here pools with a window larger than 3x3).
_MAX_WINDOW_ELEMENTS = 16


class _PoolSpec(NamedTuple):
    window: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[tuple[int, int], tuple[int, int]]


def max_pool(
    inputs: Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] = "VALID",
) -> Array:
    """``flax.linen.max_pool`` with a CPU-fast backward pass.

    Same signature and values as ``flax.linen.max_pool``; on the CPU backend the
    gradient is computed elementwise instead of with ``select_and_scatter_add``. Other
    backends, and inputs outside the fast path (not ``[B, H, W, C]`` floating point,
    windows over 16 elements), use ``flax.linen.max_pool`` itself.

    Args:
      inputs: ``[B, H, W, C]``.
      window_shape: ``(kh, kw)``.
      strides: ``(sh, sw)``; default ``(1, 1)`` as in Flax.
      padding: ``'SAME'``, ``'VALID'`` or ``((top, bottom), (left, right))``; padded
        positions never win (they are ``-inf``).

    Returns:
      ``[B, Ho, Wo, C]``.
    """
    window = tuple(int(k) for k in window_shape)
    strides_t = tuple(int(s) for s in (strides if strides is not None else (1,) * len(window)))
    if (
        inputs.ndim != 4
        or len(window) != 2
        or len(strides_t) != 2
        or not jnp.issubdtype(inputs.dtype, jnp.floating)
        or window[0] * window[1] > _MAX_WINDOW_ELEMENTS
    ):
        import flax.linen as nn  # Local: the fallback is the only use of Flax here.

        return nn.max_pool(inputs, window_shape, strides=strides, padding=padding)
    pads: Sequence[tuple[int, int]]
    if isinstance(padding, str):
        pads = lax.padtype_to_pads(inputs.shape[1:3], window, strides_t, padding)
    else:
        pads = padding
    (pt, pb), (pl, pr) = pads
    spec = _PoolSpec(
        (window[0], window[1]),
        (strides_t[0], strides_t[1]),
        ((int(pt), int(pb)), (int(pl), int(pr))),
    )
    return _pool(inputs, spec)


def _ref_pool(x: Array, spec: _PoolSpec) -> Array:
    # Same op flax.linen.max_pool builds: reduce_window(max) with -inf padding.
    return lax.reduce_window(
        x,
        -jnp.inf,
        lax.max,
        (1, *spec.window, 1),
        (1, *spec.strides, 1),
        ((0, 0), *spec.pads, (0, 0)),
    )


def _ref_bwd(spec: _PoolSpec, x: Array, g: Array) -> Array:
    return jax.vjp(functools.partial(_ref_pool, spec=spec), x)[1](g)[0]


def _cpu_bwd(spec: _PoolSpec, x: Array, g: Array) -> Array:
    if x.dtype in (jnp.bfloat16, jnp.float16):
        # XLA:CPU emulates half-precision elementwise math; fp32 is faster, and the
        # compares and the (<= KH*KW-term) sums are exact or better in fp32.
        return _cpu_bwd(spec, x.astype(jnp.float32), g.astype(jnp.float32)).astype(x.dtype)
    (kh, kw), (sh, sw), ((pt, pb), (pl, pr)) = spec.window, spec.strides, spec.pads
    b, h, w, c = x.shape
    xp = lax.pad(
        x, jnp.asarray(-jnp.inf, x.dtype), ((0, 0, 0), (pt, pb, 0), (pl, pr, 0), (0, 0, 0))
    )
    hp, wp = h + pt + pb, w + pl + pr
    _, ho, wo, _ = g.shape
    views = [
        lax.slice(
            xp, (0, i, j, 0), (b, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, c), (1, sh, sw, 1)
        )
        for i in range(kh)
        for j in range(kw)
    ]
    y = functools.reduce(jnp.maximum, views)
    taken = jnp.zeros(g.shape, bool)
    total = None
    zero = jnp.zeros((), g.dtype)
    for idx, v in enumerate(views):
        i, j = divmod(idx, kw)
        hit = (v == y) & ~taken
        taken = taken | hit
        part = jnp.where(hit, g, zero)
        placed = lax.pad(
            part,
            zero,
            (
                (0, 0, 0),
                (i, hp - (i + (ho - 1) * sh + 1), sh - 1),
                (j, wp - (j + (wo - 1) * sw + 1), sw - 1),
                (0, 0, 0),
            ),
        )
        total = placed if total is None else total + placed
    assert total is not None
    return lax.pad(total, zero, ((0, 0, 0), (-pt, -pb, 0), (-pl, -pr, 0), (0, 0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _pool(x: Array, spec: _PoolSpec) -> Array:
    return _ref_pool(x, spec)


def _pool_fwd(x: Array, spec: _PoolSpec) -> tuple[Array, Array]:
    return _ref_pool(x, spec), x


def _pool_bwd(spec: _PoolSpec, x: Array, g: Array) -> tuple[Array]:
    # Inside shard_map both branches see and return the same varying axes (manual_axes).
    axes = manual_axes.varying(x, g)
    dx = lax.platform_dependent(
        *manual_axes.vary((x, g), axes),
        cpu=lambda x, g: manual_axes.vary(_cpu_bwd(spec, x, g), axes),
        default=lambda x, g: manual_axes.vary(_ref_bwd(spec, x, g), axes),
    )
    return (manual_axes.reduce_to(dx, x),)


_pool.defvjp(_pool_fwd, _pool_bwd)
