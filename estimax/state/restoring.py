"""What a run starts from: a checkpoint (which one), restored onto the mesh, or the model
initialised (training: then warm-started, if asked).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import Mesh

from estimax.parallel import layouts, replication
from estimax.state import checkpoints as ckpt_lib
from estimax.state.train_state import TrainState


class StepsLike(Protocol):
    """What restoring needs of a run's steps (``estimax.estimator.step_builder.Steps``): their
    initialisers (for shapes), base key and layout."""

    @property
    def init(self) -> Callable[..., Any]: ...
    @property
    def rng(self) -> jax.Array: ...
    @property
    def layout(self) -> layouts.Layout: ...
    def init_variables(self, mode: str) -> Callable[..., Any]: ...


def open_checkpoint(
    model_dir: str,
    checkpoint_path: str | None,
    own: Callable[[], ckpt_lib.Checkpointer],
    best: Callable[[], str | None],
) -> tuple[ckpt_lib.Checkpointer, int | None]:
    """The checkpointer and step of ``checkpoint_path`` ("best": ``best()``), or of
    ``model_dir``'s latest (``own()``: its checkpointer, made when first needed)."""
    if checkpoint_path is None:
        checkpointer = own()
        return checkpointer, checkpointer.latest_step()
    if checkpoint_path == "best":
        path = best()
        if path is None:
            raise FileNotFoundError(
                f"checkpoint_path='best': no checkpoint of {model_dir} has a recorded "
                "evaluation yet (evaluate first: Estimator.evaluate or train_and_evaluate)."
            )
        checkpoint_path = path
    model_dir, step = ckpt_lib.step_from_checkpoint_path(checkpoint_path)
    checkpointer = ckpt_lib.Checkpointer(model_dir, None, read_only=True)
    if step not in checkpointer.all_steps():
        raise FileNotFoundError(f"No complete checkpoint at {checkpoint_path}.")
    return checkpointer, step


def training_start(
    checkpointer: ckpt_lib.Checkpointer,
    checkpoint_path: str | None,
    best: Callable[[], str | None],
) -> tuple[ckpt_lib.Checkpointer, int]:
    """Where training in ``checkpointer``'s model_dir starts: (the checkpointer to restore
    from, its step; 0: initialise)."""
    start = checkpointer.latest_step() or 0
    if checkpoint_path is None:
        return checkpointer, start
    model_dir = checkpointer.model_dir
    chosen, step = open_checkpoint(model_dir, checkpoint_path, lambda: checkpointer, best)
    assert step is not None  # open_checkpoint refuses a path without a checkpoint
    if _same_dir(chosen.model_dir, model_dir):
        if step == start:
            return checkpointer, start
        raise ValueError(
            f"train(checkpoint_path={checkpoint_path!r}) is step {step} of this model_dir, "
            f"whose latest checkpoint is step {start}: training from it here would "
            "overwrite the history of the later steps. Train from it in a new model_dir: "
            "Estimator(..., model_dir=NEW).train(..., checkpoint_path="
            f"{ckpt_lib.step_path(model_dir, step)!r})."
        )
    if start:
        logging.info(
            "%s has its own checkpoint (step %d): resuming from it, not from %s.",
            model_dir,
            start,
            checkpoint_path,
        )
        return checkpointer, start
    logging.info("Starting from checkpoint %s (step %d).", checkpoint_path, step)
    return chosen, step


def train_state(
    steps: StepsLike,
    mesh: Mesh,
    checkpointer: ckpt_lib.Checkpointer,
    step: int,
    sample: Any,
    warm_start_from: Any,
    model_dir: str,
) -> Any:
    """The train state at ``step`` (restored), or initialised from ``sample`` at step 0 (then
    warm-started from ``warm_start_from`` if given); ``model_dir`` is the Estimator's."""
    abstract = _placed_state(jax.eval_shape(steps.init, steps.rng, *sample), steps, mesh)
    if not step:
        shardings = jax.tree.map(lambda s: s.sharding, abstract)
        state = replication.run_init(steps.init, mesh, steps.rng, *sample, out_shardings=shardings)
        if warm_start_from is not None:  # no checkpoint of our own yet
            from estimax.state import warm_start

            # Placed as ``state`` is, leaf by leaf (FSDP's slices stay slices).
            state, _ = warm_start.warm_start(warm_start_from, state)
        return state
    state = checkpointer.restore_state(step, abstract)
    if state.ema_params is None:
        if jax.tree.leaves(abstract.ema_params):
            logging.warning("Checkpoint %d has no EMA of the weights; starting it from them.", step)
        ema = state.params if jax.tree.leaves(abstract.ema_params) else abstract.ema_params
        state = dataclasses.replace(state, ema_params=ema)
    logging.info("Restored checkpoint at step %d from %s", step, model_dir)
    return state


def load_variables(
    steps: StepsLike,
    mesh: Mesh,
    checkpointer: ckpt_lib.Checkpointer,
    step: int | None,
    sample: Any,
    mode: str,
) -> tuple[dict, int]:
    """Returns (variables, step) of ``checkpointer``'s ``step``, for EVAL or PREDICT.

    Uses the EMA of the weights when the checkpoint has one. Without any checkpoint (``step``
    None) the model is initialised, with a warning, as the original did.
    """
    init = steps.init_variables(mode)
    if step is None:
        logging.warning(
            "Could not find trained model in model_dir: %s, running initialization to %s.",
            checkpointer.model_dir,
            mode,
        )
        abstract_variables = _placed_variables(
            jax.eval_shape(init, steps.rng, *sample), steps, mesh
        )
        shardings = jax.tree.map(lambda s: s.sharding, abstract_variables)
        variables = replication.run_init(init, mesh, steps.rng, *sample, out_shardings=shardings)
        return dict(variables), 0
    variables = _placed_variables(jax.eval_shape(init, steps.rng, *sample), steps, mesh)
    params = variables.pop("params", {})
    abstract = TrainState(
        step=cast(Any, jax.ShapeDtypeStruct((), jnp.int32, sharding=replication.replicated(mesh))),
        params=params,
        model_state=variables,
        opt_state={},
        ema_params=params,  # read only if the checkpoint has an EMA
    )
    state = checkpointer.restore_state(step, abstract)
    chosen = state.params if state.ema_params is None else state.ema_params
    return {"params": chosen, **state.model_state}, step


def _with_replicated_sharding(abstract: Any, mesh: Mesh) -> Any:
    sharding = replication.replicated(mesh)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract
    )


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        abstract,
        shardings,
    )


def _placed_state(abstract: TrainState, steps: StepsLike, mesh: Mesh) -> TrainState:
    """``abstract`` (a train state's shapes) with the shardings of ``steps``' layout: whole
    arrays on every device by default; FSDP's split leaves as slices (``layouts``). Orbax
    restores each array into the sharding given, so a checkpoint of any layout or device
    count restores into this one."""
    if steps.layout.is_default:
        return _with_replicated_sharding(abstract, mesh)
    replicas = layouts.replicas_per_slice(mesh)  # FSDP splits inside a slice only
    steps.layout.check_fsdp(abstract.params, replicas)
    specs = steps.layout.state_specs(abstract, replicas)
    return _with_shardings(abstract, layouts.shardings(specs, mesh))


def _placed_variables(abstract: Any, steps: StepsLike, mesh: Mesh) -> dict[str, Any]:
    """``{"params": ..., <collection>: ...}`` shapes placed as ``_placed_state`` places them."""
    if steps.layout.is_default:
        return dict(_with_replicated_sharding(abstract, mesh))
    specs = steps.layout.variables_specs(abstract, layouts.replicas_per_slice(mesh))
    return dict(_with_shardings(abstract, layouts.shardings(specs, mesh)))


def _same_dir(a: str, b: str) -> bool:
    """Whether two model_dir paths name the same directory."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)
