"""Pure steps: ``train_step``, ``eval_step``, ``predict_step`` and the state they carry.

Each step is a function of its inputs only (no Estimator, no mesh, no host state), the shape of
flax's and keras' JAX trainers: ``train_step(model, state, batch, rng) -> (state, metrics)``.
``model`` is a Flax module whose ``__call__(features, labels, step)`` returns an
``EstimatorSpec`` (``ModelFnModule`` wraps a user's ``model_fn`` so); bind it with
``functools.partial`` to get ``train_step(state, batch, rng)``. With ``axis_name`` set, a step runs
on one replica's slice of the batch inside ``shard_map`` and the collectives over that axis make
it global (the Estimator does that wiring); without it, it is an ordinary single-device step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax

from estimax.estimator import losses
from estimax.estimator import metrics as metrics_lib
from estimax.estimator import summary as summary_lib
from estimax.estimator.spec import EstimatorSpec, ModeKeys

_tracing = threading.local()


def get_global_step() -> jax.Array:
    """Returns the global step (int32 scalar) inside a ``model_fn`` being traced.

    The counterpart of ``tf.train.get_global_step()``: use it for learning-rate schedules and
    epoch counters written from ``model_fn``. In TRAIN it is the step being taken (0 for the
    first); in EVAL/PREDICT, the step of the checkpoint in use.
    """
    step = getattr(_tracing, "step", None)
    if step is None:
        raise RuntimeError(
            "estimax.get_global_step() can only be called inside a model_fn "
            "while the Estimator runs it."
        )
    return step


@contextlib.contextmanager
def global_step_scope(step: jax.Array) -> Iterator[None]:
    """Makes ``get_global_step()`` return ``step`` while a ``model_fn`` is traced in this block."""
    previous = getattr(_tracing, "step", None)
    _tracing.step = step
    try:
        yield
    finally:
        _tracing.step = previous


@struct.dataclass
class TrainState:
    """Everything a checkpoint holds besides the input position."""

    step: jax.Array
    params: Any
    model_state: Any  # mutable collections other than params, e.g. batch_stats
    opt_state: Any
    ema_params: Any  # {} when the spec asks for no EMA


class ModelFnModule(nn.Module):
    """Runs a ``model_fn`` (bound to its params: ``call(features, labels, mode)``) as a module.

    The layers the ``model_fn`` creates are owned by this module, so ``init``/``apply`` give
    their variables. ``__call__(features, labels, step)`` returns the ``EstimatorSpec``, checked.
    """

    call: Callable[..., EstimatorSpec]
    mode: str

    @nn.compact
    def __call__(self, features, labels, step):
        with global_step_scope(step):
            spec = self.call(features, labels, self.mode)
        check_spec(spec, self.mode)
        return spec


def check_spec(spec: Any, mode: str) -> None:
    """Raises a ValueError/TypeError naming what a ``model_fn`` left out for ``mode``."""
    if not isinstance(spec, EstimatorSpec):
        raise TypeError(
            f"model_fn must return an estimax.EstimatorSpec, got {type(spec).__name__}."
        )
    if mode == ModeKeys.TRAIN:
        if spec.loss is None:
            raise ValueError("model_fn returned no loss in TRAIN mode.")
        if spec.optimizer is None:
            raise ValueError(
                "model_fn returned no optimizer in TRAIN mode: set "
                "EstimatorSpec(optimizer=optax....); it replaces train_op."
            )
    if mode == ModeKeys.EVAL and spec.loss is None and not spec.eval_metrics:
        raise ValueError("model_fn returned neither loss nor eval_metrics in EVAL mode.")
    if mode == ModeKeys.PREDICT and spec.predictions is None:
        raise ValueError("model_fn returned no predictions in PREDICT mode.")


def mean_loss(loss: Any, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns (sum of losses over real rows, number of real rows) for a scalar or [B] loss.

    Without a mask: (the mean loss, 1).
    """
    loss = jnp.asarray(loss, jnp.float32)
    if mask is None:
        return (jnp.mean(loss) if loss.ndim else loss), jnp.float32(1)
    if loss.ndim == 0:
        # A scalar loss cannot tell padding rows apart: weight it by the real rows. Exact unless
        # the batch is ragged; return per-example losses [B] for an exact eval loss.
        return loss * jnp.sum(mask), jnp.sum(mask)
    per_example = loss.reshape(mask.shape[0], -1).mean(axis=1)
    return jnp.sum(per_example * mask), jnp.sum(mask)


def l2_excluding_batch_norm(params: Any, model_state: Any) -> jax.Array:
    """``sum(l2_loss(w))`` over parameters, skipping those of batch-norm layers.

    A module is a batch-norm layer when it keeps ``batch_stats``: that finds Flax's BatchNorm
    whatever the user named it (the original skipped variables named ``batch_normalization``).
    """
    bn_paths = {
        path[:-1]
        for path, _ in jax.tree_util.tree_flatten_with_path(model_state.get("batch_stats", {}))[0]
    }
    total = jnp.float32(0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if path[:-1] in bn_paths:
            continue
        total = total + 0.5 * jnp.sum(jnp.square(leaf.astype(jnp.float32)))  # tf.nn.l2_loss
    return total


def init_variables(model: nn.Module, rng: jax.Array, batch: tuple[Any, Any]) -> dict:
    """Returns the variables ``model`` creates on ``batch`` = (features, labels)."""
    params_rng, dropout_rng = jax.random.split(rng)
    features, labels = batch
    return dict(
        model.init(
            {"params": params_rng, "dropout": dropout_rng},
            features,
            labels,
            jnp.zeros((), jnp.int32),
        )
    )


def init_state(model: nn.Module, rng: jax.Array, batch: tuple[Any, Any]) -> TrainState:
    """Returns the step-0 ``TrainState`` of a TRAIN-mode ``model`` on ``batch``.

    The optimizer (and whether an EMA is kept) comes from the spec the model returns.
    """
    params_rng, dropout_rng = jax.random.split(rng)
    features, labels = batch
    spec, variables = model.init_with_output(
        {"params": params_rng, "dropout": dropout_rng}, features, labels, jnp.zeros((), jnp.int32)
    )
    variables = dict(variables)
    params = variables.pop("params", {})
    ema = params if spec.ema_decay else {}
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        model_state=variables,
        opt_state=spec.optimizer.init(params),
        ema_params=ema,
    )


@struct.dataclass
class Signals:
    """What a training step tells the loop besides the user's metrics (None: not computed).

    Attributes:
      nonfinite_skipped: float32, 1.0 if the step was skipped for a non-finite loss or gradient
        (``RunConfig.skip_nonfinite_steps``), else 0.0; None without that option.
      invalid_labels: float32, the integer labels outside ``[0, num_classes)`` over every loss
        and replica (``losses.label_checks``); None when no loss took integer labels.
      invalid_label_example: float32, the largest such label (meaningful when the count is > 0).
      label_classes: float32, the number of classes of the first checked loss.
    """

    nonfinite_skipped: jax.Array | None = None
    invalid_labels: jax.Array | None = None
    invalid_label_example: jax.Array | None = None
    label_classes: jax.Array | None = None


@struct.dataclass
class StepOutput:
    """What one training step returns besides the state; stacked, what one loop returns.

    The user's metrics, the framework's signals and the summaries are separate fields, so no
    name a user picks can collide with the loop's own. Each leaf is a scalar per step (``[n]``
    once a loop's outputs are stacked).

    Attributes:
      loss: float32, the mean loss over replicas.
      scalars: ``EstimatorSpec.scalars`` (float32, means over replicas).
      signals: the framework's per-step signals.
      summaries: ``EstimatorSpec.summaries`` reduced over replicas (images, histograms, text),
        or None; never kept per step (the loop keeps summary steps' only).
    """

    loss: jax.Array
    scalars: dict[str, jax.Array]
    signals: Signals
    summaries: dict[str, Any] | None = None

    def metrics(self) -> dict[str, Any]:
        """``{"loss": ..., <scalar>: ...}``: what is logged and what hooks see."""
        return {"loss": self.loss, **self.scalars}

    def __getitem__(self, name: str) -> Any:
        """A metric by name, else a signal by its field name (convenient in tests)."""
        metrics = self.metrics()
        if name in metrics:
            return metrics[name]
        if name in _SIGNAL_NAMES and getattr(self.signals, name) is not None:
            return getattr(self.signals, name)
        raise KeyError(name)


_SIGNAL_NAMES = frozenset(f.name for f in dataclasses.fields(Signals))


def train_step(
    model: nn.Module,
    state: TrainState,
    batch: tuple[Any, Any],
    rng: jax.Array,
    *,
    axis_name: str | None = None,
    skip_nonfinite: bool = False,
) -> tuple[TrainState, StepOutput]:
    """One optimizer step on ``batch`` = (features, labels).

    The dropout key of the step is ``rng`` folded with ``state.step`` (and the replica index
    when ``axis_name`` is set), so a step's randomness depends only on its number: resumed runs
    repeat it exactly. With ``axis_name``, the applied gradient and the mutable collections are
    means over replicas (``CrossShardOptimizer`` semantics).

    Args:
      model: a TRAIN-mode module returning an ``EstimatorSpec`` (``ModelFnModule``).
      state: the state before the step.
      batch: (features, labels), each a pytree of arrays ``[B, ...]`` (labels may be None).
      rng: the run's base PRNG key.
      axis_name: the replica axis when run under ``shard_map``; None on one device.
      skip_nonfinite: when the loss or any gradient is NaN/Inf, keep params, optimizer state,
        mutable collections and EMA as they were (the step counter still advances, so the
        input position and schedules stay aligned); decided on the device, no host sync.

    Returns:
      (the state after the step, its ``StepOutput``: the loss and the spec's scalars as float32
      scalars, the label check and, with ``skip_nonfinite``, whether the step was skipped).
    """
    step = state.step
    spec, loss, new_model_state, aux, grads = _gradients(model, state, batch, rng, axis_name)
    mean = (lambda x: x) if axis_name is None else (lambda x: lax.pmean(x, axis_name))
    grads = mean(grads)
    if spec.gradient_clip_norm:
        grads, _ = optax.clip_by_global_norm(spec.gradient_clip_norm).update(grads, None)
    assert spec.optimizer is not None  # ModelFnModule refuses a TRAIN spec without one
    updates, opt_state = spec.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Batch statistics are computed per replica; keep one consistent (averaged) copy.
    new_model_state = mean(dict(new_model_state))
    ema = _ema(spec.ema_decay, step, state.ema_params, params)
    loss = mean(loss)
    scalars = {k: mean(jnp.asarray(v, jnp.float32)) for k, v in aux["scalars"].items()}
    signals = _label_signals(aux["label_checks"], axis_name)
    if skip_nonfinite:
        # The gradients are already averaged over replicas, so every replica decides alike.
        finite = jnp.isfinite(loss) & _all_finite(grads)
        params, opt_state, new_model_state, ema = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state, new_model_state, ema),
            (state.params, state.opt_state, dict(state.model_state), state.ema_params),
        )
        skipped = jnp.where(finite, 0.0, 1.0).astype(jnp.float32)
        signals = dataclasses.replace(signals, nonfinite_skipped=skipped)
    summaries = summary_lib.reduce(aux["summaries"], axis_name) if aux["summaries"] else None
    out = StepOutput(loss, scalars, signals, summaries)
    return TrainState(step + 1, params, new_model_state, opt_state, ema), out


def _gradients(
    model: nn.Module,
    state: TrainState,
    batch: tuple[Any, Any],
    rng: jax.Array,
    axis_name: str | None,
) -> tuple[EstimatorSpec, jax.Array, Any, dict[str, Any], Any]:
    """(spec, this replica's loss, new mutable collections, aux, this replica's gradients).

    ``aux``: ``scalars`` (the spec's), ``label_checks`` (``losses.label_checks``) and
    ``summaries`` (the spec's, this replica's: reduced outside the differentiated function).
    """
    features, labels = batch
    step = state.step
    rng = jax.random.fold_in(rng, step)
    if axis_name is not None:
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
    mutable = list(state.model_state.keys())
    captured: dict[str, EstimatorSpec] = {}

    def loss_fn(params):
        variables = {"params": params, **state.model_state}
        with losses.label_checks() as checks:
            spec, new_model_state = model.apply(
                variables, features, labels, step, rngs={"dropout": rng}, mutable=mutable
            )
        captured["spec"] = spec
        loss, _ = mean_loss(spec.loss)
        if spec.weight_decay:
            loss = loss + spec.weight_decay * l2_excluding_batch_norm(params, state.model_state)
        aux = {
            "scalars": _scalars(spec.scalars),
            "label_checks": checks,
            "summaries": summary_lib.check(spec.summaries),
        }
        return loss, (new_model_state, aux)

    params = state.params
    if axis_name is not None:
        # Mark the (replicated) params as varying per replica before differentiating, so each
        # replica's gradient is its own; otherwise shard_map's autodiff would already sum them.
        params = lax.pcast(params, axis_name, to="varying")
    (loss, (new_model_state, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return captured["spec"], loss, new_model_state, aux, grads


def _ema(decay: float | None, step: jax.Array, ema: Any, params: Any) -> Any:
    """The moving average of the weights after a step (``ema`` unchanged without a decay)."""
    if not decay:
        return ema
    # tf.train.ExponentialMovingAverage(decay, num_updates=global_step)
    n = (step + 1).astype(jnp.float32)
    rate = jnp.minimum(decay, (1.0 + n) / (10.0 + n))
    return jax.tree.map(lambda e, p: rate * e + (1.0 - rate) * p, ema, params)


def _scalars(scalars: Any) -> dict[str, Any]:
    """``EstimatorSpec.scalars`` as a dict, refusing values that are not one number."""
    out = dict(scalars or {})
    if "loss" in out:
        raise ValueError(
            "EstimatorSpec(scalars={'loss': ...}): 'loss' is the training loss, which the "
            "Estimator writes itself; give this scalar another name (e.g. 'total_loss')."
        )
    for name, value in out.items():
        shape = jnp.shape(value)
        if int(np.prod(shape)) != 1:
            raise ValueError(
                f"EstimatorSpec(scalars={{{name!r}: ...}}) has shape {shape}: scalars are one "
                "number per step (reduce it, e.g. jnp.mean); images, histograms and text go in "
                "summaries="
            )
    return out


def _label_signals(
    checks: list[tuple[jax.Array, jax.Array, int]], axis_name: str | None
) -> Signals:
    """The step's label check over all losses and replicas: the invalid count, the largest
    invalid label and the class count (all None when no loss took integer labels)."""
    if not checks:
        return Signals()
    count = sum((c for c, _, _ in checks), jnp.int32(0))
    example = jnp.max(jnp.stack([e for _, e, _ in checks]))
    if axis_name is not None:
        count, example = lax.psum(count, axis_name), lax.pmax(example, axis_name)
    return Signals(
        invalid_labels=count.astype(jnp.float32),
        invalid_label_example=example.astype(jnp.float32),
        label_classes=jnp.float32(checks[0][2]),
    )


def _all_finite(tree: Any) -> jax.Array:
    """A bool scalar: every element of every leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def eval_step(
    model: nn.Module,
    variables: Any,
    step: jax.Array,
    batch: tuple[Any, Any],
    mask: jax.Array,
    *,
    axis_name: str | None = None,
) -> dict[str, metrics_lib.Mean]:
    """The eval metrics of one (padded) batch, reduced under ``mask``.

    Args:
      model: an EVAL-mode module returning an ``EstimatorSpec``.
      variables: ``{"params": ..., <collections>: ...}``.
      step: int32 scalar, the checkpoint's global step (what ``get_global_step()`` returns).
      batch: (features, labels) ``[B, ...]``.
      mask: ``[B]`` float32, 1 for real rows and 0 for padding.
      axis_name: the replica axis under ``shard_map`` (totals are summed over it); or None.

    Returns:
      ``{"loss": Mean, <metric>: Mean}``: totals and counts, to be summed over batches.
    """
    features, labels = batch
    spec = cast(EstimatorSpec, model.apply(variables, features, labels, step))
    out = {}
    if spec.loss is not None:
        total, count = mean_loss(spec.loss, mask)
        out["loss"] = metrics_lib.Mean(total, count)
    for name, metric in _eval_metrics(spec).items():
        out[name] = metric.reduce(mask)
    return out if axis_name is None else lax.psum(out, axis_name)


# Keys ``Estimator.evaluate`` sets in its results itself (the original refused "loss" too).
_EVAL_RESULT_KEYS = ("loss", "global_step", "num_examples")


def _eval_metrics(spec: EstimatorSpec) -> dict[str, metrics_lib.PerExample]:
    """The spec's eval metrics, refusing a name the evaluation results use for their own."""
    metrics = metrics_lib.from_spec(spec.eval_metrics)
    for name in _EVAL_RESULT_KEYS:
        if name in metrics:
            raise ValueError(
                f"EstimatorSpec(eval_metrics={{{name!r}: ...}}): {name!r} is a key the "
                "evaluation results set themselves (loss, global_step, num_examples); give "
                "this metric another name."
            )
    return metrics


def predict_step(model: nn.Module, variables: Any, step: jax.Array, features: Any) -> Any:
    """The predictions ``[B, ...]`` (an array or a dict of them) of a PREDICT-mode ``model``."""
    return cast(EstimatorSpec, model.apply(variables, features, None, step)).predictions


def serving_outputs(model: nn.Module, variables: Any, step: jax.Array, features: Any) -> Any:
    """What an export returns: the spec's first ``export_outputs`` entry, else its predictions."""
    spec = cast(EstimatorSpec, model.apply(variables, features, None, step))
    if spec.export_outputs:
        return next(iter(spec.export_outputs.values()))
    return spec.predictions
