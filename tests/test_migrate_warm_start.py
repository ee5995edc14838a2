"""Warm starts (Estimator(warm_start_from=...)) from TensorFlow and estimax checkpoints."""

import logging
import os

import jax
import numpy as np
import optax
import pytest

import estimax as ex
from estimax import migrate
from estimax.models import ResNetTiny
from estimax.state import warm_start

DATA = os.path.join(os.path.dirname(__file__), "data", "tf_checkpoints")
TF_RESNET = os.path.join(DATA, "resnet_tiny")


def _model_fn(num_classes):
    def model_fn(features, labels, mode, params):
        logits = ResNetTiny(num_classes=num_classes)(features, train=mode == ex.ModeKeys.TRAIN)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            # A zero rate: the weights after a step are the warm-started ones (batch statistics
            # still move, as in any training step).
            optimizer=optax.sgd(0.0),
            predictions={"logits": logits},
        )

    return model_fn


def _input_fn(params):
    rng = np.random.default_rng(0)
    while True:
        yield (
            rng.normal(size=(params["batch_size"], 32, 32, 3)).astype(np.float32),
            rng.integers(0, 3, params["batch_size"]).astype(np.int32),
        )


def _estimator(model_dir, num_classes, warm_start_from):
    return ex.Estimator(
        _model_fn(num_classes),
        ex.RunConfig(model_dir=str(model_dir), num_shards=1, save_checkpoints_steps=1),
        train_batch_size=2,
        warm_start_from=warm_start_from,
    )


def test_warm_start_from_tensorflow_with_a_new_head(tmp_path, caplog):
    reader = migrate.CheckpointReader(TF_RESNET)
    # A path alone warms every variable, the batch statistics too (tf.estimator's Estimator).
    est = _estimator(tmp_path / "a", 3, TF_RESNET)
    with caplog.at_level(logging.INFO):
        est.train(_input_fn, max_steps=1)
    params = est.get_variables()["params"]["ResNet_0"]
    np.testing.assert_array_equal(
        params["initial_conv"]["kernel"], reader.get_tensor("conv2d/kernel")
    )
    np.testing.assert_array_equal(
        params["block_group2"]["block0"]["bn2"]["scale"],
        reader.get_tensor("batch_normalization_6/gamma"),
    )
    assert params["final_dense"]["kernel"].shape == (16, 3)  # fresh, not TF's [16, 10]
    assert est.get_global_step() == 1  # the step starts at 0, not TF's 3
    text = caplog.text
    assert "35 variables loaded, 2 initialised fresh" in text
    assert (
        "initialised fresh (other shape or dtype): ResNet_0/final_dense/bias [3] float32 <- "
        "dense/bias [10] float32, ResNet_0/final_dense/kernel [16, 3] float32 <- dense/kernel "
        "[16, 10] float32"
    ) in text
    est.close()

    # A model_dir with a checkpoint of its own resumes from it: the warm start is not used
    # (a source that does not exist would fail if it were).
    again = _estimator(tmp_path / "a", 3, str(tmp_path / "nothing-here"))
    again.train(_input_fn, max_steps=2)
    assert again.get_global_step() == 2
    again.close()


def _resnet_variables(num_classes=10):
    model = ResNetTiny(num_classes=num_classes)
    variables = model.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3), np.float32), train=False)
    return jax.tree.map(np.asarray, dict(variables))


def test_warm_start_settings_take_the_trainable_variables_unless_given_a_list():
    reader = migrate.CheckpointReader(TF_RESNET)
    variables = _resnet_variables()
    loaded, report = warm_start.warm_start_variables(ex.WarmStartSettings(TF_RESNET), variables)
    np.testing.assert_array_equal(
        loaded["params"]["initial_conv"]["kernel"], reader.get_tensor("conv2d/kernel")
    )
    # A string: tf.estimator's TRAINABLE_VARIABLES; the statistics stay as initialised.
    np.testing.assert_array_equal(
        loaded["batch_stats"]["initial_bn"]["mean"], variables["batch_stats"]["initial_bn"]["mean"]
    )
    assert "initial_bn/mean" in report.fresh and "initial_bn/scale" in report.loaded
    # A list: tf.estimator's GLOBAL_VARIABLES, statistics included.
    settings = ex.WarmStartSettings(TF_RESNET, [".*initial_bn.*"])
    loaded, report = warm_start.warm_start_variables(settings, variables)
    np.testing.assert_array_equal(
        loaded["batch_stats"]["initial_bn"]["mean"],
        reader.get_tensor("batch_normalization/moving_mean"),
    )
    assert report.loaded == [f"initial_bn/{n}" for n in ("bias", "mean", "scale", "var")]
    assert report.sources["initial_bn/mean"] == "batch_normalization/moving_mean"
    # An expression may name the original's TensorFlow names too.
    _, report = warm_start.warm_start_variables(
        ex.WarmStartSettings(TF_RESNET, "dense/.*"), variables
    )
    assert report.loaded == ["final_dense/bias", "final_dense/kernel"]


def test_warm_start_from_an_estimax_model_dir_and_only_some_variables(tmp_path):
    first = _estimator(tmp_path / "first", 3, TF_RESNET)
    first.train(_input_fn, max_steps=1)
    source = first.get_variables()["params"]["ResNet_0"]
    first.close()
    est = _estimator(
        tmp_path / "second",
        5,
        ex.WarmStartSettings(str(tmp_path / "first"), vars_to_warm_start=".*initial_conv.*"),
    )
    est.train(_input_fn, max_steps=1)
    params = est.get_variables()["params"]["ResNet_0"]
    np.testing.assert_array_equal(
        params["initial_conv"]["kernel"], source["initial_conv"]["kernel"]
    )
    reader = migrate.CheckpointReader(TF_RESNET)
    assert not np.array_equal(
        params["block_group1"]["block0"]["conv1"]["kernel"], reader.get_tensor("conv2d_2/kernel")
    )
    est.close()


def test_warm_start_from_nothing_is_one_clear_error(tmp_path):
    est = _estimator(tmp_path / "m", 3, str(tmp_path / "missing"))
    with pytest.raises(migrate.TFCheckpointError, match="neither a TensorFlow checkpoint"):
        est.train(_input_fn, max_steps=1)
    est.close()
