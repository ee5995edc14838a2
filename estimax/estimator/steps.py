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
from estimax.parallel import strategies
from estimax.state.train_state import TrainState

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


def l2_excluding_batch_norm(params: Any, model_state: Any, weights: Any = None) -> jax.Array:
    """``sum(l2_loss(w))`` over parameters, skipping those of batch-norm layers.

    A module is a batch-norm layer when it keeps ``batch_stats``: that finds Flax's BatchNorm
    whatever the user named it (the original skipped variables named ``batch_normalization``).
    ``weights``: a tree like ``params`` of each leaf's factor (None: 1 for all).
    """
    bn_paths = {
        path[:-1]
        for path, _ in jax.tree_util.tree_flatten_with_path(model_state.get("batch_stats", {}))[0]
    }
    total = jnp.float32(0)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    factors = [1] * len(leaves) if weights is None else jax.tree.leaves(weights)
    for (path, leaf), factor in zip(leaves, factors, strict=True):
        if path[:-1] in bn_paths:
            continue
        # tf.nn.l2_loss
        total = total + factor * 0.5 * jnp.sum(jnp.square(leaf.astype(jnp.float32)))
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
    axis_name: strategies.AxisName = None,
    skip_nonfinite: bool = False,
    accumulation_steps: int = 1,
    unroll_accumulation: bool = False,
    param_dims: Any = None,
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
      accumulation_steps: k > 1 splits ``batch`` into k micro-batches of ``B / k`` rows (B must
        divide by k), differentiates them one after the other in a ``lax.scan`` and applies
        their mean gradient once (``_accumulated_gradients``): clipping, the skip decision and
        the EMA see that mean, the step counter advances by one.
      unroll_accumulation: unroll that scan (k copies of the body, still run one after the
        other): XLA:CPU's own convolutions run many times slower inside a loop (the guide's
        MNIST CNN without estimax's oneDNN kernels: 3.9 s a step against 0.15 s), so the step
        builder unrolls on CPU; elsewhere the loop keeps one body.
      param_dims: FSDP (``layouts.Layout.param_dims``): a pytree like ``state.params`` giving
        the dimension each leaf is split on over ``axis_name`` (-1: held whole). ``state``
        then holds this replica's slices of those parameters (and of their optimizer state
        and EMA); they are gathered whole (``all_gather``) for the model, and their gradients
        come back as slices (its transpose, a reduce-scatter). None: every leaf whole.

    Returns:
      (the state after the step, its ``StepOutput``: the loss and the spec's scalars as float32
      scalars, the label check and, with ``skip_nonfinite``, whether the step was skipped).
    """
    step = state.step
    placed = strategies.for_params(param_dims, axis_name)
    if accumulation_steps > 1:
        spec, loss, new_model_state, aux, grads = _accumulated_gradients(
            model, state, batch, rng, axis_name, accumulation_steps, unroll_accumulation, placed
        )
    else:
        spec, loss, new_model_state, aux, grads = _gradients(
            model, state, batch, rng, axis_name, placed=placed
        )
    mean = (lambda x: x) if axis_name is None else (lambda x: lax.pmean(x, axis_name))
    grads = placed.mean_gradients(grads)
    if spec.gradient_clip_norm:
        grads = placed.clip_by_global_norm(grads, spec.gradient_clip_norm)
    assert spec.optimizer is not None  # ModelFnModule refuses a TRAIN spec without one
    updates, opt_state = spec.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Batch statistics are computed per replica; keep one consistent (averaged) copy.
    new_model_state = mean(dict(new_model_state))
    ema = _ema(spec.ema_decay, step, state.ema_params, params)
    loss = mean(loss)
    scalars = {k: mean(jnp.asarray(v, jnp.float32)) for k, v in aux["scalars"].items()}
    if "signals" in aux:  # accumulated: reduced over the micro-batches and replicas already
        signals = aux["signals"]
    else:
        signals = _label_signals(aux["label_checks"], axis_name)
    if skip_nonfinite:
        # The gradients are already averaged over replicas, so every replica decides alike.
        finite = jnp.isfinite(loss) & placed.all_finite(grads)
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
    axis_name: strategies.AxisName,
    micro_batch: jax.Array | None = None,
    placed: strategies.ParamStrategy | None = None,
) -> tuple[EstimatorSpec, jax.Array, Any, dict[str, Any], Any]:
    """(spec, this replica's loss, new mutable collections, aux, this replica's gradients).

    ``aux``: ``scalars`` (the spec's), ``label_checks`` (``losses.label_checks``) and
    ``summaries`` (the spec's, this replica's: reduced outside the differentiated function).
    ``micro_batch``: the index of an accumulated micro-batch, folded into the dropout key.
    ``placed``: how the replicas hold the parameters (``strategies.for_params``; None: whole
    on each). Split ones are gathered inside the differentiated function so their gradients
    come back as this replica's slices, summed over replicas.
    """
    placed = placed or strategies.Replicated(axis_name)
    features, labels = batch
    step = state.step
    rng = jax.random.fold_in(rng, step)
    if axis_name is not None:
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
    if micro_batch is not None:
        rng = jax.random.fold_in(rng, micro_batch)
    mutable = list(state.model_state.keys())
    captured: dict[str, EstimatorSpec] = {}

    def loss_fn(params):
        variables = {"params": placed.gather(params), **state.model_state}
        with losses.label_checks() as checks, placed.gathering_in_blocks(params):
            spec, new_model_state = model.apply(
                variables, features, labels, step, rngs={"dropout": rng}, mutable=mutable
            )
        captured["spec"] = spec
        loss, _ = mean_loss(spec.loss)
        if spec.weight_decay:
            l2 = l2_excluding_batch_norm(params, state.model_state, placed.l2_weights())
            loss = loss + spec.weight_decay * l2
        aux = {
            "scalars": _scalars(spec.scalars),
            "label_checks": checks,
            "summaries": summary_lib.check(spec.summaries),
        }
        return loss, (new_model_state, aux)

    # Each replica's gradient its own; otherwise shard_map's autodiff would already sum them.
    params = placed.varying(state.params)
    (loss, (new_model_state, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return captured["spec"], loss, new_model_state, aux, grads


def _accumulated_gradients(
    model: nn.Module,
    state: TrainState,
    batch: tuple[Any, Any],
    rng: jax.Array,
    axis_name: strategies.AxisName,
    k: int,
    unroll: bool = False,
    placed: strategies.ParamStrategy | None = None,
) -> tuple[EstimatorSpec, jax.Array, Any, dict[str, Any], Any]:
    """``_gradients`` of ``batch`` as the mean over k micro-batches of ``B / k`` rows.

    The micro-batches run in a ``lax.scan`` inside the step (one compiled body, whatever k), or
    with ``unroll`` as k copies of its body chained by ``_after`` so that they still run one
    after the other; either way the activations held at once are one micro-batch's (and the
    running sum is one copy of the gradients). The gradients are summed in float32 and
    divided by k, the loss and the spec's scalars are means over the micro-batches, the label
    checks are summed (the largest invalid label kept) and the summaries are the first
    micro-batch's. Mutable collections (batch-norm statistics) are threaded through the
    micro-batches in order: each normalises with its own statistics and updates the moving
    averages, as k smaller steps would. For equal micro-batches the mean of their mean losses
    is the mean over the whole batch, so without batch norm (or dropout, whose key differs per
    micro-batch) the gradient is the whole batch's up to float rounding.

    The spec itself (its optimizer, whose learning rate may depend on ``get_global_step()``,
    its clip norm and EMA decay) comes from tracing ``model`` once more, outside the scan, on
    the first micro-batch: values traced inside the scan's body cannot leave it. That forward
    pass's outputs are unused, so XLA removes it; only the optimizer's hyperparameters remain.

    Returns:
      (spec, loss, new mutable collections, aux, gradients), as ``_gradients``, with
      ``aux["signals"]`` the step's label check already reduced over micro-batches and replicas.
    """
    placed = placed or strategies.Replicated(axis_name)
    micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
    first_features, first_labels = jax.tree.map(lambda x: x[0], micro)
    mutable = list(state.model_state.keys())
    spec, _ = model.apply(
        {"params": placed.gather(state.params), **state.model_state},
        first_features,
        first_labels,
        state.step,
        rngs={"dropout": rng},
        mutable=mutable,
    )
    spec = cast(EstimatorSpec, spec)

    def varying(tree: Any) -> Any:
        # Carries that each replica updates with its own rows differ per replica (shard_map).
        return tree if axis_name is None else lax.pcast(tree, axis_name, to="varying")

    def body(carry: tuple[Any, Any], xs: tuple[jax.Array, Any]) -> tuple[Any, Any]:
        model_state, total = carry
        index, micro_batch = xs
        _, loss, new_model_state, aux, grads = _gradients(
            model,
            dataclasses.replace(state, model_state=model_state),
            micro_batch,
            rng,
            axis_name,
            index,
            placed,
        )
        total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)
        outputs = (loss, aux["scalars"], _label_signals(aux["label_checks"], None))
        return (dict(new_model_state), total), (*outputs, aux["summaries"])

    zeros = jax.tree.map(
        lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), state.params
    )
    carry = (varying(dict(state.model_state)), varying(zeros))
    if unroll:
        outputs = []
        for i in range(k):
            micro_batch = jax.tree.map(lambda x, i=i: x[i], micro)
            if i:
                micro_batch = _after(micro_batch, carry[1])
            carry, out = body(carry, (jnp.int32(i), micro_batch))
            outputs.append(out)
        model_state, total = carry
        loss, scalars, signals, summaries = jax.tree.map(lambda *x: jnp.stack(x), *outputs)
    else:
        (model_state, total), (loss, scalars, signals, summaries) = lax.scan(
            body, carry, (jnp.arange(k, dtype=jnp.int32), micro)
        )
    grads = jax.tree.map(lambda t, p: (t / k).astype(p.dtype), total, state.params)
    scalars = {name: jnp.mean(jnp.asarray(v, jnp.float32)) for name, v in scalars.items()}
    aux = {
        "scalars": scalars,
        "signals": _accumulated_signals(signals, axis_name),
        "summaries": jax.tree.map(lambda x: x[0], summaries),
    }
    return spec, jnp.mean(loss), model_state, aux, grads


def _after(tree: Any, total: Any) -> Any:
    """``tree`` unchanged (bit for bit), made to depend on every leaf of ``total``.

    Unrolled, the micro-batches are independent computations and XLA:CPU's scheduler runs
    them side by side (every micro-batch's first layer, then every second layer, ...): the
    activations of all k are alive at once, as without accumulation, and each layer's working
    set is the whole batch's. Feeding micro-batch i + 1 from the running gradient sum after
    micro-batch i makes them run one after the other: one micro-batch's activations at a time
    (the guide's CNN at k=4: 26 MB of temporaries instead of 95 MB) and a step of 0.65-0.70x
    the CPU time of k=1, as the model alone at the micro-batch (``bench/accumulation.py``),
    instead of 1.0-1.05x. ``lax.optimization_barrier`` does not order them: XLA:CPU
    removes it before scheduling. The dependency is one element of each leaf, turned into an
    exact +0.0 (``(p != p) * 0``: 0 for any p, NaN and Inf included, and not folded by XLA,
    which keeps ``x * 0`` for floats) and subtracted (``-0.0 - 0.0`` is ``-0.0``) or added.
    """
    probes = [leaf.reshape(-1)[-1] for leaf in jax.tree.leaves(total) if leaf.size]
    zero = sum(((p != p).astype(jnp.float32) for p in probes), jnp.float32(0)) * jnp.float32(0)

    def tied(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.bool_:
            return x | (zero != 0)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return x - zero.astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x + zero.astype(x.dtype)
        return x  # e.g. PRNG keys: the numeric features order the micro-batches already

    return jax.tree.map(tied, tree)


def _accumulated_signals(signals: Signals, axis_name: strategies.AxisName) -> Signals:
    """The label checks of k micro-batches (``[k]`` each) as one step's, over all replicas."""
    if signals.invalid_labels is None or signals.invalid_label_example is None:
        return Signals()
    count = jnp.sum(signals.invalid_labels)
    example = jnp.max(signals.invalid_label_example)
    if axis_name is not None:
        count, example = lax.psum(count, axis_name), lax.pmax(example, axis_name)
    assert signals.label_classes is not None
    return Signals(
        invalid_labels=count, invalid_label_example=example, label_classes=signals.label_classes[0]
    )


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


def _label_signals(checks: list[losses.LabelCheck], axis_name: strategies.AxisName) -> Signals:
    """The step's label check over all losses and replicas: the invalid count, the largest
    invalid label and the class count (all None when no loss took integer labels)."""
    if not checks:
        return Signals()
    count = sum((c.num_invalid for c in checks), jnp.int32(0))
    example = jnp.max(jnp.stack([c.example for c in checks]))
    if axis_name is not None:
        count, example = lax.psum(count, axis_name), lax.pmax(example, axis_name)
    return Signals(
        invalid_labels=count.astype(jnp.float32),
        invalid_label_example=example.astype(jnp.float32),
        label_classes=jnp.float32(checks[0].num_classes),
    )


@struct.dataclass
class EvalOutput:
    """What one eval batch returns (summed over replicas); merged over batches, the totals.

    Attributes:
      metrics: ``{"loss": Mean, <metric>: Mean}``: totals and counts.
      signals: the label check (``invalid_labels``: real examples with a label outside
        ``[0, num_classes)``; the largest such label; the class count); None fields when no
        loss took integer labels.
    """

    metrics: dict[str, metrics_lib.Mean]
    signals: Signals

    def merge(self, other: EvalOutput) -> EvalOutput:
        """The totals of both: metrics and counts added, the largest invalid label kept."""
        metrics = jax.tree.map(jnp.add, self.metrics, other.metrics)
        a, b = self.signals, other.signals
        if a.invalid_labels is None or b.invalid_labels is None:
            return EvalOutput(metrics, a)
        most = jnp.maximum(
            jnp.asarray(a.invalid_label_example), jnp.asarray(b.invalid_label_example)
        )
        signals = dataclasses.replace(
            b,
            invalid_labels=jnp.add(a.invalid_labels, b.invalid_labels),
            invalid_label_example=most,
        )
        return EvalOutput(metrics, signals)

    def __getitem__(self, name: str) -> metrics_lib.Mean:
        """A metric by name (``"loss"`` or the spec's)."""
        return self.metrics[name]


def eval_step(
    model: nn.Module,
    variables: Any,
    step: jax.Array,
    batch: tuple[Any, Any],
    mask: jax.Array,
    *,
    axis_name: strategies.AxisName = None,
    exclude_invalid_labels: bool = False,
) -> EvalOutput:
    """The eval metrics of one (padded) batch, reduced under ``mask``, and its label check.

    Args:
      model: an EVAL-mode module returning an ``EstimatorSpec``.
      variables: ``{"params": ..., <collections>: ...}``.
      step: int32 scalar, the checkpoint's global step (what ``get_global_step()`` returns).
      batch: (features, labels) ``[B, ...]``.
      mask: ``[B]`` float32, 1 for real rows and 0 for padding.
      axis_name: the replica axis under ``shard_map`` (totals are summed over it); or None.
      exclude_invalid_labels: leave rows whose integer labels are outside ``[0, num_classes)``
        out of the loss and every metric (they are still counted in the signals). Exact for a
        per-example ``[B]`` loss; a scalar loss has already averaged them in.

    Returns:
      ``EvalOutput``: metric totals and counts, and the label check, to be merged over batches.
    """
    features, labels = batch
    with losses.label_checks() as checks:
        spec = cast(EstimatorSpec, model.apply(variables, features, labels, step))
    invalid_rows, signals = _eval_label_signals(checks, mask)
    if exclude_invalid_labels and invalid_rows is not None:
        mask = mask * (1.0 - invalid_rows.astype(mask.dtype))
    out = {}
    if spec.loss is not None:
        total, count = mean_loss(spec.loss, mask)
        out["loss"] = metrics_lib.Mean(total, count)
    for name, metric in _eval_metrics(spec).items():
        out[name] = metric.reduce(mask)
    if axis_name is None:
        return EvalOutput(out, signals)
    if signals.invalid_labels is not None:
        signals = dataclasses.replace(
            signals,
            invalid_labels=lax.psum(signals.invalid_labels, axis_name),
            invalid_label_example=lax.pmax(signals.invalid_label_example, axis_name),
        )
    return EvalOutput(lax.psum(out, axis_name), signals)


def _eval_label_signals(
    checks: list[losses.LabelCheck], mask: jax.Array
) -> tuple[jax.Array | None, Signals]:
    """(``[B]`` bool: rows with an invalid label, or None; the batch's signals), real rows only.

    A loss whose labels are not batch-shaped (leading size other than B) is counted by its own
    count but cannot be left out row by row.
    """
    if not checks:
        return None, Signals()
    rows = mask.shape[0]
    real = mask > 0
    invalid_rows = jnp.zeros([rows], bool)
    unplaced = jnp.int32(0)
    example: jax.Array = jnp.int32(jnp.iinfo(jnp.int32).min)
    for check in checks:
        labels = check.labels
        if labels.ndim == 0 or labels.shape[0] != rows:
            unplaced, example = unplaced + check.num_invalid, jnp.maximum(example, check.example)
            continue
        invalid = ((labels < 0) | (labels >= check.num_classes)) & real.reshape(
            (rows,) + (1,) * (labels.ndim - 1)
        )
        invalid_rows = invalid_rows | invalid.reshape(rows, -1).any(axis=1)
        found = jnp.max(jnp.where(invalid, labels, jnp.iinfo(jnp.int32).min))
        example = jnp.maximum(example, found)
    count = jnp.sum(invalid_rows.astype(jnp.int32)) + unplaced
    return invalid_rows, Signals(
        invalid_labels=count.astype(jnp.float32),
        invalid_label_example=jnp.asarray(example).astype(jnp.float32),
        label_classes=jnp.float32(checks[0].num_classes),
    )


# Keys ``Estimator.evaluate`` sets in its results itself (the original refused "loss" too).
_EVAL_RESULT_KEYS = ("loss", "global_step", "num_examples", "invalid_labels")


def _eval_metrics(spec: EstimatorSpec) -> dict[str, metrics_lib.PerExample]:
    """The spec's eval metrics, refusing a name the evaluation results use for their own."""
    metrics = metrics_lib.from_spec(spec.eval_metrics)
    for name in _EVAL_RESULT_KEYS:
        if name in metrics:
            raise ValueError(
                f"EstimatorSpec(eval_metrics={{{name!r}: ...}}): {name!r} is a key the "
                f"evaluation results set themselves ({', '.join(_EVAL_RESULT_KEYS)}); give "
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
