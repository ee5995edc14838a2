"""The response cache: identical requests to an opted-in model answered from memory.

Opt-in per model, Triton's ``response_cache { enable: true }`` in the model's config: a load's
config override or ``<base_path>/config.json`` (``estimax.serving.model_settings``), else
``--response_cache_models=a,b`` (TF Serving's ``--model_config_file`` is a fixed text proto: a
per-model field there would need a proto change every TF Serving client would then refuse).
Bounded for the whole server by ``--response_cache_bytes`` (least recently used answers evicted
first). Triton's key, by content: the model, the version, and every input
after decoding (its name, dtype, shape and bytes, hashed with BLAKE2b); the request's
``priority`` and ``timeout`` change when a request runs, not what it answers, and are not part of
the key. Never across versions (the version and its directory are in the key). A version whose
``serving.json`` declares ``"random": true`` (its answers are drawn, not computed) is never
cached, whatever its model's config asks (said in one log line at its load, and in the
repository index and the model's config). Counted in Prometheus:
``estimax_serving_response_cache_total{model_name, result}``
(``hit``, ``miss``), ``estimax_serving_response_cache_evictions_total{model_name}`` and
``estimax_serving_response_cache_bytes``.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["ResponseCache", "request_key"]


def request_key(model: str, version: Any, path: str, features: dict[str, np.ndarray]) -> bytes:
    """The cache key of a decoded request: a hash of the model, version and every input."""
    h = hashlib.blake2b(digest_size=32)
    for part in (model, str(version), path):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    for name in sorted(features):
        array = np.asarray(features[name])
        h.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode("utf-8", "surrogatepass"))
        if array.dtype.kind == "O":  # strings: each element's bytes, length-prefixed
            for x in array.ravel():
                b = x if isinstance(x, bytes) else str(x).encode("utf-8", "surrogatepass")
                h.update(len(b).to_bytes(8, "little") + b)
        else:
            h.update(np.ascontiguousarray(array).tobytes())
    return h.digest()


def _size(outputs: dict[str, np.ndarray]) -> int:
    return sum(int(v.nbytes) for v in outputs.values()) + 64 * len(outputs)


class ResponseCache:
    """A server's answers by ``request_key``, at most ``max_bytes`` of them (LRU)."""

    def __init__(self, max_bytes: int, registry: CollectorRegistry | None = None) -> None:
        """Holds at most ``max_bytes`` of answers; counts in ``registry`` (Prometheus)."""
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[bytes, tuple[str, dict[str, np.ndarray]]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self.lookups = Counter(
            "estimax_serving_response_cache",
            "Response cache lookups by result (hit: answered from memory).",
            ["model_name", "result"],
            registry=registry,
        )
        self.evictions = Counter(
            "estimax_serving_response_cache_evictions",
            "Answers evicted from the response cache to stay within --response_cache_bytes.",
            ["model_name"],
            registry=registry,
        )
        self.size = Gauge(
            "estimax_serving_response_cache_bytes",
            "Bytes of answers held by the response cache.",
            registry=registry,
        )

    def caches(self, enabled: bool, servable: Any) -> bool:
        """Whether answers of ``servable`` are cached: its model's config ``enabled`` the
        cache, the cache has room, and the version does not declare random answers."""
        return enabled and self.max_bytes > 0 and not self.random(servable)

    @staticmethod
    def random(servable: Any) -> bool:
        """Whether ``servable`` (a version) declares random answers (``serving.json``)."""
        return bool(getattr(getattr(servable, "record", None), "random", False))

    def get(self, model: str, key: bytes) -> dict[str, np.ndarray] | None:
        """The answer stored under ``key`` (counted as a hit or a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        self.lookups.labels(model, "hit" if entry is not None else "miss").inc()
        return dict(entry[1]) if entry is not None else None

    def put(self, model: str, key: bytes, outputs: dict[str, np.ndarray]) -> None:
        """Stores a copy of ``outputs`` (read-only), evicting the least recently used."""
        stored = {}
        for name, value in outputs.items():
            copy = np.array(value, copy=True)  # not a view pinning the whole batch's arrays
            copy.setflags(write=False)
            stored[name] = copy
        size = _size(stored)
        if size > self.max_bytes:
            return
        evicted: list[str] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= _size(old[1])
            while self._entries and self.bytes + size > self.max_bytes:
                _, (owner, dropped) = self._entries.popitem(last=False)
                self.bytes -= _size(dropped)
                evicted.append(owner)
            self._entries[key] = (model, stored)
            self.bytes += size
            held = self.bytes
        for owner in evicted:
            self.evictions.labels(owner).inc()
        self.size.set(held)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
