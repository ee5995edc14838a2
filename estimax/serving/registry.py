"""Several models per server: TF Serving's ``--model_config_file``, read at start and re-read.

The file is a text ``ModelServerConfig`` (TF Serving's ``model_server_config.proto``)::

    model_config_list {
      config {
        name: "resnet"  base_path: "/models/resnet"  model_platform: "tensorflow"
        model_version_policy { specific { versions: 1 versions: 2 } }  # or latest {...}, all {}
        version_labels { key: "stable" value: 1 }
        version_labels { key: "canary" value: 2 }
      }
      config { name: "bert"  base_path: "/models/bert" }
    }

Who owns what:

============================  ====================================================
``read_config``               the file -> ``ModelConfig`` list, or one line why not
``ModelRegistry.apply``       a config list -> models added, removed, re-policied and
                              relabelled in the ``ServingCore``
``ConfigPoller``              re-reads the file every ``--model_config_file_poll_wait_seconds``
``ModelRegistry.reload``      gRPC ``ModelService/HandleReloadConfigRequest``'s config
============================  ====================================================

Each model gets its own ``ModelManager`` (its versions polled every
``--file_system_poll_wait_seconds``, hot-reloaded as a single model is) and its own batching
queue (``ServingCore.add``). A model whose ``base_path`` changes is replaced; one whose version
policy changes keeps its loaded versions and follows the new policy at once.

Version labels follow TF Serving's rule: a label may only name a version that is available
(loaded, checked and warmed), unless ``--allow_version_labels_for_unavailable_models`` is given,
which lets a *new* label (never an existing one moved) name a version not yet loaded. Unlike TF
Serving, labels are checked after the models' versions have loaded, so a first config may label
the versions it loads (TF Serving refuses every label at start without the flag). A refused
label keeps every model's old labels (labels change together, as TF Serving's label map) and is
tried again at the next poll, so a label moved to a version still loading takes effect once
that version is available.

A file that cannot be read or parsed, or that is not a valid config (a model listed twice, no
``base_path``, another platform), is refused whole: at start in one line (the server does not
start), on a later poll in one ERROR line (once per distinct error) while the old config keeps
being served, as TF Serving's poller does.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from estimax.serving.core import ServingCore
from estimax.serving.manager import ModelManager, VersionPolicy
from estimax.serving.poller import Poller

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A model config that cannot be served (its one line)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One model of a ``ModelServerConfig``.

    Attributes:
      name: the model's name (``/v1/models/NAME``).
      base_path: the folder (or URL) of its numeric versions.
      policy: which versions are served.
      labels: version label -> version.
    """

    name: str
    base_path: str
    policy: VersionPolicy = VersionPolicy()
    labels: tuple[tuple[str, int], ...] = ()


def parse_config(text: str, where: str) -> list[ModelConfig]:
    """A text ``ModelServerConfig`` -> its models; ConfigError (naming ``where``) if bad."""
    from google.protobuf import text_format

    from estimax.serving.protos.tensorflow_serving.config import model_server_config_pb2

    try:
        config = text_format.Parse(text, model_server_config_pb2.ModelServerConfig())
    except text_format.ParseError as e:
        raise ConfigError(f"{where}: not a ModelServerConfig ({e})") from None
    return models_of(config, where)


def models_of(config: Any, where: str) -> list[ModelConfig]:
    """A ``ModelServerConfig`` message -> its models; ConfigError (naming ``where``) if bad."""
    if config.WhichOneof("config") != "model_config_list":
        raise ConfigError(f"{where}: give model_config_list {{ config {{ ... }} }}")
    models: list[ModelConfig] = []
    for i, model in enumerate(config.model_config_list.config):
        if not model.name or not model.base_path:
            raise ConfigError(f"{where}: config {i} needs a name and a base_path")
        if any(m.name == model.name for m in models):
            # TF Serving's message (ValidateModelConfigList).
            raise ConfigError(
                f"{where}: Illegal to list model {model.name} multiple times in config list"
            )
        if model.model_platform not in ("", "tensorflow"):
            raise ConfigError(
                f"{where}: model {model.name}: model_platform {model.model_platform!r} is not "
                'served (estimax serves its own exports; give "tensorflow" or nothing)'
            )
        models.append(
            ModelConfig(
                model.name,
                model.base_path,
                _policy(model.model_version_policy, f"{where}: model {model.name}"),
                tuple(sorted((k, int(v)) for k, v in model.version_labels.items())),
            )
        )
    return models


def _policy(policy: Any, where: str) -> VersionPolicy:
    """A ``ServableVersionPolicy`` message as a ``VersionPolicy``."""
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy("all")
    if which == "specific":
        versions = tuple(sorted(set(policy.specific.versions)))
        if not versions:
            raise ConfigError(f"{where}: model_version_policy specific lists no versions")
        return VersionPolicy("specific", versions=versions)
    # latest, or no policy: TF Serving's default is latest { num_versions: 1 }.
    num = policy.latest.num_versions if which == "latest" else 1
    return VersionPolicy("latest", num_versions=num or 1)


def read_config(path: str) -> list[ModelConfig]:
    """``--model_config_file`` -> its models; ConfigError (one line naming the flag) if bad."""
    flag = f"--model_config_file={path}"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read it: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag}: not a text file") from None
    return parse_config(text, flag)


class ModelRegistry:
    """Keeps a ``ServingCore``'s models as a config list says (module docstring)."""

    def __init__(
        self,
        core: ServingCore,
        make_manager: Callable[[ModelConfig], ModelManager],
        allow_unavailable_labels: bool = False,
    ):
        """``make_manager``: a new (not started) manager for a model's config."""
        self.core = core
        self._make = make_manager
        self.allow_unavailable_labels = allow_unavailable_labels
        self.configs: dict[str, ModelConfig] = {}
        # Whether the labels of ``configs`` are the ones served (False: refused; retried).
        self.labels_applied = True
        self._lock = threading.Lock()  # one apply at a time

    def apply(self, configs: Sequence[ModelConfig]) -> list[str]:
        """Serves ``configs``: adds, removes, re-policies the models, then sets the labels.

        New models are loaded before this returns (their first poll). Returns what changed, a
        phrase each.

        Raises:
          ConfigError: a label refused; the models changed, the old labels are kept.
        """
        with self._lock:
            return self._apply({c.name: c for c in configs})

    def reload(self, config: Any) -> list[str]:
        """Applies a ``ModelServerConfig`` message (gRPC ``HandleReloadConfigRequest``)."""
        configs = models_of(config, "ReloadConfigRequest")
        log.info("HandleReloadConfigRequest: serving %s", ", ".join(c.name for c in configs))
        return self.apply(configs)

    def _apply(self, new: dict[str, ModelConfig]) -> list[str]:
        changes: list[str] = []
        old = self.configs
        for name, config in old.items():
            if name not in new or new[name].base_path != config.base_path:
                model = self.core.remove(name)
                if model is not None:
                    model.manager.close()  # after the requests holding its versions
                    if model.batcher is not None:
                        model.batcher.close_soon()  # its queue is empty: they have ended
                if name not in new:
                    changes.append(f"removed model {name}")
        for name, config in new.items():
            before = old.get(name)
            if before is None or before.base_path != config.base_path:
                manager = self._make(config)
                self.core.add(manager)
                manager.start()  # its first poll loads the policy's versions
                self.core.name = self.core.name or name
                changes.append(
                    f"added model {name} from {config.base_path}"
                    if before is None
                    else f"model {name} now from {config.base_path}"
                )
            elif before.policy != config.policy:
                manager = self.core.models[name].manager
                manager.policy = config.policy
                manager.poll()  # now, not at its next poll (which may be never)
                changes.append(f"model {name}: version policy {config.policy.json()}")
        self.configs = new
        self.labels_applied = False
        changes += self._set_labels(new)
        self.labels_applied = True
        return changes

    def _set_labels(self, new: dict[str, ModelConfig]) -> list[str]:
        """Checks every label, then sets them all; ConfigError (nothing set) if one is refused."""
        maps: dict[str, dict[str, int]] = {}
        for name, config in new.items():
            model = self.core.models[name]
            for label, version in config.labels:
                previous = model.labels.get(label)
                may_wait = self.allow_unavailable_labels and previous in (None, version)
                if not may_wait and not model.manager.available(version):
                    # TF Serving's message (ServerCore::UpdateModelVersionLabelMap).
                    raise ConfigError(
                        f"Request to assign label to version {version} of model {name}, which "
                        "is not currently available for inference"
                        + (
                            ""
                            if self.allow_unavailable_labels
                            else " (--allow_version_labels_for_unavailable_models lets a new "
                            "label name a version not loaded yet)"
                        )
                    )
            maps[name] = dict(config.labels)
        changes = []
        for name, labels in maps.items():
            model = self.core.models[name]
            if model.labels != labels:
                model.labels = labels  # replaced whole: requests read it unlocked
                shown = ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"
                changes.append(f"model {name}: labels {shown}")
        return changes

    def close(self) -> None:
        """Stops every model's polling."""
        for model in self.core.models.values():
            model.manager.stop()


class ConfigPoller:
    """Re-reads ``--model_config_file`` every ``poll_wait_seconds`` and applies a change."""

    def __init__(self, path: str, registry: ModelRegistry, poll_wait_seconds: float):
        """Starts nothing until ``start``."""
        self.path = path
        self.registry = registry
        self.poll_wait_seconds = poll_wait_seconds
        self._poller = Poller(
            self.poll,
            poll_wait_seconds,
            name="poll-model-config",
            what=f"--model_config_file={path}",
            logger=log,
        )
        self._last_error = ""

    def poll(self) -> None:
        """Reads the file once; applies it if it changed (or its labels were refused)."""
        try:
            configs = read_config(self.path)
            if {c.name: c for c in configs} == self.registry.configs and (
                self.registry.labels_applied
            ):
                self._last_error = ""
                return
            changes = self.registry.apply(configs)
        except ConfigError as e:
            if str(e) != self._last_error:  # once per distinct error, not every poll
                log.error("%s; still serving the previous model config", e)
            self._last_error = str(e)
            return
        self._last_error = ""
        log.info(
            "--model_config_file=%s reloaded: %s", self.path, "; ".join(changes) or "no change"
        )

    def start(self) -> None:
        """Polls every ``poll_wait_seconds`` in a thread."""
        self._poller.start()

    def stop(self) -> None:
        """Stops polling."""
        self._poller.stop()
