"""The pure steps and the periodic-action primitive, on their own (no Estimator, no mesh)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.estimator import periodic, steps


def model_fn(features, labels, mode):
    x = nn.BatchNorm(use_running_average=mode != ex.ModeKeys.TRAIN, momentum=0.9)(features)
    logits = nn.Dense(3)(nn.relu(nn.Dense(8)(x)))
    loss = None if labels is None else ex.losses.softmax_cross_entropy(logits, labels)
    return ex.EstimatorSpec(
        mode=mode,
        loss=loss,
        optimizer=optax.sgd(0.5),
        eval_metrics=None if labels is None else {"accuracy": ex.metrics.accuracy(labels, logits)},
        predictions={"classes": jnp.argmax(logits, -1)},
        scalars={"step_seen": ex.get_global_step().astype(jnp.float32)},
    )


def batches(n, size=16, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        x = rng.normal(size=(size, 5)).astype(np.float32)
        yield x, (x[:, 0] > 0).astype(np.int32)


def test_train_step_is_a_plain_sgd_step_on_one_device():
    model = steps.ModelFnModule(call=model_fn, mode=ex.ModeKeys.TRAIN)
    batch = next(batches(1))
    rng = jax.random.PRNGKey(0)
    state = steps.init_state(model, rng, batch)
    new_state, metrics = jax.jit(functools.partial(steps.train_step, model))(state, batch, rng)

    def loss_of(params):
        spec, _ = model.apply(
            {"params": params, **state.model_state}, *batch, state.step, mutable=["batch_stats"]
        )
        return jnp.mean(spec.loss)

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, state.params, grads)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        new_state.params,
        expected,
    )
    assert int(new_state.step) == 1
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    assert float(metrics["step_seen"]) == 0.0  # get_global_step() is the step being taken
    # The batch statistics moved towards this batch's.
    assert not np.allclose(
        new_state.model_state["batch_stats"]["BatchNorm_0"]["mean"],
        state.model_state["batch_stats"]["BatchNorm_0"]["mean"],
    )


def test_eval_and_predict_steps_mask_padding():
    train = steps.ModelFnModule(call=model_fn, mode=ex.ModeKeys.TRAIN)
    x, y = next(batches(1, size=8))
    variables = steps.init_variables(train, jax.random.PRNGKey(1), (x, y))
    step = jnp.int32(0)
    evaluator = steps.ModelFnModule(call=model_fn, mode=ex.ModeKeys.EVAL)
    mask = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)
    out = steps.eval_step(evaluator, variables, step, (x, y), mask)
    predictor = steps.ModelFnModule(call=model_fn, mode=ex.ModeKeys.PREDICT)
    classes = np.asarray(steps.predict_step(predictor, variables, step, x)["classes"])
    assert classes.shape == (8,)
    # Only the 5 real rows count.
    assert float(out["accuracy"].count) == 5.0
    np.testing.assert_allclose(out["accuracy"].compute(), np.mean(classes[:5] == y[:5]))
    assert float(out["loss"].count) == 5.0


def test_estimator_runs_the_same_steps(tmp_path):
    """The Estimator's streamed loop (3, 3, 1 steps) equals a hand loop over train_step."""
    data = list(batches(7))
    model = steps.ModelFnModule(call=model_fn, mode=ex.ModeKeys.TRAIN)
    state = steps.init_state(model, jax.random.PRNGKey(0), (data[0][0][:16], data[0][1][:16]))
    step = jax.jit(functools.partial(steps.train_step, model))
    for batch in data:
        state, _ = step(state, batch, jax.random.PRNGKey(0))

    est = ex.Estimator(
        lambda features, labels, mode: model_fn(features, labels, mode),
        ex.RunConfig(
            model_dir=str(tmp_path), iterations_per_loop=3, num_shards=1, save_checkpoints_steps=3
        ),
        train_batch_size=16,
    )
    est.train(lambda params: iter(data), max_steps=7)
    got = est.get_variables()
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        got["params"],
        jax.device_get(state.params),
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        got["batch_stats"],
        jax.device_get(state.model_state["batch_stats"]),
    )


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_periodic_action_every_steps_and_every_secs():
    clock = FakeClock()
    by_steps = periodic.PeriodicAction(every_steps=5, clock=clock, start_step=2)
    ran = [s for s in range(3, 30, 3) if by_steps(s, lambda s: None)]
    assert ran == [9, 15, 21, 27]  # >= 5 steps after the last firing, checked every 3 steps
    by_secs = periodic.PeriodicAction(every_secs=10.0, clock=clock)
    assert not by_secs.due(1)
    clock.now += 9.5
    assert not by_secs.due(2)
    clock.now += 0.5
    assert by_secs.due(3)
    by_secs.fired(3)
    assert not by_secs.due(4) and by_secs.seconds_since_fired() == 0.0
    assert not by_secs.due(3)  # never twice at one step, even when forced by time
    assert by_secs(4, lambda s: None, force=True)
    with pytest.raises(ValueError, match="every_steps must be >= 1"):
        periodic.PeriodicAction(every_steps=0)


def test_steps_due_lists_the_grid_and_the_first_step():
    assert periodic.steps_due(0, 10, 4, first=1) == [1, 4, 8]
    assert periodic.steps_due(10, 13, 4, first=1) == [12]
    assert periodic.steps_due(13, 15, 4) == []
