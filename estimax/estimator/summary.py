"""Image, histogram and text summaries from ``model_fn`` (``EstimatorSpec(summaries=...)``).

The original wrote these through ``host_call`` (``tf.contrib.summary.image``, ``histogram``,
``text``); here ``model_fn`` returns them by name, next to ``scalars``::

    summaries={
        "inputs": ex.summary.image(features, max_outputs=3),
        "logits": ex.summary.histogram(logits),
        "predicted": ex.summary.text(logits.argmax(-1), vocabulary=("cat", "dog")),
    }

They are computed on the device with the training step and reduced over the replicas there
(a histogram is its bucket counts; an image or text summary the first few examples), so what
crosses to the host is small and the same on every replica. The loop keeps them only for the
steps it writes (every ``save_summary_steps``, at their true step numbers); other steps' values
are dropped at once, so memory does not grow with ``iterations_per_loop``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from estimax import storage

__all__ = ["Histogram", "Image", "Text", "histogram", "image", "text"]


def _gather(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """Every replica's ``x`` [k, ...] concatenated in replica order, the same on all replicas.

    A psum of one-hot slots rather than ``all_gather``, whose result shard_map does not know to
    be replicated (the step returns it with ``out_specs=P()``).
    """
    wide = x.astype(jnp.int32) if jnp.issubdtype(x.dtype, jnp.integer) else x
    slots = jnp.zeros((lax.axis_size(axis_name), *x.shape), wide.dtype)
    slots = slots.at[lax.axis_index(axis_name)].set(wide)
    return lax.psum(slots, axis_name).reshape(-1, *x.shape[1:]).astype(x.dtype)


@struct.dataclass
class Image:
    """Up to ``max_outputs`` images ``[k, H, W, C]`` (C = 1, 3 or 4) of the batch."""

    images: jax.Array
    max_outputs: int = struct.field(pytree_node=False, default=3)

    def reduce(self, axis_name: str | tuple[str, ...] | None) -> Image:
        """The first ``max_outputs`` images of the global batch (replica 0's first)."""
        x = self.images[: self.max_outputs]
        if axis_name is not None:
            x = _gather(x, axis_name)[: self.max_outputs]
        return Image(x, self.max_outputs)

    def events(self, name: str) -> list[Any]:
        """tensorboardX ``Summary`` protos: one image per tag ``name/i`` (as tf.summary)."""
        storage.register_summary_writers()  # before tensorboardX: its clients stay out
        from tensorboardX import summary as tbx_summary

        out = []
        for i, img in enumerate(np.asarray(self.images)):
            if img.ndim == 2:
                img = img[..., None]
            if img.dtype != np.uint8:
                # As TF1's summary.image for floats: scaled per image to the full range.
                img = img.astype(np.float32)
                lo, hi = float(img.min()), float(img.max())
                img = (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)
                img = np.round(img * 255).astype(np.uint8)
            out.append(tbx_summary.image(f"{name}/{i}", img, dataformats="HWC"))
        return out


@struct.dataclass
class Histogram:
    """Values summarised as ``buckets`` bucket counts over their [min, max], on the device."""

    values: jax.Array
    buckets: int = struct.field(pytree_node=False, default=30)

    def reduce(self, axis_name: str | tuple[str, ...] | None) -> HistogramCounts:
        """Bucket counts, min, max, count, sum and sum of squares over all replicas."""
        v = jnp.ravel(self.values).astype(jnp.float32)
        lo, hi = jnp.min(v), jnp.max(v)
        if axis_name is not None:
            lo, hi = lax.pmin(lo, axis_name), lax.pmax(hi, axis_name)
        span = jnp.where(hi > lo, hi - lo, 1.0)
        index = jnp.clip(((v - lo) / span * self.buckets).astype(jnp.int32), 0, self.buckets - 1)
        counts = jnp.zeros(self.buckets, jnp.float32).at[index].add(1.0)
        totals = jnp.stack([jnp.float32(v.size), jnp.sum(v), jnp.sum(v * v)])
        if axis_name is not None:
            counts, totals = lax.psum((counts, totals), axis_name)
        return HistogramCounts(counts, lo, hi, totals)


@struct.dataclass
class HistogramCounts:
    """A reduced :class:`Histogram`: what reaches the host."""

    counts: jax.Array
    low: jax.Array
    high: jax.Array
    totals: jax.Array  # [count, sum, sum of squares]

    def events(self, name: str) -> list[Any]:
        """One tensorboardX histogram ``Summary``."""
        storage.register_summary_writers()  # before tensorboardX: its clients stay out
        from tensorboardX import summary as tbx_summary

        counts = np.asarray(self.counts, np.float64)
        low, high = float(self.low), float(self.high)
        limits = np.linspace(low, high if high > low else low + 1.0, counts.size + 1)[1:]
        num, total, squares = (float(x) for x in np.asarray(self.totals))
        return [
            tbx_summary.histogram_raw(
                name, low, high, num, total, squares, limits.tolist(), counts.tolist()
            )
        ]


@struct.dataclass
class Text:
    """Up to ``max_outputs`` values of the batch as text (class ids through a vocabulary)."""

    values: jax.Array
    vocabulary: tuple[str, ...] | None = struct.field(pytree_node=False, default=None)
    max_outputs: int = struct.field(pytree_node=False, default=8)

    def reduce(self, axis_name: str | tuple[str, ...] | None) -> Text:
        """The first ``max_outputs`` values of the global batch."""
        x = jnp.asarray(self.values)[: self.max_outputs]
        if axis_name is not None:
            x = _gather(x, axis_name)[: self.max_outputs]
        return Text(x, self.vocabulary, self.max_outputs)

    def events(self, name: str) -> list[Any]:
        """One tensorboardX text ``Summary``: a line per value."""
        storage.register_summary_writers()  # before tensorboardX: its clients stay out
        from tensorboardX import summary as tbx_summary

        lines = []
        for value in np.asarray(self.values):
            if self.vocabulary is not None and np.ndim(value) == 0:
                k = int(value)
                lines.append(self.vocabulary[k] if 0 <= k < len(self.vocabulary) else str(k))
            else:
                lines.append(np.array2string(np.asarray(value), precision=4))
        return [tbx_summary.text(name, "\n\n".join(lines))]


def image(images: jax.Array, max_outputs: int = 3) -> Image:
    """An image summary (``tf.summary.image``): the batch's first ``max_outputs`` images.

    Args:
      images: [B, H, W, C] (C = 1, 3 or 4) or [B, H, W]; uint8 as they are, floats scaled per
        image to the full range.
      max_outputs: how many images to write (tags ``name/0``, ``name/1``, ...).
    """
    x = jnp.asarray(images)
    if x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[-1] not in (1, 3, 4)):
        raise ValueError(
            f"summary.image takes [B, H, W, C] with C in (1, 3, 4) or [B, H, W]; got shape "
            f"{x.shape}"
        )
    return Image(x if x.ndim == 4 else x[..., None], int(max_outputs))


def histogram(values: jax.Array, buckets: int = 30) -> Histogram:
    """A histogram summary (``tf.summary.histogram``) of all ``values`` of the step."""
    if buckets < 1:
        raise ValueError(f"summary.histogram needs at least one bucket, got {buckets}")
    return Histogram(jnp.asarray(values), int(buckets))


def text(values: jax.Array, vocabulary: Sequence[str] | None = None, max_outputs: int = 8) -> Text:
    """A text summary (``tf.summary.text``) of the batch's first ``max_outputs`` values.

    Args:
      values: [B] class ids (shown through ``vocabulary`` when given) or [B, ...] numbers.
      vocabulary: names of the class ids.
      max_outputs: how many values to show.
    """
    return Text(
        jnp.asarray(values), tuple(vocabulary) if vocabulary is not None else None, max_outputs
    )


def check(summaries: Mapping[str, Any] | None) -> dict[str, Any]:
    """``EstimatorSpec.summaries`` as a dict, refusing anything that is not a summary."""
    out = dict(summaries or {})
    for name, value in out.items():
        if not isinstance(value, Image | Histogram | Text):
            raise TypeError(
                f"EstimatorSpec(summaries={{{name!r}: ...}}) is a {type(value).__name__}; use "
                "ex.summary.image(...), ex.summary.histogram(...) or ex.summary.text(...) "
                "(single numbers go in scalars=)"
            )
    return out


def reduce(summaries: Mapping[str, Any], axis_name: str | tuple[str, ...] | None) -> dict[str, Any]:
    """Each summary reduced over the replicas (inside the traced step)."""
    return {name: value.reduce(axis_name) for name, value in summaries.items()}
