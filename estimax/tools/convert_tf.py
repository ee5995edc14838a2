"""A TensorFlow checkpoint of the original -> an estimax checkpoint a program evaluates or resumes.

``convert_tf_checkpoint`` builds the program's own ``model_fn`` from its flags (the same
``make_model_fn`` and config the program uses), initialises the train state the Estimator would,
loads the TensorFlow tensors into it (``estimax.migrate.load``), saves it as the checkpoint at
TensorFlow's ``global_step`` in ``model_dir`` and records the model-shaping flags in
``model_dir/flags.json``, so ``resnet --model_dir=DIR --mode=eval`` evaluates the converted model
and ``--mode=train`` continues it.

A model of one's own (``--model_fn=FILE.py:NAME`` or ``MODULE:NAME``) is built as an Estimator
builds it, on one batch of its ``input_fn``, and its variables are found in the checkpoint by
name (``estimax.migrate.assignment``: the Flax path as a TensorFlow name, an ``assignment_map``,
a ``rename``), as a warm start finds them; so are a program's, when given a map or a rename.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from estimax.migrate.assignment import (
    AssignmentMap,
    Rename,
    TFSource,
    is_model_tensor,
    model_variables,
    plan,
    registered_names,
)
from estimax.migrate.load import ImportReport, load_tf_state
from estimax.migrate.names import Entry, TFNames
from estimax.migrate.tf_checkpoint import CheckpointReader, TFCheckpointError
from estimax.programs import cli

__all__ = [
    "ProgramModel",
    "convert_tf_checkpoint",
    "load_callable",
    "named_by_checkpoint",
    "program_model",
    "user_model",
]


@dataclasses.dataclass(frozen=True)
class ProgramModel:
    """What a program trains, built from its flags as its ``run_from_flags`` builds it.

    Attributes:
      program: the program's name (``flags.json``'s); None for a ``model_fn`` of one's own.
      model_fn: the program's ``model_fn``.
      model_flags: the flags ``flags.json`` records and the program checks.
      features: one example of the features the program feeds (for initialising).
      tf_names: the TensorFlow original's names of its network.
      labels: one example's labels.
      params: the ``model_fn``'s params (``batch_size`` is set to 1).
    """

    program: str | None
    model_fn: Callable
    model_flags: dict[str, Any]
    features: Any
    tf_names: Any = None
    labels: Any = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def program_model(program: str, argv: Sequence[str]) -> ProgramModel:
    """The model of ``program`` with the flags ``argv`` (``["--resnet_depth=18", ...]``).

    Raises:
      TFCheckpointError: a program without a TensorFlow original; absl's ``flags.Error`` for
        unknown/bad flags.
    """
    from estimax.programs import families

    known = families.with_tf_original()
    if program not in known:
        raise TFCheckpointError(
            f"--model={program!r}: must be one of {', '.join(known)}; a model of your own: "
            "--model_fn=FILE.py:NAME (its variables found by name, with --assignment_map and "
            "--rename)"
        )
    family = families.get(program)
    fv = family.parse(argv)
    return ProgramModel(
        program,
        family.make_model_fn(family.config_from_flags(fv)),
        family.recorded_flags(fv),
        family.example_features(fv),
        family.tf_names,
    )


def load_callable(spec: str, flag: str) -> Callable:
    """The callable ``spec`` names: ``path/to/file.py:NAME`` or ``package.module:NAME``.

    Raises:
      TFCheckpointError: no such file, module or name (one line).
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise TFCheckpointError(f"{flag}={spec!r}: expected FILE.py:NAME or MODULE:NAME")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise TFCheckpointError(f"{flag}={spec!r}: no file {where}")
            module_name = "estimax_user_" + os.path.splitext(os.path.basename(where))[0]
            file_spec = importlib.util.spec_from_file_location(module_name, where)
            assert file_spec is not None and file_spec.loader is not None  # a .py file
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[module_name] = module  # dataclasses look their module up
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as e:
        raise TFCheckpointError(f"{flag}={spec!r}: {e}") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise TFCheckpointError(f"{flag}={spec!r}: {where} has no callable {name!r}")
    return found


def user_model(
    model_fn: str, input_fn: str | None = None, params: Mapping[str, Any] | None = None
) -> ProgramModel:
    """A ``model_fn`` of one's own, with one batch of its ``input_fn`` to initialise it.

    Args:
      model_fn: ``FILE.py:NAME`` or ``MODULE:NAME``.
      input_fn: the same forms (default: ``input_fn`` beside the ``model_fn``); called with
        the params and ``batch_size`` 1, its first ``(features, labels)`` is used.
      params: the ``model_fn``'s and ``input_fn``'s params.

    Raises:
      TFCheckpointError: a name that cannot be loaded, or an ``input_fn`` yielding nothing.
    """
    fn = load_callable(model_fn, "--model_fn")
    input_spec = input_fn or f"{model_fn.rpartition(':')[0]}:input_fn"
    make_input = load_callable(input_spec, "--input_fn")
    call_params = {**(params or {}), "batch_size": 1}
    try:
        features, labels = next(iter(make_input(call_params)))
    except StopIteration:
        raise TFCheckpointError(f"--input_fn={input_spec!r} yielded no batch") from None
    return ProgramModel(None, fn, {}, features, None, labels, call_params)


def named_by_checkpoint(
    variables: Mapping[str, Any],
    reader: CheckpointReader,
    family: TFNames | None = None,
    *,
    assignment_map: AssignmentMap | None = None,
    rename: Rename | None = None,
) -> TFNames:
    """TensorFlow names for every variable of ``variables``, found as a warm start finds them
    (``estimax.migrate.assignment``), as the ``TFNames`` the loader takes.

    Raises:
      TFCheckpointError: the map names what the model has not (one line per kind).
    """
    params = variables["params"]
    if not params:
        raise TFCheckpointError("the model has no variables to convert")
    ours = model_variables(variables)
    names = [n for n in TFSource(reader).tensors() if is_model_tensor(n)]
    planned, problems = plan(
        ours,
        names,
        assignment_map=assignment_map,
        rename=rename,
        registered=registered_names(variables, family) if family is not None else {},
        purpose="of the model",
    )
    if problems:
        raise TFCheckpointError(
            f"{reader.index_path} does not fit the model:\n  " + "\n  ".join(problems)
        )
    entries = [
        Entry(p.variable.collection, p.variable.path, p.source or p.wanted or "", p.reshape)
        for p in planned
    ]
    # Every entry's path is from the root, so the "scope marker" is any top-level name.
    marker = next(iter(params))
    return TFNames(family.name if family else "model_fn", marker, lambda _: entries)


def initial_state(
    model_fn: Callable,
    features: Any,
    labels: Any,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
) -> Any:
    """The step-0 ``TrainState`` an Estimator with ``model_fn`` starts from on one example."""
    from estimax.estimator import steps
    from estimax.estimator.spec import ModeKeys

    call_params = dict(params or {"batch_size": 1})

    def call(features: Any, labels: Any, mode: str) -> Any:
        return model_fn(features, labels, mode, call_params)

    module = steps.ModelFnModule(call=call, mode=ModeKeys.TRAIN)
    return jax.jit(lambda rng: steps.init_state(module, rng, (features, labels)))(
        jax.random.PRNGKey(seed)
    )


def _zeros(spec: Any) -> np.ndarray:
    return np.zeros(spec.shape, spec.dtype)


def _refuse_existing(model_dir: str) -> None:
    """Raises ``TFCheckpointError`` if ``model_dir`` already holds a checkpoint."""
    from estimax import storage
    from estimax.state import checkpoints

    if not storage.isdir(checkpoints.checkpoint_dir(model_dir)):
        return
    before = checkpoints.Checkpointer(model_dir, keep_checkpoint_max=None, read_only=True)
    try:
        found = before.latest_step()
    finally:
        before.close()
    if found is not None:
        raise TFCheckpointError(
            f"--model_dir={model_dir} already has checkpoints (step {found}): convert "
            "into a new model_dir"
        )


def _write(model_dir: str, step: int, variables: dict, opt_state: Any, ema_params: Any) -> None:
    """Saves the converted state as ``model_dir``'s checkpoint at ``step`` (synchronously)."""
    from estimax.state import checkpoints
    from estimax.state.train_state import TrainState

    model_state = dict(variables)
    params = model_state.pop("params")
    state = TrainState(jnp.asarray(step, jnp.int32), params, model_state, opt_state, ema_params)
    writer = checkpoints.Checkpointer(model_dir, keep_checkpoint_max=None, async_save=False)
    try:
        writer.save_state(step, state, None)
        writer.wait_until_finished()
    finally:
        writer.close()


def convert_tf_checkpoint(
    checkpoint: str,
    model_dir: str,
    program: str | ProgramModel,
    program_argv: Sequence[str] = (),
    *,
    optimizer_state: bool = True,
    ema: bool = True,
    allow_missing: bool = False,
    allow_mismatch: bool = False,
    allow_unmapped: bool = False,
    assignment_map: AssignmentMap | None = None,
    rename: Rename | None = None,
) -> ImportReport:
    """Writes ``checkpoint`` (TensorFlow) as the estimax checkpoint of ``program`` in ``model_dir``.

    Args:
      checkpoint: the TensorFlow checkpoint (its model_dir, a prefix, or ``.index``).
      model_dir: the estimax model_dir to create (must hold no checkpoint yet).
      program: a program with a TensorFlow original (``resnet``, ``inception_v3``...), or a
        ``model_fn`` of one's own (``user_model``).
      program_argv: that program's model flags (``--resnet_depth=50``...).
      optimizer_state: load the optimizer slots (False: fresh optimizer state, step kept).
      ema: load the moving-average shadows into estimax's EMA.
      allow_missing, allow_mismatch, allow_unmapped: see ``load_tf_state``.
      assignment_map, rename: how the checkpoint's names map onto the variables' (as
        ``WarmStartSettings``'); a ``model_fn`` of one's own is always matched by name.

    Returns the import's report.

    Raises:
      TFCheckpointError: unreadable checkpoint, a model_dir that has checkpoints, or (a
        ``MappingError``) tensors that do not fit.
    """
    reader = CheckpointReader(checkpoint)
    if isinstance(program, ProgramModel):
        if program_argv:
            raise TFCheckpointError(
                f"a model_fn takes no program flags ({' '.join(program_argv)}): give --params"
            )
        target = program
    else:
        target = program_model(program, program_argv)
    _refuse_existing(model_dir)
    labels = np.zeros((1,), np.int32) if target.labels is None else target.labels
    features = jax.tree.map(jnp.asarray, target.features)
    params = dict(target.params) or None

    def init() -> Any:
        return initial_state(target.model_fn, features, labels, params=params)

    # First the names and shapes alone (no initialiser compiled: a minute for a big model),
    # so a checkpoint that does not fit is refused at once, before model_dir is created.
    abstract = jax.eval_shape(init)
    shapes = jax.tree.map(_zeros, {"params": abstract.params, **abstract.model_state})
    names = target.tf_names
    if target.program is None or assignment_map is not None or rename is not None:
        names = named_by_checkpoint(
            shapes, reader, target.tf_names, assignment_map=assignment_map, rename=rename
        )
    load = functools.partial(
        load_tf_state,
        reader,
        names,
        allow_missing=allow_missing,
        allow_mismatch=allow_mismatch,
        allow_unmapped=allow_unmapped,
    )
    load(shapes, ema=False)
    state = init()
    variables, opt_state, ema_params, report = load(
        {"params": state.params, **state.model_state},
        state.opt_state,
        state.ema_params,
        optimizer_state=optimizer_state,
        ema=ema,
    )
    _write(model_dir, report.step or 0, variables, opt_state, ema_params)
    if target.program is not None:
        cli.check_model_dir(model_dir, target.program, target.model_flags, write=True)
    logging.info("Converted %s", report.summary())
    return report
