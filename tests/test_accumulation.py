"""``RunConfig(gradient_accumulation_steps=k)``: k micro-batches per optimizer step (issue #39).

The input still feeds the global batch (``train_batch_size``, the optimizer's batch); each
replica splits its share into k micro-batches inside the jitted step. Tiny models on the 8
forced CPU devices (conftest).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.estimator import steps as steps_lib
from estimax.estimator.spec import ModeKeys
from estimax.programs import cli, configs

# Measured on the parity run below (8 CPU devices, float32): the largest difference of a
# parameter after 8 steps was 6e-8, of a step's loss 1e-7. The tolerance leaves room for
# another XLA's reduction order, not for a different computation (a wrong mean is ~1e-2).
PARAMS_ATOL = 1e-6
LOSS_RTOL = 1e-6
# LLVM at level 0 (as tests/test_models.py): XLA's HLO passes and buffer assignment, which
# decide the temporaries, are the default's; the machine code is compiled several times faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class Mlp(nn.Module):
    """No batch norm, no dropout: k micro-batches equal one batch up to float rounding."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.tanh(nn.Dense(16)(x)))


def mlp_model_fn(features, labels, mode, params):
    logits = Mlp()(features)
    lr = optax.exponential_decay(0.5, 2, 0.5)(ex.get_global_step())
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(lr, momentum=0.9),
        predictions=logits,
        scalars={"learning_rate": lr, "micro_batch": jnp.float32(params["batch_size"])},
        weight_decay=1e-3,
    )


def data(n=512, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, 5).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)


class Recorder(ex.SessionRunHook):
    """Every step's metrics, by step number."""

    def __init__(self):
        self.by_step: dict[str, dict[int, float]] = {}

    def after_run(self, run_context, run_values):
        for name, values in run_values.results.items():
            for step, value in zip(run_values.steps, np.asarray(values), strict=True):
                self.by_step.setdefault(name, {})[int(step)] = float(value)


def train(model_dir, k, max_steps, model_fn=mlp_model_fn, shuffle=False, **config):
    x, y = data()
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(
            model_dir=str(model_dir),
            gradient_accumulation_steps=k,
            **{"iterations_per_loop": 4, **config},
        ),
        train_batch_size=64,
    )
    recorder = Recorder()
    est.train(ex.numpy_input_fn(x, y, shuffle=shuffle), max_steps=max_steps, hooks=[recorder])
    return est, recorder


def test_k_micro_batches_equal_one_batch_of_k_times_b(tmp_path):
    # 64 over 8 replicas: 8 rows each, as 4 micro-batches of 2 (k=4) or one batch of 8.
    big, big_rec = train(tmp_path / "one", 1, 8)
    acc, acc_rec = train(tmp_path / "four", 4, 8)
    assert big.get_global_step() == acc.get_global_step() == 8
    np.testing.assert_allclose(
        [acc_rec.by_step["loss"][s] for s in range(1, 9)],
        [big_rec.by_step["loss"][s] for s in range(1, 9)],
        rtol=LOSS_RTOL,
    )
    for a, b in zip(
        jax.tree.leaves(acc.get_variables()), jax.tree.leaves(big.get_variables()), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=PARAMS_ATOL)
    # The model sees the per-replica micro-batch.
    assert set(acc_rec.by_step["micro_batch"].values()) == {2.0}
    assert set(big_rec.by_step["micro_batch"].values()) == {8.0}


def test_global_step_and_the_schedule_count_optimizer_steps(tmp_path):
    est, rec = train(tmp_path, 8, 6, save_checkpoints_steps=3, iterations_per_loop=3)
    assert est.get_global_step() == 6
    assert est.latest_checkpoint().endswith("/6")
    schedule = optax.exponential_decay(0.5, 2, 0.5)
    steps = sorted(rec.by_step["learning_rate"])
    assert steps == [1, 2, 3, 4, 5, 6]  # one metric per optimizer step
    np.testing.assert_allclose(
        [rec.by_step["learning_rate"][s] for s in steps],
        [schedule(s - 1) for s in steps],
        rtol=1e-6,  # the mean of k equal float32 values
    )


# ------------------------------------------------- clipping and EMA on the optimizer step


def _linear_model_fn(clip=None, ema=None):
    def model_fn(features, labels, mode, params):
        w = nn.Dense(1, use_bias=False, kernel_init=nn.initializers.zeros)(features)
        # d loss / d w = mean(features): each micro-batch's gradient is its rows' mean.
        return ex.EstimatorSpec(
            mode=mode,
            loss=jnp.mean(w),
            optimizer=optax.sgd(1.0),
            gradient_clip_norm=clip,
            ema_decay=ema,
        )

    return model_fn


def _one_step(model_fn, features, k):
    module = steps_lib.ModelFnModule(call=lambda f, y, m: model_fn(f, y, m, {}), mode="train")
    state = steps_lib.init_state(module, jax.random.PRNGKey(0), (features[:1], None))
    step = jax.jit(
        lambda s, f: steps_lib.train_step(
            module, s, (f, None), jax.random.PRNGKey(1), accumulation_steps=k
        )
    )
    return step(state, features)


def test_clipping_applies_to_the_accumulated_gradient():
    # Micro-batch gradients +10 and -6: their mean, 2, clips to 1 (w: 0 -> -1). Clipping each
    # micro-batch (+1, -1) would average to 0 and leave w at 0; no clipping would give -2.
    features = jnp.array([[10.0], [10.0], [-6.0], [-6.0]])
    state, out = _one_step(_linear_model_fn(clip=1.0), features, 2)
    np.testing.assert_allclose(np.asarray(state.params["Dense_0"]["kernel"]), [[-1.0]])
    assert int(state.step) == 1
    np.testing.assert_allclose(float(out.loss), 0.0)  # mean over micro-batches, before update
    unclipped, _ = _one_step(_linear_model_fn(), features, 2)
    np.testing.assert_allclose(np.asarray(unclipped.params["Dense_0"]["kernel"]), [[-2.0]])


def test_ema_is_updated_once_per_optimizer_step():
    features = jnp.array([[10.0], [10.0], [-6.0], [-6.0]])
    state, _ = _one_step(_linear_model_fn(ema=0.9), features, 4)
    # tf.train.ExponentialMovingAverage at num_updates=1: rate min(0.9, 2/11); from ema 0 to
    # params -2 once. Four updates (one per micro-batch) would leave a different average.
    rate = min(0.9, 2 / 11)
    np.testing.assert_allclose(
        np.asarray(state.ema_params["Dense_0"]["kernel"]), [[(1 - rate) * -2.0]], rtol=1e-6
    )
    whole, _ = _one_step(_linear_model_fn(ema=0.9), features, 1)
    np.testing.assert_allclose(
        np.asarray(state.ema_params["Dense_0"]["kernel"]),
        np.asarray(whole.ema_params["Dense_0"]["kernel"]),
    )


# ------------------------------------------------- resume, batch norm, dropout


class BnDropNet(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(16)(x))
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


def bn_model_fn(features, labels, mode, params):
    logits = BnDropNet()(features, mode == ModeKeys.TRAIN)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.adam(1e-2),
        predictions=logits,
        ema_decay=0.99,
        gradient_clip_norm=1.0,
    )


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    run = dict(model_fn=bn_model_fn, shuffle=True, save_checkpoints_steps=3, iterations_per_loop=3)
    whole, whole_rec = train(tmp_path / "whole", 2, 9, **run)
    train(tmp_path / "parts", 2, 3, **run)
    train(tmp_path / "parts", 2, 6, **run)
    resumed, resumed_rec = train(tmp_path / "parts", 2, 9, **run)
    assert resumed.get_global_step() == 9
    # Same batches (the input position), same dropout keys (per step and micro-batch), same
    # batch statistics: the same numbers, bit for bit.
    assert [resumed_rec.by_step["loss"][s] for s in (7, 8, 9)] == [
        whole_rec.by_step["loss"][s] for s in (7, 8, 9)
    ]
    for a, b in zip(
        jax.tree.leaves(resumed.get_variables()),
        jax.tree.leaves(whole.get_variables()),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_batch_norm_statistics_are_updated_per_micro_batch():
    class Bn(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False, momentum=0.5)(x)

    def model_fn(features, labels, mode, params):
        return ex.EstimatorSpec(
            mode=mode, loss=jnp.mean(Bn()(features) ** 2), optimizer=optax.sgd(0.0)
        )

    features = jnp.array([[0.0], [2.0], [10.0], [12.0]])  # micro-batch means 1 and 11
    state, _ = _one_step(model_fn, features, 2)
    # The moving mean, from 0, updated once per micro-batch: 0.5 * (0.5 * 0 + 0.5 * 1) + 0.5 * 11.
    mean = state.model_state["batch_stats"]["Bn_0"]["BatchNorm_0"]["mean"]
    np.testing.assert_allclose(np.asarray(mean), [0.25 + 5.5])


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Conv(8, (3, 3))(x.reshape(-1, 16, 16, 1)))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def conv_model_fn(features, labels, mode, params):
    logits = ConvNet()(features, mode == ModeKeys.TRAIN)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.1),
        predictions=logits,
    )


def test_unrolled_micro_batches_run_one_after_the_other():
    # On CPU the step unrolls its micro-batch loop; the k copies must still run in turn, or
    # XLA:CPU runs them side by side and holds every micro-batch's activations at once.
    module = steps_lib.ModelFnModule(call=lambda f, y, m: conv_model_fn(f, y, m, {}), mode="train")
    rs = np.random.RandomState(0)
    batch = (rs.randn(64, 256).astype(np.float32), rs.randint(0, 3, 64).astype(np.int32))
    state = steps_lib.init_state(module, jax.random.PRNGKey(0), (batch[0][:1], batch[1][:1]))

    def compiled(k, unroll):
        step = functools.partial(
            steps_lib.train_step,
            module,
            rng=jax.random.PRNGKey(1),
            accumulation_steps=k,
            unroll_accumulation=unroll,
        )
        return jax.jit(step).lower(state, batch).compile(FAST_COMPILE)

    whole, unrolled, rolled = compiled(1, False), compiled(4, True), compiled(4, False)
    # Measured: 3.7 MB of temporaries at k=1, 1.7 MB as 4 chained micro-batches (0.46x), and
    # 1.02x side by side (the micro-batches independent).
    temp = [c.memory_analysis().temp_size_in_bytes for c in (whole, unrolled)]
    assert temp[1] < 0.6 * temp[0]
    # The same step as the loop: dropout keys, batch statistics and the gradient sum in order.
    (after_u, out_u), (after_r, out_r) = unrolled(state, batch), rolled(state, batch)
    np.testing.assert_allclose(float(out_u.loss), float(out_r.loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(after_u), jax.tree.leaves(after_r), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# ------------------------------------------------- a k that does not fit is one line


@pytest.mark.parametrize("k", [0, -2])
def test_k_below_one_is_one_line(k):
    with pytest.raises(ValueError) as raised:
        ex.RunConfig(gradient_accumulation_steps=k)
    message = str(raised.value)
    assert "\n" not in message and "--gradient_accumulation_steps" in message
    assert f"must be >= 1 (1: no accumulation), got {k}" in message


@pytest.mark.parametrize(
    "k,suggested",
    [(3, "use 2 or 4 (the divisors of 8: 1, 2, 4, 8)"), (16, "use 8 "), (5, "use 4 or 8 ")],
)
def test_k_that_does_not_divide_the_per_replica_batch_is_one_line(tmp_path, k, suggested):
    with pytest.raises(ValueError) as raised:
        ex.Estimator(
            mlp_model_fn,
            ex.RunConfig(model_dir=str(tmp_path), gradient_accumulation_steps=k),
            train_batch_size=64,
        )
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"--gradient_accumulation_steps={k} (RunConfig.gradient_accumulation_steps) must divide "
        "each replica's train batch, 8 (train_batch_size=64 over 8 replicas)"
    )
    assert suggested in message


def test_programs_check_k_before_anything_runs(tmp_path):
    config = ex.RunConfig(model_dir=str(tmp_path), gradient_accumulation_steps=3)
    with pytest.raises(cli.UsageError, match=r"^--gradient_accumulation_steps=3 .* use 2 or 4"):
        configs.check_accumulation(config, 64, 8)
    configs.check_accumulation(dataclasses.replace(config, gradient_accumulation_steps=4), 64, 8)
