"""The original's ``--config_file`` and ``--params_override`` (``params_dict``) on estimax's flags.

From 2019 the original's ResNet (and its later programs) started from Python defaults
(``configs/resnet_config.py``) and took, in this order (``resnet_main.py``'s ``main``)::

    params = params_dict.override_params_dict(params, FLAGS.config_file, is_strict=True)
    params = params_dict.override_params_dict(params, FLAGS.params_override, is_strict=True)
    params = flags_to_params.override_params_from_input_flags(params, FLAGS)

so a value comes from, lowest first: the defaults < ``--config_file`` (a YAML file, such as
``configs/cloud/v3-8.yaml``; ``--hparams_file`` was its 2019-04 name) < ``--params_override`` (a
YAML/JSON string, ``key=value,...`` or a YAML file) < the flags given explicitly. estimax keeps
that order, with the environment (``ESTIMAX_<FLAG>``, ``cli.apply_environment``) counted as
given explicitly, just below the command line.

Each program lists the keys its original's params had (``ConfigKeys``: a dotted key such as
``train_batch_size`` or ``train.train_batch_size`` to what estimax does with it):

* ``Flag(name)``: sets estimax's flag ``--name``.
* ``Unused(why)``: accepted and logged (INFO) with ``why``: the key had no effect the estimax
  program could have.
* ``OnlyDefault(value, why)``: a feature estimax's program does not build; the original's
  default (``value``, or any "off" value when that is off) is accepted, any other value refused.

Any other key is refused in one line naming the key and the file, as ``is_strict=True`` refused it
(``KeyError: The key `x` does not exist``). ``--print_config`` prints every flag's value and where
it came from, and exits without training.
"""

from __future__ import annotations

import dataclasses
import difflib
import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec
import yaml
from absl import flags, logging

from estimax.programs import flagspec
from estimax.programs.cli import UsageError

__all__ = [
    "FLAGS",
    "ConfigKeys",
    "Effective",
    "Flag",
    "OnlyDefault",
    "Unused",
    "apply",
    "format_effective",
    "read_override",
    "read_yaml_file",
]

FLAGS = (
    flagspec.Str(
        "config_file",
        None,
        "The original's --config_file: a YAML file of the original's params (such as its "
        "configs/cloud/v3-8.yaml; local, gs:// or s3://) setting this program's flags. Order, "
        "lowest first: defaults < --config_file < --params_override < ESTIMAX_<FLAG> < flags "
        "on the command line. A key the original did not have is refused.",
    ),
    flagspec.Str(
        "hparams_file",
        None,
        "The original's 2019-04 name of --config_file (the same YAML keys).",
    ),
    flagspec.Str(
        "params_override",
        None,
        "The original's --params_override: a YAML/JSON string ('{\"train_batch_size\": 4096}', "
        "'train_steps: 1000'), key=value pairs ('train_steps=1000,train_batch_size=4096') or a "
        "YAML file, applied over --config_file; flags on the command line still win.",
    ),
    flagspec.Bool(
        "print_config",
        False,
        "Print every flag's effective value and where it came from (default, config file, "
        "params_override, environment or command line), then exit without training.",
    ),
)


@dataclasses.dataclass(frozen=True)
class Flag:
    """The key sets estimax's flag ``--name``."""

    name: str


@dataclasses.dataclass(frozen=True)
class Unused:
    """The key is accepted and logged: ``why`` it has no estimax meaning."""

    why: str


@dataclasses.dataclass(frozen=True)
class OnlyDefault:
    """A feature estimax does not build: only the original's default ``value`` is accepted."""

    value: Any
    why: str


ConfigKeys = Mapping[str, Flag | Unused | OnlyDefault]

# Where a value came from, as --print_config names it.
DEFAULT, PARAMS_OVERRIDE, COMMAND_LINE = "default", "params_override", "command line"


@dataclasses.dataclass(frozen=True)
class Effective:
    """The flags' values after the config file and the override, and where each came from.

    Attributes:
      values: ``{flag name: (value, source)}``; a source is ``default``, ``config file PATH``,
        ``params_override``, ``$VARIABLE`` (the environment) or ``command line``.
      other_keys: ``{key: (value, source, note)}`` of the keys that set no flag (``Unused``,
        ``OnlyDefault``).
    """

    values: dict[str, tuple[Any, str]]
    other_keys: dict[str, tuple[Any, str, str]]


class _Loader(yaml.SafeLoader):
    """YAML as the original's params_dict read it: ``1e-4`` is a float (YAML 1.1 wants a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$""",
        re.X,
    ),
    list("-+0123456789."),
)

# params_dict's key=value form: "a=1, b='x', c.d=[1, 2]" (its _PARAM_RE).
_PAIR = re.compile(
    r"""(?P<name>[a-zA-Z][\w.]*)\s*=\s*
    (?P<val>'[^']*'|"[^"]*"|\[[^\]]*\]|[^,\[]*)
    ($|,\s*)""",
    re.X,
)


def _load_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader: no Python objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UsageError(f"{where}: not valid YAML/JSON{at}: {problem}.") from None


def read_yaml_file(flag: str, path: str) -> dict[str, Any]:
    """The mapping of the YAML file ``path`` given as ``--flag``.

    Raises:
      UsageError: the path is empty, missing (an unset variable is named when the path sits
        directly under ``/``), unreadable, not YAML, or not a mapping.
    """
    where = f"--{flag}={path}"
    if not path.strip():
        raise UsageError(
            f"--{flag} is empty: an environment variable in the command line is probably "
            f"unset. Give --{flag} a YAML file or leave the flag out."
        )
    try:
        fs, fs_path = fsspec.core.url_to_fs(path)
        with fs.open(fs_path, "r") as f:
            text = f.read()
    except FileNotFoundError:
        hint = ""
        if "://" not in path and posixpath.dirname(path.rstrip("/")) == "/":
            hint = (
                f" (it is directly under /: a variable in the command line, such as "
                f"$CONFIG_DIR in --{flag}=$CONFIG_DIR/{posixpath.basename(path)}, is probably "
                "unset)"
            )
        raise UsageError(f"{where}: no such file{hint}.") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{where}: cannot read it: {e}") from None
    data = _load_yaml(text, where)
    if data is None:
        return {}  # an empty file overrides nothing, as in the original
    if not isinstance(data, dict):
        raise UsageError(f"{where}: holds a {type(data).__name__}, not a mapping of keys.")
    return data


def _pairs(text: str) -> dict[str, Any] | None:
    """``key=value,...`` as ``{dotted key: value}``; None if ``text`` is not of that form."""
    out: dict[str, Any] = {}
    pos = 0
    while pos < len(text):
        m = _PAIR.match(text, pos)
        if not m or m.end() == pos:
            return None
        pos = m.end()
        value = m.group("val")
        if re.match(r"[a-z0-9]+://", value):  # a URL is a string, as params_dict quoted it
            out[m.group("name")] = value
        else:
            out[m.group("name")] = _load_yaml(value, f"--params_override: {m.group('name')}")
    return out


def read_override(text: str) -> tuple[dict[str, Any], str]:
    """``--params_override``'s mapping and what it was (as params_dict's
    ``override_params_dict`` tried them: ``key=value`` pairs, then YAML/JSON, then a YAML file).

    Returns:
      ``(mapping, source)``, source ``params_override`` or ``params_override file PATH``.

    Raises:
      UsageError: not YAML, not a mapping and not a readable YAML file.
    """
    if not text.strip():
        raise UsageError(
            "--params_override is empty: an environment variable in the command line is "
            "probably unset. Give it a YAML/JSON mapping or leave the flag out."
        )
    pairs = _pairs(text)
    if pairs is not None:
        return pairs, PARAMS_OVERRIDE
    data = _load_yaml(text, f"--params_override={text!r}")
    if isinstance(data, dict):
        return data, PARAMS_OVERRIDE
    if isinstance(data, str) and "\n" not in text.strip():
        return read_yaml_file("params_override", text.strip()), f"params_override file {text}"
    raise UsageError(
        f"--params_override={text!r}: not a mapping of keys (give YAML/JSON such as "
        "'{\"train_batch_size\": 4096}', key=value pairs, or a YAML file)."
    )


def _flatten(data: Mapping[str, Any], keys: ConfigKeys, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}``: a nested mapping is followed unless its dotted key is a key."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in keys:
            out.update(_flatten(v, keys, f"{key}."))
        else:
            out[key] = v
    return out


def _unknown(key: str, where: str, program: str, keys: ConfigKeys) -> UsageError:
    close = difflib.get_close_matches(key, list(keys), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return UsageError(
        f"{where}: unknown key {key!r}: not a key of the original {program}'s params (its "
        f"params_dict refused it too: is_strict=True).{hint} The keys: docs/programs.md."
    )


def _off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == ""


def _check_only_default(key: str, spec: OnlyDefault, value: Any, where: str) -> None:
    if value == spec.value or (_off(spec.value) and _off(value)):
        return
    raise UsageError(
        f"{where}: {key}: {_yaml(value)}: {spec.why}; it takes only the original's default "
        f"({key}: {_yaml(spec.value)}). Remove the key or set it to {_yaml(spec.value)}."
    )


def _yaml(value: Any) -> str:
    """``value`` as YAML writes it (``null``, ``true``, ``'bn_relu'``, ``0.25``)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def _set(fv: flags.FlagValues, name: str, value: Any, key: str, where: str) -> None:
    flag = fv[name]
    if value is None and flag.default is not None:
        raise UsageError(f"{where}: {key}: null, but --{name} needs a value.")
    if value is not None and type(flag.parser) is flags.ArgumentParser:
        value = str(value)  # a string flag: YAML may have read 7 or True
    try:
        fv.set_default(name, value)
    except (flags.Error, ValueError, TypeError) as e:
        raise UsageError(f"{where}: {key}: {value!r} is not a valid --{name}: {e}") from None


def apply(
    fv: flags.FlagValues,
    program: str,
    keys: ConfigKeys,
    env_used: Mapping[str, str] | None = None,
    names: Iterable[str] | None = None,
) -> Effective:
    """Applies ``--config_file``/``--hparams_file`` then ``--params_override`` to ``fv``.

    A flag given on the command line, or set from the environment (``env_used``), keeps its
    value; the others take the override's value, else the config file's, else their default.

    Args:
      fv: the parsed flags (with ``FLAGS`` defined).
      program: the program's name (for the messages).
      keys: the program's table of the original's keys.
      env_used: ``{flag: variable}`` of the flags the environment set.
      names: the flags to report in ``Effective.values`` (default: every flag of ``fv``).

    Returns:
      The effective values and their sources.

    Raises:
      UsageError: a file is missing or not YAML, a key is unknown, a value is invalid for its
        flag, or a feature estimax lacks is asked for (one line each, naming the key).
    """
    if fv["config_file"].value is not None and fv["hparams_file"].value is not None:
        raise UsageError(
            "--config_file and --hparams_file are one setting (--hparams_file is its 2019 name): "
            "give one of them."
        )
    layers: list[tuple[dict[str, Any], str, str]] = []  # (mapping, source, where)
    for flag in ("config_file", "hparams_file"):
        path = fv[flag].value
        if path is not None:
            layers.append((read_yaml_file(flag, path), f"config file {path}", f"--{flag}={path}"))
    override = fv["params_override"].value
    if override is not None:
        data, source = read_override(override)
        layers.append((data, source, f"--params_override={override}"))

    chosen: dict[str, tuple[Any, str, str, str]] = {}  # flag -> (value, source, key, where)
    other: dict[str, tuple[Any, str, str]] = {}
    for data, source, where in layers:
        for key, value in _flatten(data, keys).items():
            spec = keys.get(key)
            if spec is None:
                raise _unknown(key, where, program, keys)
            if isinstance(spec, Flag):
                chosen[spec.name] = (value, source, key, where)
            elif isinstance(spec, OnlyDefault):
                _check_only_default(key, spec, value, where)
                other[key] = (value, source, spec.why)
            else:
                other[key] = (value, source, spec.why)
    for key, (value, source, why) in sorted(other.items()):
        logging.info("%s: %s: %r: not used by estimax: %s.", source, key, value, why)

    values: dict[str, tuple[Any, str]] = {}
    env_used = env_used or {}
    for name, (value, _, key, where) in chosen.items():
        if fv[name].present or name in env_used:
            continue  # an explicit flag wins, as in the original's flags_to_params
        _set(fv, name, value, key, where)
    for name in sorted(fv if names is None else names):
        if fv[name].present:
            source = COMMAND_LINE
        elif name in env_used:
            source = f"${env_used[name]}"
        elif name in chosen:
            source = chosen[name][1]
        else:
            source = DEFAULT
        values[name] = (fv[name].value, source)
    if chosen:
        logging.info(
            "From the config: %s",
            ", ".join(
                f"--{n}={fv[n].value} ({values[n][1] if n in values else 'given'})"
                for n in sorted(chosen)
            ),
        )
    return Effective(values, other)


def _show(name: str, value: Any) -> str:
    if value is None:
        return f"--{name} (unset)"  # not --name=, which would set an empty string
    if isinstance(value, bool):
        return f"--{name}={'true' if value else 'false'}"
    return f"--{name}={value}"


def format_effective(effective: Effective) -> str:
    """``--print_config``'s text: one ``--flag=value  # source`` line per flag (``--flag
    (unset)`` for None), then the keys that set no flag."""
    lines = [(_show(n, v), source) for n, (v, source) in effective.values.items()]
    width = max((len(line) for line, _ in lines), default=0) + 2
    out = [f"{line:<{width}}# {source}" for line, source in lines]
    for key, (value, source, why) in effective.other_keys.items():
        out.append(f"# {key}: {_yaml(value)} ({source}): not used by estimax: {why}")
    return "\n".join(out)
