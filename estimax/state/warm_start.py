"""Warm starts, as tf.estimator had them: a new run's variables from another model's checkpoint.

``Estimator(warm_start_from=PATH or WarmStartSettings(...))`` (and ``--warm_start_from`` on the
programs) calls ``warm_start`` once, on the freshly initialised state, and only when its
model_dir has no checkpoint of its own (a resumed run continues from its own).

The source is a TensorFlow checkpoint (a model_dir with a ``checkpoint`` file, a
``model.ckpt-N`` prefix or its ``.index``) of any model, or an estimax model_dir or
``<model_dir>/checkpoints/<step>``. Variables are matched by name (``estimax.migrate.assignment``:
a variable's Flax path written as TensorFlow wrote names, ``bert/encoder/layer_0/.../kernel``),
by ``var_name_to_prev_var_name`` and ``assignment_map`` (``init_from_checkpoint``'s), and for the
original ResNet and Inceptions by their registered TensorFlow names (``estimax.models.TF_NAMES``).
The optimizer state and the step start fresh (as tf.estimator's warm start); an EMA starts from
the loaded weights.

As strict as ``tf.compat.v1.train.warm_start``: every variable ``vars_to_warm_start`` selects
must be in the checkpoint (under the name the maps give it) with its shape and a dtype that holds
its values exactly, or the run stops before step 0 with one error naming them (the first
``SHOWN``, and how many more) and, for each, the closest checkpoint names (a prefix to strip or
add, said so). ``WarmStartSettings(allow_missing=True)`` keeps the variables the checkpoint lacks
as initialised, ``allow_shape_mismatch=True`` those of another shape or dtype (a new head), each
listed in a WARNING; a variable named one by one or under a mapped scope is always an error (as
``init_from_checkpoint``'s), and so is a warm start that loads nothing. What was loaded, and what
not and why, is logged.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from estimax import storage
from estimax.migrate.assignment import (
    ArraySource,
    AssignmentMap,
    Planned,
    Rename,
    Source,
    TFSource,
    Variable,
    WarmStartError,
    exact_cast,
    is_model_tensor,
    model_variables,
    plan,
    registered_names,
    renamer,
)
from estimax.migrate.load import copy_tree, set_path
from estimax.migrate.tf_checkpoint import CheckpointReader, TFCheckpointError, resolve_checkpoint

__all__ = ["WarmStartError", "WarmStartReport", "WarmStartSettings", "warm_start"]

ALL = ".*"
# Variables an error lists one by one (with their closest checkpoint names); the rest counted.
SHOWN = 10


@dataclasses.dataclass(frozen=True)
class WarmStartSettings:
    """What to warm-start from and how (``tf.estimator.WarmStartSettings``, plus
    ``init_from_checkpoint``'s ``assignment_map`` and a ``rename``).

    Attributes:
      ckpt_to_initialize_from: a TensorFlow checkpoint (model_dir, prefix or ``.index``) or
        an estimax model_dir or ``<model_dir>/checkpoints/<step>``; local, gs:// or s3://.
      vars_to_warm_start: as tf.estimator's. A regular expression (``re.match``ed against each
        variable's name, ``bert/encoder/layer_0/attention/self/query/kernel``): the trainable
        variables (``params``) it matches; the default ``".*"``: all of them, not batch
        statistics. A list of expressions: every variable any matches, batch statistics too
        (``[".*"]``: all). None: only what ``assignment_map`` or ``var_name_to_prev_var_name``
        names. For the original ResNet/Inception an expression may match the TensorFlow name
        (``dense/.*``) too.
      var_name_to_vocab_info: tf.estimator's vocabulary remapping: not supported (must be None).
      var_name_to_prev_var_name: ``{variable name: name in the checkpoint}``, as tf.estimator's.
      assignment_map: ``init_from_checkpoint``'s, checkpoint name -> variable name:
        ``{"bert/": "bert/"}`` (a scope, every variable under it), ``{"old/var": "new/var"}``,
        ``{"/": "scope/"}`` (the checkpoint's root into a scope), a dict or a list of pairs.
        Given a map, only what it (or ``var_name_to_prev_var_name``) covers is warm-started.
      rename: the checkpoint's names in the model's convention, applied before names derived
        from a scope or a variable's own name are looked up: ``{"LayerNorm/gamma":
        "LayerNorm/scale", "LayerNorm/beta": "LayerNorm/bias"}`` (whole ``/``-separated parts)
        or a function of the checkpoint name.
      allow_missing: a selected variable the checkpoint lacks keeps its initial value (listed in
        a WARNING) instead of stopping the run, as tf.estimator's ``ValueError: Tensor ... is
        not found`` did. Not for variables named one by one or under a mapped scope.
      allow_shape_mismatch: likewise for a selected variable the checkpoint holds in another
        shape or in a dtype that would not hold its values exactly (a new head: another number
        of classes). A warm start that loads nothing is an error either way.
    """

    ckpt_to_initialize_from: str
    vars_to_warm_start: str | Sequence[str] | None = ALL
    var_name_to_vocab_info: Mapping[str, Any] | None = None
    var_name_to_prev_var_name: Mapping[str, str] | None = None
    assignment_map: AssignmentMap | None = None
    rename: Rename | None = None
    allow_missing: bool = False
    allow_shape_mismatch: bool = False

    def selects(self, variable: Variable, *other_names: str) -> bool:
        """True if ``vars_to_warm_start`` takes ``variable`` (by its name or ``other_names``)."""
        return bool(self.matching(variable, (variable.name, *other_names)))

    def expressions(self) -> tuple[list[str], bool]:
        """``vars_to_warm_start``'s expressions, and whether they take trainable variables only
        (one string: tf.estimator's TRAINABLE_VARIABLES; a list: its GLOBAL_VARIABLES)."""
        chosen = self.vars_to_warm_start
        if chosen is None:
            return [], True
        if isinstance(chosen, str):
            return [chosen], True
        return list(chosen), False

    def matching(self, variable: Variable, names: Sequence[str]) -> list[str]:
        """The expressions of ``vars_to_warm_start`` that take ``variable``, matched against
        ``names`` (its name, and the TensorFlow name a registered network gives it)."""
        patterns, trainable_only = self.expressions()
        if trainable_only and not variable.trainable:
            return []
        return [p for p in patterns if any(re.match(p, n) for n in names)]

    def asks_for_all(self) -> bool:
        """Every variable wanted, none mapped: then a checkpoint variable left over is news."""
        return (
            self.vars_to_warm_start in (ALL, [ALL], (ALL,))
            and self.assignment_map is None
            and not self.var_name_to_prev_var_name
        )


@dataclasses.dataclass
class WarmStartReport:
    """What a warm start loaded and kept as initialised, by variable name.

    Attributes:
      source: the checkpoint read.
      loaded: the variables loaded.
      fresh: the variables kept as initialised (each for one of the reasons below).
      mismatched: of ``fresh``, those of another shape or dtype (``lines`` say which).
      missing: of ``fresh``, those the checkpoint lacks.
      sources: ``{variable: checkpoint name}`` of those loaded under another name.
      unused: the checkpoint's model variables nothing took.
      asked_for_all: every variable was wanted (so ``unused`` is worth a warning).
      lines: the mismatches, one per variable (``name [2, 3] float32 <- ckpt [2, 10] float32``).
    """

    source: str
    loaded: list[str] = dataclasses.field(default_factory=list)
    fresh: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    unused: list[str] = dataclasses.field(default_factory=list)
    asked_for_all: bool = False
    lines: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """The log lines: counts, then one line per kind listing the names."""

        def named(names: Sequence[str]) -> str:
            return ", ".join(f"{n} <- {self.sources[n]}" if n in self.sources else n for n in names)

        lines = [
            f"Warm-started from {self.source}: {len(self.loaded)} variables loaded, "
            f"{len(self.fresh)} initialised fresh."
        ]
        not_wanted = [f for f in self.fresh if f not in self.mismatched and f not in self.missing]
        if self.loaded:
            lines.append(f"  loaded: {named(self.loaded)}")
        if self.mismatched:
            lines.append(f"  initialised fresh (other shape or dtype): {', '.join(self.lines)}")
        if self.missing:
            lines.append(f"  initialised fresh (not in the checkpoint): {named(self.missing)}")
        if not_wanted:
            lines.append(f"  initialised fresh (not warm-started): {', '.join(not_wanted)}")
        if self.unused and self.asked_for_all:
            lines.append(f"  checkpoint variables not used: {', '.join(self.unused)}")
        return "\n".join(lines)


def _as_settings(source: str | WarmStartSettings) -> WarmStartSettings:
    # A path alone warms every variable, batch statistics too (tf.estimator's Estimator
    # documents ``warm_start_from=PATH`` so; estimax's programs have always loaded them).
    if isinstance(source, WarmStartSettings):
        return source
    return WarmStartSettings(str(source), vars_to_warm_start=[ALL])


def _host(tree: Any) -> Any:
    """Host copies of (replicated) arrays: one addressable shard holds the whole value."""

    def one(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _like(new: Any, old: Any) -> Any:
    """``new`` (numpy) placed as ``old`` is (its sharding), leaf by leaf."""

    def put(n: Any, o: Any) -> Any:
        if isinstance(o, jax.Array):
            n = np.asarray(n, dtype=o.dtype)
            return jax.make_array_from_callback(o.shape, o.sharding, lambda idx: n[idx])
        return n

    return jax.tree.map(put, new, old)


def _is_tf_checkpoint(path: str) -> bool:
    try:
        resolve_checkpoint(path)
    except TFCheckpointError:
        return False
    return True


def _estimax_variables(path: str) -> tuple[dict[str, Any], str]:
    """The variables (``{"params": ..., <collection>: ...}``) of an estimax checkpoint at
    ``path``, and the checkpoint's directory."""
    from estimax.state import checkpoints

    path = path.rstrip("/")
    try:
        model_dir, step = checkpoints.step_from_checkpoint_path(path)
    except ValueError:
        model_dir, step = path, None
    checkpointer = checkpoints.Checkpointer(model_dir, keep_checkpoint_max=None, read_only=True)
    try:
        if step is None:
            step = checkpointer.latest_step()
        if step is None:
            raise TFCheckpointError(
                f"--warm_start_from={path}: neither a TensorFlow checkpoint ('checkpoint' file or "
                "model.ckpt-N.index) nor an estimax model_dir with checkpoints"
            )
        model = checkpointer.restore_numpy(step, checkpoints.MODEL_ITEM)
    finally:
        checkpointer.close()
    return checkpoints.variables_of(model), checkpointer.step_dir(step)


def _inside(tree: Any, path: Sequence[str]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _open(path: str) -> tuple[Source, bool]:
    """The checkpoint at ``path`` and whether it is TensorFlow's."""
    if _is_tf_checkpoint(path):
        return TFSource(CheckpointReader(path)), True
    saved, location = _estimax_variables(path)
    return ArraySource(saved, location), False


def _select(
    settings: WarmStartSettings,
    ours: Mapping[str, Variable],
    registered: Mapping[str, tuple[str, bool]],
) -> tuple[dict[str, Variable], list[str]]:
    """The variables ``vars_to_warm_start`` takes, and a problem line for each expression
    matching none."""
    patterns, trainable_only = settings.expressions()
    if settings.vars_to_warm_start is None:
        return dict(ours), []
    used: set[str] = set()
    chosen = {}
    for name, var in ours.items():
        tf_name = registered.get(name, (name, False))[0]
        hits = settings.matching(var, (name, tf_name))
        used.update(hits)
        if hits:
            chosen[name] = var
    kind = "trainable variable" if trainable_only else "variable"
    idle = [repr(p) for p in patterns if p not in used]
    problems = [f"vars_to_warm_start matches no {kind}: {', '.join(idle)}"] if idle else []
    return chosen, problems


def _fits(p: Planned, ours: np.ndarray, theirs: tuple[tuple[int, ...], np.dtype]) -> str | None:
    """None if the checkpoint's ``theirs`` (shape, dtype) loads exactly into ``ours``, else the
    mismatch as one item (``name [8] float32 <- ckpt [10] float32``)."""
    shape, dtype = theirs
    same_size = int(np.prod(shape)) == int(np.prod(ours.shape))
    if (tuple(shape) == ours.shape or (p.reshape and same_size)) and exact_cast(dtype, ours.dtype):
        return None
    return f"{p.variable.name} {list(ours.shape)} {ours.dtype} <- {p.source} {list(shape)} {dtype}"


def _bounded(items: Sequence[str]) -> str:
    """The first ``SHOWN`` of ``items``, comma-separated, and how many more."""
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _prefix_fix(wanted: str, known: Mapping[str, str]) -> tuple[str, str, str] | None:
    """``(checkpoint name, verb, prefix)`` if ``wanted`` is in the checkpoint (``known``: its
    names, as they are and after ``rename``, to the real name) once a leading scope is stripped
    (``("bert/x", "strip", "Top_0/")`` for ``Top_0/bert/x``) or added; None otherwise."""
    parts = wanted.split("/")
    for k in range(1, len(parts)):  # the longest tail first: the least stripped
        tail = "/".join(parts[k:])
        if tail in known:
            return known[tail], "strip", "/".join(parts[:k]) + "/"
    longer = sorted(n for n in known if n.endswith("/" + wanted))
    if longer:
        return known[longer[0]], "add", longer[0][: -len(wanted)]
    return None


def _hint(wanted: str, known: Mapping[str, str]) -> str:
    """Where the checkpoint may hold ``wanted``: under another prefix, else its closest names."""
    fix = _prefix_fix(wanted, known)
    if fix is not None:
        name, verb, prefix = fix
        return f"the checkpoint has {name}; {verb} {prefix!r}?"
    close = difflib.get_close_matches(wanted, list(known), n=3, cutoff=0.6)
    if close:
        return "closest in the checkpoint: " + ", ".join(dict.fromkeys(known[c] for c in close))
    return "nothing like it in the checkpoint"


def _absent_lines(
    absent: Sequence[Planned],
    selected: int,
    tensors: Mapping[str, Any],
    rename: Rename | None,
) -> list[str]:
    """The error's lines for selected variables the checkpoint lacks: a count, the first
    ``SHOWN`` each with its hint, and the assignment map that loads them all when every one is
    in the checkpoint under one other prefix (a model_fn's unnamed top module, ``Top_0/``)."""
    to_model = renamer(rename)
    names = [n for n in tensors if is_model_tensor(n)]
    known = {n: n for n in names} | {to_model(n): n for n in names}
    lines = [f"not in the checkpoint: {len(absent)} of the {selected} selected variables"]
    for p in absent[:SHOWN]:
        shown = (
            p.variable.name if p.wanted == p.variable.name else f"{p.variable.name} <- {p.wanted}"
        )
        lines.append(f"  {shown}: {_hint(str(p.wanted), known)}")
    if len(absent) > SHOWN:
        lines.append(f"  and {len(absent) - SHOWN} more")
    # One prefix to strip from every one (looked up by the variables' own names): a map that
    # loads them all.
    fixes = [_prefix_fix(str(p.wanted), known) for p in absent]
    kinds = {(f[1], f[2]) for f in fixes if f is not None}
    if len(kinds) == 1 and None not in fixes and all(p.wanted == p.variable.name for p in absent):
        verb, prefix = kinds.pop()
        if verb == "strip":
            scopes = sorted({p.variable.name[len(prefix) :].split("/")[0] for p in absent})
            mapping = {f"{s}/": f"{prefix}{s}/" for s in scopes}
            lines.append(
                f"every one is in the checkpoint without {prefix!r}: "
                f"assignment_map={mapping} loads them"
            )
    return lines


def warm_start_variables(
    settings: WarmStartSettings, variables: Mapping[str, Any]
) -> tuple[dict[str, Any], WarmStartReport]:
    """``variables`` (host numpy ``{"params": ..., <collection>: ...}``) with the checkpoint's
    values in, and the report.

    Raises:
      WarmStartError: the settings do not fit (one line per kind of problem, listing names).
      TFCheckpointError: no readable checkpoint at ``ckpt_to_initialize_from``.
    """
    path = settings.ckpt_to_initialize_from
    if settings.var_name_to_vocab_info:
        raise WarmStartError(
            f"--warm_start_from={path}: var_name_to_vocab_info (vocabulary remapping) is not "
            "supported; map names with var_name_to_prev_var_name or assignment_map"
        )
    source, is_tf = _open(path)
    ours = model_variables(variables)
    registered = registered_names(variables) if is_tf else {}
    tensors = source.tensors()
    chosen, problems = _select(settings, ours, registered)
    only_mapped = settings.assignment_map is not None or settings.vars_to_warm_start is None
    planned, plan_problems = plan(
        chosen,
        [n for n in tensors if is_model_tensor(n)],
        assignment_map=settings.assignment_map,
        prev_names=settings.var_name_to_prev_var_name,
        rename=settings.rename,
        registered=registered,
        only_mapped=only_mapped,
    )
    problems += plan_problems
    report = WarmStartReport(source=source.location, asked_for_all=settings.asks_for_all())
    loaded = copy_tree(dict(variables))
    absent: list[Planned] = []
    unfit: list[tuple[Planned, str]] = []
    taken: set[str] = set()
    for p in planned:
        var = p.variable
        like = np.asarray(_inside(variables[var.collection], var.path))
        mismatch = None if p.source is None else _fits(p, like, tensors[p.source])
        if p.source is not None:
            taken.add(p.source)
        if p.wanted is None:
            report.fresh.append(var.name)
        elif p.source is None:
            absent.append(p)
            report.fresh.append(var.name)
            report.missing.append(var.name)
            if p.wanted != var.name:
                report.sources[var.name] = p.wanted
        elif mismatch is not None:
            unfit.append((p, mismatch))
            report.fresh.append(var.name)
            report.mismatched.append(var.name)
            report.lines.append(mismatch)
        else:
            value = np.asarray(source.get(p.source)).reshape(like.shape).astype(like.dtype)
            set_path(loaded[var.collection], var.path, value)
            report.loaded.append(var.name)
            if p.source != var.name:
                report.sources[var.name] = p.source
    report.fresh += sorted(set(ours) - set(chosen))
    report.fresh.sort()
    report.unused = sorted(n for n in tensors if is_model_tensor(n) and n not in taken)
    # Nothing loaded is never what was meant: every problem is then the error, opt-outs or not.
    nothing = not report.loaded
    refused = [p for p in absent if nothing or p.explicit or not settings.allow_missing]
    wrong = [m for p, m in unfit if nothing or p.explicit or not settings.allow_shape_mismatch]
    selected = sum(p.wanted is not None for p in planned)
    if refused:
        problems += _absent_lines(refused, selected, tensors, settings.rename)
    if wrong:
        problems.append(f"other shape or dtype: {_bounded(wrong)}")
    if nothing and (selected or not problems):  # else the lines above say why
        problems.insert(
            0,
            f"no variable would be loaded ({selected} selected): a warm start that loads "
            "nothing is refused",
        )
    if problems:
        raise WarmStartError(
            f"--warm_start_from={path} does not fit the model:\n  " + "\n  ".join(problems)
        )
    return loaded, report


def warm_start(source: str | WarmStartSettings, state: Any) -> tuple[Any, WarmStartReport]:
    """Returns ``state`` (a fresh ``TrainState``) with the source's variables in, and a report
    (also logged: what was loaded, what was not and why).

    Raises:
      WarmStartError: the settings do not fit the model or the checkpoint.
      TFCheckpointError: the source is neither a TensorFlow nor an estimax checkpoint.
    """
    settings = _as_settings(source)
    storage.configure()
    variables = _host({"params": state.params, **state.model_state})
    loaded, report = warm_start_variables(settings, variables)
    params = loaded.pop("params")
    new_state = state.replace(
        params=_like(params, state.params),
        model_state=_like(loaded, state.model_state),
        ema_params=_like(params, state.ema_params) if state.ema_params else state.ema_params,
    )
    for line in report.summary().splitlines():
        # What was selected and not loaded (under an opt-out) is a warning, as is a checkpoint
        # variable left over when all were asked for; the rest is the record of a good start.
        warn = line.startswith(
            (
                "  initialised fresh (other",
                "  initialised fresh (not in the checkpoint)",
                "  checkpoint variables not used",
            )
        )
        (logging.warning if warn else logging.info)("%s", line)
    return new_state, report
