"""A TPUEstimator user's habits: the original's keyword arguments, ``(metric_fn, tensors)``,
one-hot labels, and the errors that name what to do instead."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimax as ex
from estimax import data as estimax_data


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ex.EstimatorSpec("train", train_op=None), r"train_op=.*optimizer=optax"),
        (lambda: ex.EstimatorSpec("eval", eval_metric_ops={}), r"eval_metrics=\(metric_fn"),
        (lambda: ex.EstimatorSpec("train", host_call=None), r"host_call=.*scalars="),
        (lambda: ex.EstimatorSpec("train", training_hooks=[]), r"train/evaluate/predict\(hooks"),
        (lambda: ex.RunConfig(tf_random_seed=1), r"tf_random_seed=.*seed="),
        (lambda: ex.RunConfig(cluster=None), r"jax.distributed"),
        (lambda: ex.EvalSpec(None, start_delay_secs=120), r"throttle_secs="),
        (lambda: ex.Estimator(lambda *a: None, use_tpu=True), r"CPU, GPU and TPU"),
    ],
)
def test_the_originals_keywords_name_their_replacement_in_one_line(make, message):
    with pytest.raises(TypeError, match=message) as raised:
        make()
    assert "\n" not in str(raised.value) and "TPUEstimator's" in str(raised.value)


def test_the_replacements_still_construct():
    assert ex.RunConfig(seed=3).seed == 3
    assert ex.EvalSpec(None, throttle_secs=5).throttle_secs == 5
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        ex.EstimatorSpec("train", bogus=1)  # not the original's: Python's own error


class _Linear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def _model_fn(form):
    def model_fn(features, labels, mode, params):
        logits = _Linear()(features)
        if mode == ex.ModeKeys.PREDICT:
            return ex.EstimatorSpec(mode=mode, predictions={"classes": logits.argmax(-1)})
        if form == "tuple":  # TPUEstimatorSpec's form: a function of per-example tensors
            metrics = (
                lambda labels, logits: {
                    "accuracy": ex.metrics.accuracy(labels, logits),
                    "top_2": ex.metrics.top_k_accuracy(labels, logits, k=2),
                },
                [labels, logits],
            )
        elif form == "dict_tensors":
            metrics = (
                lambda labels, logits: {"accuracy": ex.metrics.accuracy(labels, logits)},
                {"labels": labels, "logits": logits},
            )
        else:
            metrics = {
                "accuracy": ex.metrics.accuracy(labels, logits),
                "top_2": ex.metrics.top_k_accuracy(labels, logits, k=2),
            }
        onehot = jnp.eye(3)[labels] if form == "tuple" else labels  # onehot_labels, as TF took
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, onehot),
            optimizer=optax.sgd(0.1),
            eval_metrics=metrics,
        )

    return model_fn


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)


def test_metric_fn_tensors_and_one_hot_labels_give_what_the_dict_form_gives(tmp_path):
    x, y = _data()
    results = {}
    for form in ("dict", "tuple", "dict_tensors"):
        est = ex.Estimator(
            _model_fn(form),
            ex.RunConfig(model_dir=str(tmp_path / form), iterations_per_loop=5),
            train_batch_size=8,
            eval_batch_size=8,
        )
        est.train(ex.numpy_input_fn(x, y, shuffle=True), max_steps=10)
        results[form] = est.evaluate(ex.numpy_input_fn(x[:37], y[:37], shuffle=False, num_epochs=1))
    for form in ("tuple", "dict_tensors"):
        for key in ("accuracy", "loss", "num_examples", "global_step"):
            assert results[form][key] == pytest.approx(results["dict"][key]), (form, key)
    assert results["tuple"]["top_2"] == pytest.approx(results["dict"]["top_2"])


def test_labels_that_fit_neither_form_are_one_error_naming_both_shapes():
    logits = jnp.zeros((32, 10))
    with pytest.raises(ValueError, match=r"labels of shape \(31,\).*logits of shape \(32, 10\)"):
        ex.losses.softmax_cross_entropy(logits, jnp.zeros((31,), jnp.int32))
    with pytest.raises(ValueError, match=r"integer class ids of shape \(32,\)"):
        ex.losses.softmax_cross_entropy(logits, jnp.zeros((32,), jnp.float32))
    with pytest.raises(ValueError, match="look one-hot"):
        ex.metrics.accuracy(jnp.eye(10)[:4], logits[:4])
    with pytest.raises(TypeError, match=r"metric_fn returned a list"):
        ex.metrics.from_spec((lambda a: [a], [1]))


def _three_class_model_fn(features, labels, mode, params):
    logits = _Linear()(features)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.1),
        predictions=logits,
    )


def test_labels_outside_the_class_range_stop_training_with_one_line(tmp_path):
    from estimax.estimator.label_check import InvalidLabelError

    x, y = _data()
    y1 = y + 1  # the converters' 1-based labels, fed to 3 logits: label 3 is out of range
    config = ex.RunConfig(model_dir=str(tmp_path / "run"), iterations_per_loop=4)
    est = ex.Estimator(_three_class_model_fn, config, train_batch_size=8)
    with pytest.raises(InvalidLabelError) as raised:
        est.train(ex.numpy_input_fn(x, y1, shuffle=False), max_steps=8)
    message = str(raised.value)
    assert "\n" not in message
    assert "label value 3 is outside the valid range [0, 3) at step 1" in message
    assert "subtract 1" in message and "allow_invalid_labels" in message
    assert est.get_global_step() == 0  # nothing from the bad loop was saved

    # Opting out trains on, counting them in TensorBoard.
    allowed = ex.Estimator(
        _three_class_model_fn,
        ex.RunConfig(
            model_dir=str(tmp_path / "allowed"), iterations_per_loop=4, allow_invalid_labels=True
        ),
        train_batch_size=8,
    )
    allowed.train(ex.numpy_input_fn(x, y1, shuffle=False), max_steps=8)
    assert allowed.get_global_step() == 8
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tmp_path / "allowed"))
    acc.Reload()
    counted = acc.Scalars("train/invalid_labels")
    fed = np.concatenate([y1, y1[:24]])  # 8 steps of 8 in order: one pass of 40, then 24 more
    assert (counted[-1].step, counted[-1].value) == (8, (fed == 3).sum())


def test_valid_labels_train_and_eval_as_before(tmp_path):
    x, y = _data()
    est = ex.Estimator(
        _three_class_model_fn,
        ex.RunConfig(model_dir=str(tmp_path / "run"), iterations_per_loop=4),
        train_batch_size=8,
    )
    est.train(ex.numpy_input_fn(x, y, shuffle=False), max_steps=8)
    assert est.get_global_step() == 8


def test_features_and_labels_of_different_batch_sizes_name_both_shapes(tmp_path):
    est = ex.Estimator(
        _three_class_model_fn, ex.RunConfig(model_dir=str(tmp_path)), train_batch_size=8
    )

    def input_fn(params):
        yield np.zeros((8, 4), np.float32), np.zeros((7,), np.int32)

    with pytest.raises(ValueError, match=r"features \(8, 4\), labels \(7,\)") as raised:
        est.train(input_fn, max_steps=1)
    assert "\n" not in str(raised.value)


def test_a_training_input_shorter_than_a_batch_says_why(tmp_path):
    est = ex.Estimator(
        _three_class_model_fn, ex.RunConfig(model_dir=str(tmp_path)), train_batch_size=16
    )

    def one_short_epoch(params):  # as a 1-epoch loader of 3 examples with drop_remainder
        yield from ()

    with pytest.raises(ValueError, match=r"before a whole batch of 16 examples.*num_epochs=None"):
        est.train(one_short_epoch, max_steps=1)


def test_an_endless_eval_input_is_reported(tmp_path, caplog):
    import logging

    x, y = _data()
    est = ex.Estimator(
        _three_class_model_fn,
        ex.RunConfig(model_dir=str(tmp_path)),
        train_batch_size=8,
        eval_batch_size=8,
        clock=iter(range(0, 10**6, 60)).__next__,  # each reading of the clock: a minute later
    )
    est.train(ex.numpy_input_fn(x, y), max_steps=1)
    endless = ex.numpy_input_fn(x, y, num_epochs=None)  # a training input, by mistake
    with caplog.at_level(logging.WARNING):
        results = est.evaluate(endless, steps=30)  # bounded by steps: no warning
    assert results["num_examples"] == 240
    assert "has not ended" not in caplog.text
    from estimax.estimator import feeding

    clock = iter(range(0, 10**6, 60)).__next__
    watch = feeding.EndlessEvalInput(None, clock)
    for batch in range(1, 20):
        watch.check(batch, batch * 8)
    assert watch.warned  # more than 600 s of clock without an end
    counted = feeding.EndlessEvalInput(5, lambda: 0.0)
    with caplog.at_level(logging.WARNING):
        for batch in range(1, 8):
            counted.check(batch, batch * 8)
    assert "more than its len() of 5" in caplog.text


class _Records:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return bytes([i])

    def describe(self, i):
        return f"record #{i}"


def _ragged_at(k):
    def transform(record, rng):
        i = record[0]
        return np.zeros((4 + (i == k), 4, 3), np.uint8), np.int32(i)

    return transform


@pytest.mark.parametrize("k, where", [(2, "example 2 of the first batch"), (6, "record #6")])
def test_ragged_images_name_the_example_and_the_shapes(k, where):
    loader = estimax_data.Loader(
        _Records(), _ragged_at(k), 4, shuffle=False, num_epochs=1, num_workers=1
    )
    with pytest.raises(ValueError, match=rf"{where}: the transform gave \[\(\(5, 4, 3\)") as e:
        list(loader)
    assert "after [((4, 4, 3)" in str(e.value) and "resize or crop" in str(e.value)


def test_a_scalar_that_is_not_one_number_is_an_error_naming_its_key(tmp_path):
    def model_fn(features, labels, mode, params):
        logits = _Linear()(features)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            scalars={"lr": jnp.float32(0.1), "labels": labels},  # a label vector, by mistake
        )

    x, y = _data()
    est = ex.Estimator(model_fn, ex.RunConfig(model_dir=str(tmp_path)), train_batch_size=16)
    with pytest.raises(ValueError, match=r"scalars=\{'labels': \.\.\.\}\) has shape \(\d+,\)"):
        est.train(ex.numpy_input_fn(x, y), max_steps=1)
