"""Which checkpoint variable initialises which model variable, for any model (warm starts, the
``--model_fn`` conversion, ``Estimator.get_variable_names``).

A model's variables are named as TensorFlow named a graph's: the Flax path inside its collection,
joined by ``/`` (``bert/encoder/layer_0/attention/self/query/kernel``): no collection
(``params/``) and no name for the module the Estimator runs a ``model_fn`` in (it is the root, so
Flax gives it none). A module created in the ``model_fn`` is named as its ``name=`` says
(``BertModel(config, name="bert")``), else by Flax's auto-name (``BertModel_0``).

Where a variable's value comes from, first match first (``plan``):

1. ``var_name_to_prev_var_name[name]`` (tf.estimator's ``WarmStartSettings``): that name.
2. ``assignment_map`` (``tf.compat.v1.train.init_from_checkpoint``'s, checkpoint name -> model
   name): an entry naming the variable (``{"old/var": "new/var"}``), else the entry of the
   innermost scope holding it (``{"bert/": "bert/"}``: ``bert/x`` <- ``bert/x``; ``{"/":
   "scope/"}``: ``scope/x`` <- the checkpoint's root ``x``; ``{"old/": "new/"}``: ``new/x`` <-
   ``old/x``).
3. A registered network's TensorFlow names (``estimax.models.TF_NAMES``: ResNet, Inception),
   for its variables.
4. The variable's own name.

Names derived from a scope (2) or from a variable's own name (4) are looked up after ``rename``,
which turns each checkpoint name into the model's convention (``{"LayerNorm/gamma":
"LayerNorm/scale"}``: whole ``/``-separated parts; or a callable). Names given one by one (1 and
the exact form of 2) are the checkpoint's own. Those (1, 2) must exist and fit, as
``init_from_checkpoint`` required; the others (3, 4) are loaded where they do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from estimax import models
from estimax.migrate.load import (
    BOOKKEEPING,
    SLOT_SUFFIXES,
    STRIPPED_PREFIXES,
    MappingError,
    model_scope,
)
from estimax.migrate.names import TFNames
from estimax.migrate.tf_checkpoint import DTYPES, CheckpointReader, TFCheckpointError

__all__ = [
    "ArraySource",
    "AssignmentMap",
    "Planned",
    "Rename",
    "Source",
    "TFSource",
    "Variable",
    "WarmStartError",
    "assignment_pairs",
    "exact_cast",
    "is_model_tensor",
    "model_variables",
    "plan",
    "registered_names",
    "renamer",
]

# init_from_checkpoint's assignment_map: a dict, or pairs (one checkpoint variable may then
# initialise several model variables).
AssignmentMap = Mapping[str, str] | Sequence[tuple[str, str]]
# Checkpoint name -> the model's convention: whole-part substitutions, or a function.
Rename = Mapping[str, str] | Callable[[str], str]


class WarmStartError(TFCheckpointError):
    """A warm start's settings do not fit the model or the checkpoint (one line per problem)."""


@dataclasses.dataclass(frozen=True)
class Variable:
    """One of a model's variables.

    Attributes:
      name: its TensorFlow-style name (``bert/embeddings/word_embeddings``).
      collection: ``params`` (trainable), ``batch_stats``...
      path: the keys inside that collection.
    """

    name: str
    collection: str
    path: tuple[str, ...]

    @property
    def trainable(self) -> bool:
        """In TensorFlow's TRAINABLE_VARIABLES: what the optimizer updates."""
        return self.collection == "params"


def _leaves(tree: Any, prefix: tuple[str, ...] = ()) -> Iterable[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, (*prefix, str(key)))
    else:
        yield prefix, tree


def model_variables(variables: Mapping[str, Any]) -> dict[str, Variable]:
    """``{name: Variable}`` of ``{"params": ..., <collection>: ...}``, sorted by name.

    Raises:
      WarmStartError: two collections hold a variable at the same path (one name for two).
    """
    found: dict[str, Variable] = {}
    clashes = []
    for collection in sorted(variables, key=lambda c: (c != "params", c)):
        for path, _ in _leaves(variables[collection]):
            name = "/".join(path)
            if name in found:
                clashes.append(f"{found[name].collection}/{name} and {collection}/{name}")
                continue
            found[name] = Variable(name, collection, path)
    if clashes:
        raise WarmStartError(f"variables of two collections have one name: {', '.join(clashes)}")
    return dict(sorted(found.items()))


def is_model_tensor(name: str) -> bool:
    """False for a checkpoint's step, optimizer slots and accumulators (not a model's variable)."""
    return name not in BOOKKEEPING and name.rsplit("/", 1)[-1] not in SLOT_SUFFIXES


def renamer(rename: Rename | None) -> Callable[[str], str]:
    """``rename`` as a function of a checkpoint name.

    A mapping replaces whole ``/``-separated parts, each pair in turn: ``{"LayerNorm/gamma":
    "LayerNorm/scale"}`` turns ``a/LayerNorm/gamma`` into ``a/LayerNorm/scale``, never
    ``a/MyLayerNorm/gamma``.
    """
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    pairs = [(f"/{old.strip('/')}/", f"/{new.strip('/')}/") for old, new in rename.items()]

    def substitute(name: str) -> str:
        framed = f"/{name}/"
        for old, new in pairs:
            framed = framed.replace(old, new)
        return framed[1:-1]

    return substitute


def assignment_pairs(assignment_map: AssignmentMap | None) -> list[tuple[str, str]]:
    """``assignment_map`` as ``(checkpoint name, model name)`` pairs.

    Raises:
      WarmStartError: neither a mapping nor a sequence of string pairs.
    """
    if assignment_map is None:
        return []
    items = assignment_map.items() if isinstance(assignment_map, Mapping) else assignment_map
    pairs = []
    for item in items:
        if (
            not isinstance(item, Sequence)
            or isinstance(item, str)
            or len(item) != 2
            or not all(isinstance(x, str) for x in item)
        ):
            raise WarmStartError(
                f"assignment_map: {item!r} is not a (checkpoint name, model name) pair of strings"
            )
        pairs.append((item[0], item[1]))
    return pairs


class Source(Protocol):
    """A checkpoint's variables: names (shapes, dtypes) and values."""

    location: str

    def tensors(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{name: (shape, dtype)}`` of every variable in it."""
        ...

    def get(self, name: str) -> np.ndarray:
        """The value of ``name``."""
        ...


class TFSource:
    """A TensorFlow checkpoint, by the names its graph gave (``bfloat16/`` of TF <= 1.8 runs
    stripped, as the conversion strips it)."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.location = reader.prefix
        self._real = {_strip(n): n for n in reader.variables()}

    def tensors(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{name: (shape, dtype)}``; a dtype numpy has not (a string) as ``object``."""
        infos = self.reader.variables()
        return {
            name: (infos[real].shape, DTYPES.get(infos[real].dtype, np.dtype(object)))
            for name, real in self._real.items()
        }

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` (CRC-checked)."""
        return self.reader.get_tensor(self._real[name])


class ArraySource:
    """An estimax checkpoint's variables, by the names ``model_variables`` gives them."""

    def __init__(self, variables: Mapping[str, Any], location: str):
        self.location = location
        self._values = {
            v.name: np.asarray(_get(variables[v.collection], v.path))
            for v in model_variables(variables).values()
        }

    def tensors(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{name: (shape, dtype)}``."""
        return {n: (tuple(v.shape), v.dtype) for n, v in self._values.items()}

    def get(self, name: str) -> np.ndarray:
        """The value of ``name``."""
        return self._values[name]


def _strip(name: str) -> str:
    for prefix in STRIPPED_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def exact_cast(theirs: np.dtype, ours: np.dtype) -> bool:
    """True if every value of dtype ``theirs`` is exactly one of ``ours`` (float32 -> bfloat16
    is not: a warm-started value must equal the checkpoint's)."""
    try:
        return bool(np.can_cast(theirs, ours, "safe"))
    except TypeError:  # object (string) tensors
        return False


@dataclasses.dataclass(frozen=True)
class Planned:
    """Where one model variable's value comes from.

    Attributes:
      variable: the model's variable.
      wanted: the checkpoint name looked for (None: no entry of the assignment map covers it,
        with ``only_mapped``).
      source: the checkpoint's name found for it (None: the checkpoint has none).
      explicit: named one by one or under a mapped scope: it must exist and fit.
      reshape: a registered map's reshape (a 1x1 conv kernel for a dense one).
    """

    variable: Variable
    wanted: str | None
    source: str | None
    explicit: bool = False
    reshape: bool = False


def _scope_name(ckpt: str, current: str, name: str) -> str | None:
    """The checkpoint name of model variable ``name`` under the pair ``(ckpt, current)``
    (``init_from_checkpoint``'s scope rule), or None if ``name`` is not under ``current``."""
    scope = current[: current.rindex("/")]
    if scope and not name.startswith(scope + "/"):
        return None
    rest = name[len(scope) :]
    if current != "/":
        rest = rest[1:]
    full = rest if ckpt == "/" else ckpt + rest
    return full[:-1] if full.endswith("/") else full


def plan(
    variables: Mapping[str, Variable],
    checkpoint: Iterable[str],
    *,
    assignment_map: AssignmentMap | None = None,
    prev_names: Mapping[str, str] | None = None,
    rename: Rename | None = None,
    registered: Mapping[str, tuple[str, bool]] | None = None,
    only_mapped: bool = False,
    purpose: str = "to warm-start",
) -> tuple[list[Planned], list[str]]:
    """Each variable's checkpoint name (the module docstring's order), and the problems.

    Args:
      variables: the model's variables to plan for (``model_variables``, perhaps a selection).
      checkpoint: the checkpoint's variable names.
      assignment_map: init_from_checkpoint's map, checkpoint name -> model name or scope.
      prev_names: tf.estimator's ``var_name_to_prev_var_name``, model name -> checkpoint name.
      rename: checkpoint names -> the model's convention (``renamer``).
      registered: a registered network's ``{model name: (TensorFlow name, reshape)}``.
      only_mapped: plan only what ``assignment_map`` or ``prev_names`` covers, as
        init_from_checkpoint loaded only what its map named (the rest: ``wanted`` None).
      purpose: what the variables are for, in the problem lines ("matches no variable
        to warm-start").

    Returns:
      ``(planned, problems)``: ``problems`` are lines (``"matches no variable: ..."``), one per
      kind; the caller raises them.
    """
    names = set(checkpoint)
    renamed, clashes = _renamed(names, rename)
    pairs = assignment_pairs(assignment_map)
    prev = dict(prev_names or {})
    registered = registered or {}

    exact = {current: ckpt for ckpt, current in pairs if current in variables}
    others = [(ckpt, current) for ckpt, current in pairs if current not in variables]
    # init_from_checkpoint's scope form: both sides end in "/" ("/" alone: the root).
    scopes = [(c, m) for c, m in others if c.endswith("/") and m.endswith("/")]
    covered: dict[tuple[str, str], int] = dict.fromkeys(scopes, 0)
    mixed = [f"{c!r}: {m!r}" for c, m in others if c.endswith("/") != m.endswith("/")]
    lone = [f"{c!r}: {m!r}" for c, m in others if not c.endswith("/") and not m.endswith("/")]

    planned = []
    for var in variables.values():
        # A derived name is in the model's convention (renamed first); a given one is the
        # checkpoint's own.
        wanted, derived, explicit, reshape = _wanted(
            var.name, prev, exact, scopes, covered, only_mapped, registered
        )
        order = (
            (renamed.get(wanted), wanted if wanted in names else None) if wanted is not None else ()
        )
        found = next((n for n in (order if derived else order[::-1]) if n is not None), None)
        planned.append(Planned(var, wanted, found, explicit=explicit, reshape=reshape))

    nothing = [f"var_name_to_prev_var_name {n!r}" for n in sorted(prev) if n not in variables]
    nothing += [f"assignment_map {item}" for item in lone]
    nothing += [f"assignment_map {c!r}: {m!r}" for (c, m), n in covered.items() if n == 0]
    return planned, _problems(nothing, mixed, clashes, purpose)


def _wanted(
    name: str,
    prev: dict[str, str],
    exact: dict[str, str],
    scopes: list[tuple[str, str]],
    covered: dict[tuple[str, str], int],
    only_mapped: bool,
    registered: Mapping[str, tuple[str, bool]],
) -> tuple[str | None, bool, bool, bool]:
    """``(wanted, derived, explicit, reshape)`` of model variable ``name``: the checkpoint name
    looked for (the module docstring's order: prev_names, an exact map entry, the innermost
    mapped scope, nothing with ``only_mapped``, a registered network's name, the name itself),
    whether it is derived (in the model's convention) rather than given, ``Planned.explicit``
    and ``Planned.reshape``."""
    if name in prev:
        return prev[name], False, True, False
    if name in exact:
        return exact[name], False, True, False
    scoped = _innermost_scope(scopes, name, covered)
    if scoped is not None:
        return scoped, True, True, False
    if only_mapped:
        return None, True, False, False
    if name in registered:
        tf_name, reshape = registered[name]
        return tf_name, False, False, reshape
    return name, True, False, False


def _renamed(names: set[str], rename: Rename | None) -> tuple[dict[str, str], list[str]]:
    """``{name in the model's convention: checkpoint name}`` under ``rename`` (the first in
    sorted order kept), and a line for each checkpoint name that renames onto a kept one."""
    to_model = renamer(rename)
    renamed: dict[str, str] = {}
    clashes = []
    for name in sorted(names):
        theirs = to_model(name)
        if theirs in renamed:
            clashes.append(f"{renamed[theirs]} and {name} -> {theirs}")
        renamed.setdefault(theirs, name)
    return renamed, clashes


def _innermost_scope(
    scopes: list[tuple[str, str]], name: str, covered: dict[tuple[str, str], int]
) -> str | None:
    """The checkpoint name of model variable ``name`` under the innermost of ``scopes`` (pairs
    of checkpoint scope, model scope) that holds it; None if none does. Counts in ``covered``
    each scope that holds it (a scope that holds nothing is a problem)."""
    best: tuple[int, str] | None = None
    for ckpt, current in scopes:
        full = _scope_name(ckpt, current, name)
        if full is None:
            continue
        covered[(ckpt, current)] += 1
        if best is None or len(current) > best[0]:  # the innermost scope wins
            best = (len(current), full)
    return None if best is None else best[1]


def _problems(nothing: list[str], mixed: list[str], clashes: list[str], purpose: str) -> list[str]:
    """``plan``'s problem lines, one per kind: map entries that match no variable, scopes
    mapped to variables (or back), and checkpoint names ``rename`` merges."""
    problems = []
    if nothing:
        problems.append(f"matches no variable {purpose}: {', '.join(nothing)}")
    if mixed:
        problems.append(
            "assignment_map maps a scope to a scope (both ending in '/', as 'bert/': 'bert/') "
            f"or a variable to a variable, not one to the other: {', '.join(mixed)}"
        )
    if clashes:
        problems.append(f"rename gives two checkpoint variables one name: {', '.join(clashes)}")
    return problems


def registered_names(
    variables: Mapping[str, Any], names: TFNames | None = None
) -> dict[str, tuple[str, bool]]:
    """``{variable name: (TensorFlow name, reshape)}`` of a registered network found in
    ``variables`` (``names``, else the first of ``estimax.models.TF_NAMES`` whose scope marker
    is there); empty if none is."""
    params = variables["params"]
    for candidate in [names] if names is not None else list(models.TF_NAMES):
        try:
            scope = model_scope(params, candidate)
        except MappingError:
            continue
        inner = {c: _get(v, scope) for c, v in variables.items() if c in ("params", "batch_stats")}
        return {
            "/".join((*scope, *e.path)): (e.tf_name, e.reshape) for e in candidate.entries(inner)
        }
    return {}
