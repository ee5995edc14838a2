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
queue (``ServingCore.add``). A model whose ``base_path`` changes is replaced once the new path
has a version available: its new versions load and warm while the old ones serve on, then the
model is swapped in one step (no request finds it missing). A new path that is absent or has no
version that loads keeps the old one serving and is refused as a bad file is (below), tried again
at each poll. A model whose version policy changes keeps its loaded versions and follows the new
policy at once.

A file that is not a regular file (a FIFO, a device such as ``/dev/zero``, directly or through a
symlink) or is larger than ``MAX_CONFIG_BYTES`` is refused unread. A model name that is not
URL-safe (``check_name``: ASCII letters, digits, ``_.-~``, beginning with a letter or a digit) is
refused in one line naming its config entry, in the file and in ``HandleReloadConfigRequest``.
Reading a config is linear in its models (20,000 models: a fraction of a second).

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
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any

from estimax.export.versions import list_versions
from estimax.serving.core import ServedModel, ServingCore
from estimax.serving.manager import ModelManager, VersionPolicy
from estimax.serving.poller import Poller

log = logging.getLogger(__name__)

# The largest --model_config_file read: 64 MiB holds some 500,000 models' configs.
MAX_CONFIG_BYTES = 64 << 20


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
    names: set[str] = set()  # a set: a config of 20,000 models is checked in linear time
    for i, model in enumerate(config.model_config_list.config):
        if not model.name or not model.base_path:
            raise ConfigError(f"{where}: config {i} needs a name and a base_path")
        check_name(model.name, f"{where}: config {i}")
        if model.name in names:
            # TF Serving's message (ValidateModelConfigList).
            raise ConfigError(
                f"{where}: Illegal to list model {model.name} multiple times in config list"
            )
        names.add(model.name)
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


def check_name(name: str, where: str) -> None:
    """Raises ConfigError (naming ``where``) for a model name that is not URL-safe.

    The one rule for every name (``--model_config_file``, ``--model_name``, ``--load_model``,
    ``HandleReloadConfigRequest``, a v2 load): ``NAME_RULE``, RFC 3986's unreserved characters
    (ASCII letters, digits, ``_``, ``.``, ``-``, ``~``), beginning with a letter or a digit.
    A name is a path segment (``/v1/models/NAME:predict``, ``/v2/models/NAME/infer``) that
    every client writes unescaped: ``/`` or ``\\`` (even sent as ``%2F``: the server decodes it
    before routing), ``.``/``..`` (dot segments URL clients resolve away) would serve a model
    no URL addresses (``../../etc``); a space, ``?``, ``#``, ``%``, a control character (which
    would forge the server's log lines) or a letter outside ASCII must be escaped by each
    client, and some do not. Kubernetes' and Triton's model names fit the rule.
    """
    if _NAME.fullmatch(name):
        return
    bad = sorted({c for c in name if not _NAME_CHAR.fullmatch(c)})
    if not name:
        why = "it is empty"
    elif not name.isprintable():  # CR/LF would forge the log's lines, ESC drive a terminal
        why = "it holds a control character (CR, LF, ESC or another non-printable one)"
    elif bad:
        why = "it holds " + ", ".join(repr(c) for c in bad[:8])
    else:
        why = f"it begins with {name[0]!r}"
    raise ConfigError(
        f"{where}: model name {name[:80]!r} is not URL-safe (a name is a segment of "
        f"/v1/models/NAME:predict): {why}; give a name of ASCII letters, digits, '_', '.', "
        "'-' or '~', beginning with a letter or a digit"
    )


# The model name rule (``check_name``).
NAME_RULE = r"[A-Za-z0-9][A-Za-z0-9_.~-]*"
_NAME = re.compile(NAME_RULE)
_NAME_CHAR = re.compile(r"[A-Za-z0-9_.~-]")


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


def read_config(path: str, max_bytes: int = MAX_CONFIG_BYTES) -> list[ModelConfig]:
    """``--model_config_file`` -> its models; ConfigError (one line naming the flag) if bad."""
    return parse_config(read_config_text(path, max_bytes), f"--model_config_file={path}")


def read_config_text(path: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """``--model_config_file``'s text; ConfigError (one line naming the flag) if unreadable.

    A regular file of at most ``max_bytes`` only: a FIFO (whose open would wait for a writer
    for ever), a device (``/dev/zero``, endless) or a socket, directly or through a symlink, is
    refused unread, and so is a larger file. Opened without blocking, then checked again, so a
    FIFO put in its place between the two checks cannot block either.
    """
    flag = f"--model_config_file={path}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"{flag}: not a regular file (a FIFO, device, socket or folder)")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{flag}: not a regular file (a FIFO, device or socket)")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read it: {e.strerror}") from None
    if len(data) > max_bytes:
        raise ConfigError(
            f"{flag}: larger than {max_bytes} bytes; a model config is text of a few hundred "
            "bytes per model"
        )
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{flag}: not a text file") from None


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
        log.info("HandleReloadConfigRequest: serving %s", ", ".join(repr(c.name) for c in configs))
        return self.apply(configs)

    def _apply(self, new: dict[str, ModelConfig]) -> list[str]:
        changes: list[str] = []
        refused: list[str] = []
        old = self.configs
        served = dict(new)  # what is served after this: a refused base_path keeps the old one
        for name in old:
            if name not in new:
                self._close(self.core.remove(name))
                changes.append(f"removed model {name}")
        for name, config in new.items():
            before = old.get(name)
            if before is None:
                manager = self._make(config)
                try:
                    self.core.add(manager)
                except ValueError as e:  # its config.json (estimax.serving.model_settings)
                    del served[name]
                    refused.append(f"model {name!r} not added: {e}")
                    continue
                manager.start()  # its first poll loads the policy's versions
                self.core.name = self.core.name or name
                changes.append(f"added model {name} from {config.base_path}")
            elif before.base_path != config.base_path:
                why = self._replace(before, config)
                if why:
                    served[name] = before
                    refused.append(why)
                else:
                    changes.append(f"model {name} now from {config.base_path}")
            elif before.policy != config.policy:
                manager = self.core.models[name].manager
                manager.policy = config.policy
                manager.poll()  # now, not at its next poll (which may be never)
                changes.append(f"model {name}: version policy {config.policy.json()}")
        self.configs = served
        self.labels_applied = False
        changes += self._set_labels(served)
        self.labels_applied = True
        if refused:
            if changes:
                log.info("model config partly applied: %s", "; ".join(changes))
            raise ConfigError("; ".join(refused))
        return changes

    def _replace(self, before: ModelConfig, config: ModelConfig) -> str:
        """Serves ``config``'s new ``base_path`` in place of ``before``'s, once it has a version
        available; returns why not ("": done), the old model serving on.

        The new versions load (and warm) while the old ones answer every request: the model
        is swapped in one step, never absent (no 404 while the new path loads). A path with
        no version that loads keeps the old one served; it is tried again at the next apply.
        """
        name = config.name
        keeps = f"still serving model {name!r} from {before.base_path}"
        try:
            if not list_versions(config.base_path):
                raise FileNotFoundError(f"{config.base_path} holds no version")
        except (OSError, ValueError) as e:
            return f"model {name!r}: new base_path {config.base_path}: {e}; {keeps}"
        manager = self._make(config)
        try:
            model = self.core.prepare(manager)
        except ValueError as e:  # its config.json (estimax.serving.model_settings)
            return f"model {name!r}: new base_path {config.base_path}: {e}; {keeps}"
        manager.poll()  # loads the new path's versions while the old ones serve
        if not manager.ready():
            errors = [f"version {s.version}: {s.error}" for s in manager.states() if s.error]
            why = "; ".join(errors) or manager.last_poll_error or "no version became available"
            self._close(model)
            where = f"model {name!r}: new base_path {config.base_path}"
            return f"{where}: no version loads ({why}); {keeps}"
        replaced = self.core.models.get(name)
        self.core.publish(model)  # from now on requests take the new versions
        self._close(replaced)
        manager.start(poll_now=False)  # its first poll has run
        return ""

    @staticmethod
    def _close(model: ServedModel | None) -> None:
        """Unloads a model no longer served (after the requests holding its versions)."""
        if model is not None:
            model.manager.close()
            if model.batcher is not None:
                model.batcher.close_soon()  # its queue is empty: they have ended

    # One model at a time, for model control (``estimax.serving.control``).
    close_model = _close

    def new_manager(self, config: ModelConfig) -> ModelManager:
        """A new (not started) manager for ``config``."""
        return self._make(config)

    def put(self, config: ModelConfig, model: ServedModel) -> ServedModel | None:
        """Serves ``model`` (``ServingCore.prepare``'s, loaded) as ``config``'s model in one
        step, its labels set; returns the model it replaced (to be closed), if any."""
        with self._lock:
            model.labels = dict(config.labels)
            replaced = self.core.models.get(config.name)
            self.core.publish(model)
            self.core.name = self.core.name or config.name
            self.configs = {**self.configs, config.name: config}
            return replaced

    def drop(self, name: str) -> ServedModel | None:
        """Stops serving model ``name`` (404 from now on); returns it, to be closed."""
        with self._lock:
            self.configs = {n: c for n, c in self.configs.items() if n != name}
            return self.core.remove(name)

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
        # The text last served whole, and the registry's configs it gave: the same text at the
        # next poll, nothing else applied meanwhile (HandleReloadConfigRequest), is not parsed
        # again (20,000 models: seconds of parsing at every poll otherwise).
        self._served: tuple[str, dict[str, ModelConfig]] | None = None

    def poll(self) -> None:
        """Reads the file once; applies it if it changed (or its labels were refused)."""
        registry = self.registry
        try:
            text = read_config_text(self.path)
            if self._served is not None and registry.labels_applied:
                served_text, served_configs = self._served
                if text == served_text and registry.configs is served_configs:
                    self._last_error = ""
                    return
            configs = parse_config(text, f"--model_config_file={self.path}")
            if {c.name: c for c in configs} == registry.configs and registry.labels_applied:
                self._served = (text, registry.configs)
                self._last_error = ""
                return
            changes = registry.apply(configs)
            self._served = (text, registry.configs)
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
