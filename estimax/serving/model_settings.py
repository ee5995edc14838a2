"""Per-model settings: a model's response cache and priority levels, in Triton's field names.

Triton configures both per model (``ModelConfig.response_cache { enable }`` and
``dynamic_batching { priority_levels, default_priority_level }``); so does estimax, from three
sources, the first that gives a field winning:

1. the v2 load request's ``parameters.config`` (a JSON model config, Triton's override;
   ``estimax.serving.control``): for that load only, as Triton's;
2. ``<base_path>/config.json`` beside the model's numeric versions: a JSON object with
   Triton's JSON field names. JSON, not Triton's ``config.pbtxt``: parsing a text
   ``ModelConfig`` needs tritonclient's ``model_config_pb2``, which the server does not
   depend on (tritonclient is a test tool here). Read at each load of the model;
3. the server's flags, the defaults for every model: ``--response_cache_models``,
   ``--priority_levels``, ``--default_priority_level``.

For example ``{"response_cache": {"enable": true}, "dynamic_batching": {"priority_levels": 5,
"default_priority_level": 5}}``. A model that gives ``priority_levels`` but no
``default_priority_level`` takes the server's default level, or its own lowest level if the
server's is beyond it. The cache's bound stays the server's (``--response_cache_bytes``), and a
version that declares random answers (``"random": true`` in its ``serving.json``) is never
cached, whatever its model's config asks (``estimax.serving.response_cache``).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from typing import Any

import fsspec

from estimax.serving.options import ServerOptions
from estimax.serving.protocol import cut

__all__ = ["FILE", "ModelSettings", "parse", "read_file", "resolve"]

# The per-model file in a model's base path.
FILE = "config.json"
# The largest per-model file read (a config is a few hundred bytes).
MAX_FILE_BYTES = 1 << 20
# The fields of a model config that a per-model setting lives in (Triton's), and those of a
# model config read back from ``GET /v2/models/NAME/config`` (accepted and ignored here, so
# that a config read back can be saved as the file).
FIELDS = ("response_cache", "dynamic_batching")
_BATCHING = ("priority_levels", "default_priority_level")
IGNORED = (
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "input",
    "output",
    "parameters",
    "version_policy",
)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """A model's effective settings (module docstring).

    Attributes:
      response_cache: whether its answers are cached (a random version's never are).
      priority_levels: its levels, 1 the highest; a request's ``parameters.priority`` is
        refused above it.
      default_priority_level: the level of a request without a priority.
    """

    response_cache: bool = False
    priority_levels: int = 3
    default_priority_level: int = 2


def integer(value: Any, where: str, least: int = 1) -> int:
    """``value``, a config's integer field, checked ``>= least``.

    Raises:
      ValueError: one line naming ``where``.
    """
    # Triton's JSON writes its uint64 fields as strings: both are taken.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{where} must be an integer >= {least}, not {cut(json.dumps(value))}")
    return value


def parse(fields: dict[str, Any], where: str, batching_also: tuple[str, ...] = ()) -> dict:
    """The per-model settings a model config (a JSON object) gives: a dict of those of
    ``response_cache``, ``priority_levels``, ``default_priority_level`` it sets.

    ``batching_also``: other ``dynamic_batching`` fields the caller takes (not checked here).

    Raises:
      ValueError: one line naming ``where`` and the field: not Triton's shape, a value of the
        wrong type or out of range.
    """
    out: dict[str, Any] = {}
    if "response_cache" in fields:
        cache = fields["response_cache"]
        if not isinstance(cache, dict) or set(cache) - {"enable"}:
            raise ValueError(f'{where}: response_cache must be {{"enable": true}} or false')
        enable = cache.get("enable", False)  # proto3 JSON leaves a false out
        if not isinstance(enable, bool):
            raise ValueError(
                f"{where}: response_cache.enable must be true or false, not "
                f"{json.dumps(enable)[:40]}"
            )
        out["response_cache"] = enable
    if "dynamic_batching" in fields:
        batching = fields["dynamic_batching"]
        taken = (*_BATCHING, *batching_also)
        if not isinstance(batching, dict) or set(batching) - set(taken):
            unknown = sorted(set(batching) - set(taken)) if isinstance(batching, dict) else []
            raise ValueError(
                f"{where}: dynamic_batching takes {', '.join(taken)}"
                + (f" (not {', '.join(repr(u)[:40] for u in unknown)})" if unknown else "")
            )
        for name in _BATCHING:
            if name in batching:
                out[name] = integer(batching[name], f"{where}: dynamic_batching.{name}")
    return out


def read_file(base_path: str) -> dict[str, Any]:
    """The settings ``<base_path>/config.json`` gives (``{}``: no such file).

    Raises:
      ValueError: one line naming the file: unreadable, not JSON, an unknown field, a bad
        value.
    """
    where = posixpath.join(base_path.rstrip("/"), FILE)
    try:
        fs, path = fsspec.core.url_to_fs(where)
        if not fs.exists(path):
            return {}
        info = fs.info(path)
        if info.get("type", "file") != "file" or (info.get("size") or 0) > MAX_FILE_BYTES:
            raise ValueError(f"{where}: not a regular file of at most {MAX_FILE_BYTES} bytes")
        with fs.open(path, "rb") as f:
            text = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({e})") from None
    try:
        fields = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: must be a JSON object (a model config, Triton's names)")
    unknown = sorted(set(fields) - set(FIELDS) - set(IGNORED))
    if unknown:
        raise ValueError(
            f"{where}: unknown fields {[str(u)[:40] for u in unknown]}; it takes "
            f"{', '.join(FIELDS)} (and ignores {', '.join(IGNORED)})"
        )
    # A config read back from the server holds the queue's fields: taken, and ignored here
    # (the queue delay is --batch_timeout_micros, or a load's override).
    return parse(
        fields, where, batching_also=("max_queue_delay_microseconds", "preferred_batch_size")
    )


def resolve(name: str, options: ServerOptions, *layers: dict[str, Any]) -> ModelSettings:
    """Model ``name``'s effective settings: each field from the first of ``layers`` (the
    override's, the file's) that gives it, else the server's flags.

    Raises:
      ValueError: the effective default level is outside the effective levels, naming both.
    """
    given: dict[str, Any] = {}
    for layer in reversed(layers):
        given.update(layer)
    levels = given.get("priority_levels", options.priority_levels)
    default = given.get("default_priority_level")
    if default is None:
        default = min(options.default_priority_level, levels)
    if not 1 <= default <= levels:
        raise ValueError(
            f"model {name!r}: dynamic_batching.default_priority_level={default} is outside its "
            f"priority_levels={levels} (give 1 to {levels})"
        )
    return ModelSettings(
        response_cache=given.get("response_cache", name in options.response_cache_models),
        priority_levels=levels,
        default_priority_level=default,
    )
