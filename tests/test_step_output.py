"""A step's output keeps the user's metrics, the framework's signals and the summaries apart:
a user's scalar may carry any name the loop uses for its own signals."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.estimator import steps
from estimax.estimator.label_check import InvalidLabelError

# Every name the loop once read (and popped) from the per-step metrics, each with a value that
# would trip its check if the loop took the user's scalar for its own signal.
FORMER_RESERVED = {
    "nonfinite_skipped": 7.0,
    "summaries": 8.0,
    "invalid_labels": 9.0,
    "invalid_label_example": 10.0,
    "label_classes": 11.0,
}


def _model_fn(features, labels, mode, params):
    logits = nn.Dense(3)(features.reshape(features.shape[0], -1))
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),  # integer labels: checked
        optimizer=optax.sgd(0.1),
        scalars={name: jnp.float32(value) for name, value in FORMER_RESERVED.items()},
        summaries={"inputs": ex.summary.image(features, max_outputs=1)},
    )


def _data(bad_label_at: int | None = None):
    rng = np.random.default_rng(0)
    x = rng.random((32, 4, 4, 1)).astype(np.float32)
    y = rng.integers(0, 3, 32).astype(np.int32)
    if bad_label_at is not None:
        y[bad_label_at] = 5
    return x, y


def _estimator(model_dir: str) -> ex.Estimator:
    config = ex.RunConfig(
        model_dir=model_dir,
        iterations_per_loop=2,
        save_summary_steps=1,
        save_checkpoints_steps=4,
        skip_nonfinite_steps=True,
        num_shards=2,
    )
    return ex.Estimator(_model_fn, config, train_batch_size=8)


class Recorder(ex.SessionRunHook):
    def __init__(self):
        self.results: list[dict] = []

    def after_run(self, run_context, run_values):
        self.results.append({k: np.asarray(v) for k, v in run_values.results.items()})


def test_user_scalars_named_like_the_loops_signals_are_the_users(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    x, y = _data()
    est = _estimator(str(tmp_path))
    hook = Recorder()
    est.train(ex.numpy_input_fn(x, y, shuffle=False), hooks=[hook], max_steps=4)
    est.close()
    acc = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={"scalars": 0, "images": 0}
    )
    acc.Reload()
    tags = acc.Tags()
    for name, value in FORMER_RESERVED.items():
        assert [(e.step, e.value) for e in acc.Scalars(name)] == [(s, value) for s in (1, 2, 3, 4)]
    # The framework's own signals were not disturbed: no step counted as skipped, no label as
    # invalid (training did not stop), and the image summaries were written at their steps.
    assert "train/nonfinite_skipped_steps" not in tags["scalars"]
    assert "train/invalid_labels" not in tags["scalars"]
    assert [e.step for e in acc.Images("inputs/0")] == [1, 2, 3, 4]
    # Hooks see the loss and the user's scalars, per step.
    assert [sorted(r) for r in hook.results] == [sorted(["loss", *FORMER_RESERVED])] * 2
    np.testing.assert_array_equal(hook.results[0]["invalid_labels"], [9.0, 9.0])


def test_the_label_check_reads_its_signal_not_a_user_scalar_of_its_name(tmp_path):
    x, y = _data(bad_label_at=10)  # in the second batch of 8 (the input is not shuffled)
    est = _estimator(str(tmp_path))
    with pytest.raises(InvalidLabelError) as e:
        est.train(ex.numpy_input_fn(x, y, shuffle=False), max_steps=4)
    est.close()
    # The label and class count are the batch's (5, 3), not the user's scalars (10, 11).
    assert "label value 5 is outside the valid range [0, 3) at step 2" in str(e.value)
    assert "(1 such label(s)" in str(e.value)


def test_a_step_output_reads_a_metric_before_a_signal_of_the_same_name():
    out = steps.StepOutput(
        loss=jnp.float32(1.5),
        scalars={"nonfinite_skipped": jnp.float32(7.0)},
        signals=steps.Signals(nonfinite_skipped=jnp.float32(0.0)),
    )
    assert float(out["nonfinite_skipped"]) == 7.0
    assert float(out.signals.nonfinite_skipped) == 0.0
    assert float(out["loss"]) == 1.5
    with pytest.raises(KeyError):
        out["invalid_labels"]  # not computed: no loss took integer labels


def test_a_scalar_named_loss_is_one_error(tmp_path):
    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3)(features.reshape(features.shape[0], -1))
        loss = ex.losses.softmax_cross_entropy(logits, labels)
        return ex.EstimatorSpec(
            mode=mode, loss=loss, optimizer=optax.sgd(0.1), scalars={"loss": jnp.mean(loss)}
        )

    x, y = _data()
    est = ex.Estimator(model_fn, ex.RunConfig(model_dir=str(tmp_path)), train_batch_size=8)
    with pytest.raises(ValueError, match=r"scalars=\{'loss': \.\.\.\}\): 'loss' is the training"):
        est.train(ex.numpy_input_fn(x, y), max_steps=1)


@pytest.mark.parametrize("name", ["loss", "global_step", "num_examples"])
def test_an_eval_metric_named_like_a_result_key_is_one_error(tmp_path, name):
    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3)(features.reshape(features.shape[0], -1))
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            eval_metrics={name: ex.metrics.accuracy(labels, logits)},
        )

    x, y = _data()
    est = ex.Estimator(model_fn, ex.RunConfig(model_dir=str(tmp_path)), eval_batch_size=8)
    with pytest.raises(ValueError, match=rf"eval_metrics=\{{'{name}': \.\.\.\}}\): '{name}' is"):
        est.evaluate(ex.numpy_input_fn(x, y, num_epochs=1, shuffle=False))
