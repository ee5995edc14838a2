"""Tests of estimax.programs.schedules against the original programs' formulas.

Each reference below is the original's TF code transcribed to plain Python/numpy (float64) from
docs/original.md §2.4 (resnet_main.py), §6 (inception_v3.py / inception_v4.py) and §7
(mnist_tpu.py), and EfficientNet's main.py + utils.build_learning_rate (tensorflow/tpu 2019-06);
the schedules under test compute in float32 with jnp, so values are compared with
a float32 tolerance, and steps are chosen on both sides of every boundary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimax.programs import schedules

N = 1281167  # ImageNet train images, every original program's default


# ---- references, written out from the original sources -------------------------------------
def ref_resnet(step, base_lr=0.1, batch=1024, n=N, train_steps=None):
    epoch = step / (n / batch)
    scaled = base_lr * batch / 256.0
    table = [(1.0, 5), (0.1, 30), (0.01, 60), (0.001, 80)]
    if train_steps is not None:  # 2019-01 get_lr_schedule
        train_epochs = train_steps / np.floor(n / batch)
        table = [(m, np.floor(e / 90 * train_epochs)) for m, e in table]
    lr = scaled * table[0][0] * epoch / table[0][1]
    for mult, start in table:
        lr = lr if epoch < start else scaled * mult
    return lr


def ref_inception_v3(step, lr=0.165, batch=1024, n=N, decay=0.94, decay_epochs=3):
    initial = lr * batch / 256
    decay_steps = int(decay_epochs * (n / batch))
    return max(initial * decay ** (step // decay_steps), 0.0001 * initial)


def ref_inception_v3_warmup(
    step, lr=0.165, batch=1024, n=N, decay=0.94, decay_epochs=3, cold=2, warmup=7
):
    initial = lr * batch / 256
    adj = initial * decay ** ((warmup + cold) / decay_epochs)
    bpe = n / batch
    epoch = int(step / bpe)
    decayed = initial * decay ** (step // int(decay_epochs * bpe))
    wlr = 0.1 * adj
    height = 0.9 * adj / (warmup + decay_epochs - 1)
    lin = wlr + (epoch - (cold - 1)) * height
    out = (decayed if epoch >= warmup + cold + decay_epochs else lin) if epoch >= cold else wlr
    return max(out, 0.0001 * initial)


def ref_inception_v4(
    step, lr=0.15, batch=256, n=N, decay=0.94, decay_epochs=2, cold_lr=0.001, cold=1, warmup=2
):
    initial = lr * batch / 256 / decay ** ((warmup + cold) / decay_epochs)
    bpe = n / batch
    epoch = int(step / bpe)
    if epoch < cold:
        out = cold_lr
    elif epoch < warmup + cold:
        out = epoch * initial / (warmup + cold)
    else:
        out = initial * decay ** (step // int(decay_epochs * bpe))
    return max(out, 0.0001 * initial)


def ref_efficientnet(step, base_lr=0.016, batch=2048, n=N, decay=0.97, decay_epochs=2.4, warmup=5):
    # main.py: scaled_lr = base * batch / 256, steps_per_epoch = n / batch (a float);
    # build_learning_rate: exponential_decay(scaled, step, steps_per_epoch * decay_epochs, decay,
    # staircase=True), replaced by scaled * step / int(warmup * steps_per_epoch) before that step.
    scaled = base_lr * batch / 256.0
    steps_per_epoch = n / batch
    warmup_steps = int(warmup * steps_per_epoch)
    if step < warmup_steps:
        return scaled * step / warmup_steps
    return scaled * decay ** math.floor(step / (steps_per_epoch * decay_epochs))


def first_step_at_epoch(epoch, batch, n=N):
    """Smallest integer step whose epoch (step / (n / batch)) is >= ``epoch``."""
    return math.ceil(epoch * n / batch)


def check(schedule, reference, steps):
    got = np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32)))
    want = np.array([reference(s) for s in steps])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
    return dict(zip(steps, got, strict=False))


def around(*boundaries):
    """Each boundary step with its neighbours: the last step before and the first after."""
    return sorted({b + d for b in boundaries for d in (-1, 0, 1) if b + d >= 0})


# ---- ResNet ---------------------------------------------------------------------------------
def test_resnet_default_recipe_at_every_boundary():
    sched = schedules.resnet_schedule(0.1, 1024, N)
    b = [first_step_at_epoch(e, 1024) for e in (5, 30, 60, 80)]
    assert b == [6256, 37535, 75069, 100092]  # ceil(e * 1281167 / 1024)
    got = check(sched, ref_resnet, [0, 1, 3000, *around(*b), 112590])
    # The recipe in words: 0 -> 0.4 over 5 epochs, 0.4, 0.04 at 30, 0.004 at 60, 0.0004 at 80.
    assert got[0] == 0.0
    np.testing.assert_allclose(got[6255], 0.4 * 6255 / (5 * N / 1024), rtol=1e-6)
    for step, lr in (
        (6256, 0.4),
        (37534, 0.4),
        (37535, 0.04),
        (75068, 0.04),
        (75069, 0.004),
        (100091, 0.004),
        (100092, 0.0004),
        (112590, 0.0004),
    ):
        np.testing.assert_allclose(got[step], lr, rtol=1e-6)


def test_resnet_scales_with_batch_and_base_rate():
    sched = schedules.resnet_schedule(0.2, 256, N)
    end = first_step_at_epoch(5, 256)
    check(
        sched,
        lambda s: ref_resnet(s, base_lr=0.2, batch=256),
        around(end, first_step_at_epoch(30, 256)),
    )
    np.testing.assert_allclose(sched(end), 0.2, rtol=1e-6)


def test_resnet_2019_variant_scales_start_epochs_with_train_steps():
    # Half the recipe: 56295 steps at 1251 steps/epoch = 45 epochs -> starts 2, 15, 30, 40.
    sched = schedules.resnet_schedule(0.1, 1024, N, train_steps=56295)
    b = [first_step_at_epoch(e, 1024) for e in (2, 15, 30, 40)]
    got = check(sched, lambda s: ref_resnet(s, train_steps=56295), [0, *around(*b), 56295])
    np.testing.assert_allclose(got[b[0]], 0.4, rtol=1e-6)
    np.testing.assert_allclose(got[b[1]], 0.04, rtol=1e-6)
    np.testing.assert_allclose(got[b[3] - 1], 0.004, rtol=1e-6)
    # With the full 112590 steps (90.0 epochs) the variant is the fixed schedule.
    full = schedules.resnet_schedule(0.1, 1024, N, train_steps=112590)
    steps = around(*[first_step_at_epoch(e, 1024) for e in (5, 30, 60, 80)])
    check(full, ref_resnet, steps)


def test_current_epoch_is_the_originals_float_epoch():
    steps = np.array([0, 1251, 1252, 112590])
    got = np.asarray(schedules.current_epoch(jnp.asarray(steps), 1024, N))
    np.testing.assert_allclose(got, steps / (N / 1024), rtol=1e-6)
    assert got.dtype == np.float32
    assert got[1] < 1.0 <= got[2]


# ---- Inception v3 ---------------------------------------------------------------------------
def test_inception_v3_staircase_decay_and_floor():
    sched = schedules.inception_v3_schedule()  # 0.165, batch 1024, 0.94 every 3 epochs
    decay_steps = int(3 * N / 1024)
    assert decay_steps == 3753
    # Floor 0.0001 * initial: first reached at k = ceil(log(1e-4) / log(0.94)) = 149 decays.
    k_floor = math.ceil(math.log(1e-4) / math.log(0.94))
    assert k_floor == 149
    steps = [
        0,
        *around(
            decay_steps,
            2 * decay_steps,
            10 * decay_steps,
            (k_floor - 1) * decay_steps,
            k_floor * decay_steps,
        ),
        10**7,
    ]
    got = check(sched, ref_inception_v3, steps)
    initial = 0.165 * 1024 / 256
    np.testing.assert_allclose(got[0], initial, rtol=1e-6)
    np.testing.assert_allclose(got[3752], initial, rtol=1e-6)
    np.testing.assert_allclose(got[3753], initial * 0.94, rtol=1e-6)
    np.testing.assert_allclose(got[7506], initial * 0.94**2, rtol=1e-6)
    np.testing.assert_allclose(got[148 * 3753], initial * 0.94**148, rtol=1e-5)
    assert got[148 * 3753] > 1e-4 * initial
    np.testing.assert_allclose(got[149 * 3753], 1e-4 * initial, rtol=1e-6)
    np.testing.assert_allclose(got[10**7], 1e-4 * initial, rtol=1e-6)


def test_inception_v3_optional_warmup_follows_the_originals_ramp():
    sched = schedules.inception_v3_schedule(use_learning_rate_warmup=True)
    # Epoch boundaries 1..13 (cold 2, warm-up 7, decay 3: the decay takes over at epoch 12).
    b = [first_step_at_epoch(e, 1024) for e in range(1, 14)]
    check(sched, ref_inception_v3_warmup, [0, *around(*b)])


# ---- Inception v4 ---------------------------------------------------------------------------
def test_inception_v4_cold_warmup_decay_and_floor():
    sched = schedules.inception_v4_schedule()  # 0.15, batch 256, cold 1, warm-up 2, 0.94 / 2 ep
    initial = 0.15 / 0.94**1.5
    e1, e2, e3 = (first_step_at_epoch(e, 256) for e in (1, 2, 3))
    decay_steps = int(2 * N / 256)
    assert (e1, e2, e3, decay_steps) == (5005, 10010, 15014, 10009)
    k_floor = math.ceil(math.log(1e-4) / math.log(0.94))
    steps = [0, *around(e1, e2, e3, 2 * decay_steps, 3 * decay_steps, k_floor * decay_steps)]
    got = check(sched, ref_inception_v4, steps)
    np.testing.assert_allclose(got[e1 - 1], 0.001, rtol=1e-6)  # cold
    np.testing.assert_allclose(got[e1], initial / 3, rtol=1e-6)  # warm-up, epoch 1
    np.testing.assert_allclose(got[e2], 2 * initial / 3, rtol=1e-6)  # warm-up, epoch 2
    # At epoch 3 the decay (counting from step 0) has already applied once: 0.94 * initial,
    # which is why the original divides the initial rate by 0.94 ** 1.5.
    np.testing.assert_allclose(got[e3], initial * 0.94, rtol=1e-6)
    np.testing.assert_allclose(got[2 * decay_steps], initial * 0.94**2, rtol=1e-6)
    np.testing.assert_allclose(got[k_floor * decay_steps], 1e-4 * initial, rtol=1e-6)


def test_inception_v4_scaled_batch():
    sched = schedules.inception_v4_schedule(train_batch_size=1024)
    b = [first_step_at_epoch(e, 1024) for e in (1, 2, 3, 5)]
    check(sched, lambda s: ref_inception_v4(s, batch=1024), [0, *around(*b)])


# ---- EfficientNet --------------------------------------------------------------------------
def test_efficientnet_warmup_then_staircase_decay_every_2_4_epochs():
    sched = schedules.efficientnet_schedule(0.016, 2048)  # the defaults: 0.128 at batch 2048
    decay_steps = 2.4 * N / 2048  # 1501.37: the decay period is fractional, as the original's
    warmup_end = int(5 * N / 2048)
    assert warmup_end == 3127
    decays = [math.ceil(k * decay_steps) for k in (1, 2, 3, 4, 10)]
    got = check(sched, ref_efficientnet, [0, 1, *around(warmup_end, *decays)])
    assert got[0] == 0.0
    np.testing.assert_allclose(got[3126], 0.128 * 3126 / 3127, rtol=1e-6)
    # The decay counts from step 0, so two periods have passed when the warm-up ends.
    np.testing.assert_allclose(got[3127], 0.128 * 0.97**2, rtol=1e-6)
    np.testing.assert_allclose(got[decays[2] - 1], 0.128 * 0.97**2, rtol=1e-6)
    np.testing.assert_allclose(got[decays[2]], 0.128 * 0.97**3, rtol=1e-6)
    # The last decay of the default 218949 steps; 0.97 ** 145 in float32 is within 1e-5.
    last = math.ceil(145 * decay_steps)
    for step in (last - 1, last, 218949):
        np.testing.assert_allclose(sched(step), ref_efficientnet(step), rtol=1e-5)
    np.testing.assert_allclose(sched(218949), 0.128 * 0.97**145, rtol=1e-5)


def test_efficientnet_scales_with_batch_and_base_rate():
    sched = schedules.efficientnet_schedule(0.032, 512, N, warmup_epochs=1)
    ref = lambda s: ref_efficientnet(s, base_lr=0.032, batch=512, warmup=1)  # noqa: E731
    check(sched, ref, [0, *around(int(N / 512), math.ceil(2.4 * N / 512))])
    no_warmup = schedules.efficientnet_schedule(0.016, 2048, warmup_epochs=0)
    np.testing.assert_allclose(no_warmup(0), 0.128, rtol=1e-6)


# ---- MNIST and errors -----------------------------------------------------------------------
def test_mnist_continuous_exponential_decay():
    sched = schedules.mnist_schedule()
    for step in (0, 1, 999, 50_000, 100_000, 250_000):
        np.testing.assert_allclose(sched(step), 0.05 * 0.96 ** (step / 100_000), rtol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="train_batch_size must be > 0, got 0"):
        schedules.resnet_schedule(0.1, 0, N)
    with pytest.raises(ValueError, match="num_train_images must be > 0"):
        schedules.current_epoch(0, 1024, 0)
    with pytest.raises(ValueError, match="learning_rate_decay_epochs=0"):
        schedules.inception_v3_schedule(learning_rate_decay_epochs=0)
    with pytest.raises(ValueError, match="decay_epochs must be > 0, got 0"):
        schedules.efficientnet_schedule(0.016, 2048, decay_epochs=0)
