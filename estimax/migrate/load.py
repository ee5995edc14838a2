"""Loads a TensorFlow checkpoint of the original models into estimax variables and optimizer state.

``load_tf_state`` takes what an estimax model initialised (``{"params", "batch_stats"}``, the
Optax state, the EMA) and returns it with every mapped tensor replaced by the checkpoint's, plus
an ``ImportReport`` of what was loaded, kept, missing, mismatched and left unused. Unless told
to allow it, anything missing, mismatched or unmapped stops the import with one error listing
each by name and shape.

Optimizer slots go into Optax state by what each state field is:
``TraceState.trace`` <- ``<var>/Momentum`` (SGD with momentum) or ``<var>/RMSProp_1`` (the
RMSProp momentum), ``ScaleByRmsState.nu`` <- ``<var>/RMSProp`` (the mean square), Adam's ``mu``
and ``nu`` <- ``<var>/Adam`` and ``<var>/Adam_1`` (or BERT's ``adam_m``, ``adam_v``), and every
``count`` <- ``global_step`` (so a schedule continues where TensorFlow's was).
``<var>/ExponentialMovingAverage`` shadows of the weights become estimax's EMA; shadows of the
batch-norm statistics replace the statistics (the original evaluated with them: its
``ema.variables_to_restore()`` covered ``tf.moving_average_variables()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from estimax.migrate.names import Entry, TFNames, lookup
from estimax.migrate.tf_checkpoint import CheckpointReader, TFCheckpointError

__all__ = ["ImportReport", "MappingError", "load_tf_state", "model_scope"]

# Prefixes the original's runs put before every name (TF <= 1.8 with --precision=bfloat16).
STRIPPED_PREFIXES = ("bfloat16/",)
# Optimizer slots and shadows, ``<var>/<suffix>``: the originals' (Momentum, RMSProp), and those
# a user's model_fn wrote (tf.train's Adam, Adagrad, Ftrl; BERT's AdamWeightDecayOptimizer).
SLOT_SUFFIXES = (
    "Momentum",
    "RMSProp",
    "RMSProp_1",
    "ExponentialMovingAverage",
    "Adam",
    "Adam_1",
    "adam_m",
    "adam_v",
    "Adagrad",
    "Ftrl",
    "Ftrl_1",
)
# Not model state: the step is read separately; Adam's beta powers; mixed precision's loss scale.
BOOKKEEPING = ("global_step", "beta1_power", "beta2_power", "loss_scale", "good_steps")


class MappingError(TFCheckpointError):
    """The checkpoint does not fit the model (missing, mismatched or unmapped tensors)."""


@dataclasses.dataclass
class ImportReport:
    """What an import did, by name.

    Attributes:
      checkpoint: the checkpoint prefix read.
      step: its ``global_step`` (None if it has none).
      loaded: TensorFlow names loaded into the model (weights and statistics).
      slots: optimizer slot names loaded into the Optax state.
      ema: shadow names loaded into the EMA (or the statistics).
      missing: ``(estimax name, TensorFlow name, shape)`` not in the checkpoint.
      mismatched: ``(estimax name, TensorFlow name, our shape, its shape)``.
      unused: ``(TensorFlow name, shape)`` of the checkpoint that nothing took.
      fresh: estimax names kept as initialised (missing or mismatched, allowed).
    """

    checkpoint: str
    step: int | None = None
    loaded: list[str] = dataclasses.field(default_factory=list)
    slots: list[str] = dataclasses.field(default_factory=list)
    ema: list[str] = dataclasses.field(default_factory=list)
    missing: list[tuple[str, str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = dataclasses.field(
        default_factory=list
    )
    unused: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    fresh: list[str] = dataclasses.field(default_factory=list)

    def unmapped(self) -> list[tuple[str, tuple[int, ...]]]:
        """Unused tensors that are model variables (not slots, shadows or bookkeeping)."""
        return [
            (name, shape)
            for name, shape in self.unused
            if name not in BOOKKEEPING and name.rsplit("/", 1)[-1] not in SLOT_SUFFIXES
        ]

    def problems(self) -> list[str]:
        """One line per missing, mismatched or unmapped tensor."""
        lines = [f"missing: {t} (for {f}, shape {list(s)})" for f, t, s in self.missing]
        lines += [
            f"shape mismatch: {t} is {list(theirs)} in the checkpoint, {f} is {list(ours)}"
            for f, t, ours, theirs in self.mismatched
        ]
        lines += [f"unmapped: {n} {list(s)}" for n, s in self.unmapped()]
        return lines

    def summary(self) -> str:
        """A few lines for the log: counts, then every problem and fresh variable."""
        head = (
            f"{self.checkpoint} (global_step {self.step}): loaded {len(self.loaded)} "
            f"variables, {len(self.slots)} optimizer slots, {len(self.ema)} moving averages; "
            f"{len(self.fresh)} kept as initialised; {len(self.unused)} checkpoint tensors unused"
        )
        rest = self.problems() + [f"initialised fresh: {f}" for f in self.fresh]
        return "\n".join([head, *("  " + line for line in rest)])


def _strip(name: str) -> str:
    for prefix in STRIPPED_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Sets the leaf at ``path`` of nested dicts."""
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def copy_tree(tree: Any) -> Any:
    """Nested dicts copied (leaves shared) so that ``set_path`` leaves the caller's tree alone."""
    if isinstance(tree, Mapping):
        return {k: copy_tree(v) for k, v in tree.items()}
    return tree


def model_scope(params: Mapping[str, Any], model: str | TFNames) -> tuple[str, ...]:
    """Where the model's variables are inside ``params``.

    A model built inside a ``model_fn`` sits under its auto-name (``ResNet_0``,
    ``InceptionV3_0``); a bare module's variables are at the root.

    Args:
      params: the ``params`` collection.
      model: the original's name (``resnet``...) or its ``TFNames``.
    """
    names = lookup(model)
    marker = names.scope_marker
    if marker in params:
        return ()
    found = [k for k, v in params.items() if isinstance(v, Mapping) and marker in v]
    if len(found) != 1:
        raise MappingError(
            f"cannot find the {names.name} network in the variables "
            f"(top-level names: {sorted(params)})"
        )
    return (found[0],)


class _Tensors:
    """The checkpoint's tensors by stripped name, each read once and marked as used."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.names = {_strip(n): n for n in reader.variables()}
        self.used: set[str] = set()

    def shape(self, name: str) -> tuple[int, ...] | None:
        real = self.names.get(name)
        return None if real is None else self.reader.variables()[real].shape

    def get(self, name: str) -> np.ndarray:
        self.used.add(name)
        return self.reader.get_tensor(self.names[name])


def _fits(entry: Entry, ours: tuple[int, ...], theirs: tuple[int, ...]) -> bool:
    if ours == theirs:
        return True
    return entry.reshape and int(np.prod(ours)) == int(np.prod(theirs))


def _cast(value: np.ndarray, like: Any) -> np.ndarray:
    return np.asarray(value).reshape(np.shape(like)).astype(np.asarray(like).dtype)


def load_tf_state(
    checkpoint: str | CheckpointReader,
    model: str | TFNames,
    variables: Mapping[str, Any],
    opt_state: Any = None,
    ema_params: Any = None,
    *,
    optimizer_state: bool = True,
    ema: bool = True,
    allow_missing: bool = False,
    allow_mismatch: bool = False,
    allow_unmapped: bool = False,
    fresh: Callable[[Entry], bool] | None = None,
) -> tuple[dict[str, Any], Any, Any, ImportReport]:
    """Returns ``(variables, opt_state, ema_params, report)`` with the checkpoint's values in.

    Args:
      checkpoint: a TensorFlow checkpoint (model_dir, prefix or ``.index``) or its reader.
      model: the original's name (``resnet``, ``inception_v3`` or ``inception_v4``) or its
        ``TFNames`` (``estimax.models.TF_NAMES``).
      variables: the initialised ``{"params": ..., "batch_stats": ...}`` (the network at the
        root, or under one auto-named scope as in an Estimator's state).
      opt_state: the initialised Optax state of ``variables["params"]`` (None: not loaded).
      ema_params: the initialised EMA of the params (None or ``{}``: no EMA kept).
      optimizer_state: load the optimizer slots (False: keep ``opt_state`` as initialised).
      ema: load the moving-average shadows (False: ignore them).
      allow_missing, allow_mismatch, allow_unmapped: keep as initialised (listed in ``fresh``)
        the variables the checkpoint lacks / whose shape differs (a new head); go on although
        checkpoint tensors map to nothing.
      fresh: entries to keep as initialised whatever the checkpoint has (warm-start filters);
        called with the entry's path inside ``variables`` (scope included).

    Raises:
      MappingError: missing, mismatched or unmapped tensors not allowed (each on its own line).
    """
    reader = (
        checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    )
    tensors = _Tensors(reader)
    report = ImportReport(checkpoint=reader.prefix)
    report.step = int(tensors.get("global_step")) if "global_step" in tensors.names else None
    scope = model_scope(variables["params"], model)
    inner = {c: _get(v, scope) for c, v in variables.items() if c in ("params", "batch_stats")}
    state = _Import(tensors, report, copy_tree(dict(variables)), copy_tree(ema_params), ema)
    for entry in lookup(model).entries(inner):
        state.add(dataclasses.replace(entry, path=(*scope, *entry.path)), fresh)
    if opt_state is not None and optimizer_state:
        opt_state = _load_slots(tensors, opt_state, state.taken, report)
    report.unused = sorted(
        (name, tensors.shape(name) or ()) for name in tensors.names if name not in tensors.used
    )
    _check_fits(reader, lookup(model).name, report, allow_missing, allow_mismatch, allow_unmapped)
    return state.variables, opt_state, state.ema_params, report


def _check_fits(
    reader: CheckpointReader,
    model: str,
    report: ImportReport,
    allow_missing: bool,
    allow_mismatch: bool,
    allow_unmapped: bool,
) -> None:
    """Raises ``MappingError`` listing every problem the ``allow_*`` flags do not allow."""
    refused = (
        (report.missing and not allow_missing)
        or (report.mismatched and not allow_mismatch)
        or (report.unmapped() and not allow_unmapped)
    )
    if refused:
        raise MappingError(
            f"{reader.index_path} does not fit the {model} model:\n  "
            + "\n  ".join(report.problems())
            + "\n(--allow_missing / --allow_mismatch / --allow_unmapped to go on anyway; "
            "those variables then keep their initial values)"
        )


@dataclasses.dataclass
class _Import:
    """The variables and EMA being filled from the checkpoint, one ``Entry`` at a time.

    Attributes:
      tensors, report: the checkpoint's tensors and what was done with them.
      variables, ema_params: copies of the caller's trees, filled in place.
      ema: load the moving-average shadows.
      taken: the loaded parameters' entries by path (their optimizer slots are read next).
    """

    tensors: _Tensors
    report: ImportReport
    variables: dict[str, Any]
    ema_params: Any
    ema: bool
    taken: dict[tuple[str, ...], Entry] = dataclasses.field(default_factory=dict)

    def add(self, entry: Entry, fresh: Callable[[Entry], bool] | None) -> None:
        """Loads ``entry`` (its path from the variables' root), or says why it stays fresh."""
        fname = "/".join((entry.collection, *entry.path))  # as the state names it
        ours = tuple(np.shape(_get(self.variables[entry.collection], entry.path)))
        theirs = self.tensors.shape(entry.tf_name)
        if fresh is not None and fresh(entry):
            self.report.fresh.append(fname)
            if theirs is not None:
                self.tensors.used.add(entry.tf_name)  # left out on purpose, not unmapped
        elif theirs is None:
            self.report.missing.append((fname, entry.tf_name, ours))
            self.report.fresh.append(fname)
        elif not _fits(entry, ours, theirs):
            self.report.mismatched.append((fname, entry.tf_name, ours, theirs))
            self.report.fresh.append(fname)
            self.tensors.used.add(entry.tf_name)  # mapped (reported as mismatched), not unmapped
        else:
            self._load(entry)

    def _load(self, entry: Entry) -> None:
        full = entry.path
        like = _get(self.variables[entry.collection], full)
        value = self.tensors.get(entry.tf_name)
        shadow_name = f"{entry.tf_name}/ExponentialMovingAverage"
        has_shadow = self.ema and self.tensors.shape(shadow_name) is not None
        if has_shadow and entry.collection == "batch_stats":
            # The original evaluated with the statistics' shadows: so does the import.
            value = self.tensors.get(shadow_name)
            self.report.ema.append(shadow_name)
        set_path(self.variables[entry.collection], full, _cast(value, like))
        self.report.loaded.append(entry.tf_name)
        if entry.collection != "params":
            return
        self.taken[full] = entry
        if has_shadow and self.ema_params:
            shadow = self.tensors.get(shadow_name)
            set_path(self.ema_params, full, _cast(shadow, _get(self.ema_params, full)))
            self.report.ema.append(shadow_name)
        elif self.ema_params:
            # No shadow (or not asked for): the average starts from the loaded weights, as
            # the Estimator starts it from a checkpoint that has none.
            set_path(self.ema_params, full, _cast(value, _get(self.ema_params, full)))


def _load_slots(
    tensors: _Tensors, opt_state: Any, taken: Mapping[tuple[str, ...], Entry], report: ImportReport
) -> Any:
    """The Optax state with the checkpoint's slots (see the module docstring)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    fields = {k.name for path, _ in leaves for k in path if isinstance(k, jax.tree_util.GetAttrKey)}
    momentum_slot = "RMSProp_1" if "nu" in fields else "Momentum"
    slot_of: dict[str, tuple[str, ...]] = {"trace": (momentum_slot,), "nu": ("RMSProp",)}
    if "mu" in fields:
        # Adam: tf.train's slots, or BERT's AdamWeightDecayOptimizer's (the same moments).
        slot_of = {"mu": ("Adam", "adam_m"), "nu": ("Adam_1", "adam_v")}
    new_leaves = []
    for path, leaf in leaves:
        attrs = [i for i, k in enumerate(path) if isinstance(k, jax.tree_util.GetAttrKey)]
        value = leaf
        if attrs:
            field = path[attrs[-1]].name
            rest = tuple(
                str(getattr(k, "key", getattr(k, "name", k))) for k in path[attrs[-1] + 1 :]
            )
            if field == "count" and report.step is not None:
                value = np.asarray(report.step, dtype=np.asarray(leaf).dtype).reshape(
                    np.shape(leaf)
                )
            elif field in slot_of and rest in taken:
                entry = taken[rest]
                names = [f"{entry.tf_name}/{slot}" for slot in slot_of[field]]
                name = next((n for n in names if tensors.shape(n) is not None), names[0])
                if tensors.shape(name) is None:
                    report.missing.append(("optimizer/" + "/".join(rest), name, np.shape(leaf)))
                    report.fresh.append("optimizer/" + "/".join(rest))
                else:
                    value = _cast(tensors.get(name), leaf)
                    report.slots.append(name)
        new_leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, new_leaves)
