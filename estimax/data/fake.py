"""Fake image batches: the original's "null input" (zeros, label 0) and a random-normal variant.

Used when there is no data directory (``data_dir`` None / ``''`` / ``'null'``) or fake data is asked
for, to measure the model and the accelerator without the input pipeline. Batches are made in the
caller's thread (they cost a ``np.zeros`` or one RNG draw), and the iterator has the same
``get_state``/``set_state`` as the real loader so the Estimator treats both alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["FakeImages"]


class FakeImages:
    """An iterable of ``(images [B, S, S, 3], labels [B] int32)`` batches.

    Args:
      batch_size: B, the per-host batch.
      image_size: S.
      kind: ``"zeros"``: zero images and label 0, as the original's null input; ``"random"``:
        standard-normal float32 images and uniform labels in ``[0, num_classes)``, drawn from
        ``np.random.default_rng([seed, batch_index])`` (reproducible and resumable).
      dtype: image dtype for ``"zeros"`` (the real pipeline's: uint8 for ResNet, float32 for
        Inception); ``"random"`` is always float32.
      num_examples: ``None`` repeats forever (training); else that many examples, the last batch
        possibly smaller (eval).
      num_classes: label range for ``"random"``.
      seed: RNG seed for ``"random"``.
    """

    def __init__(
        self,
        batch_size: int,
        image_size: int = 224,
        *,
        kind: str = "zeros",
        dtype: Any = np.float32,
        num_examples: int | None = None,
        num_classes: int = 1000,
        seed: int = 0,
    ):
        if kind not in ("zeros", "random"):
            raise ValueError(f"fake data kind must be 'zeros' or 'random', got {kind!r}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.image_size = image_size
        self.kind = kind
        self.dtype = np.dtype(dtype)
        self.num_examples = num_examples
        self.num_classes = num_classes
        self.seed = seed

    def __iter__(self) -> _FakeIterator:
        return _FakeIterator(self)

    def __len__(self) -> int:
        if self.num_examples is None:
            raise TypeError("infinite fake data (num_examples=None) has no len()")
        return -(-self.num_examples // self.batch_size)


class _FakeIterator(Iterator[tuple[np.ndarray, np.ndarray]]):
    def __init__(self, fake: FakeImages):
        self._fake = fake
        self._batch_index = 0
        self.num_skipped = 0

    def get_state(self) -> dict[str, Any]:
        """``{"batch_index": batches returned so far}``."""
        return {"fake": True, "batch_index": self._batch_index}

    def set_state(self, state: dict[str, Any]) -> None:
        if not state.get("fake"):
            raise ValueError(f"not a fake-data input state: {state}")
        self._batch_index = int(state["batch_index"])

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        f = self._fake
        b = f.batch_size
        if f.num_examples is not None:
            remaining = f.num_examples - self._batch_index * f.batch_size
            if remaining <= 0:
                raise StopIteration
            b = min(b, remaining)
        shape = (b, f.image_size, f.image_size, 3)
        if f.kind == "zeros":
            images, labels = np.zeros(shape, f.dtype), np.zeros([b], np.int32)
        else:
            rng = np.random.default_rng([f.seed, self._batch_index])
            images = rng.standard_normal(shape, dtype=np.float32)
            labels = rng.integers(0, f.num_classes, size=[b], dtype=np.int32)
        self._batch_index += 1
        return images, labels
