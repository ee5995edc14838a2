"""Model control while the server runs: the v2 model-repository extension, Triton's shapes.

``--model_control_mode`` says who decides which models are loaded:

* ``none`` (the default, what the server always did): every configured model is loaded at
  start; load and unload calls are refused.
* ``poll``: as ``none``, and ``--model_config_file`` is watched (``registry.ConfigPoller``);
  load and unload calls are refused, as Triton refuses them while it polls.
* ``explicit``: only the models named by ``--load_model`` are loaded at start; the others of the
  config file are *known* (the repository) and loaded on request.

``ModelControl`` answers the three calls of the extension (``index``, ``load``, ``unload``) for
the HTTP routes (``POST /v2/repository/index``, ``/v2/repository/models/NAME/load|unload``) and
the gRPC methods (``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``):

* A load builds the model aside (``ServingCore.prepare``), loads, checks and warms its versions
  in one of the control's own threads (``call``: the event loop and every other model keep
  answering), then swaps it in in one step (``ModelRegistry.put``), as a ``base_path`` change
  of the config file is. A load that fails leaves the previous state serving (the old
  model, or none) and is kept, with its reason, for the index until the model's next load or
  unload.
* An unload removes the model at once (new requests answer 404), waits for the requests in
  flight at most ``unload_drain_s`` (``--unload_drain_secs``), then frees its versions; past the
  bound the call answers and the versions are freed in the background once their last request
  ends.

Each call is logged (one INFO line) and counted (``ServingMetrics.control``); the routes' own
access-log lines name the action (``repository_load``...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from estimax.serving import model_settings
from estimax.serving.batching import BatchingOptions
from estimax.serving.core import ServingCore
from estimax.serving.manager import VersionPolicy
from estimax.serving.options import ServerOptions
from estimax.serving.protocol import ApiError, cut
from estimax.serving.registry import ConfigError, ModelConfig, ModelRegistry, check_name

__all__ = ["MODES", "ModelControl", "parse_override"]

log = logging.getLogger(__name__)

MODES = ("none", "poll", "explicit")

# Triton's model states in the index, from TF Serving's version states.
_STATES = {
    "START": "LOADING",
    "LOADING": "LOADING",
    "AVAILABLE": "READY",
    "UNLOADING": "UNLOADING",
    "END": "UNAVAILABLE",
}
# The config override's fields: ours, then those ``GET /v2/models/NAME/config`` answers
# (accepted and ignored, so that a config read back can be sent again).
_OVERRIDE_FIELDS = (
    "name",
    "base_path",
    "version_policy",
    "version_labels",
    "dynamic_batching",
    "response_cache",
)
_IGNORED_FIELDS = ("platform", "backend", "max_batch_size", "input", "output", "parameters")


@dataclasses.dataclass(frozen=True)
class Override:
    """A load's config override (``parameters.config``), parsed.

    Attributes:
      config: the model's config with the override's fields applied.
      batch_timeout_micros: ``dynamic_batching.max_queue_delay_microseconds``, if given.
      settings: the per-model settings it gives (``model_settings.parse``: ``response_cache``,
        ``priority_levels``, ``default_priority_level``), over the model's ``config.json``.
    """

    config: ModelConfig
    batch_timeout_micros: int | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


class ModelControl:
    """Loads and unloads a server's models on request (module docstring)."""

    def __init__(
        self,
        registry: ModelRegistry,
        repository: Sequence[ModelConfig],
        mode: str = "none",
        unload_drain_s: float = 30.0,
    ):
        """``repository``: every model the server knows (the config file's), loaded or not."""
        if mode not in MODES:
            raise ValueError(f"--model_control_mode={mode!r}: give one of {', '.join(MODES)}")
        self.registry = registry
        self.core: ServingCore = registry.core
        self.mode = mode
        self.unload_drain_s = unload_drain_s
        self.repository: dict[str, ModelConfig] = {c.name: c for c in repository}
        # Model -> (version, why) of its last load that failed (shown by the index).
        self.failures: dict[str, tuple[str, str]] = {}
        # Models unloading: out of service, their requests in flight draining.
        self.unloading: dict[str, Any] = {}
        # Loads and unloads run here, never on the event loop nor on the default executor
        # (which walks large request bodies): a minutes-long load delays no request.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="control")
        # One load or unload at a time per model; other models' calls run meanwhile.
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # ---------------------------------------------------------------- the index
    def known(self) -> list[str]:
        """The models the index lists: served, configured, or whose load failed; sorted."""
        names = (
            set(self.core.models)
            | set(self.registry.configs)
            | set(self.failures)
            | set(self.unloading)
        )
        if self.mode == "explicit":
            names |= set(self.repository)
        return sorted(names)

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: ``{name, version, state, reason}`` per model version.

        A model with no version seen has one entry (version ``""``) saying why: ``unloaded``,
        or why its versions cannot be listed (a missing ``base_path``). ``ready_only``: the
        ``READY`` entries alone (the index request's ``ready``).
        """
        entries: list[dict[str, str]] = []
        for name in self.known():
            model = self.core.models.get(name)
            draining = self.unloading.get(name)
            if model is None and draining is not None:
                for s in draining.manager.states():
                    if s.state == "AVAILABLE":
                        reason = "unloading: its requests in flight end first"
                        entries.append(_entry(name, str(s.version), "UNLOADING", reason))
            elif model is None:
                entries.append(_entry(name, "", "UNAVAILABLE", "unloaded"))
            else:
                states = model.manager.states()
                for s in states:
                    reason = s.error
                    if s.state == "AVAILABLE" and model.settings.response_cache:
                        cache = self.core.cache_state(model, s.servable)
                        reason = reason or ("" if cache == "on" else f"response cache {cache}")
                    entries.append(_entry(name, str(s.version), _STATES[s.state], reason))
                if not states:
                    why = model.manager.last_poll_error or (
                        f"no version in base_path {model.manager.base_path} yet; the model "
                        "waits for versions"
                    )
                    entries.append(_entry(name, "", "UNAVAILABLE", why))
            failure = self.failures.get(name)
            if failure is not None:
                entries.append(_entry(name, failure[0], "UNAVAILABLE", failure[1]))
        if ready_only:
            entries = [e for e in entries if e["state"] == "READY"]
        return entries

    # ---------------------------------------------------------------- load and unload
    async def call(self, action: str, name: str, parameters: dict[str, Any]) -> str:
        """``load`` or ``unload`` (``action``) of model ``name``, in a control thread."""
        work = self.load if action == "load" else self.unload
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, name, parameters)

    def check_allowed(self, action: str, name: str) -> None:
        """400 naming the mode when load and unload calls are refused (not ``explicit``)."""
        if self.mode != "explicit":
            why = (
                "the model config file is polled"
                if self.mode == "poll"
                else "the models are those loaded at start"
            )
            raise ApiError(
                400,
                f"failed to {action} {cut(name)!r}: explicit model load / unload is not allowed "
                f"with --model_control_mode={self.mode} ({why}); start the server with "
                "--model_control_mode=explicit",
            )

    def load(self, name: str, parameters: dict[str, Any] | None = None) -> str:
        """Loads (or reloads) model ``name``, with ``parameters["config"]``'s override; blocks
        until its versions are served. Returns what was done.

        Raises:
          ApiError: 400 (refused in this mode, a bad override, a load that failed: the
            previous state serves on), 404 (a model the repository does not know).
        """
        self.check_allowed("load", name)
        parameters = parameters or {}
        override = parse_override(
            name, parameters.get("config"), self._base(name), self.core.options
        )
        with self._lock_of(name):
            return self._load(name, override)

    def _base(self, name: str) -> ModelConfig | None:
        """The config a load of ``name`` starts from: the served one, else the repository's."""
        return self.registry.configs.get(name) or self.repository.get(name)

    def _load(self, name: str, override: Override) -> str:
        config = override.config
        reloaded = name in self.core.models
        action = "reload" if reloaded else "load"
        start = time.perf_counter()
        manager = self.registry.new_manager(config)
        try:
            model = self.core.prepare(manager, _batching(self.core, override), override.settings)
        except ValueError as e:  # its config.json, or its levels with the override's
            self.failures[name] = ("", f"load failed: {e}")
            self.core.metrics.control(action, name, ok=False)
            kept = "the previous state serves on" if reloaded else "it is not served"
            log.warning("model control: %s of model %r failed: %s; %s", action, name, e, kept)
            raise ApiError(400, f"failed to load {name!r}: {e}; {kept}") from None
        manager.poll()  # reads, compiles, checks and warms while the served model answers
        labels = self._labels(config, manager)
        if not manager.ready() or labels:
            errors = [f"version {s.version}: {s.error}" for s in manager.states() if s.error]
            why = (
                labels
                or "; ".join(errors)
                or manager.last_poll_error
                or (f"no version in base_path {config.base_path}")
            )
            failed = [str(s.version) for s in manager.states() if s.error]
            self.registry.close_model(model)
            self.failures[name] = (failed[0] if failed else "", f"load failed: {why}")
            self.core.metrics.control(action, name, ok=False)
            served = self.core.models.get(name)
            if served is not None and served.manager.ready():
                kept = f"still serving it from {served.manager.base_path}"
            elif served is not None:
                kept = f"it still waits for versions in {served.manager.base_path}"
            else:
                kept = "it is not served"
            log.warning("model control: %s of model %r failed: %s; %s", action, name, why, kept)
            raise ApiError(400, f"failed to load {name!r}: {why}; {kept}")
        replaced = self.registry.put(config, model)  # requests take the new versions from now
        self.failures.pop(name, None)
        self.repository[name] = config
        manager.start(poll_now=False)
        if replaced is not None:
            self.registry.close_model(replaced)  # after the requests that hold its versions
        versions = [str(s.version) for s in manager.states() if s.state == "AVAILABLE"]
        self.core.metrics.control(action, name, ok=True)
        done = (
            f"{action}ed model {name!r} from {config.base_path} (versions "
            f"{', '.join(versions)}) in {time.perf_counter() - start:.2f} s"
        )
        log.info("model control: %s", done)
        return done

    def _labels(self, config: ModelConfig, manager: Any) -> str:
        """Why ``config``'s labels cannot be served by ``manager``'s versions ("": they can)."""
        for label, version in config.labels:
            if not manager.available(version) and not self.registry.allow_unavailable_labels:
                # TF Serving's message (ServerCore::UpdateModelVersionLabelMap).
                return (
                    f"Request to assign label {label} to version {version} of model "
                    f"{config.name}, which is not currently available for inference"
                )
        return ""

    def unload(self, name: str, parameters: dict[str, Any] | None = None) -> str:
        """Stops serving model ``name``: new requests answer 404 at once, those in flight end
        (waited for ``unload_drain_s`` at most), then its versions are freed.

        ``parameters``: ``unload_dependents`` (a bool; no model here depends on another).

        Raises:
          ApiError: 400 (refused in this mode, a bad parameter), 404 (an unknown model).
        """
        self.check_allowed("unload", name)
        dependents = (parameters or {}).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise ApiError(400, "failed to unload: unload_dependents must be true or false")
        with self._lock_of(name):
            if name not in self.core.models:
                if name in self.repository or name in self.failures:
                    self.failures.pop(name, None)
                    return f"model {name!r} is not loaded"  # Triton: unloading it again is OK
                raise ApiError(404, f"failed to unload {cut(name)!r}: no such model")
            start = time.perf_counter()
            model = self.registry.drop(name)  # from now on: 404
            self.failures.pop(name, None)
            if model is None:
                return f"model {name!r} is not loaded"
            model.manager.stop()
            self.unloading[name] = model
            servables = [s.servable for s in model.manager.states() if s.servable is not None]
            deadline = time.monotonic() + self.unload_drain_s
            drained = all(s.drain(max(0.0, deadline - time.monotonic())) for s in servables)
            if drained:
                self._close(name, model)
            else:  # freed once the last request ends, not under it
                threading.Thread(
                    target=self._close, args=(name, model), name=f"unload-{name}", daemon=True
                ).start()
        self.core.metrics.control("unload", name, ok=True)
        done = (
            f"unloaded model {name!r} in {time.perf_counter() - start:.2f} s"
            if drained
            else f"unloaded model {name!r}: requests still in flight after "
            f"{self.unload_drain_s:g} s (--unload_drain_secs); its versions are freed when "
            "they end"
        )
        log.info("model control: %s", done)
        return done

    def _close(self, name: str, model: Any) -> None:
        """Frees an unloaded model's versions (after their requests) and forgets it."""
        self.registry.close_model(model)
        if self.unloading.get(name) is model:
            del self.unloading[name]

    def reload_config(self, config: Any) -> list[str]:
        """gRPC ``HandleReloadConfigRequest``: the registry applies it; its models join the
        repository."""
        changes = self.registry.reload(config)
        self.repository.update(self.registry.configs)
        for name in self.registry.configs:
            self.failures.pop(name, None)
        self.core.metrics.control("reload_config", "", ok=True)
        return changes

    def _lock_of(self, name: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(name, threading.Lock())


def _entry(name: str, version: str, state: str, reason: str) -> dict[str, str]:
    return {"name": name, "version": version, "state": state, "reason": reason}


def _batching(core: ServingCore, override: Override) -> BatchingOptions | None:
    """The model's batching options with the override's queue delay (None: the server's)."""
    if override.batch_timeout_micros is None:
        return None
    return dataclasses.replace(
        core.options.batching, batch_timeout_micros=override.batch_timeout_micros
    )


def parse_override(
    name: str, text: Any, base: ModelConfig | None, options: ServerOptions | None = None
) -> Override:
    """A load's ``parameters.config`` (JSON text of a model config, Triton's) over ``base``;
    ``options``: the server's (their priority levels are the defaults of the override's).

    Raises:
      ApiError: 400 for an override that is not a JSON object of known fields of the right
        types; 404 for a model with no ``base`` and no ``base_path`` in the override.
    """
    try:
        check_name(name, "failed to load")  # one rule for every name (registry.check_name)
    except ConfigError as e:
        raise ApiError(400, str(e)) from None
    where = f"failed to load {cut(name)!r}: parameters.config"
    fields: dict[str, Any] = {}
    if text is not None:
        if isinstance(text, bytes | bytearray):
            text = bytes(text).decode("utf-8", "replace")
        if not isinstance(text, str):
            raise ApiError(400, f"{where} must be a string of JSON (a model config)")
        try:
            fields = json.loads(text)
        except ValueError as e:
            raise ApiError(400, f"{where} is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ApiError(400, f"{where} must be a JSON object (a model config)")
        unknown = sorted(set(fields) - set(_OVERRIDE_FIELDS) - set(_IGNORED_FIELDS))
        if unknown:
            raise ApiError(
                400,
                f"{where}: unknown fields {[cut(str(u)) for u in unknown]}; it takes "
                f"{', '.join(_OVERRIDE_FIELDS)} (and ignores {', '.join(_IGNORED_FIELDS)})",
            )
        if fields.get("name", name) != name:
            raise ApiError(400, f"{where}: name {cut(str(fields['name']))!r} is not {name!r}")
    base_path = fields.get("base_path")
    if base_path is not None and (not isinstance(base_path, str) or not base_path):
        raise ApiError(400, f"{where}: base_path must be a non-empty string")
    if base is None:
        if base_path is None:
            raise ApiError(
                404,
                f"failed to load {cut(name)!r}: no such model in the repository (give its "
                "base_path in parameters.config to add it)",
            )
        base = ModelConfig(name, base_path)
    config = base
    if base_path is not None:
        config = dataclasses.replace(config, base_path=base_path)
    if "version_policy" in fields:
        config = dataclasses.replace(config, policy=_policy(fields["version_policy"], where))
    if "version_labels" in fields:
        config = dataclasses.replace(config, labels=_labels(fields["version_labels"], where))
    timeout = None
    try:
        settings = model_settings.parse(
            fields, where, batching_also=("max_queue_delay_microseconds", "preferred_batch_size")
        )
        # Its levels must fit together, or with the server's (the file's: at the load).
        model_settings.resolve(name, options or ServerOptions(), settings)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    if "dynamic_batching" in fields:
        batching = fields["dynamic_batching"]  # a dict: parse checked it
        if "max_queue_delay_microseconds" in batching:
            timeout = _integer(
                batching["max_queue_delay_microseconds"],
                f"{where}: dynamic_batching.max_queue_delay_microseconds",
            )
    return Override(config, timeout, settings)


def _integer(value: Any, where: str, least: int = 0) -> int:
    try:
        return model_settings.integer(value, where, least)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _policy(policy: Any, where: str) -> VersionPolicy:
    """Triton's ``ModelVersionPolicy`` JSON (as ``GET .../config`` answers it)."""
    where = f"{where}: version_policy"
    if not isinstance(policy, dict) or len(policy) != 1:
        raise ApiError(
            400,
            f'{where} must be one of {{"latest": {{"num_versions": N}}}}, '
            '{"all": {}}, {"specific": {"versions": [...]}}',
        )
    ((kind, body),) = policy.items()
    if not isinstance(body, dict):
        raise ApiError(400, f"{where}: {cut(str(kind))} must be an object")
    if kind == "all" and not body:
        return VersionPolicy("all")
    if kind == "latest" and set(body) <= {"num_versions"}:
        return VersionPolicy(
            "latest", num_versions=_integer(body.get("num_versions", 1), f"{where}.latest", 1)
        )
    if kind == "specific" and set(body) == {"versions"} and isinstance(body["versions"], list):
        versions = tuple(sorted({_integer(v, f"{where}.specific") for v in body["versions"]}))
        if versions:
            return VersionPolicy("specific", versions=versions)
    raise ApiError(
        400,
        f'{where} must be one of {{"latest": {{"num_versions": N}}}}, '
        '{"all": {}}, {"specific": {"versions": [...]}}',
    )


def _labels(labels: Any, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(labels, dict):
        raise ApiError(400, f"{where}: version_labels must be an object of label: version")
    return tuple(
        sorted(
            (str(k), _integer(v, f"{where}: version_labels.{cut(str(k))}"))
            for k, v in labels.items()
        )
    )
