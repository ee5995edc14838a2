"""A tiny model and helpers shared by the checkpoint, evaluation, NaN and disk-full tests.

Importable both in-process and by child processes (``python -c`` with this directory on
``sys.path``), so a fault can be made real in a process of its own.
"""

from __future__ import annotations

import glob
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import estimax as ex

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def model_fn(features, labels, mode, params):
    """A two-layer classifier; ``params['width']`` sets the hidden width (bigger files)."""
    h = nn.relu(nn.Dense(params.get("width", 8))(features))
    logits = nn.Dense(3)(h)
    if mode == ex.ModeKeys.PREDICT:
        return ex.EstimatorSpec(mode=mode, predictions={"logits": logits})
    loss = ex.losses.softmax_cross_entropy(logits, labels)
    return ex.EstimatorSpec(
        mode=mode,
        loss=loss,
        optimizer=optax.adam(0.01),
        eval_metrics={"accuracy": ex.metrics.accuracy(labels, jnp.argmax(logits, -1))},
    )


def data(nan_rows: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """128 examples of 6 features, 3 classes; ``nan_rows`` get NaN features."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype(np.float32)
    x[list(nan_rows)] = np.nan
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)


def train_input_fn(nan_rows: tuple[int, ...] = ()):
    """A repeating, shuffled, resumable (get_state/set_state) training input."""
    x, y = data(nan_rows)
    return ex.numpy_input_fn(x, y, seed=1)


def eval_input_fn():
    """One pass over the 128 examples."""
    x, y = data()
    return ex.numpy_input_fn(x, y, shuffle=False, num_epochs=1)


def estimator(model_dir: str, width: int = 8, **config) -> ex.Estimator:
    """An Estimator on one device saving every 2 steps (loops of 2), keeping every checkpoint."""
    settings = dict(
        model_dir=model_dir,
        iterations_per_loop=2,
        save_checkpoints_steps=2,
        keep_checkpoint_max=None,
        num_shards=1,
        save_summary_steps=1,
    )
    settings.update(config)
    return ex.Estimator(
        model_fn,
        ex.RunConfig(**settings),
        params={"width": width},
        train_batch_size=16,
        eval_batch_size=16,
        predict_batch_size=16,
    )


def train(model_dir: str, max_steps: int, **kwargs) -> dict:
    """Trains to ``max_steps``; returns the final checkpoint's variables (numpy)."""
    est = estimator(model_dir, **kwargs)
    try:
        est.train(train_input_fn(), max_steps=max_steps)
        return est.get_variables()
    finally:
        est.close()


def leaves_equal(a, b) -> bool:
    """True if two pytrees have the same structure and bit-identical leaves."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def step_files(step_dir: str) -> list[str]:
    """The files of a checkpoint step, sorted (manifest excluded)."""
    return sorted(
        f
        for f in glob.glob(os.path.join(step_dir, "**"), recursive=True)
        if os.path.isfile(f) and not f.endswith("estimax_manifest.json")
    )


def scalar_events(logdir: str, tag: str) -> list[tuple[int, float]]:
    """``[(step, value)]`` of ``tag`` in ``logdir``, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]
