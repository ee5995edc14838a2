"""The steps of a ``model_fn`` on a mesh, as a value: ``StepBuilder(...).build(mesh, sizes)``.

The builder holds what the steps close over (the ``model_fn``, its ``params``, the
``RunConfig``), never an Estimator; ``build`` places them on a mesh at given global batch sizes
and returns a ``Steps`` record of jitted functions. ``Estimator`` builds its steps once on its
own mesh; ``estimax.compile`` builds them again on a slice's mesh.

Inside ``shard_map`` each replica runs ``model_fn`` on its slice of the batch, so the model sees
per-replica shapes (``params["batch_size"]`` is the per-replica batch).

Gradient accumulation (``RunConfig.gradient_accumulation_steps = k``) is inside the train step:
the input still feeds the whole global batch (``train_batch_size``, the optimizer's batch) and
each replica splits its share into k micro-batches that a ``lax.scan`` differentiates one after
the other before one optimizer update (``steps.train_step``). Why there and not in the input:
the batch a user names keeps its meaning with or without accumulation (as in TF's and
big_vision's accumulation), one input batch is one step, so the input position saved with a
checkpoint, ``global_step`` and every cadence count optimizer steps with no bookkeeping, and a
job changes k (to fit memory) without touching its input or its schedule. In TRAIN,
``params["batch_size"]`` is the per-replica micro-batch, the rows ``model_fn`` sees.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from estimax.estimator import steps as steps_lib
from estimax.estimator.spec import EstimatorSpec, ModeKeys, RunConfig
from estimax.parallel import layouts, replication, strategies

_MODEL_FN_ARGS = ("features", "labels", "mode", "params", "config")


@dataclasses.dataclass(frozen=True)
class Steps:
    """What an Estimator runs, built on a given mesh (``StepBuilder.build`` makes it).

    Attributes:
      init: ``(rng, features, labels) -> TrainState`` on one replica's rows (for shapes only).
      train: the jitted train step ``(state, rng, features, labels) -> (state, metrics)``.
      init_eval: ``(rng, features, labels) -> variables`` in EVAL mode (shapes only).
      eval: the jitted eval step ``(totals, variables, step, features, labels, mask)``; it
        donates the running ``totals``.
      rng: the run's base key.
      train_loop: ``train`` as a device loop over batches stacked ``[n, B, ...]`` (outputs
        ``[n]``; ``RunConfig.steps_per_device_call``).
      eval_first: ``eval`` for the first batch (``totals`` None: nothing to donate).
      init_predict: ``(rng, features, labels) -> variables`` in PREDICT mode (shapes only).
      predict: the jitted predict step ``(variables, step, features) -> predictions``.
      serve: ``(variables, step, features) -> outputs`` in PREDICT mode, unjitted (export).
      layout: where the steps' arrays lie (``layouts.Layout``): what states and variables are
        placed by (``restoring``) and batches transferred by (``batches``).
    """

    init: Callable[..., Any]
    train: Any
    init_eval: Callable[..., Any]
    eval: Any
    rng: jax.Array
    train_loop: Any
    eval_first: Any
    init_predict: Callable[..., Any]
    predict: Any
    serve: Callable[..., Any]
    layout: layouts.Layout = layouts.Layout()

    def init_variables(self, mode: str) -> Callable[..., Any]:
        """``init_eval`` or ``init_predict``, by ``mode``."""
        return self.init_eval if mode == ModeKeys.EVAL else self.init_predict


def check_model_fn(model_fn: Callable) -> tuple[str, ...]:
    """The names of ``model_fn``'s arguments, or an error naming the ones not allowed."""
    try:
        names = tuple(inspect.signature(model_fn).parameters)
    except (TypeError, ValueError):
        return ("features", "labels", "mode", "params")
    if "features" not in names:
        raise ValueError(
            f"model_fn {model_fn!r} must have a `features` argument; it has {list(names)}."
        )
    unknown = [n for n in names if n not in _MODEL_FN_ARGS]
    if unknown:
        raise ValueError(
            f"model_fn has unexpected argument(s) {unknown}; allowed: {list(_MODEL_FN_ARGS)}."
        )
    return names


@dataclasses.dataclass(frozen=True, eq=False)
class StepBuilder:
    """Builds the train, eval and predict steps of a ``model_fn`` on a mesh.

    Attributes:
      model_fn: ``model_fn(features, labels, mode, params[, config]) -> EstimatorSpec``.
      params: the user's params (without ``batch_size``; each mode's is set when called).
      config: the RunConfig (its seed, ``skip_nonfinite_steps``, ``allow_invalid_labels``;
        ``model_fn`` may take it).
    """

    model_fn: Callable[..., EstimatorSpec]
    params: Mapping[str, Any]
    config: RunConfig
    model_fn_args: tuple[str, ...] = dataclasses.field(init=False)
    layout: layouts.Layout = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_fn_args", check_model_fn(self.model_fn))
        object.__setattr__(self, "layout", self.config.layout)

    def make_mesh(self) -> Mesh:
        """The mesh of the config's replicas (``num_shards``) and cores per replica."""
        return self.layout.make_mesh(self.config.num_shards)

    def build(
        self,
        mesh: Mesh,
        batch_sizes: Mapping[str, int | None],
        accumulation_steps: int | None = None,
    ) -> Steps:
        """The steps on ``mesh``, each mode's model seeing its global batch size per replica.

        ``accumulation_steps`` (default: the config's ``gradient_accumulation_steps``) splits
        each replica's train batch into that many micro-batches; it must divide it (else one
        ``ValueError`` line naming the flag and the valid values).
        """
        k = accumulation_steps or self.config.gradient_accumulation_steps
        self._check_mesh(mesh)
        replicas = layouts.num_replicas(mesh)
        train_size = batch_sizes.get(ModeKeys.TRAIN)
        if train_size is not None:
            micro_batch(train_size, replicas, k)

        def module(mode: str) -> steps_lib.ModelFnModule:
            size = batch_sizes.get(mode)
            per_replica = None if size is None else size // replicas
            if per_replica is not None and mode == ModeKeys.TRAIN:
                per_replica //= k
            return steps_lib.ModelFnModule(
                call=functools.partial(self._call_model_fn, batch_size=per_replica), mode=mode
            )

        train, evaluation, prediction = (
            module(m) for m in (ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)
        )
        eval_first, eval_fn = self._eval_fns(evaluation, mesh)
        return Steps(
            init=functools.partial(_init_state, train),
            train=self._train_fn(train, mesh, block=False, accumulation_steps=k),
            init_eval=functools.partial(_init_variables, evaluation),
            eval=eval_fn,
            rng=jax.random.PRNGKey(self.config.seed),
            train_loop=self._train_fn(train, mesh, block=True, accumulation_steps=k),
            eval_first=eval_first,
            init_predict=functools.partial(_init_variables, prediction),
            predict=self._predict_fn(prediction, mesh),
            serve=functools.partial(steps_lib.serving_outputs, prediction),
            layout=self.layout,
        )

    def _check_mesh(self, mesh: Mesh) -> None:
        """Refuses a mesh without the layout's model axes (one not made by ``make_mesh``)."""
        wanted = self.layout.mesh_axes
        if tuple(mesh.axis_names) != wanted:
            raise ValueError(
                f"The steps of num_cores_per_replica={self.layout.cores_per_replica} need a "
                f"mesh with axes {wanted} (StepBuilder.make_mesh / layouts.Layout.make_mesh); "
                f"got {tuple(mesh.axis_names)}."
            )

    def _call_model_fn(self, features, labels, mode, *, batch_size) -> EstimatorSpec:
        params = dict(self.params)
        params["batch_size"] = batch_size
        available = {
            "features": features,
            "labels": labels,
            "mode": mode,
            "params": params,
            "config": self.config,
        }
        return self.model_fn(**{n: available[n] for n in self.model_fn_args})

    def _train_fn(
        self, module: steps_lib.ModelFnModule, mesh: Mesh, block: bool, accumulation_steps: int
    ) -> Callable:
        """``(state, rng, features, labels) -> (state, StepOutput)`` on the mesh: one step, or
        with ``block`` a device loop over batches stacked ``[n, B, ...]`` (outputs ``[n]``)."""
        step = functools.partial(
            steps_lib.train_step,
            module,
            axis_name=replication.data_axes(mesh),
            skip_nonfinite=self.config.skip_nonfinite_steps,
            accumulation_steps=accumulation_steps,
            unroll_accumulation=accumulation_unrolled(mesh),
        )

        axes = replication.data_axes(mesh)
        batch = P(None, axes) if block else P(axes)
        if self.layout.is_default:

            def per_replica(state, rng, features, labels):
                return step(state, (features, labels), rng)

            def per_replica_loop(state, rng, features, labels):
                return jax.lax.scan(
                    lambda state, batch: step(state, batch, rng), state, (features, labels)
                )

            sharded = jax.shard_map(
                per_replica_loop if block else per_replica,
                mesh=mesh,
                in_specs=(P(), P(), batch, batch),
                out_specs=(P(), P()),
            )
            return jax.jit(sharded, donate_argnums=(0,))
        # FSDP splits parameters over one slice's replicas, never over the slices (DCN).
        layout, replicas = self.layout, layouts.replicas_per_slice(mesh)

        def laid_out_step(dims, state, batch, rng):
            features, labels = layout.constrain(*batch)
            return step(state, (features, labels), rng, param_dims=dims)

        def laid_out(state, rng, features, labels):
            # The parameters' split follows their shapes, known here (traced), not at build.
            dims = layout.param_dims(state.params, replicas)
            specs = layout.state_specs(state, replicas)

            def per_replica(state, rng, features, labels):
                if block:
                    return jax.lax.scan(
                        lambda state, batch: laid_out_step(dims, state, batch, rng),
                        state,
                        (features, labels),
                    )
                return laid_out_step(dims, state, (features, labels), rng)

            # Manual over the replicas only: the model axes are XLA's (spatial partitioning).
            return jax.shard_map(
                per_replica,
                mesh=mesh,
                in_specs=(specs, P(), batch, batch),
                out_specs=(specs, P()),
                axis_names=set(layout.mesh_axes) - set(layout.model_axes),
            )(state, rng, features, labels)

        return jax.jit(laid_out, donate_argnums=(0,))

    def _eval_fns(self, module: steps_lib.ModelFnModule, mesh: Mesh) -> tuple[Callable, Callable]:
        """``(totals, variables, step, features, labels, mask) -> (totals, batch metrics)``."""
        step_fn = functools.partial(
            steps_lib.eval_step,
            module,
            axis_name=replication.data_axes(mesh),
            exclude_invalid_labels=self.config.allow_invalid_labels,
        )

        def per_replica(variables, step, features, labels, mask):
            return step_fn(variables, step, (features, labels), mask)

        batch = P(replication.data_axes(mesh))
        sharded = jax.shard_map(
            per_replica, mesh=mesh, in_specs=(P(), P(), batch, batch, batch), out_specs=P()
        )
        if not self.layout.is_default:
            constrain = self.layout.constrain
            sharded = self._laid_out(
                lambda variables, step, features, labels, mask: step_fn(
                    variables, step, constrain(features, labels), mask
                ),
                mesh,
                in_specs=(P(), batch, batch, batch),
                out_specs=P(),
            )

        def accumulate(totals, variables, step, features, labels, mask):
            batch = sharded(variables, step, features, labels, mask)
            if totals is None:
                return batch, batch
            return totals.merge(batch), batch

        return jax.jit(accumulate), jax.jit(accumulate, donate_argnums=(0,))

    def _predict_fn(self, module: steps_lib.ModelFnModule, mesh: Mesh) -> Callable:
        step_fn = functools.partial(steps_lib.predict_step, module)
        if not self.layout.is_default:
            constrain = self.layout.constrain
            return jax.jit(
                self._laid_out(
                    lambda variables, step, features: step_fn(
                        variables, step, constrain(features, None)[0]
                    ),
                    mesh,
                    in_specs=(P(), P(replication.data_axes(mesh))),
                    out_specs=P(replication.data_axes(mesh)),
                )
            )
        return jax.jit(
            jax.shard_map(
                step_fn,
                mesh=mesh,
                in_specs=(P(), P(), P(replication.data_axes(mesh))),
                out_specs=P(replication.data_axes(mesh)),
            )
        )

    def _laid_out(
        self, fn: Callable[..., Any], mesh: Mesh, in_specs: tuple[Any, ...], out_specs: Any
    ) -> Callable[..., Any]:
        """``fn(variables, *rest)`` per replica under the layout: the variables placed by it
        (FSDP's split parameters gathered whole before ``fn``), manual over the replicas only.
        ``in_specs``: those of ``rest``."""
        layout, replicas = self.layout, layouts.replicas_per_slice(mesh)
        axes = replication.data_axes(mesh)

        def laid_out(variables, *rest):
            params = variables.get("params", {})
            placed = strategies.for_params(layout.param_dims(params, replicas), axes)

            def per_replica(variables, *rest):
                if "params" in variables:  # FSDP's split ones whole (Replicated: as they are)
                    variables = {**variables, "params": placed.gather(variables["params"])}
                return fn(variables, *rest)

            return jax.shard_map(
                per_replica,
                mesh=mesh,
                in_specs=(layout.variables_specs(variables, replicas), *in_specs),
                out_specs=out_specs,
                axis_names=set(layout.mesh_axes) - set(layout.model_axes),
            )(variables, *rest)

        return laid_out


def accumulation_unrolled(mesh: Mesh) -> bool:
    """Whether the train step unrolls its micro-batch loop on ``mesh`` (k copies of the body).

    XLA:CPU runs convolution gradients inside a loop many times slower, so on CPU it is
    unrolled; elsewhere it stays a loop, whose body XLA's cost analysis counts once
    (``utilization`` multiplies by k there, not here).
    """
    return bool(mesh.devices.flat[0].platform == "cpu")


def micro_batch(global_batch: int, num_replicas: int, k: int) -> int:
    """Each replica's micro-batch when ``k`` micro-batches make a step's ``global_batch``.

    Raises:
      ValueError: one line naming ``--gradient_accumulation_steps`` and the values that divide
        the per-replica batch, when k does not.
    """
    per_replica = global_batch // num_replicas
    if k >= 1 and per_replica % k == 0:
        return per_replica // k
    divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
    below = [d for d in divisors if 1 < d < k]
    above = [d for d in divisors if d > k]
    nearest = [*below[-1:], *above[:1]] or [1]
    listed = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
    raise ValueError(
        f"--gradient_accumulation_steps={k} (RunConfig.gradient_accumulation_steps) must divide "
        f"each replica's train batch, {per_replica} (train_batch_size={global_batch} over "
        f"{num_replicas} replica{'s' if num_replicas != 1 else ''}), into equal micro-batches: "
        f"use {' or '.join(map(str, nearest))} (the divisors of {per_replica}: {listed})."
    )


def _init_state(
    module: steps_lib.ModelFnModule, rng: jax.Array, features: Any, labels: Any
) -> steps_lib.TrainState:
    return steps_lib.init_state(module, rng, (features, labels))


def _init_variables(
    module: steps_lib.ModelFnModule, rng: jax.Array, features: Any, labels: Any
) -> dict:
    return steps_lib.init_variables(module, rng, (features, labels))
