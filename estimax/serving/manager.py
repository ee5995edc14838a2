"""Versions of one model: polling the base path, loading and warming, swapping without downtime.

Policy ``latest{num_versions}`` as TensorFlow Serving's default: the newest published versions
are served. A new version is loaded and compiled for every batch size before any old one is
unloaded (availability-preserving, as TF Serving's default). Before a version is served its
stored check runs (``export_check.json``: the export's own examples and predictions,
``versions.rerun_check``): a version whose files were damaged after the export answers other
predictions and is refused. A version that fails to load or to check is reported (state ``END``
with its error) and is retried when its files change (``versions.fingerprint``: a copy that
was still under way, files copied in any order), never on every poll; it never replaces a
working one. An unloaded version refuses new requests, finishes those in flight, then frees its
device memory.

Each load and unload logs one INFO line (``estimax.serving.manager``) with the version's path and
how long it took; a failed load one ERROR line with the path and the cause (which names the file
that could not be read).
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from estimax.serving.servable import Servable
from estimax.serving.versions import fingerprint, list_versions, rerun_check

log = logging.getLogger(__name__)


@dataclasses.dataclass
class VersionState:
    """One version's state in TF Serving's terms (START, LOADING, AVAILABLE, UNLOADING, END)."""

    version: int
    state: str
    error: str = ""
    servable: Servable | None = None
    stamp: Any = None  # the folder's fingerprint when loading failed
    path: str = ""


class ModelManager:
    """Keeps the newest versions of ``model_base_path`` loaded (see module docstring)."""

    def __init__(
        self,
        name: str,
        model_base_path: str,
        batch_sizes: Sequence[int],
        num_versions: int = 1,
        poll_wait_seconds: float = 1.0,
        load: Callable[[str, int, Sequence[int]], Servable] | None = None,
    ):
        """Does not load anything until ``poll()`` or ``start()``."""
        self.name = name
        self.base_path = model_base_path
        self.batch_sizes = list(batch_sizes)
        self.num_versions = num_versions
        self.poll_wait_seconds = poll_wait_seconds
        self._load = load or (lambda path, version, sizes: Servable(path, version, sizes))
        self._versions: dict[int, VersionState] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_poll_error = ""
        # Called with (path, seconds, ok) after each load attempt (the server's metrics).
        self.on_load: Callable[[str, float, bool], None] | None = None

    # ---------------------------------------------------------------- queries (any thread)
    def states(self) -> list[VersionState]:
        """Every version seen, newest first."""
        with self._lock:
            return sorted(self._versions.values(), key=lambda v: -v.version)

    def get(self, version: int | None = None) -> Servable | None:
        """The servable of ``version`` (None: the newest available), or None."""
        with self._lock:
            available = {
                v: s
                for v, s in self._versions.items()
                if s.state == "AVAILABLE" and s.servable is not None
            }
            if version is None:
                return available[max(available)].servable if available else None
            state = available.get(version)
            return state.servable if state else None

    def ready(self) -> bool:
        """Whether some version is available."""
        return self.get() is not None

    # ---------------------------------------------------------------- polling
    def _path(self, version: int) -> str:
        return posixpath.join(self.base_path.rstrip("/"), str(version))

    def poll(self) -> None:
        """One poll: load what the policy wants, then unload what it no longer wants."""
        try:
            on_disk = list_versions(self.base_path)
            self.last_poll_error = ""
        except (OSError, ValueError) as e:
            if self.last_poll_error != str(e):
                log.error("Model %s: cannot list versions: %s", self.name, e)
            self.last_poll_error = str(e)
            return
        wanted = sorted(on_disk)[-self.num_versions :]
        for version in wanted:
            with self._lock:
                state = self._versions.get(version)
            if state is not None and state.state == "AVAILABLE":
                continue
            stamp = fingerprint(self._path(version))
            if state is not None and state.state == "END" and state.stamp == stamp:
                continue  # failed before and unchanged since
            self._load_version(version, stamp)
        with self._lock:
            available = [v for v, s in self._versions.items() if s.state == "AVAILABLE"]
            keep = set(wanted) & set(available)
            if not keep and available:
                keep = {max(available)}  # never unload the last working version
            to_unload = [self._versions[v] for v in available if v not in keep]
            for s in to_unload:
                s.state = "UNLOADING"
        for s in to_unload:
            servable = s.servable
            start = time.perf_counter()
            if servable is not None:
                servable.retire()  # waits for the requests that hold it
            with self._lock:
                s.state, s.servable = "END", None
            log.info(
                "Model %s: unloaded version %d (%s) in %.2f s",
                self.name,
                s.version,
                s.path,
                time.perf_counter() - start,
            )

    def _load_version(self, version: int, stamp: Any) -> None:
        path = self._path(version)
        with self._lock:
            self._versions[version] = VersionState(version, "LOADING", path=path)
        log.debug("Model %s: loading version %d from %s", self.name, version, path)
        start = time.perf_counter()
        servable = None
        try:
            servable = self._load(path, version, self.batch_sizes)
            servable.warm()
            checked = rerun_check(servable, path, "at load")
        except Exception as e:  # noqa: BLE001 - any failure is reported, the old one stays
            if servable is not None:
                servable.model.close()  # its device memory, at once
            self._failed(version, path, stamp, e, time.perf_counter() - start)
            return
        seconds = time.perf_counter() - start
        with self._lock:
            self._versions[version] = VersionState(
                version, "AVAILABLE", servable=servable, path=path
            )
        log.info(
            "Model %s: loaded version %d from %s in %.2f s (compiled for batch sizes %s; %s)",
            self.name,
            version,
            path,
            seconds,
            self.batch_sizes,
            f"its stored check passed on {checked[0]} examples"
            if checked
            else "no stored check: exported without check_inputs",
        )
        if self.on_load is not None:
            self.on_load(path, seconds, True)

    def _failed(self, version: int, path: str, stamp: Any, e: Exception, seconds: float) -> None:
        log.error(
            "Model %s: version %d failed to load from %s: %s: %s (retried when its files change)",
            self.name,
            version,
            path,
            type(e).__name__,
            e,
        )
        with self._lock:
            self._versions[version] = VersionState(
                version, "END", error=f"{type(e).__name__}: {e}", stamp=stamp, path=path
            )
        if self.on_load is not None:
            self.on_load(path, seconds, False)

    def start(self) -> None:
        """Polls once now, then every ``poll_wait_seconds`` in a thread (never if 0)."""
        self.poll()
        if self.poll_wait_seconds > 0:
            self._thread = threading.Thread(target=self._run, name=f"poll-{self.name}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_wait_seconds):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad poll
                log.exception("Model %s: poll failed", self.name)

    def stop(self) -> None:
        """Stops polling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
