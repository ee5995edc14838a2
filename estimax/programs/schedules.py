"""Learning-rate schedules of the original programs, as optax schedules (``step -> lr``).

Each factory returns a pure function of the global step (a Python int or a jnp integer scalar,
traceable under ``jit``) giving a float32 learning rate, so it can be passed to any optax optimizer
(``optax.sgd(schedule, momentum=0.9, nesterov=True)``) and logged next to ``current_epoch``.
The arithmetic follows the original's TF graphs literally (float32 epoch = step / (images / batch),
``tf.where`` chains, ``tf.train.exponential_decay``), so boundary steps land where they did there.

Sources: resnet_main.py's ``learning_rate_schedule``, inception_v3.py / inception_v4.py's
``inception_model_fn``, EfficientNet's main.py and ``utils.build_learning_rate``, mnist_tpu.py.
They live beside the programs because they are recipes of particular models;
``estimax.estimator`` knows no model. ``tf_rmsprop`` is the optimizer the Inception and
EfficientNet recipes drive: TF1's RMSProp, whose update optax's ``rmsprop`` does not reproduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import optax

# ImageNet's train-set size, the default of every original program (--num_train_images); stated
# once, in the ImageNet input.
from estimax.data.imagenet import NUM_TRAIN_IMAGES

# ResNet's (start epoch, multiplier) decay points after warm-up (LR_SCHEDULE in resnet_main.py).
RESNET_BOUNDARIES = ((30, 0.1), (60, 0.01), (80, 0.001))


def _batches_per_epoch(train_batch_size: int, num_train_images: int) -> float:
    if train_batch_size <= 0:
        raise ValueError(f"train_batch_size must be > 0, got {train_batch_size}")
    if num_train_images <= 0:
        raise ValueError(f"num_train_images must be > 0, got {num_train_images}")
    return num_train_images / train_batch_size


def _staircase_decay(
    initial: float, decay: float, decay_epochs: float, batches_per_epoch: float
) -> optax.Schedule:
    """``initial * decay ** floor(step / int(decay_epochs * batches_per_epoch))`` (Inception)."""
    decay_steps = int(decay_epochs * batches_per_epoch)
    if decay_steps <= 0:
        raise ValueError(
            f"learning_rate_decay_epochs={decay_epochs} is less than one step "
            f"({batches_per_epoch:g} steps per epoch)"
        )
    return optax.exponential_decay(initial, decay_steps, decay, staircase=True)


def current_epoch(step, train_batch_size: int, num_train_images: int = NUM_TRAIN_IMAGES):
    """The fractional epoch the original logs as ``current_epoch``.

    ``global_step / (num_train_images / train_batch_size)`` in float32, as resnet_main.py.

    Args:
      step: global step, int or integer array (any shape).
      train_batch_size: global batch size.
      num_train_images: examples per epoch.

    Returns:
      float32 array of ``step``'s shape.
    """
    bpe = _batches_per_epoch(train_batch_size, num_train_images)
    return jnp.asarray(step, jnp.float32) / jnp.float32(bpe)


def resnet_schedule(
    base_learning_rate: float,
    train_batch_size: int,
    num_train_images: int = NUM_TRAIN_IMAGES,
    train_steps: int | None = None,
    warmup_epochs: float = 5,
    boundaries: Sequence[tuple[float, float]] = RESNET_BOUNDARIES,
) -> optax.Schedule:
    """ResNet: linear scaling, linear warm-up, step decay (resnet_main.py's schedule).

    ``scaled_lr = base_learning_rate * train_batch_size / 256``; the rate rises linearly from 0 to
    ``scaled_lr`` over ``warmup_epochs`` and is ``scaled_lr * multiplier`` from each boundary's
    start epoch on (0.1 at 30, 0.01 at 60, 0.001 at 80 by default). Epochs are fractional:
    ``step / (num_train_images / train_batch_size)``.

    Args:
      base_learning_rate: rate for a batch of 256 (``--base_learning_rate``, 0.1).
      train_batch_size: global batch size (``--train_batch_size``).
      num_train_images: examples per epoch (``--num_train_images``).
      train_steps: if given, the 2019-01 variant: every start epoch ``e`` (warm-up end included)
        becomes ``floor(e / 90 * train_epochs)`` with ``train_epochs = train_steps /
        floor(num_train_images / train_batch_size)``, so a shorter run keeps the recipe's shape.
        ``None`` keeps the fixed epochs of the 2018 original.
      warmup_epochs: length of the linear warm-up.
      boundaries: ``(start_epoch, multiplier)`` pairs, increasing.

    Returns:
      ``schedule(step) -> float32 lr``.
    """
    scaled_lr = base_learning_rate * train_batch_size / 256.0
    starts = [(1.0, float(warmup_epochs))] + [(float(m), float(e)) for e, m in boundaries]
    if train_steps is not None:
        # 2019-01 get_lr_schedule: the 90-epoch recipe compressed/stretched to train_steps.
        steps_per_epoch = math.floor(num_train_images / train_batch_size)
        if steps_per_epoch <= 0:
            raise ValueError(
                f"train_batch_size={train_batch_size} exceeds num_train_images="
                f"{num_train_images}; an epoch must hold at least one step"
            )
        train_epochs = train_steps / steps_per_epoch
        starts = [(m, float(math.floor(e / 90 * train_epochs))) for m, e in starts]
    bpe = _batches_per_epoch(train_batch_size, num_train_images)
    warmup_mult, warmup_end = starts[0]

    def schedule(step):
        epoch = jnp.asarray(step, jnp.float32) / jnp.float32(bpe)
        if warmup_end > 0:
            lr = jnp.float32(scaled_lr * warmup_mult) * epoch / jnp.float32(warmup_end)
        else:  # no warm-up (a run so short that floor(5/90 * epochs) is 0)
            lr = jnp.full_like(epoch, scaled_lr * warmup_mult)
        for mult, start in starts:
            lr = jnp.where(epoch < start, lr, jnp.float32(scaled_lr * mult))
        return lr

    return schedule


def inception_v3_schedule(
    learning_rate: float = 0.165,
    train_batch_size: int = 1024,
    num_train_images: int = NUM_TRAIN_IMAGES,
    learning_rate_decay: float = 0.94,
    learning_rate_decay_epochs: float = 3,
    use_learning_rate_warmup: bool = False,
    cold_epochs: int = 2,
    warmup_epochs: int = 7,
) -> optax.Schedule:
    """Inception v3: staircase exponential decay with a floor (inception_v3.py).

    ``initial = learning_rate * train_batch_size / 256``; ``lr = initial * decay **
    floor(step / int(decay_epochs * batches_per_epoch))``; never below ``0.0001 * initial``.
    With ``use_learning_rate_warmup`` (off by default, as the original) the first
    ``cold_epochs`` run at ``0.1 * adj`` and then rise linearly by integer epoch until the decay
    takes over at ``warmup + cold + decay_epochs``, where ``adj = initial * decay **
    ((warmup + cold) / decay_epochs)`` -- the original's formula verbatim.

    Args:
      learning_rate: ``--learning_rate`` (0.165 per 256 examples).
      train_batch_size: ``--train_batch_size`` (global).
      num_train_images: examples per epoch.
      learning_rate_decay: ``--learning_rate_decay`` (0.94).
      learning_rate_decay_epochs: ``--learning_rate_decay_epochs`` (3).
      use_learning_rate_warmup: ``--use_learning_rate_warmup`` (False).
      cold_epochs: ``--cold_epochs`` (2). warmup_epochs: ``--warmup_epochs`` (7).

    Returns:
      ``schedule(step) -> float32 lr``.
    """
    initial = learning_rate * train_batch_size / 256.0
    final = 0.0001 * initial
    bpe = _batches_per_epoch(train_batch_size, num_train_images)
    decayed = _staircase_decay(initial, learning_rate_decay, learning_rate_decay_epochs, bpe)
    adj = initial * learning_rate_decay ** (
        (warmup_epochs + cold_epochs) / learning_rate_decay_epochs
    )
    wlr = 0.1 * adj
    wlr_height = 0.9 * adj / (warmup_epochs + learning_rate_decay_epochs - 1)
    exp_decay_start = warmup_epochs + cold_epochs + learning_rate_decay_epochs

    def schedule(step):
        step = jnp.asarray(step)
        lr = jnp.asarray(decayed(step), jnp.float32)
        if use_learning_rate_warmup:
            # The original truncates the epoch to an int32 for the warm-up ramp.
            epoch = (step.astype(jnp.float32) / jnp.float32(bpe)).astype(jnp.int32)
            lin_inc = jnp.float32(wlr) + (epoch - (cold_epochs - 1)).astype(
                jnp.float32
            ) * jnp.float32(wlr_height)
            lr = jnp.where(
                epoch >= cold_epochs,
                jnp.where(epoch >= exp_decay_start, lr, lin_inc),
                jnp.float32(wlr),
            )
        return jnp.maximum(lr, jnp.float32(final))

    return schedule


def inception_v4_schedule(
    learning_rate: float = 0.15,
    train_batch_size: int = 256,
    num_train_images: int = NUM_TRAIN_IMAGES,
    learning_rate_decay: float = 0.94,
    learning_rate_decay_epochs: float = 2,
    cold_learning_rate: float = 0.001,
    cold_epochs: int = 1,
    warmup_epochs: int = 2,
) -> optax.Schedule:
    """Inception v4: cold start, linear warm-up by integer epoch, staircase decay (inception_v4.py).

    ``initial = learning_rate * batch / 256 / decay ** ((warmup + cold) / decay_epochs)`` (so the
    decay, which counts from step 0, is back at ``learning_rate * batch / 256`` when it takes
    over); with ``e = int(step / batches_per_epoch)``: ``e < cold``: ``cold_learning_rate``;
    ``e < cold + warmup``: ``e * initial / (warmup + cold)``; else ``initial * decay **
    floor(step / int(decay_epochs * batches_per_epoch))``; never below ``0.0001 * initial``.

    Args:
      learning_rate: ``--learning_rate`` (0.15 per 256 examples).
      train_batch_size: ``--train_batch_size`` (global, 256).
      num_train_images: examples per epoch.
      learning_rate_decay: ``--learning_rate_decay`` (0.94).
      learning_rate_decay_epochs: ``--learning_rate_decay_epochs`` (2).
      cold_learning_rate: ``--cold_learning_rate`` (0.001).
      cold_epochs: ``--cold_epochs`` (1). warmup_epochs: ``--warmup_epochs`` (2).

    Returns:
      ``schedule(step) -> float32 lr``.
    """
    initial = learning_rate * train_batch_size / 256.0
    initial /= learning_rate_decay ** ((warmup_epochs + cold_epochs) / learning_rate_decay_epochs)
    final = 0.0001 * initial
    bpe = _batches_per_epoch(train_batch_size, num_train_images)
    decayed = _staircase_decay(initial, learning_rate_decay, learning_rate_decay_epochs, bpe)
    wlr = initial / (warmup_epochs + cold_epochs)

    def schedule(step):
        step = jnp.asarray(step)
        epoch = (step.astype(jnp.float32) / jnp.float32(bpe)).astype(jnp.int32)
        lr = jnp.where(
            epoch >= cold_epochs,
            jnp.where(
                epoch >= warmup_epochs + cold_epochs,
                jnp.asarray(decayed(step), jnp.float32),
                epoch.astype(jnp.float32) * jnp.float32(wlr),
            ),
            jnp.float32(cold_learning_rate),
        )
        return jnp.maximum(lr, jnp.float32(final))

    return schedule


def efficientnet_schedule(
    base_learning_rate: float,
    train_batch_size: int,
    num_train_images: int = NUM_TRAIN_IMAGES,
    *,
    decay_factor: float = 0.97,
    decay_epochs: float = 2.4,
    warmup_epochs: float = 5,
) -> optax.Schedule:
    """EfficientNet: linear warm-up, then staircase exponential decay (efficientnet main.py).

    ``scaled_lr = base_learning_rate * train_batch_size / 256``; with ``steps_per_epoch =
    num_train_images / train_batch_size`` (a float): ``lr = scaled_lr * decay_factor **
    floor(step / (steps_per_epoch * decay_epochs))`` (``tf.train.exponential_decay(staircase=
    True)``, whose decay period is fractional), and for ``step < warmup_steps = int(warmup_epochs
    * steps_per_epoch)`` instead ``scaled_lr * step / warmup_steps`` (``utils.build_learning_rate``
    with its defaults: ``lr_decay_type='exponential'``).

    Args:
      base_learning_rate: ``--base_learning_rate`` (0.016 per 256 examples).
      train_batch_size: ``--train_batch_size`` (global, 2048).
      num_train_images: ``--num_train_images``.
      decay_factor: the decay per period (0.97).
      decay_epochs: epochs per decay period (2.4).
      warmup_epochs: epochs of linear warm-up (5; 0: none).

    Returns:
      ``schedule(step) -> float32 lr``.
    """
    scaled_lr = base_learning_rate * train_batch_size / 256.0
    steps_per_epoch = _batches_per_epoch(train_batch_size, num_train_images)
    decay_steps = steps_per_epoch * decay_epochs
    if decay_steps <= 0:
        raise ValueError(f"decay_epochs must be > 0, got {decay_epochs}")
    warmup_steps = int(warmup_epochs * steps_per_epoch)

    def schedule(step):
        step = jnp.asarray(step)
        p = jnp.floor(step.astype(jnp.float32) / jnp.float32(decay_steps))
        lr = jnp.float32(scaled_lr) * jnp.power(jnp.float32(decay_factor), p)
        if warmup_steps > 0:
            warmup = jnp.float32(scaled_lr) * step.astype(jnp.float32) / jnp.float32(warmup_steps)
            lr = jnp.where(step < warmup_steps, warmup, lr)
        return lr

    return schedule


def tf_rmsprop(
    learning_rate: optax.ScalarOrSchedule, decay: float, momentum: float, epsilon: float
) -> optax.GradientTransformation:
    """``tf.train.RMSPropOptimizer(learning_rate, decay, momentum, epsilon)`` on optax.

    TF1's update is ``ms = decay ms + (1 - decay) g^2`` (``ms`` starts at 1, not 0), ``mom =
    momentum mom + lr * g / sqrt(ms + epsilon)`` (epsilon *inside* the square root), ``w -=
    mom``. ``optax.rmsprop`` would apply the learning rate after the momentum, which differs from
    TF whenever the rate changes, so the chain is spelled out: ``scale_by_rms(initial_scale=1,
    eps_in_sqrt=True)``, then the rate, then the momentum trace.
    """
    return optax.chain(
        optax.scale_by_rms(decay=decay, eps=epsilon, initial_scale=1.0, eps_in_sqrt=True),
        optax.scale_by_learning_rate(learning_rate),
        optax.trace(decay=momentum),
    )


def mnist_schedule(
    learning_rate: float = 0.05, decay_steps: int = 100000, decay_rate: float = 0.96
) -> optax.Schedule:
    """MNIST: ``tf.train.exponential_decay(0.05, step, 100000, 0.96)`` (continuous, not staircase).

    Args:
      learning_rate: ``--learning_rate`` (0.05).
      decay_steps: steps per factor of ``decay_rate``.
      decay_rate: decay factor.

    Returns:
      ``schedule(step) -> lr = learning_rate * decay_rate ** (step / decay_steps)``.
    """
    return optax.exponential_decay(learning_rate, decay_steps, decay_rate, staircase=False)
