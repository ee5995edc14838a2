"""A TensorFlow checkpoint of the original -> an estimax checkpoint a program evaluates or resumes.

``convert_tf_checkpoint`` builds the program's own ``model_fn`` from its flags (the same
``make_model_fn`` and config the program uses), initialises the train state the Estimator would,
loads the TensorFlow tensors into it (``estimax.migrate.load``), saves it as the checkpoint at
TensorFlow's ``global_step`` in ``model_dir`` and records the model-shaping flags in
``model_dir/flags.json``, so ``resnet --model_dir=DIR --mode=eval`` evaluates the converted model
and ``--mode=train`` continues it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from estimax.migrate.load import ImportReport, load_tf_state
from estimax.migrate.tf_checkpoint import CheckpointReader, TFCheckpointError
from estimax.programs import cli

__all__ = ["ProgramModel", "convert_tf_checkpoint", "program_model"]


@dataclasses.dataclass(frozen=True)
class ProgramModel:
    """What a program trains, built from its flags as its ``run_from_flags`` builds it.

    Attributes:
      program: the program's name (``flags.json``'s).
      model_fn: the program's ``model_fn``.
      model_flags: the flags ``flags.json`` records and the program checks.
      features: one example of the features the program feeds (for initialising).
      tf_names: the TensorFlow original's names of its network.
    """

    program: str
    model_fn: Callable
    model_flags: dict[str, Any]
    features: np.ndarray
    tf_names: Any = None


def program_model(program: str, argv: Sequence[str]) -> ProgramModel:
    """The model of ``program`` with the flags ``argv`` (``["--resnet_depth=18", ...]``).

    Raises:
      TFCheckpointError: a program without a TensorFlow original; absl's ``flags.Error`` for
        unknown/bad flags.
    """
    from estimax.programs import families

    known = families.with_tf_original()
    if program not in known:
        raise TFCheckpointError(f"--model={program!r}: must be one of {', '.join(known)}")
    family = families.get(program)
    fv = family.parse(argv)
    return ProgramModel(
        program,
        family.make_model_fn(family.config_from_flags(fv)),
        family.recorded_flags(fv),
        family.example_features(fv),
        family.tf_names,
    )


def initial_state(model_fn: Callable, features: Any, labels: Any, seed: int = 0) -> Any:
    """The step-0 ``TrainState`` an Estimator with ``model_fn`` starts from on one example."""
    from estimax.estimator import steps
    from estimax.estimator.spec import ModeKeys

    def call(features: Any, labels: Any, mode: str) -> Any:
        return model_fn(features, labels, mode, {"batch_size": 1})

    module = steps.ModelFnModule(call=call, mode=ModeKeys.TRAIN)
    return jax.jit(lambda rng: steps.init_state(module, rng, (features, labels)))(
        jax.random.PRNGKey(seed)
    )


def _zeros(spec: Any) -> np.ndarray:
    return np.zeros(spec.shape, spec.dtype)


def _refuse_existing(model_dir: str) -> None:
    """Raises ``TFCheckpointError`` if ``model_dir`` already holds a checkpoint."""
    from estimax import storage
    from estimax.estimator import checkpoints

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
    from estimax.estimator import checkpoints
    from estimax.estimator.steps import TrainState

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
    program: str,
    program_argv: Sequence[str] = (),
    *,
    optimizer_state: bool = True,
    ema: bool = True,
    allow_missing: bool = False,
    allow_mismatch: bool = False,
    allow_unmapped: bool = False,
) -> ImportReport:
    """Writes ``checkpoint`` (TensorFlow) as the estimax checkpoint of ``program`` in ``model_dir``.

    Args:
      checkpoint: the TensorFlow checkpoint (its model_dir, a prefix, or ``.index``).
      model_dir: the estimax model_dir to create (must hold no checkpoint yet).
      program: a program with a TensorFlow original (``resnet``, ``inception_v3``...).
      program_argv: that program's model flags (``--resnet_depth=50``...).
      optimizer_state: load the optimizer slots (False: fresh optimizer state, step kept).
      ema: load the moving-average shadows into estimax's EMA.
      allow_missing, allow_mismatch, allow_unmapped: see ``load_tf_state``.

    Returns the import's report.

    Raises:
      TFCheckpointError: unreadable checkpoint, a model_dir that has checkpoints, or (a
        ``MappingError``) tensors that do not fit.
    """
    reader = CheckpointReader(checkpoint)
    target = program_model(program, program_argv)
    _refuse_existing(model_dir)
    load = functools.partial(
        load_tf_state,
        reader,
        target.tf_names,
        allow_missing=allow_missing,
        allow_mismatch=allow_mismatch,
        allow_unmapped=allow_unmapped,
    )
    labels = np.zeros((1,), np.int32)
    features = jnp.asarray(target.features)
    # First the names and shapes alone (no initialiser compiled: a minute for a big model),
    # so a checkpoint that does not fit is refused at once, before model_dir is created.
    abstract = jax.eval_shape(lambda: initial_state(target.model_fn, features, labels))
    load(jax.tree.map(_zeros, {"params": abstract.params, **abstract.model_state}), ema=False)
    state = initial_state(target.model_fn, features, labels)
    variables, opt_state, ema_params, report = load(
        {"params": state.params, **state.model_state},
        state.opt_state,
        state.ema_params,
        optimizer_state=optimizer_state,
        ema=ema,
    )
    _write(model_dir, report.step or 0, variables, opt_state, ema_params)
    cli.check_model_dir(model_dir, target.program, target.model_flags, write=True)
    logging.info("Converted %s", report.summary())
    return report
