"""Versions of one model: polling the base path, loading and warming, swapping without downtime.

Version policies as TensorFlow Serving's (``VersionPolicy``): ``latest{num_versions}`` (its
default: the newest published versions), ``all`` (every version on disk) or
``specific{versions}`` (those listed that are on disk). A new version is loaded and compiled for
every batch size before any old one is unloaded (availability-preserving, as TF Serving's
default). Before a version is served its
stored check runs (``export_check.json``: the export's own examples and predictions,
``versions.rerun_check``): a version whose files were damaged after the export answers other
predictions and is refused. A version that fails to load or to check is reported (state ``END``
with its error) and is retried when its files change (``versions.fingerprint``: a copy that
was still under way, files copied in any order), never on every poll; it never replaces a
working one. An unloaded version refuses new requests, finishes those in flight, then frees its
device memory.

A load is bounded in time (``load_timeout_s``, ``--version_load_timeout_seconds``): one that
has not ended by then (a file on a hung mount; a FIFO is refused at once, as any file that is
not a regular one) is logged, set aside (state ``END`` with its cause) and left to end in its
own thread; the other versions load meanwhile, and it is tried again once that load ends (its
outcome, late, is dropped). TF Serving's single loading thread has no such bound.

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

from estimax.export.servable import Servable
from estimax.export.versions import fingerprint, list_versions, rerun_check
from estimax.serving.poller import Poller

log = logging.getLogger(__name__)

# The stamp of a version set aside while loading: equal to no fingerprint, so it is retried.
_RETRY = object()


@dataclasses.dataclass(frozen=True)
class VersionPolicy:
    """Which versions on disk are served: TF Serving's ``ServableVersionPolicy``.

    Attributes:
      kind: ``latest`` (the newest ``num_versions``), ``all`` or ``specific`` (``versions``).
      num_versions: for ``latest``.
      versions: for ``specific``.
    """

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def wanted(self, on_disk: Sequence[int]) -> list[int]:
        """The versions of ``on_disk`` to serve, oldest first."""
        if self.kind == "all":
            return sorted(on_disk)
        if self.kind == "specific":
            return sorted(set(on_disk) & set(self.versions))
        return sorted(on_disk)[-self.num_versions :]

    def json(self) -> dict[str, Any]:
        """The policy as Triton's ``ModelVersionPolicy`` JSON (also TF Serving's text names)."""
        if self.kind == "all":
            return {"all": {}}
        if self.kind == "specific":
            return {"specific": {"versions": list(self.versions)}}
        return {"latest": {"num_versions": self.num_versions}}


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
        load_timeout_s: float = 600.0,
        policy: VersionPolicy | None = None,
    ):
        """Does not load anything until ``poll()`` or ``start()``.

        ``load_timeout_s``: a version whose load (read, compile, warm, check) takes longer is
        set aside (module docstring). ``policy``: which versions to serve (default: the newest
        ``num_versions``); may be replaced while polling (the next poll follows it).
        """
        self.load_timeout_s = load_timeout_s
        # Versions whose load was set aside and has not ended yet: their thread.
        self._stuck: dict[int, threading.Thread] = {}
        self.name = name
        self.base_path = model_base_path
        self.batch_sizes = list(batch_sizes)
        self.policy = policy or VersionPolicy("latest", num_versions)
        self.poll_wait_seconds = poll_wait_seconds
        self._load = load or (lambda path, version, sizes: Servable(path, version, sizes))
        self._versions: dict[int, VersionState] = {}
        # Read on every request without the lock (replaced whole under it, never changed in
        # place): the available servables, and every version seen, as the strings requests use.
        self._serving: dict[int, Servable] = {}
        self._newest: Servable | None = None
        self._seen: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        # One poll at a time: the poll thread's, and one asked for when the policy changes.
        self._poll_lock = threading.Lock()
        # Set once the first poll has ended (every wanted version tried).
        self.polled = threading.Event()
        self._poller = Poller(
            self.poll, poll_wait_seconds, name=f"poll-{name}", what=f"Model {name}", logger=log
        )
        self.last_poll_error = ""
        # Called with (path, seconds, ok) after each load attempt (the server's metrics).
        self.on_load: Callable[[str, float, bool], None] | None = None
        # Called with (servable, path) after a version's stored check, before it is served:
        # replays its warm-up records (``warmup.replay``) and returns how many; raising fails
        # the load.
        self.warmup: Callable[[Servable, str], int] | None = None
        # Warm-up records replayed, in all (the server's log and /metrics).
        self.warmup_records = 0

    # ---------------------------------------------------------------- queries (any thread)
    def states(self) -> list[VersionState]:
        """Every version seen, newest first."""
        with self._lock:
            return sorted(self._versions.values(), key=lambda v: -v.version)

    def get(self, version: int | None = None) -> Servable | None:
        """The servable of ``version`` (None: the newest available), or None."""
        return self._newest if version is None else self._serving.get(version)

    def knows(self, version: str) -> bool:
        """Whether ``version`` (as a request writes it) is a version seen, in any state."""
        return version in self._seen

    def available(self, version: int) -> bool:
        """Whether ``version`` is available now."""
        return version in self._serving

    def ready(self) -> bool:
        """Whether the first poll has ended and some version is available."""
        return self._newest is not None and self.polled.is_set()

    def _set(self, state: VersionState) -> None:
        """Records a version's new state (under ``_lock``) and what requests read of it."""
        self._versions[state.version] = state
        serving = {
            v: s.servable
            for v, s in self._versions.items()
            if s.state == "AVAILABLE" and s.servable is not None
        }
        self._serving = serving
        self._newest = serving[max(serving)] if serving else None
        self._seen = frozenset(str(v) for v in self._versions)

    # ---------------------------------------------------------------- polling
    def _path(self, version: int) -> str:
        return posixpath.join(self.base_path.rstrip("/"), str(version))

    def poll(self) -> None:
        """One poll: load what the policy wants, then unload what it no longer wants."""
        with self._poll_lock:
            self._poll()
        self.polled.set()

    def _poll(self) -> None:
        try:
            on_disk = list_versions(self.base_path)
            self.last_poll_error = ""
        except (OSError, ValueError) as e:
            # A missing folder is named as the model's base_path: list_versions' message names
            # --model_base_path, a flag a --model_config_file user never gave.
            why = (
                f"base_path {self.base_path} does not exist or is not a directory; the model "
                "waits for versions"
                if isinstance(e, FileNotFoundError)
                else str(e)
            )
            if self.last_poll_error != why:
                log.error("Model %s: cannot list versions: %s", self.name, why)
            self.last_poll_error = why
            return
        wanted = self.policy.wanted(on_disk)
        for version in wanted:
            with self._lock:
                state = self._versions.get(version)
            if state is not None and state.state == "AVAILABLE":
                continue
            with self._lock:
                if version in self._stuck:
                    continue  # its load has not ended yet: one thread per version
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
                self._set(dataclasses.replace(s, state="UNLOADING"))
        self._unload([self._versions[s.version] for s in to_unload])

    def _unload(self, to_unload: list[VersionState]) -> None:
        """Retires each version (after the requests holding it) and frees it."""
        for s in to_unload:
            servable = s.servable
            start = time.perf_counter()
            if servable is not None:
                servable.retire()  # waits for the requests that hold it
            with self._lock:
                self._set(dataclasses.replace(s, state="END", servable=None))
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
            self._set(VersionState(version, "LOADING", path=path))
        log.debug("Model %s: loading version %d from %s", self.name, version, path)
        start = time.perf_counter()
        outcome: dict[str, Any] = {}
        thread = threading.Thread(
            target=self._load_in_thread,
            args=(version, path, outcome),
            name=f"load-{self.name}-{version}",
            daemon=True,  # a load stuck for ever must not keep the process from exiting
        )
        thread.start()
        thread.join(self.load_timeout_s)
        with self._lock:
            stuck = "done" not in outcome
            if stuck:  # the thread sees this under the lock when it ends (_load_in_thread)
                self._stuck[version] = thread
                error = (
                    f"loading took longer than {self.load_timeout_s:g} s "
                    "(--version_load_timeout_seconds): a file that blocks (a hung mount?); "
                    "set aside, tried again once that load ends"
                )
                self._set(VersionState(version, "END", error=error, stamp=_RETRY, path=path))
        seconds = time.perf_counter() - start
        if stuck:
            log.error(
                "Model %s: version %d from %s: %s; the other versions load meanwhile",
                self.name,
                version,
                path,
                error,
            )
            if self.on_load is not None:
                self.on_load(path, seconds, False)
            return
        if "error" in outcome:
            self._failed(version, path, stamp, outcome["error"], seconds)
            return
        servable, checked, warmed = outcome["servable"], outcome["checked"], outcome["warmed"]
        with self._lock:
            self._set(VersionState(version, "AVAILABLE", servable=servable, path=path))
            self.warmup_records += warmed
        log.info(
            "Model %s: loaded version %d from %s in %.2f s (compiled for batch sizes %s; %s; "
            "%d warm-up records replayed)",
            self.name,
            version,
            path,
            seconds,
            self.batch_sizes,
            f"its stored check passed on {checked[0]} examples"
            if checked
            else "no stored check: exported without check_inputs",
            warmed,
        )
        if self.on_load is not None:
            self.on_load(path, seconds, True)

    def _load_in_thread(self, version: int, path: str, outcome: dict[str, Any]) -> None:
        """Loads, warms and checks a version into ``outcome`` (``servable`` and ``checked``, or
        ``error``), then marks it ``done``; a load set aside meanwhile is dropped."""
        servable = None
        try:
            servable = self._load(path, version, self.batch_sizes)
            servable.warm()
            outcome["checked"] = rerun_check(servable, path, "at load")
            outcome["warmed"] = self.warmup(servable, path) if self.warmup is not None else 0
            outcome["servable"] = servable
        except Exception as e:  # noqa: BLE001 - any failure is reported, the old one stays
            if servable is not None:
                servable.model.close()  # its device memory, at once
                servable = None
            outcome["error"] = e
        with self._lock:
            outcome["done"] = True
            late = self._stuck.get(version) is threading.current_thread()
            if late:
                del self._stuck[version]  # the next poll tries it again
        if late:
            if servable is not None:
                servable.model.close()
            log.warning(
                "Model %s: the load of version %d set aside earlier has ended (%s); it is "
                "tried again at the next poll",
                self.name,
                version,
                "failed" if "error" in outcome else "loaded",
            )

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
            self._set(
                VersionState(
                    version, "END", error=f"{type(e).__name__}: {e}", stamp=stamp, path=path
                )
            )
        if self.on_load is not None:
            self.on_load(path, seconds, False)

    def start(self, poll_now: bool = True) -> None:
        """Polls once now (unless ``poll_now`` is False: the caller has), then every
        ``poll_wait_seconds`` in a thread (never if 0)."""
        if poll_now:
            self.poll()
        if self.poll_wait_seconds > 0:
            self._poller.interval = self.poll_wait_seconds
            self._poller.start()

    def stop(self) -> None:
        """Stops polling."""
        self._poller.stop()

    def close(self) -> None:
        """Stops polling and unloads every version (a model no longer served)."""
        self.stop()
        with self._poll_lock, self._lock:
            to_unload = [s for s in self._versions.values() if s.state == "AVAILABLE"]
            for s in to_unload:
                self._set(dataclasses.replace(s, state="UNLOADING"))
        self._unload([self._versions[s.version] for s in to_unload])
