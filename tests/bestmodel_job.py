"""A training job that keeps its best model: run as a command by tests/test_best_model.py.

``python tests/bestmodel_job.py MODEL_DIR`` trains a small classifier with
``train_and_evaluate``: an evaluation every 4 steps, a ``BestExporter`` on accuracy, early
stopping when accuracy has not increased for 8 steps, 2 checkpoints kept beside the best one.
The learning rate turns negative after step 16 (gradient ascent), so accuracy falls and the job
stops early. ``KILL_AT_EXPORT=N`` kills the process (SIGKILL) when it is about to publish its
N-th export (an evaluation recorded, its export not yet made). ``TRAIN_AFTER_EARLY_STOP=1``
trains on past a recorded early stop.
"""

from __future__ import annotations

import os
import signal
import sys

import flax.linen as nn
import numpy as np
import optax

import estimax as ex
from estimax.export import (
    exporters,
    publish,  # exporters first: it reads export_version's signature
)

KEEP = 2  # keep_checkpoint_max


def model_fn(features, labels, mode, params):
    logits = nn.Dense(3)(nn.relu(nn.Dense(16)(features)))
    if mode == ex.ModeKeys.PREDICT:
        return ex.EstimatorSpec(mode=mode, predictions={"logits": logits})
    # Up the gradient after step 16: accuracy gets worse, so early stopping must act.
    lr = optax.join_schedules([optax.constant_schedule(0.3), optax.constant_schedule(-0.3)], [16])
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(lr),
        eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
    )


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` examples of 6 features, 3 classes separable by the first two features."""
    x = np.random.default_rng(seed).normal(size=(n, 6)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)


def estimator(model_dir: str, **config) -> ex.Estimator:
    """The job's Estimator on one device: loops of 2 steps, a checkpoint every 2 (``config``
    overrides any ``RunConfig`` field)."""
    settings = {"iterations_per_loop": 2, "save_checkpoints_steps": 2, "num_shards": 1}
    settings.update(config)
    return ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=model_dir, **settings),
        train_batch_size=16,
        eval_batch_size=16,
        predict_batch_size=16,
    )


def _kill_at_export(n: int) -> None:
    publish_version = publish.export_version
    calls = []

    def publish_or_die(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return publish_version(*args, **kwargs)

    publish.export_version = publish_or_die


def main(model_dir: str) -> None:
    if os.environ.get("KILL_AT_EXPORT"):
        _kill_at_export(int(os.environ["KILL_AT_EXPORT"]))
    est = estimator(
        model_dir,
        keep_checkpoint_max=KEEP,
        keep_best_checkpoint=ex.BestCheckpoint("accuracy", "max"),
        train_after_early_stop=bool(os.environ.get("TRAIN_AFTER_EARLY_STOP")),
    )
    train_x, train_y = data(256, seed=0)
    eval_x, eval_y = data(100, seed=1)
    exporter = exporters.BestExporter(
        "best",
        lambda: ex.TensorSpec((None, 6), np.float32),
        metric="accuracy",
        mode="max",
        exports_to_keep=2,
        platforms=("cpu",),
    )
    ex.train_and_evaluate(
        est,
        ex.TrainSpec(
            ex.numpy_input_fn(train_x, train_y, seed=1),
            max_steps=200,
            hooks=[ex.stop_if_no_increase_hook(est, "accuracy", 8, run_every_steps=2)],
        ),
        ex.EvalSpec(
            ex.numpy_input_fn(eval_x, eval_y, shuffle=False, num_epochs=1),
            every_steps=4,
            exporters=[exporter],
        ),
    )
    est.close()


if __name__ == "__main__":
    main(sys.argv[1])
