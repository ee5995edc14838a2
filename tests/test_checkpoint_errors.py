"""Checkpoint errors a user can act on: a model_dir holding another model names the difference."""

from __future__ import annotations

import flax.linen as nn
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.estimator.checkpoints import ModelMismatchError


def _model_fn(classes: int, extra: bool):
    def model_fn(features, labels, mode, params):
        x = nn.Dense(5, name="extra")(features) if extra else features
        logits = nn.Dense(classes, name="head")(x)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            predictions=logits,
        )

    return model_fn


def _train(model_dir: str, classes: int, extra: bool = False, steps: int = 2) -> ex.Estimator:
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    est = ex.Estimator(
        _model_fn(classes, extra),
        ex.RunConfig(model_dir=model_dir, iterations_per_loop=2),
        train_batch_size=8,
    )
    est.train(ex.numpy_input_fn(x, np.zeros(16, np.int32)), max_steps=steps)
    return est


@pytest.mark.parametrize(
    "classes, extra, difference",
    [
        (4, False, r"params/head/bias has shape \(3,\) in the checkpoint, \(4,\) in this model"),
        (3, True, r"params/extra/bias \(5,\) is not in the checkpoint"),
    ],
)
def test_a_model_dir_holding_another_model_names_the_first_difference(
    tmp_path, classes, extra, difference
):
    model_dir = str(tmp_path / "run")
    _train(model_dir, classes=3)
    with pytest.raises(ModelMismatchError, match=difference) as raised:
        _train(model_dir, classes=classes, extra=extra, steps=4)
    message = str(raised.value)
    assert "\n" not in message
    assert f"{model_dir} holds a different model" in message
    assert "new --model_dir" in message and "warm_start_from" in message
    assert "partial_restore" not in message and "strict=False" not in message  # Orbax's advice
    # Nothing was lost: the first model still resumes from its checkpoint.
    assert _train(model_dir, classes=3, steps=4).get_global_step() == 4
